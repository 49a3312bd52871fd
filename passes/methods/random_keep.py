"""`random`: random keep, a baseline: K patches drawn uniformly without replacement at a fixed seed.

The draw: the K patches with the smallest of N raw 64-bit draws of NumPy's PCG64 bit generator
seeded with --seed (default 0), ties to the lower index, in ascending (raster) order. A uniform
K-subset; the bit generator's stream is stable across NumPy versions (its Generator methods'
are not promised to be), so a seed names the same set wherever the bundle is rebuilt. The same
patches for every image and batch row (passes.methods.fixed): a deterministic reference point
for accuracy tables, not a pruning method to deploy.
"""

from __future__ import annotations

import numpy as np

from vlmprune.passes.methods.base import positive_int
from vlmprune.passes.methods.fixed import SITE_HELP, FixedMethod
from vlmprune.passes.methods.selection import check_count


def random_indices(n: int, keep: int, seed: int) -> np.ndarray:
    """K of N patch indices drawn uniformly without replacement at seed, ascending int64."""
    check_count(n, keep)
    draws = np.random.PCG64(seed).random_raw(n)
    return np.sort(np.argsort(draws, kind="stable")[:keep]).astype(np.int64)


class RandomKeepMethod(FixedMethod):
    name = "random"
    paired = True  # accuracy tables pair every row with random keep at its K and place (vs_random)
    summary = "baseline, not for deployment: K patches drawn uniformly at a fixed seed, the same for every image"
    options = {"seed": (int, "random: seed of the draw (default 0)"), "site": (str, SITE_HELP)}

    def defaults(self, keep: int) -> dict:
        return {**super().defaults(keep), "seed": 0}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        params["seed"] = positive_int(self.name, "seed", params["seed"], minimum=0)
        return params

    def describe(self, params: dict) -> str:
        return f"random keep (baseline): {params['keep']} patches drawn at seed {params['seed']}"

    def indices(self, params: dict, n: int) -> np.ndarray:
        return random_indices(n, params["keep"], params["seed"])
