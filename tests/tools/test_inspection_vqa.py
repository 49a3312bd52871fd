"""tools/inspection_vqa.py: deterministic scenes, answers read back from the scene, balanced types, small parts."""

from __future__ import annotations

import collections
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import inspection_vqa as iv  # noqa: E402


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_and_count_takes_a_prefix(tmp_path):
    iv.write_split("test", tmp_path / "a", seed=3, count=6)
    iv.write_split("test", tmp_path / "b", seed=3, count=6)
    iv.write_split("test", tmp_path / "c", seed=3, count=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    a = (tmp_path / "a" / "questions.jsonl").read_text().splitlines()
    c = (tmp_path / "c" / "questions.jsonl").read_text().splitlines()
    assert a[:len(c)] == c and len(a) == 12 and len(c) == 8
    assert (tmp_path / "a/images/test-00003.png").read_bytes() == (tmp_path / "c/images/test-00003.png").read_bytes()
    iv.write_split("test", tmp_path / "d", seed=4, count=6)
    assert _digest(tmp_path / "a") != _digest(tmp_path / "d")


def test_splits_are_different_streams():
    train, _ = iv.scene(0, "train", 5)
    test, _ = iv.scene(0, "test", 5)
    assert not np.array_equal(train, test)


def test_rows_are_eval_dataset_lines(tmp_path):
    from vlmprune.compiler.quality.dataset import read_dataset

    info = iv.write_split("test", tmp_path / "s", seed=0, count=5)
    samples = read_dataset(tmp_path / "s" / "questions.jsonl")
    assert len(samples) == 10 and all(Path(s.image).is_file() for s in samples)
    rows = [json.loads(line) for line in (tmp_path / "s" / "questions.jsonl").read_text().splitlines()]
    assert {r["type"] for r in rows} <= set(iv.TYPES)
    assert all(len(r["answers"]) == 1 and " " not in r["answers"][0] for r in rows)
    assert json.loads((tmp_path / "s" / "summary.json").read_text()) == json.loads(json.dumps(info))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_answers_are_balanced_per_type_and_parts_are_small():
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i in range(400):
        rng = iv.image_rng(0, "train", i)
        kinds = iv._pick_types(rng)
        assert len(set(kinds)) == 2
        targets = {k: iv.ANSWERS[k][rng.integers(len(iv.ANSWERS[k]))] for k in kinds}
        parts, refs = iv.plan_scene(rng, targets)
        assert 1 <= len(parts) <= 6 and len({(p.color, p.shape) for p in parts}) == len(parts)
        for p in parts:  # each part's box covers 0.3-3 % of the image, inside it
            assert iv.AREA[0] * 0.9 <= p.side ** 2 / iv.SIZE ** 2 <= iv.AREA[1] * 1.05
            assert 0 <= p.x and p.x + p.side <= iv.SIZE and 0 <= p.y and p.y + p.side <= iv.SIZE
        for k in kinds:
            text, answer = iv.question(k, refs, parts)
            assert answer == targets[k], (i, k, text)
            counts[k][answer] += 1
    for kind, answers in counts.items():
        assert set(answers) == set(iv.ANSWERS[kind]), kind
        # drawn uniformly: no answer takes more than twice its fair share on ~100 questions a type
        assert max(answers.values()) / sum(answers.values()) < 2 / len(iv.ANSWERS[kind]), (kind, answers)


def test_region_and_defect_are_in_the_pixels():
    """The queried part's colour is at its centre; a defect changes the part's pixels."""
    for i in range(60):
        pixels, rows = iv.scene(0, "test", i)
        rng = iv.image_rng(0, "test", i)
        kinds = iv._pick_types(rng)
        targets = {k: iv.ANSWERS[k][rng.integers(len(iv.ANSWERS[k]))] for k in kinds}
        parts, _ = iv.plan_scene(rng, targets)
        for p in parts:
            if p.shape in ("square", "circle", "cross") and not p.label and not p.defect:
                cx, cy = (int(v) for v in p.center)
                assert tuple(pixels[cy, cx]) == iv.COLORS[p.color], (i, p)
        assert pixels.shape == (iv.SIZE, iv.SIZE, 3) and pixels.dtype == np.uint8
        assert len(rows) == 2


def test_region_names_follow_the_three_by_three_cells():
    s = iv.SIZE
    assert iv.region_of(1, 1) == "topleft" and iv.region_of(s - 1, s - 1) == "bottomright"
    assert iv.region_of(s / 2, s / 2) == "center" and iv.region_of(s / 2, 2) == "top"


def test_cli_refuses_existing_output_and_bad_count(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert iv.main(["--split", "test", "-o", str(tmp_path / "x"), "--count", "1"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert iv.main(["--split", "test", "-o", str(tmp_path / "y"), "--count", "0"]) == 2
    assert capsys.readouterr().err == "error: --count must be at least 1, got 0\n"
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_type_can_be_drawn(split):
    seen = set()
    for i in range(40):
        _, rows = iv.scene(1, split, i)
        seen |= {r["type"] for r in rows}
    assert seen == set(iv.TYPES)


def test_a_description_names_every_part_in_reading_order_and_agrees_with_the_questions():
    """describe: the count, then each part's colour, shape and region (its defect and label where it has them),
    region by region; the same facts the scene's questions answer; deterministic."""
    for i in range(40):
        d = iv.describe(0, "train", i)
        assert d == iv.describe(0, "train", i) and d["question"] == iv.DESCRIBE and d["type"] == "describe"
        head, body = d["answers"][0].split(" parts : ")
        parts = [p.split() for p in body.split(" , ")]
        assert int(head) == len(parts)
        regions = [iv.REGIONS.index(p[2]) for p in parts]
        assert regions == sorted(regions)  # reading order
        for words in parts:
            assert words[0] in iv.COLORS and words[1] in iv.SHAPES and words[2] in iv.REGIONS
            rest = words[3:]
            if rest and rest[0] in iv.DEFECTS:
                rest = rest[1:]
            assert rest == [] or (rest[0] == "label" and rest[1] in iv.LABELS and len(rest) == 2)
        _, rows = iv.scene(0, "train", i)
        more = iv.more_questions(0, "train", i, 64)
        for q in rows + more:
            answer = q["answers"][0]
            if q["type"] == "count":
                assert answer == head
            elif q["type"] == "region":
                color, shape = q["question"].split()[-2:]
                assert any(w[:2] == [color, shape.rstrip("?")] and w[2] == answer for w in parts)
            elif q["type"] == "label":
                assert ["label", answer] in [w[-2:] for w in parts]
            elif q["type"] == "defect":
                assert (answer == "yes") == any(set(w) & set(iv.DEFECTS) for w in parts)


def test_patch_words_name_the_part_under_each_patch_and_nothing_on_the_background():
    """patch_words: a patch whose centre lies on a part's silhouette names its label where it overlaps the label's
    characters, and otherwise its colour, shape, region or defect by the patch's index; patches far from every
    part are None; the part's pixel colour is under its patches, and the label's ink inside its label box."""
    grid, step = 32, iv.SIZE / 32
    by_turn = on_text = 0
    for i in range(20):
        pixels, _ = iv.scene(0, "train", i)
        _, _, parts, _ = iv._planned(iv.image_rng(0, "train", i))
        words = iv.patch_words(0, "train", i, grid)
        assert len(words) == grid * grid and words == iv.patch_words(0, "train", i, grid)
        for t, w in enumerate(words):
            r, c = divmod(t, grid)
            cx, cy = (c + 0.5) * step, (r + 0.5) * step
            owners = [p for p in parts if p.x <= cx < p.x + p.side and p.y <= cy < p.y + p.side]
            if w is None:
                continue
            assert owners, (i, t, w)
            fields = {p.x: [p.color, p.shape, iv.region_of(*p.center)] + [f for f in (p.defect,) if f]
                      for p in owners}
            if w in iv.LABELS:  # on the label's characters: the patch overlaps the box they are drawn in
                p = next(p for p in owners if p.label == w)
                x0, y0, x1, y1 = iv.label_box(p)
                assert x0 < (c + 1) * step and c * step < x1 and y0 < (r + 1) * step and r * step < y1, (i, t, w)
                continue
            p = next(p for p in owners if fields[p.x][t % len(fields[p.x])] == w)
            if w == p.color and t % len(fields[p.x]) == 0 and not p.label and not p.defect and p.shape != "triangle":
                assert tuple(pixels[int(cy), int(cx)]) == iv.COLORS[w]
        for t in range(grid * grid):  # a patch centre outside every part's box is background
            r, c = divmod(t, grid)
            cx, cy = (c + 0.5) * step, (r + 0.5) * step
            if not any(p.x - 1 <= cx < p.x + p.side + 1 and p.y - 1 <= cy < p.y + p.side + 1 for p in parts):
                assert words[t] is None
        assert sum(w is not None for w in words) >= len(parts)  # every part covers at least one patch centre
        named = set(words)
        for p in parts:  # every label is named on its characters; defects where a part reaches their turn
            if p.label:
                assert p.label in named, (i, p)
                x0, y0, x1, y1 = (round(v) for v in iv.label_box(p))  # render drew the characters in that box
                ink = pixels[y0:y1, x0:x1].reshape(-1, 3)
                assert (ink == (0, 0, 0)).all(1).sum() + (ink == (255, 255, 255)).all(1).sum() > 10, (i, p)
        old = iv.patch_words(0, "train", i, grid, label_on_text=False)  # the earlier targets: labels by turn only
        assert [w is None for w in old] == [w is None for w in words]
        by_turn += sum(w in iv.LABELS for w in old)
        on_text += sum(w in iv.LABELS for w in words)
    assert on_text > by_turn  # every patch on the characters names the label, where a turn gave it one in four or five
