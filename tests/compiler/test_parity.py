"""Parity comparisons as data: what turns a kept-index mismatch into a pass, and what does not."""

from __future__ import annotations

import numpy as np
import pytest

from vlmprune.compiler import parity
from vlmprune.compiler.cli.render import stage_line

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


def test_independent_cuts_judge_each_mismatch_by_its_own_span():
    # Two TopKs of K = 2, over positions 4-7 and 12-15 (DyCoke's pruned frames 1 and 3 of 4 positions each); higher
    # is kept. Frame 1 is still (its last three positions tie exactly); frame 3's scores are apart.
    cuts = [(4, np.array([[0.9, -1.0, -1.0, -1.0]]), 2), (12, np.array([[0.8, 0.1, -0.5, -0.6]]), 2)]
    whole = [0, 1, 2, 3, 8, 9, 10, 11]
    ref = np.array([sorted(whole + [4, 5, 12, 13])])
    tied = parity.compare_local_cuts(ref, np.array([sorted(whole + [4, 7, 12, 13])]), cuts, FP32)
    assert tied["passed"] and tied["tie_resolved_images"] == [0] and tied["boundary_ties"] == [3]
    apart = parity.compare_local_cuts(ref, np.array([sorted(whole + [4, 5, 12, 14])]), cuts, FP32)
    assert not apart["passed"] and apart["tie_resolved_images"] == []
    outside = parity.compare_local_cuts(ref, np.array([sorted([0, 1, 2, 3, 8, 9, 10] + [4, 5, 6, 12, 13])]), cuts,
                                        FP32)  # 6 kept instead of 11, a position no cut ranks
    assert not outside["passed"]


def test_a_tie_band_is_never_narrower_than_fp32_rounding_of_the_scores():
    """A still background: six cosines within 3e-7 of the cut (a few fp32 ulps at 1), more than the share cap lets
    the narrowed band hold (2 at K = 4); a runtime summing in another order picked the 5th nearest. That is
    rounding, not a wrong selection (the failure the clip made here gave at 16 frames). 1.75e-5 from the cut is not."""
    scores = np.array([[0.5, 0.4, 0.3, -0.9999749, -0.9999750, -0.9999751, -0.9999752, -0.9999753, -1.0]])
    cuts = [(0, scores, 4)]
    ref = np.array([[0, 1, 2, 3]])
    assert parity.compare_local_cuts(ref, np.array([[0, 1, 2, 6]]), cuts, FP32)["passed"]
    apart = [(0, np.array([[0.5, 0.4, 0.3, -0.99997, -0.999975, -0.99999]]), 4)]  # index 5: 1.75e-5 past the cut
    assert not parity.compare_local_cuts(ref, np.array([[0, 1, 2, 5]]), apart, FP32)["passed"]
    # One clip-wide TopK the same (evs-encoder: the first frame's 255, then windows of a still background whose
    # 1 - cosine is rounding noise; the cut falls among them).
    evs = np.array([[255.0, 255.0, 0.3, 2e-7, 1e-7, 0.0, -1e-7, -2e-7, -3e-7, 0.2]])
    ref = np.array([[0, 1, 2, 3, 4, 9]])
    assert parity.compare_indices(ref, np.array([[0, 1, 2, 3, 8, 9]]), evs, FP32)["passed"]
    assert not parity.compare_indices(ref, np.array([[0, 1, 3, 4, 5, 9]]), evs, FP32)["passed"]  # 0.3 dropped


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


