"""One support check for every target: its own `supports(node)` over the whole graph.

A target says which nodes its runtime runs (Target.supports) and what it needs of the
model as a whole (opset, static shapes); this pass asks it about every node of the
graph, subgraphs included, and refuses in one line listing each unsupported op with
the target's reason and the count. It changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import onnx_ir as ir

from vlmprune.compiler.errors import StructureError, VlmpruneError

NodeCheck = Callable[[ir.Node], "tuple[bool, str]"]
ModelCheck = Callable[[ir.Model], "list[str]"]


def unsupported(model: ir.Model, supports: NodeCheck, model_check: ModelCheck | None = None) -> list[str]:
    """Every reason the target would refuse model: model-level ones, then 'op: why (n nodes)'."""
    reasons = list(model_check(model)) if model_check is not None else []
    found: Counter[tuple[str, str]] = Counter()
    for node in model.graph.all_nodes():
        ok, why = supports(node)
        if not ok:
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            found[(op, why)] += 1
    reasons += [f"{op}: {why} ({n} node{'s' * (n > 1)})" for (op, why), n in found.items()]
    return reasons


class SupportCheckPass(ir.passes.InPlacePass):
    """Refuse, with every reason in one line, a graph the target cannot run. Changes nothing.

    Why its work is in `requires`: what it checks is the precondition of what comes after the
    pipeline (the target's emission and its toolchain), and of nothing this pass does; its call
    changes nothing, so an `ensures` would check the same graph again. A refusal here is the
    user's (a StructureError: the graph, the target), not a post-condition a pass broke.
    """

    def __init__(self, target: str, supports: NodeCheck, model_check: ModelCheck | None = None):
        super().__init__()
        self.target, self.supports, self.model_check = target, supports, model_check

    def requires(self, model: ir.Model) -> None:
        reasons = unsupported(model, self.supports, self.model_check)
        if reasons:
            raise StructureError(f"{self.target} cannot run this graph: " + "; ".join(reasons))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=False)


class TargetPipeline(ir.passes.Sequential):
    """A target's passes in order; a failure names the failing pass and the passes that ran before it.

    onnx_ir's Sequential wraps any failure in a PassError naming the pass; a failure the
    user can act on (a StructureError or other VlmpruneError) is re-raised as one line
    of its own type with that context, so the CLI still reports it as one line.
    """

    def __init__(self, target: str, *passes: ir.passes.PassBase):
        super().__init__(*passes)
        self.target = target

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for i, pass_ in enumerate(self.passes):
            try:
                result = pass_(model)
            except Exception as exc:
                cause = _user_error(exc)
                if cause is None:
                    raise
                before = ", ".join(type(p).__name__ for p in self.passes[:i]) or "none"
                raise type(cause)(f"{cause} [{self.target}: {type(pass_).__name__}, after {before}]") from exc
            model = result.model
            modified = modified or result.modified
        return ir.passes.PassResult(model, modified)

    @property
    def names(self) -> list[str]:
        return [type(p).__name__ for p in self.passes]


def _user_error(exc: BaseException) -> VlmpruneError | None:
    """The VlmpruneError behind exc (onnx_ir wraps what requires() raises), or None for a bug."""
    while exc is not None:
        if isinstance(exc, VlmpruneError):
            return exc
        exc = exc.__cause__
    return None
