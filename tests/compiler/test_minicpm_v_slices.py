"""MiniCPM-V 4.6 with --grid: its processor's slicing of one image (the source image + R·C slices, two sizes) compiled
into one graph that runs the tower on each, K one budget over their rows, the kept rows handed to the LLM among the
processor's slice markers.

What is checked against transformers itself (the tiny MiniCPM-V of tiny_models.tiny_minicpm_v: patch 8, S = 128, the
window merger and merger folding 4x4 patches into a token; seed 0 for the tower side, 5 for the LLM side):
- minicpm_slices gives exactly the pixel_values of MiniCPM-V's image processor (MiniCPMV4_6ImageProcessorPil, the
  backend transformers picks without torchvision) on photos of the grid's aspect, and its grid and target_sizes; a
  photo it would slice otherwise is resized to the grid's shape first, and still gives the bundle's layout;
- the dense pipeline over the source image and the slices is get_image_features on the same pixel_values (1x2: a
  96x192 source, 18 tokens, and two 128x128 slices, 16 each; 2x2 and 1x3 too);
- --grid 1x2 divprune on ort, orin, xavier (host parity) and openvino (the CPU plugin), dart on ort: parity passes,
  the rows are HF's rows at kept_indices (over the image's 50 rows end to end);
- generate's prompt at --grid 2x2 is the processor's own (replace_image_token and its image id on its own outputs),
  its dense splice of the 5 parts' rows among the slice markers gives HF's own forward; a pruned 2x2 bundle's kept
  rows, spliced among the markers, give HF's forward on the processor's prompt with the pruned image tokens dropped;
  `generate` through a --with-llm 1x2 bundle's graphs gives the --reference tokens;
- eval at the 2x2 bundle's grid: its harness holds, the bundle's figures are divprune's reference's over the same
  slices, its answers are generate's (pruned and --dense); `eval --grid 2x2` runs, --grid 1x2 beside the bundle is
  one line;
- --batch 2: each image's rows are HF's at its own kept_indices, `run` slices two photos into the batch;
- a grid the processor does not cut (12 slices, one slice, a bad spelling) and the batch-1 targets rk3588 and qnn
  are refused in one line, nothing written.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (assert_close, cat_image, check_eval, check_eval_is_generate, check_generate_through_graphs,
                           check_pruned_tiles_splice, compiled)
from minicpm_fixtures import IMAGE, PROMPT, VOCAB, hf_model, minicpm_dir  # noqa: F401
from tiny_models import tiny_minicpm_v
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.minicpm_v import MiniCPMVFamily, minicpm_slices, slice_source, sliced
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, WIDTH, PATCH = 128, 48, 8
MEAN = STD = (0.5, 0.5, 0.5)
# grid -> (source image (h, w) px, tokens of the source, of one slice): the processor's cut of rows·128 x cols·128
LAYOUTS = {(1, 2): ((96, 192), 18, 16), (2, 2): ((128, 128), 16, 16), (1, 3): ((64, 224), 14, 16)}


def _photo(width: int, height: int) -> np.ndarray:
    from PIL import Image
    from skimage import data

    return np.asarray(Image.fromarray(data.astronaut()).resize((width, height), Image.BICUBIC))


def _sliced(model_dir, grid):
    source = load_source(str(model_dir))
    slice_source(source, grid)
    return source


def hf_rows(model, source, pixel: np.ndarray) -> torch.Tensor:
    """get_image_features' rows of one sliced image [T, D]: its parts' rows end to end, fed the processor's
    pixel_values and target_sizes."""
    family = MiniCPMVFamily()
    with torch.inference_mode():
        return family.hf_image_features(model.model.get_image_features(**family.hf_image_inputs(None, source, pixel)))


@pytest.mark.parametrize("grid, width, height", [((1, 2), 256, 128), ((1, 2), 300, 150), ((2, 2), 256, 256),
                                                 ((1, 3), 384, 128), ((2, 1), 150, 300)])
def test_slices_are_the_processors_pixel_values(minicpm_dir, grid, width, height):
    """A photo of the grid's aspect: the processor's own pixel_values, exactly, and its grid and target_sizes; the
    transposed grid's cut of the same photo is another."""
    from PIL import Image

    layout = sliced(_sliced(minicpm_dir, grid))
    photo = _photo(width, height)
    expected = layout.processor(MEAN, STD)(images=Image.fromarray(photo), return_tensors="np")
    assert list(expected["grids"][0]) == list(grid) and expected["target_sizes"].tolist() == layout.target_sizes
    got = minicpm_slices(photo, layout, MEAN, STD)
    assert got.shape == (1, 3, PATCH, layout.patches * PATCH) == expected["pixel_values"].shape
    print(f"{grid} {width}x{height}: pixels max-abs {np.abs(got - expected['pixel_values']).max():.3g}")
    np.testing.assert_array_equal(got, expected["pixel_values"])
    if grid[0] != grid[1]:
        other = sliced(_sliced(minicpm_dir, grid[::-1]))
        assert minicpm_slices(photo, other, MEAN, STD).shape != got.shape or \
            np.abs(minicpm_slices(photo, other, MEAN, STD) - got).max() > 0.5


