"""Imports run one way, down the data flow; the folders read like it.

    frontend -> methods -> passes -> fusion -> targets -> parity -> bundle -> pipeline / CLI

compiler/errors.py is the one leaf every layer may import (it imports nothing of vlmprune),
and kernels/ is a leaf beside it (C++ sources and their build). A module may import only from
its own layer or the layers before it; importing from a later layer fails this test with the
offending line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"compiler": "vlmprune.compiler", "passes": "vlmprune.passes", "targets": "vlmprune.targets",
           "kernels": "vlmprune.kernels"}
# Module prefix -> layer, most specific prefix first.
LAYERS = [
    ("vlmprune.compiler.errors", 0),
    ("vlmprune.kernels", 0),
    ("vlmprune.compiler.frontend", 1),
    ("vlmprune.passes.dataflow", 2),
    ("vlmprune.passes.structure", 2),
    ("vlmprune.passes.methods", 3),
    ("vlmprune.passes.fusion", 5),
    ("vlmprune.passes", 4),
    ("vlmprune.targets", 6),
    ("vlmprune.compiler.reference", 7),
    ("vlmprune.compiler.parity", 7),
    ("vlmprune.compiler.bundle", 8),
    ("vlmprune.compiler", 9),
]


def _layer(module: str) -> int:
    return next(layer for prefix, layer in LAYERS if module == prefix or module.startswith(prefix + "."))


def _modules():
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield path, ".".join([package, *parts])


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmprune"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vlmprune"):
                    yield node.lineno, alias.name


@pytest.mark.parametrize("path,module", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_run_down_the_data_flow(path, module):
    if path.name == "rknn_worker.py":  # runs in the rknn venv: imports nothing of vlmprune
        assert not list(_imports(path))
        return
    own = _layer(module)
    for line, imported in _imports(path):
        assert _layer(imported) <= own, f"{path.relative_to(REPO)}:{line} ({module}, layer {own}) imports " \
                                        f"{imported} (layer {_layer(imported)}): against the data flow"


def test_errors_is_a_leaf():
    assert not list(_imports(REPO / "compiler" / "errors.py"))
