"""passes.llm_norm_fusion on a residual block written in code as torch.onnx spells an LLM's RMSNorm.

The graph: h = a + b (the residual stream), then weight · h / sqrt(mean(h², last axis) + eps) as Pow, ReduceMean,
Add, Sqrt, Reciprocal, Mul, Mul; both the normed value and h are outputs (the next layer's residual reads h).
Checked: the op list after the rewrite, ONNX Runtime's numbers against numpy at a fixed seed, the ONNX checker, and
forms the rules must leave alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from vlmprune.passes.llm_norm_fusion import FUSED, LlmNormFusionPass, count_fused
from vlmprune.targets.runtime import ort_session

B, S, D = 2, 5, 16
EPS = 1e-6


def _graph(residual: bool = True, exponent: float = 2.0, axes: tuple[int, ...] = (-1,), const_weight: bool = True,
           skip_shape: tuple[int, ...] = (B, S, D), rank: int = 3) -> ir.Model:
    shape = (B, S, D) if rank == 3 else (B, S, 2, D)
    nodes, inits = [], [helper.make_tensor("two", TensorProto.FLOAT, [], [exponent]),
                        helper.make_tensor("axes", TensorProto.INT64, [len(axes)], list(axes)),
                        helper.make_tensor("eps", TensorProto.FLOAT, [], [EPS])]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape)]
    x = "a"
    if residual:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, skip_shape))
        nodes.append(helper.make_node("Add", ["a", "b"], ["h"]))
        x = "h"
    if const_weight:
        weight = np.random.default_rng(1).uniform(0.5, 1.5, D).astype(np.float32)
        inits.append(helper.make_tensor("w", TensorProto.FLOAT, [D], weight))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [D]))
    nodes += [
        helper.make_node("Pow", [x, "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["inv"]),
        helper.make_node("Mul", [x, "inv"], ["scaled"]),
        helper.make_node("Mul", ["w", "scaled"], ["normed"]),  # the weight first, as torch.onnx writes it
    ]
    outputs = [helper.make_tensor_value_info("normed", TensorProto.FLOAT, shape)]
    if residual:
        outputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "norm", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def _feeds(model: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {v.name: rng.standard_normal(tuple(v.shape), dtype=np.float32) for v in model.graph.inputs}


def _reference(feeds: dict[str, np.ndarray], weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = feeds["a"].astype(np.float64) + feeds.get("b", 0.0)
    return weight * h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS), h


def _run(model: ir.Model, feeds: dict, tmp_path) -> list[np.ndarray]:
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    return ort_session(path).run(None, feeds)


def _weight(model: ir.Model) -> np.ndarray:
    return model.graph.initializers["w"].const_value.numpy()


def test_residual_and_norm_become_one_skip_simplified_layer_normalization(tmp_path):
    model = _graph()
    feeds, weight = _feeds(model), _weight(model)
    before = _run(model, feeds, tmp_path)
    assert LlmNormFusionPass()(model).modified
    assert [n.op_type for n in model.graph] == [FUSED]
    node = next(iter(model.graph))
    assert node.domain == "com.microsoft" and node.attributes["epsilon"].value == pytest.approx(EPS)
    after = _run(model, feeds, tmp_path)  # the sum is still an output: the op's fourth output gives it
    normed, total = _reference(feeds, weight)
    for got in (before, after):
        np.testing.assert_allclose(got[0], normed, rtol=0, atol=2e-6)
        np.testing.assert_allclose(got[1], total, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rank", [3, 4])  # 4: Qwen3's per-head q/k norm over [B, S, heads, d]
def test_a_norm_without_a_residual_add_is_left_as_it_is(rank, tmp_path):
    """Its fused form (SimplifiedLayerNormalization, registered by ONNX Runtime in the ONNX domain) fails the ONNX
    checker, so it stays seven standard nodes."""
    model = _graph(residual=False, rank=rank)
    ops = [n.op_type for n in model.graph]
    assert not LlmNormFusionPass()(model).modified
    assert [n.op_type for n in model.graph] == ops


@pytest.mark.parametrize("how, kwargs", [
    ("a cube, not a square", {"exponent": 3.0}),
    ("a mean over two axes", {"axes": (-2, -1)}),
    ("a weight that is an input", {"const_weight": False}),
    ("a residual over [B, S, heads, d]", {"rank": 4, "skip_shape": (B, S, 2, D)}),
])
def test_other_forms_are_left_as_they_are(how, kwargs):
    model = _graph(**kwargs)
    ops = [n.op_type for n in model.graph]
    assert not LlmNormFusionPass()(model).modified, how
    assert [n.op_type for n in model.graph] == ops and count_fused(model) == 0


def test_a_broadcasting_residual_add_keeps_its_add(tmp_path):
    """SkipSimplifiedLayerNormalization takes two inputs of one shape: an Add that broadcasts stays an Add."""
    model = _graph(skip_shape=(1, 1, D))
    feeds, weight = _feeds(model), _weight(model)
    ops = [n.op_type for n in model.graph]
    assert not LlmNormFusionPass()(model).modified
    assert [n.op_type for n in model.graph] == ops
    np.testing.assert_allclose(_run(model, feeds, tmp_path)[0], _reference(feeds, weight)[0], rtol=0, atol=2e-6)


def test_a_fused_graph_is_not_fused_twice():
    model = _graph()
    LlmNormFusionPass()(model)
    with pytest.raises(ir.passes.PreconditionError, match="fused already"):
        LlmNormFusionPass()(model)
