"""Fuse each decoder layer's attention of the exported LLM graphs into com.microsoft.MultiHeadAttention.

Why: compiler.llm.torch_exporter spells a layer's attention as MatMul(q, Kᵀ), a scale Mul, in
the prefill graph a causal mask built per layer as Where(Greater(Unsqueeze(Range), Unsqueeze(Range)),
-inf, scores) over [B, heads, S, S], Softmax, MatMul with V, and the heads merged by Transpose +
Reshape. On a Qwen2-0.5B-shaped model that Where alone cost 216 ms and its Softmax 179 ms of a
2,344 ms prefill (tools/bench_e2e.py --profile). ONNX Runtime's MultiHeadAttention takes the mask as an attribute
(unidirectional=1: key j is hidden from query i when j > i, which is the graph's mask when the
keys are the queries, as in prefill) and runs scores, softmax and the weighted sum in one
kernel, without materialising the mask.

The rule matches by structure only and checks every constant that fixes the semantics: Kᵀ is a
Transpose of a 4-D K swapping its last two axes, the scale is a constant scalar, the Softmax
is over the keys, the output Transpose is the heads swap and the Reshape merges to 3 axes, and
(prefill) the mask's condition is Greater(Unsqueeze(r, axis 0), Unsqueeze(r, axis 1)) of one
Range(0, n, 1) with a fill of -inf. It rewrites to
MultiHeadAttention(q as [B, S, H·d], K, V, num_heads=H, scale, unidirectional) with K and V as
they are, [B, H, L, d] (the op's "BNSH key" form), after the rotary embedding and the GQA heads
expansion. The rotary embedding, the caches (present.*: the unexpanded K and V) and FastV's
selection are untouched: FastV's score row reads layer K's q and K, which stay in the graph as
values of their own, and the later layers' kept tokens keep their original positions because
the rotary embedding that carries them runs before the matched part.

A decoder whose prefill mask is not plain causal (Gemma 3: a bidirectional image block, sliding-window layers) is
exported with the mask as an additive bias computed in the graph from its inputs, q·Kᵀ·s + bias; that form becomes
MultiHeadAttention(q, K, V, attention_bias=bias, unidirectional=0), the bias's nodes left in the graph (computed once
per layer type, not per layer). Attention logit softcapping has no place in the op: such a decoder is refused before
the export (compiler.llm.lm_source.check_family).

Why MultiHeadAttention and not GroupQueryAttention: GQA takes K and V before the rotary
embedding and the heads expansion in [B, S, Hkv·d] and applies the rotary embedding from its
own cos/sin caches indexed by sequence position; after FastV a layer's cache length is not the
position, and position ids with gaps (a tower-pruned image's original positions) are not
expressible through GQA's seqlens. MultiHeadAttention takes what the graph already computed.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import const_array, const_ints, const_scalar

MS_DOMAIN = "com.microsoft"
FUSED = "MultiHeadAttention"


def _perm(value: ir.Value) -> list[int] | None:
    node = value.producer()
    attr = None if node is None else node.attributes.get("perm")
    return None if attr is None else list(attr.value)


def _heads(q: ir.Value, k: ir.Value) -> int | None:
    """The head count: dim 1 of q's [B, H, S, d] shape, else of the expanded K's."""
    for value in (q, k):
        if value.shape is not None and len(value.shape) == 4 and isinstance(value.shape[1], int):
            return value.shape[1]
    return None


def _unsqueezed_axis(value: ir.Value) -> tuple[ir.Value, int] | None:
    """(the input, the one axis) of an Unsqueeze producing value, else None."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or node.domain not in ("", "ai.onnx"):
        return None
    axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    return (node.inputs[0], axes[0]) if axes is not None and len(axes) == 1 else None


def _causal_mask_reason(cond: ir.Value) -> str | None:
    """None when cond is steps[None, :] > steps[:, None] over steps = Range(0, n, 1), else why not."""
    node = cond.producer()
    if node is None or node.op_type != "Greater" or node.domain not in ("", "ai.onnx"):
        return "the mask's condition is not a Greater"
    cols, rows = _unsqueezed_axis(node.inputs[0]), _unsqueezed_axis(node.inputs[1])
    if cols is None or rows is None or cols[0] is not rows[0]:
        return "the mask does not compare one sequence of steps unsqueezed twice"
    if cols[1] != 0 or rows[1] not in (1, -1):
        return "the mask is not key index > query index (steps[None, :] > steps[:, None])"
    steps = cols[0].producer()
    if steps is None or steps.op_type != "Range":
        return "the mask's steps are not a Range"
    if const_scalar(steps.inputs[0]) != 0 or const_scalar(steps.inputs[2]) != 1:
        return "the mask's Range does not start at 0 with step 1"
    return None


