"""`divprune`: DivPrune's diversity selection on the projector output (vbdi/divprune).

On the tokens the LLM sees (the tower's end, after the projector), with
D = 1 - cosine between token rows:

1. First pick: the token whose nearest other token is farthest: the largest
   min_{j != i} D[j, i] (the official code's second-smallest entry of column i, the
   smallest being D[i, i] = 0).
2. Each next pick: the token maximising its minimum distance to the tokens picked so far.
3. K picks, then sorted ascending. Output: the K tokens, no summary. Needs no [CLS].
   `--merge local` (passes.methods.merge, applied by the base class): the K kept tokens merged
   with their pruned neighbours, + 1 summary of those with none, the tokens their own keys.

Choices where the official code is batch-1 only or silent:
- ties go to the lower index (argmax's first occurrence, torch and ONNX alike);
- a picked token is never picked again: the official code relies on D[i, i] being the
  exact minimum, which float rounding of 1 - cos(x, x) does not guarantee, so here
  picked tokens are masked out and the diagonal is excluded from the first pick;
- rows are normalised by max(||x||, 1e-12);
- with a [CLS] token in the features (select strategy `full`), [CLS] passes through and
  only patch tokens are selected.

Formulations (the greedy loop is sequential): "loop", one ONNX Loop over the K - 1 picks
after the first (control flow), and "unrolled", the same body repeated in the graph; a
target that takes no control flow gets "unrolled" (Target.control_flow, and each target's
reason by measurement). ONNX Runtime fuses the loop into one
`DivPruneSelect` node (kernels/cpu; kernels/cuda for the CUDA twin): DivPruneFusion.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from vlmprune.compiler.contract import NORM_EPS, SITE_FEATURES, PruneRecord
from vlmprune.passes.graph.dataflow import const_array, const_ints
from vlmprune.passes.methods.base import (CROPS_EACH, GREEDY, Formulation, FusedOp, GraphInputs, Method,
                                           Needs, SiteTensors, TorchResult)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS, add_loop, loop_body
from vlmprune.passes.methods.selection import gather_rows, relative_margin, split_prefix

DIVPRUNE_SELECT = "DivPruneSelect"
# The graph masks with a finite sentinel, not infinity: quantizers and fp16 toolchains calibrate every
# tensor (an infinity breaks rknn-toolkit2's int8 calibration), and distances lie in [0, 2], so
# +-1e4 orders exactly as +-inf does (fp16 holds it).
SENTINEL = 1e4


def distances(tokens: torch.Tensor) -> torch.Tensor:
    """D = 1 - cosine between rows: [B, N, D] -> [B, N, N]."""
    unit = tokens / tokens.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return 1.0 - unit @ unit.transpose(1, 2)


def greedy(dist: torch.Tensor, keep: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The picks in order [B, K], and per step (pick [B, 1], margin over the runner-up [B])."""
    b, n, _ = dist.shape
    eye = torch.eye(n, dtype=torch.bool, device=dist.device)
    candidates = dist.masked_fill(eye, float("inf")).amin(dim=1)  # nearest other token, per column
    picked = torch.zeros(b, n, dtype=torch.bool, device=dist.device)
    running = None
    picks, steps = [], []
    for _ in range(keep):
        pick = candidates.argmax(dim=-1, keepdim=True)
        steps.append((pick, relative_margin(candidates, 1)))
        picks.append(pick)
        picked.scatter_(1, pick, True)
        row = torch.gather(dist, 1, pick.unsqueeze(-1).expand(b, 1, n)).squeeze(1)
        running = row if running is None else torch.minimum(running, row)
        candidates = running.masked_fill(picked, float("-inf"))
    return torch.cat(picks, dim=1), steps


