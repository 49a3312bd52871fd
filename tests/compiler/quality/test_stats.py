"""compiler.quality.stats: exact match and the bootstrap intervals of accuracy and accuracy retained."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vlmprune.compiler.quality.stats import (RESAMPLES, SEED, accuracy_interval, agreement, difference_interval,
                                             exact_match, majority, normalize, retained_interval)


@pytest.mark.parametrize("text, normal", [
    ("Red", "red"), ("  The   RED car. ", "red car"), ("a dog!", "dog"), ("two, three", "two three"),
    ("an apple?", "apple"), ("theme", "theme"), ("", ""),
])
def test_normalize(text, normal):
    assert normalize(text) == normal


def test_exact_match():
    assert exact_match("Red.", ["red"])
    assert exact_match("the cat", ["A Cat"])
    assert exact_match("two", ["2", "Two"])  # any accepted answer
    assert exact_match("2", ["2", "two"])
    assert not exact_match("three", ["2", "two"])
    assert not exact_match("red car", ["red"])  # equal, not contained
    assert not exact_match("", ["red"])


def _reference(values, resamples=RESAMPLES, seed=SEED):
    """A plain percentile bootstrap: one resample after another from the same generator."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = [values[rng.integers(0, len(values), size=len(values))].mean() for _ in range(resamples)]
    return values.mean(), np.percentile(means, 2.5), np.percentile(means, 97.5)


def _correct(n, p, seed=1):
    return (np.random.default_rng(seed).random(n) < p).astype(int).tolist()


