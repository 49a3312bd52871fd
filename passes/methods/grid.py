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

import numpy as np

from vlmprune.passes.methods.fixed import SITE_HELP, FixedMethod
from vlmprune.passes.methods.selection import grid_indices  # the rule above, which --coverage forces too


class GridMethod(FixedMethod):
    name = "grid"
    summary = "baseline, not for deployment: K patches on a uniform grid over the patches, the same for every image"
    options = {"site": (str, SITE_HELP)}

    def describe(self, params: dict) -> str:
        return f"uniform grid (baseline): {params['keep']} patches"

    def indices(self, params: dict, n: int) -> np.ndarray:
        return grid_indices(n, params["keep"])
