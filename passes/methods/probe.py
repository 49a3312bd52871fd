"""The probe score: how much the attention-pooling head's probe query attends to each patch (`--score probe`).

SigLIP has no [CLS] token; what summarises its image is the attention-pooling (MAP) head: one
learned probe query attending over post_layernorm(last_hidden_state). Its attention over the
patches plays the role of the [CLS] row, so the score-based methods (cls, visionzip) have a
[CLS]-free variant on SigLIP towers. Recomputed from the head's own weights, like the [CLS]
row from block L's Q and K, mean over heads:

    x_i  = post_layernorm(h_i)             h: block L's output [B, N, D]
    q_h  = (W_q · probe + b_q)_h            the head's in-projection, head h, d_h = D / H
    k_ih = (W_k · x_i + b_k)_h
    P_i  = mean_h softmax_i(q_h · k_ih / √d_h)

At the last block this is exactly the attention the head computes (its input is
post_layernorm(last_hidden_state)); at an earlier block L the head never sees those tokens,
so post_layernorm is applied to block L's output as the head applies it to the last
block's: the same query, asked earlier. The softmax runs over the site's tokens (all
patches: SigLIP has no prefix).

Graph: q is a constant, so q_h · k_ih = x_i · (W_kh^T q_h) + b_kh · q_h, and the second term
is the same for every token of a head, which the softmax ignores. The emission is one
LayerNormalization, a MatMul by a [D, H] constant, a Softmax over the tokens and a mean over
heads: O(N·D·H), cheaper than recomputing keys. The reference computes the head's
projections as written above, from the head's own tensors (compiler.frontend.tower.PoolingHead).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import POOLING_HEAD
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.builder import INT64_MAX

SCORES = ("cls", "probe")  # the values of --score
SCORE_HELP = "what ranks the patches: cls ([CLS] attention of block L, default) or probe (SigLIP's attention-pooling head)"
PROBE_SERVES = (POOLING_HEAD, ", with --score probe")  # Method.serves: what --score probe needs


def parse_score(method: str, value, allowed: tuple[str, ...] = SCORES) -> str:
    """--score's value, one of `allowed` (a method with more scores passes its own list)."""
    if value not in allowed:
        raise InputError(f"--score of method {method} is one of {', '.join(allowed)}, got {value!r}")
    return value


def probe_attention(hidden: torch.Tensor, head, prefix: int = 0) -> torch.Tensor:
    """P [B, N]: mean over heads of the probe query's softmax over norm(hidden)'s keys (patch tokens only).

    hidden: [B, prefix + N, D], block L's output; head: compiler.frontend.tower.PoolingHead.
    """
    dtype = hidden.dtype
    norm = head.norm
    x = torch.nn.functional.layer_norm(hidden, norm.normalized_shape, norm.weight.to(dtype), norm.bias.to(dtype),
                                       norm.eps)
    q = head.probe.to(dtype) @ head.q_weight.to(dtype).T + head.q_bias.to(dtype)  # [D]
    k = x @ head.k_weight.to(dtype).T + head.k_bias.to(dtype)  # [B, T, D]
    b, t, d = k.shape
    dh = d // head.heads
    logits = torch.einsum("hd,bthd->bht", q.view(head.heads, dh), k.view(b, t, head.heads, dh)) * dh ** -0.5
    return logits.softmax(dim=-1).mean(dim=1)[:, prefix:]


def folded_query(head) -> np.ndarray:
    """M [D, H] with x · M[:, h] = q_h · (W_k x)_h / √d_h: the head's constant query folded into its key projection."""
    q = (head.probe.double() @ head.q_weight.double().T + head.q_bias.double())  # [D]
    d = q.shape[0]
    dh = d // head.heads
    w_k = head.k_weight.double().view(head.heads, dh, d)  # per head [dh, D]
    folded = torch.einsum("hd,hde->eh", q.view(head.heads, dh), w_k) * dh ** -0.5
    return folded.detach().numpy()


def emit_probe_attention(b, hidden: ir.Value, head, prefix: int = 0) -> ir.Value:
    """P [B, N] in the graph: LayerNormalization -> MatMul by the folded query -> Softmax over tokens -> mean over heads."""
    np_dtype = (hidden.dtype or ir.DataType.FLOAT).numpy()
    norm = head.norm
    weight = b.const("probe_norm_weight", norm.weight.detach().numpy().astype(np_dtype))
    bias = b.const("probe_norm_bias", norm.bias.detach().numpy().astype(np_dtype))
    x = b.op("LayerNormalization", [hidden, weight, bias], "probe_norm", axis=-1, epsilon=float(norm.eps))
    logits = b.op("MatMul", [x, b.const("probe_query", folded_query(head).astype(np_dtype))], "probe_logits")
    probs = b.op("Softmax", [logits], "probe_probs", axis=1)  # [B, T, H], over the tokens
    attn = b.reduce("ReduceMean", probs, [2], 0, "probe_attn")  # [B, T]
    return b.slice(attn, prefix, INT64_MAX, 1, "patch_probe") if prefix else attn
