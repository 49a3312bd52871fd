"""Bundles: one directory per compile, written atomically, verified before use.

The directory is assembled in a temporary sibling and renamed into place at the
end, so an interrupted or failed compile never leaves a half-written bundle. Every
file's sha256 is recorded in manifest.json and checked before anything from the
bundle is loaded (models, custom-op libraries).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from vlmprune.compiler.errors import InputError

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_output(output: Path, force: bool) -> None:
    """Fail early, with one line, if the bundle cannot be written where asked."""
    if output.exists() and not force:
        raise InputError(f"{output} already exists (use --force to replace it)")
    if output.exists() and not output.is_dir():
        raise InputError(f"{output} exists and is not a directory")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.exists():
        raise InputError(f"{parent}: parent directory does not exist")
    if not parent.is_dir():
        raise InputError(f"{parent}: not a directory")
    # os.access says yes to root everywhere; creating something is the real test.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".probe", dir=parent))
    except OSError as exc:
        raise InputError(f"{parent}: directory is not writable ({exc.strerror})") from None


@contextlib.contextmanager
def staging(output: Path, force: bool):
    """Yield a temporary directory beside output; rename it into place on success."""
    prepare_output(output, force)
    parent = output.parent if str(output.parent) else Path(".")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise InputError(f"{parent}: cannot create a directory there ({exc.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 is not what a bundle should end up with
    try:
        yield tmp
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=parent))
            os.replace(output, old / output.name)
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(bundle_dir: Path, manifest: dict) -> dict:
    """Record every file's sha256 (the manifest itself excepted) and write manifest.json."""
    files = {}
    for path in sorted(p for p in bundle_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(path.relative_to(bundle_dir))] = sha256_file(path)
    manifest = {**manifest, "files": files}
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_manifest(bundle_dir: Path, verify: bool = True) -> dict:
    """Read manifest.json; with verify, refuse a bundle whose files do not match it."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not bundle_dir.is_dir():
        raise InputError(f"{bundle_dir}: no such bundle directory")
    if not path.is_file():
        raise InputError(f"{bundle_dir}: not a vlmprune bundle (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg})") from None
    if verify:
        for name, expected in manifest.get("files", {}).items():
            file = bundle_dir / name
            if not file.is_file():
                raise InputError(f"{bundle_dir}: {name} is listed in the manifest but missing")
            if sha256_file(file) != expected:
                raise InputError(f"{bundle_dir}: {name} does not match its sha256 in the manifest; refusing to load it")
    return manifest
