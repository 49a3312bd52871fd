"""The vlmprune.* custom ops inside ONNX Runtime sessions, against numpy references."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from kernel_helpers import (
    attention_like_qk,
    cosine_distances,
    ref_cls_scores,
    ref_divprune,
    ref_gather_summary,
    ref_topk,
    tied_scores,
)
from onnx import TensorProto, helper, numpy_helper

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("vlmprune", 1)]


def _model(nodes, inputs, outputs, opsets=OPSETS, initializer=None):
    graph = helper.make_graph(nodes, "vlmprune_test", inputs, outputs, initializer=initializer)
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


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
def test_token_prune_same_bits_for_any_thread_count_and_batch(ort_library, cpu, dtype):
    # The op splits each image into chunks of rows run on the pool in any order; the order of the
    # summary's sum is fixed by the chunk size alone, so 1 or 2 threads, an image alone or inside a
    # batch, and the single-threaded C ABI all give the same bits. N = 577 leaves a short last chunk.
    rng = np.random.default_rng(11)
    hidden = rng.standard_normal((3, 578, 1024)).astype(dtype)
    scores = rng.random((3, 577)).astype(np.float32)
    model = token_prune_model(dtype, keep=192)
    runs = {}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.register_custom_ops_library(str(ort_library))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for _ in range(2):  # repeated runs reuse the calling thread's buffer of partial sums
            runs[threads] = session.run(None, {"hidden": hidden, "scores": scores})
    tokens, kept = runs[2]
    np.testing.assert_array_equal(tokens, runs[1][0])
    np.testing.assert_array_equal(kept, ref_topk(scores, 192))
    alone, _ = _session(model, ort_library).run(None, {"hidden": hidden[1:2], "scores": scores[1:2]})
    np.testing.assert_array_equal(alone[0], tokens[1])
    np.testing.assert_array_equal(tokens, cpu.gather_summary(hidden, kept, has_cls=1))
    ref = ref_gather_summary(hidden, kept, has_cls=1)
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


def _score_plugin_model(**attrs):
    node = helper.make_node("VlmpClsScore", ["q", "k"], ["scores"], domain="trt.plugins", **attrs)
    return _model(
        [node],
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)],
    )


@pytest.mark.parametrize("k_transposed", [0, 1])
def test_cls_score_plugin_twin_is_the_int8_kernel(ort_library, k_transposed):
    """trt.plugins.VlmpClsScore (orin / xavier, --scorer int8) runs ClsAttentionScore's kernel: the same scores."""
    q, k = attention_like_qk(np.random.default_rng(32), 2, 6, 257, 64)
    k = np.ascontiguousarray(np.swapaxes(k, 2, 3)) if k_transposed else k
    kw = dict(scale=0.125, has_cls=1, int8=1, k_transposed=k_transposed)
    (twin,) = _session(_score_plugin_model(plugin_version="1", plugin_namespace="vlmprune", **kw), ort_library).run(
        None, {"q": q, "k": k})
    (op,) = _session(cls_score_model(np.float32, **kw), ort_library).run(None, {"q": q, "k": k})
    np.testing.assert_array_equal(twin, op)
    np.testing.assert_allclose(twin, ref_cls_scores(q, k, k_transposed=bool(k_transposed), int8=True, scale=0.125,
                                                    has_cls=1), rtol=1e-5, atol=1e-9)


def test_cls_score_plugin_twin_refuses_another_version(ort_library):
    model = _score_plugin_model(plugin_version="2", plugin_namespace="vlmprune", scale=0.125, has_cls=1, int8=1,
                                k_transposed=1)
    with pytest.raises(Exception, match="VlmpClsScore.*plugin_version"):
        _session(model, ort_library)


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
    """The contract's own torch reference (the methods' `reference` code), not only this folder's numpy one."""
    torch = pytest.importorskip("torch")
    from vlmprune.passes.methods.attention import cls_attention
    from vlmprune.passes.methods.cls import gather_summary
    from vlmprune.passes.methods.selection import select_topk

    b, h, t, dh, d, keep = 3, 4, 577, 16, 48, 192
    rng = np.random.default_rng(50)
    q, k = attention_like_qk(rng, b, h, t, dh)
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    scores = tied_scores(rng, b, t - 1)

    (attn,) = _session(cls_score_model(np.float32, scale=dh**-0.5, k_transposed=0), ort_library).run(
        None, {"q": q, "k": k})
    expect_attn = cls_attention(torch.from_numpy(q), torch.from_numpy(k), dh**-0.5).numpy()
    np.testing.assert_allclose(attn, expect_attn, rtol=1e-5, atol=1e-9)

    tokens, kept = _session(token_prune_model(np.float32, keep=keep), ort_library).run(
        None, {"hidden": hidden, "scores": scores})
    expect_kept = select_topk(torch.from_numpy(scores), keep)
    np.testing.assert_array_equal(kept, expect_kept.numpy())
    expect_tokens = gather_summary(torch.from_numpy(hidden), expect_kept).numpy()
    np.testing.assert_allclose(tokens, expect_tokens, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ DivPruneSelect

DIVPRUNE_OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid("vlmprune", 1)]


