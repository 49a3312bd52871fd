"""passes.llm_gqa_fusion on one prefill attention written as the fused LLM graph holds it: the rotated q merged to
[B, S, H·d], K and V [B, Hkv, S, d] repeated to H heads as torch.onnx spells repeat_kv (Unsqueeze at axis 2, Expand,
Reshape), a com.microsoft.MultiHeadAttention with unidirectional 1. Checked: the op list after the rewrite, ONNX
Runtime's numbers against numpy at a fixed seed (GQA's head mapping is repeat_kv's), the ONNX checker, and the forms
left alone (a decode step's unmasked attention, an additive mask, heads repeated along another axis)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from vlmprune.passes.llm_gqa_fusion import LlmGroupQueryAttentionPass, count_fused
from vlmprune.targets.runtime import ort_session

B, H, HKV, S, D = 2, 6, 2, 7, 8  # D a multiple of 8, as ONNX Runtime's GroupQueryAttention asks
SCALE = 0.3


def _graph(kv_heads: int = HKV, unidirectional: int = 1, axis: int = 2, bias: bool = False, d: int = D) -> ir.Model:
    groups = H // kv_heads
    i64 = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes, inits = [], [i64("axes", [axis])]
    heads = {}
    for name in ("k", "v"):
        if kv_heads == H:
            heads[name] = name
            continue
        five = [B, kv_heads, groups, S, d] if axis == 2 else [B, groups, kv_heads, S, d]
        inits += [i64(f"{name}_shape5", five), i64(f"{name}_shape4", [B, H, S, d])]
        nodes += [helper.make_node("Unsqueeze", [name, "axes"], [f"{name}5"]),
                  helper.make_node("Expand", [f"{name}5", f"{name}_shape5"], [f"{name}x"]),
                  helper.make_node("Reshape", [f"{name}x", f"{name}_shape4"], [f"{name}_heads"])]
        heads[name] = f"{name}_heads"
    inputs = ["q", heads["k"], heads["v"]] + (["", "", "bias"] if bias else [])
    nodes.append(helper.make_node("MultiHeadAttention", inputs, ["out"], domain="com.microsoft", num_heads=H,
                                  scale=SCALE, unidirectional=unidirectional))
    graph_inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, S, H * d]),
                    helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, kv_heads, S, d]),
                    helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, kv_heads, S, d])]
    if bias:
        graph_inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 1, S, S]))
    graph = helper.make_graph(nodes, "prefill_attention", graph_inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, S, H * d])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def _inputs(kv_heads: int = HKV) -> dict:
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((B, S, H * D), dtype=np.float32),
            "k": rng.standard_normal((B, kv_heads, S, D), dtype=np.float32),
            "v": rng.standard_normal((B, kv_heads, S, D), dtype=np.float32)}


def _reference(x: dict) -> np.ndarray:
    """Causal attention with query head h reading key/value head h // (H / Hkv), as repeat_kv lays them out."""
    groups = H // x["k"].shape[1]
    q = x["q"].astype(np.float64).reshape(B, S, H, D).transpose(0, 2, 1, 3)
    k, v = np.repeat(x["k"], groups, axis=1), np.repeat(x["v"], groups, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * SCALE
    scores = np.where(np.arange(S)[None, :] > np.arange(S)[:, None], -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, H * D)


def _run(model: ir.Model, x: dict, tmp_path) -> np.ndarray:
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    return ort_session(path).run(None, x)[0]


@pytest.mark.parametrize("kv_heads", [HKV, 1, H])
def test_causal_attention_over_shared_heads_becomes_group_query_attention(kv_heads, tmp_path):
    model, x = _graph(kv_heads), _inputs(kv_heads)
    before = _run(model, x, tmp_path)
    assert LlmGroupQueryAttentionPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert "MultiHeadAttention" not in ops and "Unsqueeze" not in ops and ops.count("GroupQueryAttention") == 1
    fused = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert fused.domain == "com.microsoft"
    assert (fused.attributes["num_heads"].value, fused.attributes["kv_num_heads"].value) == (H, kv_heads)
    assert fused.attributes["scale"].value == pytest.approx(SCALE)
    assert "do_rotary" not in fused.attributes  # the graph's rotary embedding stays where it is
    after = _run(model, x, tmp_path)
    np.testing.assert_allclose(before, _reference(x), rtol=0, atol=1e-5)
    np.testing.assert_allclose(after, _reference(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("how", ["the decode step's unmasked attention", "an additive mask",
                                 "a head size ONNX Runtime's kernel refuses"])
def test_other_forms_stay_multi_head_attention(how):
    model = _graph(unidirectional=0 if "decode" in how else 1, bias="additive" in how, d=12 if "size" in how else D)
    assert not LlmGroupQueryAttentionPass()(model).modified
    assert count_fused(model) == 0 and [n.op_type for n in model.graph][-1] == "MultiHeadAttention"


def test_heads_repeated_along_another_axis_are_not_taken_for_shared_ones(tmp_path):
    """Unsqueeze at axis 1 interleaves the heads otherwise than repeat_kv: the repeated value is then read as H heads
    of its own (kv_num_heads H), never as the Hkv heads it came from, and the numbers stay the MultiHeadAttention's."""
    model, x = _graph(axis=1), _inputs()
    before = _run(model, x, tmp_path)
    assert LlmGroupQueryAttentionPass()(model).modified
    fused = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert fused.attributes["kv_num_heads"].value == H and "Unsqueeze" in [n.op_type for n in model.graph]
    np.testing.assert_allclose(_run(model, x, tmp_path), before, rtol=0, atol=1e-6)


def test_a_graph_with_group_query_attention_is_not_fused_twice():
    model = _graph()
    LlmGroupQueryAttentionPass()(model)
    with pytest.raises(ir.passes.PreconditionError, match="already has GroupQueryAttention"):
        LlmGroupQueryAttentionPass()(model)