@pytest.mark.parametrize("width, height", [(600, 300), (100, 50), (1000, 333), (257, 511)])
def test_any_photo_gives_the_layout(minicpm_dir, width, height):
    """A photo the processor would slice otherwise (larger, smaller, another aspect): centre-cropped to the grid's
    aspect, resized to its shape where needed, it gives the bundle's 1x2 layout."""
    layout = sliced(_sliced(minicpm_dir, (1, 2)))
    assert minicpm_slices(_photo(width, height), layout, MEAN, STD).shape == (1, 3, PATCH, 50 * 16 * PATCH)


@pytest.mark.parametrize("grid", list(LAYOUTS))
def test_dense_slices_are_hf_image_features(minicpm_dir, hf_model, grid):
    """The pipeline's rows (the tower twice in one forward: the source image, the slices as a batch) are
    get_image_features' on the processor's pixel_values, part by part end to end."""
    source = _sliced(minicpm_dir, grid)
    layout = sliced(source)
    (size, source_tokens, slice_tokens), count = LAYOUTS[grid], grid[0] * grid[1]
    assert layout.source == size and layout.slice == (SIZE, SIZE)
    assert layout.tile_rows == (source_tokens,) + (slice_tokens,) * count
    assert source.num_patches == source_tokens + count * slice_tokens
    assert source.details["token_counts"]["image_tokens"] == source.num_patches
    pixel = minicpm_slices(_photo(grid[1] * 150, grid[0] * 150), layout, MEAN, STD)
    with torch.inference_mode():
        got = source.pipeline(torch.from_numpy(pixel))
    want = hf_rows(hf_model, source, pixel)
    assert got.shape == (1, source.num_patches, WIDTH)
    print(f"{grid}: rows max-abs {float((got[0] - want).abs().max()):.3g} (largest {float(want.abs().max()):.3g})")
    assert_close(got[0], want)


def _rows_are_hf_rows(result, model, source, keep: int) -> None:
    """The bundle's last parity stage (ort: model.onnx; orin / xavier: TensorRT's host stand-in) on a 400x260 photo's
    slices: its rows are HF's at kept_indices, which index the image's rows end to end."""
    from vlmprune.targets import get_target

    m = result.manifest
    pixel = minicpm_slices(_photo(400, 260), sliced(source), MEAN, STD)
    out = get_target(m["target"]["name"]).stages(result.bundle, m)[-1].run(pixel)
    features, kept = out["image_features"], out["kept_indices"]
    assert features.shape == (1, keep, WIDTH) and kept.shape == (1, keep)
    assert kept.min() >= 0 and kept.max() < source.num_patches and len(set(kept[0].tolist())) == keep
    want = hf_rows(model, source, pixel)[torch.from_numpy(kept[0]).long()]
    print(f"{m['target']['name']} {m['method']['name']}: kept rows max-abs "
          f"{float((torch.from_numpy(features[0]) - want).abs().max()):.3g}")
    assert_close(torch.from_numpy(features[0]), want)


@pytest.fixture(scope="module")
def bundle_1x2(minicpm_dir, tmp_path_factory):
    return compiled(minicpm_dir, tmp_path_factory.mktemp("minicpm_slices") / "b", method="divprune", keep=10,
                    family_options={"grid": "1x2"})


