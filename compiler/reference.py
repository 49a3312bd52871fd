"""The reference pruner: shared/DESIGN.md's pruning semantics in plain torch.

Every other implementation (the inserted ONNX subgraph, the fused custom op, the
CUDA kernels, target artifacts) is checked against these functions. They are
batched, never synchronise with the host and never loop over the batch.
"""

from __future__ import annotations

import torch

# Floor for the per-image maxima that normalise the two score terms: a constant
# image has zero pixel variance everywhere.
SCORE_EPS = 1e-6


def cls_attention(q: torch.Tensor, k: torch.Tensor, scale: float, has_cls: bool = True) -> torch.Tensor:
    """Mean over heads of the [CLS] row of softmax(q kᵀ · scale).

    q, k: [B, H, T, dh] after the block's projections. Returns [B, N] for the
    patch keys (the [CLS] key is part of the softmax but not returned).
    """
    logits = torch.einsum("bhd,bhtd->bht", q[:, :, 0], k) * scale
    attn = logits.softmax(dim=-1).mean(dim=1)
    return attn[:, 1:] if has_cls else attn


def patch_variance(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """Variance over the pixels and channels of each patch: [B, C, H, W] -> [B, N] (raster order)."""
    b, c, h, w = pixel_values.shape
    x = pixel_values.reshape(b, c, h // patch, patch, w // patch, patch)
    x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)
    return x.var(dim=-1, unbiased=False)


def combine_scores(attn: torch.Tensor, variance: torch.Tensor | None = None, lam: float = 0.0) -> torch.Tensor:
    """S = A / max(A) + λ · V / max(V), maxima per image and floored at SCORE_EPS."""
    scores = attn / attn.amax(dim=-1, keepdim=True).clamp_min(SCORE_EPS)
    if lam:
        if variance is None:
            raise ValueError("lambda > 0 needs the pixel variance")
        scores = scores + lam * (variance / variance.amax(dim=-1, keepdim=True).clamp_min(SCORE_EPS))
    return scores


def select_topk(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """TopK with ties broken towards the lower index, returned in ascending (raster) order."""
    n = scores.shape[-1]
    if not 1 <= keep < n:
        raise ValueError(f"keep must satisfy 1 <= keep < {n}, got {keep}")
    # A stable descending sort keeps equal scores in index order: the tie rule.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    return order.sort(dim=-1).values


def gather_summary(hidden: torch.Tensor, kept: torch.Tensor, has_cls: bool = True) -> torch.Tensor:
    """[CLS] (if any) + kept tokens + the unweighted mean of the pruned ones: [B, T, D] -> [B, (1)+K+1, D]."""
    patches = hidden[:, 1:] if has_cls else hidden
    b, n, d = patches.shape
    k = kept.shape[-1]
    kept_tokens = torch.gather(patches, 1, kept.unsqueeze(-1).expand(b, k, d))
    pruned = torch.ones(b, n, dtype=patches.dtype, device=patches.device).scatter(1, kept, 0.0)
    summary = (pruned / (n - k)).unsqueeze(1) @ patches
    parts = [hidden[:, :1]] if has_cls else []
    return torch.cat(parts + [kept_tokens, summary], dim=1)


def prune_tokens(
    hidden: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    keep: int,
    *,
    has_cls: bool = True,
    lam: float = 0.0,
    pixel_values: torch.Tensor | None = None,
    patch: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole method: returns (pruned hidden states, kept indices, scores)."""
    if not has_cls:
        raise ValueError("the [CLS]-attention method needs a [CLS] token")
    attn = cls_attention(q, k, scale, has_cls=has_cls)
    variance = patch_variance(pixel_values, patch) if lam else None
    scores = combine_scores(attn, variance, lam)
    kept = select_topk(scores, keep)
    return gather_summary(hidden, kept, has_cls), kept, scores


def boundary_ties(scores: torch.Tensor, keep: int, rel_tol: float) -> torch.Tensor:
    """Per image, how many scores lie within rel_tol · max|S| of the K-th/(K+1)-th boundary.

    Zero means the selection is unambiguous at that precision; a positive count
    means a lower precision may legitimately keep a different set.
    """
    top = torch.sort(scores, dim=-1, descending=True, stable=True).values
    cut = 0.5 * (top[:, keep - 1] + top[:, keep])
    band = rel_tol * scores.abs().amax(dim=-1).clamp_min(SCORE_EPS)
    gap = (top[:, keep - 1] - top[:, keep]).abs()
    near = (scores - cut.unsqueeze(-1)).abs() <= band.unsqueeze(-1)
    # Only a boundary whose gap is inside the band is a tie at all.
    return torch.where(gap <= 2 * band, near.sum(dim=-1), torch.zeros_like(gap, dtype=torch.long))
