"""The prefill's causal MultiHeadAttention over heads a GQA decoder shares -> com.microsoft.GroupQueryAttention.

Why: passes.llm_attention_fusion gives each layer one MultiHeadAttention, but MultiHeadAttention wants K and V with
as many heads as q, so the graph still materialises each shared key/value head once per query head (torch.onnx's
repeat_kv: Unsqueeze, Expand, Reshape) before every prefill attention, and the op then reads that copy. ONNX
Runtime's GroupQueryAttention reads the Hkv heads as they are and maps query head h to key/value head h // (H / Hkv),
which is repeat_kv's order; on a Qwen2-0.5B-shaped layer at 640 tokens (14 query heads, 2 key/value heads) its
CPU kernel plus the K/V layout change costs about 6 ms less than the expansion plus MultiHeadAttention, per layer.
It is what onnxruntime-genai's builder writes.

Only the op's attention is used here, not its rotary embedding (do_rotary 0): the graph has already rotated q and K
at the tokens' own position ids, which after a tower-pruned image have gaps and after FastV are not the cache
index; the op's causal mask is by index within the sequence, which is the graph's mask since kept tokens stay in
order. Its present_key/present_value outputs are left unused: the graph's present.* are the rotated K and V it
already computes. seqlens_k (each row's length - 1) and total_sequence_length are read from q's shape, so a layer
after FastV's selection gets its own shorter length.

Matched by structure, never by names (GroupQueryAttentionFusion): a MultiHeadAttention with unidirectional 1 and
only q, K, V (no bias, no padding mask: Gemma 3's additive-mask form and the decode step's one-query form stay as
they are); K and V either repeat_kv of a [B, Hkv, L, d] value (an Unsqueeze at axis 2, an Expand, a Reshape merging
the two head axes, with Hkv · groups = the op's num_heads) or already of num_heads heads; the head size a static
multiple of 8, which ONNX Runtime's CPU kernel requires (it fails at run time otherwise).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from vlmprune.passes.graph.dataflow import const_ints

MS_DOMAIN = "com.microsoft"
FUSED = "GroupQueryAttention"


def _attribute(node: ir.Node, name: str):
    attr = node.attributes.get(name)
    return None if attr is None else attr.value


def _kv_heads(value: ir.Value) -> int | None:
    """dim 1 of a 4-D [B, heads, L, d] value, where static."""
    shape = value.shape
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    return shape[1]


class GroupQueryAttentionFusion(RewriteRuleClassBase):
    """MultiHeadAttention(q, repeat_kv(K), repeat_kv(V), unidirectional=1) -> GroupQueryAttention(q, K, V) with K and
    V as [B, L, Hkv·d]; expanded False: K and V already of q's head count (GroupQueryAttention with Hkv = H)."""

    def __init__(self, expanded: bool):
        super().__init__(name="GroupQueryAttentionFusion" if expanded else "SameHeadsAttentionFusion")
        self.expanded = expanded

    def pattern(self, op, query, k, v, k_axes=None, k_shape5=None, k_shape4=None, v_axes=None, v_shape5=None,
                v_shape4=None):
        if self.expanded:
            k = op.Reshape(op.Expand(op.Unsqueeze(k, k_axes), k_shape5), k_shape4, _allow_other_attributes=True,
                           _outputs=["k_heads"])
            v = op.Reshape(op.Expand(op.Unsqueeze(v, v_axes), v_shape5), v_shape4, _allow_other_attributes=True,
                           _outputs=["v_heads"])
        return op.MultiHeadAttention(query, k, v, _domain=MS_DOMAIN, _allow_other_attributes=True,
                                     _outputs=["attended"])

    def check(self, context, query, k, v, attended, k_axes=None, v_axes=None, k_heads=None, v_heads=None,
              **_) -> MatchResult:
        check = MatchResult()
        node = attended.producer()
        if len(node.inputs) != 3:
            return check.fail("the attention has inputs beyond q, K and V (a bias or a padding mask)")
        if _attribute(node, "unidirectional") != 1:
            return check.fail("the attention is not causal (unidirectional 1): not a prefill's")
        heads = _attribute(node, "num_heads")
        if heads is None:
            return check.fail("the attention has no num_heads")
        if query.shape is not None and len(query.shape) != 3:
            return check.fail("q is not [B, S, H·d]")
        kv = _kv_heads(k)
        if kv is None or _kv_heads(v) != kv:
            return check.fail("K and V are not 4-D [B, Hkv, L, d] with one static head count")
        size = k.shape[3]
        if not isinstance(size, int) or size % 8 or v.shape[3] != size:
            return check.fail("the head size is not a static multiple of 8 (ONNX Runtime's GroupQueryAttention "
                              "refuses others at run time)")
        if self.expanded:
            for axes, name in ((k_axes, "K"), (v_axes, "V")):
                if const_ints(axes) != [2]:
                    return check.fail(f"{name}'s heads are not repeated along a new axis 2 (repeat_kv's Unsqueeze)")
            for value, name in ((k_heads, "K"), (v_heads, "V")):
                if _kv_heads(value) != heads:
                    return check.fail(f"the repeated {name} does not have the attention's {heads} heads")
            if heads % kv:
                return check.fail(f"{heads} query heads are not a multiple of {kv} key/value heads")
        elif kv != heads:
            return check.fail("K and V do not have the attention's head count")
        return check

    def rewrite(self, op, query, k, v, attended, **_):
        node = attended.producer()
        heads, scale = _attribute(node, "num_heads"), _attribute(node, "scale")
        merge = op.Constant(value_ints=[0, 0, -1])
        key = op.Reshape(op.Transpose(k, perm=[0, 2, 1, 3]), merge)  # [B, Hkv, L, d] -> [B, L, Hkv·d]
        value = op.Reshape(op.Transpose(v, perm=[0, 2, 1, 3]), merge)
        length = op.Shape(query, start=1, end=2)  # [S], int64
        total = op.Cast(op.Squeeze(length), to=ir.DataType.INT32)
        seqlens = op.Expand(op.Sub(length, op.Constant(value_ints=[1])), op.Shape(query, start=0, end=1))  # [B]
        extra = {} if scale is None else {"scale": scale}
        out, _key, _value = op.GroupQueryAttention(
            query, key, value, None, None, op.Cast(seqlens, to=ir.DataType.INT32), total,
            num_heads=heads, kv_num_heads=_kv_heads(k), _domain=MS_DOMAIN, _outputs=3, **extra)
        return out


def gqa_rules() -> list:
    return [GroupQueryAttentionFusion.rule(True), GroupQueryAttentionFusion.rule(False)]


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == FUSED)


class LlmGroupQueryAttentionPass(ir.passes.InPlacePass):
    """Each causal MultiHeadAttention of a fused prefill graph -> GroupQueryAttention where its form allows; others
    (the decode step's, an additive mask's) stay: a speed-up with equal numbers, never a condition of a compile."""

    def requires(self, model: ir.Model) -> None:
        if count_fused(model):
            raise ir.passes.PreconditionError("the graph already has GroupQueryAttention")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        fired = RewriteRuleSet(gqa_rules()).apply_to_model(model)
        if fired:
            RemoveUnusedNodesPass()(model)  # repeat_kv's Unsqueeze/Expand/Reshape, now read by nobody
        return ir.passes.PassResult(model, modified=bool(fired))
