"""Single-file outputs (pictures, reports, .npz): checked before any work, written whole or not at all.

The same promise bundles make (compiler.bundle), for one file: an existing file is
replaced only with --force, a directory never; the bytes go to a temporary file beside
the target and are renamed into place, so a reader never sees half a PNG or half a report,
and an interrupted run leaves nothing behind. Without --force the rename is a hard link
(fails if the name exists), so two writers cannot both claim a fresh name.

Missing parent folders are created, as build tools do, and removed again if the write fails
or is interrupted (bundle.parents_made, shared with bundles); each file is recorded once it
is complete, for the interrupt line (bundle.interrupted_line).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vlmprune.compiler.bundle import check_parent, parents_made, record_complete
from vlmprune.compiler.errors import FORCE, InputError


def check_output_file(path: Path, force: bool, suffixes: tuple[str, ...], flag: str) -> Path:
    """One line if path cannot be written as asked (wrong suffix, exists without --force, no parent).

    flag: the option that named path, as compiler.errors.option() spells it for both surfaces."""
    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise InputError(f"{flag} {path}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory")
    if path.exists() and not force:
        raise InputError(f"{flag} {path} already exists (use {FORCE} to replace it)")
    check_parent(path, f"{flag} {path}")
    return path


def write_file(path: Path, data: bytes, force: bool) -> None:
    """Write data to path atomically (making missing parents); refuse to replace an existing file unless force."""
    path = Path(path)
    with parents_made(path):
        _write_file(path, data, force)
    record_complete(str(path))


def _write_file(path: Path, data: bytes, force: bool) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=parent)
    except OSError as exc:
        raise InputError(f"{path}: cannot write there ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        if force:
            if path.is_dir():
                raise InputError(f"{path}: is a directory")
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise InputError(f"{path} already exists (use {FORCE} to replace it)") from None
            os.unlink(tmp)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