def _variable_k_stage(cand_kept, cand_rows, rho_n, scores):
    """One fp16 stage over a hand-made two-image variable-K reference (K_max 2, D 2, no summary row)."""
    from vlmprune.compiler.parity.reference import FEATURES, KEPT, NUM_TOKENS, Reference

    feats = np.array([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [0.0, 0.0]]])  # image 1 keeps one row
    ref = Reference({FEATURES: feats, KEPT: np.array([[0, 1], [2, -1]]), NUM_TOKENS: np.array([2, 1])},
                    trace={"scores": scores, "keep": np.array([2, 1]), "budget_rows": np.array(rho_n),
                           "budget_range": (1, 2)})
    cand = {FEATURES: np.array([[[1.0, 0.0], [0.0, 1.0]], cand_rows]), KEPT: np.array(cand_kept),
            NUM_TOKENS: np.array([2, int((np.abs(cand_rows).sum(-1) > 0).sum())])}
    return parity.run_stage("s", "test", "fp16", lambda _pixels: cand, np.zeros((2, 3, 4, 4)), ref)


def test_variable_k_swap_in_the_tie_band_at_the_images_own_k_passes():
    scores = np.array([[0.9, 0.5, 0.1, 0.1], [0.1, 0.3, 0.8, 0.8 - 1e-6]])  # image 1: K_b = 1, ranks 1 and 2 tie
    stage = _variable_k_stage([[0, 1], [3, -1]], [[1.0, 1.0], [0.0, 0.0]], [2.0, 1.0], scores)
    assert stage.passed and stage.indices["tie_resolved_images"] == [1], stage.indices
    clear = np.array([[0.9, 0.5, 0.1, 0.1], [0.1, 0.3, 0.8, 0.2]])  # the same swap with a clear margin
    assert not _variable_k_stage([[0, 1], [3, -1]], [[1.0, 1.0], [0.0, 0.0]], [2.0, 1.0], clear).passed


def test_a_k_decision_tie_passes_only_where_rho_n_sits_on_the_rounding_cut():
    scores = np.array([[0.9, 0.5, 0.1, 0.1], [0.1, 0.5, 0.8, 0.2]])
    two_rows = [[1.0, 1.0], [0.0, 1.0]]  # the candidate rounded image 1's ρ·N up: K 2, not 1
    tie = _variable_k_stage([[0, 1], [1, 2]], two_rows, [2.0, 1.5 - 1e-4], scores)
    assert tie.passed and tie.outputs["num_tokens"]["k_decision_ties"] == [1], tie.outputs["num_tokens"]
    assert tie.indices["tie_resolved_images"] == [1]
    far = _variable_k_stage([[0, 1], [1, 2]], two_rows, [2.0, 1.2], scores)  # ρ·N = 1.2 rounds to 1 at any precision
    assert not far.passed and far.outputs["num_tokens"]["rows_wrong"] == 1


def test_fp32_max_abs_bound_grows_with_the_outputs_scale_and_is_reported():
    """The easy-vqa case: a 1.08e-4 gap on features that reach 100 passes (bound 1e-4 + 1e-5 x 100 = 1.1e-3);
    the same gap on features of scale 1 fails (bound 1.1e-4 is met, 1.2e-4 is not)."""
    rng = np.random.default_rng(0)
    big = rng.normal(size=(1, 4, 8)) * 30
    big[0, 0, 0] = 100.0
    cand = big.copy()
    cand[0, 1, 2] += 1.08e-4
    got = parity.compare_tokens(big, cand, FP32)
    assert got["passed"] and got["reference_max_abs"] == 100.0
    assert got["max_abs_bound"] == pytest.approx(1e-4 + 1e-5 * 100)
    small = big / 100
    off = small.copy()
    off[0, 1, 2] += 1.2e-4  # bound 1e-4 + 1e-5 x 1 = 1.1e-4
    failed = parity.compare_tokens(small, off, FP32)
    assert not failed["passed"] and failed["max_abs_bound"] == pytest.approx(1.1e-4)
    stage = parity.StageResult("rewritten", "ort", "fp32", FP32, False, outputs={"image_features": failed})
    assert stage_line(stage) == (
        "rewritten  FAIL  cosine_min 1, max_abs 0.00012 (≤ 0.00011)  (failing: image_features)")
    # --atol gives the whole bound: no scale term
    exact = parity.compare_tokens(big, cand, parity.tolerance_for("fp32", parity.parse_overrides(
        {"atol": ("1e-4",)}, ["image_features"])["image_features"]))
    assert not exact["passed"] and exact["max_abs_bound"] == 1e-4


