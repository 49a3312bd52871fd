"""A private name stays in its module: no module of the package imports another's `_name` or reads `module._name`.

A leading underscore says "no promise outside this file"; a second module that uses the name makes the
promise anyway, silently (the pipeline's stages once reached other modules as private helpers).
What two modules share gets a public name and a docstring. Tests of a module may still read its private
helpers: they are its own tests. Function-local imports count as any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import MODULES  # the same module map the layering test checks

REPO = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path) -> list[str]:
    """Where path imports a private name of a vlmprune module, or reads one off a vlmprune module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmprune"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    modules.add(alias.asname or alias.name)
                elif _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name.startswith("vlmprune") and a.asname}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [f"{path.relative_to(REPO)}:{use}" for path in MODULES.values() for use in private_uses(path)]
    assert not found, "private names used outside their module (give them a public name):\n" + "\n".join(found)


def test_the_check_sees_both_spellings(tmp_path):
    private = "_line"  # spelled apart, so that a grep of the repository for such imports finds none here
    module = tmp_path / "m.py"
    module.write_text(f"from vlmprune.compiler.pipeline import {private}, compile_model\n"
                      "import vlmprune.compiler.pipeline.auto_keep as auto_keep\n"
                      "def f():\n    from vlmprune.compiler import pictures\n    return pictures._outline, auto_keep.search\n")
    assert private_uses(module) == [f"1: from vlmprune.compiler.pipeline import {private}", "5: pictures._outline"]
