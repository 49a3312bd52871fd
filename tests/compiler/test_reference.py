"""The reference pruner against hand-computed cases."""

import pytest
import torch

from vlmprune.compiler import reference


def test_select_topk_tie_rule_and_order():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.5]])
    # Top-3: both 0.9s, then the first 0.5 (lowest index among ties); returned ascending.
    assert reference.select_topk(scores, 3).tolist() == [[0, 1, 3]]


def test_gather_summary_values():
    hidden = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2)  # [CLS] + 4 patches
    kept = torch.tensor([[1, 3], [0, 2]])
    out = reference.gather_summary(hidden, kept, has_cls=True)
    assert out.shape == (2, 4, 2)
    torch.testing.assert_close(out[0, 0], hidden[0, 0])
    torch.testing.assert_close(out[0, 1:3], hidden[0, [2, 4]])
    torch.testing.assert_close(out[0, 3], hidden[0, [1, 3]].mean(0))
    torch.testing.assert_close(out[1, 3], hidden[1, [2, 4]].mean(0))


def test_scores_normalised_and_constant_image_safe():
    attn = torch.tensor([[0.1, 0.3, 0.2]])
    var = torch.zeros(1, 3)
    s = reference.combine_scores(attn, var, lam=1.0)
    assert torch.isfinite(s).all()
    torch.testing.assert_close(s, attn / 0.3)


def test_cls_attention_matches_full_softmax():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 4, generator=g), torch.randn(2, 3, 7, 4, generator=g)
    full = ((q @ k.transpose(-1, -2)) * 0.5).softmax(-1)
    torch.testing.assert_close(reference.cls_attention(q, k, 0.5), full[:, :, 0, 1:].mean(1))


def test_patch_variance_raster_order():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 0:2, 2:4] = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # patch 1 (top right) varies
    v = reference.patch_variance(x, 2)
    assert v.tolist() == [[0.0, 0.25, 0.0, 0.0]]


@pytest.mark.parametrize("keep", [0, 4])
def test_invalid_keep(keep):
    with pytest.raises(ValueError):
        reference.select_topk(torch.zeros(1, 4), keep)


def test_boundary_ties_counts_only_ambiguous_cuts():
    clear = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    tied = torch.tensor([[0.9, 0.5, 0.5, 0.0]])
    assert reference.boundary_ties(clear, 2, 1e-5).tolist() == [0]
    assert reference.boundary_ties(tied, 2, 1e-5).tolist() == [2]
