"""vlmprune.passes.methods: one module per pruning method, behind passes.methods.base.Method.

The table below is the whole list: methods are named explicitly, never discovered.
Adding a method is one module (a Method subclass) plus its tests, and one line here.
"""

from __future__ import annotations

from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import Method
from vlmprune.passes.methods.cls import ClsMethod
from vlmprune.passes.methods.dart import DartMethod
from vlmprune.passes.methods.divprune import DivPruneMethod
from vlmprune.passes.methods.grid import GridMethod
from vlmprune.passes.methods.random_keep import RandomKeepMethod
from vlmprune.passes.methods.visionzip import VisionZipMethod

METHODS: dict[str, type[Method]] = {m.name: m for m in (ClsMethod, VisionZipMethod, DivPruneMethod, DartMethod,
                                                   RandomKeepMethod, GridMethod)}
DEFAULT = "cls"


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]()