def test_grid_1x2_bundle(bundle_1x2, minicpm_dir, hf_model):
    m = bundle_1x2.manifest
    assert m["inputs"][0]["shape"] == [1, 3, PATCH, 50 * 16 * PATCH]  # the processor's packed pixel_values
    assert m["model"]["grid"] == "1x2" and m["model"]["slices"]["source"] == [96, 192]
    assert m["model"]["token_counts"]["image_tokens"] == 50 and m["method"]["num_patches"] == 50
    assert m["llm"]["dense_image_tokens"] == 50
    readme = (bundle_1x2.bundle / "README.md").read_text()
    assert "<slice>" in readme and "one budget" in readme
    _rows_are_hf_rows(bundle_1x2, hf_model, _sliced(minicpm_dir, (1, 2)), 10)


@pytest.mark.parametrize("target, method, options", [
    ("orin", "divprune", {}), ("xavier", "dart", {"pivots": 2}), ("ort", "dart", {"pivots": 2})])
def test_grid_methods_and_targets(minicpm_dir, hf_model, tmp_path, target, method, options):
    """orin and xavier (every host parity stage) and dart on ort: the rows are HF's at kept_indices."""
    result = compiled(minicpm_dir, tmp_path / "b", target=target, method=method, keep=10, method_options=options,
                      family_options={"grid": "1x2"})
    assert all(s.passed for s in result.report.stages), [s.stage for s in result.report.stages]
    _rows_are_hf_rows(result, hf_model, _sliced(minicpm_dir, (1, 2)), 10)


def test_grid_on_openvino(minicpm_dir, hf_model, tmp_path):
    """openvino (the CPU plugin here) runs the two-size graph as it is: the IR's parity stage passes, and its rows are
    HF's at kept_indices (as InternVL's tiles)."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install 'vlmprune[openvino]')")
    result = compiled(minicpm_dir, tmp_path / "b", target="openvino", method="divprune", keep=10,
                      family_options={"grid": "1x2"})
    assert "openvino" in [s.stage for s in result.report.stages]
    assert result.manifest["inputs"][0]["shape"] == [1, 3, PATCH, 50 * 16 * PATCH]
    _rows_are_hf_rows(result, hf_model, _sliced(minicpm_dir, (1, 2)), 10)


def test_batch_2_of_sliced_images(minicpm_dir, hf_model, tmp_path):
    """--batch 2 --grid 1x2: two images' packed pixel_values in one static batch, the tower on 2 sources and 4 slices;
    each image's rows are HF's rows of that image at its own kept_indices, and `run` (api.run) slices two photos into
    the batch; one photo for the batch of 2 is one line."""
    from PIL import Image
    from skimage import data

    from vlmprune.compiler import api
    from vlmprune.targets import get_target

    result = compiled(minicpm_dir, tmp_path / "b", method="divprune", keep=10, batch=2, family_options={"grid": "1x2"})
    m = result.manifest
    assert m["inputs"][0]["shape"] == [2, 3, PATCH, 50 * 16 * PATCH] and m["outputs"][0]["shape"] == [2, 10, WIDTH]
    source = _sliced(minicpm_dir, (1, 2))
    photos = [_photo(400, 260), data.coffee()]
    pixel = np.concatenate([minicpm_slices(photo, sliced(source), MEAN, STD) for photo in photos])
    out = get_target("ort").stages(result.bundle, m)[-1].run(pixel)
    kept = out["kept_indices"]
    assert (kept[0] != kept[1]).any()  # each image its own selection
    for b in range(2):
        got = torch.from_numpy(out["image_features"][b])
        want = hf_rows(hf_model, source, pixel[b:b + 1])[torch.from_numpy(kept[b]).long()]
        print(f"batch 2, image {b}: kept rows max-abs {float((got - want).abs().max()):.3g}")
        assert_close(got, want)
    files = []
    for name, photo in zip(("a.png", "b.png"), photos):
        Image.fromarray(photo).save(tmp_path / name)
        files.append(tmp_path / name)
    np.testing.assert_array_equal(np.asarray(api.run(result.bundle, images=files).kept), kept)
    one_line_error(run_cli("run", result.bundle, "--image", files[0]),
                   "this bundle has a static batch of 2: pass --image 2 times")


@pytest.mark.parametrize("options, message", [
    (dict(family_options={"grid": "4x3"}), "cuts an image of that grid's shape \\(384x512\\) into 3x3 slices, not 4x3"),
    (dict(family_options={"grid": "1x1"}), "does not slice an image of 128x128"),
    (dict(family_options={"grid": "2by2"}), "--grid is ROWSxCOLS"),
    (dict(family_options={"grid": "1x2"}, target="rk3588"), "target rk3588 cannot run --grid slices"),
    (dict(family_options={"grid": "1x2"}, target="qnn"), "target qnn cannot run --grid slices"),
])
def test_refusals(minicpm_dir, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        compile_model(str(minicpm_dir), tmp_path / "b", CompileOptions(method="divprune", keep=10, **options))
    assert not (tmp_path / "b").exists()


def test_cli_refusal_is_one_line(minicpm_dir, tmp_path):
    one_line_error(run_cli("compile", minicpm_dir, "--method", "divprune", "--keep", "10", "--grid", "4x3",
                           "-o", tmp_path / "b"), "not 4x3")
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------- the LLM side


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_minicpm_v(tmp_path_factory.mktemp("tiny_minicpm_v_llm"), 5, image_token_id=IMAGE, tokenizer=True,
                          vocab_size=VOCAB)


@pytest.fixture(scope="module")
def square_photo(tmp_path_factory):
    """A photo of the 2x2 grid's shape, so that the processor itself slices it 2x2."""
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "square.png"
    Image.fromarray(_photo(256, 256)).save(path)
    return path


