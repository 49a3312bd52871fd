"""Fuse each block's attention (as torch.onnx's dynamo exporter writes it) into com.microsoft.MultiHeadAttention.

Why: the dynamo export spells scaled_dot_product_attention as ~12 standard nodes per block
(Reshape/Transpose of q, k, v; K transposed through a 3-D Reshape; a sqrt-scale Mul on q and
on Kᵀ, one through CastLike; MatMul, Softmax, MatMul; Transpose, Reshape), and ONNX Runtime's
own transformer optimizer fuses none of it (it knows the TorchScript exporter's spelling).
The rule matches that form by structure only (never by names), checks every attribute and
constant that fixes the semantics (the perms, the heads split, the Softmax axis, constant
scalar scales) and rewrites it to MultiHeadAttention(q_lin, k_lin, v_lin, num_heads=h,
scale=sq·sk) on the projected [B, S, D] activations. It is the same for CLIP, SigLIP, ViT and
DINOv2 (one form, measured on their tiny towers). The rewriter refuses a match whose
intermediates have consumers outside it, so the block whose Q and Kᵀ a pruning method's
[CLS] score reads (cls, visionzip, ... read block L's) stays in standard ops and the score
reads exactly what it read before.

Which op, by measurement (a one-off script, not kept: one block's attention with its q/k/v
projections, ONNX Runtime 1.32 CPU, 2 intra-op threads, batch 1, clip-l-336 shapes S = 577,
D = 1024, 16 heads, 30 interleaved rounds; the shared 2-core machine had load average ~4.9,
so the figures are provisional), median (min) ms, two runs:
    decomposed (standard ops)            89.0 (61.6) | 120.7 (62.5)
    com.microsoft.MultiHeadAttention     93.1 (78.3) | 112.6 (73.9)
    ONNX Attention (opset 23, CPU kernel) 108.1 (81.0) | 109.3 (73.2)
    com.microsoft.Attention, packed QKV  93.8 (65.4) |  97.4 (70.0)
All four agree to < 1e-6. Under that load no candidate is separable from the others (the run
to run spread exceeds the differences), so the choice rests on what else holds:
MultiHeadAttention takes the projected q, k, v as they are (no weights concatenated into a
second copy; the projections stay MatMul + Add), is what the earlier prototype measured at 1.03x over the dense graph on the whole
clip-l-336 tower (maxabs 7e-6), and unlike opset-23 Attention needs no opset bump of the
whole graph. tools/bench_tower.py times model.onnx (this fusion) beside model.decomposed.onnx
on the whole tower ("onnxruntime" vs "onnxruntime unfused" rows).

Qwen2-VL / Qwen2.5-VL: their q and k pass through the 2-D rotary embedding between the heads
split and the scale Mul (and Qwen2.5-VL's window attention adds a mask), which is not the form
above, so their attention is left in standard ops (by the structure; no export of theirs was
checked against the rule yet).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from vlmprune.passes.graph.dataflow import const_array, const_scalar

MS_DOMAIN = "com.microsoft"
FUSED_ATTENTION = f"{MS_DOMAIN}.MultiHeadAttention"


def _perm(value: ir.Value) -> list[int] | None:
    attr = value.producer().attributes.get("perm")
    return None if attr is None else list(attr.value)


def _heads(split: ir.Value, q: ir.Value) -> int | None:
    """The head count: the heads split's constant shape [B, S, h, dh] (dim 2), else q's [B, h, S, dh] shape."""
    shape = const_array(split)
    if shape is not None and shape.size == 4 and int(shape.reshape(-1)[2]) > 0:
        return int(shape.reshape(-1)[2])
    if q.shape is not None and len(q.shape) == 4 and isinstance(q.shape[1], int):
        return q.shape[1]
    return None


class MultiHeadAttentionFusion(RewriteRuleClassBase):
    """softmax((q·sq)(Kᵀ·sk)) V, heads split and merged by Reshape/Transpose -> MultiHeadAttention(q, k, v).

    q_cast / k_cast: whether that side's scale reaches its Mul through CastLike (the exporter writes one,
    constant folding may remove it).
    """

    def __init__(self, q_cast: bool = False, k_cast: bool = True, k_shape: bool = False):
        super().__init__(name="MultiHeadAttentionFusion" + ("(q CastLike)" if q_cast else "") +
                         ("" if k_cast else "(k no CastLike)") + ("(K shape computed)" if k_shape else ""))
        self.q_cast, self.k_cast, self.k_shape = q_cast, k_cast, k_shape

    def pattern(self, op, q_lin, k_lin, v_lin, q_split, k_split, v_split, k_flat, k_back, sq, sk, merged,
                minus_one=None, s_last=None, e_last=None, s_mid=None, e_mid=None, s_lead=None, e_lead=None):
        q = op.Transpose(op.Reshape(q_lin, q_split, _allow_other_attributes=True), _outputs=["q"])
        k = op.Transpose(op.Reshape(k_lin, k_split, _allow_other_attributes=True), _outputs=["k"])
        if self.k_shape:  # a dynamic batch: Kᵀ's shapes from Shape(K) (the exporter's batched matmul of k.mT)
            dims = op.Shape(k, _allow_other_attributes=True, _outputs=["k_dims"])
            last, mid = op.Slice(dims, s_last, e_last), op.Slice(dims, s_mid, e_mid)
            k_flat = op.Concat(minus_one, mid, last, axis=0)
            k_back = op.Concat(op.Slice(dims, s_lead, e_lead), last, mid, axis=0)
        v = op.Transpose(op.Reshape(v_lin, v_split, _allow_other_attributes=True), _outputs=["v"])
        kt = op.Reshape(op.Transpose(op.Reshape(k, k_flat, _allow_other_attributes=True), _outputs=["k_t"]), k_back,
                        _allow_other_attributes=True)
        qs = op.Mul(q, op.CastLike(sq, q) if self.q_cast else sq)
        ks = op.Mul(kt, op.CastLike(sk, kt) if self.k_cast else sk)
        probs = op.Softmax(op.MatMul(qs, ks), _outputs=["probs"])
        out = op.Transpose(op.MatMul(probs, v), _outputs=["out"])
        return op.Reshape(out, merged, _allow_other_attributes=True)

    def check(self, context, q_lin, k_lin, v_lin, q_split, k_split, v_split, k_flat, k_back, sq, sk, merged,
              q, k, v, k_t, probs, out, minus_one=None, s_last=None, e_last=None, s_mid=None, e_mid=None,
              s_lead=None, e_lead=None, k_dims=None, **_) -> MatchResult:
        result = MatchResult()
        if self.k_shape:
            start = k_dims.producer().attributes.get("start")
            if (start.value if start is not None else 0) != 0 or "end" in k_dims.producer().attributes:
                return result.fail("Shape(K) is not K's whole shape")
            slices = ((s_last, e_last, -1, None), (s_mid, e_mid, -2, -1), (s_lead, e_lead, None, -2))
            for begin, end, want_begin, want_end in slices:
                b, e = const_array(begin), const_array(end)
                if b is None or e is None or b.size != 1 or e.size != 1:
                    return result.fail("K's shape is sliced with non-constant bounds")
                b, e = int(b.reshape(-1)[0]), int(e.reshape(-1)[0])
                if (want_begin is not None and b != want_begin) or (want_begin is None and b > -4 and b != 0) \
                        or (want_end is not None and e != want_end) or (want_end is None and e < 4):
                    return result.fail("K's shape is not sliced into (batch, heads), keys, head size")
            if const_array(minus_one) is None or const_array(minus_one).reshape(-1).tolist() != [-1]:
                return result.fail("K is not flattened to [-1, keys, head size]")
        for value, name in ((q, "q"), (k, "K"), (v, "V"), (out, "the output")):
            if _perm(value) != [0, 2, 1, 3]:
                return result.fail(f"{name}'s Transpose is not the heads swap (perm 0, 2, 1, 3)")
        if _perm(k_t) != [0, 2, 1]:
            return result.fail("K's 3-D Transpose does not swap its last two axes")
        axis = probs.producer().attributes.get("axis")
        if (axis.value if axis is not None else -1) not in (-1, 3):
            return result.fail("the Softmax is not over the keys (axis -1)")
        if const_scalar(sq) is None or const_scalar(sk) is None:
            return result.fail("a scale is not a constant scalar")
        heads = _heads(q_split, q)
        if heads is None:
            return result.fail("the head count is neither a constant of the heads split nor known from q's shape")
        for split in (k_split, v_split):
            shape = const_array(split)
            if shape is not None and (shape.size != 4 or int(shape.reshape(-1)[2]) != heads):
                return result.fail("K or V is split into a different head count than q")
        merge = const_array(merged)
        if merge is not None and merge.size != 3:
            return result.fail("the heads are not merged back to [B, S, D]")
        for value in (q_lin, k_lin, v_lin):
            if value.shape is not None and len(value.shape) != 3:
                return result.fail("the projected q, k, v are not [B, S, D]")
        return result

    def rewrite(self, op, q_lin, k_lin, v_lin, q_split, sq, sk, q, **_):
        return op.MultiHeadAttention(q_lin, k_lin, v_lin, num_heads=_heads(q_split, q),
                                     scale=const_scalar(sq) * const_scalar(sk), _domain=MS_DOMAIN)


def attention_rules() -> list:
    """Every spelling of the exporter's attention the rule takes (the CastLike on either scale, or none)."""
    return [MultiHeadAttentionFusion.rule(q_cast, k_cast, k_shape) for k_shape in (True, False)
            for q_cast in (False, True) for k_cast in (True, False)]


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == "MultiHeadAttention")

