"""Bundles: one directory per compile, claimed once, published atomically, verified before use.

A compile claims its output by creating the staging directory `.NAME.partial` beside
it (mkdir is atomic: exactly one writer wins) and holds an exclusive lock on a file
inside it while it writes. A second writer finds the staging directory, tries the
lock, and refuses in one line while the first is alive; a staging directory whose
lock is free was left by a writer that died, and is reclaimed. The finished bundle
is renamed into place, so an interrupted or failed compile never leaves a half-written
bundle, and `--force` replaces only a complete bundle (one with a manifest), never a
directory that is something else. An empty directory is taken as the output (as build
tools take a `mkdir build`): the bundle is staged inside it (`.vlmprune-partial`) and its
files are moved into it, manifest.json last, since an empty directory may be a mount point
(a tmpfs, a USB stick, a container volume) that no rename can replace or cross into; the
same holds for a bundle at a mount point that --force replaces. Missing parents are created
(removed again on failure). Writability of where the files go is checked before any work.

Every file's sha256 is recorded in manifest.json, and the manifest records the digest
of its own content, so an edited manifest (keep changed by hand, a file list trimmed)
is caught like an edited model: nothing is loaded from a bundle that does not match.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

# The manifest and its digests are manifest.py's, below this module; sha256_file is the cache's too (pipeline.cache).
from vlmprune.compiler.bundle.manifest import DIGEST_KEY, Manifest, manifest_digest, sha256_file
from vlmprune.compiler.contract import MANIFEST
from vlmprune.compiler.errors import FORCE, InputError, option

_LOCK = ".vlmprune-writing"
_OURS = ".vlmprune-"  # names of this module's own entries inside an output directory it publishes into
_INTO = _OURS + "partial"
_complete: list[str] | None = None  # while tracking(): the outputs complete so far, as the interrupt line names them


def _parent(output: Path) -> Path:
    return output.parent if str(output.parent) else Path(".")


def _is_bundle(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def check_parent(path: Path, label: str) -> None:
    """One line unless path's parent exists or can be made: the nearest folder above it that exists must be
    a directory one can create things in."""
    base = Path(path).parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise InputError(f"{label}: {base} is not a directory")
    # os.access says yes to root everywhere; creating something is the real test.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{Path(path).name}.", suffix=".probe", dir=base))
    except OSError as exc:
        raise InputError(f"{label}: {base} is not writable ({exc.strerror})") from None


@contextlib.contextmanager
def parents_made(path: Path):
    """Create path's missing parent folders; if the block fails or is interrupted, remove the ones made here."""
    missing, folder = [], Path(path).parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # made meanwhile by another writer: not ours to remove
            except OSError as exc:
                raise InputError(f"{folder}: cannot create the directory ({exc.strerror})") from None
            made.append(folder)
        yield
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # rmdir: only while empty, so another writer's output stays
                folder.rmdir()
        raise


@contextlib.contextmanager
def tracking(complete: list[str]):
    """Within one command, append each output to complete once it is whole (bundle.staging, write_file)."""
    global _complete
    outer, _complete = _complete, complete
    try:
        yield complete
    finally:
        _complete = outer


def record_complete(what: str) -> None:
    if _complete is not None:
        _complete.append(what)


class Resumable(str):
    """A partial result an interrupted command keeps for a rerun to resume from (eval --dataset's stored cells),
    recorded as a whole clause: the interrupt line says it after the outputs that are complete."""


class Several(str):
    """One phrase for several outputs (`7 bundles under DIR`): the interrupt line says `are complete` after it."""


@contextlib.contextmanager
def summarised(phrase):
    """Within the block, the outputs made are counted rather than listed; on leaving it, however it ends, one
    phrase for them all (phrase(list of what was recorded) -> str) is recorded instead, so that a command that
    makes many bundles (eval --dataset) has a short interrupt line."""
    made: list[str] = []
    try:
        with tracking(made):
            yield made
    finally:
        if made:
            record_complete(phrase(made) if len(made) == 1 else Several(phrase(made)))


