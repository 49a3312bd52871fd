"""The TensorRT plugin wrappers (kernels/trt): contract, build files, compile check.

Always: the sources and CMakeLists exist, and the plugin name / version / namespace /
fields agree between kernels/trt/common/plugin_names.h (what the plugins report),
kernels/trt/plugin_names.json (what the ONNX side reads) and the wrappers (which may
only use the header's constants). With TensorRT headers at hand, also the full
compile check of tools/trt_compile_check.py (compile, symbols, host-driven check):

    VLMPRUNE_TRT_INCLUDE_V3=/path/to/TensorRT-10.3/include \\
    VLMPRUNE_TRT_INCLUDE_V2=/path/to/TensorRT-8.5/include pytest tests/kernels/test_trt_plugins.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRT = REPO / "kernels" / "trt"
CHECK_TOOL = REPO / "tools" / "trt_compile_check.py"

# The contract as the brief of the ONNX side states it (shared/DESIGN.md, Targets).
CONTRACT = {"name": "VlmpTokenPrune", "version": "1", "namespace": "vlmprune"}
FIELDS = {"keep": "int32", "has_cls": "int32"}
# The scorer plugin (--scorer int8 on orin / xavier): vlmp_cls_scores_cuda, the ClsAttentionScore op's attributes.
SCORER = {"name": "VlmpClsScore", "version": "1", "namespace": "vlmprune"}
SCORER_FIELDS = {"scale": "float32", "has_cls": "int32", "int8": "int32", "k_transposed": "int32"}

SOURCES = {
    "common": ["plugin_names.h", "token_prune_checks.h", "plugin_fields.h", "token_prune_enqueue.h", "cls_score.h",
               "tensorrt.cmake"],
    "v3": ["CMakeLists.txt", "token_prune_plugin.h", "token_prune_plugin.cpp", "cls_score_plugin.h",
           "cls_score_plugin.cpp", "entry_points.cpp"],
    "v2": [
        "CMakeLists.txt",
        "token_prune_plugin.h",
        "token_prune_plugin.cpp",
        "cls_score_plugin.h",
        "cls_score_plugin.cpp",
        "register.cpp",
        "index_cast.h",
        "index_cast.cu",
    ],
    "host_check": ["host_fakes.h", "host_kernel_stubs.cpp", "host_check_v3.cpp", "host_check_v2.cpp"],
}


def _header_constants() -> dict[str, str]:
    text = (TRT / "common" / "plugin_names.h").read_text(encoding="utf-8")
    strings = dict(re.findall(r'constexpr char const\* (k\w+) = "([^"]*)";', text))
    numbers = dict(re.findall(r"constexpr int64_t (k\w+) = (\d+);", text))
    return strings | numbers


def _wrapper_sources() -> list[Path]:
    return [p for d in ("common", "v2", "v3") for p in sorted((TRT / d).iterdir()) if p.suffix in {".h", ".cpp", ".cu"}]


@pytest.mark.parametrize("folder", sorted(SOURCES))
def test_sources_and_build_files_exist(folder):
    missing = [name for name in SOURCES[folder] if not (TRT / folder / name).is_file()]
    assert not missing, f"kernels/trt/{folder} lacks {missing}"


def test_header_json_and_contract_agree():
    header = _header_constants()
    data = json.loads((TRT / "plugin_names.json").read_text(encoding="utf-8"))
    assert {k: data[k] for k in CONTRACT} == CONTRACT
    assert data["fields"] == FIELDS
    assert header["kTokenPruneName"] == data["name"]
    assert header["kTokenPruneVersion"] == data["version"]
    assert header["kTokenPruneNamespace"] == data["namespace"]
    assert [header["kFieldKeep"], header["kFieldHasCls"]] == list(data["fields"])
    assert int(header["kMaxPatches"]) == data["max_patches"] == 4096
    scorer = data["scorer"]
    assert {k: scorer[k] for k in SCORER} == SCORER and scorer["fields"] == SCORER_FIELDS
    assert [header["kClsScoreName"], header["kClsScoreVersion"], header["kClsScoreNamespace"]] == list(SCORER.values())
    assert [header["kFieldScale"], header["kFieldHasCls"], header["kFieldInt8"], header["kFieldKTransposed"]] == \
        list(SCORER_FIELDS)
    assert int(header["kMaxKeys"]) == scorer["max_keys"] == 4097
    assert int(header["kMaxHeadDim"]) == scorer["max_head_dim"] == 1024


def test_wrappers_use_the_header_constants_not_literals():
    """The strings may be spelled out in plugin_names.h only, so nothing can drift."""
    literals = {f'"{v}"' for v in (*CONTRACT.values(), *FIELDS, *SCORER.values(), *SCORER_FIELDS)}
    offenders = [
        f"{path.relative_to(REPO)}: {lit}"
        for path in _wrapper_sources()
        if path.name != "plugin_names.h"
        for lit in literals
        if lit in path.read_text(encoding="utf-8")
    ]
    assert not offenders, offenders


def test_both_wrappers_report_the_header_constants():
    expected = {
        "v3": ["getPluginName", "getPluginVersion", "getPluginNamespace"],
        "v2": ["getPluginType", "getPluginName", "getPluginVersion", "getPluginNamespace"],
    }
    for api, methods in expected.items():
        text = (TRT / api / "token_prune_plugin.cpp").read_text(encoding="utf-8")
        for method in methods:
            assert re.search(rf"::{method}\(\) const noexcept\s*\{{", text), f"{api}: {method} not defined"
        assert text.count("return kTokenPruneName;") >= 2, api  # plugin and creator
        assert text.count("return kTokenPruneVersion;") >= 2, api
        assert "kTokenPruneNamespace" in text, api


def test_both_wrappers_register_the_scorer():
    for api, cls in (("v3", "ClsScorePluginV3"), ("v2", "ClsScorePluginV2")):
        text = (TRT / api / "cls_score_plugin.cpp").read_text(encoding="utf-8")
        assert text.count("return kClsScoreName;") >= 2 and text.count("return kClsScoreVersion;") >= 2, api
        assert "enqueueClsScore(" in text and f"{cls}::" in text, api
        assert "cls_score_plugin.cpp" in (TRT / api / "CMakeLists.txt").read_text(encoding="utf-8"), api
    assert "ClsScoreCreatorV3 scoreCreator" in (TRT / "v3" / "entry_points.cpp").read_text(encoding="utf-8")
    assert "REGISTER_TENSORRT_PLUGIN(ClsScoreCreatorV2);" in (TRT / "v2" / "register.cpp").read_text(encoding="utf-8")


def test_cmake_targets_and_defaults():
    v3 = (TRT / "v3" / "CMakeLists.txt").read_text(encoding="utf-8")
    v2 = (TRT / "v2" / "CMakeLists.txt").read_text(encoding="utf-8")
    common = (TRT / "common" / "tensorrt.cmake").read_text(encoding="utf-8")
    assert "add_library(vlmprune_trt SHARED" in v3 and "add_library(vlmprune_trt SHARED" in v2
    assert "set(CMAKE_CUDA_ARCHITECTURES 87)" in v3 and "set(CMAKE_CUDA_ARCHITECTURES 72)" in v2
    assert "vlmp_find_tensorrt(10 " in v3 and "vlmp_find_tensorrt(8 " in v2
    assert "set(CMAKE_CXX_STANDARD 14)" in v2  # JetPack 5.1's gcc 9
    assert '"${VLMP_KERNELS_DIR}/cuda/token_prune.cu"' in common
    for default in ("/usr/include/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
        assert default in common
    for override in ("TENSORRT_INCLUDE_DIR", "TENSORRT_LIB_DIR", "TENSORRT_ROOT", "VLMP_KERNELS_DIR"):
        assert override in common


def test_v3_exports_the_loader_entry_points():
    text = (TRT / "v3" / "entry_points.cpp").read_text(encoding="utf-8")
    assert re.search(r"VLMP_TRT_EXPORT nvinfer1::IPluginCreatorInterface\* const\* getCreators\(int32_t& \w+\)", text)
    assert re.search(r"VLMP_TRT_EXPORT void setLoggerFinder\(nvinfer1::ILoggerFinder\* \w+\)", text)


# ------------------------------------------------------------------ compile check


def _compile_check(api: str, env_var: str, tmp_path: Path) -> None:
    include = os.environ.get(env_var)
    if not include:
        pytest.skip(f"{env_var} is not set (a folder with the TensorRT headers for --api {api})")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    report_path = tmp_path / f"report_{api}.json"
    cmd = [sys.executable, str(CHECK_TOOL), "--api", api, "--trt-include", include, "--json", str(report_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert report_path.is_file(), proc.stdout + proc.stderr
    report = json.loads(report_path.read_text(encoding="utf-8"))
    failed = [s["name"] + ": " + (s["detail"] or s["output"][-2000:]) for s in report["steps"] if s["ok"] is False]
    assert proc.returncode == 0 and report["ok"], "\n".join(failed) or proc.stdout[-4000:]
    ran = {s["name"] for s in report["steps"] if s["ok"]}
    assert {"compile", "symbols", "host"} <= ran, report["steps"]


def test_compile_check_v3_tensorrt10(tmp_path):
    _compile_check("v3", "VLMPRUNE_TRT_INCLUDE_V3", tmp_path)


def test_compile_check_v2_tensorrt85(tmp_path):
    _compile_check("v2", "VLMPRUNE_TRT_INCLUDE_V2", tmp_path)
