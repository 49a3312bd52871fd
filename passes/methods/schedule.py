"""`--schedule`: progressive pruning, a score-based method applied in several steps across blocks.

Instead of keeping K of the N patches at once after one block, step s of S prunes after
block L_s to K_s tokens (L_1 < ... < L_S, N > K_1 > ... > K_S = K = --keep), so the blocks
in between run on fewer tokens while the early ones still see most of the image (layer-wise
keep ratios: gentle early, stronger later). Two spellings:

- blocks only, `--schedule 2,4,6` (or `2/4/6`): the counts follow the geometric
  interpolation between N and K, K_s = round(N · (K/N)^(s/S)); each step keeps the same
  share of what reaches it, so the early steps drop the tokens that are cheapest to lose
  (in absolute numbers most, in share as many as the later ones). Counts that rounding
  makes equal are pushed apart (K_s > K_{s+1}, K_1 < N). With N = 1024, K = 192: 586, 335, 192.
- with counts, `--schedule 2:512,4:320,6:192` (or `2:512/4:320/6:192`); the last count must
  be --keep and may be left out (`2:512,4:320,6`).
`/` separates steps where a comma already separates something else: eval's comma lists
(`-m cls:schedule=2/4/6`, a place `--layer 2/4/6`). The last block is the method's layer:
`--layer` is then left out, or equal to it.

Each step recomputes the method's own score at its own block over the tokens still present
(cls: the [CLS] row of that block's attention; visionzip: its dominant score), with the
method's other options. Intermediate steps keep their K_s best tokens in raster order and
drop the others without a summary (a summary token would be one more token the next blocks
run on and the next score ranks; the final step's own extras cover what was dropped by
then); the final step is the method as it is at its block, its summary token (cls: the mean
of the tokens pruned at that step) or contextual tokens included. kept_indices [B, K]
compose back to the original patch indices (in ascending raster order for cls). Forced
patches (--roi, --coverage) are forced at every step, mapped to the surviving tokens.

Refused in one line: a schedule that is not increasing in blocks or decreasing in counts, a
last count other than --keep, a block beyond the tower's, fewer than two steps (one step is
--layer), and what has no single ranked score at a block: greedy selections, baselines,
methods at the projector output, K per image (--budget adaptive, prumerge+), --merge local
(its windows need the whole patch grid), the pixel term (--lambda: per original patch),
--scorer int8, anyres crops and .onnx sources (whose reference reads the dense graph's
blocks, which never run on the pruned tokens).
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from vlmprune.passes.methods.builder import SELECT
from vlmprune.passes.methods.progressive import Progressive
# The schedule's text and steps are schedule_steps', below base (whose Method.parse runs parse) and below
# progressive.Progressive (which runs the steps); re-exported here.
from vlmprune.passes.methods.schedule_steps import GENERIC, Step, layers, parse, refusal, resolve, split  # noqa: F401


def text(steps: list[Step]) -> str:
    """`2→4→6` for tables and summaries."""
    return "→".join(str(s.layer) for s in steps)


def wrap(method, params: dict, num_patches: int | None = None):
    """The method as compiled with these (parsed) parameters: Progressive(method) under --schedule."""
    if params.get("schedule") is None or isinstance(method, Progressive):
        return method
    return Progressive(method, num_patches)


def emit_compose(b, composed: ir.Value | None, kept: ir.Value) -> ir.Value:
    """Original patch indices of this step's kept tokens: kept indexes the tokens present, composed says which
    original patch each of those is (None: the first step, the tokens are the patches)."""
    if composed is None:
        return kept
    with b.role(SELECT):
        return b.op("GatherElements", [composed, kept], "step_compose", axis=1)


def steps_record(steps: list[Step], prefix: int, n: int, final_tokens: int) -> list[dict]:
    """What the manifest lists per step: block, tokens kept, token counts in and out."""
    out, tokens_in = [], prefix + n
    for i, s in enumerate(steps):
        tokens_out = final_tokens if i == len(steps) - 1 else prefix + s.keep
        out.append({"layer": s.layer, "keep": s.keep, "tokens_in": tokens_in, "tokens_out": tokens_out})
        tokens_in = prefix + s.keep
    return out


