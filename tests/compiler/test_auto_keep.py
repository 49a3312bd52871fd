"""`--keep auto --latency-ms X` (compiler.pipeline.auto_keep): the selection on a given curve, the search on a given
latency function, the bad inputs in one line, and one real ONNX Runtime run on the tiny LLaVA."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, auto_keep

from cli_helpers import one_line_error, run_cli

CURVE = [(1, 2.0), (2, 2.1), (4, 2.3), (8, 2.8), (16, 4.0), (32, 6.5), (63, 11.0)]


def test_select_takes_the_largest_k_that_fits():
    assert auto_keep.select(CURVE, 100.0) == 63
    assert auto_keep.select(CURVE, 11.0) == 63  # a budget equal to a point's latency fits it
    assert auto_keep.select(CURVE, 1.99) is None


def test_a_budget_between_two_points_picks_the_lower():
    assert auto_keep.select(CURVE, 5.0) == 16  # between K=16 (4.0) and K=32 (6.5)
    assert auto_keep.select(CURVE, 6.49) == 16
    assert auto_keep.select(CURVE, 6.5) == 32


def test_chosen_k_is_monotone_in_the_budget_even_on_a_noisy_curve():
    noisy = [(1, 2.0), (2, 3.0), (4, 2.5), (8, 3.2), (16, 3.1), (32, 6.0)]  # dips at K=4 and K=16: noise
    assert auto_keep.envelope(noisy) == [(1, 2.0), (2, 3.0), (4, 3.0), (8, 3.2), (16, 3.2), (32, 6.0)]
    assert auto_keep.select(noisy, 2.6) == 1  # K=4 measured 2.5, but K=2 did not fit: the dip is not trusted
    chosen = [auto_keep.select(noisy, b) for b in np.linspace(1.0, 7.0, 121)]
    fitted = [c for c in chosen if c is not None]
    assert fitted == sorted(fitted) and chosen[0] is None and chosen[-1] == 32


def _linear(timed: list[int], refused=()):
    def time_k(k):
        timed.append(k)
        if k in refused:
            return None
        return auto_keep.Timing(k, [1.0 + 0.1 * k] * auto_keep.REPEATS)
    return time_k


def test_search_finds_the_exact_largest_k_in_few_candidates():
    timed: list[int] = []
    chosen, timings = auto_keep.search(_linear(timed), 1, 575, 10.0)
    assert chosen == 90  # 1 + 0.1 K <= 10
    assert timed[:8] == [1, 2, 4, 8, 16, 32, 64, 128]  # the ladder stops at the first rung over the budget
    assert len(timed) == len(set(timed)) <= 8 + 7  # then bisection between 64 and 128
    assert set(timings) == set(timed)


def test_search_stops_at_the_top_when_everything_fits_and_skips_refused_ks():
    timed: list[int] = []
    chosen, _ = auto_keep.search(_linear(timed, refused={2}), 1, 63, 1e6)
    assert chosen == 63 and timed == [1, 2, 4, 8, 16, 32, 63]
    timed = []
    chosen, _ = auto_keep.search(_linear(timed), 1, 63, 0.5)
    assert chosen is None and timed == [1]


def test_search_stops_where_the_bracket_is_within_the_noise():
    def time_k(k):  # a flat curve (pruning at the tower's end), spread 0.2 ms: the budget falls inside the noise
        return auto_keep.Timing(k, [5.0 + 0.001 * k + d for d in (-0.2, -0.1, 0.0, 0.1, 0.2)])
    chosen, timings = auto_keep.search(time_k, 1, 575, 5.2)
    assert chosen is not None and timings[chosen].ms <= 5.2
    assert len(timings) <= 11  # no bisection through noise


def _runs(median: float, spread: float) -> list[float]:
    return [median + d * spread for d in (-0.6, -0.25, 0.0, 0.25, 0.6)]


def test_a_flat_curve_says_that_k_does_not_change_the_latency():
    """The demo pruned at the tower's end: K=1 36.5 ms, K=575 40.7 ms, each candidate's runs spread ~3 ms; a budget
    inside that band picks K from noise, and the search says so."""
    demo = {1: 36.5, 2: 37.9, 4: 36.8, 8: 38.2, 16: 37.0, 32: 39.1, 64: 38.0, 128: 39.6, 256: 40.1, 575: 40.7}
    timed = {k: auto_keep.Timing(k, _runs(ms, 3.0)) for k, ms in demo.items()}
    assert timed[1].spread >= 2.1  # the interquartile range the threshold is relative to
    said = auto_keep.flat(timed)
    assert said and said.startswith("K does not change the latency here: from K=1 to K=575 it rises 4.200 ms")
    assert "picked by noise" in said
    steep = {k: auto_keep.Timing(k, _runs(ms, 0.3)) for k, ms in CURVE}  # 2.0 to 11.0 ms, spread ~0.2 ms
    assert auto_keep.flat(steep) is None
    assert auto_keep.flat({1: timed[1]}) is None  # one K timed: nothing to compare


@pytest.mark.parametrize("options,needle", [
    (dict(keep=64, latency_ms=5.0), "--latency-ms is the budget of --keep auto"),
    (dict(keep="auto"), "--keep auto needs --latency-ms"),
    (dict(keep="auto", latency_ms=-1.0), "--latency-ms must be a positive number"),
    (dict(keep="auto", latency_ms=float("nan")), "--latency-ms must be a positive number"),
    (dict(keep="most", latency_ms=5.0), "--keep must be an integer >= 1 or auto"),
    (dict(keep="auto", latency_ms=5.0, prune=False), "--no-prune"),
    (dict(keep="auto", latency_ms=5.0, target="orin"), "build-engine"),
    (dict(keep="auto", latency_ms=5.0, target="rk3588"), "simulator"),
    (dict(keep="auto", latency_ms=5.0, target="qnn"), "emulated cycles"),
])
def test_bad_combinations_are_refused_before_any_work(options, needle):
    with pytest.raises(InputError, match=needle.replace("+", r"\+").replace("(", r"\(")):
        auto_keep.requested(CompileOptions(**options))
    assert auto_keep.requested(CompileOptions(keep=64)) is False


@pytest.mark.parametrize("args,needle", [
    (("--latency-ms", 5), "--latency-ms is the budget of --keep auto"),
    (("--keep", "auto"), "--keep auto needs --latency-ms"),
    (("--keep", "auto", "--latency-ms", "-3"), "--latency-ms must be a positive number"),
    (("--keep", "lots"), "is not an integer or auto"),
    (("--keep", "auto", "--latency-ms", 5, "--target", "orin"), "no device here"),
    (("--keep", "auto", "--latency-ms", 5, "--no-prune"), "--keep, --latency-ms do not apply"),
])
def test_cli_refuses_in_one_line(tiny_llava_dir, tmp_path, args, needle):
    result = run_cli("compile", tiny_llava_dir, *args, "-o", tmp_path / "b")
    one_line_error(result, needle)
    assert not (tmp_path / "b").exists()


def test_generous_budget_compiles_the_largest_k_with_its_curve(tiny_llava_dir, tmp_path):
    out = tmp_path / "b"
    result = run_cli("compile", tiny_llava_dir, "--keep", "auto", "--latency-ms", 10000, "--layer", 1, "-o", out,
                     "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    section = manifest["keep_auto"]
    ks = [k for k, _ in section["curve"]]
    assert section["chosen"] == 63 == max(ks) and ks == sorted(ks) and ks[0] == 1  # 64 patches: K < 64
    assert all(ms > 0 for _, ms in section["curve"]) and section["budget_ms"] == 10000
    assert section["source"] == "measured" and "onnxruntime" in section["timed_on"]
    assert manifest["method"]["keep"] == 63 and manifest["compile_options"]["keep"] == 63
    assert manifest["compile_options"]["latency_ms"] is None  # the bundle recompiles with --keep 63 alone
    assert manifest["parity"]["passed"]
    report = tmp_path / "r.html"
    result = run_cli("check", out, "--report", report)
    assert result.exit_code == 0, result.output
    page = report.read_text()
    assert "K chosen by latency (--keep auto)" in page and 'alt="latency vs K" src="data:image/png;base64,' in page


def test_impossible_budget_is_one_line_and_leaves_no_bundle(tiny_llava_dir, tmp_path):
    result = run_cli("compile", tiny_llava_dir, "--keep", "auto", "--latency-ms", 1e-6, "--layer", 1,
                     "-o", tmp_path / "b")
    one_line_error(result, "even K=1 takes")
    assert not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".partial", ".old"))]


def test_latency_curve_picture_draws_points_budget_and_choice():
    from vlmprune.compiler import pictures
    from vlmprune.compiler.bundle.manifest import KeepAutoSection

    image = np.asarray(pictures.latency_curve(KeepAutoSection({"budget_ms": 5.0, "chosen": 16,
                                                                "curve": [list(p) for p in CURVE]})))
    colors = {tuple(c) for c in image.reshape(-1, 3)}
    assert {pictures.BUDGET_RGB, pictures.CURVE_RGB, pictures.CHOSEN_RGB} <= colors
    one_point = np.asarray(pictures.latency_curve(KeepAutoSection({"budget_ms": 5.0, "chosen": 4,
                                                                    "curve": [[4, 3.0]]})))
    assert pictures.CHOSEN_RGB in {tuple(c) for c in one_point.reshape(-1, 3)}


def test_a_compile_on_a_flat_curve_warns_and_records_it(tiny_llava_dir, tmp_path, monkeypatch):
    """`--keep auto` on the demo's flat curve once picked K from noise without a word; the compile says so in
    a warning line and in manifest["keep_auto"]["flat"]. (The timings are the demo's, given: this machine's
    noise would make the test's outcome noise.)"""
    demo = {1: 36.5, 8: 38.2, 32: 39.1, 63: 40.7}
    monkeypatch.setattr(auto_keep, "search", lambda measure, first, last, budget, progress: (
        63, {k: auto_keep.Timing(k, _runs(ms, 3.0)) for k, ms in demo.items()}))
    out = tmp_path / "b"
    result = run_cli("compile", tiny_llava_dir, "--keep", "auto", "--latency-ms", 10000, "--layer", 1, "-o", out)
    assert result.exit_code == 0, result.output
    flat = json.loads((out / "manifest.json").read_text())["keep_auto"]["flat"]
    assert flat and flat.startswith("K does not change the latency here")
    assert any(line.endswith(f"] warning: keep auto: {flat}") for line in result.stderr.splitlines()), result.stderr