def interrupted_line(complete: list[str]) -> str:
    """What an interrupted command says: nothing was written, or which outputs are complete and what a rerun
    resumes from."""
    outputs = [c for c in complete if not isinstance(c, Resumable)]
    kept = [str(c) for c in complete if isinstance(c, Resumable)]
    if not outputs and not kept:
        return "interrupted; nothing was written"
    several = len(outputs) > 1 or any(isinstance(c, Several) for c in outputs)
    said = [f"{' and '.join(outputs)} {'are' if several else 'is'} complete"] if outputs else []
    return "interrupted; " + "; ".join(said + kept)


def _is_empty_dir(path: Path) -> bool:
    """An empty directory, or one holding only a compile's staging (that compile's claim decides)."""
    return path.is_dir() and not any(not p.name.startswith(_OURS) for p in path.iterdir())


def is_mount_point(path: Path) -> bool:
    """A mount point, bind mounts on the same file system included (os.path.ismount misses those)."""
    if os.path.ismount(path):
        return True
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            points = {line.split()[4].encode().decode("unicode_escape") for line in f if len(line.split()) > 4}
    except OSError:
        return False
    return real in points


def _publishes_into(output: Path, force: bool) -> bool:
    """Whether output's files are moved into it rather than the bundle renamed onto it: an empty directory, or a
    bundle at a mount point that --force replaces (a rename onto a mount point fails: EBUSY)."""
    return output.is_dir() and (_is_empty_dir(output) or (force and _is_bundle(output) and is_mount_point(output)))


def _not_a_bundle(output: Path) -> InputError:
    return InputError(f"{output} exists and is not a vlmprune bundle (no {MANIFEST}), and {FORCE} replaces only a "
                      f"bundle: choose another {option('-o', 'output')} or remove it")


