"""The CUDA kernels compile for the Jetson Orin (sm_87) and Hopper (sm_90) targets.

No GPU is needed: this is nvcc only. Running them is tools/gpu_kernel_check.py's job.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from vlmprune.kernels import build

CUDA_ENTRY_POINTS = ("vlmp_select_topk_cuda", "vlmp_gather_summary_cuda", "vlmp_cls_scores_cuda",
                     "vlmp_divprune_select_cuda")


@pytest.fixture(scope="module")
def nvcc() -> str:
    try:
        return build.find_nvcc()
    except build.ToolNotFoundError as exc:
        pytest.skip(str(exc))


def _defined_symbols(obj) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found: cannot list the object's symbols")
    out = subprocess.run([nm, "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_kernels_compile_and_export_the_c_abi(nvcc, arch, tmp_path):
    obj = build.nvcc_compile(arch, tmp_path)
    assert obj.is_file() and obj.stat().st_size > 0
    symbols = _defined_symbols(obj)
    assert set(CUDA_ENTRY_POINTS) <= symbols
    assert not {s for s in symbols if s.endswith("_v1")}  # the v1 baseline is the harness's only


def test_kernels_compile_as_cxx14(nvcc, tmp_path):
    # The Xavier plugin build (TensorRT 8.5, CUDA 11.4) compiles this file with C++14;
    # sm_75 is the oldest architecture this nvcc accepts.
    obj = build.nvcc_compile("sm_75", tmp_path, std="c++14")
    assert set(CUDA_ENTRY_POINTS) <= _defined_symbols(obj)


@pytest.mark.slow
def test_gpu_check_harness_builds(nvcc, tmp_path):
    exe = build.nvcc_build_harness("sm_90", tmp_path)
    assert exe.is_file() and exe.stat().st_mode & 0o111
    # The previous kernels are linked in as the baseline the new ones are checked and timed against.
    assert {f"{name}_v1" for name in CUDA_ENTRY_POINTS} <= _defined_symbols(exe)


def test_bad_architecture_is_a_one_line_error(tmp_path):
    with pytest.raises(build.KernelBuildError, match="unrecognised CUDA architecture 'hopper'"):
        build.nvcc_compile("hopper", tmp_path)
