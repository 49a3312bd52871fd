"""QNN HTP emulator (onnxruntime-qnn) end to end on the probe graph (tools/probe_graph.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from vlmprune.targets import qnn_tools

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # the probe graph is a developer module
import probe_graph as probe_lib  # noqa: E402

needs_qnn = pytest.mark.usefixtures("qnn_ready")  # skips, saying why, without the HTP emulator
CALIB_SEEDS = range(100, 116)
TEST_SEEDS = (1, 2)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("qnn_probe")
    model = probe_lib.build_probe_model()
    onnx.save(model, root / "probe.onnx")
    calib = [{"x": probe_lib.probe_input(s)} for s in CALIB_SEEDS]
    return {"root": root, "model": model, "calib": calib}


@pytest.fixture(scope="module")
def qdq16(probe):
    return qnn_tools.quantize_qdq(probe["root"] / "probe.onnx", probe["root"] / "probe.qdq.onnx", probe["calib"])


def _check_parity(model, path, min_agreement=0.99, min_cosine=0.99):
    for seed in TEST_SEEDS:
        x = probe_lib.probe_input(seed)
        ref = probe_lib.reference_run(model, x)
        out = qnn_tools.run_qnn(path, {"x": x})
        agreement = probe_lib.kept_agreement(ref["kept_idx"], out["kept_idx"])
        cosine = probe_lib.token_cosines(ref, out["tokens"], out["kept_idx"]).min()
        assert agreement >= min_agreement, (seed, agreement, probe_lib.near_ties(ref["score"], probe_lib.K))
        assert cosine >= min_cosine, (seed, cosine)


@needs_qnn
def test_qdq_16bit_runs_on_htp_with_parity(probe, qdq16):
    """Default recipe: uint16 activations, uint8 weights, score-only nodes in fp16; no CPU fallback."""
    _check_parity(probe["model"], qdq16)


@needs_qnn
def test_fully_quantized_score_path_with_calibrated_softmax(probe):
    path = qnn_tools.quantize_qdq(probe["root"] / "probe.onnx", probe["root"] / "probe.q16.onnx", probe["calib"],
                                  score_path="quantized")
    assert not any(n.op_type == "Softmax" and not _quantized_input(onnx.load(path), n)
                   for n in onnx.load(path).graph.node)
    _check_parity(probe["model"], path)


def _quantized_input(model, node) -> bool:
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    return producers.get(node.input[0]) == "DequantizeLinear"


@needs_qnn
def test_epcontext_is_written_and_runs(probe, qdq16, tmp_path):
    ctx, bins = qnn_tools.make_epcontext(qdq16, tmp_path / "ctx")
    assert ctx.is_file() and bins and all(b.stat().st_size > 0 for b in bins)
    assert [n.op_type for n in onnx.load(ctx).graph.node] == ["EPContext"]
    x = probe_lib.probe_input(TEST_SEEDS[0])
    from_ctx, from_qdq = qnn_tools.run_qnn(ctx, {"x": x}), qnn_tools.run_qnn(qdq16, {"x": x})
    assert all(np.array_equal(from_ctx[k], from_qdq[k]) for k in from_qdq)


@needs_qnn
def test_placement_gather_on_htp_gathernd_on_cpu(probe, tmp_path):
    calib = probe["calib"][:4]
    rows = {}
    for select in ("gather", "gathernd"):
        src = tmp_path / f"{select}.onnx"
        onnx.save(probe_lib.build_probe_model(select=select), src)
        qdq = qnn_tools.quantize_qdq(src, tmp_path / f"{select}.qdq.onnx", calib)
        rows[select] = {r["type"]: r["provider"] for r in qnn_tools.placement(qdq)}
    assert set(rows["gather"].values()) == {"QNNExecutionProvider"}
    assert rows["gathernd"]["GatherND"] == "CPUExecutionProvider"
    assert rows["gathernd"]["TopK"] == "QNNExecutionProvider"


@needs_qnn
def test_unsupported_node_fails_without_fallback(probe, tmp_path):
    src = tmp_path / "gathernd.onnx"
    onnx.save(probe_lib.build_probe_model(select="gathernd"), src)
    with pytest.raises(qnn_tools.QnnError, match="CPU EP"):
        qnn_tools.run_qnn(src, {"x": probe_lib.probe_input(1)})


def test_legalize_makes_gather_indices_positive_and_rejects_dynamic_inputs():
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "idx"], ["g"], axis=1), helper.make_node("Relu", ["g"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])],
        initializer=[numpy_helper.from_array(np.array([-1, 0], np.int64), "idx")])
    model = qnn_tools.legalize_for_htp(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert numpy_helper.to_array(model.graph.initializer[0]).tolist() == [4, 0]
    names = [n.name for n in model.graph.node]  # exclusions and placement rows go by name: each one distinct
    assert [n.op_type for n in model.graph.node] == ["Gather", "Relu"] and all(names) and len(set(names)) == 2
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(qnn_tools.QnnError, match="static shapes"):
        qnn_tools.legalize_for_htp(model)


def test_selection_is_found_by_role_not_by_shape():
    model = probe_lib.build_probe_model()
    selection = {n.output[0] for n in qnn_tools.role_nodes(model)}
    upstream = {n.output[0] for n in qnn_tools.feeding_selection_nodes(model)}
    assert {"attn", "score", "q", "k", "h1", "top_v", "kept_idx"} <= selection
    assert "hidden" not in selection and "hidden" in upstream and "tokens" not in upstream
    for node in model.graph.node:  # a graph without roles has no selection: nothing is guessed from TopK
        del node.metadata_props[:]
    assert qnn_tools.role_nodes(model) == []
