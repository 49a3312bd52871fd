"""compiler.quality.dataset: reading JSON Lines datasets, sample digests, and chunking by image."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.quality.dataset import Sample, by_image, read_dataset


def _png(path: Path, color=(255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), color).save(path)
    return path


def _jsonl(path: Path, records) -> Path:
    """Each record is a dict (written as JSON) or a raw string (written as is, for bad or blank lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def data(tmp_path):
    """A dataset folder: two images next to the file, one line each for a relative path and an absolute one."""
    red, blue = _png(tmp_path / "d" / "img" / "red.png"), _png(tmp_path / "d" / "blue.png", (0, 0, 255))
    path = _jsonl(tmp_path / "d" / "set.jsonl", [
        {"image": "img/red.png", "question": "What color?", "answers": ["red", "Red"]},
        "",
        "   ",
        {"image": str(blue), "question": "Which color is it?", "answers": "blue", "id": "b1"},
        {"image": "img/red.png", "question": "Is it red?", "answers": ["yes"]},
    ])
    return path, red, blue


def test_reads_relative_and_absolute_images_and_answer_forms(data):
    path, red, blue = data
    samples = read_dataset(path)
    assert [s.index for s in samples] == [0, 1, 2]  # blank lines take no index
    assert [s.image for s in samples] == [str(red.resolve()), str(blue.resolve()), str(red.resolve())]
    assert [s.question for s in samples] == ["What color?", "Which color is it?", "Is it red?"]
    assert [s.answers for s in samples] == [("red", "Red"), ("blue",), ("yes",)]  # a string is one answer
    assert all(isinstance(s, Sample) and len(s.digest) == 32 for s in samples)
    assert len({s.digest for s in samples}) == 3


def test_limit_takes_the_first_samples_and_reads_no_further(data, tmp_path):
    path, _, _ = data
    assert [s.question for s in read_dataset(path, limit=2)] == ["What color?", "Which color is it?"]
    assert len(read_dataset(path, limit=10)) == 3
    # Lines past the limit are not read, so a bad one there does not stop a short run.
    with path.open("a", encoding="utf-8") as f:
        f.write("not json\n")
    assert len(read_dataset(path, limit=3)) == 3
    with pytest.raises(InputError):
        read_dataset(path)


def test_digest_follows_content_not_location(data, tmp_path):
    path, red, _ = data
    before = [s.digest for s in read_dataset(path)]
    # Moving the file with its images (relative paths) keeps every digest, so the store's rows are reused;
    # the blue image is referenced absolutely and stays where it is.
    moved = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(path.parent, moved)
    path.unlink()
    assert [s.digest for s in read_dataset(moved / "set.jsonl")] == before

    # A different image under the same name is a new sample.
    _png(moved / "img" / "red.png", (250, 0, 0))
    after = [s.digest for s in read_dataset(moved / "set.jsonl")]
    assert after[0] != before[0] and after[2] != before[2] and after[1] == before[1]


def test_digest_changes_with_question_and_answers(tmp_path):
    _png(tmp_path / "a.png")
    base = {"image": "a.png", "question": "q?", "answers": ["x"]}

    def digest(**change):
        return read_dataset(_jsonl(tmp_path / "one.jsonl", [{**base, **change}]))[0].digest

    d = digest()
    assert digest() == d
    assert digest(answers="x") == d  # one answer as a string or a list is the same sample
    assert digest(id="other") == d  # the id is not part of what decides an answer
    assert digest(question="q!") != d
    assert digest(answers=["y"]) != d
    assert digest(answers=["x", "y"]) != d


def test_same_image_bytes_under_two_names_share_the_image_part(tmp_path):
    """The digest hashes the image's bytes, not its path: a renamed copy is the same sample."""
    _png(tmp_path / "a.png")
    shutil.copy(tmp_path / "a.png", tmp_path / "b.png")
    s = read_dataset(_jsonl(tmp_path / "s.jsonl", [{"image": "a.png", "question": "q", "answers": "x"},
                                                   {"image": "b.png", "question": "q", "answers": "x"}]))
    assert s[0].image != s[1].image and s[0].digest == s[1].digest


def _error(path, limit=None) -> str:
    with pytest.raises(InputError) as exc:
        read_dataset(path, limit)
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_bad_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert _error(missing) == f"--dataset {missing}: no such file"
    # a folder is a dataset only with its questions.jsonl
    assert _error(tmp_path) == (f"--dataset {tmp_path}: a folder without questions.jsonl "
                                "(JSON Lines of image or video, question, answers)")
    empty = _jsonl(tmp_path / "empty.jsonl", ["", "  "])
    assert _error(empty) == f"--dataset {empty}: no samples in it"
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert _error(binary) == f"--dataset {binary}: not UTF-8 text (JSON Lines)"


@pytest.mark.parametrize("line, problem", [
    ("not json", "not JSON (Expecting value)"),
    ('{"image": "a.png", "question": "q"', "not JSON (Expecting ',' delimiter)"),
    ("[1, 2]", "a JSON object with image, question and answers is expected"),
    ('{"image": "a.png"}', "missing question, answers"),
    ('{"question": "q", "answers": "x"}', "missing image"),
    ('{"image": "a.png", "question": "q", "answers": []}', "answers must be a string or a non-empty list of strings"),
    ('{"image": "a.png", "question": "q", "answers": 3}', "answers must be a string or a non-empty list of strings"),
    ('{"image": "a.png", "question": "q", "answers": ["x", 1]}',
     "answers must be a string or a non-empty list of strings"),
    ('{"image": "a.png", "question": "  ", "answers": "x"}', "question must be a non-empty string"),
    ('{"image": "a.png", "question": 7, "answers": "x"}', "question must be a non-empty string"),
    ('{"image": "a.png", "question": "q", "answers": "x", "type": 3}', "type must be a non-empty string where given"),
    ('{"image": "a.png", "question": "q", "answers": "x", "type": " "}', "type must be a non-empty string where given"),
])
def test_bad_line_names_its_number(tmp_path, line, problem):
    _png(tmp_path / "a.png")
    path = _jsonl(tmp_path / "s.jsonl", [{"image": "a.png", "question": "ok", "answers": "x"}, "", line])
    assert _error(path) == f"--dataset {path} line 3: {problem}"


def test_missing_image_names_the_resolved_path(tmp_path):
    path = _jsonl(tmp_path / "d" / "s.jsonl", [{"image": "../img/gone.png", "question": "q", "answers": "x"}])
    assert _error(path) == f"--dataset {path} line 1: image {(tmp_path / 'img' / 'gone.png').resolve()} not found"


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3"])
def test_bad_limit(data, limit):
    path, _, _ = data
    assert _error(path, limit) == f"--limit must be an integer >= 1, got {limit!r}"


def _samples(images: str) -> list[Sample]:
    """One sample per letter, the letter naming its image: "aab" is two questions on a, one on b."""
    return [Sample(i, f"/img/{c}.png", f"q{i}", ("x",), f"d{i}") for i, c in enumerate(images)]


@pytest.mark.parametrize("images, size", [
    ("aabbbcdddd", 4), ("aaaaaabc", 4), ("abcdefg", 3), ("aaaaaaa", 2), ("a", 1), ("aabbccdd", 16), ("abab", 2),
])
def test_by_image_chunks(images, size):
    samples = _samples(images)
    chunks = by_image(samples, size)
    flat = [s for c in chunks for s in c]
    assert sorted(s.index for s in flat) == list(range(len(samples)))  # every sample exactly once
    assert all(1 <= len(c) <= size for c in chunks)
    # Images in order of first appearance, each image's questions in their own order.
    order = list(dict.fromkeys(s.image for s in samples))
    assert flat == sorted(samples, key=lambda s: (order.index(s.image), s.index))
    for image in order:
        group = [s for s in samples if s.image == image]
        if len(group) <= size:  # a group that fits is never split
            assert sum(1 for c in chunks if any(s.image == image for s in c)) == 1


def test_by_image_keeps_groups_and_fills_chunks():
    chunks = by_image(_samples("aabbbcdddd"), 4)
    assert ["".join(s.image[5] for s in c) for c in chunks] == ["aa", "bbbc", "dddd"]
    chunks = by_image(_samples("aaaaaabc"), 4)  # a group too big splits, and its rest shares a chunk
    assert ["".join(s.image[5] for s in c) for c in chunks] == ["aaaa", "aabc"]
    assert by_image([], 4) == []


def test_a_type_is_read_where_given_and_is_not_in_the_digest(tmp_path):
    """The type groups the answers (accuracy per type); it does not decide them, so typing a dataset keeps its
    digests and every stored cell."""
    _png(tmp_path / "a.png")
    plain = _jsonl(tmp_path / "plain.jsonl", [{"image": "a.png", "question": "How many?", "answers": "2"},
                                              {"image": "a.png", "question": "Color?", "answers": "red"}])
    typed = _jsonl(tmp_path / "typed.jsonl", [{"image": "a.png", "question": "How many?", "answers": "2",
                                               "type": "count"},
                                              {"image": "a.png", "question": "Color?", "answers": "red"}])
    a, b = read_dataset(plain), read_dataset(typed)
    assert [s.type for s in a] == [None, None] and [s.type for s in b] == ["count", None]
    assert [s.digest for s in a] == [s.digest for s in b]
