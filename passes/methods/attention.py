"""The [CLS] query's attention row of block L, recomputed from the block's own Q and K.

Methods that score patches by how much [CLS] attends to them (cls, visionzip) need one
row of block L's attention, averaged over heads. Recomputing that row costs O(N·d) and
leaves the block's attention untouched, so the tower keeps its fused SDPA/Flash kernel
and the score is exportable in standard ops. The same computation, in torch (the
reference) and in the graph (the emission):

    A_i = mean_h softmax(q_cls,h · K_hᵀ · scale)[1 + i]      i = 0 .. N-1
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from vlmprune.compiler.contract import SCORE_EPS
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.methods.builder import INT64_MAX
from vlmprune.passes.graph.structure import scale_operand, static_dim


def cls_attention(q: torch.Tensor, k: torch.Tensor, scale: float, prefix: int = 1) -> torch.Tensor:
    """Mean over heads of the [CLS] row of softmax(q kᵀ · scale).

    q, k: [B, H, T, dh] after the block's projections. Returns [B, N] for the patch keys:
    the `prefix` leading keys ([CLS], and register tokens where the tower has them) are part
    of the softmax but not returned.
    """
    logits = torch.einsum("bhd,bhtd->bht", q[:, :, 0], k) * scale
    attn = logits.softmax(dim=-1).mean(dim=1)
    return attn[:, prefix:]


def normalise(scores: torch.Tensor) -> torch.Tensor:
    """scores / max(scores) per image, the maximum floored at SCORE_EPS."""
    return scores / scores.amax(dim=-1, keepdim=True).clamp_min(SCORE_EPS)


def emit_cls_attention(b, block, prefix: int = 1) -> ir.Value:
    """A [B, N]: the recomputed [CLS] row of `block`'s attention, mean over heads, patch keys only."""
    q_cls = b.slice(block.q, 0, 1, 2, "q_cls")  # [B, H, 1, dh]
    kt = block.k if block.k_transposed else b.op("Transpose", [block.k], "k_t", perm=[0, 1, 3, 2])
    logits = b.op("MatMul", [q_cls, kt], "cls_logits")  # [B, H, 1, 1+N]
    for i, scale in enumerate(block.scale_ops):  # the block's own scaling ops, replayed
        logits = b.op(scale.op_type, [logits, scale_operand(scale)], f"cls_scale{i}")
    if block.softmax is None:  # the Attention op's scale attribute
        logits = b.op("Mul", [logits, b.scalar("scale", block.scale)], "cls_scale")
    probs = b.op("Softmax", [logits], "cls_probs", axis=-1)
    attn = b.reduce("ReduceMean", probs, [1, 2], 0, "cls_attn")  # [B, 1+N]
    return b.slice(attn, prefix, INT64_MAX, 1, "patch_attn")  # [B, N]


def emit_normalise(b, scores: ir.Value, name: str) -> ir.Value:
    """scores / max(max(scores), SCORE_EPS) per image, in the graph."""
    eps = b.scalar(f"{name}_eps", SCORE_EPS)
    top = b.reduce("ReduceMax", scores, [1], 1, f"{name}_max")
    return b.op("Div", [scores, b.op("Max", [top, eps], f"{name}_den")], name)


def patch_variance(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """Variance over the pixels and channels of each patch: [B, C, H, W] -> [B, N] (raster order)."""
    b, c, h, w = pixel_values.shape
    x = pixel_values.reshape(b, c, h // patch, patch, w // patch, patch)
    x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)
    return x.var(dim=-1, unbiased=False)


def emit_patch_variance(b, structure, n: int) -> ir.Value:
    """Per-patch variance of the pixel input: [B, C, H, W] -> [B, N], raster order."""
    pixel, p = structure.pixel_input, structure.patch_size
    gh, gw = structure.grid
    channels = static_dim(pixel, 1)
    if channels is None:
        raise StructureError("pixel input has no static channel count")
    x = b.op("Reshape", [pixel, b.ints("pix6_shape", [-1, channels, gh, p, gw, p])], "pix6")
    x = b.op("Transpose", [x], "pix_patches", perm=[0, 2, 4, 1, 3, 5])
    x = b.op("Reshape", [x, b.ints("pix3_shape", [-1, n, channels * p * p])], "pix3")
    mean = b.reduce("ReduceMean", x, [2], 1, "pix_mean")
    centered = b.op("Sub", [x, mean], "pix_centered")
    return b.reduce("ReduceMean", b.op("Mul", [centered, centered], "pix_sq"), [2], 0, "pix_var")
