"""The received-attention score: how much attention each merged token receives at a full-attention block
(`cls --score attention`, Qwen2-VL and Qwen2.5-VL).

Qwen towers have no [CLS] and no pooling head; what stands in for the [CLS] row is the
attention every patch *receives*, averaged over heads and over all queries, at the last block
the tower runs whose attention spans the whole image:

    A_i = mean_h mean_q softmax_j(q_qh · k_jh · scale)[i]        i = 0 .. N-1 (patches)
    S_m = mean of A_i over the merge² patches of merged token m   (the patch merger's groups)

The block is the last of Qwen2.5-VL's `fullatt_block_indexes` (every block is full in Qwen2-VL;
a window that covers the whole image counts as full attention, since it is the same
attention), recomputed from that block's own Q and K after its 2-D rotary. S is then in the
merged tokens' raster order, mapped there exactly as the features are (Qwen2.5-VL's inverse
window permutation), and `cls` selects on the merged tokens at the features site: top K by
S / max(S) (ties to the lower index), in raster order, + one summary token, the mean of the
pruned merged tokens. The pixel term has no merged grid, so `--lambda` must stay 0.

Why this reduction: the [CLS]-free score of VisionZip-style pruning. VisionZip's maintainers
say their Qwen2.5-VL support recomputes attention weights in the vision encoder
(JIA-Lab-research/VisionZip issues #24, #25); the VisPruner author describes the score for
encoders without [CLS] as "the average attention each visual token receives from all other
tokens ... also adopted in other works, such as VisionZip", with the same merging applied to
the attention as to the tokens and pruning on the merged tokens (Theia-4869/VisPruner issue
#1). The official Qwen2.5-VL code itself was not available to check (the stored
dvlab-research/VisionZip snapshot holds only the LLaVA code), so the block choice (the last
full-attention block: window blocks do not see the whole image) and the mean over the 2x2
groups are vlmprune's, stated here as the contract. (An unofficial port,
Hanjiangli/VisionZip-Qwen2VL, reads token 0's row as if it were [CLS]; Qwen has none, which
is why the column mean is used instead.)

Graph: found by structure (passes.graph.structure), not by names: among the attention blocks
(Softmax over Q·Kᵀ, no non-zero mask: masked-window blocks are not taken), the last one
whose Softmax spans the most tokens T, batched per image (the window blocks are batches of
windows over T / windows tokens); T must be a multiple of the site's M merged tokens. The
emission: MatMul(Q, Kᵀ), the block's own scaling, Softmax, ReduceMean over heads and queries,
Reshape [B, M, T/M] and ReduceMean over each group (the merger's groups are consecutive in
the tower's order), then the constant Gather that puts the features into raster order where
the graph has one (its own indices). TokenPrune copies one [CLS] token, so the selection
stays in standard ops here.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import MERGED_TOKENS
from vlmprune.compiler.errors import InputError, StructureError
import vlmprune.passes.methods.probe as probe
from vlmprune.passes.graph.structure import scale_operand

ATTENTION = "attention"  # the --score value
SCORE_HELP = ("what ranks the patches: cls ([CLS] attention of block L, default), probe (SigLIP's "
              "attention-pooling head) or attention (the attention each merged token receives at the last "
              "full-attention block: Qwen2-VL / Qwen2.5-VL)")
SERVES = (MERGED_TOKENS, ", with --score attention")  # Method.serves: what --score attention needs


def parse_score(method: str, value) -> str:
    return probe.parse_score(method, value, (*probe.SCORES, ATTENTION))


def check_lambda(method: str, lam: float) -> None:
    if lam:
        raise InputError(f"--lambda of method {method} must be 0 with --score attention: the pixel term has no "
                         f"merged-token grid, got {lam:g}")


def received_attention(q: torch.Tensor, k: torch.Tensor, scale: float, tokens: int) -> torch.Tensor:
    """S [B, M]: mean over heads and queries of softmax(q kᵀ · scale), then mean over each group of T / M keys.

    q, k: [B, H, T, dh], the block's Q and K, their tokens grouped so that merged token m's
    patches are keys m·u .. m·u+u-1 (u = T / M), merged tokens in the features' order.
    """
    b, _, t, _ = k.shape
    if t % tokens:
        raise StructureError(f"the score block has {t} tokens, not a multiple of the {tokens} merged tokens")
    probs = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).softmax(dim=-1)
    return probs.mean(dim=(1, 2)).reshape(b, tokens, t // tokens).mean(dim=-1)


def _static(value: ir.Value, axis: int):
    shape = value.shape
    return None if shape is None or len(shape) <= abs(axis) else shape[axis]


def score_block(graph: ir.Graph, structure, hidden: ir.Value):
    """The last attention block over the whole image (see the module docstring), or StructureError."""
    if structure is None or not structure.blocks:
        raise StructureError("--score attention found no attention block in the graph")
    if any(_static(blk.attention.inputs[0], -1) is None for blk in structure.blocks):
        from onnx_ir.passes.common import ShapeInferencePass

        ShapeInferencePass()(ir.Model(graph, ir_version=10))  # shapes merged into the graph's own values
    spans = [(_static(blk.attention.inputs[0], -1), blk) for blk in structure.blocks]
    if any(not isinstance(t, int) for t, _ in spans):
        raise StructureError("--score attention needs the static token count of every attention block")
    widest = max(t for t, _ in spans)
    block = [blk for t, blk in spans if t == widest][-1]
    tokens = _static(hidden, 1)
    if not isinstance(tokens, int) or widest % tokens or widest == tokens:
        raise StructureError(f"--score attention: the widest attention block spans {widest} tokens, not a whole "
                             f"number (> 1) of patches for each of the {tokens} merged tokens")
    batch, q_batch = _static(hidden, 0), _static(block.attention.inputs[0], 0)
    if batch is not None and q_batch is not None and batch != q_batch:
        raise StructureError("--score attention: the widest attention block is not batched per image")
    return block, widest // tokens


def raster_gather(hidden: ir.Value) -> ir.Value | None:
    """The constant indices of the Gather (axis 1) that puts the features into raster order, or None."""
    node = hidden.producer()
    if node is None or node.op_type != "Gather" or node.attributes.get_int("axis", 0) != 1:
        return None
    indices = ir.convenience.get_const_tensor(node.inputs[1])
    tokens = _static(hidden, 1)
    if indices is None or indices.numpy().ndim != 1 or sorted(indices.numpy().tolist()) != list(range(tokens)):
        return None
    return node.inputs[1]


def emit_received_attention(b, graph: ir.Graph, structure, hidden: ir.Value) -> ir.Value:
    """S [B, M] in the graph, merged tokens in the features' order."""
    block, unit = score_block(graph, structure, hidden)
    tokens = _static(hidden, 1)
    kt = block.k if block.k_transposed else b.op("Transpose", [block.k], "k_t", perm=[0, 1, 3, 2])
    logits = b.op("MatMul", [block.q, kt], "recv_logits")  # [B, H, T, T]
    for i, scale in enumerate(block.scale_ops):  # the block's own scaling ops, replayed
        logits = b.op(scale.op_type, [logits, scale_operand(scale)], f"recv_scale{i}")
    if block.softmax is None:  # the Attention op's scale attribute
        logits = b.op("Mul", [logits, b.scalar("recv_scale", block.scale)], "recv_scale")
    probs = b.op("Softmax", [logits], "recv_probs", axis=-1)
    received = b.reduce("ReduceMean", probs, [1, 2], 0, "recv_attn")  # [B, T]
    groups = b.op("Reshape", [received, b.ints("recv_groups_shape", [-1, tokens, unit])], "recv_groups")
    scores = b.reduce("ReduceMean", groups, [2], 0, "recv_merged")  # [B, M], the tower's order
    order = raster_gather(hidden)
    if order is not None:
        indices = ir.convenience.get_const_tensor(order).numpy().astype(np.int64)
        scores = b.op("Gather", [scores, b.const("recv_raster_order", indices)], "recv_raster", axis=1)
    return scores
