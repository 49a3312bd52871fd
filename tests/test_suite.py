"""The suite's own promises: compiled bundles shared per options, the markers applied, the README's command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_a_compile_is_made_once_per_model_and_options(compiled, tiny_llava_dir):
    first = compiled(tiny_llava_dir, keep=16)
    assert compiled(tiny_llava_dir, keep=16) is first
    other = compiled(tiny_llava_dir, method="visionzip", keep=16, method_options={"contextual": 4})
    assert other.bundle != first.bundle and other.manifest["method"]["name"] == "visionzip"


def test_another_worker_loads_the_compile_a_first_one_made(compiled, tiny_llava_dir, tmp_path):
    """Under pytest-xdist each worker makes its own checkpoints (same seed, another folder) and its own results;
    the run's shared folder gives the second the first's bundle, and a checkpoint that differs is compiled anew."""
    import shutil

    first = compiled(tiny_llava_dir, keep=16)
    compile_shared, root = compiled.shared, compiled.root
    assert first.bundle.parents[1] == root
    copy = shutil.copytree(tiny_llava_dir, tmp_path / "their_tiny_llava")
    theirs = compile_shared(root, {}, copy, {"keep": 16})  # a fresh process: nothing made yet
    assert theirs is not first and theirs.bundle == first.bundle and theirs.manifest == first.manifest
    assert theirs.report.to_json() == first.report.to_json()
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")  # one byte more, same model
    changed = compile_shared(root, {}, copy, {"keep": 16})
    assert changed.bundle != first.bundle and changed.report.passed


def test_toolchain_tests_are_marked_and_only_they():
    """-m 'not toolchain' must leave out exactly the tests that ask for a pinned toolchain (here: QNN, rknn)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "toolchain", "tests/compiler/test_methods.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    picked = {line.split("::")[1] for line in done.stdout.splitlines() if "::" in line}
    assert picked == {f"test_{t}[{m}]" for t in ("qnn", "rk3588") for m in ("visionzip", "dart", "divprune", "holov")}


def test_the_readme_test_command_lists_the_slowest_tests():
    """.ci/run runs the README's second command verbatim: found by its own pattern, it asks for the durations."""
    pattern = re.search(r"grep -m1 -E '([^']+)' README.md", (ROOT / ".ci" / "run").read_text())[1]
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if re.search(pattern, line))
    assert line.endswith("&& python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=25")


def test_one_python_floor_the_suite_runs_on():
    """The suite reads pyproject.toml with tomllib, new in Python 3.11: pyproject's floor and the README's are 3.11."""
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"] == ">=3.11"
    assert "On a fresh machine (Python 3.11+" in (ROOT / "README.md").read_text()


def test_the_readme_command_line_lists_every_method():
    """README's "What it does" line listed 6 of the 9 methods."""
    import re
    from pathlib import Path

    from vlmprune.passes.methods import METHODS

    text = (Path(__file__).parents[1] / "README.md").read_text()
    listed = re.search(r"--method \{([^}]*)\}", text).group(1).split(",")
    assert sorted(listed) == sorted(METHODS)


def _bullet_heads(text: str) -> set[str]:
    """The backticked names that open each bullet of the README's Methods list (before the bullet's first colon)."""
    section = text[text.index("2. **Methods**"):text.index("3. **Passes**")]
    heads = (line.strip()[2:].split(":")[0] for line in section.splitlines() if line.strip().startswith("- "))
    return {name for head in heads for name in re.findall(r"`([^`]+)`", head)}


def _row_heads(text: str, header: str) -> set[str]:
    """The backticked names that open each row of the README table under `header` (before the first cell's "(")."""
    rows = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0].split("(")[0])}


def test_the_readme_describes_every_registered_method():
    """Each method in the registry has its bullet in "What it does", its row in the per-target table and its column
    in the per-family table (they had 9, 10 and 6 of the 12)."""
    from vlmprune.passes.methods import METHODS

    text = (ROOT / "README.md").read_text()
    family_header = text[text.index("| family | `cls`"):].splitlines()[0]
    assert set(METHODS) - _bullet_heads(text) == set()
    assert set(METHODS) - _row_heads(text, "| method | ort |") == set()
    assert set(METHODS) - set(re.findall(r"`([^`]+)`", family_header)) == set()


def test_the_readme_says_what_its_first_command_says_when_run_again(tmp_path, monkeypatch):
    """The README's first command, run twice, stopped with `build already exists` and the README said
    nothing of it. The README quotes the line the second run prints (a bundle at build/ already)."""
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    readme = (ROOT / "README.md").read_text()
    command = re.search(r"&& vlmprune (compile demo [^\n]*-o build/)", readme)[1].split()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "manifest.json").write_text("{}")  # a bundle's marker: the first run's output
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 2, result.output
    line = result.output.strip().removeprefix("error: ")
    assert line == "build already exists (use --force to replace it)", result.output
    assert f"`{line}`" in " ".join(readme.split()) and "add `--force`" in readme


def test_the_readme_states_the_opset_ranges_the_targets_enforce():
    """The README's opsets per target were not those the code held to."""
    from vlmprune.targets import get_target

    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"`--opset` \(what each target declares, refused before any work outside it: ([^`]*)`vlmprune "
                     r"targets` lists them\)", text)[1]
    ranges = {}
    for part in filter(str.strip, said.split(";")):
        names, low, high = re.match(r"\s*([a-z0-9 ]+?) (\d+)–(\d+)", part).groups()
        for name in names.split(" and "):
            ranges[name] = (int(low), int(high))
    assert ranges == {t: get_target(t).opsets for t in ("ort", "qnn", "orin", "xavier", "rk3588")}, said
