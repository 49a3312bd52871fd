"""Reference building blocks several methods share: TopK with the tie rule, gathers, the tie band, and the
baselines' constant index rules (check_count, grid_indices: the grid baseline's and --coverage's).

Plain torch, batched, never synchronising with the host and never looping over the
batch. Parity (compiler.parity) uses tie_band and boundary_ties from here too, so the
reference and the check agree on what counts as a tie.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vlmprune.compiler.contract import SCORE_EPS  # floors the per-image maxima that normalise scores

# Method.selection (passes.methods.base): how parity compares a method's kept indices; here, below base, since the
# generic options' modules (relevance, budget_options, schedule_steps) refuse a method by it.
BY_SCORE, GREEDY = "score", "greedy"


def topk_lower_index(scores: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """The k best entries of the last axis, best first; equal scores go to the lower index."""
    # A stable sort keeps equal scores in index order: the tie rule (torch.topk does not promise it).
    return torch.sort(scores, dim=-1, descending=largest, stable=True).indices[..., :k]


def select_topk(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """TopK with ties broken towards the lower index, returned in ascending (raster) order."""
    n = scores.shape[-1]
    if not 1 <= keep < n:
        raise ValueError(f"keep must satisfy 1 <= keep < {n}, got {keep}")
    return topk_lower_index(scores, keep).sort(dim=-1).values


def gather_rows(tokens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tokens [B, N, D], indices [B, k] -> [B, k, D]."""
    b, _, d = tokens.shape
    return torch.gather(tokens, 1, indices.unsqueeze(-1).expand(b, indices.shape[-1], d))


def pruned_mask(indices: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """[B, N]: 1 where a patch is not among indices, 0 where it is."""
    ones = torch.ones(indices.shape[0], n, dtype=dtype, device=indices.device)
    return ones.scatter(1, indices, 0.0)


def split_prefix(hidden: torch.Tensor, prefix: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the prefix tokens ([CLS], registers) as a list of 0 or 1 tensors [B, prefix, D], patch tokens [B, N, D])."""
    return ([hidden[:, :prefix]], hidden[:, prefix:]) if prefix else ([], hidden)


# The most scores a tie band may hold, as a share of K (and at least the boundary pair): a band as wide as a
# lower precision's noise can hold a third of K where scores are flat, and a "tie" that wide explains any
# selection; the band is narrowed to the scores nearest the cut instead.
TIE_SHARE_MAX = 0.25
# ...but never below this share of the scores' scale (1e-6: about 8 fp32 ulps at 1), nor above the precision's own
# band. Scores are only known to a few ulps (a runtime that sums in another order differs by that much), and flat
# content (a still background: many cosines within ulps of 1) puts more scores than the cap lets in that close to
# the cut; narrowing below it would call rounding a wrong selection.
ORDER_FLOOR = 1e-6


def tie_band(scores: np.ndarray | torch.Tensor, rel_tol: float, keep: int | None = None,
             max_share: float = TIE_SHARE_MAX):
    """Half-width of the band around the K-th boundary in which two scores count as tied.

    rel_tol times the largest |score| of the image (floored at SCORE_EPS): scores that
    close may be ordered either way by a lower-precision runtime. With keep: narrowed so that
    it holds at most max(2, max_share·K) scores, the ones nearest the cut between the K-th and
    (K+1)-th best (TIE_SHARE_MAX), but never below ORDER_FLOOR of the scale (where that is under rel_tol).
    """
    floor = min(ORDER_FLOOR, rel_tol)
    if isinstance(scores, torch.Tensor):
        scale = scores.abs().amax(dim=-1).clamp_min(SCORE_EPS)
        band = rel_tol * scale
        if keep is None:
            return band
        top = torch.sort(scores, dim=-1, descending=True, stable=True).values
        cut = 0.5 * (top[..., keep - 1] + top[..., keep])
        nearest = torch.sort((scores - cut.unsqueeze(-1)).abs(), dim=-1).values
        narrowed = nearest[..., _tie_cap(keep, max_share, scores.shape[-1]) - 1]
        return torch.minimum(band, torch.maximum(narrowed, floor * scale))
    scores = np.asarray(scores)
    scale = np.maximum(np.abs(scores).max(axis=-1), SCORE_EPS)
    band = rel_tol * scale
    if keep is None:
        return band
    top = -np.sort(-scores, axis=-1)
    cut = 0.5 * (top[..., keep - 1] + top[..., keep])
    nearest = np.sort(np.abs(scores - np.expand_dims(cut, -1)), axis=-1)
    narrowed = nearest[..., _tie_cap(keep, max_share, scores.shape[-1]) - 1]
    return np.minimum(band, np.maximum(narrowed, floor * scale))


def _tie_cap(keep: int, share: float, n: int) -> int:
    return min(n, max(2, int(share * keep)))


def boundary_ties(scores: torch.Tensor, keep: int, rel_tol: float, max_share: float = TIE_SHARE_MAX) -> torch.Tensor:
    """Per image, how many scores lie within the (narrowed) tie band of the K-th/(K+1)-th boundary.

    Zero means the selection is unambiguous at that precision; a positive count
    means a lower precision may legitimately keep a different set.
    """
    top = torch.sort(scores, dim=-1, descending=True, stable=True).values
    cut = 0.5 * (top[:, keep - 1] + top[:, keep])
    band = tie_band(scores, rel_tol, keep, max_share)
    gap = (top[:, keep - 1] - top[:, keep]).abs()
    near = (scores - cut.unsqueeze(-1)).abs() <= band.unsqueeze(-1)
    # Only a boundary whose gap is inside the band is a tie at all.
    return torch.where(gap <= 2 * band, near.sum(dim=-1), torch.zeros_like(gap, dtype=torch.long))


def relative_margin(values: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """How far the k-th best of values is ahead of the (k+1)-th, relative to the largest finite |value|: [B].

    The margin of one greedy step: zero (or within a tie band) means a lower precision may pick differently.
    """
    finite = values.masked_fill(~torch.isfinite(values), float("nan"))
    ordered = torch.sort(values, dim=-1, descending=largest, stable=True).values
    gap = (ordered[:, k - 1] - ordered[:, k]).abs()
    scale = finite.abs().nan_to_num(0.0).amax(dim=-1).clamp_min(SCORE_EPS)
    return torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf"))) / scale


def check_count(n: int, keep: int) -> None:
    """The index rules' own guard (the method's check refuses bad input in one line before they run)."""
    if not 1 <= keep < n:
        raise ValueError(f"keep must satisfy 1 <= keep < {n}, got {keep}")


def grid_indices(n: int, keep: int) -> np.ndarray:
    """K of N patch indices on a uniform grid (passes.methods.grid's rule), ascending int64: the grid baseline's
    kept set and --coverage's forced one (passes.methods.coverage)."""
    check_count(n, keep)
    side = math.isqrt(n)
    h, w = (side, side) if side * side == n else (1, n)
    rows = min(h, max(math.floor(math.sqrt(keep * h / w) + 0.5), -(-keep // w)))
    out = []
    for j in range(rows):
        count = (j + 1) * keep // rows - j * keep // rows
        y = (2 * j + 1) * h // (2 * rows)
        out += [y * w + (2 * i + 1) * w // (2 * count) for i in range(count)]
    return np.asarray(out, dtype=np.int64)
