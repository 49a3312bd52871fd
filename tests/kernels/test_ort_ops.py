"""The vlmprune.* custom ops inside ONNX Runtime sessions, against numpy references."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from kernel_helpers import attention_like_qk, ref_cls_scores, ref_gather_summary, ref_topk, tied_scores
from onnx import TensorProto, helper

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("vlmprune", 1)]


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "vlmprune_test", inputs, outputs)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=8)


def _session(model, library) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def token_prune_model(dtype, hidden_elem=None, **attrs):
    elem = hidden_elem if hidden_elem is not None else ELEM[np.dtype(dtype)]
    node = helper.make_node("TokenPrune", ["hidden", "scores"], ["tokens", "kept"], domain="vlmprune", **attrs)
    return _model(
        [node],
        [helper.make_tensor_value_info("hidden", elem, ["B", "T", "D"]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "N"])],
        [helper.make_tensor_value_info("tokens", elem, None),
         helper.make_tensor_value_info("kept", TensorProto.INT64, None)],
    )


def cls_score_model(dtype, **attrs):
    elem = ELEM[np.dtype(dtype)]
    node = helper.make_node("ClsAttentionScore", ["q", "k"], ["scores"], domain="vlmprune", **attrs)
    return _model(
        [node],
        [helper.make_tensor_value_info("q", elem, None), helper.make_tensor_value_info("k", elem, None)],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)],
    )


# ------------------------------------------------------------------ TokenPrune


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n", [576, 1024])
@pytest.mark.parametrize("b", [1, 3])
def test_token_prune_matches_reference(ort_library, b, n, dtype):
    rng = np.random.default_rng(b * n)
    d, keep = 96, n // 3
    hidden = rng.standard_normal((b, 1 + n, d)).astype(dtype)
    scores = tied_scores(rng, b, n)
    tokens, kept = _session(token_prune_model(dtype, keep=keep), ort_library).run(
        None, {"hidden": hidden, "scores": scores})
    expect_kept = ref_topk(scores, keep)
    np.testing.assert_array_equal(kept, expect_kept)
    ref = ref_gather_summary(hidden, expect_kept, has_cls=1)
    assert tokens.dtype == dtype and tokens.shape == (b, keep + 2, d)
    np.testing.assert_array_equal(tokens[:, :-1], ref[:, :-1])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(tokens[:, -1].astype(np.float64), ref[:, -1].astype(np.float64), **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_token_prune_wide_rows_split_over_threads(ort_library, dtype):
    # D = 1024 with B = 3 takes the column-split path of the op (several tasks per image).
    rng = np.random.default_rng(11)
    hidden = rng.standard_normal((3, 577, 1024)).astype(dtype)
    scores = rng.random((3, 576)).astype(np.float32)
    tokens, kept = _session(token_prune_model(dtype, keep=192), ort_library).run(
        None, {"hidden": hidden, "scores": scores})
    ref = ref_gather_summary(hidden, ref_topk(scores, 192), has_cls=1)
    np.testing.assert_array_equal(tokens[:, :-1], ref[:, :-1])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(tokens[:, -1].astype(np.float64), ref[:, -1].astype(np.float64), **tol)


def test_token_prune_without_cls(ort_library):
    rng = np.random.default_rng(12)
    hidden = rng.standard_normal((2, 64, 40)).astype(np.float32)
    scores = tied_scores(rng, 2, 64)
    tokens, kept = _session(token_prune_model(np.float32, keep=16, has_cls=0), ort_library).run(
        None, {"hidden": hidden, "scores": scores})
    np.testing.assert_array_equal(kept, ref_topk(scores, 16))
    np.testing.assert_allclose(tokens, ref_gather_summary(hidden, kept, has_cls=0), rtol=1e-5, atol=1e-6)


def _run_error(model, library, feeds) -> str:
    with pytest.raises(Exception) as info:  # onnxruntime raises its own Fail / InvalidArgument types
        _session(model, library).run(None, feeds)
    return str(info.value)


@pytest.mark.parametrize("keep", [576, 600])
def test_token_prune_keep_not_below_n_fails_clearly(ort_library, keep):
    feeds = {"hidden": np.zeros((1, 577, 8), np.float32), "scores": np.zeros((1, 576), np.float32)}
    message = _run_error(token_prune_model(np.float32, keep=keep), ort_library, feeds)
    assert f"vlmprune.TokenPrune: keep={keep} must satisfy 1 <= keep < N, the 576 patch tokens" in message


def test_token_prune_scores_shape_mismatch_fails_clearly(ort_library):
    feeds = {"hidden": np.zeros((2, 577, 8), np.float32), "scores": np.zeros((2, 577), np.float32)}
    message = _run_error(token_prune_model(np.float32, keep=10), ort_library, feeds)
    assert "scores must be [B, T - has_cls] = [2, 576]" in message and "got [2, 577]" in message


def test_token_prune_rejects_integer_hidden(ort_library):
    feeds = {"hidden": np.zeros((1, 9, 4), np.int32), "scores": np.zeros((1, 8), np.float32)}
    message = _run_error(token_prune_model(None, hidden_elem=TensorProto.INT32, keep=2), ort_library, feeds)
    assert "input 'hidden' must be float or float16" in message


@pytest.mark.parametrize("attrs,needle", [({}, "attribute 'keep' (int) is required"),
                                          ({"keep": 0}, "attribute 'keep' must be >= 1"),
                                          ({"keep": 4, "has_cls": 2}, "attribute 'has_cls' must be 0 or 1")])
def test_token_prune_bad_attributes_fail_at_session_creation(ort_library, attrs, needle):
    with pytest.raises(Exception, match="vlmprune.TokenPrune") as info:
        _session(token_prune_model(np.float32, **attrs), ort_library)
    assert needle in str(info.value)


# ----------------------------------------------------------- ClsAttentionScore


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("transposed", [1, 0])
@pytest.mark.parametrize("b", [1, 3])
def test_cls_attention_score_matches_reference(ort_library, b, transposed, dtype):
    q, k = attention_like_qk(np.random.default_rng(20 + b), b, 4, 577, 32)
    q, k = q.astype(dtype), k.astype(dtype)
    k_in = np.ascontiguousarray(np.swapaxes(k, 2, 3)) if transposed else k
    scale = 32**-0.5
    (scores,) = _session(cls_score_model(dtype, scale=scale, k_transposed=transposed), ort_library).run(
        None, {"q": q, "k": k_in})
    assert scores.dtype == np.float32 and scores.shape == (b, 576)
    expect = ref_cls_scores(q, k_in, k_transposed=bool(transposed), scale=scale, has_cls=1)
    np.testing.assert_allclose(scores, expect, rtol=1e-5, atol=1e-9)


def test_cls_attention_score_accepts_only_the_cls_query_row(ort_library):
    q, k = attention_like_qk(np.random.default_rng(30), 2, 4, 197, 16)
    k_t = np.ascontiguousarray(np.swapaxes(k, 2, 3))
    session = _session(cls_score_model(np.float32, scale=0.25), ort_library)
    (full,) = session.run(None, {"q": q, "k": k_t})
    (row,) = session.run(None, {"q": np.ascontiguousarray(q[:, :, :1]), "k": k_t})
    np.testing.assert_array_equal(full, row)


def test_cls_attention_score_int8(ort_library):
    q, k = attention_like_qk(np.random.default_rng(31), 3, 8, 577, 64)
    kw = dict(scale=64**-0.5, has_cls=1)
    (scores,) = _session(cls_score_model(np.float32, int8=1, k_transposed=0, **kw), ort_library).run(
        None, {"q": q, "k": k})
    np.testing.assert_allclose(scores, ref_cls_scores(q, k, k_transposed=False, int8=True, **kw), rtol=1e-5, atol=1e-9)


def test_cls_attention_score_layout_mismatch_fails_clearly(ort_library):
    q = np.zeros((1, 2, 5, 4), np.float32)
    message = _run_error(cls_score_model(np.float32), ort_library, {"q": q, "k": q})  # k_transposed=1 by default
    assert "vlmprune.ClsAttentionScore: k must be [B, H, dh, T] = [1, 2, 4, 4]" in message


# ------------------------------------------------------------------- together


def test_score_then_prune_pipeline(ort_library):
    """The fused graph's shape: scores from Q/K, then TopK + gather + summary."""
    b, h, t, dh, d, keep = 3, 4, 577, 16, 64, 144
    rng = np.random.default_rng(40)
    q, k = attention_like_qk(rng, b, h, t, dh)
    k_t = np.ascontiguousarray(np.swapaxes(k, 2, 3))
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    nodes = [
        helper.make_node("ClsAttentionScore", ["q", "k"], ["scores"], domain="vlmprune", scale=dh**-0.5),
        helper.make_node("TokenPrune", ["hidden", "scores"], ["tokens", "kept"], domain="vlmprune", keep=keep),
    ]
    f32 = TensorProto.FLOAT
    model = _model(
        nodes,
        [helper.make_tensor_value_info(n, f32, None) for n in ("q", "k", "hidden")],
        [helper.make_tensor_value_info("tokens", f32, None), helper.make_tensor_value_info("kept", TensorProto.INT64, None),
         helper.make_tensor_value_info("scores", f32, None)],
    )
    tokens, kept, scores = _session(model, ort_library).run(None, {"q": q, "k": k_t, "hidden": hidden})
    expect = ref_cls_scores(q, k_t, k_transposed=True, scale=dh**-0.5, has_cls=1)
    np.testing.assert_allclose(scores, expect, rtol=1e-5, atol=1e-9)
    # Selection is checked on the op's own scores: fp64 reference scores may order near-ties differently.
    np.testing.assert_array_equal(kept, ref_topk(scores, keep))
    np.testing.assert_allclose(tokens, ref_gather_summary(hidden, kept, has_cls=1), rtol=1e-5, atol=1e-6)


