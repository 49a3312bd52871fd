"""The reference building blocks against hand-computed cases: tie rule, gathers, scores, tie band, margins."""

import numpy as np
import pytest
import torch

from vlmprune.passes.methods import attention, selection
from vlmprune.passes.methods.cls import gather_summary


def test_select_topk_tie_rule_and_order():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.5]])
    # Top-3: both 0.9s, then the first 0.5 (lowest index among ties); returned ascending.
    assert selection.select_topk(scores, 3).tolist() == [[0, 1, 3]]
    assert selection.topk_lower_index(scores, 3, largest=False).tolist() == [[4, 0, 2]]


def test_gather_summary_values():
    hidden = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2)  # [CLS] + 4 patches
    kept = torch.tensor([[1, 3], [0, 2]])
    out = gather_summary(hidden, kept)
    assert out.shape == (2, 4, 2)
    torch.testing.assert_close(out[0, 0], hidden[0, 0])
    torch.testing.assert_close(out[0, 1:3], hidden[0, [2, 4]])
    torch.testing.assert_close(out[0, 3], hidden[0, [1, 3]].mean(0))
    torch.testing.assert_close(out[1, 3], hidden[1, [2, 4]].mean(0))


def test_scores_normalised_and_constant_image_safe():
    attn = torch.tensor([[0.1, 0.3, 0.2]])
    assert torch.isfinite(attention.normalise(torch.zeros(1, 3))).all()  # a constant image: zero variance
    torch.testing.assert_close(attention.normalise(attn), attn / 0.3)


def test_cls_attention_matches_full_softmax():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 4, generator=g), torch.randn(2, 3, 7, 4, generator=g)
    full = ((q @ k.transpose(-1, -2)) * 0.5).softmax(-1)
    torch.testing.assert_close(attention.cls_attention(q, k, 0.5), full[:, :, 0, 1:].mean(1))


def test_patch_variance_raster_order():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 0:2, 2:4] = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # patch 1 (top right) varies
    assert attention.patch_variance(x, 2).tolist() == [[0.0, 0.25, 0.0, 0.0]]


@pytest.mark.parametrize("keep", [0, 4])
def test_invalid_keep(keep):
    with pytest.raises(ValueError):
        selection.select_topk(torch.zeros(1, 4), keep)


def test_boundary_ties_counts_only_ambiguous_cuts():
    clear = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    tied = torch.tensor([[0.9, 0.5, 0.5, 0.0]])
    assert selection.boundary_ties(clear, 2, 1e-5).tolist() == [0]
    assert selection.boundary_ties(tied, 2, 1e-5).tolist() == [2]


def test_tie_band_is_relative_to_the_largest_score():
    assert selection.tie_band(np.array([[2.0, -4.0, 1.0]]), 1e-3).tolist() == [0.004]
    assert selection.tie_band(torch.zeros(1, 3), 1e-3).tolist() == [pytest.approx(1e-9)]  # floored


def test_relative_margin():
    values = torch.tensor([[3.0, 1.0, 2.0, float("-inf")]])
    # The best is 3, the runner-up 2: margin 1 relative to the largest finite |value|, 3.
    assert selection.relative_margin(values, 1).tolist() == [pytest.approx(1 / 3)]
    # Smallest first, +inf excluded as dart excludes retained tokens: 1 then 2.
    excluded = torch.tensor([[3.0, 1.0, 2.0, float("inf")]])
    assert selection.relative_margin(excluded, 1, largest=False).tolist() == [pytest.approx(1 / 3)]
    assert selection.relative_margin(torch.tensor([[1.0, 1.0, 0.0]]), 1).tolist() == [0.0]
