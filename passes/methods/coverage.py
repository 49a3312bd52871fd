"""`--coverage F`: a uniform grid subset always kept, the rest of K by the method's own score (FEATHER's lesson).

A score-based method alone can spend its whole budget on a few salient regions and leave
parts of the image unseen; FEATHER found a uniform sample beside the ranked tokens keeps the
coverage that localisation questions need. With `--coverage F` (0 <= F < 1, default 0: the
method as it is), G = round(F · K) (half up) of the K kept patches are the uniform grid of
the `grid` baseline (passes.methods.grid: the same rule, G cells of the patch grid), and the
other K − G are the method's best-scored patches among the rest. Built on ROI forced keep
(passes.methods.roi): the grid is a constant forced set, lifted above every score before the
method's TopK by the same F·(bound + 1), so the method's selection, summary token, kept
indices and fused TokenPrune are unchanged; with `--roi` too, the forced set is their union.
Under `--schedule` the grid is in original patch coordinates and forced at every step.

Refused in one line where ROI forced keep is (roi.refusal: greedy selections, baselines,
--budget adaptive, --score attention, methods without a score bound), for anyres crops and
merged grids (no one patch grid), and for G = K (nothing left to rank: use `grid`).
Parity checks the forced set like an ROI's (every grid patch kept: the `roi_forced` figure).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.errors import InputError
import vlmprune.passes.methods.roi as roi
from vlmprune.passes.methods.selection import grid_indices

GENERIC = {
    "coverage": (float, "F in [0, 1): round(F·K) of the K kept patches are the uniform grid (grid's rule), the rest "
                        "by the method's score (default 0: the method as it is; score-based methods: cls)"),
}


def count(params: dict) -> int:
    """G, the grid patches of K (0 without --coverage)."""
    return int(np.floor(params.get("coverage", 0.0) * params["keep"] + 0.5))


def parse(method, params: dict) -> dict:
    """Check --coverage for `method`; F = 0 leaves no trace in the parameters (the method as it is)."""
    value = params.get("coverage")
    if value is None:
        return params
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
            or not 0 <= value < 1:
        raise InputError(f"--coverage must be a number with 0 <= F < 1 (a share of K), got {value!r}")
    if value == 0:
        del params["coverage"]
        return params
    why = roi.refusal(method, params)
    if why:
        raise InputError(f"method {method.name} cannot take --coverage: {why}")
    params["coverage"] = float(value)
    if count(params) >= params["keep"]:
        raise InputError(f"--coverage {value:g} of K = {params['keep']} keeps only the grid, nothing by the score "
                         "(use the grid baseline)")
    return params


def check(params: dict, spec) -> None:
    if not count(params):
        return
    if "crops" in params:
        raise InputError("--coverage needs one patch grid per image, and LLaVA-NeXT's crops are several")
    if spec.frames > 1:
        raise InputError(f"--coverage needs one patch grid, and a clip's tokens are {spec.frames} frames' grids "
                         "(compile --video-frames)")
    if spec.merge is not None and spec.merge >= 2:
        raise InputError("--coverage needs one patch grid, and this tower's merged tokens (Qwen2-VL's) have none")


def describe(params: dict) -> str:
    g = count(params)
    return f"; coverage: {g} uniform grid patches always kept, inside K" if g else ""


def grid_mask(params: dict, n: int) -> np.ndarray:
    """[N] float32: 1 at the G grid patches."""
    mask = np.zeros(n, dtype=np.float32)
    g = count(params)
    if g:
        mask[grid_indices(n, g)] = 1.0
    return mask


# ---------------------------------------------------------------------------- graph


def emit_forced(b, params: dict, n: int, forced: ir.Value | None) -> ir.Value | None:
    """The forced set F with the grid: [1, N] (the grid alone) or Max(ROI's [B, N], grid); unchanged without."""
    if not count(params):
        return forced
    grid = b.const("coverage_grid", grid_mask(params, n)[None])  # [1, N]
    return grid if forced is None else b.op("Max", [forced, grid], "coverage_forced")


def emit_mapped(b, forced: ir.Value, composed: ir.Value) -> ir.Value:
    """F [1 or B, N] in original patch coordinates -> [B, N_s] for the tokens present (composed: their patches)."""
    shape = b.op("Shape", [composed], "forced_ids_shape")  # [B, 1] broadcast against [1, N]: F's rows per image
    rows = b.op("Expand", [forced, b.op("Concat", [b.slice(shape, 0, 1, 0, "forced_batch"),
                                                  b.ints("forced_cols", [1])], "forced_shape_raw", axis=0)],
                "forced_rows") if _batch_one(forced) else forced
    return b.op("GatherElements", [rows, composed], "forced_mapped", axis=1)


def _batch_one(value: ir.Value) -> bool:
    return value.shape is not None and len(value.shape) == 2 and value.shape[0] == 1


# ---------------------------------------------------------------------------- reference


def forced_reference(params: dict, n: int, forced: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """F [B, N] bool with the grid added (the reference of emit_forced); unchanged without --coverage."""
    if not count(params):
        return forced
    grid = torch.from_numpy(grid_mask(params, n) > 0).unsqueeze(0).expand(batch, -1)
    return grid.clone() if forced is None else forced | grid
