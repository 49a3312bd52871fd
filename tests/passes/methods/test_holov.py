"""holov: the crops, the official arithmetic written plainly, the surplus rule, the graph at batch 1 and 3, refusals.

The oracle below is HoloV for one image as the official code computes it (obananas/HoloV,
llava/model/utils.py and qwen-model-HoloV/utils.py: lists, loops, float64), with vlmprune's
stated deviations only: the surplus of an over-full crop goes to the others in weight order
instead of zero padding, ties go to the lower index, kept tokens come out in raster order, and
the context token (the pruned tokens' mean) follows them. It shares no code with the module.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import pytest
import torch

from method_helpers import finish, session
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.graph.structure import AttentionBlock, TowerStructure
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.holov import crop_groups, default_partitions

HEADS, DH = 2, 4


def official(x: np.ndarray, a: np.ndarray, partitions: int, keep: int):
    """(kept indices ascending, context token, budgets, token scores [N]) for one image: x [N, D], a [N]."""
    n = len(x)
    q, r = divmod(n, partitions)
    crops, start = [], 0
    for p in range(partitions):
        size = q + (1 if p < r else 0)
        if size > 0:
            crops.append(list(range(start, start + size)))
        start += size
    scores, token_scores = [], []
    for idx in crops:
        if len(idx) <= 1:
            scores.append(float(np.mean(a[idx])))
            token_scores += list(a[idx])  # the official one-token crop: its attention, unscaled
            continue
        f = x[idx] / (np.linalg.norm(x[idx], axis=1, keepdims=True) + 1e-6)
        s = (f @ f.T) * (1 - np.eye(len(idx)))
        mean = s.sum(1) / (len(idx) - 1)
        var = ((s - mean[:, None]) ** 2).sum(1) / (len(idx) - 1)
        att = a[idx] * 1e3
        scale = np.mean(np.abs(att)) / (np.mean(np.abs(var)) + 1e-6)
        token_scores += list(att + 0.09 * var * scale)
        scores.append(float(np.mean(att + 0.09 * var * scale)))
    w = np.array(scores) / (sum(scores) + 1e-6)
    alloc = [math.floor(v * keep) for v in w]
    order = sorted(range(len(crops)), key=lambda c: (-w[c], c))
    for c in order[: keep - sum(alloc)]:
        alloc[c] += 1
    surplus = sum(max(0, alloc[c] - len(crops[c])) for c in range(len(crops)))
    alloc = [min(alloc[c], len(crops[c])) for c in range(len(crops))]
    for c in order:  # the deviation: the surplus to the others, largest weight first, instead of zero padding
        give = min(surplus, len(crops[c]) - alloc[c])
        alloc[c] += give
        surplus -= give
    kept = []
    for c, idx in enumerate(crops):
        kept += sorted(idx, key=lambda i: (-a[i], i))[: alloc[c]]
    kept.sort()
    pruned = [i for i in range(n) if i not in kept]
    return kept, x[pruned].mean(0), alloc, np.array(token_scores)


def cls_row(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[B, N]: mean over heads of softmax(q_cls · kᵀ · scale), patch keys."""
    logits = np.einsum("bhd,bhtd->bht", q[:, :, 0].astype(np.float64), k.astype(np.float64)) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).mean(1)[:, 1:]


