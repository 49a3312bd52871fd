"""vlmprune.passes.methods: one module per pruning method, behind passes.methods.base.Method.

The table below is the whole list: methods are named explicitly, never discovered.
Adding a method is one module (a Method subclass), its tests, one line here, and its
README entries (tests/test_suite.py holds the README to this table). What the shared
code needs of a method it reads from the method's declarations (its crop form for
LLaVA-NeXT's crops, whether it is a baseline or the paired one of accuracy tables).
"""

from __future__ import annotations

from vlmprune.compiler.contract import MethodSection
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import Method
from vlmprune.passes.methods.cdpruner import CDPrunerMethod
from vlmprune.passes.methods.cls import ClsMethod
from vlmprune.passes.methods.dart import DartMethod
from vlmprune.passes.methods.dense import Dense
from vlmprune.passes.methods.dycoke import DyCokeMethod
from vlmprune.passes.methods.evs import EvsMethod
from vlmprune.passes.methods.evs_encoder import EvsEncoderMethod
from vlmprune.passes.methods.divprune import DivPruneMethod
from vlmprune.passes.methods.grid import GridMethod
from vlmprune.passes.methods.holov import HolovMethod
from vlmprune.passes.methods.prumerge import PruMergePlusMethod
from vlmprune.passes.methods.random_keep import RandomKeepMethod
from vlmprune.passes.methods.tome import ToMeMethod
from vlmprune.passes.methods.visionzip import VisionZipMethod

METHODS: dict[str, type[Method]] = {m.name: m for m in (ClsMethod, VisionZipMethod, DivPruneMethod, DartMethod,
                                                   RandomKeepMethod, GridMethod, PruMergePlusMethod,
                                                   CDPrunerMethod, HolovMethod, ToMeMethod, EvsMethod, EvsEncoderMethod,
                                                   DyCokeMethod)}
DEFAULT_METHOD = "cls"  # `vlmprune compile` and `eval` without --method
# The reference rows of every accuracy table (Method.baseline: random keep, a uniform grid), in the table's order.
BASELINES: tuple[str, ...] = tuple(name for name, method in METHODS.items() if method.baseline)

# Parts of the pruning designs vlmprune started from (its seed designs) that are trained models, not
# training-free rules: their weights exist nowhere here (no checkpoint was published with them, and vlmprune
# downloads nothing), so they are named, to be refused in one line saying so, rather than answered as unknown
# or approximated by an untrained network. The texts are user-facing (`vlmprune methods`, the refusal): they
# say what the part is, not where it was proposed.
NEEDS_TRAINED_WEIGHTS: dict[str, str] = {
    "coarse-heatmap": "the coarse stage of a two-stage pruner (a small MobileNetV3 network that predicts a heat map "
                      "of where to look, before the tower runs) needs that trained heat-map network",
    "query-compressor": "a learned query compressor (trained query tokens that cross-attend to the patch tokens, "
                        "then a projection, in place of selection) needs its trained query tokens and projection",
}


def get_method(name: str) -> Method:
    if name in NEEDS_TRAINED_WEIGHTS:
        raise InputError(f"method {name!r} is not available: {NEEDS_TRAINED_WEIGHTS[name]}, and no such weights "
                         "exist (vlmprune ships only training-free methods; `vlmprune methods` lists them)")
    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]()


def method_of(section: MethodSection) -> Method | Dense:
    """The method object a bundle's manifest records (its method section), Dense for a dense bundle."""
    return get_method(section.name) if section.pruned else Dense()
