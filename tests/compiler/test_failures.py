"""Every failure a new user hit: one clear line (exit 2) instead of a traceback, nothing lost or left behind.

Each test drives the real CLI (click's runner, or a subprocess where file descriptors or
concurrency matter) on tiny offline Hugging Face models and ONNX files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from tiny_models import edited_copy
from vlmprune.compiler import bundle
from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import InputError

CLI = [sys.executable, "-m", "vlmprune.compiler.cli"]


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(result, needle: str, code: int = 2):
    output = result.output if hasattr(result, "output") else result.stdout + result.stderr
    rc = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert rc == code, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], output


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# --- 1. one output, one writer ------------------------------------------------------------

def test_two_compiles_into_one_output(tiny_llava_dir, tmp_path):
    """The second compile starts while the first holds its claim (from inside the first's parity step), so the
    race has one outcome: the second process is refused with the one line a live writer's claim gives."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    out = tmp_path / "same"
    second = []

    def start_the_second_while_writing(message):
        if isinstance(message, str) and message.endswith("] parity"):  # a parity stage comes as its record
            cmd = [*CLI, "compile", str(tiny_llava_dir), "--keep", "16", "-o", str(out), "-q"]
            second.append(subprocess.run(cmd, capture_output=True, text=True, timeout=600))

    compile_model(str(tiny_llava_dir), out, CompileOptions(keep=16), start_the_second_while_writing)
    (loser,) = second
    assert loser.returncode == 2 and loser.stdout == "", (loser.stdout, loser.stderr)
    assert loser.stderr.splitlines() == [f"error: {out} is being written by another vlmprune compile; "
                                         "wait for it to finish or choose another --output"], loser.stderr
    assert bundle.load_manifest(out)["parity"]["passed"]  # the first writer's bundle, whole
    assert _leftovers(tmp_path) == []


# --- 2. tracebacks that became one line -----------------------------------------------------

def test_safetensors_that_disagree_with_config(tiny_clip_dir, tmp_path):
    copy = edited_copy(tiny_clip_dir, tmp_path / "clip", lambda config: config.update(intermediate_size=80))
    _one_line_error(_run("compile", copy, "--keep", 8, "-o", tmp_path / "b"), "the checkpoint and config disagree")
    assert not (tmp_path / "b").exists()


def test_truncated_safetensors(tiny_clip_dir, tmp_path):
    copy = tmp_path / "clip"
    shutil.copytree(tiny_clip_dir, copy)
    weights = next(copy.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _one_line_error(_run("compile", copy, "--keep", 8, "-o", tmp_path / "b"), "not a readable safetensors file")
    assert not (tmp_path / "b").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("fixture,key", [
    ("tiny_llava_dir", "vision_tower.encoder.layers.0.self_attn.q_proj.weight"),  # read by vlmprune, by name
    ("tiny_vit_dir", "encoder.layer.0.attention.attention.query.weight"),  # read by transformers' from_pretrained
])
def test_integer_weights_where_the_model_wants_floats(request, tmp_path, fixture, key):
    """A quantized checkpoint without its scales: its int8 weights were cast to float without a word."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "ckpt"
    shutil.copytree(request.getfixturevalue(fixture), copy)
    weights = next(copy.glob("*.safetensors"))
    state = load_file(weights)
    state[key] = (state[key] * 100).to(torch.int8)
    save_file(state, weights, metadata={"format": "pt"})
    result = _run("compile", copy, "--keep", 8, "-o", tmp_path / "b")
    _one_line_error(result, "")
    assert f"error: model.safetensors: tensor {key} has dtype int8; the model expects floating point " \
           "(a quantized checkpoint without its scales?)" in result.output.splitlines()
    assert not (tmp_path / "b").exists() and _leftovers(tmp_path) == []


def test_onnx_with_missing_external_data(elsewhere_onnx, tmp_path):
    model = onnx.load(str(elsewhere_onnx))
    path = tmp_path / "tower.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="tower.weights", size_threshold=0)
    (tmp_path / "tower.weights").unlink()
    _one_line_error(_run("compile", path, "--keep", 8, "-o", tmp_path / "b"), "external data file tower.weights is missing")


def test_run_and_check_refuse_a_batch_the_bundle_cannot_take(tiny_llava_dir, tmp_path):
    from PIL import Image

    out = tmp_path / "b2"
    assert _run("compile", tiny_llava_dir, "--keep", 16, "--batch", 2, "-o", out, "-q").exit_code == 0
    image = tmp_path / "x.png"
    Image.fromarray(np.full((120, 160, 3), 90, np.uint8)).save(image)
    _one_line_error(_run("run", out, "--image", image), "static batch of 2: pass --image 2 times")
    result = _run("run", out, "--image", image, "--image", image)
    assert result.exit_code == 0 and "image_features: shape [2, 17, 48]" in result.output, result.output
    _one_line_error(_run("check", out, "--batch", 3), "static batch of 2; --batch 3 cannot be fed to it")


# --- 3. machine-readable output stays machine-readable --------------------------------------

@pytest.mark.slow  # two processes, each loading the HTP emulator: ~55 s on 2 cores
@pytest.mark.skipif(sys.platform != "linux", reason="the QNN HTP emulator is a Linux x86_64 wheel")
def test_json_on_qnn_is_only_json(qnn_ready, tiny_llava_dir, tmp_path):
    out = tmp_path / "q"
    proc = subprocess.run([*CLI, "compile", str(tiny_llava_dir), "--target", "qnn", "--keep", "16", "-o", str(out),
                           "--json"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parity"]["passed"]  # the HTP library's chatter went to stderr
    proc = subprocess.run([*CLI, "check", str(out), "--json"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passed"]


# --- 4. every numeric option, before any work -------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_lambda_is_validated_before_anything(tmp_path, value):
    # The model does not exist: a check that ran after loading would complain about it instead.
    _one_line_error(_run("compile", tmp_path / "no-model", "--lambda", value, "-o", tmp_path / "b"), "--lambda")


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--opset", "9"], "--opset must be between 17 and 23"),
    (["--target", "ort", "--precision", "int4"], "ort --precision takes fp32 or int8"),
    (["--target", "ort", "--precision", "int8", "--calibration", "/no/such/dir"], "--calibration /no/such/dir: not a"),
    (["--target", "orin", "--precision", "fp8"], "--precision for orin is one of"),
    (["--target", "qnn", "--soc", "SM0000"], "unknown --soc"),
    (["--target", "rk3588", "--batch", "2"], "rk3588 runs batch 1"),
])
def test_other_options_are_validated_before_anything(tmp_path, args, needle):
    _one_line_error(_run("compile", tmp_path / "no-model", *args, "-o", tmp_path / "b"), needle)


# --- 5. an edited manifest is a modified bundle -----------------------------------------------

def test_edited_manifest_is_refused_everywhere(tiny_llava_dir, compiled, tmp_path):
    from PIL import Image

    out = tmp_path / "b"
    shutil.copytree(compiled(tiny_llava_dir, keep=16).bundle, out)  # a copy: the compiled bundle is shared
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["method"]["keep"] = 12
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    image = tmp_path / "x.png"
    Image.new("RGB", (112, 112)).save(image)
    for args in (["check", out], ["inspect", out], ["run", out, "--image", image]):
        _one_line_error(_run(*args), "the bundle was modified")


# --- 6. say how the image is preprocessed -----------------------------------------------------

def test_run_describes_preprocessing_and_warns_on_tiny_images(demo_bundle, tmp_path):
    from PIL import Image

    tiny = tmp_path / "dot.png"
    Image.new("RGB", (1, 1), (200, 10, 10)).save(tiny)
    result = _run("run", demo_bundle.bundle, "--image", tiny)
    assert result.exit_code == 0, result.output
    assert "1x1 image: short side upscaled x336 to 336x336" in result.output
    assert "centre crop 336x336" in result.output and "mean (0.481, 0.458, 0.408)" in result.output
    assert "warning: " in result.output and "upscaled x336" in result.output
    photo = tmp_path / "photo.png"
    Image.new("RGB", (672, 504)).save(photo)
    result = _run("run", demo_bundle.bundle, "--image", photo)
    assert "672x504 image: short side downscaled x0.667 to 448x336" in result.output
    assert "warning" not in result.output


# --- 8. .onnx sources give the same bundle as every other source ------------------------------

@pytest.mark.parametrize("layer", [2, 3])
def test_onnx_sources_have_the_bundle_contract(elsewhere_onnx, tmp_path, layer):
    out = tmp_path / "b"
    result = _run("compile", elsewhere_onnx, "--keep", 20, "--layer", layer, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    manifest = bundle.load_manifest(out)
    outputs = {o["name"]: o["shape"] for o in manifest["outputs"]}
    assert outputs == {"image_features": [1, 21, 32], "kept_indices": [1, 20]}  # [CLS] dropped, like HF sources
    report = json.loads((out / "parity.json").read_text())
    rewritten = next(s for s in report["stages"] if s["stage"] == "rewritten")
    if layer == 3:  # at the tower's end the original graph's rows are the reference: values are checked
        feats = rewritten["outputs"]["image_features"]
        assert feats["passed"] and feats["max_abs"] < 1e-5 and "rows_not_compared" not in feats
    else:
        assert rewritten["outputs"] == {} and rewritten["indices"]["agreement"] == 1.0


def test_onnx_source_keeps_cls_when_asked(elsewhere_onnx, tmp_path):
    out = tmp_path / "b"
    assert _run("compile", elsewhere_onnx, "--keep", 20, "--cls", "keep", "-o", out, "-q").exit_code == 0
    manifest = bundle.load_manifest(out)
    assert manifest["outputs"][0] == {"name": "image_features", "shape": [1, 22, 32], "dtype": "float"}
    assert manifest["compile_options"]["cls"] == "keep"


def test_dynamic_batch_is_named_batch(tiny_dense_path, tmp_path):
    out = tmp_path / "b"
    assert _run("compile", tiny_dense_path, "--keep", 20, "--layer", 2, "-o", out, "-q").exit_code == 0
    manifest = bundle.load_manifest(out)
    assert {io["shape"][0] for io in manifest["inputs"] + manifest["outputs"]} == {"batch"}


# --- 9 and 10. the summary line, and static-batch .onnx towers --------------------------------

def test_summary_at_the_towers_end_and_static_batch_parity(elsewhere_onnx, tmp_path):
    result = _run("compile", elsewhere_onnx, "--keep", 20, "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output
    assert "(at the tower's end, after block 3/3)" in result.output and "later blocks" not in result.output
    report = json.loads((tmp_path / "b" / "parity.json").read_text())
    assert report["inputs"]["chunk"] == 1 and len(report["inputs"]["images"]) == 2  # two images, one at a time
    assert [s["stage"] for s in report["stages"]] == ["rewritten", "fused"] and report["passed"]


def test_check_of_a_static_batch_onnx_bundle(elsewhere_onnx, tmp_path):
    out = tmp_path / "b"
    assert _run("compile", elsewhere_onnx, "--keep", 20, "--layer", 1, "-o", out, "-q").exit_code == 0
    result = _run("check", out)
    assert result.exit_code == 0, result.output


def test_an_empty_output_path_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    """`-o ""` said ". exists and is not a vlmprune bundle"."""
    from vlmprune.compiler import api

    monkeypatch.chdir(tmp_path)
    result = _run("compile", "demo", "-k", "32", "-o", "")
    assert result.exit_code == 2 and "an empty path" in result.output and "Traceback" not in result.output
    with pytest.raises(InputError, match="output is empty"):
        api.compile("demo", "", keep=32)
    assert list(tmp_path.iterdir()) == []


def test_run_prints_the_value_of_a_small_integer_output():
    """`run` on a prumerge+ bundle once printed `num_tokens: shape [1]`, not how many tokens the image kept."""
    from vlmprune.compiler.api import RunResult
    from vlmprune.compiler.cli.render import run_lines

    result = RunResult(Path("b"), "onnxruntime", np.zeros((1, 3, 8, 8), np.float32),
                       {"image_features": np.zeros((1, 65, 4), np.float32), "num_tokens": np.array([57])})
    lines = run_lines(result)
    assert f"num_tokens: shape [1] dtype {np.array([57]).dtype}, value [57]" in lines
    assert "image_features: shape [1, 65, 4] dtype float32" in lines
    assert result.to_json()["outputs"]["num_tokens"]["value"] == [57]
