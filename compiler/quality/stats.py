"""Exact match and 95 % bootstrap intervals for accuracy and accuracy retained.

Exact match as VQA scripts score one-word answers: lower-cased, punctuation and articles
dropped, whitespace collapsed, then equal to any accepted answer. The intervals are the
percentile bootstrap over samples (1,000 resamples, seed 0, as the quality contract says, so a table reprints the
same figures); accuracy retained resamples the pruned and the dense answers of the same
samples together (a paired ratio), as a paired comparison has to; so does the difference of
two rows' accuracies (difference_interval: a row against random keep at the same K and place),
which counts only where its interval excludes 0.

Agreement with dense (agreement): the share of samples whose answer is the dense bundle's own answer, after the
same normalisation. It does not need the answer to be right, so it measures what pruning changed even on question
types where the model sits at chance, where accuracy cannot tell methods apart; its paired difference to random
keep's agreement is the benchmark's second ranking.

The majority baseline is the accuracy of always giving the most frequent answer: ties go to the
answer that sorts first, so the baseline is the same whatever order the samples come in.
"""

from __future__ import annotations

import re

import numpy as np

RESAMPLES = 1000
SEED = 0
_ARTICLES = {"a", "an", "the"}

# What an accuracy table's "vs random" and "agrees" columns mean, said once for its three renderings (the CLI's
# text, tools/eval_quality.py's markdown, the HTML report); each adds its own mark for a difference that counts.
VERSUS_RANDOM = ("accuracy minus random keep's at the same K and place (a row spread over blocks, ToMe's range or a "
                 "progressive schedule: random keep after the earliest block the table has), paired 95 % bootstrap "
                 "interval")
AGREES = ("the share of answers equal to the dense bundle's own, right or wrong, which sees what pruning changed "
          "where the model answers at chance; agreement vs random: minus random keep's, paired the same way")


def normalize(text: str) -> str:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return " ".join(w for w in words if w not in _ARTICLES)


def exact_match(answer: str, accepted) -> bool:
    got = normalize(answer)
    return got != "" and any(got == normalize(a) for a in accepted)


def agreement(answers, reference) -> list[int]:
    """1 where an answer is the reference's (the dense bundle's), normalised as exact_match normalises, else 0."""
    answers, reference = list(answers), list(reference)
    if len(answers) != len(reference):
        raise ValueError("agreement needs the answers of both rows on the same samples")
    return [int(normalize(a) == normalize(r)) for a, r in zip(answers, reference)]


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


def difference_interval(correct, other, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """(difference, low, high): accuracy(correct) - accuracy(other) over the same samples and its 95 % paired
    bootstrap interval (both resampled with the same indices): the difference counts where the interval excludes 0."""
    c, o = np.asarray(correct, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if c.shape != o.shape or c.size == 0:
        raise ValueError("a paired difference needs the results of both rows on the same, non-empty samples")
    diffs = (c - o)[_indices(c.size, resamples, seed)].mean(axis=1)
    return float(c.mean() - o.mean()), float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def majority(answer_sets) -> tuple[str, float]:
    """(answer, accuracy): the most frequent first accepted answer over the samples (ties: the one that sorts first,
    so a reordered dataset gives the same baseline), and the share of samples it answers right."""
    sets = [tuple(a) for a in answer_sets]
    if not sets:
        raise ValueError("no samples")
    counts: dict[str, int] = {}
    for answers in sets:
        counts[answers[0]] = counts.get(answers[0], 0) + 1
    best = min(counts, key=lambda a: (-counts[a], a))
    return best, sum(exact_match(best, answers) for answers in sets) / len(sets)
