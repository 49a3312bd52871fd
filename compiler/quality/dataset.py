"""Datasets for `eval --dataset`: JSON Lines, one {"image", "question", "answers"} object a line.

`image` is a path, relative to the file's own folder unless absolute; `answers` a list of
accepted answers (a string is one answer). A row may name a `video` instead of an `image`: a
folder of frames (name order) or a video file, as `run --video` reads one; a dataset is all
images or all clips, since one sweep compiles its bundles for one input (a clip's F frames, or
an image). `--dataset DIR` reads DIR/questions.jsonl. An `id` is optional, and so is a `type` (a short
name such as "count" or "color"): eval reports accuracy per type beside the overall figure.
Each sample has a digest of
its image bytes (a clip's: every frame file's name and bytes, or the video file's bytes), question and answers: the store keys cells by it, so an edited sample or a
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
    video: bool = False  # `image` names a clip (a folder of frames or a video file), not an image


QUESTIONS = "questions.jsonl"  # what --dataset DIR reads


def dataset_file(path: str | Path) -> Path:
    """--dataset FILE, or DIR holding questions.jsonl."""
    path = Path(path)
    if path.is_dir():
        if not (path / QUESTIONS).is_file():
            raise InputError(f"--dataset {path}: a folder without {QUESTIONS} (JSON Lines of image or video, "
                             "question, answers)")
        return path / QUESTIONS
    return path


def _bytes_digest(path: Path) -> str:
    """An image's or video file's bytes; a folder of frames: each frame file's name and bytes, in name order."""
    from vlmprune.compiler.frontend.video import FRAME_SUFFIXES

    digest = hashlib.sha256()
    if path.is_dir():
        for frame in sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES):
            digest.update(frame.name.encode() + b"\0" + hashlib.sha256(frame.read_bytes()).digest())
        return "clip:" + digest.hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_dataset(path: str | Path, limit: int | None = None) -> list[Sample]:
    """The first `limit` samples of a JSON Lines dataset (all without a limit), each checked; one line for bad input."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"--limit must be an integer >= 1, got {limit!r}")
    path = dataset_file(path)
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
        if "image" in record and "video" in record:
            raise InputError(f"{where}: names both an image and a video; a row takes one")
        video = "video" in record
        missing = [k for k in ("video" if video else "image", "question", "answers") if k not in record]
        if missing:
            raise InputError(f"{where}: missing {', '.join(missing)}")
        if samples and samples[0].video != video:
            raise InputError(f"{where}: a {'video' if video else 'image'} among "
                             f"{'videos' if samples[0].video else 'images'}; a dataset is all images or all "
                             "videos (its bundles take one kind of input)")
        answers = record["answers"]
        answers = (answers,) if isinstance(answers, str) else answers
        if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
            raise InputError(f"{where}: answers must be a string or a non-empty list of strings")
        if not isinstance(record["question"], str) or not record["question"].strip():
            raise InputError(f"{where}: question must be a non-empty string")
        kind = record.get("type")
        if kind is not None and (not isinstance(kind, str) or not kind.strip()):
            raise InputError(f"{where}: type must be a non-empty string where given")
        image = Path(str(record["video" if video else "image"]))
        image = (image if image.is_absolute() else path.parent / image).resolve()
        if not (image.is_file() or (video and image.is_dir())):
            raise InputError(f"{where}: {'video' if video else 'image'} {image} not found")
        key = str(image)
        if key not in image_digests:
            image_digests[key] = _bytes_digest(image)
        digest = hashlib.sha256(json.dumps([image_digests[key], record["question"], list(answers)]).encode()
                                ).hexdigest()[:32]
        samples.append(Sample(len(samples), key, record["question"], tuple(answers), digest,
                              kind.strip() if kind is not None else None, video))
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


def write_video_dataset(folder: str | Path, clips: int = 3, frames: int = 8, size: int = 112, seed: int = 0,
                        file_clips: int = 0) -> Path:
    """A small video dataset made here, for `eval --dataset` on a video bundle: `clips` seeded clips
    (frontend.video.seeded_clip: a square of a drawn colour moving one way over a photograph, a scene cut), each
    asked the square's colour and its direction, with the answers its seed drew (types "color", "direction").
    Clips are folders of PNG frames; the last `file_clips` are GIF files instead (the video-file path, as imageio
    reads it). Returns folder/questions.jsonl, which `--dataset folder` reads."""
    from PIL import Image

    from vlmprune.compiler.frontend.video import seeded_clip, write_frames

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(clips):
        clip, facts = seeded_clip(seed + i, frames, size)
        if i >= clips - file_clips:
            name = f"clip{i}.gif"
            first, *rest = (Image.fromarray(f) for f in clip)
            first.save(folder / name, save_all=True, append_images=rest, duration=100, loop=0)
        else:
            name = f"clip{i}"
            write_frames(clip, folder / name)
        lines.append({"video": name, "question": "what color is the moving square?", "answers": [facts["color"]],
                      "type": "color"})
        lines.append({"video": name, "question": "which way does the square move?", "answers": [facts["direction"]],
                      "type": "direction"})
    path = folder / QUESTIONS
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path
