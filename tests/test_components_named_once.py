"""Components declare, the pipeline asks: nothing names a component outside its own module.

Every registered target id, method id, family id and LLM exporter id is searched for as a whole string constant
(ast) in the library's source (compiler/, passes/, targets/). It may appear in its own module and in its registry;
anywhere else the pipeline should ask the component for a declaration instead of naming it (a method's crop form, a
family's whole-checkpoint language model or chat prompt, the registries' defaults). ALLOWED lists, with a reason
each, the places still naming one: user-facing text, and scripts that run outside vlmprune; DECLARATIONS, the
declarations whose values are ids by design (a target's LLM exporters).
"""

from __future__ import annotations

import ast
from pathlib import Path

from vlmprune.compiler.frontend import FAMILIES
from vlmprune.compiler.llm.export import EXPORTERS
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
# package); the exporter "torch" (the frontend's framework, the package).
AMBIGUOUS = {"cls", "grid", "random", "llava", "clip", "dinov2", "onnx", "torch"}


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
    for name, exporter in EXPORTERS.items():
        owners.setdefault(name, set()).add(_module_file(exporter))
    return {name: files for name, files in owners.items() if name not in AMBIGUOUS}


# Declarations whose value is other components' ids by design, with why: the scan does not count them.
DECLARATIONS = {
    "llm_exporters": "a target declares the LLM exporters it takes by id (Target.llm_exporters): the exporter table "
                     "(compiler.llm.export) imports the targets, so a target cannot import an exporter class, and "
                     "the ids are the join the table reads",
}


def _constants(source: str, filename: str = "<source>"):
    """(line, value) of every string constant, except those inside a class-level DECLARATIONS assignment."""
    tree = ast.parse(source, filename)
    declared = {id(c) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for stmt in node.body
                if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                and any(isinstance(t, ast.Name) and t.id in DECLARATIONS
                        for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]))
                for c in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in declared:
            yield node.lineno, node.value


def test_a_declaration_is_not_counted_and_anything_else_is():
    source = ('class T:\n    llm_exporters = ("genai", "edgellm")\n    other = ("genai",)\n'
              'x = "edgellm"\nllm_exporters = ("genai",)\n')
    assert sorted(_constants(source)) == [(3, "genai"), (4, "edgellm"), (5, "genai")]


def test_no_component_named_outside_its_module():
    owners = _components()
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in REGISTRIES:
                continue
            for line, value in _constants(path.read_text(), str(path)):
                if value in owners and rel not in owners[value] and (rel, value) not in ALLOWED:
                    found.append(f"{rel}:{line} names {value!r}")
    assert not found, "components named outside their own module:\n" + "\n".join(found)


def test_every_registered_component_is_scanned():
    """The scan covers the registries as they are: a new method, family, target or exporter is scanned without
    editing this test, and only the ids listed as ambiguous are left out."""
    owners = _components()
    for ids in (METHODS, TARGETS, {f.id for f in FAMILIES}, EXPORTERS):
        assert set(ids) - AMBIGUOUS <= set(owners)
    assert {"divprune", "dart", "visionzip", "holov", "prumerge+", "qwen2_vl", "llava_next", "genai",
            "edgellm"} <= set(owners)
