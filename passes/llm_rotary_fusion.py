"""Fuse the exported LLM graphs' rotary embedding, x·cos + rotate_half(x)·sin, into com.microsoft.RotaryEmbedding.

Why: compiler.llm.torch_exporter rotates each layer's q and K as transformers writes it: two Slices of the head's
halves, a Neg, a Concat, two Muls and an Add, each reading and writing a [B, heads, S, d] tensor; at a Qwen2-0.5B
shape that is 14 elementwise passes a layer over the prefill's q and K, where onnxruntime-genai's builder does the
rotation inside its attention op. RotaryEmbedding does it in one pass.

What it is fed: the graph's own cos and sin rows ([B, S, d], computed once from position_ids, mRoPE's sections and
any attention scaling included), not a cos/sin cache of max_position_embeddings rows: cos_cache is those rows
flattened to [B·S, d/2] and position_ids is 0 .. B·S-1 laid out as [B, S], so token (b, s) reads exactly the row the
graph computed for it. Gaps in the positions (a tower-pruned image's original ones) and batches whose rows have
different positions therefore need nothing of their own, and the graph carries no table of every position.

The op takes cos[..., :d/2] for both halves, so the rule holds only where the graph's cos and sin repeat their
halves: each is Cos/Sin (through a scalar Mul or a Cast) of a Concat of two equal angle tensors along the last axis,
which is how transformers' rotary embeddings build them (emb = cat(freqs, freqs)). Matched by structure
(RotaryFusion): the Slices take [d/2, end) and [0, d/2) of the last axis with step 1, the Concat puts the negated
upper half first, cos and sin are 3-D [B, S, d] unsqueezed at axis 1, x is 4-D with a static even head size. A
partial rotary embedding (Qwen3.5's: the rotated features a slice of the head) or any other form is left as it is:
a speed-up with equal numbers, never a condition of a compile.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from vlmprune.passes.graph.dataflow import const_array, const_ints, const_scalar

MS_DOMAIN = "com.microsoft"
FUSED = "RotaryEmbedding"
_LAST_AXIS = ([-1], [3])
_PASS_THROUGH = ("Cast", "Mul")  # Mul by a scalar constant: the rope's attention scaling


def _same_value(a: ir.Value | None, b: ir.Value | None, depth: int = 8) -> bool:
    """a and b hold the same numbers by construction: one value, equal constants, or the same output of two nodes
    of one kind with equal attributes whose inputs are pairwise the same (to depth). torch.export does not merge
    repeated subexpressions: the rotation's Slices and its Mul read two Transposes of two Reshapes of one projection,
    and cat(freqs, freqs) is two Muls of the same inputs."""
    if a is b:
        return True
    if a is None or b is None or depth == 0:
        return False
    ca, cb = const_array(a), const_array(b)
    if ca is not None or cb is not None:
        return ca is not None and cb is not None and ca.shape == cb.shape and bool((ca == cb).all())
    pa, pb = a.producer(), b.producer()
    if pa is None or pb is None or (pa.op_type, pa.domain) != (pb.op_type, pb.domain):
        return False
    if a.index() != b.index() or len(pa.inputs) != len(pb.inputs):
        return False
    if {k: repr(v.value) for k, v in pa.attributes.items()} != {k: repr(v.value) for k, v in pb.attributes.items()}:
        return False
    return all(_same_value(x, y, depth - 1) for x, y in zip(pa.inputs, pb.inputs))


def _halves_repeat(value: ir.Value, trig: str) -> bool:
    """value is trig (Cos or Sin) of cat(angle, angle) along the last axis, through Casts and scalar Muls."""
    node = value.producer()
    while node is not None and node.op_type in _PASS_THROUGH:
        if node.op_type == "Mul":
            scalar = [i for i in node.inputs if const_scalar(i) is not None]
            if len(scalar) != 1:
                return False
            node = next(i for i in node.inputs if i is not scalar[0]).producer()
        else:
            node = node.inputs[0].producer()
    if node is None or node.op_type != trig:
        return False
    cat = node.inputs[0].producer()
    if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 2:
        return False
    axis = cat.attributes.get("axis")
    rank = None if cat.outputs[0].shape is None else len(cat.outputs[0].shape)
    if axis is None or axis.value not in (-1, *(() if rank is None else (rank - 1,))):
        return False
    return _same_value(cat.inputs[0], cat.inputs[1])


def _rows(value: ir.Value) -> ir.Value | None:
    """The [B, S, d] table that value is unsqueezed from at axis 1, else None."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or len(node.inputs) != 2 or const_ints(node.inputs[1]) != [1]:
        return None
    return node.inputs[0]


