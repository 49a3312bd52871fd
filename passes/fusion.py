"""Fuse what a method emitted into custom ops, with the method's own rewrite rules.

Why: a decomposed selection reads the hidden states several times and materialises
intermediates; a fused op reads each token once (kernels/, one C ABI for ONNX Runtime
and TensorRT). Each method brings its rules (Method.fusion_rules), written against the
op names a target spells (FusedOp); rules match by structure only, check every constant
that fixes the semantics, and the rewriter refuses a match whose intermediates have
consumers outside it.

A target adds FusionPass only for a method whose rules it spells, so the fusion must
fire: a rule that does not is a failure, reported with the rewriter's nearest misses. A
target's own rules (Target.own_fusion_rules: ort's fused attention) come as `optional` and
need not fire.
The ops fused are recorded in the model's metadata_props (`vlmprune.fused`).
"""

from __future__ import annotations

import contextlib
import io
import json

import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, RewriteRuleSet

from vlmprune.compiler.contract import FUSED_META
from vlmprune.compiler.errors import StructureError


class FusionPass(ir.passes.InPlacePass):
    """Apply `rules`; at least one must fire. debug: the failure carries the tracer's whole report.

    optional: rules applied after them that need not fire (a target's own, e.g. passes.attention_fusion:
    a tower whose attention has another form stays as it is); with no `rules`, nothing must fire.
    """

    def __init__(self, rules: list, domains: dict[str, int], debug: bool = False, optional: list = ()):
        super().__init__()
        if not rules and not optional:
            raise ValueError("FusionPass needs at least one rule (a target adds it only where a rule applies)")
        self.rules, self.domains, self.debug, self.optional = list(rules), dict(domains), debug, list(optional)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if FUSED_META in model.metadata_props:  # fused already: nothing left to match
            return ir.passes.PassResult(model, modified=False)
        fired = RewriteRuleSet(self.rules).apply_to_model(model) if self.rules else 0
        if self.rules and not fired:
            raise StructureError(fusion_failure(self._near_misses(model), self.debug))
        fired += RewriteRuleSet(self.optional).apply_to_model(model) if self.optional else 0
        if not fired:
            return ir.passes.PassResult(model, modified=False)
        _stable_names(model.graph, self.domains)
        used = {n.domain for n in model.graph.all_nodes()}
        model.opset_imports.update({d: v for d, v in self.domains.items() if d in used})
        fused = sorted({f"{n.domain}.{n.op_type}" for n in model.graph if n.domain in self.domains})
        model.metadata_props[FUSED_META] = json.dumps({"count": fired, "ops": fused})
        return ir.passes.PassResult(model, modified=True)

    def _near_misses(self, model: ir.Model) -> str:
        """The rewriter's report of every near match and why it failed (a diagnosing run)."""
        tracer = MatchingTracer()
        RewriteRuleSet(self.rules).apply_to_model(model, tracer=tracer)
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            tracer.report()
        return sink.getvalue()


def _stable_names(graph: ir.Graph, domains: dict[str, int]) -> None:
    """Name the fused nodes by their place in the graph: the rewriter names a new node from the graph's running
    counter, which depends on how the graph was made (exported here, or loaded from the product cache), and a
    bundle must be the same bytes either way."""
    counts: dict[str, int] = {}
    for node in graph:
        if node.domain in domains and (node.name or "").startswith("node_"):
            i = counts[node.op_type] = counts.get(node.op_type, -1) + 1
            node.name = f"fused/{node.op_type}_{i}"


def fusion_failure(report: str, debug: bool) -> str:
    """The one-line error for a fusion that did not fire; with debug, the tracer's whole report after it."""
    reasons = [line.strip() for line in report.splitlines() if "fail" in line.lower() or "mismatch" in line.lower()]
    line = "the fusion did not match the inserted subgraph"
    line += f" (nearest miss: {reasons[-1]})" if reasons else ""
    if debug and report:
        line += "\n" + report.rstrip()
    else:
        line += "; rerun with --debug for every near-match"
    return line
