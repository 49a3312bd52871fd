"""`run --benchmark`, `--save-outputs` and `--load-inputs` on a real bundle, and their bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vlmprune.compiler import benchmark
from vlmprune.compiler.frontend.images import load_image_file
from cli_helpers import one_line_error as _one_line_error, run_cli as _run


@pytest.fixture(scope="module")
def bundle(tiny_llava_dir, compiled):
    return compiled(tiny_llava_dir, keep=16).bundle


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from skimage import data

    root = tmp_path_factory.mktemp("photos")
    paths = [root / "rocket.png", root / "astronaut.png"]
    Image.fromarray(data.rocket()).save(paths[0])
    Image.fromarray(data.astronaut()).save(paths[1])
    return paths


def test_nearest_rank_reports_measured_values():
    ms = sorted([5.0, 1.0, 3.0, 2.0, 4.0])
    assert [benchmark.nearest_rank(ms, q) for q in (0, 50, 90, 99, 100)] == [1.0, 3.0, 5.0, 5.0, 5.0]


def test_benchmark_json_at_the_batch_given(bundle, photos):
    result = _run("run", bundle, "--image", photos[0], "--image", photos[1], "--benchmark", "--warmup", 1,
                  "--iterations", 7, "--json")
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)["benchmark"]
    lat = bench["latency_ms"]
    assert bench["batch"] == 2 and bench["iterations"] == 7 and bench["warmup"] == 1
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"]
    assert bench["throughput_images_per_s"] == pytest.approx(2 / (lat["mean"] / 1e3))
    assert bench["measures"] == "latency"  # ONNX Runtime here is the runtime itself
    text = _run("run", bundle, "--image", photos[0], "--benchmark", "--iterations", 3)
    assert text.exit_code == 0 and "latency ms: min" in text.output and "images/s at batch 1" in text.output


@pytest.mark.slow  # a qnn compile and the HTP emulator: ~1 min on 2 busy cores
def test_the_qnn_emulators_time_is_named_emulator_time_not_latency(qnn_ready, tiny_llava_dir, compiled, photos):
    """The emulator's ~1.6 s per image was printed as "latency ms": no HTP will show it (Target.emulated_time)."""
    from vlmprune.compiler import api
    from vlmprune.compiler.cli.render import run_lines

    bundle = compiled(tiny_llava_dir, keep=16, target="qnn").bundle
    result = api.run(bundle, images=[photos[0]], benchmark=True, warmup=0, iterations=1)
    assert result.benchmark["measures"].startswith("emulator time: onnxruntime-qnn's HTP emulator")
    assert set(result.benchmark["latency_ms"]) == {"min", "mean", "p50", "p90", "p99", "max"}  # the keys stay
    lines = run_lines(result)
    assert not any(line.startswith(("latency", "throughput")) for line in lines), lines
    assert any(line.startswith("emulator time ms: min") for line in lines), lines
    assert any(line.startswith("(times are emulator time: ") and "not the HTP's latency" in line for line in lines)


def test_save_outputs_and_load_inputs_round_trip(bundle, photos, tmp_path):
    from vlmprune.compiler.bundle import load_manifest

    pre = load_manifest(bundle)["preprocess"]
    pixel, _, _ = load_image_file(str(photos[1]), pre["size"], pre["mean"], pre["std"])
    np.savez(tmp_path / "in.npz", pixel_values=pixel)
    first = _run("run", bundle, "--image", photos[1], "--save-outputs", tmp_path / "a.npz", "--json")
    again = _run("run", bundle, "--load-inputs", tmp_path / "in.npz", "--save-outputs", tmp_path / "b.npz")
    assert first.exit_code == 0 and again.exit_code == 0, first.output + again.output
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert set(a.files) == {"image_features", "kept_indices"}
    assert a["kept_indices"].tolist() == json.loads(first.stdout)["kept_indices"]
    assert np.array_equal(a["kept_indices"], b["kept_indices"])
    assert np.array_equal(a["image_features"], b["image_features"])
    _one_line_error(_run("run", bundle, "--load-inputs", tmp_path / "in.npz", "--save-outputs", tmp_path / "a.npz"),
                    "already exists")


@pytest.mark.parametrize("case,needle", [
    ("float64", "is float64, the bundle takes float32"),
    ("shape", "has shape [1, 3, 56, 56]"),
    ("names", "no array named 'pixel_values'"),
    ("garbage", "not an .npz file of input arrays (not a zip archive, which numpy.savez writes)"),
])
def test_bad_inputs_are_one_line(bundle, tmp_path, case, needle):
    path = tmp_path / "in.npz"
    x = np.zeros((1, 3, 112, 112), np.float32)
    if case == "float64":
        np.savez(path, x.astype(np.float64))
    elif case == "shape":
        np.savez(path, pixel_values=np.zeros((1, 3, 56, 56), np.float32))
    elif case == "names":
        np.savez(path, a=x, b=x)
    else:
        path.write_bytes(b"not a zip")
    _one_line_error(_run("run", bundle, "--load-inputs", path), needle)


def test_an_image_or_pickle_given_as_inputs_is_one_line_without_unpickling_advice(bundle, tmp_path):
    text = tmp_path / "text.png"
    text.write_text("not an image either")
    result = _run("run", bundle, "--load-inputs", text)
    _one_line_error(result, "")
    assert result.output.splitlines()[-1] == (f"error: --load-inputs {text}: not an .npz file of input arrays "
                                              "(not a zip archive, which numpy.savez writes)")
    pickled = tmp_path / "objects.npz"
    np.savez(pickled, pixel_values=np.array([{"a": 1}], dtype=object))
    result = _run("run", bundle, "--load-inputs", pickled)
    _one_line_error(result, "")
    assert result.output.splitlines()[-1] == (f"error: --load-inputs {pickled}: not an .npz file of input arrays "
                                              "(it holds pickled Python objects, which are never loaded)")
    assert "allow_pickle" not in result.output


def test_flag_combinations_are_checked_first(bundle, photos):
    _one_line_error(_run("run", bundle, "--image", photos[0], "--warmup", 2), "only apply with --benchmark")
    _one_line_error(_run("run", bundle, "--image", photos[0], "--benchmark", "--iterations", 0), "--iterations must be")
    _one_line_error(_run("run", bundle), "either as --image")


def test_inspect_json_and_op_listing(bundle):
    result = _run("inspect", bundle, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["manifest"]["method"]["name"] == "cls" and data["manifest"]["files"]
    ops = data["ops"]
    assert {o["role"] for o in ops} >= {"score", "", "tokens"}  # the model's own nodes and what vlmprune inserted
    assert any(o["domain"] == "vlmprune" and o["op"] == "TokenPrune" for o in ops)  # ort fuses cls's selection
    text = _run("inspect", bundle, "--ops")
    assert text.exit_code == 0 and f"ops of model.onnx ({len(ops)}):" in text.output and "TokenPrune" in text.output
