"""passes.llm_rotary_fusion on q's and K's rotation written as torch.onnx spells transformers' rotary embedding: the
angles cat(pos·inv_freq, pos·inv_freq) (two Muls, as torch.export leaves them), Cos and Sin times the attention
scaling, one Unsqueeze of each serving both rotations, x·cos + cat(-x[..., d/2:], x[..., :d/2])·sin. Checked: the op
list after the rewrite, ONNX Runtime's numbers against numpy at a fixed seed with batch rows at different positions
(gaps included), the ONNX checker, and the forms left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from vlmprune.passes.llm_rotary_fusion import LlmRotaryFusionPass, count_fused
from vlmprune.targets.runtime import ort_session

B, H, HKV, S, D = 2, 4, 2, 5, 8
SCALING = 0.9
END = np.iinfo(np.int64).max


def _graph(same_halves: bool = True, lower_start: int = 0) -> ir.Model:
    i64 = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    inits = [helper.make_tensor("inv_freq", TensorProto.FLOAT, [D // 2], inv),
             helper.make_tensor("other_freq", TensorProto.FLOAT, [D // 2], inv * 2),
             helper.make_tensor("scaling", TensorProto.FLOAT, [], [SCALING]),
             i64("axis1", [1]), i64("hi_start", [D // 2]), i64("hi_end", [END]), i64("lo_start", [lower_start]),
             i64("lo_end", [D // 2 + lower_start]), i64("last", [3]), i64("one", [1])]
    nodes = [helper.make_node("Mul", ["pos", "inv_freq"], ["a1"]),
             helper.make_node("Mul", ["pos", "inv_freq" if same_halves else "other_freq"], ["a2"]),
             helper.make_node("Concat", ["a1", "a2"], ["angles"], axis=-1)]
    for trig in ("Cos", "Sin"):
        low = trig.lower()
        nodes += [helper.make_node(trig, ["angles"], [f"{low}_raw"]),
                  helper.make_node("Mul", [f"{low}_raw", "scaling"], [low]),
                  helper.make_node("Unsqueeze", [low, "axis1"], [f"{low}4"])]  # one for q and K alike
    for x in ("q", "k"):
        nodes += [helper.make_node("Slice", [x, "hi_start", "hi_end", "last", "one"], [f"{x}_hi"]),
                  helper.make_node("Slice", [x, "lo_start", "lo_end", "last", "one"], [f"{x}_lo"]),
                  helper.make_node("Neg", [f"{x}_hi"], [f"{x}_neg"]),
                  helper.make_node("Concat", [f"{x}_neg", f"{x}_lo"], [f"{x}_turned"], axis=-1),
                  helper.make_node("Mul", [x, "cos4"], [f"{x}_c"]),
                  helper.make_node("Mul", [f"{x}_turned", "sin4"], [f"{x}_s"]),
                  helper.make_node("Add", [f"{x}_c", f"{x}_s"], [f"{x}_rot"])]
    graph = helper.make_graph(
        nodes, "rotary",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, H, S, D]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, HKV, S, D]),
         helper.make_tensor_value_info("pos", TensorProto.FLOAT, [B, S, 1])],
        [helper.make_tensor_value_info("q_rot", TensorProto.FLOAT, [B, H, S, D]),
         helper.make_tensor_value_info("k_rot", TensorProto.FLOAT, [B, HKV, S, D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def _inputs() -> dict:
    rng = np.random.default_rng(0)
    positions = np.stack([np.arange(S), np.array([0, 1, 7, 8, 30])]).astype(np.float32)  # row 2: a gap, as pruning
    return {"q": rng.standard_normal((B, H, S, D), dtype=np.float32),
            "k": rng.standard_normal((B, HKV, S, D), dtype=np.float32), "pos": positions[..., None]}


def _reference(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    angles = positions.astype(np.float64)[..., None] * inv  # [B, S, d/2]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None] * SCALING
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None] * SCALING
    turned = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + turned * sin


def _run(model: ir.Model, x: dict, tmp_path) -> list[np.ndarray]:
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    return ort_session(path).run(None, x)


def test_both_rotations_become_rotary_embedding_with_the_same_numbers(tmp_path):
    model, x = _graph(), _inputs()
    before = _run(model, x, tmp_path)
    assert LlmRotaryFusionPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert count_fused(model) == 2 and "Neg" not in ops and "Concat" in ops  # the angles' Concat stays
    fused = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert all(n.domain == "com.microsoft" for n in fused)
    after = _run(model, x, tmp_path)
    for got, want, name in zip(after, before, ("q", "k")):
        np.testing.assert_allclose(want, _reference(x[name], x["pos"][..., 0]), rtol=0, atol=1e-5)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["cos halves that differ", "a lower half that does not start at 0"])
def test_other_forms_stay_as_exported(how):
    model = _graph(same_halves="differ" not in how, lower_start=1 if "start" in how else 0)
    assert not LlmRotaryFusionPass()(model).modified
    assert count_fused(model) == 0 and [n.op_type for n in model.graph].count("Neg") == 2


def test_a_fused_graph_is_not_fused_twice():
    model = _graph()
    LlmRotaryFusionPass()(model)
    with pytest.raises(ir.passes.PreconditionError, match="fused already"):
        LlmRotaryFusionPass()(model)
