"""Legalization passes for rk3588 and qnn (passes.legalize, passes.rknn, passes.qnn) on tiny graphs."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

from vlmprune.compiler.errors import StructureError
from vlmprune.targets.runtime import ort_session
from vlmprune.passes.legalize import FoldCastLikePass, GatherNDToGatherPass, OneHotSelectionPass, StaticBatchPass
from vlmprune.passes.methods.cls import selection_model
from vlmprune.passes.qnn import PositiveGatherIndicesPass, htp_legalization, htp_model_support, htp_support
from vlmprune.passes.rknn import rknn_legalization, rknn_model_support, rknn_support
from vlmprune.passes.support import SupportCheckPass


def _model(nodes, inputs, outputs, inits=(), opset=18) -> ir.Model:
    graph = oh.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10))


def _run(model: ir.Model, feeds: dict) -> dict:
    session = ort_session(ir.serde.serialize_model(model).SerializeToString())
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _dynamic_reshape_model() -> ir.Model:
    """x [batch, 4, 6] -> Reshape(x, Concat(Shape(x)[0:1], [24])): the exporter's batch arithmetic."""
    nodes = [oh.make_node("Shape", ["x"], ["s"], name="shape", start=0, end=1),
             oh.make_node("Concat", ["s", "c24"], ["target"], name="concat", axis=0),
             oh.make_node("Reshape", ["x", "target"], ["y"], name="reshape")]
    return _model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
                  [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 24])],
                  [onh.from_array(np.array([24], np.int64), "c24")])


def test_static_batch_fixes_the_batch_and_folds_shape_arithmetic():
    model = _dynamic_reshape_model()
    result = StaticBatchPass(1)(model)
    assert result.modified
    assert _ops(model) == ["Reshape"]
    assert list(model.graph.inputs[0].shape) == [1, 4, 6] and list(model.graph.outputs[0].shape) == [1, 24]
    x = np.random.default_rng(0).standard_normal((1, 4, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(model, {"x": x})["y"], x.reshape(1, 24))
    assert not StaticBatchPass(1)(model).modified  # already static: nothing to do, and it says so


def test_static_batch_refuses_another_static_batch_in_one_line():
    model = _dynamic_reshape_model()
    model.graph.inputs[0].shape = ir.Shape([2, 4, 6])
    with pytest.raises(StructureError, match="runs batch 1.*--batch 1") as info:
        StaticBatchPass(1, "rk3588")(model)
    assert "\n" not in str(info.value)


def test_fold_castlike():
    nodes = [oh.make_node("CastLike", ["k", "x"], ["k_same"], name="same"),
             oh.make_node("CastLike", ["x", "h"], ["x_half"], name="other"),
             oh.make_node("Mul", ["x", "k_same"], ["y"], name="mul")]
    model = _model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                           oh.make_tensor_value_info("h", TensorProto.FLOAT16, [2])],
                   [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                    oh.make_tensor_value_info("x_half", TensorProto.FLOAT16, [2])],
                   [onh.from_array(np.array(1.702, np.float32), "k")])
    assert FoldCastLikePass()(model).modified
    assert not FoldCastLikePass()(model).modified  # both folded on the first run
    assert sorted(_ops(model)) == ["Cast", "Identity", "Mul"]  # the graph output keeps its name via Identity
    out = _run(model, {"x": np.array([1, 2], np.float32), "h": np.zeros(2, np.float16)})
    np.testing.assert_allclose(out["y"], [1.702, 3.404], rtol=1e-6)
    assert out["x_half"].dtype == np.float16


@pytest.mark.parametrize("batch, op", [(1, "Gather"), (2, "GatherElements")])
def test_gathernd_becomes_gather_or_gather_elements(batch, op):
    model = selection_model(batch, 16, 8, 5)
    rng = np.random.default_rng(batch)
    feeds = {"hidden": rng.standard_normal((batch, 17, 8)).astype(np.float32),
             "scores": rng.standard_normal((batch, 16)).astype(np.float32)}
    before = _run(model, feeds)
    assert GatherNDToGatherPass()(model).modified
    assert not GatherNDToGatherPass()(model).modified  # nothing left on a second run
    assert "GatherND" not in _ops(model) and op in _ops(model)
    after = _run(model, feeds)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_onehot_selection_replaces_gather_and_scatter_exactly():
    model = selection_model(1, 16, 8, 5)
    rng = np.random.default_rng(3)
    feeds = {"hidden": rng.standard_normal((1, 17, 8)).astype(np.float32),
             "scores": rng.standard_normal((1, 16)).astype(np.float32)}
    before = _run(model, feeds)
    assert OneHotSelectionPass()(model).modified
    ops = _ops(model)
    assert "GatherND" not in ops and "ScatterElements" not in ops
    assert {"Equal", "Cast", "MatMul", "ReduceSum"} <= set(ops)
    after = _run(model, feeds)
    np.testing.assert_array_equal(after["kept_indices"], before["kept_indices"])
    np.testing.assert_allclose(after["tokens"], before["tokens"], rtol=1e-6, atol=1e-6)


def test_positive_gather_indices():
    nodes = [oh.make_node("Gather", ["x", "idx"], ["y"], name="gather", axis=1)]
    model = _model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 3])],
                   [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])],
                   [onh.from_array(np.array([-1, 0], np.int64), "idx")])
    assert PositiveGatherIndicesPass()(model).modified
    assert model.graph.initializers["idx"].const_value.numpy().tolist() == [4, 0]


def test_rknn_check_refuses_new_opsets_and_other_batches():
    check = SupportCheckPass("rk3588", rknn_support, rknn_model_support)
    model = _dynamic_reshape_model()
    StaticBatchPass(1)(model)
    assert not check(model).modified  # legal: passes quietly, changes nothing
    model.opset_imports[""] = 21
    with pytest.raises(StructureError, match="opset <= 19.*--opset 19"):
        check(model)


def test_htp_check_refuses_batched_gathernd():
    with pytest.raises(StructureError, match="GatherND: GatherND with batch_dims has no HTP kernel"):
        SupportCheckPass("qnn", htp_support, htp_model_support)(selection_model(1, 16, 8, 5))


@pytest.mark.parametrize("legalization", [rknn_legalization(), htp_legalization(1)], ids=["rknn", "htp"])
def test_pipelines_leave_a_static_standard_graph(legalization):
    model = selection_model("batch", 16, 8, 5)
    for p in legalization:
        p(model)
    assert "GatherND" not in _ops(model)
    assert all(isinstance(d, int) for v in [*model.graph.inputs, *model.graph.outputs] for d in v.shape)