def divprune_model(**attrs):
    node = helper.make_node("DivPruneSelect", ["dist"], ["picks"], domain="vlmprune", **attrs)
    return _model([node], [helper.make_tensor_value_info("dist", TensorProto.FLOAT, None)],
                  [helper.make_tensor_value_info("picks", TensorProto.INT64, None)], opsets=DIVPRUNE_OPSETS)


def divprune_standard_model(n: int, keep: int):
    """The same greedy selection in standard ops, unrolled: the graph DivPruneSelect replaces
    (ReduceMin of dist + diag(+inf), ArgMax, GatherElements of the row, Min, ScatterElements of -inf)."""
    nodes, consts = [], []

    def const(name, array):
        consts.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(op_type, inputs, name, **attrs):
        nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def argmax(x, name):
        return op("ArgMax", [x], name, axis=-1, keepdims=1, select_last_index=0)  # [B, 1]

    def row(pick, name):  # dist[b, pick[b], :] -> [B, N]
        index = op("Expand", [op("Unsqueeze", [pick, axes_last], f"{name}_col"), row_shape], f"{name}_index")
        return op("Squeeze", [op("GatherElements", ["dist", index], f"{name}_gather", axis=1), axes_1], name)

    def mark(mask, pick, name):  # -inf written at pick
        fill = op("Expand", [neg_inf, op("Shape", [pick], f"{name}_shape")], f"{name}_fill")
        return op("ScatterElements", [mask, pick, fill], name, axis=1)

    diag = const("diag", np.where(np.eye(n, dtype=bool), np.inf, 0.0).astype(np.float32))
    axes_1, axes_last = const("axes_1", np.array([1], np.int64)), const("axes_last", np.array([-1], np.int64))
    row_shape = const("row_shape", np.array([1, 1, n], np.int64))
    neg_inf = const("neg_inf", np.array(-np.inf, np.float32))
    first = op("ReduceMin", [op("Add", ["dist", diag], "off_diagonal"), axes_1], "nearest_other", keepdims=0)
    picks = [argmax(first, "pick0")]
    running = row(picks[0], "row0")
    zeros = op("ConstantOfShape", [op("Shape", [first], "first_shape")], "zeros",
               value=numpy_helper.from_array(np.zeros(1, np.float32)))
    mask = mark(zeros, picks[0], "mask0")
    for i in range(1, keep):
        picks.append(argmax(op("Add", [running, mask], f"candidates{i}"), f"pick{i}"))
        running = op("Min", [running, row(picks[i], f"row{i}")], f"running{i}")
        mask = mark(mask, picks[i], f"mask{i}")
    if keep > 1:
        op("Concat", picks, "picks", axis=1)
    else:
        op("Identity", picks, "picks")
    return _model(nodes, [helper.make_tensor_value_info("dist", TensorProto.FLOAT, ["B", n, n])],
                  [helper.make_tensor_value_info("picks", TensorProto.INT64, ["B", keep])],
                  opsets=DIVPRUNE_OPSETS, initializer=consts)


def _divprune_dist(kind: str, rng: np.random.Generator, b: int, n: int) -> np.ndarray:
    if kind == "cosine":
        return cosine_distances(rng, b, n)
    if kind == "random":
        return rng.random((b, n, n), dtype=np.float32)
    return (rng.integers(0, 3, size=(b, n, n)) / 2).astype(np.float32)


