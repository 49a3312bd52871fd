"""Target openvino (targets.openvino): IR from ov.convert_model, f32 / bf16 hint / NNCF int8, devices labelled."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from PIL import Image

from vlmprune.compiler.contract import FEATURES, KEPT, MODEL, OPENVINO_INT8_IR, OPENVINO_IR
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.parity import compare_indices, tolerance_for
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets import get_target
from vlmprune.targets.runtime import ort_session, run_session

ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install 'vlmprune[openvino]')")
pytest.importorskip("nncf", reason="nncf is not installed (pip install 'vlmprune[openvino]')")

SEED = 3


def _compile(tiny_clip_dir, root, **target_options):
    options = CompileOptions(target="openvino", method="cls", keep=16, layer=1, target_options=target_options)
    return compile_model(str(tiny_clip_dir), root / "bundle", options)


@pytest.fixture(scope="module")
def f32_npu(tiny_clip_dir, tmp_path_factory):
    """f32, built for the NPU: checked on CPU where this machine has none."""
    return _compile(tiny_clip_dir, tmp_path_factory.mktemp("ov-f32"), precision="f32", device="NPU")


@pytest.fixture(scope="module")
def bf16(tiny_clip_dir, tmp_path_factory):
    return _compile(tiny_clip_dir, tmp_path_factory.mktemp("ov-bf16"), precision="bf16")


@pytest.fixture(scope="module")
def int8(tiny_clip_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ov-int8")
    calib = root / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(calib / f"c{i}.png")
    return _compile(tiny_clip_dir, root, precision="int8", calibration=str(calib))


@pytest.fixture(scope="module")
def int8_bf16(tiny_clip_dir, tmp_path_factory):
    """The int8 IR under the bf16 hint, on the built-in calibration photographs."""
    return _compile(tiny_clip_dir, tmp_path_factory.mktemp("ov-int8-bf16"), precision="int8-bf16")


def _ir_ops(path) -> list[str]:
    return [layer.get("type") for layer in ET.parse(path).getroot().iter("layer")]


def _pixels() -> np.ndarray:
    return np.random.default_rng(SEED).standard_normal((2, 3, 112, 112)).astype(np.float32)


def _stage(result):
    return {s.stage: s for s in result.report.stages}["openvino"]


def test_f32_ir_runs_the_standard_graph_at_fp32(f32_npu):
    bundle = f32_npu.bundle
    onnx.checker.check_model(str(bundle / MODEL), full_check=True)
    assert {n.domain for n in onnx.load(str(bundle / MODEL), load_external_data=False).graph.node} <= {"", "ai.onnx"}
    ops = _ir_ops(bundle / OPENVINO_IR)
    assert {"TopK", "SoftMax", "GatherND"} <= set(ops) and "FakeQuantize" not in ops
    assert (bundle / "model.bin").stat().st_size > 0
    stage = _stage(f32_npu)
    assert stage.passed and stage.precision == "fp32"
    # numbers against ONNX Runtime on the same standard graph, at a fixed seed
    run, _ = get_target("openvino").runner(bundle, f32_npu.manifest)
    got, want = run(_pixels()), run_session(ort_session(bundle / MODEL), _pixels())
    np.testing.assert_array_equal(got[KEPT], want[KEPT])
    np.testing.assert_allclose(got[FEATURES], want[FEATURES], atol=1e-4, rtol=1e-4)


def test_absent_device_is_checked_on_cpu_and_labelled(f32_npu):
    if "NPU" in {d.split(".")[0] for d in ov.Core().available_devices}:
        pytest.skip("this machine has an NPU: the bundle is checked there")
    assert f32_npu.manifest.target["device"] == "NPU" and f32_npu.manifest.target["checked_on"] == "CPU"
    assert "(checked on CPU: no NPU here)" in _stage(f32_npu).runtime
    assert "This machine has no NPU" in (f32_npu.bundle / "README.md").read_text()


def test_bf16_runs_bf16_and_is_held_to_the_bf16_tolerance(bf16, f32_npu):
    stage = _stage(bf16)
    assert stage.passed and stage.precision == "bf16" and stage.tolerance == tolerance_for("bf16")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        assert "no bf16" in stage.runtime  # says what runs instead
        return
    target = get_target("openvino")
    half = target.runner(bf16.bundle, bf16.manifest)[0](_pixels())[FEATURES]
    full = target.runner(f32_npu.bundle, f32_npu.manifest)[0](_pixels())[FEATURES]
    assert np.abs(half - full).max() > 1e-4  # the hint took: not the f32 result
    assert bf16.manifest.target["inference_precision_hint"] == "bf16"


def test_int8_quantizes_outside_the_score_path(int8, f32_npu):
    ops = _ir_ops(int8.bundle / OPENVINO_INT8_IR)
    assert ops.count("FakeQuantize") > 0 and "FakeQuantize" not in _ir_ops(int8.bundle / OPENVINO_IR)
    stage = _stage(int8)
    assert stage.passed and stage.precision == "int8-fp32-score" and OPENVINO_INT8_IR in stage.runtime
    assert int8.manifest.target["int8"]["calibration_images"] == ["c0.png", "c1.png", "c2.png"]
    target = get_target("openvino")
    q = target.runner(int8.bundle, int8.manifest)[0](_pixels())
    f = target.runner(f32_npu.bundle, f32_npu.manifest)[0](_pixels())
    np.testing.assert_array_equal(q[KEPT], f[KEPT])  # the score path is fp32: the same kept set
    assert not np.array_equal(q[FEATURES], f[FEATURES])  # the later block is quantized


def test_int8_bf16_runs_the_int8_ir_under_the_bf16_hint(int8_bf16, f32_npu):
    ops = _ir_ops(int8_bf16.bundle / OPENVINO_INT8_IR)
    assert ops.count("FakeQuantize") > 0
    fields = int8_bf16.manifest.target
    assert fields["ir"] == OPENVINO_INT8_IR and fields["inference_precision_hint"] == "bf16"
    assert fields["int8"]["calibration_images"]  # the built-in photographs
    stage = _stage(int8_bf16)
    assert stage.passed and stage.precision == "int8-bf16" and stage.tolerance == tolerance_for("int8-bf16")
    assert OPENVINO_INT8_IR in stage.runtime
    target = get_target("openvino")
    q = target.runner(int8_bf16.bundle, int8_bf16.manifest)[0](_pixels())
    f = target.runner(f32_npu.bundle, f32_npu.manifest)[0](_pixels())
    agreement = np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(q[KEPT], f[KEPT])])
    assert agreement >= tolerance_for("int8-bf16").index_agreement_min
    assert not np.array_equal(q[FEATURES], f[FEATURES])
    assert "int8-bf16" in (int8_bf16.bundle / "README.md").read_text()


def test_bf16_boundary_swap_is_reported_not_hidden():
    """A swap at the K-th boundary inside bf16's tie band passes and is named; one outside it fails."""
    tol = tolerance_for("bf16")
    scores = np.array([[0.9, 0.8, 0.5001, 0.5, 0.1, 0.05]])  # K = 3: index 2 and 3 tie within 1e-2
    ref = np.array([[0, 1, 2]])
    swapped = compare_indices(ref, np.array([[0, 1, 3]]), scores, tol)
    assert swapped["passed"] and swapped["tie_resolved_images"] == [0] and swapped["boundary_ties"] == [2]
    wrong = compare_indices(ref, np.array([[0, 1, 4]]), scores, tol)
    assert not wrong["passed"] and wrong["tie_resolved_images"] == []