def test_accuracy_interval_mean_and_bounds():
    correct = [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    acc, low, high = accuracy_interval(correct)
    assert acc == 0.7
    assert 0 <= low <= acc <= high <= 1 and low < high
    assert accuracy_interval(correct) == (acc, low, high)  # the same figures every time at the default seed
    assert accuracy_interval([bool(c) for c in correct]) == (acc, low, high)


@pytest.mark.parametrize("n, resamples, seed", [(10, RESAMPLES, SEED), (37, 500, 3), (200, 1000, 11)])
def test_accuracy_interval_is_the_plain_bootstrap(n, resamples, seed):
    correct = _correct(n, 0.6)
    assert accuracy_interval(correct, resamples, seed) == pytest.approx(_reference(correct, resamples, seed),
                                                                        rel=0, abs=1e-12)


def test_accuracy_interval_seed_matters_and_is_fixed():
    """Few resamples, so the percentiles fall between grid points and another seed moves them."""
    correct = _correct(37, 0.5)
    assert accuracy_interval(correct, 200, seed=5) == accuracy_interval(correct, 200, seed=5)
    assert accuracy_interval(correct, 200, seed=5)[1:] != accuracy_interval(correct, 200, seed=6)[1:]


def test_accuracy_interval_shrinks_with_more_samples():
    widths = []
    for n in (20, 200, 2000):
        _, low, high = accuracy_interval([1, 0] * (n // 2))  # accuracy 0.5 at every n
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[2] < 0.06  # about 4 standard errors of 0.5 over 2000 samples (0.044)


@pytest.mark.parametrize("value", [0, 1])
def test_accuracy_interval_of_a_constant_has_no_width(value):
    assert accuracy_interval([value] * 25) == (value, value, value)


def test_accuracy_interval_needs_samples():
    with pytest.raises(ValueError):
        accuracy_interval([])


def test_retained_ratio_and_bounds():
    dense = _correct(100, 0.8, seed=2)
    pruned = [d if i % 5 else 0 for i, d in enumerate(dense)]  # a fifth of the dense answers lost
    ratio, low, high = retained_interval(pruned, dense)
    assert ratio == pytest.approx(np.mean(pruned) / np.mean(dense), rel=1e-15)
    assert low <= ratio <= high <= 1  # pruned is right only where dense is, so no resample exceeds 1
    assert retained_interval(pruned, dense) == (ratio, low, high)


def test_retained_of_identical_answers_is_exactly_one():
    dense = _correct(40, 0.5, seed=4)
    assert retained_interval(dense, dense) == (1.0, 1.0, 1.0)


def test_retained_resamples_pairs():
    """Resampling pruned and dense answers together: one disagreement in 200 barely moves the ratio, far less than
    resampling each on its own would."""
    dense = _correct(200, 0.5, seed=7)
    pruned = list(dense)
    pruned[dense.index(1)] = 0
    _, low, high = retained_interval(pruned, dense)
    rng = np.random.default_rng(SEED)
    p, d = np.asarray(pruned, float), np.asarray(dense, float)
    unpaired = [p[rng.integers(0, 200, 200)].mean() / d[rng.integers(0, 200, 200)].mean() for _ in range(RESAMPLES)]
    assert high - low < 0.05 < np.percentile(unpaired, 97.5) - np.percentile(unpaired, 2.5)


def test_retained_matches_a_plain_paired_bootstrap():
    dense, pruned = _correct(30, 0.7, seed=8), _correct(30, 0.5, seed=9)
    rng = np.random.default_rng(SEED)
    p, d = np.asarray(pruned, float), np.asarray(dense, float)
    ratios = []
    for _ in range(RESAMPLES):
        i = rng.integers(0, 30, 30)
        if d[i].mean() > 0:
            ratios.append(p[i].mean() / d[i].mean())
    expected = (p.mean() / d.mean(), np.percentile(ratios, 2.5), np.percentile(ratios, 97.5))
    assert retained_interval(pruned, dense) == pytest.approx(expected, rel=0, abs=1e-12)


def test_retained_skips_resamples_without_a_dense_hit():
    """With one dense hit in ten, some resamples miss it: they have no ratio and are left out, not counted as 0."""
    dense = [1] + [0] * 9
    ratio, low, high = retained_interval(dense, dense)
    assert (ratio, low, high) == (1.0, 1.0, 1.0)


def test_retained_is_nan_without_dense_hits():
    assert all(math.isnan(x) for x in retained_interval([1, 0, 1], [0, 0, 0]))


@pytest.mark.parametrize("pruned, dense", [([1, 0], [1, 0, 1]), ([], []), ([[1, 0]], [1, 0])])
def test_retained_needs_the_same_samples(pruned, dense):
    with pytest.raises(ValueError):
        retained_interval(pruned, dense)


def test_difference_interval_is_paired():
    """The same resampled indices for both rows: two rows that differ on one sample in twenty have a difference of
    0.05 and an interval from 0 (resamples without that sample) up; identical rows give exactly 0."""
    a, b = [1] * 20, [1] * 19 + [0]
    d, lo, hi = difference_interval(a, b)
    assert d == pytest.approx(0.05) and lo == 0.0 and hi > 0
    assert difference_interval(a, a) == (0.0, 0.0, 0.0)
    wins = [1] * 15 + [0] * 5
    d, lo, hi = difference_interval(wins, [0] * 20)
    assert d == pytest.approx(0.75) and lo > 0  # excludes 0: it counts
    with pytest.raises(ValueError):
        difference_interval([1, 0], [1])


def test_majority_breaks_ties_by_answer_text_whatever_the_order():
    """Two answers as frequent as each other; the baseline must not change with the samples' order (or
    with Python's string hashing, which `max(set(...))` depended on)."""
    sets = [("yes",), ("no",), ("no",), ("yes", "y"), ("red",)]
    for order in (sets, sets[::-1], sets[2:] + sets[:2]):
        assert majority(order) == ("no", 2 / 5)
    assert majority([("y",), ("x", "y")]) == ("x", 0.5)  # scored by exact match against every accepted answer


def test_agreement_is_the_dense_answer_after_normalisation_right_or_wrong():
    """Agreement counts the same answer as dense's, whether either is right: 'The Cat.' agrees with 'cat'."""
    assert agreement(["The Cat.", "dog", "", "red"], ["cat", "cat", "", "blue"]) == [1, 0, 1, 0]
    with pytest.raises(ValueError):
        agreement(["a"], ["a", "b"])
