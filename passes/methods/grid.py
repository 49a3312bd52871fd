"""`grid`: a uniform grid, a baseline: K patches spread evenly over the patch grid.

The rule, on an H x W patch grid (H = W = sqrt(N) when N is a square; otherwise the raster
order as one row, H = 1, W = N):
- rows r = min(H, max(round(sqrt(K·H/W)), ceil(K/W))) (round half up): the nearest square-ish
  grid, with enough rows that none holds more than W points;
- row j of r holds k_j = floor((j+1)·K/r) - floor(j·K/r) points (together exactly K), at grid
  row floor((2j+1)·H / 2r) and columns floor((2i+1)·W / 2k_j), i < k_j: cell centres.
So K = 64 of 16 x 16 is every second row and column (rows and columns 1, 3, ..., 15), K = 16
rows and columns 2, 6, 10, 14; the indices are distinct (spacings >= 1) and ascending. The same
patches for every image and batch row (passes.methods.fixed): a reference point for accuracy
tables, not a pruning method to deploy.
"""

from __future__ import annotations

import math

import numpy as np

from vlmprune.passes.methods.fixed import SITE_HELP, FixedMethod, check_count


def grid_indices(n: int, keep: int) -> np.ndarray:
    """K of N patch indices on a uniform grid (the rule above), ascending int64."""
    check_count(n, keep)
    side = math.isqrt(n)
    h, w = (side, side) if side * side == n else (1, n)
    rows = min(h, max(math.floor(math.sqrt(keep * h / w) + 0.5), -(-keep // w)))
    out = []
    for j in range(rows):
        count = (j + 1) * keep // rows - j * keep // rows
        y = (2 * j + 1) * h // (2 * rows)
        out += [y * w + (2 * i + 1) * w // (2 * count) for i in range(count)]
    return np.asarray(out, dtype=np.int64)


class GridMethod(FixedMethod):
    name = "grid"
    summary = "baseline, not for deployment: K patches on a uniform grid over the patches, the same for every image"
    options = {"site": (str, SITE_HELP)}

    def describe(self, params: dict) -> str:
        return f"uniform grid (baseline): {params['keep']} patches"

    def indices(self, params: dict, n: int) -> np.ndarray:
        return grid_indices(n, params["keep"])
