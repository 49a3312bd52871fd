"""The image methods' algorithms restated plainly, for one image (or one clip's rows): what the methods' references
and bundles are held to, on still images (tests/passes/methods) and on a clip's F·M rows (a video bundle prunes the
clip as one sequence: tests/compiler/test_llava_next_video.py).

Written from the papers' and official repositories' text in lists, loops and float64, not from the methods' code;
the temporal methods' references (vLLM's EVS, DyCoke's TTM) are in video_references.py.
"""

from __future__ import annotations

import math

import numpy as np


def divprune_official(x: np.ndarray, keep: int) -> list[int]:
    """DivPrune as vbdi/divprune writes it, for one image: topk(2, smallest).values[1] first, then min over picked rows."""
    unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
    dist = 1.0 - unit @ unit.T
    picks: list[int] = []
    for i in range(keep):
        if i == 0:
            scores = np.sort(dist, axis=0)[1]  # the second-smallest entry of each column
        else:
            scores = dist[picks].min(axis=0)
        picks.append(int(np.argmax(scores)))
    return picks


def dart_straightforward(x: np.ndarray, keep: int, pivots: int) -> list[int]:
    """DART for one image, written plainly from its description (lists and loops, float64)."""
    l1 = np.abs(x).sum(-1)
    order = sorted(range(len(x)), key=lambda i: (-l1[i], i))
    retained = order[:pivots]
    pool = [i for i in range(len(x)) if i not in retained]
    for j, p in enumerate(order[:pivots]):
        remaining = keep - len(retained)
        if remaining <= 0:
            break
        take = math.ceil(remaining / (pivots - j))
        cos = {c: x[p] @ x[c] / max(np.linalg.norm(x[p]) * np.linalg.norm(x[c]), 1e-8) for c in pool}
        chosen = sorted(pool, key=lambda c: (cos[c], c))[:take]
        retained += chosen
        pool = [c for c in pool if c not in chosen]
    return sorted(retained)


def random_draw(n: int, keep: int, seed: int) -> list[int]:
    """The random baseline's draw as its help states it: N uniform 64-bit draws of numpy's PCG64 at the seed, the K
    positions of the smallest (ties to the lower index), ascending; the same K for every input."""
    draws = np.random.PCG64(seed).random_raw(n)
    return sorted(sorted(range(n), key=lambda i: (int(draws[i]), i))[:keep])
