"""Imports run one way, down the data flow, and the folders say which way.

Each folder (a package) is one step of the data flow. A module may import anything of its own
folder; across folders, it may import only from folders earlier in the flow. The order is the
README's layout table, read here, so the documentation and the code cannot drift apart, and
no list of modules is kept by hand: a new module is placed by the folder it is put in.

Leaves are exempt: a module that imports nothing of vlmprune (compiler/errors.py, contract.py,
a kernel build helper) depends on no step, so every step may import it.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"compiler": "vlmprune.compiler", "passes": "vlmprune.passes", "targets": "vlmprune.targets",
         "kernels": "vlmprune.kernels"}
STANDALONE = {"rknn_worker.py"}  # runs in the rknn venv: imports nothing of vlmprune


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(path: Path):
    """(line, module) of every vlmprune module path imports, `from pkg import module` included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmprune"):
            yield node.lineno, node.module
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vlmprune"):
                    yield node.lineno, alias.name


LEAVES = {m for m, p in MODULES.items() if not any(i in MODULES for _, i in _imports(p))}


def _folder(module: str) -> str:
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _flow() -> list[str]:
    """The packages of the README's layout table, in its order (the data flow)."""
    text = (REPO / "README.md").read_text().split("## Layout", 1)[1]
    return [m.group(1) for m in re.finditer(r"^\| `[^`]+` \| `(vlmprune\.[\w.]+)` \|", text, re.M)]


FLOW = _flow()


def test_every_folder_has_its_row_in_the_layout_table():
    folders = {_folder(m) for m in MODULES}
    assert sorted(folders - set(FLOW)) == [] and sorted(set(FLOW) - folders) == []


def _crossings():
    for module, path in MODULES.items():
        if path.name in STANDALONE:
            continue
        for line, imported in _imports(path):
            if imported not in MODULES or imported in LEAVES:
                continue
            own, theirs = _folder(module), _folder(imported)
            if own != theirs:  # compiler/ holds the top (API, CLI): the flow rules, not the nesting
                yield pytest.param(path, line, own, theirs, imported, id=f"{module}->{imported}")


@pytest.mark.parametrize("path,line,own,theirs,imported", list(_crossings()))
def test_imports_run_down_the_data_flow(path, line, own, theirs, imported):
    assert FLOW.index(theirs) < FLOW.index(own), (
        f"{path.relative_to(REPO)}:{line} ({own}) imports {imported} ({theirs}), a later step of the data "
        f"flow ({' -> '.join(FLOW)})")


def test_standalone_scripts_import_nothing_of_vlmprune():
    for name in STANDALONE:
        path = next(p for p in MODULES.values() if p.name == name)
        assert not list(_imports(path)), path


def test_errors_and_contract_are_leaves():
    assert {"vlmprune.compiler.errors", "vlmprune.compiler.contract"} <= LEAVES


def test_every_package_is_installed():
    """setuptools installs only the packages pyproject lists: a folder left out works editable and is missing
    from a wheel. A top folder is a package through package-dir even without an __init__.py (kernels/ has none,
    so that a Python started in the checkout's root does not take it for PyPI's `kernels`)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"} | set(ROOTS.values())
    assert sorted(packages - listed) == [] and sorted(listed - packages) == []
