"""Family `lfm2_vl`: LFM2-VL's SigLIP2 NaFlex tower, pixel unshuffle and projector, pruned after the connector,
against transformers.

A tiny LFM2-VL built offline from a config (tiny_models.tiny_lfm2_vl: 3 SigLIP2 blocks 32 wide, patch 8, an 8x8
position table: 64 px by default, 8x8 patches unshuffled 2x2 into 4x4 = 16 tokens; an LFM2 LLM of one short-conv and
one attention layer). What is checked against Hugging Face itself:
- the dense pipeline's rows are get_image_features' (NaFlex patches, resampled positions, blocks, post_layernorm,
  unshuffle, projector), at the table's own size and at static --image-size 96 and 128 (positions resampled), with
  NaFlex's patch layout as transformers' SigLIP2 processor cuts it;
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator), each gated on its
  toolchain as the other families' tests are;
- block-site and attention-scored methods, bad --image-size values, --feature-layer and a non-square position table
  are refused in one line; `vlmprune methods` lists LFM2-VL;
- the lfm2-vl-450m-256 preset has LFM2-VL-450M's tower and projector shapes;
- the LLM side: the prompt is the processor's (the chat template, the image rows between <|image_start|> and
  <|image_end|> as transformers' own _build_image_tokens writes them), generate's dense splice gives HF's own forward's
  logits, a pruned bundle's rows spliced by generate give the logits of HF's forward given its own tower's rows of the
  same kept tokens (1-D original positions), and `generate` and eval run through the bundle (--with-llm, LFM2's
  hybrid decoder exported with its convolution states: test_lfm2_vl_llm).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (QNN_RK3588_CASES, TENSORRT_CASES, assert_close, cat_image, check_dense_splice, check_eval,
                           check_methods_listing, check_openvino, check_other_method, check_pruned_splice,
                           check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt)
from tiny_models import edited_copy, tiny_lfm2_vl
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, TOKENS, WIDTH, PATCH = 64, 16, 48, 8
VOCAB, IMAGE = 320, 300  # the LLM-side model: bytes 0-255, its special tokens, <image> at 300
PROMPT = "what is in the image?"


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory):
    # seed 0: seed 3's block-1 out_proj loses cosine 0.992 to the HTP's 8-bit per-tensor weights alone, and a kept
    # index flips on qnn at a margin of 0.03 (a draw of the tiny weights: seeds 0-2 and 4-6 pass there)
    return tiny_lfm2_vl(tmp_path_factory.mktemp("tiny_lfm2_vl"), 0)


@pytest.fixture(scope="module")
def hf_model(lfm2_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(lfm2_dir).eval()


def _hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [B, T, D] for B square images, fed as its processor feeds them (NaFlex patches)."""
    from vlmprune.compiler.frontend.lfm2_vl import Lfm2VlFamily

    source = types.SimpleNamespace(image_size=pixel.shape[-1], patch_size=PATCH)
    with torch.inference_mode():
        rows = model.model.get_image_features(**Lfm2VlFamily().hf_image_inputs(None, source, pixel.numpy()))
    return torch.stack(list(rows.pooler_output))


@pytest.mark.parametrize("size, tokens", [(SIZE, TOKENS), (96, 36), (128, 64)])
def test_dense_path_is_hf_image_features(lfm2_dir, hf_model, size, tokens):
    source = load_source(str(lfm2_dir), image_size=None if size == SIZE else size)
    assert source.family == "lfm2_vl" and not source.has_cls and source.num_patches == tokens
    assert source.spatial_merge == 2 and source.num_blocks == 3 and source.image_size == size
    side = round(tokens ** 0.5)
    assert source.details["token_counts"]["merged_grid_thw"] == [1, side, side]
    assert source.mean == (0.5, 0.5, 0.5)
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, tokens, WIDTH)
        assert_close(got, _hf_rows(hf_model, x))