class DivPruneMethod(Method):
    name = "divprune"
    summary = "DivPrune: K tokens of maximal diversity (greedy max-min cosine distance) on the projector output"
    selection = GREEDY
    formulations = (Formulation("loop", control_flow=True), Formulation("unrolled"))
    crop_form = CROPS_EACH  # anyres crops: run on each crop with an equal share of K (passes.methods.crops)
    official = "https://github.com/vbdi/divprune"
    local_merge = True  # --merge local: its output is the kept rows (base.Method.__init_subclass__)

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES)

    def describe(self, params: dict) -> str:
        return f"DivPrune: {params['keep']} most diverse tokens of the projector output"

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        picks, steps = greedy(distances(patches), params["keep"])
        kept = picks.sort(dim=-1).values
        return TorchResult(torch.cat([*cls, gather_rows(patches, kept)], dim=1), kept, {"steps": steps})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep, n = params["keep"], inputs.num_patches
        with b.role(TOKENS):
            cls = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else inputs.hidden
        with b.role(SCORE):
            unit = b.l2_normalize(patches, "unit", NORM_EPS)
            cosine = b.op("MatMul", [unit, b.op("Transpose", [unit], "unit_t", perm=[0, 2, 1])], "cosine")
            dist = b.op("Sub", [b.scalar("one", 1.0), cosine], "distances")  # [B, N, N]
        with b.role(SELECT):
            picks = emit_greedy(b, dist, keep, n, formulation)
            kept = b.sort_ascending(picks, keep, "kept")
        with b.role(TOKENS):
            gathered = b.gather_rows(patches, kept, "gather_kept")
            tokens = b.op("Concat", [*cls, gathered], "tokens", axis=1) if cls else gathered
        return tokens, kept

    def fusion_rules(self, spellings: dict[str, FusedOp], record: PruneRecord | None = None) -> list:
        spelling = spellings.get(DIVPRUNE_SELECT)
        return [DivPruneFusion.rule(spelling)] if spelling is not None else []


# ---------------------------------------------------------------------------- graph


def emit_greedy(b, dist: ir.Value, keep: int, n: int, formulation: str) -> ir.Value:
    """The K picks in pick order [B, K] int64, from distances [B, N, N]."""
    diagonal = np.where(np.eye(n, dtype=bool), SENTINEL, 0.0).astype(np.float32)
    first = b.reduce("ReduceMin", b.op("Add", [dist, b.const("diagonal", diagonal)], "off_diagonal"), [1], 0,
                     "nearest_other")  # [B, N]
    pick = b.op("ArgMax", [first], "pick0", axis=-1, keepdims=1, select_last_index=0)  # [B, 1]
    running = _row(b, b, dist, pick, n, "row0")
    zeros = b.op("ConstantOfShape", [b.op("Shape", [first], "first_shape")], "mask_zeros",
                 value=ir.tensor(np.zeros([1], np.float32)))
    masked = _mark(b, b, zeros, pick, "mask0")
    if keep == 1:
        return pick
    if formulation == "unrolled":
        picks = [pick]
        for i in range(1, keep):
            pick, running, masked = _step(b, b, dist, running, masked, n, f"step{i}")
            picks.append(pick)
        return b.op("Concat", picks, "picks", axis=1)
    loop = _loop(b, dist, running, masked, keep - 1, n)
    scanned = loop.outputs[2]  # [K-1, B, 1]
    rest = b.op("Squeeze", [b.op("Transpose", [scanned], "picks_t", perm=[1, 0, 2]), b.ints("picks_axes", [2])],
                "picks_rest")
    return b.op("Concat", [pick, rest], "picks", axis=1)


def _row(b, w, dist: ir.Value, pick: ir.Value, n: int, name: str) -> ir.Value:
    """dist[b, pick[b], :] -> [B, N]."""
    index = w.op("Expand", [w.op("Unsqueeze", [pick, b.ints(f"{name}_axes", [-1])], f"{name}_col"),
                            b.ints(f"{name}_shape", [1, 1, n])], f"{name}_index")
    row = w.op("GatherElements", [dist, index], f"{name}_gather", axis=1)  # [B, 1, N]
    return w.op("Squeeze", [row, b.ints(f"{name}_squeeze", [1])], name)


def _mark(b, w, masked: ir.Value, pick: ir.Value, name: str) -> ir.Value:
    """masked with -SENTINEL written at pick: picked tokens are never candidates again."""
    fill = w.op("Expand", [b.scalar(f"{name}_sentinel", -SENTINEL), w.op("Shape", [pick], f"{name}_shape")],
                f"{name}_fill")
    return w.op("ScatterElements", [masked, pick, fill], name, axis=1)


def _step(b, w, dist, running, masked, n: int, name: str):
    """One greedy pick: (pick [B, 1], new running minimum, new mask)."""
    candidates = w.op("Add", [running, masked], f"{name}_candidates")
    pick = w.op("ArgMax", [candidates], f"{name}_pick", axis=-1, keepdims=1, select_last_index=0)
    running = w.op("Min", [running, _row(b, w, dist, pick, n, f"{name}_row")], f"{name}_running")
    return pick, running, _mark(b, w, masked, pick, f"{name}_mask")


