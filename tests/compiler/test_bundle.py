"""Bundles: claimed once, published atomically, --force only over a complete bundle, manifest covered."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlmprune.compiler import bundle
from vlmprune.compiler.errors import InputError


def _write_bundle(out, force=False, files=None):
    with bundle.staging(out, force) as tmp:
        for name, text in (files or {"model.onnx": "graph"}).items():
            (tmp / name).write_text(text)
        bundle.write_manifest(tmp, {"vlmprune_version": "test"})
    return out


def test_publish_and_verify(tmp_path):
    out = _write_bundle(tmp_path / "b")
    manifest = bundle.load_manifest(out)
    assert manifest["files"] == {"model.onnx": bundle.sha256_file(out / "model.onnx")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no staging, lock or probe left
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx"]


def test_second_writer_is_refused_while_the_first_writes(tmp_path):
    out = tmp_path / "b"
    with bundle.staging(out, False) as tmp:
        (tmp / "model.onnx").write_text("first")
        with pytest.raises(InputError, match="being written by another vlmprune compile"):
            with bundle.staging(out, False):
                pass
        with pytest.raises(InputError, match="being written"):  # --force never replaces one being written
            with bundle.staging(out, True):
                pass
        bundle.write_manifest(tmp, {})
    assert (out / "model.onnx").read_text() == "first"
    bundle.load_manifest(out)


def test_staging_left_by_a_dead_writer_is_reclaimed(tmp_path):
    out = tmp_path / "b"
    stale = tmp_path / ".b.partial"
    stale.mkdir()
    (stale / bundle._LOCK).write_text("")  # nobody holds its lock
    (stale / "junk").write_text("half")
    _write_bundle(out)
    assert not stale.exists() and not (out / "junk").exists()


def test_lock_held_by_another_process_refuses(tmp_path):
    """The lock is an OS lock: a live writer in another process keeps its claim."""
    out = tmp_path / "b"
    staging = tmp_path / ".b.partial"
    staging.mkdir()
    lock = staging / bundle._LOCK
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InputError, match="being written"):
            _write_bundle(out)
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "b"
    with pytest.raises(RuntimeError):
        with bundle.staging(out, False) as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    _write_bundle(out)  # and the name is free again


def test_force_replaces_only_a_complete_bundle(tmp_path):
    out = _write_bundle(tmp_path / "b", files={"model.onnx": "old"})
    _write_bundle(out, force=True, files={"model.onnx": "new"})
    assert (out / "model.onnx").read_text() == "new"
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_text("precious")
    with pytest.raises(InputError, match="not a vlmprune bundle"):
        _write_bundle(other, force=True)
    assert (other / "cat.jpg").read_text() == "precious"
    with pytest.raises(InputError, match="already exists"):
        _write_bundle(out)


def test_edited_manifest_is_caught(tmp_path):
    out = _write_bundle(tmp_path / "b")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["vlmprune_version"] = "edited"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="manifest.json does not match its recorded digest: the bundle was modified"):
        bundle.load_manifest(out)
    (out / "manifest.json").write_text("{ not json")
    with pytest.raises(InputError, match="bundle was modified"):
        bundle.load_manifest(out)
