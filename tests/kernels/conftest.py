"""Fixtures of the kernel tests: the custom-op library's C functions (the library itself: tests/conftest.py)."""

from __future__ import annotations

import pytest
from kernel_helpers import CpuKernels


@pytest.fixture(scope="session")
def cpu(ort_library) -> CpuKernels:
    return CpuKernels(ort_library)
