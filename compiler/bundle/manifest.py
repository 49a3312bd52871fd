"""The bundle's manifest.json as a type: load and verify. The typed read-only views of its sections are the
contract's (compiler.contract.Manifest and its sections, re-exported here): every step, the targets and passes
too, reads them without importing this module; `Manifest` here is that type with load and verify.

Every file's sha256 is recorded in the manifest, and the manifest records the digest of its
own content, so an edited manifest (keep changed by hand, a file list trimmed) is caught like
an edited model: nothing is loaded from a bundle that does not match.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vlmprune.compiler.contract import MANIFEST
from vlmprune.compiler.contract import Manifest as ContractManifest
from vlmprune.compiler.contract import (  # the views, re-exported where their readers found them
    KeepAutoSection, LlmSection, MethodSection, ModelSection, ParitySection, PreprocessSection, Section,
    TargetSection, Tensor)
from vlmprune.compiler.errors import InputError

__all__ = ["DIGEST_KEY", "SECTIONS", "KeepAutoSection", "LlmSection", "Manifest", "MethodSection", "ModelSection",
           "ParitySection", "PreprocessSection", "Section", "TargetSection", "Tensor", "manifest_digest", "sha256_file"]

DIGEST_KEY = "manifest_sha256"  # the manifest's digest of its own content (manifest_digest)
# The sections every bundle has, and their JSON type; a manifest without one is refused on load.
SECTIONS = {"target": dict, "model": dict, "method": dict, "inputs": list, "outputs": list, "preprocess": dict,
            "compile_options": dict}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of the manifest's canonical JSON, its own digest field left out."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Manifest(ContractManifest):
    """manifest.json: the typed views (compiler.contract.Manifest), read from a bundle and verified."""

    @classmethod
    def load(cls, bundle_dir: Path, verify: bool = True) -> Manifest:
        """Read manifest.json; with verify, refuse a bundle whose manifest or files were modified."""
        bundle_dir = Path(bundle_dir)
        path = bundle_dir / MANIFEST
        if not bundle_dir.is_dir():
            raise InputError(f"{bundle_dir}: no such bundle directory")
        if not path.is_file():
            raise InputError(f"{bundle_dir}: not a vlmprune bundle (no {MANIFEST})")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)}); the bundle was modified") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: not a vlmprune manifest; the bundle was modified")
        manifest = cls(data)
        if verify:
            manifest.verify(bundle_dir)
        manifest.check_sections(path)
        return manifest

    def verify(self, bundle_dir: Path) -> None:
        """Refuse (one line) a manifest that does not match its own digest, or a file that does not match its sha256."""
        if self.get(DIGEST_KEY) != manifest_digest(self):
            raise InputError(f"{bundle_dir}: {MANIFEST} does not match its recorded digest: the bundle was "
                             "modified after it was compiled; recompile it")
        for name, expected in self.files.items():
            file = Path(bundle_dir) / name
            if not file.is_file():
                raise InputError(f"{bundle_dir}: {name} is listed in the manifest but missing")
            if sha256_file(file) != expected:
                raise InputError(f"{bundle_dir}: {name} does not match its sha256 in the manifest; "
                                 "the bundle was modified; refusing to load it")

    def check_sections(self, path: Path) -> None:
        """One line naming the first section a reader needs that this manifest lacks."""
        for key, kind in SECTIONS.items():
            if not isinstance(self.get(key), kind):
                raise InputError(f"{path}: not a vlmprune manifest (no {key!r} section); "
                                 "the bundle was modified or is not a vlmprune bundle")
