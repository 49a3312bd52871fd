"""SmolVLM with --grid: the processor's tiles of one image (do_image_splitting: R·C tiles + the global thumbnail)
compiled as the tower's batch, K one budget over them, the kept rows handed to the LLM among the processor's
split-image prompt (<fake_token_around_image><row_r_col_c> before each tile, <global-img> before the thumbnail).

What is checked against transformers itself (the tiny SmolVLM of tiny_models.tiny_smolvlm, 128 px tiles of 16 merged
tokens, seed 3 for the tower side, 5 for the LLM side):
- smolvlm_tiles gives exactly the pixel_values of SmolVLM's image processor (SmolVLMImageProcessorPil,
  do_image_splitting, longest edge 3 tiles) on a photo of a 3:2 aspect, tiles in the same order; the transposed
  grid does not;
- the dense pipeline over the tiles is get_image_features on the same tiles;
- --grid 1x2 divprune on ort, orin and xavier (host parity), dart on ort: parity passes,
  the rows are HF's rows at kept_indices (c·16 + i over the image's tiles), the manifest counts the tiles, the
  method's line says the thumbnail last;
- generate's prompt over a 2x2 image is SmolVLMProcessor's own input_ids (its split-image prompt, dense) on the same
  image, and its pixels the processor's pixel_values; generate's dense splice gives HF's own forward on them;
- a 2x2 bundle's kept rows, spliced by generate among the markers, give the logits of HF's forward on the processor's
  prompt with the pruned image tokens dropped (its own rows of the kept tokens, every other token at its dense
  position); `generate` through a --with-llm 1x2 bundle's graphs gives the --reference tokens; eval runs over tiles;
- a grid past the processor's tiles a side, --batch, --crop-budget proportional, --crop-budget without --grid, a
  bad grid, the batch-1 targets rk3588 and qnn, and random --site features over tiles (a baseline the crops' budget
  has no form of; it serves one tile per image) are refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (cat_image, check_dense_tiles, check_eval, check_generate_through_graphs,
                           check_pruned_tiles_splice, check_tile_rows, compile_tiles)
from tiny_models import tiny_smolvlm
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.smolvlm import smolvlm_tiles
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, TOKENS, WIDTH = 128, 16, 48
MEAN = STD = (0.5, 0.5, 0.5)
VOCAB, IMAGE = 320, 300
PROMPT = "what is in the image?"


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"), 3)


@pytest.fixture(scope="module")
def hf_model(smolvlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(smolvlm_dir).eval()


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm_llm"), 5, image_token_id=IMAGE, tokenizer=True,
                        vocab_size=VOCAB)


def hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [C·16, D] of one image's C tiles [C, 3, S, S] (its input: [1, C, 3, S, S])."""
    with torch.inference_mode():
        rows = model.model.get_image_features(pixel_values=pixel[None]).pooler_output
    return torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])


def _photo(width: int, height: int) -> np.ndarray:
    from PIL import Image
    from skimage import data

    return np.asarray(Image.fromarray(data.astronaut()).resize((width, height), Image.BICUBIC))


def _processor(longest: int):
    from transformers import SmolVLMImageProcessorPil

    return SmolVLMImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": SIZE},
                                    image_mean=list(MEAN), image_std=list(STD))


def test_tiles_are_the_processors_pixel_values():
    """A 450x300 photo, the processor's longest edge 3 tiles: 2 rows x 3 columns of 128 tiles + the thumbnail;
    --grid 2x3 cuts the same 7 tiles in the same order; the transposed grid does not."""
    from PIL import Image

    photo = _photo(450, 300)
    expected = _processor(3 * SIZE)(images=Image.fromarray(photo), return_tensors="np", return_row_col_info=True)
    assert expected["rows"] == [[2]] and expected["cols"] == [[3]]
    got = smolvlm_tiles(photo, {"grid": [2, 3], "count": 7}, SIZE, MEAN, STD)
    assert got.shape == (7, 3, SIZE, SIZE)
    np.testing.assert_array_equal(got, expected["pixel_values"][0])
    other = smolvlm_tiles(photo, {"grid": [3, 2], "count": 7}, SIZE, MEAN, STD)
    assert np.abs(other - expected["pixel_values"][0]).max() > 0.5


@pytest.mark.parametrize("grid", [(1, 2), (2, 1), (2, 2), (1, 1)])
@pytest.mark.parametrize("width, height", [(300, 280), (1000, 333), (257, 511)])
def test_any_photo_gives_the_grid(grid, width, height):
    """The centre crop to the grid's aspect, its short side rounded down, gives the bundle's grid whatever the photo."""
    count = grid[0] * grid[1] + (grid[0] * grid[1] > 1)
    assert smolvlm_tiles(_photo(width, height), {"grid": list(grid), "count": count}, SIZE, MEAN, STD).shape[0] == count


def test_dense_tiles_are_hf_image_features(smolvlm_dir, hf_model):
    check_dense_tiles(smolvlm_dir, lambda crops: smolvlm_tiles(_photo(300, 280), crops, SIZE, MEAN, STD),
                      lambda pixel: hf_rows(hf_model, pixel), resolution=256, tokens=TOKENS)


