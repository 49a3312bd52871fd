"""Imports run one way, down the data flow, and the folders say which way.

Each folder (a package) is one step of the data flow. A module may import anything of its own
folder; across folders, it may import only from folders earlier in the flow. The order is the
README's layout table, read here, so the documentation and the code cannot drift apart, and
no list of modules is kept by hand: a new module is placed by the folder it is put in.

Leaves are exempt: a module that imports nothing of vlmprune (compiler/errors.py, contract.py,
a kernel build helper) depends on no step, so every step may import it.

Entry points are exempt the other way: a package's __main__.py (the console script, `python -m`) is
imported by no module, so it stands above every step and may import any, the CLI included.

Inside a folder too, imports run one way: no circles. A registry package's __init__
imports its components; a component imports only modules below it (base, a shared helpers
module, the contract), never the package __init__ or a sibling that imports it back.
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


ENTRY_POINTS = {m for m, p in MODULES.items() if p.name == "__main__.py"}


def _crossings():
    for module, path in MODULES.items():
        if path.name in STANDALONE or module in ENTRY_POINTS:
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


FRONTEND = "vlmprune.compiler.frontend"
# Below the frontend in what they know, though after it in the flow: the passes and the methods see a graph and the
# contract's vocabulary, the targets a graph, an emit context and the feeds their caller built.
MODEL_BLIND = ("passes", "targets")


def _frontend_imports():
    for module, path in MODULES.items():
        if path.relative_to(REPO).parts[0] in MODEL_BLIND:
            for line, imported in _imports(path):
                if imported == FRONTEND or imported.startswith(FRONTEND + "."):
                    yield f"{path.relative_to(REPO)}:{line} imports {imported}"


def test_passes_and_targets_import_no_frontend_module():
    """The flow allows it (the frontend is its first step), the design does not: a method reads the shared vocabulary
    (capabilities, site names, SiteTensors, crop budgets) from compiler.contract, a target gets what it needs of the
    model from the pipeline (EmitContext: the preprocessing, the calibration images, their ROI) and a runner its
    inputs beside the pixels as feeds from its caller. Function-local imports count: they are the same dependency."""
    found = list(_frontend_imports())
    assert not found, ("passes/ and targets/ import nothing of vlmprune.compiler.frontend: move a shared name into "
                       "compiler/contract.py, or have the pipeline hand it down (EmitContext, a runner's feeds):\n"
                       + "\n".join(found))


def test_the_frontend_check_sees_function_local_imports(tmp_path):
    """_imports walks the whole module: an import inside a function is found as one at the top is."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from vlmprune.compiler.frontend import images\n"
                      "    import vlmprune.compiler.frontend.roi_input\n")
    assert [i for _, i in _imports(module)] == [FRONTEND, f"{FRONTEND}.images", f"{FRONTEND}.roi_input"]


def test_entry_points_are_imported_by_no_module():
    """What lets a __main__.py import a later step: nothing imports it, so no step depends on it (a test may)."""
    assert ENTRY_POINTS == {"vlmprune.compiler.__main__", "vlmprune.compiler.cli.__main__"}
    found = [f"{MODULES[m].relative_to(REPO)}:{line} imports {i}" for m in MODULES
             for line, i in _imports(MODULES[m]) if i in ENTRY_POINTS]
    assert not found, found


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


# ---------------------------------------------------------------------------- no circles


def _graph() -> dict[str, set[str]]:
    """module -> the vlmprune modules it imports, a function's own imports included (_imports walks the whole
    module: an import moved into a function to dodge a circle at import time is still the same circle, and fails
    later, at the call). A package's __init__ naming its own submodules (`from pkg import mod` inside pkg) is no
    edge to itself."""
    return {module: {i for _, i in _imports(path) if i in MODULES and i != module} for module, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of graph: its strongly connected components of two or more modules (Tarjan's algorithm,
    iterative so that a deep chain of imports does not meet Python's recursion limit), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_the_circle_finder_finds_a_circle():
    """A hand-made graph: three modules importing each other round (a registry, a method that imports the registry
    back, its helper) are one circle; a module that only imports into it, and a graph without one, are none."""
    circle = {"pkg": {"pkg.method"}, "pkg.method": {"pkg.helper"}, "pkg.helper": {"pkg"}, "user": {"pkg"}}
    assert _circles(circle) == [["pkg", "pkg.helper", "pkg.method"]]
    assert _circles({"pkg": {"pkg.method"}, "pkg.method": {"pkg.helper"}, "pkg.helper": set()}) == []


def test_no_import_circles():
    """Imports run one way inside a folder too: a circle has no lower end, so no module of it can be read (or
    replaced, or tested) without the others, and which of them runs first depends on who imported first. Break one
    by moving what the lower module needs below it (a shared helpers module, base, the contract) and re-exporting it
    where it was imported from, never by an import inside a function."""
    graph = _graph()
    lines = []
    for circle in _circles(graph):
        lines.append("circle: " + ", ".join(circle))
        for module in circle:
            for line, imported in sorted(set(_imports(MODULES[module]))):
                if imported in circle and imported != module:
                    lines.append(f"  {MODULES[module].relative_to(REPO)}:{line} imports {imported}")
    assert not lines, "imports that go round in a circle:\n" + "\n".join(lines)
