"""tools/gpu_kernel_check.py's --sanitize plumbing, without a GPU: a stand-in compute-sanitizer.

The kernels themselves only run on a GPU; what is checked here is that every tool is run over
the correctness cases (--no-timing) and that a reported error, or a missing sanitizer, fails.
"""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("gpu_kernel_check", REPO / "tools" / "gpu_kernel_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_sanitizer(folder: Path, errors_for: str = "") -> Path:
    """A compute-sanitizer that logs its arguments and reports errors for one tool."""
    script = folder / "compute-sanitizer"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> "{folder}/calls.log"\n'
        f'if [ "$2" = "{errors_for}" ]; then echo "========= ERROR SUMMARY: 2 errors" >&2; exit 3; fi\n'
        'echo "========= ERROR SUMMARY: 0 errors" >&2\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_every_tool_runs_the_correctness_cases(tool, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    _fake_sanitizer(tmp_path)
    results = tool.run_sanitizers(Path("/bin/true"))
    assert set(results) == {"memcheck", "racecheck", "synccheck"}
    assert all(r["ok"] for r in results.values())
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 3 and all(c.endswith("/bin/true --no-timing") for c in calls)


def test_a_reported_error_fails(tool, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    _fake_sanitizer(tmp_path, errors_for="racecheck")
    results = tool.run_sanitizers(Path("/bin/true"))
    assert results["memcheck"]["ok"] and results["synccheck"]["ok"]
    assert not results["racecheck"]["ok"] and "2 errors" in results["racecheck"]["errors"]


def test_no_sanitizer_is_a_failure_not_a_pass(tool, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(tool, "find_sanitizer", lambda: None)
    assert not any(r["ok"] for r in tool.run_sanitizers(Path("/bin/true")).values())


def test_sanitize_takes_a_subset_and_refuses_unknown_tools(tool, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--sanitize", "memcheck,leakcheck"])
    assert exc.value.code == 2 and "unknown sanitizer tool(s) leakcheck" in capsys.readouterr().err