def _rows_are_hf_rows(result, model, tiles: int, keep: int) -> None:
    """merged_checks.check_tile_rows on the tiles of a 400x260 photo."""
    grid = [int(v) for v in result.manifest["model"]["grid"].split("x")]
    pixel = smolvlm_tiles(_photo(400, 260), {"grid": grid, "count": tiles}, SIZE, MEAN, STD)
    check_tile_rows(result, pixel, hf_rows(model, torch.from_numpy(pixel)), tiles=tiles, tokens=TOKENS,
                    keep=keep)


def test_grid_1x2_bundle(smolvlm_dir, hf_model, tmp_path):
    result = compile_tiles(smolvlm_dir, tmp_path / "b", "1x2")
    m = result.manifest
    assert m["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]  # two tiles + the global thumbnail
    assert m["model"]["grid"] == "1x2" and m["model"]["crops"] == 3 and m["model"]["resolution"] == [128, 256]
    assert m["model"]["token_counts"]["tiles"] == 3 and m["model"]["token_counts"]["image_tokens"] == 3 * TOKENS
    assert m["method"]["params"]["crops"] == {"grid": [1, 2], "count": 3, "side": 4, "budget": "equal",
                                              "noun": "tiles", "order": "1x2 grid, then the thumbnail"}
    assert "over 3 tiles (1x2 grid, then the thumbnail; equal budget)" in m["method"]["summary"]
    assert m["llm"]["dense_image_tokens"] == 3 * TOKENS
    readme = (result.bundle / "README.md").read_text()
    assert "kept_indices c * 16 + i" in readme and "<row_r_col_c>" in readme
    _rows_are_hf_rows(result, hf_model, 3, 10)


@pytest.mark.parametrize("target, method, options", [
    ("orin", "divprune", {}), ("xavier", "dart", {"pivots": 2}), ("ort", "dart", {"pivots": 2})])
def test_grid_methods_and_targets(smolvlm_dir, hf_model, tmp_path, target, method, options):
    """orin and xavier take the tiles as the engine's static batch of 3: every host parity stage passes; dart over
    the tiles on ort too; the rows are HF's at kept_indices."""
    result = compile_tiles(smolvlm_dir, tmp_path / "b", "1x2", target=target, method=method, method_options=options)
    m = result.manifest
    assert m["target"]["name"] == target and m["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]
    assert all(s.passed for s in result.report.stages), [s.stage for s in result.report.stages]
    _rows_are_hf_rows(result, hf_model, 3, 10)


@pytest.mark.parametrize("options,message", [
    (dict(family_options={"grid": "5x1"}), "5 tiles along a side, and this model's processor cuts at most 4"),
    (dict(family_options={"grid": "2x2"}, batch=2), "--batch does not apply with --grid"),
    (dict(family_options={"grid": "2x2", "crop_budget": "proportional"}), "use --crop-budget equal"),
    (dict(family_options={"crop_budget": "equal"}), "it needs --grid ROWSxCOLS"),
    (dict(family_options={"grid": "2by2"}), "--grid is ROWSxCOLS"),
    (dict(family_options={"grid": "1x2"}, target="rk3588"), "target rk3588 cannot run --grid tiles"),
    (dict(family_options={"grid": "1x2"}, target="qnn"), "target qnn cannot run --grid tiles"),
    # random / grid --site features serve one tile per image; over tiles the crops' budget has no form of a baseline
    (dict(family_options={"grid": "1x2"}, method="random", method_options={"site": "features"}),
     "method random is a baseline of one fixed patch set per image"),
])
def test_refusals(smolvlm_dir, tmp_path, options, message):
    options = {"method": "divprune", "keep": 10, **options}
    with pytest.raises(InputError, match=message):
        compile_model(str(smolvlm_dir), tmp_path / "b", CompileOptions(**options))
    assert not (tmp_path / "b").exists()


def test_fastv_over_tiles_is_refused(tmp_path):
    """FastV prunes one run of rows from --image-start, and the processor writes row/column markers among the tiles'
    rows: refused before the export (a 2-layer LLM, so that FastV's own checks pass); one tile is not refused here."""
    from vlmprune.compiler.frontend import load_fixed

    model = tiny_smolvlm(tmp_path / "two_layers", 3, num_hidden_layers=2)
    fastv = dict(method="divprune", keep=10, with_llm=True, fastv_layer=1, image_start=4)
    with pytest.raises(InputError, match="--fastv-layer is not supported here: SmolVLM's processor writes row/column"):
        compile_model(str(model), tmp_path / "b", CompileOptions(**fastv, family_options={"grid": "1x2"}))
    assert not (tmp_path / "b").exists()
    source, family = load_fixed(str(model), None, {}, prune=True, batch=None, cls=None)
    assert family.why_not_fastv(source) is None


def test_cli_refusal_is_one_line(smolvlm_dir, tmp_path):
    one_line_error(run_cli("compile", smolvlm_dir, "--method", "divprune", "--keep", "10", "--grid", "1x2",
                           "--target", "rk3588", "-o", tmp_path / "b"), "--grid tiles")


# ---------------------------------------------------------------------------------------------- the LLM side


@pytest.fixture(scope="module")
def square_photo(tmp_path_factory):
    """A photo of the 2x2 grid's aspect (square), so that the processor itself cuts 2x2 from it."""
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "square.png"
    Image.fromarray(_photo(300, 300)).save(path)
    return path


def _processor_inputs(llm_dir, image, monkeypatch):
    """SmolVLMProcessor's own input_ids and pixel_values for the chat template's prompt and the image, its image
    processor cutting 2x2 (longest edge 2 tiles). num2words (its video timestamps only) and its video processor are not
    needed here."""
    from PIL import Image
    from transformers import AutoTokenizer, SmolVLMProcessor
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(processing_smolvlm, "num2words", lambda n: str(n), raising=False)
    # no video processor here (torchvision's): the processor's class check of it is skipped, images only
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    processor = SmolVLMProcessor(image_processor=_processor(2 * SIZE), tokenizer=tokenizer, video_processor=None,
                                 image_seq_len=TOKENS, chat_template=DEFAULT_CHAT_TEMPLATE)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=[[Image.open(image).convert("RGB")]], return_tensors="pt",
                     add_special_tokens=False)


def test_prompt_and_pixels_are_the_processors(llm_dir, square_photo, monkeypatch):
    """generate at --grid 2x2 writes SmolVLMProcessor's own input_ids (the split-image prompt: row/col markers, a
    newline after each row of tiles, the global thumbnail last) and feeds its pixel_values; its dense splice of the
    5 tiles' 80 rows gives HF's own forward on them."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits

    expected = _processor_inputs(llm_dir, square_photo, monkeypatch)
    vlm = gen.load_vlm(str(llm_dir), grid="2x2")
    pixel, described = gen.load_pixels(vlm, square_photo)
    assert pixel.shape == (5, 3, SIZE, SIZE) and "5 tiles" in described
    np.testing.assert_array_equal(pixel, expected["pixel_values"][0].numpy())
    prompt = gen.build_prompt(vlm, PROMPT)
    ids = gen.hf_forward_ids(vlm, prompt, 5 * TOKENS)["input_ids"]
    assert ids[0].tolist() == expected["input_ids"][0].tolist()
    assert (ids == IMAGE).sum() == 5 * TOKENS and len(prompt.between) == 4

    rows = gen.dense_image(vlm, pixel)
    assert rows.rows.shape == (5 * TOKENS, WIDTH)
    positions, text_start = rows.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, rows.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, 5 * TOKENS)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    assert ours.position_ids == list(range(ids.shape[1]))  # every token of the processor's prompt, in order


@pytest.fixture(scope="module")
def bundle_2x2(llm_dir, tmp_path_factory):
    return compile_tiles(llm_dir, tmp_path_factory.mktemp("smolvlm_tiles") / "b", "2x2", keep=12)


def test_generate_with_pruned_tiles_is_hf_forward(bundle_2x2, llm_dir, tmp_path_factory):
    """The 2x2 bundle's 12 kept rows, spliced by generate among the processor's markers, give the logits of HF's own
    forward on the processor's prompt with the 68 pruned image tokens dropped (merged_checks.check_pruned_tiles_splice),
    with rows of every tile and of the thumbnail kept."""
    kept = check_pruned_tiles_splice(bundle_2x2, llm_dir, cat_image(tmp_path_factory), PROMPT, IMAGE,
                                     hf_rows)[-1]
    assert len(set((kept // TOKENS).tolist())) == 5


@pytest.fixture(scope="module")
def llm_bundle_1x2(llm_dir, tmp_path_factory):
    """--grid 1x2 --with-llm on ort: the tiles' kept rows and the Llama language model's graphs in one bundle."""
    return compile_tiles(llm_dir, tmp_path_factory.mktemp("smolvlm_tiles_llm") / "b", "1x2", keep=8, with_llm=True)


def test_generate_through_graphs_is_the_reference(llm_bundle_1x2, llm_dir, tmp_path_factory):
    """generate through the bundle's LLM graphs gives --reference's tokens and logits (transformers' language model on
    the same kept rows among the markers)."""
    m = llm_bundle_1x2.manifest
    assert m["llm_graphs"]["parity"]["passed"] and m["inputs"][0]["shape"] == [3, 3, SIZE, SIZE]
    check_generate_through_graphs(llm_bundle_1x2.bundle, llm_dir, cat_image(tmp_path_factory), PROMPT, 8)


def test_eval_over_tiles(llm_bundle_1x2, llm_dir, tmp_path):
    """eval at the bundle's grid: its harness is HF's forward over the 3 tiles' 48 rows among the markers, and the
    bundle's rows give the figures of divprune's reference over the same tiles."""
    check_eval(llm_bundle_1x2, llm_dir, tmp_path, [PROMPT, "describe it."], 3 * TOKENS)
