"""tools/eval_quality.py end to end on a tiny random LLaVA and a typed dataset: the accuracy table with the
difference to random keep and the per-type table, latency beside it (tower, TTFT, KV bytes), the speedup picture
as a PNG and in the report page, and the refusals that are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "tools"))
sys.path.insert(0, str(HERE.parents[1] / "compiler"))
import eval_quality  # noqa: E402
from test_accuracy import write_dataset  # noqa: E402
from test_generate import tiny_vlm  # noqa: E402


def test_tables_latency_and_picture(tmp_path, capsys):
    model = tiny_vlm(tmp_path / "model")
    data = write_dataset(tmp_path)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    typed = tmp_path / "typed.jsonl"
    typed.write_text("".join(json.dumps({**r, "type": ("count", "color")[i % 2]}) + "\n"
                             for i, r in enumerate(records)))
    out = tmp_path / "out"
    code = eval_quality.main(["--dataset", str(typed), "--model", str(model), "--methods", "cls", "--keep", "8",
                              "--layer", "1,end", "--repeats", "1", "--store", str(tmp_path / "s.sqlite"),
                              "--markdown", str(out.with_suffix(".md")), "--png", str(out.with_suffix(".png")),
                              "--report", str(out.with_suffix(".html")), "--json", str(out.with_suffix(".json"))])
    assert code == 0
    text = out.with_suffix(".md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| method | K | patches"))
    assert "vs random (95% CI)" in header and "tower speedup" in header and "KV per image" in header
    assert "saliency held" not in header  # extras off by default outside easy-vqa
    assert "| method | K | pruned | color (n=3) | count (n=3) |" in text
    assert "latency: ONNX Runtime CPU" in text
    figures = json.loads(out.with_suffix(".json").read_text())
    rows = figures["rows"]
    assert [r["method"] for r in rows] == ["dense", "cls", "cls", "random", "random", "grid", "grid"]
    assert rows[0]["tower_speedup"] == 1.0 and all(r["tower_ms"] > 0 and r["kv_bytes"] > 0 for r in rows)
    # The tiny tower has 64 patches: K=8 keeps fewer image tokens, so less KV cache than dense.
    assert all(r["kv_bytes"] < rows[0]["kv_bytes"] for r in rows[1:])
    assert all(r["retained"] is None for r in rows)  # the tiny model never says "cat": nothing to retain, so
    assert not out.with_suffix(".png").exists()  # no picture (test_speedup_picture draws one)
    assert "no picture: no pruned row has an accuracy retained" in capsys.readouterr().err
    page = out.with_suffix(".html").read_text()
    assert "Accuracy per question type" in page and "tower ms" in page
    from html import escape

    from vlmprune.compiler.quality import stats
    assert f"vs random: {stats.VERSUS_RANDOM}; **bold** where" in text and stats.AGREES in text
    assert escape(stats.VERSUS_RANDOM) in page and escape(stats.AGREES) in page


def test_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    assert eval_quality.main(["--dataset", str(tmp_path / "x.jsonl"), "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --dataset")
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    assert eval_quality.main(["--dataset", "inspection", "--model", str(tmp_path)]) == 2
    assert "run tools/train_easyvqa.py --dataset inspection first" in capsys.readouterr().err
    (tmp_path / "training.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "inspection_vqa", None)  # not in this checkout yet
    assert eval_quality.main(["--dataset", "inspection", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tools/inspection_vqa.py is not in this checkout") and "\n" not in err


def test_a_setting_the_compiler_refuses_is_one_line(tmp_path, capsys):
    """A K out of a method's reach (ToMe merges at most half a block's tokens) is the compiler's own line, exit 2."""
    model = tiny_vlm(tmp_path / "model")
    data = write_dataset(tmp_path)
    code = eval_quality.main(["--dataset", str(data), "--model", str(model), "--methods", "tome:blocks=1-1",
                              "--keep", "4", "--layer", "1", "--no-latency", "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --keep 4 is out of ToMe's reach")
    assert not any("Traceback" in line for line in err)


def test_speedup_picture():
    """A point per (method, K, place), the baselines hollow, a marker per place, dense at (1, 1); rows without a
    speedup or a retained figure are left out, and no such row at all is no picture."""
    from PIL import Image

    from vlmprune.compiler.report import place_markers, quality_html, speedup_picture

    def row(method, keep, where, retained, speedup, baseline=False):
        return {"method": method, "keep": keep, "where": where, "baseline": baseline, "retained": retained,
                "retained_ci": None if retained is None else [retained - 0.05, min(1.02, retained + 0.05)],
                "tower_speedup": speedup}

    rows = [row("dense", None, "-", 1.0, 1.0), row("cls", 48, "after block 2", 0.9, 3.5),
            row("cls", 96, "tower end", 0.97, 1.02), row("random", 48, "after block 2", 0.8, 3.6, True),
            row("grid", 48, "after block 2", None, 3.6, True), row("tome", 48, "after block 2", 0.95, None)]
    picture = speedup_picture(rows)
    assert isinstance(picture, Image.Image) and picture.size == (720, 440)
    assert place_markers(rows) == {"after block 2": "square", "tower end": "circle"}
    colors = {tuple(c) for c in np.asarray(picture).reshape(-1, 3)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # cls, then random: one colour each
    assert speedup_picture([rows[0], rows[4], rows[5]]) is None
