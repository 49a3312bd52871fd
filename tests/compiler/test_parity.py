"""Parity comparisons as data: what turns a kept-index mismatch into a pass, and what does not."""

from __future__ import annotations

import numpy as np
import pytest

from vlmprune.compiler import parity

FP32, FP16 = parity.tolerance_for("fp32"), parity.tolerance_for("fp16")


def test_identical_indices_pass():
    ref = np.array([[0, 2, 5], [1, 3, 4]])
    result = parity.compare_indices(ref, ref.copy(), None, FP32)
    assert result["passed"] and result["agreement"] == 1.0 and result["tie_resolved_images"] == []


def test_a_swap_inside_the_tie_band_passes_and_says_so():
    scores = np.array([[0.9, 0.5, 0.5 - 1e-6, 0.1]])  # ranks 2 and 3 tie at fp16's band (1e-3 x 0.9)
    ref, cand = np.array([[0, 1]]), np.array([[0, 2]])
    result = parity.compare_indices(ref, cand, scores, FP16)
    assert result["passed"] and result["tie_resolved_images"] == [0] and result["agreement"] == 0.5
    assert result["boundary_ties"] == [2]


def test_a_swap_outside_the_tie_band_fails():
    scores = np.array([[0.9, 0.5, 0.3, 0.1]])
    result = parity.compare_indices(np.array([[0, 1]]), np.array([[0, 2]]), scores, FP16)
    assert not result["passed"] and result["tie_resolved_images"] == []


def test_mismatch_in_band_needs_every_differing_index_in_the_band():
    scores = np.array([0.9, 0.5, 0.5, 0.1, 0.5])
    assert parity.mismatch_in_band(np.array([0, 1]), np.array([0, 4]), scores, 2, 1e-3)
    assert not parity.mismatch_in_band(np.array([0, 1]), np.array([0, 3]), scores, 2, 1e-3)


def test_greedy_divergence_reports_the_step_and_its_margin():
    ref = np.array([[1, 4, 7]])
    steps = [(np.array([[4]]), np.array([0.2])), (np.array([[7]]), np.array([1e-7])), (np.array([[1]]), np.array([0.3]))]
    tied = parity.compare_greedy(ref, np.array([[1, 4, 6]]), steps, FP32)
    assert tied["first_divergent_step"] == [1] and tied["margin_at_divergence"] == [pytest.approx(1e-7)]
    assert tied["passed"] and tied["tie_resolved_images"] == [0]
    clear = parity.compare_greedy(ref, np.array([[2, 4, 7]]), steps, FP32)
    assert clear["first_divergent_step"] == [2] and not clear["passed"]


def test_tokens_leave_out_undefined_and_tied_rows_and_count_them():
    ref = np.zeros((1, 3, 4))
    ref[0, :, 0] = 1.0
    cand = ref.copy()
    cand[0, 2] = [0.0, 1.0, 0.0, 0.0]  # row 2 is completely different
    assert not parity.compare_tokens(ref, cand, FP32)["passed"]
    undefined = ref.copy()
    undefined[0, 2] = np.nan
    result = parity.compare_tokens(undefined, cand, FP32)
    assert result["passed"] and result["rows_not_compared"] == 1
    margins = np.array([[np.inf, np.inf, 1e-6]])
    result = parity.compare_tokens(ref, cand, FP32, row_margins=margins)
    assert result["passed"] and result["rows_in_tie_band"] == 1
    assert not parity.compare_tokens(ref, cand, FP32, row_margins=np.array([[np.inf, np.inf, 0.5]]))["passed"]


def test_a_report_without_stages_does_not_pass():
    assert not parity.ParityReport({}, []).passed