def _processor_ids(llm_dir, image, layout) -> list[int]:
    """MiniCPMV4_6Processor's own input_ids for the chat template's prompt and the image: its replace_image_token
    and image id (_prepend_local_ids) on the image processor's own outputs, tokenized. (The processor object itself
    needs a video processor, torchvision's; its image-token expansion does not.)"""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    marks = types.SimpleNamespace(image_start_token="<image>", image_end_token="</image>", image_token="<|image_pad|>",
                                  slice_mode=True, image_id_start_token="<image_id>", image_id_end_token="</image_id>",
                                  slice_start_token="<slice>", slice_end_token="</slice>")
    inputs = layout.processor(MEAN, STD)(images=Image.open(image).convert("RGB"), return_tensors="np")
    expanded = MiniCPMV4_6Processor.replace_image_token(marks, inputs, 0, image_token_divisor=16)
    expanded = MiniCPMV4_6Processor._prepend_local_ids(marks, [text], [expanded], "<|image_pad|>")[0]
    return tokenizer(text.replace("<|image_pad|>", expanded), add_special_tokens=False)["input_ids"]


def test_prompt_and_dense_splice_are_the_processors(llm_dir, square_photo):
    """generate at --grid 2x2 writes MiniCPM-V's processor's own input_ids for the sliced image (the source's rows in
    <image> ... </image>, each slice's in <slice> ... </slice>, a newline between rows of slices) and feeds its
    pixel_values; its dense splice of the 80 rows among the markers gives HF's own forward on them."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits

    vlm = gen.load_vlm(str(llm_dir), grid="2x2")
    layout = sliced(vlm.source)
    pixel, described = gen.load_pixels(vlm, square_photo)
    assert "2x2 slices" in described and pixel.shape == (1, 3, PATCH, 80 * 16 * PATCH)
    prompt = gen.build_prompt(vlm, PROMPT)
    ids = gen.hf_forward_ids(vlm, prompt, 80)["input_ids"]
    assert ids[0].tolist() == _processor_ids(llm_dir, square_photo, layout)
    assert (ids == IMAGE).sum() == 80 and len(prompt.between) == 4 and prompt.tile_rows == (16,) * 5

    rows = gen.dense_image(vlm, pixel)
    assert rows.rows.shape == (80, WIDTH)
    positions, text_start = rows.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, rows.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, 80)
    print(f"dense splice among the slice markers vs HF's forward: first logits max-abs "
          f"{float((ours.first_logits - hf).abs().max()):.3g}")
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    assert ours.position_ids == list(range(ids.shape[1]))  # every token of the processor's prompt, in order


def test_prompt_of_an_uneven_grid_is_the_processors(llm_dir, tmp_path):
    """1x2: a source of 18 rows, slices of 16: the markers sit after each part's own rows."""
    from PIL import Image

    from vlmprune.compiler import generate as gen

    path = tmp_path / "wide.png"
    Image.fromarray(_photo(256, 128)).save(path)
    vlm = gen.load_vlm(str(llm_dir), grid="1x2")
    prompt = gen.build_prompt(vlm, PROMPT)
    assert prompt.tile_rows == (18, 16, 16)
    ids = gen.hf_forward_ids(vlm, prompt, 50)["input_ids"]
    assert ids[0].tolist() == _processor_ids(llm_dir, path, sliced(vlm.source))