def test_custom_ops_agree_with_the_torch_reference(ort_library):
    """The contract's own reference (vlmprune.compiler.reference), not only this folder's numpy one."""
    torch = pytest.importorskip("torch")
    from vlmprune.compiler import reference

    b, h, t, dh, d, keep = 3, 4, 577, 16, 48, 192
    rng = np.random.default_rng(50)
    q, k = attention_like_qk(rng, b, h, t, dh)
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    scores = tied_scores(rng, b, t - 1)

    (attn,) = _session(cls_score_model(np.float32, scale=dh**-0.5, k_transposed=0), ort_library).run(
        None, {"q": q, "k": k})
    expect_attn = reference.cls_attention(torch.from_numpy(q), torch.from_numpy(k), dh**-0.5).numpy()
    np.testing.assert_allclose(attn, expect_attn, rtol=1e-5, atol=1e-9)

    tokens, kept = _session(token_prune_model(np.float32, keep=keep), ort_library).run(
        None, {"hidden": hidden, "scores": scores})
    expect_kept = reference.select_topk(torch.from_numpy(scores), keep)
    np.testing.assert_array_equal(kept, expect_kept.numpy())
    expect_tokens = reference.gather_summary(torch.from_numpy(hidden), expect_kept).numpy()
    np.testing.assert_allclose(tokens, expect_tokens, rtol=1e-5, atol=1e-6)