@pytest.mark.parametrize("kind", ["cosine", "random", "tied"])
@pytest.mark.parametrize("n,keep", [(1, 1), (2, 2), (7, 3), (7, 7), (576, 1), (576, 192), (576, 576)])
@pytest.mark.parametrize("b", [1, 3])
def test_divprune_select_matches_reference(ort_library, b, n, keep, kind):
    dist = _divprune_dist(kind, np.random.default_rng(7 * n + keep + b), b, n)
    (picks,) = _session(divprune_model(keep=keep), ort_library).run(None, {"dist": dist})
    assert picks.dtype == np.int64 and picks.shape == (b, keep)
    np.testing.assert_array_equal(picks, ref_divprune(dist, keep))


@pytest.mark.parametrize("kind", ["cosine", "random", "tied", "equal", "minus_inf"])
@pytest.mark.parametrize("n,keep", [(1, 1), (7, 7), (50, 12), (576, 16)])
def test_divprune_select_matches_the_standard_op_graph(ort_library, n, keep, kind):
    rng = np.random.default_rng(n + keep)
    if kind == "equal":
        dist = np.full((3, n, n), 0.5, np.float32)
    elif kind == "minus_inf":  # off-diagonal -inf: candidates run out, ties go to index 0
        dist = rng.random((3, n, n), dtype=np.float32)
        dist[(rng.random(dist.shape) < 0.1) & ~np.eye(n, dtype=bool)] = -np.inf
    else:
        dist = _divprune_dist(kind, rng, 3, n)
    (fused,) = _session(divprune_model(keep=keep), ort_library).run(None, {"dist": dist})
    standard = ort.InferenceSession(divprune_standard_model(n, keep).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    (expect,) = standard.run(None, {"dist": dist})
    np.testing.assert_array_equal(fused, expect)
    np.testing.assert_array_equal(fused, ref_divprune(dist, keep))


def test_divprune_select_splits_the_batch_over_threads(ort_library):
    dist = cosine_distances(np.random.default_rng(60), 8, 576)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(ort_library))
    session = ort.InferenceSession(divprune_model(keep=192).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    for _ in range(3):  # repeated runs reuse each thread's scratch
        (picks,) = session.run(None, {"dist": dist})
        np.testing.assert_array_equal(picks, ref_divprune(dist, 192))


@pytest.mark.parametrize("keep", [8, 100])
def test_divprune_select_keep_above_n_fails_clearly(ort_library, keep):
    message = _run_error(divprune_model(keep=keep), ort_library, {"dist": np.zeros((1, 7, 7), np.float32)})
    assert f"vlmprune.DivPruneSelect: keep={keep} must satisfy 1 <= keep <= N, the 7 tokens of dist [1, 7, 7]" in message


@pytest.mark.parametrize("shape", [(7, 7), (1, 7, 6), (1, 1, 7, 7)])
def test_divprune_select_wrong_shape_fails_clearly(ort_library, shape):
    message = _run_error(divprune_model(keep=2), ort_library, {"dist": np.zeros(shape, np.float32)})
    got = "[" + ", ".join(map(str, shape)) + "]"
    assert f"vlmprune.DivPruneSelect: dist must be [B, N, N], got {got}" in message


def test_divprune_select_empty_batch(ort_library):
    (picks,) = _session(divprune_model(keep=3), ort_library).run(None, {"dist": np.zeros((0, 7, 7), np.float32)})
    assert picks.shape == (0, 3) and picks.dtype == np.int64


@pytest.mark.parametrize("attrs,needle", [({}, "attribute 'keep' (int) is required"),
                                          ({"keep": 0}, "attribute 'keep' must be >= 1, got 0")])
def test_divprune_select_bad_attributes_fail_at_session_creation(ort_library, attrs, needle):
    with pytest.raises(Exception, match="vlmprune.DivPruneSelect") as info:
        _session(divprune_model(**attrs), ort_library)
    assert needle in str(info.value)


def test_divprune_select_agrees_with_the_torch_reference(ort_library):
    """The divprune method's own greedy (torch), on its own 1 - cosine distances."""
    torch = pytest.importorskip("torch")
    from vlmprune.passes.methods.divprune import distances, greedy

    tokens = torch.from_numpy(np.random.default_rng(61).standard_normal((3, 576, 64)).astype(np.float32))
    dist = distances(tokens)
    expect, _ = greedy(dist, 64)
    (picks,) = _session(divprune_model(keep=64), ort_library).run(None, {"dist": dist.numpy()})
    np.testing.assert_array_equal(picks, expect.numpy())
