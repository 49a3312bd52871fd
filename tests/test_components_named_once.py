"""Issue 33 §1: nothing names a component outside its own module.

Every registered target id, method id and family id is searched for as a whole string constant (ast) in the
library's source (compiler/, passes/, targets/). It may appear in its own module and in its registry; anywhere
else the pipeline should ask the component for a declaration instead of naming it (a method's crop form, a
family's whole-checkpoint language model, the registries' defaults). ALLOWED lists, with a reason each, the places
still naming one: user-facing text, and scripts that run outside vlmprune.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vlmprune.compiler.frontend import FAMILIES
from vlmprune.passes.methods import METHODS
from vlmprune.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("compiler", "passes", "targets")
REGISTRIES = {"passes/methods/__init__.py", "targets/__init__.py", "compiler/llm/export.py",
              "compiler/frontend/__init__.py"}

# (file, name) -> why it may still name the component there.
ALLOWED: dict[tuple[str, str], str] = {
    ("targets/trt_engine.py", "orin"): "the TensorRT targets' on-device script, which imports nothing of vlmprune",
    ("targets/trt_engine.py", "xavier"): "the TensorRT targets' on-device script, which imports nothing of vlmprune",
    ("targets/rknn_worker.py", "rk3588"): "rk3588's own worker process (run in rknn-toolkit2's venv), part of it",
}
# Ids that are also ordinary words of the code, which a string scan cannot tell apart from the component: the
# methods "cls", "grid", "random" ([CLS] token flags and options, patch grids, random seeds); the families "llava",
# "clip", "dinov2" (Hugging Face model_type values, which adapters match on) and "onnx" (the file format, the
# package). Exporter ids are not scanned: "torch" is the frontend's framework too.
AMBIGUOUS = {"cls", "grid", "random", "llava", "clip", "dinov2", "onnx"}


def _module_file(cls) -> str:
    """vlmprune.passes.methods.cls -> passes/methods/cls.py (the checkout's layout under the package)."""
    return "/".join(cls.__module__.split(".")[1:]) + ".py"


def _components() -> dict[str, set[str]]:
    """name -> the files that own it (the component's module; the registries are skipped as a whole)."""
    owners: dict[str, set[str]] = {}
    for name, target in TARGETS.items():
        owners.setdefault(name, set()).add(_module_file(target))
    for name, method in METHODS.items():
        owners.setdefault(name, set()).add(_module_file(method))
    for family in FAMILIES:
        owners.setdefault(family.id, set()).add(_module_file(type(family)))
    return {name: files for name, files in owners.items() if name not in AMBIGUOUS}


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


def test_every_registered_method_and_family_is_scanned():
    """The scan covers the registries as they are: a new method or family is scanned without editing this test,
    and only the ids listed as ambiguous are left out."""
    owners = _components()
    assert set(METHODS) - AMBIGUOUS <= set(owners) and {f.id for f in FAMILIES} - AMBIGUOUS <= set(owners)
    assert {"divprune", "dart", "visionzip", "holov", "prumerge+", "qwen2_vl", "llava_next"} <= set(owners)
