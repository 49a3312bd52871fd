"""Family `qwen3_vl`: the tower, merger and DeepStack mergers at a static --image-size, against transformers.

A tiny Qwen3-VL built offline from a config (tiny_models.tiny_qwen3_vl: 3 vision blocks, patch 16,
DeepStack after blocks 0 and 1, a 2-layer LLM). What is checked against Hugging Face itself:
- the dense graph's rows are get_image_features' merger output and every DeepStack level's, side by side;
- the kept tokens' (t, h, w) are get_rope_index's;
- a pruned bundle's rows are HF's rows at kept_indices on every DeepStack plane, and the LLM input they
  make (spliced by generate) gives the logits of HF's own forward on those same kept tokens;
- parity on ort, orin, xavier (host), rk3588 (simulator) and qnn (HTP emulator); cls and visionzip refused.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from tiny_models import tiny_qwen3_vl
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.parity.reference import torch_reference
from vlmprune.compiler.pipeline import CompileOptions, check_bundle, compile_model
from vlmprune.targets import qnn_tools
from vlmprune.targets.runtime import ort_session, run_session

VOCAB, IMAGE, VIDEO, START, END = 320, 300, 301, 302, 303
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
WIDTH = 48  # the tiny LLM's hidden size: one plane of image_features
PLANES = 3  # the merger's and two DeepStack levels'


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), 23, IDS, vocab_size=VOCAB, initializer_range=0.3)


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(qwen3_dir).eval()


def _hf_planes(model, pixel: torch.Tensor) -> torch.Tensor:
    """[B, M, 3·48]: get_image_features' merger rows and each DeepStack level's, on the processor's patches."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False,
                                         patch_size=16, merge_size=2)
    inputs = processor(images=list(pixel.numpy()), return_tensors="pt", input_data_format="channels_first")
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_grid_thw=inputs["image_grid_thw"])
    levels = [torch.stack(list(out.pooler_output))] + [torch.stack(list(level)) for level in out.deepstack_features]
    return torch.cat(levels, dim=-1)


def _assert_close(got, expected) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), rtol=1e-5,
                               atol=1e-5 * float(torch.as_tensor(expected).abs().max()))


@pytest.mark.parametrize("size", [64, 96])
def test_dense_path_is_hf_image_features_with_every_deepstack_level(qwen3_dir, hf_model, size):
    source = load_source(str(qwen3_dir), image_size=size)
    side = size // 32
    assert source.family == "qwen3_vl" and source.num_patches == side * side and not source.has_cls
    assert source.details["deepstack"]["levels"] == [0, 1] and source.details["deepstack"]["planes"] == PLANES
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, side * side, PLANES * WIDTH)
        expected = _hf_planes(hf_model, x)
        _assert_close(got, expected)
        # The check has teeth: the position table resampled to the grid is part of it.
        assert (got[..., :WIDTH] - expected[..., WIDTH:2 * WIDTH]).abs().max() > 1e-2


def test_without_the_position_table_it_is_not_qwen3(qwen3_dir, hf_model):
    source = load_source(str(qwen3_dir), image_size=96)
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(4))
    expected = _hf_planes(hf_model, x)
    with torch.no_grad():
        source.pipeline.visual.pos_embed.weight.zero_()
        wrong = source.pipeline(x)
    assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


def _rope_positions(model, tokens: int, side: int, offset: int) -> np.ndarray:
    """The mRoPE (t, h, w) that get_rope_index gives the image tokens of `offset` text tokens + one image."""
    input_ids = torch.tensor([[5] * (offset - 1) + [START] + [IMAGE] * tokens + [END, 6, 7]])
    types = (input_ids == IMAGE).int()
    position_ids, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=torch.tensor([[1, side, side]]))
    return position_ids[:, 0, offset: offset + tokens].T.numpy()


def test_positions_are_hf_rope_index(qwen3_dir, hf_model):
    source = load_source(str(qwen3_dir), image_size=128)
    assert source.positions == "thw"
    np.testing.assert_array_equal(source.position_table + 4, _rope_positions(hf_model, 16, 8, 4))


