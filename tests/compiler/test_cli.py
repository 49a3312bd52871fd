"""The CLI end to end with click's CliRunner: the happy path and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmprune.compiler.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _assert_one_line_error(result, needle):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output


def _no_partial(parent: Path):
    assert not [p for p in parent.iterdir() if p.name.endswith(".partial") or p.name.endswith(".old")]


def test_compile_json_summary_and_bundle(tiny_llava_dir, tmp_path):
    out = tmp_path / "b"
    result = _run("compile", tiny_llava_dir, "--keep", 16, "--layer", 1, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["parity"]["passed"] is True
    assert summary["method"]["tokens_out"] == 18
    features = next(o for o in summary["outputs"] if o["name"] == "image_features")
    assert features["shape"][1:] == [17, 48]  # K + summary tokens, projected to the LLM width
    assert {"manifest.json", "model.onnx", "model.decomposed.onnx", "parity.json", "README.md"} <= {
        p.name for p in out.iterdir()}


def test_check_inspect_run_on_demo(demo_bundle, tmp_path):
    bundle = demo_bundle.bundle
    result = _run("check", bundle, "--batch", 3, "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and {s["stage"] for s in report["stages"]} == {"export", "rewritten", "fused"}
    assert all(s["indices"]["agreement"] == 1.0 for s in report["stages"] if s["indices"])
    result = _run("inspect", bundle)
    assert result.exit_code == 0 and "after block 2/5" in result.output and "sha256" in result.output
    from skimage import data
    from PIL import Image

    img = tmp_path / "cat.png"
    Image.fromarray(data.chelsea()).save(img)
    result = _run("run", bundle, "--image", img)
    assert result.exit_code == 0, result.output
    assert "image_features: shape [1, 193, 256]" in result.output
    assert len(result.output.split("kept (image 0): ")[1].split()) == 192


def test_check_refuses_tampered_bundle(demo_bundle, tmp_path):
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(demo_bundle.bundle, copy)
    with open(copy / "model.onnx", "ab") as f:
        f.write(b"\0")
    _assert_one_line_error(_run("check", copy), "does not match its sha256")


def test_targets_lists_availability():
    from vlmprune.targets import TARGETS

    result = _run("targets")
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines()[: len(TARGETS)]}
    assert list(lines) == list(TARGETS)
    for name, cls in TARGETS.items():
        ok, why = cls().available()
        status = lines[name].split(None, 1)[1]
        assert status.startswith("available ") if ok else status.startswith(f"unavailable: {why[:20]}"), lines[name]
    llm = result.output.split("--with-llm (the language model):\n", 1)[1].splitlines()
    assert [line.split()[0] for line in llm] == ["ort", "ort", "orin", "xavier", "rk3588", "qnn"]
    assert "not supported" in llm[3] and "TensorRT Edge-LLM 0.11.0 exporter" in llm[2]


@pytest.mark.parametrize("args,needle", [
    (["--keep", 0], "--keep must be an integer >= 1"),
    (["--keep", 64], "keep must satisfy 1 <= keep < 64"),
    (["--target", "nope"], "unknown target 'nope'"),
    (["--layer", 9], "--layer 9 is out of range"),
    (["--layer", 0], "--layer counts blocks from 1"),
])
def test_bad_options(tiny_llava_dir, tmp_path, args, needle):
    out = tmp_path / "b"
    _assert_one_line_error(_run("compile", tiny_llava_dir, "-o", out, *args), needle)
    assert not out.exists()
    _no_partial(tmp_path)


def test_missing_path(tmp_path):
    _assert_one_line_error(_run("compile", tmp_path / "nothing", "-o", tmp_path / "b"), "no such file or directory")


def test_corrupt_onnx(tmp_path):
    bad = tmp_path / "tower.onnx"
    bad.write_bytes(b"this is not a protobuf")
    _assert_one_line_error(_run("compile", bad, "-o", tmp_path / "b"), "not a readable ONNX model")
    assert not (tmp_path / "b").exists()


def test_tower_without_cls(tiny_siglip_dir, tmp_path):
    _assert_one_line_error(_run("compile", tiny_siglip_dir, "--keep", 8, "-o", tmp_path / "b"), "needs a [CLS] token")


def test_unwritable_output(tiny_llava_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", blocker / "b"), "not a directory")
    # Root ignores permission bits, so use a filesystem nobody can write to.
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", "/proc/vlmprune-bundle"), "not writable")


def test_existing_output_needs_force(tiny_llava_dir, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", out), "already exists")


def test_check_missing_bundle(tmp_path):
    _assert_one_line_error(_run("check", tmp_path), "not a vlmprune bundle")


def test_a_reader_that_leaves_early_is_no_error(demo_bundle):
    """`vlmprune inspect B --ops | head`: the pipe closes before vlmprune writes; that is not a vlmprune bug."""
    import subprocess
    import sys

    code = "from vlmprune.compiler.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "inspect", str(demo_bundle.bundle), "--ops"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even imported vlmprune: the first write meets EPIPE
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err.decode()
    assert b"error" not in err and b"Traceback" not in err, err.decode()
