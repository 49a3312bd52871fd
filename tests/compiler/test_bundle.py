"""Bundles: claimed once, published atomically, --force only over a complete bundle, manifest covered."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlmprune.compiler import bundle
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.bundle.manifest import SECTIONS

# The least a manifest holds to load: every section, empty.
EMPTY = {"vlmprune_version": "test", **{key: kind() for key, kind in SECTIONS.items()}}


def _write_bundle(out, force=False, files=None):
    with bundle.staging(out, force) as tmp:
        for name, text in (files or {"model.onnx": "graph"}).items():
            (tmp / name).write_text(text)
        bundle.write_manifest(tmp, EMPTY)
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
        bundle.write_manifest(tmp, EMPTY)
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


def test_missing_parents_are_made_and_removed_again_on_failure(tmp_path):
    out = _write_bundle(tmp_path / "build" / "nested" / "b")
    bundle.load_manifest(out)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with bundle.staging(tmp_path / "fresh" / "sub" / "b", False) as tmp:
                (tmp / "x").write_text("x")
                raise exc
        assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # fresh/sub made, then removed
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError) as info:
        _write_bundle(blocker / "sub" / "b")
    assert str(info.value) == f"{blocker}/sub/b: {blocker} is not a directory"


def test_parents_made_are_removed_when_the_write_fails_or_is_interrupted(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with bundle.parents_made(kept / "a" / "b" / "r.json"):
                assert (kept / "a" / "b").is_dir()
                raise exc
        assert list(kept.iterdir()) == []  # the folders it made are gone, the one that was there stays
    with pytest.raises(RuntimeError):
        with bundle.parents_made(kept / "a" / "r.json"):
            (kept / "a" / "someone-elses").write_text("x")
            raise RuntimeError("boom")
    assert (kept / "a" / "someone-elses").is_file()  # a folder another writer filled meanwhile is not removed


def test_a_directory_that_is_not_a_bundle_is_refused_with_and_without_force(tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_text("precious")
    expected = (f"{other} exists and is not a vlmprune bundle (no manifest.json), and force=True replaces only a "
                "bundle: choose another output or remove it")
    for force in (False, True):
        with pytest.raises(InputError) as info:
            _write_bundle(other, force=force)
        assert str(info.value) == expected
    assert [p.name for p in other.iterdir()] == ["cat.jpg"]
    empty = tmp_path / "empty"
    empty.mkdir()  # as a `mkdir build` before a build: taken as the output
    _write_bundle(empty)
    assert sorted(p.name for p in empty.iterdir()) == ["manifest.json", "model.onnx"]
    with pytest.raises(InputError, match=r"already exists \(use force=True to replace it\)"):
        _write_bundle(empty)


def test_an_interrupt_after_publishing_says_the_bundle_is_complete(tiny_clip_dir, tmp_path):
    """compile_model's progress callback is where Ctrl-C lands between steps: after the bundle is renamed into
    place, the interrupt line says it is complete; before, that nothing was written (and nothing is)."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    def interrupt_at(step):
        def progress(message):  # a line, or a parity stage's record (pipeline.run_parity sends data)
            if isinstance(message, str) and step in message:
                raise KeyboardInterrupt
        return progress

    out = tmp_path / "made" / "b"
    for step, line in (("parity", "interrupted; nothing was written"),
                       ("bundle written", f"interrupted; the bundle at {out} is complete")):
        complete: list[str] = []
        with pytest.raises(KeyboardInterrupt):
            with bundle.tracking(complete):
                compile_model(str(tiny_clip_dir), out, CompileOptions(keep=8), interrupt_at(step))
        assert bundle.interrupted_line(complete) == line
        assert out.exists() == bool(complete) and tmp_path.exists()
        assert list(tmp_path.iterdir()) == ([out.parent] if complete else [])  # made/ removed when nothing was
    assert bundle.load_manifest(out)["parity"]["passed"]  # whole, as the line says
    assert sorted(p.name for p in out.parent.iterdir()) == ["b"]


@pytest.fixture
def mount_point(tmp_path):
    """An empty tmpfs mounted at tmp_path/mnt (read-write), and how to remount it read-only; a skip where this
    process may not mount (not root, or a container without CAP_SYS_ADMIN)."""
    point = tmp_path / "mnt"
    point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(point)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): the mount-point output "
                    "case needs one")

    def read_only():
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)

    yield point, read_only
    subprocess.run(["umount", str(point)], check=True)


def test_an_empty_mount_point_is_published_into(mount_point):
    """-o MNT on an empty mount point: the rename onto it failed with EBUSY after all the work."""
    point, _ = mount_point
    assert bundle.is_mount_point(point)
    _write_bundle(point, files={"model.onnx": "first"})
    assert sorted(p.name for p in point.iterdir()) == ["manifest.json", "model.onnx"]  # no staging left
    assert bundle.load_manifest(point)["files"]
    with pytest.raises(InputError, match="already exists"):
        _write_bundle(point)
    _write_bundle(point, force=True, files={"model.onnx": "second"})  # --force replaces it in place
    assert (point / "model.onnx").read_text() == "second"
    assert sorted(p.name for p in point.iterdir()) == ["manifest.json", "model.onnx"]


def test_a_failed_compile_into_an_empty_directory_leaves_it_empty(tmp_path):
    out = tmp_path / "build"
    out.mkdir()
    with pytest.raises(RuntimeError):
        with bundle.staging(out, False) as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError("boom")
    assert list(out.iterdir()) == [] and out.is_dir()
    with bundle.staging(out, False) as tmp:  # a second writer while the first stages inside it: refused
        with pytest.raises(InputError, match="being written by another vlmprune compile"):
            with bundle.staging(out, False):
                pass
        bundle.write_manifest(tmp, EMPTY)
    bundle.load_manifest(out)


def test_an_empty_read_only_mount_point_is_refused_before_any_work(mount_point):
    point, read_only = mount_point
    read_only()
    with pytest.raises(InputError, match=r"mnt is not writable \(Read-only file system\)"):
        bundle.prepare_output(point, False)


def test_summarised_outputs_and_resumable_results_make_one_short_interrupt_line():
    """Eval's interrupt once listed every bundle it had compiled in one run-on line; a summarised block says
    them in one phrase, and what a rerun resumes from comes after the outputs that are complete."""
    complete: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with bundle.tracking(complete):
            with bundle.summarised(lambda made: f"{len(made)} bundles under /q"):
                for i in range(7):
                    bundle.record_complete(f"the bundle at /q/{i}")
                raise KeyboardInterrupt
    assert complete == ["7 bundles under /q"]
    complete.append(bundle.Resumable("54 of 90 cells are stored in s.sqlite: a rerun resumes from them"))
    assert bundle.interrupted_line(complete) == ("interrupted; 7 bundles under /q are complete; 54 of 90 cells are "
                                                 "stored in s.sqlite: a rerun resumes from them")
    assert bundle.interrupted_line(complete[1:]) == ("interrupted; 54 of 90 cells are stored in s.sqlite: a rerun "
                                                     "resumes from them")
    with bundle.summarised(lambda made: "never"):
        pass
    assert bundle.interrupted_line([]) == "interrupted; nothing was written"