class RotaryFusion(RewriteRuleClassBase):
    """x·Unsqueeze(cos, 1) + Concat(-x[..., d/2:], x[..., :d/2])·Unsqueeze(sin, 1) -> RotaryEmbedding(x, ...)."""

    def pattern(self, op, x, x_hi, x_lo, hi_start, hi_end, hi_axes, hi_steps, lo_start, lo_end, lo_axes, lo_steps,
                cos4, sin4):
        # cos4 and sin4 are pattern inputs, not matched Unsqueezes: one Unsqueeze serves q's and K's rotation, and a
        # matched node whose output is read outside the match cannot be replaced
        upper = op.Slice(x_hi, hi_start, hi_end, hi_axes, hi_steps)
        lower = op.Slice(x_lo, lo_start, lo_end, lo_axes, lo_steps)
        turned = op.Concat(op.Neg(upper), lower, _allow_other_attributes=True, _outputs=["turned"])
        return op.Add(op.Mul(x, cos4), op.Mul(turned, sin4))

    def check(self, context, x, x_hi, x_lo, hi_start, hi_end, hi_axes, hi_steps, lo_start, lo_end, lo_axes, lo_steps,
              cos4, sin4, turned, **_) -> MatchResult:
        check = MatchResult()
        if not (_same_value(x, x_hi) and _same_value(x, x_lo)):
            return check.fail("the halves are not sliced from the value the cos term multiplies")
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int) or x.shape[3] % 2:
            return check.fail("x is not 4-D [B, heads, S, d] with a static even head size")
        half = x.shape[3] // 2
        if const_ints(hi_axes) not in _LAST_AXIS or const_ints(lo_axes) not in _LAST_AXIS:
            return check.fail("the Slices are not along the head's last axis")
        if const_ints(hi_steps) != [1] or const_ints(lo_steps) != [1]:
            return check.fail("a Slice's step is not 1")
        upper_end = const_ints(hi_end)
        if const_ints(hi_start) != [half] or upper_end is None or upper_end[0] < 2 * half:
            return check.fail("the first Slice is not the head's upper half [d/2, end)")
        if const_ints(lo_start) != [0] or const_ints(lo_end) != [half]:
            return check.fail("the second Slice is not the head's lower half [0, d/2)")
        axis = turned.producer().attributes.get("axis")
        if axis is None or axis.value not in (-1, 3):
            return check.fail("the halves are not concatenated along the last axis")
        for value, name in ((cos4, "cos"), (sin4, "sin")):
            table = _rows(value)
            if table is None:
                return check.fail(f"{name} is not a [B, S, d] value unsqueezed at the heads' axis 1")
            if table.shape is None or len(table.shape) != 3 or table.shape[2] != 2 * half:
                return check.fail(f"{name} is not [B, S, d]")
        if not _halves_repeat(_rows(cos4), "Cos") or not _halves_repeat(_rows(sin4), "Sin"):
            return check.fail("cos or sin are not built from cat(angle, angle): their halves may differ")
        return check

    def rewrite(self, op, x, cos4, sin4, **_):
        half = x.shape[3] // 2
        cos, sin = _rows(cos4), _rows(sin4)
        rows = op.Constant(value_ints=[-1, 2 * half])
        cut = (op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), op.Constant(value_ints=[1]))
        cos_rows = op.Slice(op.Reshape(cos, rows), *cut)  # [B·S, d/2]: token (b, s)'s own row at b·S + s
        sin_rows = op.Slice(op.Reshape(sin, rows), *cut)
        grid = op.Shape(cos, start=0, end=2)  # [B, S]
        count = op.ReduceProd(grid, keepdims=0)
        positions = op.Reshape(op.Range(op.Constant(value_int=0), count, op.Constant(value_int=1)), grid)
        return op.RotaryEmbedding(x, positions, cos_rows, sin_rows, _domain=MS_DOMAIN)


def rotary_rules() -> list:
    return [RotaryFusion.rule()]


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == FUSED)


class LlmRotaryFusionPass(ir.passes.InPlacePass):
    """Every rotation of q and K whose form allows it -> RotaryEmbedding; the rest stays as exported."""

    def requires(self, model: ir.Model) -> None:
        if count_fused(model):
            raise ir.passes.PreconditionError("the graph's rotary embedding is fused already")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        fired = RewriteRuleSet(rotary_rules()).apply_to_model(model)
        if fired:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(fired))
