"""Fuse the inserted pruning subgraph into one node: `vlmprune.TokenPrune`, or a target's spelling of it.

Why: the decomposed selection (two TopKs, GatherND, a scatter-built mask and a
mask·X MatMul for the summary) reads the hidden states several times and
materialises [B, N] and [B, K, D] intermediates; the fused op reads each token
once (kernels/, one C ABI for ONNX Runtime and TensorRT).

Boundary: the node takes the final scores [B, N] and the hidden states, and
returns the pruned tokens and the kept indices. The [CLS]-row scorer stays in
standard ops upstream: it is a handful of O(N·d) ops whose inputs differ by
exporter (scaling before or after Q·Kᵀ), so keeping it outside lets one fused op
serve every tower (see tools/bench_fused_op.py for the measured cost of each part).

The rule matches by structure only, checks every constant that fixes the
semantics (K, the tie rule, raster order, the summary weight 1/(N-K)), and
refuses to fuse when an intermediate has consumers outside the subgraph (the
rewriter's own guard).

Spelling: the node is `vlmprune.TokenPrune` for ONNX Runtime (ORT_OP); a target
passes its own FusedOp, e.g. TensorRT's plugin convention (op_type = the plugin's
name, attributes plugin_version / plugin_namespace). The sort of the kept indices
is recognised in both forms the passes emit: TopK over the int64 indices, or
Cast(float) -> TopK -> Cast(int64) (passes.tensorrt.SortIndicesAsFloatPass).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, MatchingTracer, RewriteRuleClassBase, RewriteRuleSet

DOMAIN = "vlmprune"
OP_TYPE = "TokenPrune"


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """How the fused node is written: op_type, domain (imported at `version`), extra constant attributes.

    The node always has inputs (hidden, scores), outputs (tokens, kept_indices) and
    the attributes keep and has_cls; `attributes` adds target-specific ones.
    """

    op_type: str = OP_TYPE
    domain: str = DOMAIN
    version: int = 1
    attributes: tuple[tuple[str, int | float | str], ...] = ()


ORT_OP = FusedOp()


def _const(value: ir.Value | None) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def _is(value: ir.Value, expected) -> bool:
    array = _const(value)
    return array is not None and array.reshape(-1).tolist() == list(expected)


def _attr(value: ir.Value, name: str, default=None):
    attr = value.producer().attributes.get(name)
    return default if attr is None else attr.value


class TokenPruneFusion(RewriteRuleClassBase):
    """[CLS] ++ GatherND(X, sort(TopK(S, K))) ++ mean(X[pruned]) -> vlmprune.TokenPrune(X, S)."""

    def __init__(self, spelling: FusedOp = ORT_OP, sort_via_float: bool = False):
        super().__init__(name="TokenPruneFusion" + ("(float sort)" if sort_via_float else ""))
        self.spelling = spelling
        self.sort_via_float = sort_via_float

    def pattern(self, op, hidden, scores, k, unsq_kept, unsq_w, inv_pruned, p_start, p_end, p_axis,
                c_start, c_end, c_axis):
        _, top = op.TopK(scores, k, _outputs=["top_values", "top"])
        if self.sort_via_float:
            top_float = op.Cast(top, _outputs=["top_float"])
            sorted_kept, _ = op.TopK(top_float, k, _outputs=["sorted_kept", "sorted_positions"])
            kept = op.Cast(sorted_kept, _outputs=["kept"])
        else:
            kept, _ = op.TopK(top, k, _outputs=["kept", "kept_values"])
        patches = op.Slice(hidden, p_start, p_end, p_axis, _outputs=["patches"])
        gathered = op.GatherND(patches, op.Unsqueeze(kept, unsq_kept), _outputs=["gathered"])
        ones = op.ConstantOfShape(op.Shape(scores), _outputs=["ones"])
        zeros = op.ConstantOfShape(op.Shape(kept), _outputs=["zeros"])
        mask = op.ScatterElements(ones, kept, zeros, _outputs=["mask"])
        summary = op.MatMul(op.Unsqueeze(op.Mul(mask, inv_pruned), unsq_w), patches)
        cls = op.Slice(hidden, c_start, c_end, c_axis)
        tokens = op.Concat(cls, gathered, summary, _outputs=["tokens"])
        return tokens, kept

    def check(self, context, hidden, scores, k, unsq_kept, unsq_w, inv_pruned, p_start, p_end, p_axis,
              c_start, c_end, c_axis, top, kept, gathered, ones, zeros, mask, tokens, sorted_kept=None,
              top_float=None, **_) -> MatchResult:
        result = MatchResult()
        keep = _const(k)
        if keep is None or keep.size != 1:
            return result.fail("K is not a constant")
        keep = int(keep.reshape(-1)[0])
        if (_attr(top, "largest", 1), _attr(top, "sorted", 1), _attr(top, "axis", -1)) != (1, 1, -1):
            return result.fail("first TopK is not largest/sorted over the last axis")
        sort = kept if sorted_kept is None else sorted_kept
        if (_attr(sort, "largest", 1), _attr(sort, "sorted", 1)) != (0, 1):
            return result.fail("second TopK does not sort the indices ascending")
        if sorted_kept is not None:
            n_sorted = scores.shape[-1] if scores.shape is not None else None
            if _attr(top_float, "to") != ir.DataType.FLOAT or _attr(kept, "to") != ir.DataType.INT64:
                return result.fail("the float sort is not Cast(float) -> TopK -> Cast(int64)")
            if not isinstance(n_sorted, int) or n_sorted >= 1 << 24:
                return result.fail("the float sort is exact only for a static N < 2^24")
        if _attr(gathered, "batch_dims", 0) != 1 or not _is(unsq_kept, [-1]) and not _is(unsq_kept, [2]):
            return result.fail("GatherND is not a per-image gather of the kept rows")
        if _attr(mask, "axis", 0) not in (1, -1):
            return result.fail("ScatterElements does not scatter along the patch axis")
        for value, fill in ((ones, 1.0), (zeros, 0.0)):
            attr = value.producer().attributes.get("value")
            if attr is None or attr.value.numpy().reshape(-1).tolist() != [fill]:
                return result.fail(f"mask constant is not {fill}")
        if not (_is(p_start, [1]) and _is(p_axis, [1]) and _const(p_end) is not None
                and int(_const(p_end).reshape(-1)[0]) >= np.iinfo(np.int32).max):
            return result.fail("patches are not hidden[:, 1:]")
        if not (_is(c_start, [0]) and _is(c_end, [1]) and _is(c_axis, [1])):
            return result.fail("[CLS] is not hidden[:, 0:1]")
        if not _is(unsq_w, [1]) or _attr(tokens, "axis", None) not in (1, -2):
            return result.fail("summary or Concat axis differs")
        n = scores.shape[-1] if scores.shape is not None else None
        inv = _const(inv_pruned)
        if not isinstance(n, int) or inv is None or inv.size != 1:
            return result.fail("patch count is not static")
        if not np.isclose(float(inv.reshape(-1)[0]), 1.0 / (n - keep), rtol=1e-6):
            return result.fail(f"summary weight {float(inv.reshape(-1)[0])} is not 1/(N-K) = 1/{n - keep}")
        return result

    def rewrite(self, op, hidden, scores, k, **_):
        keep = int(_const(k).reshape(-1)[0])
        spelling = self.spelling
        make = getattr(op, spelling.op_type)
        return make(hidden, scores, keep=keep, has_cls=1, **dict(spelling.attributes), _domain=spelling.domain,
                    _outputs=2)


def fuse_token_prune_rules(spelling: FusedOp = ORT_OP) -> RewriteRuleSet:
    return RewriteRuleSet([TokenPruneFusion.rule(spelling), TokenPruneFusion.rule(spelling, sort_via_float=True)])


class TokenPruneFusionPass(ir.passes.InPlacePass):
    """Apply fuse_token_prune_rules; `fired` counts the fusions, `report` says why near-matches failed."""

    def __init__(self, debug: bool = False, spelling: FusedOp = ORT_OP):
        super().__init__()
        self.debug = debug
        self.spelling = spelling
        self.fired = 0
        self.report = ""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fired = fuse_token_prune_rules(self.spelling).apply_to_model(model)
        if self.debug and not self.fired:
            # A tracing run only diagnoses; it is run when the real one fused nothing.
            import contextlib
            import io

            tracer = MatchingTracer()
            fuse_token_prune_rules(self.spelling).apply_to_model(model, tracer=tracer)
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink):
                tracer.report()
            self.report = sink.getvalue()
        if self.fired:
            model.opset_imports[self.spelling.domain] = self.spelling.version
        return ir.passes.PassResult(model, modified=bool(self.fired))


def fusion_failure(fusion: TokenPruneFusionPass, debug: bool) -> str:
    """The one-line error for a fusion that did not fire; with debug, the tracer's whole report after it."""
    reasons = [line.strip() for line in fusion.report.splitlines() if "fail" in line.lower() or "mismatch" in line.lower()]
    line = "the TokenPrune fusion did not match the inserted subgraph"
    line += f" (nearest miss: {reasons[-1]})" if reasons else ""
    if debug and fusion.report:
        line += "\n" + fusion.report.rstrip()
    else:
        line += "; rerun with --debug for every near-match"
    return line
