"""Exact match and 95 % bootstrap intervals for accuracy and accuracy retained.

Exact match as VQA scripts score one-word answers: lower-cased, punctuation and articles
dropped, whitespace collapsed, then equal to any accepted answer. The intervals are the
percentile bootstrap over samples (2,000 resamples at a fixed seed, so a table reprints the
same figures); accuracy retained resamples the pruned and the dense answers of the same
samples together (a paired ratio), as a paired comparison has to.
"""

from __future__ import annotations

import re

import numpy as np

RESAMPLES = 2000
SEED = 0
_ARTICLES = {"a", "an", "the"}


def normalize(text: str) -> str:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return " ".join(w for w in words if w not in _ARTICLES)


def exact_match(answer: str, accepted) -> bool:
    got = normalize(answer)
    return got != "" and any(got == normalize(a) for a in accepted)


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def accuracy_interval(correct, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """(accuracy, low, high): the mean of `correct` and its 95 % percentile bootstrap interval."""
    c = np.asarray(correct, dtype=np.float64)
    if c.size == 0:
        raise ValueError("no samples")
    means = c[_indices(c.size, resamples, seed)].mean(axis=1)
    return float(c.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def retained_interval(correct, dense, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """(retained, low, high): accuracy(correct) / accuracy(dense) over the same samples, paired resampling.
    NaN where the dense accuracy is 0 (nothing to retain)."""
    c, d = np.asarray(correct, dtype=np.float64), np.asarray(dense, dtype=np.float64)
    if c.shape != d.shape or c.size == 0:
        raise ValueError("retained needs the pruned and dense results of the same, non-empty samples")
    if d.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    idx = _indices(c.size, resamples, seed)
    num, den = c[idx].mean(axis=1), d[idx].mean(axis=1)
    ratios = np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)
    ratios = ratios[np.isfinite(ratios)]
    return float(c.mean() / d.mean()), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))
