#!/usr/bin/env python
"""easy-vqa's questions as the JSONL `vlmprune eval --dataset` reads: one object a line.

    python tools/easyvqa_jsonl.py --split test -o test.jsonl [--force]

Each line: {"id": "test-000123", "image": the PNG's absolute path, "question": ..., "answers": [answer]},
in easy-vqa's own order (grouped by image), so `--limit N` and tools/train_easyvqa.py's test subset
take the same first N questions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

SPLITS = ("train", "test")


def records(split: str) -> list[dict]:
    """The split's questions, in easy-vqa's order."""
    import easy_vqa

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    questions, answers, image_ids = getattr(easy_vqa, f"get_{split}_questions")()
    paths = getattr(easy_vqa, f"get_{split}_image_paths")()
    return [{"id": f"{split}-{n:06d}", "image": str(Path(paths[i]).resolve()), "question": q, "answers": [a]}
            for n, (q, a, i) in enumerate(zip(questions, answers, image_ids))]


def write_jsonl(split: str, out: Path, force: bool = False) -> int:
    """Write the split to out atomically (a temporary file renamed into place); the number of lines.

    Raises FileExistsError where out exists and force is not given."""
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    rows = records(split)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=SPLITS, required=True)
    parser.add_argument("-o", "--output", required=True, type=Path)
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(argv)
    try:
        n = write_jsonl(args.split, args.output, args.force)
    except (FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {n} {args.split} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
