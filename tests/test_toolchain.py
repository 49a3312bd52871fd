"""tests/toolchain.py: a missing build tool skips a fused-op test on a developer's machine and fails it under CI."""

from __future__ import annotations

import pytest
import toolchain

from vlmprune.kernels import build


@pytest.mark.parametrize("tool", ["CXX", "NPM"])
@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("1", pytest.fail.Exception),
                                         ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_missing_tool_skips_here_and_fails_under_ci(tmp_path, monkeypatch, tool, ci, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv(tool, f"/nonexistent/{tool.lower()}")
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path))  # nothing cached: npm is asked for the headers
    monkeypatch.delenv("VLMPRUNE_ORT_INCLUDE", raising=False)
    # Both outcomes caught, so that a skip where a failure is due fails this test instead of skipping it.
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as info:
        toolchain.ort_library()
    assert info.type is outcome
    assert "not found on PATH" in str(info.value)
    assert ("CI=true" in str(info.value)) == (outcome is pytest.fail.Exception)


def test_only_a_missing_tool_is_forgiven(tmp_path, monkeypatch):
    # A build that fails for another reason is the code's fault: neither skipped nor reworded.
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("VLMPRUNE_ORT_INCLUDE", str(tmp_path))  # no headers there
    with pytest.raises(build.KernelBuildError, match="has no onnxruntime_cxx_api.h"):
        toolchain.ort_library()
