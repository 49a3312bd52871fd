"""The source, the tests and the documentation say what is meant in the project's own terms.

A docstring, a comment or a guide that points at a tracker number or an internal work item ("the rule of
<tracker item>, part 3") says nothing to a reader who has neither: the rule is written out where it applies.
User-facing text is held to the same by tests/compiler/test_cli.py; this covers every file of the checkout's
packages, tests, tools and docs.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("compiler", "passes", "targets", "kernels", "tests", "tools", "docs")
SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".yml", ".yaml"}
# Spelled in pieces, so that this file does not match itself.
INTERNAL = re.compile(r"\b" + "iss" + r"ue #?\d+\b|\b" + "se" + r"ed \d{3}\b", re.I)


def internal_references(text: str) -> list[str]:
    """The tracker numbers and work-item names in text."""
    return [m.group(0) for m in INTERNAL.finditer(text)]


def test_the_scan_finds_tracker_numbers_and_work_items():
    sample = " ".join(["as", "Iss" + "ue 33 §2", "says;", "se" + "ed 001's", "stage;", "see", "iss" + "ue #12"])
    assert internal_references(sample) == ["Iss" + "ue 33", "se" + "ed 001", "iss" + "ue #12"]
    assert internal_references("a fixed seed 0, seeds 1-3, the issues a user files, seed 12") == []


def test_no_file_points_at_a_tracker_number_or_a_work_item():
    files = [REPO / "README.md"] + [p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*"))
                                    if p.suffix in SUFFIXES and p.is_file()]
    found = [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for path in files for text in [path.read_text(errors="replace")] for m in INTERNAL.finditer(text)]
    assert not found, "say what is meant instead of where it was asked for:\n" + "\n".join(found)
