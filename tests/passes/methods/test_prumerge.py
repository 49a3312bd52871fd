"""prumerge+: the kept set and merge against an independent per-image rendering of the official algorithm, the
inserted graph on a tiny CLIP tower (padding, num_tokens, -1 slots), static ops only, refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from method_helpers import assert_matches_pipeline
from vlmprune.compiler.contract import NUM_TOKENS
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.prumerge import keep_mask
from vlmprune.passes.outputs import ZeroPaddingPass
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass
from vlmprune.passes.retarget import RetargetTokenCountPass

METHOD = get_method("prumerge+")


def official_one(hidden: np.ndarray, keys: np.ndarray, attn: np.ndarray, k_max: int) -> tuple[list[int], np.ndarray]:
    """One image as the official PruMerge+ computes it (42Shawn/LLaVA-PruMerge, batch 1), in numpy and loops, with
    this module's listed choices (per image, integer step, sample range N - 1, a set in raster order, ≤ k_max).

    Rows: the merged kept tokens, then the official `extra_one_token` = Σ over the tokens not kept of x_j · A_j."""
    n = len(attn)
    q1, q3 = np.percentile(attn, 25), np.percentile(attn, 75)
    outliers = [int(i) for i in np.where(attn > q3 + 1.5 * (q3 - q1))[0]]
    step = max(1, (n // max(len(outliers), 1)) // 3)
    chosen = set(outliers) | set(range(0, n - 1, step))
    ranked = sorted(chosen, key=lambda i: (-attn[i], i))[:k_max]
    kept = sorted(ranked)
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    rows = []
    for i in kept:
        others = [j for j in range(n) if j != i]
        cosine = unit[others] @ unit[i]
        near = [others[j] for j in np.argsort(-cosine, kind="stable")[:32]]
        rows.append(hidden[i] + (attn[near, None] * hidden[near]).sum(axis=0))
    pruned = [j for j in range(n) if j not in kept]
    rows.append((hidden[pruned] * attn[pruned, None]).sum(axis=0))
    return kept, np.stack(rows)


def _tensors(seed: int, b: int = 3, n: int = 48, h: int = 2, dh: int = 8, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, 1 + n, d, generator=g, dtype=torch.float64)
    q, k = (torch.randn(b, h, 1 + n, dh, generator=g, dtype=torch.float64) for _ in range(2))
    k[:, :, 1 + torch.arange(0, n, 7)] *= 3.0  # a few keys [CLS] attends to much more: outliers
    k[1] *= 0.3  # image 1: flatter attention, another budget
    return SiteTensors(hidden, True, q, k, 0.6)


@pytest.mark.parametrize("k_max", [12, 40])
def test_reference_is_the_official_algorithm_per_image(k_max):
    inputs = _tensors(0)
    result = METHOD.reference(METHOD.parse(k_max, {}), inputs)
    counts = result.trace["num_tokens"]
    assert len(set(counts.tolist())) > 1 or k_max == 12  # the budget differs between images
    for b in range(3):
        attn = torch.softmax(torch.einsum("hd,htd->ht", inputs.q[b, :, 0], inputs.k[b]) * 0.6, -1).mean(0)[1:]
        keys = inputs.k[b].transpose(0, 1).reshape(49, -1)[1:]
        kept, rows = official_one(inputs.hidden[b, 1:].numpy(), keys.numpy(), attn.numpy(), k_max)
        n = len(kept)
        assert counts[b] == n + 1  # the K_b merged tokens and the extra one
        assert result.kept[b, :n].tolist() == kept and (result.kept[b, n:] == -1).all()
        np.testing.assert_allclose(result.tokens[b, 1:2 + n].numpy(), rows, rtol=1e-12)
        assert (result.tokens[b, 2 + n:] == 0).all() and (result.tokens[b, 0] == inputs.hidden[b, 0]).all()
    assert result.tokens.shape[1] == 1 + k_max + 1 == 1 + METHOD.output_tokens(METHOD.parse(k_max, {}))


def test_extra_token_takes_the_pruned_truncated_too():
    """K_max below the kept set: the ones cut by score join the pruned in the extra token, at row K_max."""
    inputs = _tensors(1)
    full = METHOD.reference(METHOD.parse(40, {}), inputs)
    cut = METHOD.reference(METHOD.parse(4, {}), inputs)
    assert (full.trace["keep"] > 4).all() and (cut.trace["num_tokens"] == 5).all()
    attn, patches = cut.trace["scores"], inputs.hidden[:, 1:]
    for b in range(3):
        pruned = sorted(set(range(48)) - set(cut.kept[b].tolist()))
        expected = (attn[b, pruned, None] * patches[b, pruned]).sum(0)
        torch.testing.assert_close(cut.tokens[b, 1 + 4], expected, rtol=1e-12, atol=0)


def test_keep_mask_cases():
    flat = torch.full((1, 48), 1 / 48, dtype=torch.float64)  # no outlier: counted as one, step 48 // 3
    assert torch.where(keep_mask(flat)[0][0])[0].tolist() == [0, 16, 32]
    peaked = flat.clone()
    peaked[0, [5, 9]] = 1.0
    mask, outliers = keep_mask(peaked)
    assert torch.where(outliers[0])[0].tolist() == [5, 9]
    assert torch.where(mask[0])[0].tolist() == [0, 5, 8, 9, 16, 24, 32, 40]  # step (48 // 2) // 3 = 8
    many = flat.clone()  # a quarter above the fence (the most the IQR rule allows): step (48 // 12) // 3 = 1
    many[0, ::4] = 1.0
    mask, outliers = keep_mask(many)
    assert int(outliers.sum()) == 12 and mask[0, :47].all() and not mask[0, 47]  # the samples stop before N - 1


@pytest.mark.parametrize("batch", [1, 3])
def test_inserted_graph_matches_reference(tiny_dense_path, tiny_source, batch):
    params = METHOD.parse(12, {})
    model = ir.load(tiny_dense_path)
    for p in (InsertPruningPass(METHOD, params), RetargetTokenCountPass(), ZeroPaddingPass()):
        p(model)
    assert not ZeroPaddingPass()(model).modified  # a second run finds the padding zeroed
    ops = {n.op_type for n in model.graph}
    assert not ops & {"Loop", "NonZero", "If", "Scan"}
    x = np.random.default_rng(batch).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = assert_matches_pipeline(model, METHOD, params, tiny_source, x, 13)
    lead = out["image_features"].shape[1] - 13  # 12 merged slots + the extra token
    for b, rows in enumerate(out[NUM_TOKENS]):
        assert np.all(out["image_features"][b, rows:] == 0) and np.all(out[KEPT_INDICES][b, rows - lead - 1:] == -1)
        assert np.all(out[KEPT_INDICES][b, : rows - lead - 1] >= 0)


def test_refusals():
    with pytest.raises(InputError, match="needs a \\[CLS\\] token"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(64, has_cls=False))
    with pytest.raises(InputError, match="1 <= keep < 64"):
        METHOD.check(METHOD.parse(64, {}), SiteSpec(64, has_cls=True))
