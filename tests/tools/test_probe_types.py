"""tools/probe_types.py on a reduced run: a tiny random DINOv2 tower, 24 training and 12 test images, one epoch.

The same code path as the full run (the generator's splits, train_easyvqa's features cached per image, both probes,
the project's bootstrap intervals, the table and --json), in seconds. The tower is random, so the accuracies say
nothing about DINOv2; what is checked is the table's structure, that a rerun at one seed gives the same figures
(with the features read back from the cache, not recomputed), and that bad input is refused in one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import inspection_vqa  # noqa: E402
import probe_types  # noqa: E402

ARGS = ["--train-images", "24", "--test-images", "12", "--epochs", "1", "--threads", "2", "-q"]



@pytest.fixture(scope="module")
def runs(tower, tmp_path_factory):
    """Two runs at one seed sharing a cache: the first makes the splits and features, the second reuses them."""
    import io
    from contextlib import redirect_stdout

    cache = tmp_path_factory.mktemp("cache")
    out = []
    for n in range(2):
        buf, path = io.StringIO(), cache.parent / f"probe-{n}.json"
        with redirect_stdout(buf):
            code = probe_types.main([*ARGS, "--cache", str(cache), "--tower", str(tower), "--json", str(path)])
        out.append((code, buf.getvalue(), json.loads(path.read_text())))
    return cache, out


def test_table_has_every_type_with_intervals(runs):
    cache, [(code, text, record), _] = runs
    assert code == 0
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| type |"))
    rows = [line for line in lines[header + 2:] if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(record["types"])
    assert set(record["types"]) <= set(inspection_vqa.TYPES) and len(record["types"]) >= 5
    assert record["train_images"] == 24 and record["test_images"] == 12 and record["features_shape"] == [64, 32]
    # the test questions are the split's two a image; training adds every question more_questions reads
    assert sum(t["test_questions"] for t in record["types"].values()) <= record["test_questions"] == 24
    assert record["train_questions"] > 48
    for kind, t in record["types"].items():
        for column in ("majority", "mean_probe", "attention_probe"):
            acc, lo, hi = t[column]
            assert 0 <= lo <= acc <= hi <= 1, (kind, column)
        assert t["majority_answer"] in inspection_vqa.ANSWERS[kind]
        assert t["vlm_dense"] == probe_types.VLM_DENSE[kind]
        assert f"| {kind} | {t['test_questions']} | {t['majority'][0]:.3f} " in text
    assert "docs/quality.md" in text and (cache / "datasets" / "inspection-test-s0-n12" / "questions.jsonl").is_file()


def test_same_seed_same_accuracies_and_the_features_are_reused(runs):
    _, [(_, _, first), (code, _, second)] = runs
    assert code == 0
    assert first["features"]["computed"] == 36 and first["features"]["cached"] == 0
    assert second["features"]["computed"] == 0 and second["features"]["cached"] == 36
    assert second["types"] == first["types"]  # every probe accuracy and interval, exactly


def test_the_query_is_conditioned_on_the_named_part():
    row = {"type": "presence", "question": "is there a purple cross?"}
    vec = probe_types.params(row)
    assert vec.sum() == 2 and vec[probe_types.COLORS.index("purple")] == 1
    assert vec[len(probe_types.COLORS) + probe_types.SHAPES.index("cross")] == 1
    assert probe_types.params({"type": "region", "question": "where is the red circle?"}).sum() == 2
    assert probe_types.params({"type": "count", "question": "how many parts are there?"}).sum() == 0
    with pytest.raises(probe_types.ProbeError):
        probe_types.params({"type": "region", "question": "where is the grey blob?"})


def test_bad_cache_or_unknown_type_is_one_line_and_exit_2(tmp_path, tower, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert probe_types.main([*ARGS, "--cache", str(afile), "--tower", str(tower)]) == 2
    assert capsys.readouterr().err == f"error: --cache {afile}: not a directory\n"
    assert probe_types.main([*ARGS, "--cache", str(afile / "below"), "--tower", str(tower)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --cache {afile / 'below'}: cannot create it") and err.count("\n") == 1
    assert probe_types.main([*ARGS, "--cache", str(tmp_path / "c"), "--types", "count,colour"]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: unknown question type 'colour' (known: {', '.join(inspection_vqa.TYPES)})\n"
    assert out.out == "" and not (tmp_path / "c").exists()  # refused before anything was made
    assert probe_types.main([*ARGS, "--cache", str(tmp_path / "c"), "--tower", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --tower {tmp_path / 'none'}: not a Dinov2Model directory")