@pytest.fixture(scope="module")
def divprune_bundle(qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_bundles") / "divprune"
    return compile_model(str(qwen3_dir), out, CompileOptions(method="divprune", keep=8,
                                                             family_options={"image_size": 128}))


def test_divprune_on_ort_every_deepstack_level_at_the_kept_indices(divprune_bundle, qwen3_dir, hf_model):
    result = divprune_bundle
    assert result.report.passed, result.manifest["parity"]
    manifest = result.manifest
    outputs = {o["name"]: o["shape"] for o in manifest["outputs"]}
    assert outputs == {"image_features": ["batch", 8, PLANES * WIDTH], "kept_indices": ["batch", 8],
                       "kept_positions": ["batch", 8, 3]}
    # The manifest and the hand-off carry every DeepStack level, each with the kept indices it is gathered by.
    assert manifest["model"]["deepstack"]["levels"] == [0, 1]
    llm = manifest["llm"]
    assert llm["hidden_size"] == WIDTH and llm["deepstack"]["embeds_columns"] == [0, WIDTH]
    assert [(lv["vision_block"], lv["added_after_llm_layer"], lv["columns"], lv["kept_indices"])
            for lv in llm["deepstack"]["levels"]] == [(0, 0, [WIDTH, 2 * WIDTH], "kept_indices"),
                                                      (1, 1, [2 * WIDTH, 3 * WIDTH], "kept_indices")]
    assert "DeepStack" in (result.bundle / "README.md").read_text()
    source = load_source(str(qwen3_dir), image_size=128)
    record = manifest.record
    assert record.method == "divprune"
    hf_positions = _rope_positions(hf_model, 16, 8, 4)
    library = (result.bundle / manifest["target"]["custom_op_library"],)
    for graph in ("model.decomposed.onnx", "model.onnx"):
        onnx.checker.check_model(str(result.bundle / graph), full_check=True)
        for batch in (1, 3):
            pixel, _ = parity_inputs(batch, 128, source.mean, source.std)
            _, expected = torch_reference(source, record, pixel)
            got = run_session(ort_session(result.bundle / graph, library), pixel)
            np.testing.assert_array_equal(got["kept_indices"], expected.outputs["kept_indices"])
            np.testing.assert_allclose(got["image_features"], expected.outputs["image_features"], rtol=1e-4, atol=1e-5)
            # Every plane's rows are Hugging Face's own rows of that level at the kept indices.
            hf = _hf_planes(hf_model, torch.from_numpy(pixel)).numpy()
            kept_rows = np.take_along_axis(hf, got["kept_indices"][..., None], axis=1)
            _assert_close(got["image_features"], kept_rows)
            np.testing.assert_array_equal(got["kept_positions"] + 4, hf_positions[got["kept_indices"]])
    assert check_bundle(result.bundle, batch=3).passed


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(divprune_bundle, qwen3_dir, hf_model, tmp_path):
    """The bundle's 8 kept rows spliced by generate (plane 0 as embeddings, DeepStack planes after LLM layers 0
    and 1) give the logits of HF's own forward given its own tower's rows of those 8 tokens, on every level."""
    from PIL import Image
    from skimage import data
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    from vlmprune.compiler import generate as gen

    Image.fromarray(data.chelsea()).save(tmp_path / "cat.png")
    vlm = gen.load_vlm(str(qwen3_dir), image_size=128)
    pixel, _ = gen.load_pixels(vlm, tmp_path / "cat.png")
    prompt = gen.build_prompt(vlm, "what is in the image?")
    tokens = gen.bundle_tokens(divprune_bundle.bundle, divprune_bundle.manifest, pixel, vlm)
    kept = np.asarray(tokens.kept)
    offset = len(prompt.before)
    positions, text_start = tokens.place(offset)
    ours = gen.answer(vlm, prompt, tokens.features, positions, text_start, 1)

    hf_rows = _hf_planes(hf_model, torch.from_numpy(pixel))[0, kept]
    levels = hf_rows.split(WIDTH, dim=-1)
    image = BaseModelOutputWithDeepstackFeatures(pooler_output=(levels[0],), deepstack_features=[(lv,) for lv in
                                                                                                levels[1:]])
    ids = torch.tensor([prompt.before + [IMAGE] * len(kept) + prompt.after])
    text = [np.arange(offset), positions, text_start + np.arange(len(prompt.after))]
    text[0], text[2] = (np.broadcast_to(t, (3, len(t))) for t in (text[0], text[2]))
    position_ids = torch.from_numpy(np.concatenate(text, axis=1))[:, None]
    with torch.inference_mode():
        hf = hf_model(input_ids=ids, position_ids=position_ids, mm_encoder_outputs={"image": image},
                      logits_to_keep=1).logits[0, -1]
        without = hf_model(input_ids=ids, position_ids=position_ids, logits_to_keep=1,
                           mm_encoder_outputs={"image": BaseModelOutputWithDeepstackFeatures(
                               pooler_output=(levels[0],), deepstack_features=[(0 * lv,) for lv in levels[1:]])},
                           ).logits[0, -1]
    torch.testing.assert_close(ours.first_logits, hf.float(), rtol=0, atol=1e-4)
    assert (without - hf).abs().max() > 1e-3  # the DeepStack planes count: leaving them out is not this forward


def test_generate_dense_splice_is_the_hf_forward(qwen3_dir, hf_model, tmp_path):
    from PIL import Image
    from skimage import data

    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits

    Image.fromarray(data.chelsea()).save(tmp_path / "cat.png")
    vlm = gen.load_vlm(str(qwen3_dir), image_size=128)
    pixel, _ = gen.load_pixels(vlm, tmp_path / "cat.png")
    prompt = gen.build_prompt(vlm, "what is in the image?")
    image = gen.dense_image(vlm, pixel)
    assert image.rows.shape == (16, PLANES * WIDTH)
    positions, text_start = image.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, image.rows, positions, text_start, 1)
    torch.testing.assert_close(ours.first_logits, hf_first_logits(vlm, prompt, pixel, 16), rtol=0, atol=1e-4)