class CausalAttentionFusion(RewriteRuleClassBase):
    """softmax(mask(q·Kᵀ·s)) V, heads merged -> MultiHeadAttention(q, K, V); masked: the prefill's causal form;
    biased: an additive mask computed in the graph (q·Kᵀ·s + bias), which becomes the op's attention_bias."""

    def __init__(self, masked: bool, biased: bool = False):
        super().__init__(name="BiasedAttentionFusion" if biased else
                         "CausalAttentionFusion" if masked else "UnmaskedAttentionFusion")
        self.masked, self.biased = masked, biased

    def pattern(self, op, q, k_t, scale, v, merged, cond=None, fill=None, bias=None):
        scores = op.Mul(op.MatMul(q, k_t), scale)
        if self.masked:
            scores = op.Where(cond, fill, scores)
        if self.biased:
            scores = op.Add(scores, bias)
        probs = op.Softmax(scores, _outputs=["probs"])
        out = op.Transpose(op.MatMul(probs, v), _outputs=["out"])
        return op.Reshape(out, merged, _allow_other_attributes=True, _outputs=["result"])

    def check(self, context, q, k_t, scale, v, merged, probs, out, result, cond=None, fill=None, bias=None,
              **_) -> MatchResult:
        check = MatchResult()
        if _perm(k_t) != [0, 1, 3, 2] or k_t.producer().op_type != "Transpose":
            return check.fail("Kᵀ is not a Transpose of a 4-D K swapping its last two axes")
        k = k_t.producer().inputs[0]
        if const_scalar(scale) is None:
            return check.fail("the scale is not a constant scalar")
        axis = probs.producer().attributes.get("axis")
        if (axis.value if axis is not None else -1) not in (-1, 3):
            return check.fail("the Softmax is not over the keys (axis -1)")
        if _perm(out) != [0, 2, 1, 3]:
            return check.fail("the output Transpose is not the heads swap (perm 0, 2, 1, 3)")
        if result.shape is not None and len(result.shape) != 3:
            return check.fail("the heads are not merged back to [B, S, H·d]")
        shape = const_array(merged)
        if shape is not None and shape.size != 3:
            return check.fail("the heads are not merged back to [B, S, H·d]")
        for value, name in ((q, "q"), (k, "K"), (v, "V")):
            if value.shape is not None and len(value.shape) != 4:
                return check.fail(f"{name} is not [B, heads, length, head size]")
        heads = _heads(q, k)
        if heads is None:
            return check.fail("the head count is not known from q's or K's shape")
        for value in (k, v):
            if value.shape is not None and isinstance(value.shape[1], int) and value.shape[1] != heads:
                return check.fail("K or V has another head count than q (GQA heads not expanded)")
        if self.masked:
            reason = _causal_mask_reason(cond)
            if reason is not None:
                return check.fail(reason)
            value = const_scalar(fill)
            if value is None or not (value == -math.inf or value <= -1e30):
                return check.fail("the mask's fill is not -inf")
        if self.biased:  # the op's attention_bias: [B or 1, H or 1, S, L], added to the scaled scores
            if bias.shape is None or len(bias.shape) != 4:
                return check.fail("the additive mask is not 4-D [B or 1, H or 1, S, L]")
            if isinstance(bias.shape[1], int) and bias.shape[1] not in (1, heads):
                return check.fail("the additive mask's head axis is neither 1 nor the head count")
        return check

    def rewrite(self, op, q, k_t, scale, v, bias=None, **_):
        k = k_t.producer().inputs[0]
        heads = _heads(q, k)
        query = op.Reshape(op.Transpose(q, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))
        if self.biased:  # inputs 3 and 4 (the projections' bias, key_padding_mask) are absent
            return op.MultiHeadAttention(query, k, v, None, None, bias, num_heads=heads, scale=const_scalar(scale),
                                         unidirectional=0, _domain=MS_DOMAIN)
        return op.MultiHeadAttention(query, k, v, num_heads=heads, scale=const_scalar(scale),
                                     unidirectional=1 if self.masked else 0, _domain=MS_DOMAIN)


def llm_attention_rules() -> list:
    """The prefill's causal attention, the decode step's unmasked one (one query over the cache), and the prefill
    attention under an additive mask (Gemma 3's: the bidirectional image block, the sliding window)."""
    return [CausalAttentionFusion.rule(True), CausalAttentionFusion.rule(False, biased=True),
            CausalAttentionFusion.rule(False)]


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == FUSED)


class LlmAttentionFusionPass(ir.passes.InPlacePass):
    """Every layer's attention of an exported prefill or decode graph -> MultiHeadAttention; all or a clear error.

    layers: the decoder's layer count; a graph where fewer fire is refused (a partly fused graph would
    hide a form the rule does not know), with the rewriter's reasons for the nearest misses in debug.
    """

    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers

    def requires(self, model: ir.Model) -> None:
        if count_fused(model):
            raise ir.passes.PreconditionError("the graph's attention is fused already")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        fired = RewriteRuleSet(llm_attention_rules()).apply_to_model(model)
        if count_fused(model) != self.layers:
            raise StructureError(f"fused attention: {count_fused(model)} of the {self.layers} layers matched the "
                                 "exported attention's form (MatMul, scale, [causal Where], Softmax, MatMul)")
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        RemoveUnusedNodesPass()(model)  # the masks' Range/Greater and the -inf fills, now read by nobody
        return ir.passes.PassResult(model, modified=bool(fired))