def _flat_scores(n=40, keep=8, seed=0):
    """Scores where half the patches sit within int16's band (1e-2 of the max) of the K-th boundary."""
    rng = np.random.default_rng(seed)
    scores = np.concatenate([[1.0] * 4, 0.5 + rng.uniform(-1e-3, 1e-3, n - 4)])
    return scores[None]


def test_the_tie_band_cannot_swallow_a_share_of_k():
    """qnn at K=64: 112 and 84 scores within 1e-2 of the boundary counted as ties, so any swap passed; the band now
    holds at most K/4 scores, the ones nearest the cut."""
    int16 = parity.tolerance_for("int16")
    scores = _flat_scores()
    keep = 8
    ref = np.sort(np.argsort(-scores[0], kind="stable")[:keep])[None]
    ranked = np.argsort(np.abs(scores[0] - 0.5 * (np.sort(scores[0])[::-1][keep - 1] + np.sort(scores[0])[::-1][keep])))
    near_out = [p for p in ranked[:2] if p not in ref[0]][0]  # the boundary pair: a tie
    near_in = [p for p in ranked[:2] if p in ref[0]][0]
    swapped = np.sort(np.where(ref == near_in, near_out, ref))
    result = parity.compare_indices(ref, swapped, scores, int16)
    assert result["passed"] and result["tie_resolved_images"] == [0]
    assert result["boundary_ties"][0] <= max(2, keep // 4)  # not the ~36 scores within 1e-2
    far_out = [p for p in ranked[keep:] if p not in ref[0]][0]  # in 1e-2 of the cut, but not among the K/4 nearest
    result = parity.compare_indices(ref, np.sort(np.where(ref == near_in, far_out, ref)), scores, int16)
    assert not result["passed"] and result["tie_resolved_images"] == []


def test_a_stage_whose_kept_sets_all_differ_compares_the_tokens_both_kept():
    """'every image was resolved differently by a boundary tie' passed with no feature compared: now the rows of the
    tokens both sides kept are compared, and a wrong one fails."""
    from vlmprune.compiler.parity.reference import FEATURES, KEPT, Reference
    from vlmprune.passes.methods import get_method

    scores = np.array([[0.9, 0.5, 0.5 - 1e-6, 0.1, 0.8]] * 2)  # patches 1 and 2 tie at the K = 3 boundary
    rng = np.random.default_rng(0)
    patches = rng.normal(size=(2, 5, 4))
    ref_kept, cand_kept = np.array([[0, 1, 4]] * 2), np.array([[0, 2, 4]] * 2)
    summary = lambda kept: np.stack([np.delete(patches[b], kept[b], 0).mean(0) for b in range(2)])[:, None]  # noqa
    ref_feats = np.concatenate([np.take_along_axis(patches, ref_kept[..., None], 1), summary(ref_kept)], 1)
    cand_feats = np.concatenate([np.take_along_axis(patches, cand_kept[..., None], 1), summary(cand_kept)], 1)
    reference = Reference({FEATURES: ref_feats, KEPT: ref_kept}, trace={"scores": scores},
                          method=get_method("cls"), params={"keep": 3, "lambda": 0.0})
    stage = parity.run_stage("s", "test", "fp16", lambda _: {FEATURES: cand_feats, KEPT: cand_kept},
                             np.zeros((2, 3, 4, 4)), reference)
    feats = stage.outputs[FEATURES]
    assert stage.passed and stage.indices["tie_resolved_images"] == [0, 1]
    assert feats["images_compared_on_common_tokens"] == {"0": 2, "1": 2} and feats["rows_compared"] == 4
    assert "on the tokens both sides kept" in stage_line(stage)
    wrong = cand_feats.copy()
    wrong[1, 2] = -wrong[1, 2]  # patch 4 of image 1, kept by both
    stage = parity.run_stage("s", "test", "fp16", lambda _: {FEATURES: wrong, KEPT: cand_kept},
                             np.zeros((2, 3, 4, 4)), reference)
    assert not stage.passed and stage.outputs[FEATURES]["cosine_min"] < 0
    # nothing known to compare (no method recorded): no longer a pass
    blind = parity.compare_tokens(ref_feats, cand_feats, parity.tolerance_for("fp16"), [0, 1])
    assert not blind["passed"] and "no image compared" in blind["error"]


def test_the_stage_line_names_the_tie_resolved_images_in_number():
    """The stage line once said "image 0, 1: it diverges ...", naming two images as one."""
    from vlmprune.compiler.cli.render import manifest_stage_line as _stage_line

    stage = {"passed": False, "precision": "int8", "index_agreement": 0.6, "tie_resolved_images": [0, 1],
             "first_divergent_step": [3, 4]}
    assert "images 0, 1: they diverge at a greedy step whose two best candidates tie" in _stage_line("qdq", stage)
    stage["tie_resolved_images"] = [1]
    assert "image 1: it diverges at a greedy step" in _stage_line("qdq", stage)


def test_the_parity_report_is_data_and_the_cli_renders_its_lines():
    """The parity package holds the figures, not text: `vlmprune check`'s lines are the CLI's (render.check_lines),
    one per stage, each the stage's verdict against its bounds."""
    from vlmprune.compiler.cli import render

    tol = parity.tolerance_for("fp32")
    ref = np.random.default_rng(0).normal(size=(1, 4, 8))
    good = parity.StageResult("export", "ort", "fp32", tol, True, outputs={"image_features": parity.compare_tokens(
        ref, ref, tol)})
    off = ref.copy()
    off[0, 1, 2] += 1.0
    bad = parity.StageResult("rewritten", "ort", "fp32", tol, False, outputs={"image_features": parity.compare_tokens(
        ref, off, tol)})
    report = parity.ParityReport({}, [good, bad])
    assert not hasattr(report, "lines")  # no text in the parity package's record
    lines = render.check_lines(report)
    assert [line.split()[:2] for line in lines] == [["export", "PASS"], ["rewritten", "FAIL"]]
    assert lines[1].endswith("(failing: image_features)") and lines == [stage_line(good), stage_line(bad)]
    for name in ("stage_line", "summary_figures", "compared_text"):
        assert not hasattr(parity, name), name  # the text is the CLI's
    assert render.progress_line("stage fused") == "stage fused"  # a progress line is printed as it is
    assert render.progress_line(bad) == "  " + stage_line(bad)  # a stage's record, indented under "parity"


def test_the_stage_timer_hands_a_parity_record_on_with_the_stage_it_ends():
    from vlmprune.compiler.pipeline.timings import StageTimer

    sent = []
    timer = StageTimer(sent.append, clock=iter([0.0, 1.0, 2.0]).__next__)
    record = parity.StageResult("rewritten", "ort", "fp32", parity.tolerance_for("fp32"), True)
    timer.step("stage rewritten")
    timer.step(record)
    assert sent == ["[   1.0s] stage rewritten", record]
    assert [span.label for span in timer.finish()] == ["stage rewritten"]


def test_check_sends_each_parity_stage_s_record_to_progress(demo_bundle):
    """The library sends data: run_parity hands progress each stage's StageResult as it ends (the report's own
    records), the lines between them are the stages' names; the CLI prints a record as render.stage_line."""
    from vlmprune.compiler import api

    sent = []
    report = api.check(demo_bundle.bundle, progress=sent.append)
    records = [m for m in sent if not isinstance(m, str)]
    assert len(records) == len(report.stages) == 3 and all(a is b for a, b in zip(records, report.stages))
    assert all(isinstance(m, parity.StageResult) for m in records)