@pytest.fixture(scope="module")
def bundle_2x2(llm_dir, tmp_path_factory):
    """--grid 2x2 divprune K = 12 on ort, no LLM graphs: the kept rows generate splices."""
    return compiled(llm_dir, tmp_path_factory.mktemp("minicpm_slices_2x2") / "b", method="divprune", keep=12,
                    family_options={"grid": "2x2"})


def test_generate_with_pruned_slices_is_hf_forward(bundle_2x2, llm_dir, square_photo):
    """The 2x2 bundle's 12 kept rows, spliced by generate among the processor's slice markers (Prompt.tile_rows,
    between_tiles), give the logits of HF's own forward on the processor's prompt with the 68 pruned image tokens
    dropped: its own rows of the 12 kept tokens, every kept and marker token at its dense position
    (merged_checks.check_pruned_tiles_splice)."""
    source = _sliced(llm_dir, (2, 2))
    vlm, pixel, described, kept = check_pruned_tiles_splice(
        bundle_2x2, llm_dir, square_photo, PROMPT, IMAGE, lambda model, pixel: hf_rows(model, source, pixel.numpy()),
        pooled=lambda rows: [rows])
    assert "2x2 slices" in described and pixel.shape == (1, 3, PATCH, 80 * 16 * PATCH)
    assert vlm.source.details["grid"] == "2x2" and len(kept) == 12


@pytest.mark.slow
def test_eval_over_slices_is_generate(bundle_2x2, llm_dir, tmp_path):
    """eval at the bundle's grid (its default): its harness is HF's forward over the 5 parts' 80 rows among the slice
    markers, the bundle's rows give divprune's reference's figures over the same slices, and every answer is
    generate's through the bundle (and dense, generate --dense's)."""
    report, images = check_eval(bundle_2x2, llm_dir, tmp_path, [PROMPT], 80, keep=12)
    check_eval_is_generate(report, bundle_2x2, llm_dir, images)


def test_eval_cli_grid_and_another_grid_refused(bundle_2x2, llm_dir, tmp_path):
    """`eval --grid 2x2` runs the references over the slices; --grid 1x2 beside a 2x2 bundle is one line."""
    import json

    from skimage import data

    from cli_helpers import eval_inputs

    images, prompts = eval_inputs(tmp_path, {"cat.png": data.chelsea()}, [PROMPT])
    report = tmp_path / "r.json"
    result = run_cli("eval", llm_dir, "--images", images, "--prompts", prompts, "-m", "divprune", "-k", "12",
                     "--grid", "2x2", "--max-new-tokens", "1", "--report", report, "-q")
    assert result.exit_code == 0, result.output
    out = json.loads(report.read_text())
    assert out["dense_image_tokens"] == 80 and out["harness_kl_max"] < 1e-8
    assert out["results"][0]["samples"][0]["image_tokens"] == 12
    one_line_error(run_cli("eval", llm_dir, "--images", images, "--prompts", prompts, "--bundle", bundle_2x2.bundle,
                           "--grid", "1x2", "-q"), "compiled for --grid 2x2")


@pytest.fixture(scope="module")
def llm_bundle_1x2(llm_dir, tmp_path_factory):
    """--grid 1x2 --with-llm on ort: the slices' kept rows and Qwen3.5's graphs in one bundle."""
    return compiled(llm_dir, tmp_path_factory.mktemp("minicpm_slices_llm") / "b", method="divprune", keep=8,
                    with_llm=True, family_options={"grid": "1x2"})


@pytest.mark.slow
def test_generate_through_graphs_is_the_reference(llm_bundle_1x2, llm_dir, tmp_path_factory):
    """generate through the bundle's LLM graphs gives --reference's tokens and logits (transformers' language model on
    the same kept rows among the slice markers), the kept rows at their places among the image's 50."""
    m = llm_bundle_1x2.manifest
    assert m["llm_graphs"]["parity"]["passed"] and m["inputs"][0]["shape"] == [1, 3, PATCH, 50 * 16 * PATCH]
    check_generate_through_graphs(llm_bundle_1x2.bundle, llm_dir, cat_image(tmp_path_factory), PROMPT, 8)

