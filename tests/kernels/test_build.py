"""vlmprune.kernels.build: cached, atomic builds and one-line errors."""

from __future__ import annotations

import pytest

from vlmprune.kernels import build


@pytest.fixture
def private_cache(tmp_path, monkeypatch, ort_library):
    # Reuse the headers the session fixture already fetched: no npm in this test.
    monkeypatch.setenv("VLMPRUNE_ORT_INCLUDE", str(build.ort_headers_dir()))
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_library_is_built_once_into_the_cache(private_cache):
    first = build.build_ort_library()
    assert first.is_file() and private_cache in first.parents
    stamp = first.stat().st_mtime_ns
    assert build.build_ort_library() == first
    assert first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    leftovers = [p.name for p in first.parent.parent.iterdir() if p.name.startswith(".build-")]
    assert leftovers == []  # the temporary build folder was renamed into place


def test_missing_compiler_is_a_one_line_error(private_cache, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.ToolNotFoundError) as info:
        build.build_ort_library()
    assert "\n" not in str(info.value) and "set CXX" in str(info.value)


def test_header_override_must_hold_the_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPRUNE_ORT_INCLUDE", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="has no onnxruntime_cxx_api.h"):
        build.ort_headers_dir()


def test_sources_are_found_inside_the_package():
    names = [p.name for p in build.library_sources()]
    assert names == ["divprune.cc", "token_prune.cc", "vlmprune_ort_ops.cc"]  # all in the build key
    assert (build.CUDA_DIR / build.CUDA_LIBRARY_SOURCE).is_file()
