"""Fuse the exported LLM graphs' residual Add and the RMSNorm that reads it into ONNX Runtime's
SkipSimplifiedLayerNormalization.

Why: compiler.llm.torch_exporter spells each RMSNorm as seven elementwise nodes, Pow(x, 2), ReduceMean over the last
axis, Add(eps), Sqrt, Reciprocal, Mul(x, ·), Mul(weight, ·), after the residual Add, each of which reads and writes a
[B, S, D] tensor: on a Qwen2-0.5B-shaped prefill (49 norms, 47 after a residual Add) they are most of what separates
the fused graph from onnxruntime-genai's builder graph besides the attention op (tools/bench_e2e.py --profile).
ONNX Runtime's own level-2 fusions do not fire on this form (they look for Div by the Sqrt, not Mul by its
Reciprocal), so the graph is rewritten here into the op the builder writes: SkipSimplifiedLayerNormalization(a, b,
weight) gives both the normed value and a + b (the residual stream the next layer's Add reads) from one pass over
the rows, computing in fp32 as the seven nodes do.

Matched by structure only (SkipRmsNormFusion): the square's exponent is the constant 2, the mean is over the last
axis alone with keepdims, epsilon a constant scalar, the weight a constant 1-D tensor as long as the last axis, and
the Add's inputs 3-D of one shape (the op's contract; a broadcasting Add is left alone). A norm without a residual
Add before it (the first layer's, Qwen3's per-head q/k norms) stays as it is: the op without the skip,
SimplifiedLayerNormalization, is an ONNX Runtime op registered in the ONNX domain, which the ONNX checker rejects in
a graph this project ships. Norms of another form (a weight that is not a constant, a mean over more axes) are left
as they are too: fusion here is a speed-up with equal numbers, never a condition of a compile.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from vlmprune.passes.graph.dataflow import const_array, const_ints, const_scalar

MS_DOMAIN = "com.microsoft"
FUSED = "SkipSimplifiedLayerNormalization"


def _rms_norm(op, x, two, axes, eps, weight):
    """weight · x / sqrt(mean(x², axes) + eps) as torch.onnx spells an RMSNorm."""
    mean = op.ReduceMean(op.Pow(x, two), axes, _allow_other_attributes=True, _outputs=["mean"])
    return op.Mul(weight, op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean, eps)))))


def _rms_norm_reason(x, two, axes, eps, weight, mean) -> str | None:
    """None when the matched nodes are an RMSNorm over x's last axis with a constant gain, else why not."""
    if const_scalar(two) != 2.0:
        return "the Pow is not a square (exponent 2)"
    keep = mean.producer().attributes.get("keepdims")
    if keep is not None and keep.value != 1:
        return "the mean does not keep its axis (keepdims 0)"
    rank = None if x.shape is None else len(x.shape)
    if const_ints(axes) not in ([-1], *([[rank - 1]] if rank else [])):
        return "the mean is not over the last axis alone"
    if const_scalar(eps) is None:
        return "epsilon is not a constant scalar"
    gain = const_array(weight)
    if gain is None or gain.ndim != 1:
        return "the weight is not a constant 1-D tensor"
    last = None if not rank else x.shape[-1]
    if last is None or (isinstance(last, int) and last != gain.shape[0]):
        return "the weight's length is not x's last axis"
    return None


class SkipRmsNormFusion(RewriteRuleClassBase):
    """RMSNorm(a + b) -> SkipSimplifiedLayerNormalization(a, b, weight), which also gives a + b."""

    def pattern(self, op, a, b, two, axes, eps, weight):
        total = op.Add(a, b, _outputs=["total"])
        return _rms_norm(op, total, two, axes, eps, weight), total

    def check(self, context, a, b, two, axes, eps, weight, total, mean, **_) -> MatchResult:
        check = MatchResult()
        reason = _rms_norm_reason(total, two, axes, eps, weight, mean)
        if reason is not None:
            return check.fail(reason)
        for value, name in ((a, "the residual"), (b, "the added branch")):
            if value.shape is None or len(value.shape) != 3:
                return check.fail(f"{name} is not 3-D [batch, sequence, width] (the fused op's input)")
        if list(a.shape) != list(b.shape):
            return check.fail("the Add broadcasts (its inputs' shapes differ)")
        return check

    def rewrite(self, op, a, b, eps, weight, **_):
        out, _mean, _inv, total = op.SkipSimplifiedLayerNormalization(
            a, b, weight, epsilon=float(const_scalar(eps)), _domain=MS_DOMAIN, _outputs=4)
        return out, total


def llm_norm_rules() -> list:
    return [SkipRmsNormFusion.rule()]


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == FUSED)


class LlmNormFusionPass(ir.passes.InPlacePass):
    """Every RMSNorm of the form above that reads a residual Add -> one SkipSimplifiedLayerNormalization."""

    def requires(self, model: ir.Model) -> None:
        if count_fused(model):
            raise ir.passes.PreconditionError("the graph's norms are fused already")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # commute: the weight may be either factor of its Mul, the residual either side of its Add
        fired = RewriteRuleSet(llm_norm_rules(), commute=True).apply_to_model(model)
        if fired:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(fired))
