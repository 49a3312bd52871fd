"""Issue 33 §1: nothing names a component outside its own module.

Every registered target id is searched for as a whole string constant (ast) in the
library's source (compiler/, passes/, targets/). It may appear in its own module and in its registry; anywhere
else the pipeline should ask the component for a declaration instead of naming it. ALLOWED lists, with a reason
each, the places still naming one: the remaining items of §1 (to be emptied as they move into declarations) and
user-facing text.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vlmprune.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("compiler", "passes", "targets")
REGISTRIES = {"passes/methods/__init__.py", "targets/__init__.py", "compiler/llm/export.py"}

# (file, name) -> why it may still name the component there.
ALLOWED: dict[tuple[str, str], str] = {
    ("compiler/accuracy.py", "ort"): "the default target, still spelled here (issue 33 §1: one DEFAULT_TARGET)",
    ("compiler/api.py", "ort"): "the default target, still spelled here (issue 33 §1: one DEFAULT_TARGET)",
    ("compiler/pipeline/__init__.py", "ort"): "the default target, still spelled here (issue 33 §1: one DEFAULT_TARGET)",
    ("targets/trt_engine.py", "orin"): "the TensorRT targets' on-device script, which imports nothing of vlmprune",
    ("targets/trt_engine.py", "xavier"): "the TensorRT targets' on-device script, which imports nothing of vlmprune",
    ("targets/rknn_worker.py", "rk3588"): "rk3588's own worker process (run in rknn-toolkit2's venv), part of it",
}
# Method and exporter ids are not scanned yet: "cls", "grid", "random" and "torch" are also ordinary keys
# ([CLS] token flags, patch grids, the torch frontend), so a plain string scan needs those told apart first.


def _module_file(cls) -> str:
    """vlmprune.passes.methods.cls -> passes/methods/cls.py (the checkout's layout under the package)."""
    return "/".join(cls.__module__.split(".")[1:]) + ".py"


def _components() -> dict[str, set[str]]:
    """name -> the files that own it (the component's module, and its registry)."""
    owners: dict[str, set[str]] = {}
    for name, target in TARGETS.items():
        owners.setdefault(name, set()).add(_module_file(target))
    return owners


def _constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_component_named_outside_its_module():
    owners = _components()
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in REGISTRIES:
                continue
            for line, value in _constants(path):
                if value in owners and rel not in owners[value] and (rel, value) not in ALLOWED:
                    found.append(f"{rel}:{line} names {value!r}")
    assert not found, "components named outside their own module:\n" + "\n".join(found)
