"""tome end to end: tiny LLaVA (CLIP) and LLaVA-DINOv2 compile on ort with parity, orin and xavier's graphs too,
and rk3588 / qnn refuse it in one line (passes/methods/tome.py says why; tests/passes/methods/test_tome.py has the
method's own tests)."""

from __future__ import annotations

import pytest

from cli_helpers import one_line_error, run_cli
from tiny_models import tiny_llava_dinov2
from vlmprune.compiler.pipeline import CompileOptions, compile_model


@pytest.fixture(scope="module")
def llava_dinov2_dir(tmp_path_factory):
    return tiny_llava_dinov2(tmp_path_factory.mktemp("llava_dinov2"), seed=3)


def _check(result, keep: int) -> None:
    assert result.report.passed, result.manifest["parity"]
    stages = {s.stage: s for s in result.report.stages}
    assert {"rewritten", "fused"} <= set(stages) or result.manifest["target"]["name"] != "ort"
    for stage in result.report.stages:
        if stage.indices:
            assert stage.indices["agreement"] == 1.0
    assert result.manifest["method"]["params"]["keep"] == keep


@pytest.mark.parametrize("batch", [1, 3])
def test_llava_on_ort(tiny_llava_dir, tmp_path, batch):
    # The feature layer is block 2 of 3: 48 merges over 2 blocks, the cap of block 2 (20) front-loads block 1.
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(method="tome", keep=16, batch=batch))
    _check(result, 16)


@pytest.mark.parametrize("target", ["ort", "orin", "xavier"])
def test_llava_dinov2(llava_dinov2_dir, tmp_path, target):
    result = compile_model(str(llava_dinov2_dir), tmp_path / "b",
                           CompileOptions(target=target, method="tome", keep=24, method_options={"blocks": "1-"}))
    _check(result, 24)
    assert result.manifest["model"]["family"] == "llava_dinov2"


@pytest.mark.parametrize("target,needle", [("rk3588", "rk3588's NPU runs the graph in fp16"),
                                           ("qnn", "HTP runs the graph quantised")])
def test_refused_below_float32(tiny_llava_dir, tmp_path, target, needle):
    one_line_error(run_cli("compile", tiny_llava_dir, "-o", tmp_path / "b", "-t", target, "-m", "tome", "-k", "24"),
                   needle)
    assert not (tmp_path / "b").exists()


def test_cli_refusals(tiny_llava_dir, tmp_path):
    one_line_error(run_cli("compile", tiny_llava_dir, "-o", tmp_path / "b", "-m", "tome", "-k", "4"),
                   "out of ToMe's reach")
    one_line_error(run_cli("compile", tiny_llava_dir, "-o", tmp_path / "b", "-m", "tome", "-k", "16", "--layer", "1"),
                   "--layer does not apply")
