"""Single-file outputs: missing parents made (or refused up front), and recorded for the interrupt line."""

from __future__ import annotations

import pytest

from vlmprune.compiler.bundle import output_files as of
from vlmprune.compiler.bundle import interrupted_line, tracking
from vlmprune.compiler.errors import InputError


def test_missing_parents_are_made(tmp_path):
    path = tmp_path / "results" / "deep" / "r.json"
    assert of.check_output_file(path, False, (".json",), "--report") == path  # a missing parent is no refusal
    of.write_file(path, b"{}", False)
    assert path.read_bytes() == b"{}"
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temporary left


def test_a_parent_that_cannot_be_made_is_refused_up_front(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError) as info:
        of.check_output_file(blocker / "sub" / "r.json", False, (".json",), "--report")
    assert str(info.value) == f"--report {blocker}/sub/r.json: {blocker} is not a directory"
    with pytest.raises(InputError, match="is not writable"):
        of.check_output_file("/proc/vlmprune/r.json", False, (".json",), "--report")


def test_the_interrupt_line_names_what_is_complete(tmp_path):
    complete: list[str] = []
    assert interrupted_line(complete) == "interrupted; nothing was written"
    with tracking(complete):
        of.write_file(tmp_path / "r.html", b"<html>", False)
        of.write_file(tmp_path / "j.xml", b"<xml/>", False)
    of.write_file(tmp_path / "after.txt", b"", False)  # outside tracking: not this command's
    assert interrupted_line(complete) == f"interrupted; {tmp_path}/r.html and {tmp_path}/j.xml are complete"