def prepare_output(output: Path, force: bool) -> None:
    """Fail early, with one line, if the bundle cannot be written where asked."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise InputError(f"{output} exists and is not a directory")
    if output.exists() and not _is_bundle(output) and not _is_empty_dir(output):
        raise _not_a_bundle(output)
    if _is_bundle(output) and not force:
        raise InputError(f"{output} already exists (use {FORCE} to replace it)")
    if _publishes_into(output, force):  # the files go into output itself: it must take them
        try:
            os.rmdir(tempfile.mkdtemp(prefix=_OURS, suffix=".probe", dir=output))
        except OSError as exc:
            raise InputError(f"{output} is not writable ({exc.strerror})") from None
    else:
        check_parent(output, str(output))


def _claim(staging: Path, output: Path) -> int:
    """Make staging exist, locked by us; return the lock's descriptor. One line if another writer holds it.

    The directory is assembled privately with its lock held, then renamed to the staging
    name: a rename onto a non-empty directory fails, so exactly one writer gets the name,
    and nobody ever sees the staging directory unlocked while its writer is alive.
    """
    parent = staging.parent
    try:
        private = Path(tempfile.mkdtemp(prefix=f"{staging.name}.", suffix=".claim", dir=parent))
    except OSError as exc:
        raise InputError(f"{parent}: cannot create a directory there ({exc.strerror})") from None
    fd = os.open(private / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        for _attempt in range(3):
            try:
                os.rename(private, staging)
                return fd
            except OSError:
                if not staging.exists():
                    continue
            if not _reclaim_if_dead(staging):
                raise InputError(f"{output} is being written by another vlmprune compile; "
                                 "wait for it to finish or choose another --output")
        raise InputError(f"{output} is being written by another vlmprune compile")
    except BaseException:
        os.close(fd)
        shutil.rmtree(private, ignore_errors=True)
        raise


def _reclaim_if_dead(staging: Path) -> bool:
    """True if staging was left by a writer that died (its lock is free); it is then moved away and removed."""
    try:
        fd = os.open(staging / _LOCK, os.O_RDWR)
    except FileNotFoundError:
        return not staging.exists()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:  # still holding its lock, so no other prober can decide the same
        stale = Path(tempfile.mkdtemp(prefix=f"{staging.name}.", suffix=".stale", dir=staging.parent))
        os.replace(staging, stale / "bundle")
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        os.close(fd)
    return True


@contextlib.contextmanager
def staging(output: Path, force: bool):
    """Claim output, yield its staging directory, and publish it in place on success.

    The claim is made on entry, before any work, so a second writer fails at once;
    on an exception nothing is published and the staging directory is removed (while
    its lock is still held, so no other writer can be reclaiming it at the same time).
    """
    output = Path(output)
    prepare_output(output, force)
    into = _publishes_into(output, force)
    with parents_made(output):
        tmp = output / _INTO if into else _parent(output) / f".{output.name}.partial"
        fd = _claim(tmp, output)
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 is not what a bundle should end up with
            yield tmp
            if into:
                _publish_into(tmp, output)
                shutil.rmtree(tmp, ignore_errors=True)  # the lock file is all that is left of it
            else:
                _publish(tmp, output, force)
            record_complete(f"the bundle at {output}")
            (output / _LOCK).unlink(missing_ok=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(fd)


def _publish(tmp: Path, output: Path, force: bool) -> None:
    if not output.exists() or _is_empty_dir(output):
        try:
            os.rename(tmp, output)  # a rename replaces an empty directory, and fails on a non-empty one
            return
        except OSError:
            if not output.exists() or _is_empty_dir(output):
                raise
    # Only this writer holds the claim, but the directory may have changed since the start.
    if not _is_bundle(output):
        raise _not_a_bundle(output)
    if not force:
        raise InputError(f"{output} appeared while compiling (use {FORCE} to replace it)")
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=_parent(output)))
    os.replace(output, old / output.name)
    os.rename(tmp, output)
    shutil.rmtree(old, ignore_errors=True)


def _publish_into(tmp: Path, output: Path) -> None:
    """Move the staged files into output (manifest.json last, so output is a bundle only once it is whole); a
    bundle already there (--force at a mount point) is moved aside first, manifest first, and removed after. On
    failure the moved files go and the old bundle comes back."""
    theirs = [p for p in output.iterdir() if not p.name.startswith(_OURS)]
    if theirs and not _is_bundle(output):  # changed since the start
        raise _not_a_bundle(output)
    old = Path(tempfile.mkdtemp(prefix=_OURS, suffix=".old", dir=output)) if theirs else None
    aside, moved = [], []
    try:
        for p in sorted(theirs, key=lambda p: p.name != MANIFEST):  # manifest first: no longer a bundle
            p.rename(old / p.name)
            aside.append(p.name)
        for p in sorted((p for p in tmp.iterdir() if p.name != _LOCK), key=lambda p: p.name == MANIFEST):
            p.rename(output / p.name)
            moved.append(p.name)
    except BaseException:
        for name in moved:
            target = output / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink(missing_ok=True)
        for name in reversed(aside):
            (old / name).rename(output / name)
        if old is not None:
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(bundle_dir: Path, manifest: Manifest):
    """Record every file's sha256 (the manifest itself excepted), then the manifest's own digest; the Manifest."""
    files = {}
    for path in sorted(p for p in bundle_dir.rglob("*") if p.is_file() and p.name not in (MANIFEST, _LOCK)):
        files[str(path.relative_to(bundle_dir))] = sha256_file(path)
    manifest = Manifest({k: v for k, v in manifest.items() if k != DIGEST_KEY}).extended(files=files)
    manifest = manifest.extended(**{DIGEST_KEY: manifest_digest(manifest)})
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def source_of(manifest: Manifest, model: str | None = None, how: str = "pass --model PATH") -> str:
    """The model to load for a bundle: model where given (its source moved; the content hash is still compared
    after loading), else the recorded source, which must still be where it was compiled from."""
    recorded = manifest.model.source
    spec = recorded if model is None else str(model)
    if spec == recorded and manifest.model.kind != "preset" and not Path(spec).exists():
        raise InputError(f"the bundle's source {spec} was not found (moved?); {how}")
    return spec


def load_manifest(bundle_dir: Path, verify: bool = True):
    """Manifest.load: read manifest.json; with verify, refuse a bundle whose manifest or files were modified."""
    return Manifest.load(bundle_dir, verify)
