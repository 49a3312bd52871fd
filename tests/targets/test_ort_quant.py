"""ort --precision int8 (targets.ort_quant): QDQ outside the score path, the kept set fp32's, one-line refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from PIL import Image

from vlmprune.compiler.contract import KEPT
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets import get_target
from vlmprune.targets.ort_quant import INT8_MODEL

QDQ = ("QuantizeLinear", "DequantizeLinear")


@pytest.fixture(scope="module")
def int8_bundle(tiny_clip_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ort-int8")
    calib = root / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(calib / f"c{i}.png")
    options = CompileOptions(target="ort", method="cls", keep=16, layer=1,
                             target_options={"precision": "int8", "calibration": str(calib)})
    return compile_model(str(tiny_clip_dir), root / "bundle", options)


def _ancestors(graph: onnx.GraphProto, outputs: list[str]) -> list[onnx.NodeProto]:
    """What outputs depend on; vlmprune.TokenPrune(hidden, scores)'s kept indices depend on its scores only."""
    producer = {o: n for n in graph.node for o in n.output}
    seen, stack = {}, [producer[o] for o in outputs if o in producer]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            inputs = node.input[1:] if (node.domain, node.op_type) == ("vlmprune", "TokenPrune") else node.input
            stack.extend(producer[i] for i in inputs if i in producer)
    return list(seen.values())


def test_int8_model_is_qdq_outside_the_score_path(int8_bundle):
    path = int8_bundle.bundle / INT8_MODEL
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0
    score = [n.op_type for n in _ancestors(model.graph, [KEPT])]
    assert {"TokenPrune", "MatMul", "Softmax"} <= set(score) and not set(score) & set(QDQ)
    assert int8_bundle.manifest.target["int8"]["calibration_images"] == ["c0.png", "c1.png", "c2.png"]
    # the fused op of model.onnx is in the int8 graph too
    fused = {f"{n.domain}.{n.op_type}" for n in ir.load(int8_bundle.bundle / "model.onnx").graph if n.domain}
    assert fused <= {f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain}


def test_int8_stage_keeps_fp32_kept_indices(int8_bundle):
    stages = {s.stage: s for s in int8_bundle.report.stages}
    assert stages["int8"].precision == "int8-fp32-score" and stages["int8"].passed
    specs = {s.stage: s for s in get_target("ort").stages(int8_bundle.bundle, int8_bundle.manifest)}
    pixel = np.random.default_rng(3).standard_normal((2, 3, 112, 112)).astype(np.float32)
    fp32, int8 = specs["fused"].run(pixel), specs["int8"].run(pixel)
    np.testing.assert_array_equal(fp32[KEPT], int8[KEPT])
    assert not np.array_equal(fp32["image_features"], int8["image_features"])  # the later block is quantized


def test_runner_runs_the_int8_graph(int8_bundle):
    _, runtime = get_target("ort").runner(int8_bundle.bundle, int8_bundle.manifest)
    assert INT8_MODEL in runtime


def test_bad_calibration_folder_is_one_line(tmp_path):
    ort = get_target("ort")
    for folder, why in ((tmp_path / "missing", "not a folder"), (tmp_path, "no PNG or JPEG")):
        with pytest.raises(InputError, match=why) as exc:
            ort.check_options(CompileOptions(target_options={"precision": "int8", "calibration": str(folder)}))
        assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="fp32 or int8"):
        ort.check_options(CompileOptions(target_options={"precision": "int4"}))
    with pytest.raises(InputError, match="add --precision int8"):
        ort.check_options(CompileOptions(target_options={"calibration": str(tmp_path)}))


def test_other_targets_keep_their_messages(tmp_path):
    with pytest.raises(InputError, match=r"target rk3588 has no --calibration \(it takes --precision\)"):
        get_target("rk3588").check_options(CompileOptions(target="rk3588",
                                                          target_options={"calibration": str(tmp_path)}))
    with pytest.raises(InputError, match=r"qnn --precision takes int16 \(activation bits\), got .fp32."):
        get_target("qnn").check_options(CompileOptions(target="qnn", target_options={"precision": "fp32"}))