def test_the_check_has_teeth(lfm2_dir):
    """NaFlex's patches are cut as transformers' SigLIP2 processor cuts them; the unshuffle's grid taken transposed,
    or the table unresampled at 96 px, is not LFM2-VL."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches

    from vlmprune.compiler.frontend.lfm2_vl import Lfm2VlFamily, position_weights

    source = load_source(str(lfm2_dir))
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    cut = Lfm2VlFamily().hf_image_inputs(None, source, x.numpy())
    for i in range(2):
        np.testing.assert_array_equal(cut["pixel_values"][i].numpy(), convert_image_to_patches(x[i].numpy(), PATCH))
    assert cut["spatial_shapes"].tolist() == [[8, 8]] * 2 and bool(cut["pixel_attention_mask"].all())
    projector = source.pipeline.projector
    with torch.inference_mode():
        h = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(8))
        transposed = h.reshape(2, 8, 8, 32).transpose(1, 2).reshape(2, 64, 32)
        assert (projector(h) - projector(transposed)).abs().max() > 1e-3
    assert position_weights(8, 8) is None
    weights = position_weights(12, 8)  # 96 px: 12 patches a side from the 8x8 table
    assert weights.shape == (144, 64) and torch.allclose(weights.sum(-1), torch.ones(144))
    assert (weights > 0).sum(-1).max() > 1  # interpolated, not a lookup


@pytest.fixture(scope="module")
def divprune_bundle(lfm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lfm2_vl_bundles") / "divprune"
    return compile_model(str(lfm2_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, lfm2_dir, hf_model):
    check_rows_on_ort(divprune_bundle, lfm2_dir, lambda pixel: _hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="lfm2_vl", readme="LFM2-VL tokens")


@pytest.mark.parametrize("method, options, size", [("dart", {"pivots": 2}, None),
                                                   ("random", {"site": "features"}, None),
                                                   ("grid", {"site": "features"}, None), ("divprune", {}, 128)])
def test_other_methods_and_sizes_on_ort(lfm2_dir, tmp_path, method, options, size):
    keep = 6 if size is None else 20
    result = check_other_method(lfm2_dir, tmp_path / "b", method, options, keep=keep, width=WIDTH,
                                family_options={"image_size": size} if size else {})
    assert result.manifest["method"]["num_patches"] == (TOKENS if size is None else 64)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(lfm2_dir, tmp_path, target, method, batch, options):
    check_tensorrt(lfm2_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(lfm2_dir, tmp_path):
    check_openvino(lfm2_dir, tmp_path / "b")


@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, lfm2_dir, tmp_path, target, method):
    """The whole LFM2-VL graph, resampled positions and unshuffle too, on the HTP emulator (int16) and the RKNN
    simulator (fp16)."""
    check_qnn_or_rk3588(request, lfm2_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "pixel-unshuffles each 2x2 group"),
    (["--method", "visionzip"], "pixel-unshuffles each 2x2 group"),
    (["--method", "tome"], "pixel-unshuffles each 2x2 group"),
    (["--method", "random"], "pixel-unshuffles each 2x2 group"),
    (["--method", "cls", "--score", "attention"], "not the merged tokens"),
    (["--method", "holov"], "not the merged tokens"),
    (["--method", "cdpruner"], "not the merged tokens"),
    (["--method", "divprune", "--image-size", "100"], "must be a multiple of 16 (patch x downsample_factor) from 16 "
                                                      "to 256"),
    (["--method", "divprune", "--image-size", "512"], "must be a multiple of 16 (patch x downsample_factor) from 16 "
                                                      "to 256"),
    (["--method", "divprune", "--feature-layer", "-2"], "reads the tower's last normed output only"),
])
def test_refusals_are_one_line(lfm2_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", lfm2_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)
    assert not (tmp_path / "b").exists()


def test_a_non_square_position_table_is_refused_in_one_line(lfm2_dir, tmp_path):
    """NaFlex resamples a square table; a checkpoint whose num_patches is no square is not one vlmprune can fix."""
    bad = edited_copy(lfm2_dir, tmp_path / "bad", lambda c: c["vision_config"].update(num_patches=60))
    one_line_error(run_cli("compile", bad, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6"),
                   "num_patches 60 is not a square position table")


def test_methods_lists_lfm2_vl_from_its_declarations():
    check_methods_listing("LFM2-VL")


def test_preset_has_lfm2_vl_450m_tower_shapes():
    source = load_source("lfm2-vl-450m-256")
    pipe = source.pipeline
    assert source.family == "lfm2_vl" and source.image_size == 256 and source.patch_size == 16
    assert source.num_patches == 64 and source.num_blocks == 12 and not source.has_cls
    assert source.details["token_counts"] == {"image_size": 256, "patch_grid": [16, 16], "patches": 256,
                                              "spatial_merge": 2, "merged_grid_thw": [1, 8, 8], "tokens": 64}
    tower = pipe.vision_model
    assert tower.config.hidden_size == 768 and tower.embeddings.position_embedding.weight.shape == (256, 768)
    assert tower.embeddings.patch_embedding.weight.shape == (768, 768)  # 16 x 16 x 3 pixels a patch
    projector = pipe.projector.projector
    assert projector.linear_1.weight.shape == (2560, 3072) and projector.linear_2.weight.shape == (1024, 2560)
    params = sum(p.numel() for p in tower.parameters())
    assert 85e6 < params < 95e6  # SigLIP2 base patch16
    with torch.inference_mode():
        out = pipe(torch.zeros(1, 3, 256, 256))
    assert out.shape == (1, 64, 1024) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- the LLM side


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_lfm2_vl(tmp_path_factory.mktemp("tiny_lfm2_vl_llm"), 5, image_token_id=IMAGE, tokenizer=True,
                        vocab_size=VOCAB)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def llm_bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lfm2_vl_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8))


def test_prompt_is_the_processors(llm_dir):
    """The prompt's ids are the chat template's text with <image> expanded as LFM2-VL's processor expands one unsplit
    image (transformers' own _build_image_tokens, image special tokens on), tokenized."""
    from transformers import AutoTokenizer
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    prompt = gen.build_prompt(vlm, PROMPT)
    assert prompt.how == "the checkpoint's chat template"
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    marks = types.SimpleNamespace(image_start_token="<|image_start|>", image_end_token="<|image_end|>",
                                  image_token="<image>", image_thumbnail_token="<|img_thumbnail|>")
    expanded = text.replace("<image>", Lfm2VlProcessor._build_image_tokens(marks, 1, 1, TOKENS, TOKENS, False, True))
    assert prompt.before + [IMAGE] * TOKENS + prompt.after == tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert prompt.before[0] == 256 and prompt.before[-1] == 259 and prompt.after[0] == 260  # bos, image start, end


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    check_dense_splice(llm_dir, cat, PROMPT, TOKENS, WIDTH)


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions, give the logits of HF's own
    forward given its own tower's rows of those 8 tokens at those positions; other positions give others."""
    check_pruned_splice(llm_bundle, llm_dir, cat, PROMPT, TOKENS, IMAGE, _hf_rows,
                        pooled=lambda rows: [rows])


def test_generate_cli_and_eval(llm_bundle, llm_dir, cat, tmp_path):
    """`vlmprune generate` answers through LFM2's LLM (transformers); eval's harness holds (its dense splice is HF's
    forward) and the bundle's rows give its reference's figures."""
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", cat,
                     "--prompt", PROMPT, "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "the checkpoint's chat template" in result.output
    check_eval(llm_bundle, llm_dir, tmp_path, [PROMPT, "describe it."], TOKENS)

