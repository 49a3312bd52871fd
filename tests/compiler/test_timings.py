"""compile --timings: one span per progress step, results timed with their stage, and the table a user reads."""

from __future__ import annotations

from vlmprune.compiler.pipeline.timings import StageTimer, table

from cli_helpers import run_cli


def test_spans_follow_the_steps_and_indented_results_stay_in_their_stage():
    ticks = iter([0.0, 1.0, 4.0, 4.5, 10.0])
    printed = []
    timer = StageTimer(printed.append, clock=lambda: next(ticks))
    timer.step("load")  # t = 1
    timer.step("stage fused")  # t = 4
    timer.step("  fused PASS")  # a result line: printed, no clock read, no span
    timer.step("bundle written")  # t = 4.5
    spans = timer.finish()  # t = 10
    assert [s.label for s in spans] == ["load", "stage fused", "bundle written"]
    assert [s.seconds for s in spans] == [3.0, 0.5, 5.5]
    assert printed == ["[   1.0s] load", "[   4.0s] stage fused", "  fused PASS", "[   4.5s] bundle written"]
    assert all(s.peak_rss_mb > 0 for s in spans)
    lines = table(spans, width=20)
    assert lines[0].split()[:2] == ["stage", "seconds"] and lines[-1].split()[:2] == ["total", "9.0"]
    assert lines[1].split()[:3] == ["load", "3.0", "33.3%"]


def test_compile_timings_prints_the_table_after_the_summary(tiny_clip_dir, tmp_path):
    result = run_cli("compile", tiny_clip_dir, "--target", "ort", "--keep", "16", "-o", tmp_path / "b", "-q",
                     "--timings")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("stage ") and "seconds" in line)
    assert lines[head - 1].startswith("bundle: ")
    stages = [line.split()[0] + " " + line.split()[1] for line in lines[head + 1:-1]]
    assert stages[0].startswith("load ") and "stage rewritten" in stages and "stage fused" in stages
    seconds = [float(line.split()[-4]) for line in lines[head + 1:-1]]  # label, seconds, share, RSS, children
    total = lines[-1].split()
    assert total[0] == "total" and abs(sum(seconds) - float(total[1])) <= 0.05 * len(seconds)