def inputs(seed: int, b: int, n: int, d: int, focus: tuple[int, int] | None = None, sharp: float = 1.0):
    """Clustered tokens, and Q, K for 1 + N keys; focus: a range of keys the [CLS] query prefers."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((6, d))
    x = (centres[rng.integers(0, 6, size=(b, n))] + 0.5 * rng.standard_normal((b, n, d))).astype(np.float32)
    q = rng.standard_normal((b, HEADS, n + 1, DH)).astype(np.float32) * sharp
    k = rng.standard_normal((b, HEADS, n + 1, DH)).astype(np.float32)
    if focus is not None:
        k[:, :, 1 + focus[0]: 1 + focus[1]] = q[:, :, :1] * 3.0
    return x, q, k


def holov_graph(n: int, d: int, keep: int, text: bool = False, **options):
    """(method, params, model): (hidden [b, N, D], q, k [b, H, 1+N, dh], with text the prompt's text_embeds
    [b, T, D]) -> (tokens, kept, token scores), holov's nodes only."""
    method = get_method("holov")
    params = method.parse(keep, options)
    f32 = ir.TensorType(ir.DataType.FLOAT)
    hidden = ir.Value(name="hidden", type=f32, shape=ir.Shape(["batch", n, d]))
    q = ir.Value(name="q", type=f32, shape=ir.Shape(["batch", HEADS, n + 1, DH]))
    k = ir.Value(name="k", type=f32, shape=ir.Shape(["batch", HEADS, n + 1, DH]))
    prompt = [ir.Value(name="text_embeds", type=f32, shape=ir.Shape(["batch", "text_tokens", d]))] if text else []
    out = ir.Value(name="block_out", shape=ir.Shape(["batch", n + 1, 8]))  # what the block's output shows: 1+N
    block = AttentionBlock(1, ir.node("Attention", [q, k]), q, k, False, [], DH ** -0.5, out)
    graph = ir.Graph([hidden, q, k, *prompt], [], nodes=[], name="holov", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/holov")
    site = GraphInputs(hidden, False, n, None, TowerStructure([block], None, None, None), 0,
                       text=prompt[0] if prompt else None)
    tokens, kept = method.emit(b, params, site, "standard")
    scores = next(out for node in b.nodes for out in node.outputs if out.name == "vlmprune/holov/token_score")
    return method, params, finish(graph, b, tokens, kept, scores)  # the token scores too, to check the variance term


def run(model, x, q, k, **feeds):
    tokens, kept, scores = session(model).run(None, {"hidden": x, "q": q, "k": k, **feeds})
    return tokens, kept, scores


def reference(method, params, x, q, k):
    with torch.inference_mode():
        return method.reference(params, SiteTensors(torch.from_numpy(x), False, torch.from_numpy(q),
                                                    torch.from_numpy(k), DH ** -0.5))


def test_default_partitions_and_crops():
    assert default_partitions(576, 64) == 16  # the official LLaVA setting, P = 16 for K = 64 of 576
    assert default_partitions(576, 192) == 5 and default_partitions(576, 576 // 2) == 3
    assert default_partitions(64, 16) == 7
    assert crop_groups(64, 7) == [(0, 1, 10), (10, 6, 9)]  # the first N mod P crops hold one token more
    assert crop_groups(64, 8) == [(0, 8, 8)]
    assert crop_groups(12, 100) == [(0, 12, 1)]  # empty crops skipped, as the official code does


@pytest.mark.parametrize("n,keep,options", [(64, 16, {}), (64, 16, {"partitions": 8}), (48, 8, {}),
                                            (12, 2, {}), (12, 5, {"partitions": 100}), (40, 30, {"partitions": 3})])
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_and_reference_equal_the_official_arithmetic(n, keep, options, batch):
    d = 16
    x, q, k = inputs(n + keep, batch, n, d)
    method, params, model = holov_graph(n, d, keep, **options)
    partitions = options.get("partitions", default_partitions(n, keep))
    a = cls_row(q, k, DH ** -0.5)
    ref = reference(method, params, x, q, k)
    tokens, kept, scores = run(model, x, q, k)
    for i in range(batch):
        want, context, _, token_scores = official(x[i].astype(np.float64), a[i], partitions, keep)
        # The similarity variance enters the token scores (rescaled per crop): compared on their own, since
        # the rescale makes its crop mean 0.09 · mean|1000·a| whatever it is (see the module docstring).
        np.testing.assert_allclose(ref.trace["token_scores"][i].numpy(), token_scores, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(scores[i], token_scores, rtol=1e-4, atol=1e-4)
        assert ref.kept[i].tolist() == want
        assert kept[i].tolist() == want
        np.testing.assert_allclose(tokens[i, :keep], x[i, want], atol=1e-6)
        np.testing.assert_allclose(tokens[i, keep], context, atol=1e-5)
    assert tokens.shape == (batch, keep + 1, d) and kept.dtype == np.int64
    np.testing.assert_allclose(tokens, ref.tokens.numpy(), atol=1e-6)
    ops = {node.op_type for node in model.graph}
    assert not ops & {"Loop", "CumSum", "NonZero", "If"}, ops


def test_an_over_full_crop_gives_its_surplus_to_the_others():
    n, keep, d = 32, 24, 16  # 4 crops of 8; the [CLS] query looks at crop 0, whose share of K exceeds 8
    x, q, k = inputs(5, 2, n, d, focus=(0, 8))
    method, params, model = holov_graph(n, d, keep, partitions=4)
    ref = reference(method, params, x, q, k)
    a = cls_row(q, k, DH ** -0.5)
    budgets = ref.trace["budgets"]
    assert budgets.sum(-1).tolist() == [keep, keep] and (budgets[:, 0] == 8).all()
    tokens, kept, _ = run(model, x, q, k)
    for i in range(2):
        share = ref.trace["weights"][i, 0].item() * keep
        assert math.floor(share) > 8  # the official code would pad with zero tokens here
        want, _, alloc, _ = official(x[i].astype(np.float64), a[i], 4, keep)
        assert alloc == budgets[i].long().tolist() and kept[i].tolist() == want == ref.kept[i].tolist()
        assert set(range(8)) <= set(want) and len(want) == keep
    assert not (np.abs(tokens).sum(-1) == 0).any()  # no zero token: exactly K real ones + the context


def test_ties_go_to_the_lower_index():
    n, keep, d = 16, 4, 8
    x, q, k = inputs(2, 1, n, d)
    k[:] = 0.0  # uniform [CLS] row: every attention ties, so each crop keeps its first tokens
    method, params, model = holov_graph(n, d, keep, partitions=2)
    ref = reference(method, params, x, q, k)
    _, kept, _ = run(model, x, q, k)
    a = cls_row(q, k, DH ** -0.5)
    want, _, alloc, _ = official(x[0].astype(np.float64), a[0], 2, keep)
    assert kept[0].tolist() == ref.kept[0].tolist() == want
    assert sum(alloc) == keep and all(set(want) & set(range(c * 8, c * 8 + alloc[c])) == set(
        range(c * 8, c * 8 + alloc[c])) for c in range(2))


def test_the_trace_reports_a_margin():
    x, q, k = inputs(9, 3, 64, 16)
    method, params, _ = holov_graph(64, 16, 16)
    steps = reference(method, params, x, q, k).trace["steps"]
    (picks, margin), = steps
    assert picks.shape == (3, 16) and margin.shape == (3,) and (margin >= 0).all()


def test_refusals():
    method = get_method("holov")
    with pytest.raises(InputError, match="--partitions of method holov must be an integer >= 1"):
        method.parse(16, {"partitions": 0})
    with pytest.raises(InputError, match="method holov needs a \\[CLS\\] token"):  # a tower without one (SigLIP)
        method.check(method.parse(16, {}), SiteSpec(64, False, tower_cls=False))
    method.check(method.parse(16, {}), SiteSpec(64, False, tower_cls=True))  # LLaVA: [CLS] dropped at the features
    with pytest.raises(InputError, match="--keep must satisfy 1 <= keep < 64"):
        method.check(method.parse(64, {}), SiteSpec(64, False, tower_cls=True))
    with pytest.raises(InputError, match="--pivots is not an option of method holov"):
        method.parse(16, {"pivots": 3})


def test_the_summary_says_the_number_of_crops_not_its_formula():
    """The compile summary once printed `max(1, int((1024/576)·N/K)) raster crops` instead of the number."""
    from vlmprune.passes.prune import summary

    method = get_method("holov")
    params = method.parse(64, {})
    said = summary(method, params, 576)
    assert f"over {default_partitions(576, 64)} raster crops, 64 kept" in said and "max(1" not in said, said
    assert "over 8 raster crops" in summary(method, method.parse(64, {"partitions": 8}), 576)