def test_bad_options_are_one_line(tmp_path):
    target = get_target("openvino")
    cases = [({"precision": "fp16"}, "openvino --precision takes f32, bf16, int8, int8-bf16"),
             ({"device": "TPU"}, "openvino --device takes CPU, GPU, NPU"),
             ({"calibration": str(tmp_path)}, "add --precision int8"),
             ({"precision": "int8", "calibration": str(tmp_path)}, "no PNG or JPEG"),
             ({"soc": "SM8650"}, "target openvino has no --soc")]
    for given, why in cases:
        with pytest.raises(InputError, match=why) as exc:
            target.check_options(CompileOptions(target="openvino", target_options=given))
        assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="--precision bf16 cannot run method tome: its merge decisions"):
        target.check_options(CompileOptions(target="openvino", method="tome", target_options={"precision": "bf16"}))
    with pytest.raises(InputError, match="--precision int8-bf16 cannot run method tome"):
        target.check_options(CompileOptions(target="openvino", method="tome",
                                            target_options={"precision": "int8-bf16"}))
    for precision in ("int8", "int8-bf16"):
        with pytest.raises(InputError, match="reads the projector output"):
            target.check_options(CompileOptions(target="openvino", method="divprune",
                                                target_options={"precision": precision}))


def test_listed_with_devices_and_precisions():
    from vlmprune.compiler import api

    listing = api.targets()
    assert any(t.name == "openvino" and t.available for t in listing.targets)
    assert any("openvino --precision: f32, bf16, int8, int8-bf16" in line and "NPU" in line for line in listing.notes)
