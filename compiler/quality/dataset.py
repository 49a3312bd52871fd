"""Datasets for `eval --dataset`: JSON Lines, one {"image", "question", "answers"} object a line.

`image` is a path, relative to the file's own folder unless absolute; `answers` a list of
accepted answers (a string is one answer). An `id` is optional, and so is a `type` (a short
name such as "count" or "color"): eval reports accuracy per type beside the overall figure.
Each sample has a digest of
its image bytes, question and answers: the store keys cells by it, so an edited sample or a
replaced image is a new cell, while a moved dataset file reuses its rows. The type is not in
the digest: it groups the answers, it does not decide them, so typing a dataset reuses its cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from vlmprune.compiler.errors import InputError


@dataclasses.dataclass(frozen=True)
class Sample:
    index: int  # line order among the samples taken
    image: str  # absolute path
    question: str
    answers: tuple[str, ...]
    digest: str
    type: str | None = None  # the question's type, where the dataset gives one


def read_dataset(path: str | Path, limit: int | None = None) -> list[Sample]:
    """The first `limit` samples of a JSON Lines dataset (all without a limit), each checked; one line for bad input."""
    path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"--limit must be an integer >= 1, got {limit!r}")
    if not path.is_file():
        raise InputError(f"--dataset {path}: no such file")
    samples: list[Sample] = []
    image_digests: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"--dataset {path}: not UTF-8 text (JSON Lines)") from None
    for number, line in enumerate(lines, 1):
        if limit is not None and len(samples) >= limit:
            break
        if not line.strip():
            continue
        where = f"--dataset {path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: a JSON object with image, question and answers is expected")
        missing = [k for k in ("image", "question", "answers") if k not in record]
        if missing:
            raise InputError(f"{where}: missing {', '.join(missing)}")
        answers = record["answers"]
        answers = (answers,) if isinstance(answers, str) else answers
        if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
            raise InputError(f"{where}: answers must be a string or a non-empty list of strings")
        if not isinstance(record["question"], str) or not record["question"].strip():
            raise InputError(f"{where}: question must be a non-empty string")
        kind = record.get("type")
        if kind is not None and (not isinstance(kind, str) or not kind.strip()):
            raise InputError(f"{where}: type must be a non-empty string where given")
        image = Path(str(record["image"]))
        image = (image if image.is_absolute() else path.parent / image).resolve()
        if not image.is_file():
            raise InputError(f"{where}: image {image} not found")
        key = str(image)
        if key not in image_digests:
            image_digests[key] = hashlib.sha256(image.read_bytes()).hexdigest()
        digest = hashlib.sha256(json.dumps([image_digests[key], record["question"], list(answers)]).encode()
                                ).hexdigest()[:32]
        samples.append(Sample(len(samples), key, record["question"], tuple(answers), digest,
                              kind.strip() if kind is not None else None))
    if not samples:
        raise InputError(f"--dataset {path}: no samples in it")
    return samples


def by_image(samples: list[Sample], size: int) -> list[list[Sample]]:
    """Chunks of at most `size` samples that keep an image's questions together where they fit: a worker runs the
    tower once per image of a chunk."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    chunks: list[list[Sample]] = []
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.image, []).append(s)
    current: list[Sample] = []
    for group in groups.values():
        if current and len(current) + len(group) > size:
            chunks.append(current)
            current = []
        current = current + group
        while len(current) > size:
            chunks.append(current[:size])
            current = current[size:]
    if current:
        chunks.append(current)
    return chunks
