"""Fixtures of the kernel tests: the built custom-op library and its C functions."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernel_helpers import CpuKernels

from vlmprune.kernels import build


@pytest.fixture(scope="session")
def ort_library() -> Path:
    try:
        return build.build_ort_library()
    except build.ToolNotFoundError as exc:  # a missing compiler is an environment gap, not a bug
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cpu(ort_library) -> CpuKernels:
    return CpuKernels(ort_library)
