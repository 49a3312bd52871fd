"""passes.llm_attention_fusion on a one-layer attention written in code as torch.onnx spells the LLM's.

The graph: q [B, H, S, d], K and V [B, H, L, d] as inputs; MatMul(q, Transpose(K)), a scale Mul, the
prefill's causal Where over Range/Unsqueeze/Greater (or none: the decode step), Softmax, MatMul,
Transpose, Reshape to [B, S, H·d]. Checked: the op list after the rewrite, ONNX Runtime's numbers
against numpy at a fixed seed, the ONNX checker, and forms the rule must refuse.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.llm_attention_fusion import LlmAttentionFusionPass, count_fused
from vlmprune.targets.runtime import ort_session

B, H, S, D = 2, 4, 6, 8
SCALE = 1 / np.sqrt(D)


def _graph(masked: bool, anti_causal: bool = False, fill: float = -np.inf, length: int = S) -> ir.Model:
    i64 = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
    ]
    inits = [helper.make_tensor("scale", TensorProto.FLOAT, [], [SCALE]), i64("merged", [0, 0, H * D])]
    logits = "scaled"
    if masked:
        nodes += [
            helper.make_node("Shape", ["q"], ["q_shape"], start=2, end=3),
            helper.make_node("Squeeze", ["q_shape"], ["n"]),
            helper.make_node("Range", ["zero", "n", "one"], ["steps"]),
            helper.make_node("Unsqueeze", ["steps", "ax0"], ["cols"]),
            helper.make_node("Unsqueeze", ["steps", "ax1"], ["rows"]),
            helper.make_node("Greater", ["rows", "cols"] if anti_causal else ["cols", "rows"], ["hide"]),
            helper.make_node("Where", ["hide", "fill", "scaled"], ["masked"]),
        ]
        inits += [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                  helper.make_tensor("one", TensorProto.INT64, [], [1]), i64("ax0", [0]), i64("ax1", [1]),
                  helper.make_tensor("fill", TensorProto.FLOAT, [], [fill])]
        logits = "masked"
    nodes += [
        helper.make_node("Softmax", [logits], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["attended"]),
        helper.make_node("Transpose", ["attended"], ["swapped"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["swapped", "merged"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, H, S, D]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, H, length, D]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, H, length, D])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, S, H * D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def _inputs(length: int = S):
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((B, H, S, D), dtype=np.float32),
            "k": rng.standard_normal((B, H, length, D), dtype=np.float32),
            "v": rng.standard_normal((B, H, length, D), dtype=np.float32)}


def _reference(x: dict, masked: bool) -> np.ndarray:
    scores = x["q"].astype(np.float64) @ x["k"].transpose(0, 1, 3, 2) * SCALE
    if masked:
        n = scores.shape[-1]
        scores = np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ x["v"]).transpose(0, 2, 1, 3).reshape(B, S, H * D)


def _run(model: ir.Model, x: dict, tmp_path) -> np.ndarray:
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    return ort_session(path).run(None, x)[0]


@pytest.mark.parametrize("masked,length", [(True, S), (False, S), (False, 11)])
def test_attention_becomes_one_multi_head_attention_with_the_same_numbers(masked, length, tmp_path):
    model = _graph(masked, length=length)
    x = _inputs(length)
    before = _run(model, x, tmp_path)
    result = LlmAttentionFusionPass(layers=1)(model)
    assert result.modified
    ops = [n.op_type for n in model.graph]
    assert ops == ["Transpose", "Constant", "Reshape", "MultiHeadAttention"]  # q to [B, S, H·d]; no mask nodes
    fused = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    assert fused.domain == "com.microsoft" and fused.attributes["num_heads"].value == H
    assert fused.attributes["unidirectional"].value == int(masked)
    assert fused.inputs[1] is model.graph.inputs[1] and fused.inputs[2] is model.graph.inputs[2]  # K, V as they are
    after = _run(model, x, tmp_path)
    np.testing.assert_allclose(before, _reference(x, masked), rtol=0, atol=1e-5)
    np.testing.assert_allclose(after, _reference(x, masked), rtol=0, atol=1e-5)


@pytest.mark.parametrize("how", ["anti-causal mask", "a finite fill"])
def test_a_mask_that_is_not_the_causal_one_is_not_fused(how):
    model = _graph(True, anti_causal=how == "anti-causal mask", fill=-1.0 if how == "a finite fill" else -np.inf)
    with pytest.raises(StructureError, match="0 of the 1 layers matched"):
        LlmAttentionFusionPass(layers=1)(model)
    assert count_fused(model) == 0 and "Where" in [n.op_type for n in model.graph]


def test_a_fused_graph_is_not_fused_twice():
    model = _graph(True)
    LlmAttentionFusionPass(layers=1)(model)
    with pytest.raises(ir.passes.PreconditionError, match="fused already"):
        LlmAttentionFusionPass(layers=1)(model)