def test_generate_cli_on_a_bundle(divprune_bundle, qwen3_dir, tmp_path):
    from PIL import Image
    from skimage import data

    Image.fromarray(data.chelsea()).save(tmp_path / "cat.png")
    result = run_cli("generate", divprune_bundle.bundle, "--model", qwen3_dir, "--image", tmp_path / "cat.png",
                     "--prompt", "what is in the image?", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "8" in result.output


@pytest.mark.parametrize("target, method, batch, options", [("orin", "dart", 3, {"pivots": 2}),
                                                            ("xavier", "cls", 1, {"score": "attention"})])
def test_tensorrt_targets(qwen3_dir, tmp_path, target, method, batch, options):
    result = compile_model(str(qwen3_dir), tmp_path / "b", CompileOptions(
        target=target, method=method, keep=6, batch=batch, family_options={"image_size": 128},
        method_options=options))
    assert result.report.passed, result.manifest["parity"]
    outputs = {o["name"]: o["shape"] for o in result.manifest["outputs"]}
    assert outputs["kept_positions"] == [batch, 6, 3] and outputs["image_features"][-1] == PLANES * WIDTH
    stages = json.loads((result.bundle / "parity.json").read_text())["stages"]
    assert len(stages) >= 3 and all(s["outputs"]["kept_positions"]["exact"] for s in stages[1:])


@pytest.mark.toolchain
@pytest.mark.parametrize("target, method, options", [("qnn", "cls", {"score": "attention"}),
                                                     ("rk3588", "dart", {"pivots": 2})])
def test_qnn_and_rk3588(request, qwen3_dir, tmp_path, target, method, options):
    """The whole Qwen3-VL graph, DeepStack mergers too, on the HTP emulator (int16) and the RKNN simulator (fp16).

    dart on the HTP's int16 parts from the fp32 greedy order at its step 2 on this tiny tower (margin 0.04,
    index agreement 0.92 < 0.99: parity fails, as it should); cls --score attention keeps every index there.
    """
    if target == "rk3588":
        request.getfixturevalue("rknn_ready")
    elif not qnn_tools.available()[0]:
        pytest.skip(f"QNN toolchain unavailable: {qnn_tools.available()[1]}")
    result = compile_model(str(qwen3_dir), tmp_path / "b", CompileOptions(
        target=target, method=method, keep=6, batch=1, family_options={"image_size": 128},
        method_options=options))
    assert result.report.passed, result.manifest["parity"]
    stages = json.loads((result.bundle / "parity.json").read_text())["stages"]
    assert len(stages) >= 3 and all("kept_positions" in s["outputs"] for s in stages[1:])


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "[CLS]"),
    (["--method", "visionzip"], "[CLS]"),
    (["--image-size", "100"], "--image-size must be a multiple of 32"),
    (["--feature-layer", "-2"], "--feature-layer does not apply to qwen3_vl"),
])
def test_refusals_are_one_line(qwen3_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", qwen3_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)


def test_methods_lists_qwen3_vl():
    result = run_cli("methods")
    assert result.exit_code == 0 and "Qwen3-VL" in result.output
