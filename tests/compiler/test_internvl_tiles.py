"""InternVL3 with --grid: the processor's tiles of one image (crop_to_patches, + the thumbnail) compiled as the
tower's batch, K split over the tiles, the kept rows handed to the LLM as one image between <img> and </img>.

What is checked against transformers itself (the tiny InternVL3 of tiny_models.tiny_internvl, 112 px tiles of 16
merged tokens):
- canvas_tiles gives exactly the pixel_values of the InternVL image processor (GotOcr2ImageProcessor,
  crop_to_patches, max_patches 12) on a real photo of a non-square aspect, tiles in the same order;
- the dense pipeline over the tiles is get_image_features on the same tiles;
- --grid 1x2 and 2x2 divprune bundles on ort pass parity; their rows are HF's rows at kept_indices (c·16 + i over
  the image's tiles); the manifest counts the tiles and the image's dense tokens; the method's line says the tiles
  as InternVL lays them out (the thumbnail last);
- --grid 1x2 on orin and xavier (host parity, their ONNX Runtime stand-in) and openvino (the CPU plugin): every
  stage passes and the rows are HF's at kept_indices;
- --grid 1x2 --with-llm: the LLM graphs' parity, generate through them gives HF's language model's tokens, eval's
  harness and the bundle's figures equal divprune's reference over the same tiles, `eval --grid 1x2` runs, and
  another --grid beside the bundle is refused in one line;
- generate's splice of a 2x2 bundle's kept rows gives the logits of HF's own forward given its own rows of the same
  kept tokens at the same positions;
- a grid over max_patches, --batch or --crop-budget proportional with the tiles, --crop-budget without --grid and
  a batch-1 target are refused in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_helpers import eval_inputs, one_line_error, run_cli
from internvl_fixtures import (IMAGE, MEAN, SIZE, STD, TOKENS, WIDTH, hf_model, hf_rows, internvl_dir,  # noqa: F401
                               llm_dir)
from merged_checks import (cat_image, check_dense_tiles, check_eval, check_generate_through_graphs,
                           check_pruned_tiles_splice, check_tile_rows, compile_tiles)
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.images import canvas_tiles
from vlmprune.compiler.pipeline import CompileOptions, compile_model



def _photo(width: int, height: int) -> np.ndarray:
    from PIL import Image
    from skimage import data

    return np.asarray(Image.fromarray(data.astronaut()).resize((width, height), Image.BICUBIC))


def _processor(size: int):
    from transformers import GotOcr2ImageProcessorPil

    # InternVL3's preprocessor_config: crop_to_patches, 1..12 tiles, ImageNet mean and std
    return GotOcr2ImageProcessorPil(size={"height": size, "width": size}, crop_to_patches=True, min_patches=1,
                                    max_patches=12, image_mean=list(MEAN), image_std=list(STD))


def test_tiles_are_the_processors_pixel_values():
    """A 1344x896 photo: the processor picks 3 columns x 2 rows of 448 tiles + the thumbnail; --grid 2x3 cuts the
    same 7 tiles in the same order; the transposed grid does not."""
    photo = _photo(1344, 896)
    from PIL import Image

    expected = _processor(448)(images=Image.fromarray(photo), return_tensors="np")
    assert list(expected["num_patches"]) == [7]
    got = canvas_tiles(photo, {"grid": [2, 3], "count": 7}, 448, MEAN, STD)
    assert got.shape == (7, 3, 448, 448)
    np.testing.assert_array_equal(got, expected["pixel_values"])
    other = canvas_tiles(photo, {"grid": [3, 2], "count": 7}, 448, MEAN, STD)
    assert np.abs(other - expected["pixel_values"]).max() > 0.5


def test_dense_tiles_are_hf_image_features(internvl_dir, hf_model):
    check_dense_tiles(internvl_dir, lambda crops: canvas_tiles(_photo(300, 280), crops, SIZE, MEAN, STD),
                      lambda pixel: hf_rows(hf_model, pixel), resolution=224, tokens=TOKENS)


def _rows_are_hf_rows(result, model, tiles: int, keep: int) -> None:
    """merged_checks.check_tile_rows on the tiles of a 400x260 photo."""
    grid = [int(v) for v in result.manifest["model"]["grid"].split("x")]
    pixel = canvas_tiles(_photo(400, 260), {"grid": grid, "count": tiles}, SIZE, MEAN, STD)
    rows = hf_rows(model, torch.from_numpy(pixel)).reshape(tiles * TOKENS, WIDTH)
    check_tile_rows(result, pixel, rows, tiles=tiles, tokens=TOKENS, keep=keep)


def test_grid_1x2_bundle(internvl_dir, hf_model, tmp_path):
    result = compile_tiles(internvl_dir, tmp_path / "b", "1x2")
    m = result.manifest
    assert m["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]  # two tiles + the thumbnail
    assert m["model"]["grid"] == "1x2" and m["model"]["crops"] == 3 and m["model"]["resolution"] == [112, 224]
    assert m["model"]["token_counts"]["tiles"] == 3 and m["model"]["token_counts"]["image_tokens"] == 3 * TOKENS
    assert m["method"]["params"]["crops"] == {"grid": [1, 2], "count": 3, "side": 4, "budget": "equal",
                                              "noun": "tiles", "order": "1x2 grid, then the thumbnail"}
    # The method's line says the family's layout: the thumbnail last, not LLaVA-NeXT's base image first.
    assert "over 3 tiles (1x2 grid, then the thumbnail; equal budget)" in m["method"]["summary"]
    assert "base" not in m["method"]["summary"]
    assert m["llm"]["dense_image_tokens"] == 3 * TOKENS and m["llm"]["text_resumes_at"] == 3 * TOKENS
    assert m["compile_options"]["family_options"] == {"grid": "1x2"}
    _rows_are_hf_rows(result, hf_model, 3, 10)


@pytest.mark.parametrize("target, method, options", [("orin", "divprune", {}), ("xavier", "dart", {"pivots": 2})])
def test_grid_on_tensorrt_targets(internvl_dir, hf_model, tmp_path, target, method, options):
    """orin and xavier take the tiles as the engine's static batch of 3: every host parity stage passes, and the
    graph (their ONNX Runtime stand-in) gives HF's rows at kept_indices over both tiles and the thumbnail."""
    result = compile_tiles(internvl_dir, tmp_path / "b", "1x2", target=target, method=method, method_options=options)
    m = result.manifest
    assert m["target"]["name"] == target and m["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]
    assert m["method"]["params"]["crops"]["count"] == 3
    stages = [s.stage for s in result.report.stages]
    assert len(stages) >= 3 and all(s.passed for s in result.report.stages), stages
    _rows_are_hf_rows(result, hf_model, 3, 10)


def test_grid_on_openvino(internvl_dir, hf_model, tmp_path):
    """openvino (the CPU plugin here): the IR's parity stage passes, and its rows are HF's at kept_indices."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install 'vlmprune[openvino]')")
    result = compile_tiles(internvl_dir, tmp_path / "b", "1x2", target="openvino")
    assert "openvino" in [s.stage for s in result.report.stages]
    assert result.manifest["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]
    _rows_are_hf_rows(result, hf_model, 3, 10)


@pytest.fixture(scope="module")
def bundle_2x2(llm_dir, tmp_path_factory):
    return compile_tiles(llm_dir, tmp_path_factory.mktemp("internvl_tiles") / "b", "2x2", keep=12)


def test_grid_2x2_bundle(bundle_2x2, llm_dir):
    from transformers import AutoModelForImageTextToText

    m = bundle_2x2.manifest
    assert m["inputs"][0]["shape"] == [5, 3, SIZE, SIZE] and m["outputs"][0]["shape"] == [1, 12, WIDTH]
    assert m["model"]["crops"] == 5 and m["llm"]["dense_image_tokens"] == 5 * TOKENS
    assert json.loads((bundle_2x2.bundle / "manifest.json").read_text())["model"]["grid"] == "2x2"
    readme = (bundle_2x2.bundle / "README.md").read_text()
    assert "the 4 tiles in raster order, then the thumbnail" in readme and "kept_indices c * 16 + i" in readme
    _rows_are_hf_rows(bundle_2x2, AutoModelForImageTextToText.from_pretrained(llm_dir).eval(), 5, 12)


def test_generate_with_pruned_tiles_is_hf_forward(bundle_2x2, llm_dir, tmp_path_factory):
    """The 2x2 bundle's 12 kept rows, spliced by generate at their places among the image's 80 dense rows (between
    one <img> and </img>), give the logits of HF's own forward given its own rows of those 12 tokens there
    (merged_checks.check_pruned_tiles_splice); the thumbnail's rows are placed last."""
    vlm, pixel, described, kept = check_pruned_tiles_splice(bundle_2x2, llm_dir, cat_image(tmp_path_factory),
                                                            "what is in the image?", IMAGE, hf_rows)
    assert vlm.source.crops["count"] == 5 and pixel.shape == (5, 3, SIZE, SIZE) and "5 tiles" in described
    assert kept.max() >= 4 * TOKENS


def test_dense_generate_over_tiles_is_hf_forward(llm_dir, tmp_path_factory):
    """generate's dense splice of all 5 tiles' 80 rows gives HF's own forward on the same tiles."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits

    vlm = gen.load_vlm(str(llm_dir), grid="2x2")
    pixel, _ = gen.load_pixels(vlm, cat_image(tmp_path_factory))
    prompt = gen.build_prompt(vlm, "what is in the image?")
    rows = gen.dense_image(vlm, pixel)
    assert rows.rows.shape == (5 * TOKENS, WIDTH)
    positions, text_start = rows.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, rows.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, 5 * TOKENS)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    one_tile = hf_first_logits(vlm, prompt, pixel[:1], TOKENS)
    assert (one_tile - hf).abs().max() > 1e-4  # the other tiles count


@pytest.mark.parametrize("options,message", [
    (dict(family_options={"grid": "4x4"}), "16 tiles, and this model's processor cuts at most 12"),
    (dict(family_options={"grid": "2x2"}, batch=2), "--batch does not apply with --grid"),
    (dict(family_options={"grid": "2x2", "crop_budget": "proportional"}), "use --crop-budget equal"),
    (dict(family_options={"crop_budget": "equal"}), "it needs --grid ROWSxCOLS"),
    (dict(family_options={"grid": "two"}), "--grid is ROWSxCOLS"),
    (dict(family_options={"grid": "1x2"}, target="rk3588"), "target rk3588 cannot run --grid tiles"),
])
def test_refusals(internvl_dir, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        compile_model(str(internvl_dir), tmp_path / "b", CompileOptions(method="divprune", keep=10, **options))
    assert not (tmp_path / "b").exists()


def test_cli_refusal_is_one_line(internvl_dir, tmp_path):
    one_line_error(run_cli("compile", internvl_dir, "--method", "divprune", "--keep", "10", "--grid", "5x3",
                           "-o", tmp_path / "b"), "15 tiles")


@pytest.fixture(scope="module")
def llm_bundle_1x2(llm_dir, tmp_path_factory):
    """--grid 1x2 --with-llm on ort: the tiles' kept rows and the Qwen2 language model's graphs in one bundle."""
    return compile_tiles(llm_dir, tmp_path_factory.mktemp("internvl_tiles_llm") / "b", "1x2", keep=8, with_llm=True)


def test_with_llm_over_tiles_and_generate_through_its_graphs(llm_bundle_1x2, llm_dir, tmp_path_factory):
    """The LLM graphs pass their parity; generate through them gives HF's own language model's greedy tokens on the
    same kept rows, placed among the image's 48 dense rows (the tiles' and the thumbnail's)."""
    from vlmprune.compiler import generate as gen

    m = llm_bundle_1x2.manifest
    assert m["llm_graphs"]["parity"]["passed"] and m["llm_graphs"]["parity"]["tokens_identical"]
    assert m["llm"]["dense_image_tokens"] == 3 * TOKENS and m["llm"]["text_resumes_at"] == 3 * TOKENS
    image = cat_image(tmp_path_factory)
    check_generate_through_graphs(llm_bundle_1x2.bundle, llm_dir, image, "what is in the image?", 8)
    run = gen.generate(llm_bundle_1x2.bundle, str(llm_dir), image, "what is in the image?", max_new_tokens=1)
    assert len(set((np.asarray(run.kept) // TOKENS).tolist())) == 3  # rows of both tiles and of the thumbnail


def test_eval_over_tiles(llm_bundle_1x2, llm_dir, tmp_path):
    """eval at the bundle's grid: its dense harness is HF's forward over the 3 tiles' 48 rows, and the bundle's rows
    (answered by its LLM graphs) give the figures of divprune's reference over the same tiles."""
    check_eval(llm_bundle_1x2, llm_dir, tmp_path, ["what is in the image?", "describe it."], 3 * TOKENS)


def test_eval_cli_grid_and_another_grid_refused(llm_bundle_1x2, llm_dir, tmp_path):
    """`eval --grid 1x2` runs the references over the tiles; --grid 2x2 beside a 1x2 bundle is one line."""
    from skimage import data

    images, prompts = eval_inputs(tmp_path, {"cat.png": data.chelsea()}, ["what is in the image?"])
    report = tmp_path / "r.json"
    result = run_cli("eval", llm_dir, "--images", images, "--prompts", prompts, "-m", "divprune", "-k", "8",
                     "--grid", "1x2", "--max-new-tokens", "1", "--report", report, "-q")
    assert result.exit_code == 0, result.output
    out = json.loads(report.read_text())
    assert out["dense_image_tokens"] == 3 * TOKENS and out["harness_kl_max"] < 1e-8
    assert out["results"][0]["samples"][0]["image_tokens"] == 8
    one_line_error(run_cli("eval", llm_dir, "--images", images, "--prompts", prompts, "--bundle",
                           llm_bundle_1x2.bundle, "--grid", "2x2", "-q"), "compiled for --grid 1x2")