def _loop(b, dist: ir.Value, running: ir.Value, masked: ir.Value, trips: int, n: int) -> ir.Node:
    """Loop(trips): carried (running, mask), scan output the pick of each iteration."""
    w, _, cond_in, (run_in, mask_in) = loop_body(b, "divprune_step", {"running_in": ["batch", n],
                                                                      "mask_in": ["batch", n]})
    pick, run_out, mask_out = _step(b, w, dist, run_in, mask_in, n, "step")
    cond_out = w.op("Identity", [cond_in], "cond_out")
    pick_out = w.op("Identity", [pick], "pick_out")
    return add_loop(b, w, [cond_out, run_out, mask_out, pick_out], trips, [running, masked], "greedy_loop")


# ---------------------------------------------------------------------------- fusion


class DivPruneFusion(RewriteRuleClassBase):
    """The greedy selection (first pick, Loop of the next picks, picks in order) -> DivPruneSelect(D).

    The fused node takes the distance matrix [B, N, N] and returns the K picks in pick
    order [B, K] (the sort and gathers stay standard ops). The check verifies the Loop's
    body by structure: ArgMax of running + mask, Min with the picked row, the sentinel scattered.
    """

    def __init__(self, spelling: FusedOp):
        super().__init__(name="DivPruneFusion")
        self.spelling = spelling

    def pattern(self, op, dist, diagonal, r0_axes, r0_shape, r0_squeeze, zeros_value_shape, m0_neg,
                trips, cond, picks_axes):
        # ReduceMin's axes are an input from opset 18, an attribute before: both match.
        first = op.ReduceMin(op.Add(dist, diagonal), _allow_other_inputs=True, _allow_other_attributes=True,
                             _outputs=["first"])
        pick = op.ArgMax(first, _outputs=["pick0"], _allow_other_attributes=True)
        index = op.Expand(op.Unsqueeze(pick, r0_axes), r0_shape)
        running = op.Squeeze(op.GatherElements(dist, index), r0_squeeze)
        zeros = op.ConstantOfShape(op.Shape(first), _allow_other_attributes=True)
        masked = op.ScatterElements(zeros, pick, op.Expand(m0_neg, op.Shape(pick)), _allow_other_attributes=True)
        _, _, scanned = op.Loop(trips, cond, running, masked, _outputs=["final_running", "final_mask", "scanned"],
                                _allow_other_attributes=True)
        rest = op.Squeeze(op.Transpose(scanned, _allow_other_attributes=True), picks_axes)
        return op.Concat(pick, rest, _outputs=["picks"], _allow_other_attributes=True)

    def check(self, context, dist, diagonal, first, trips, scanned, picks, **_) -> MatchResult:
        result = MatchResult()
        reduce_min = first.producer()
        axes = const_ints(reduce_min.inputs[1]) if len(reduce_min.inputs) > 1 else None
        axes = axes if axes is not None else list(reduce_min.attributes.get_ints("axes", []) or [])
        if axes not in ([1], [-2]) or reduce_min.attributes.get_int("keepdims", 1) != 0:
            return result.fail("the first pick's minimum is not over the rows of each column (axis 1, keepdims 0)")
        loop = scanned.producer()
        body = loop.attributes["body"].value
        ops = [node.op_type for node in body]
        wanted = ["Add", "ArgMax", "Unsqueeze", "Expand", "GatherElements", "Squeeze", "Min", "Shape", "Expand",
                  "ScatterElements", "Identity", "Identity"]
        if ops != wanted:
            return result.fail(f"Loop body is not the greedy step: {ops}")
        mask = const_array(diagonal)
        if mask is None or mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
            return result.fail("the first pick's diagonal mask is not a constant [N, N]")
        count = const_ints(trips)
        if count is None or len(count) != 1:
            return result.fail("the Loop's trip count is not a constant")
        return result

    def rewrite(self, op, dist, trips, **_):
        keep = const_ints(trips)[0] + 1
        make = getattr(op, self.spelling.op_type)
        return make(dist, keep=keep, **dict(self.spelling.attributes), _domain=self.spelling.domain)
