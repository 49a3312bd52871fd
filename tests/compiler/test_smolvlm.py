"""Family `smolvlm`: SmolVLM's tower, pixel shuffle and connector, pruned after the connector, against transformers.

A tiny SmolVLM built offline from a config (tiny_models.tiny_smolvlm: 3 vision blocks 32 wide, 128 px at patch 8:
16x16 patches shuffled 4x4 into 4x4 = 16 tokens, as SmolVLM-256M's scale_factor 4; a Llama LLM). What is checked
against Hugging Face itself:
- the dense pipeline's rows are get_image_features' (tower, post_layernorm, pixel shuffle, connector), at the
  tower's size and at a smaller static --image-size (the model's bucketed positions);
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator), each gated on its
  toolchain as the other families' tests are;
- block-site and attention-scored methods, bad --image-size values and --feature-layer are refused in one line;
  `vlmprune methods` lists SmolVLM;
- the smolvlm-256m-512 preset has SmolVLM-256M's tower shapes;
- the LLM side: the prompt is the processor's (the chat template, the image rows wrapped in
  <fake_token_around_image><global-img> ... <fake_token_around_image> as transformers' own prompt string writes
  them), generate's dense splice gives HF's own forward's logits, a pruned bundle's rows spliced by generate
  give the logits of HF's forward given its own tower's rows of the same kept tokens (1-D original positions),
  `--with-llm` on ort passes its llm stage, and `generate` runs through the bundle's LLM graphs.
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (QNN_RK3588_CASES, TENSORRT_CASES, assert_close, cat_image, check_dense_splice, check_eval,
                           check_methods_listing, check_openvino, check_other_method, check_pruned_splice,
                           check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt)
from tiny_models import tiny_smolvlm
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, TOKENS, WIDTH = 128, 16, 48
VOCAB, IMAGE = 320, 300  # the LLM-side model: bytes 0-255, its special tokens, <image> at 300
PROMPT = "what is in the image?"


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"), 3)


@pytest.fixture(scope="module")
def hf_model(smolvlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(smolvlm_dir).eval()


def _hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [B, T, D] for B one-tile images (its input: [batch, images, 3, S, S])."""
    with torch.inference_mode():
        rows = model.model.get_image_features(pixel_values=pixel[:, None]).pooler_output
    return torch.stack(list(rows))


@pytest.mark.parametrize("size, tokens", [(SIZE, TOKENS), (96, 9)])
def test_dense_path_is_hf_image_features(smolvlm_dir, hf_model, size, tokens):
    source = load_source(str(smolvlm_dir), image_size=None if size == SIZE else size)
    assert source.family == "smolvlm" and not source.has_cls and source.num_patches == tokens
    assert source.spatial_merge == 4 and source.num_blocks == 3 and source.image_size == size
    side = round(tokens ** 0.5)
    assert source.details["token_counts"]["merged_grid_thw"] == [1, side, side]
    assert source.mean == (0.5, 0.5, 0.5)
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, tokens, WIDTH)
        assert_close(got, _hf_rows(hf_model, x))


def test_the_check_has_teeth(smolvlm_dir, hf_model):
    """With the shuffle's groups taken in another order, or plain raster positions at 96 px, it is not SmolVLM."""
    from vlmprune.compiler.frontend.smolvlm import position_ids

    source = load_source(str(smolvlm_dir))
    connector = source.pipeline.projector
    with torch.inference_mode():
        h = torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(8))
        transposed = h.reshape(2, 16, 16, 32).transpose(1, 2).reshape(2, 256, 32)
        assert (connector(h) - connector(transposed)).abs().max() > 1e-3
    ids = position_ids(12, 16)  # 96 px: 12 patches a side, bucketed into the 16x16 table
    assert ids.shape == (144,) and not torch.equal(ids, torch.arange(144)) and int(ids.max()) == 14 * 16 + 14
    assert torch.equal(position_ids(16, 16), torch.arange(256))


@pytest.fixture(scope="module")
def divprune_bundle(smolvlm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smolvlm_bundles") / "divprune"
    return compile_model(str(smolvlm_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, smolvlm_dir, hf_model):
    check_rows_on_ort(divprune_bundle, smolvlm_dir, lambda pixel: _hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="smolvlm", readme="SmolVLM tokens")


@pytest.mark.parametrize("method, options, size", [("dart", {"pivots": 2}, None),
                                                   ("random", {"site": "features"}, None),
                                                   ("grid", {"site": "features"}, None), ("divprune", {}, 96)])
def test_other_methods_and_sizes_on_ort(smolvlm_dir, tmp_path, method, options, size):
    keep = 6 if size is None else 4
    result = check_other_method(smolvlm_dir, tmp_path / "b", method, options, keep=keep, width=WIDTH,
                                family_options={"image_size": size} if size else {})
    assert result.manifest["method"]["num_patches"] == (TOKENS if size is None else 9)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(smolvlm_dir, tmp_path, target, method, batch, options):
    check_tensorrt(smolvlm_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(smolvlm_dir, tmp_path):
    check_openvino(smolvlm_dir, tmp_path / "b")


@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, smolvlm_dir, tmp_path, target, method):
    """The whole SmolVLM graph, pixel shuffle too, on the HTP emulator (int16) and the RKNN simulator (fp16)."""
    check_qnn_or_rk3588(request, smolvlm_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "pixel-shuffles each group"),
    (["--method", "visionzip"], "pixel-shuffles each group"),
    (["--method", "tome"], "pixel-shuffles each group"),
    (["--method", "random"], "pixel-shuffles each group"),
    (["--method", "cls", "--score", "attention"], "not the merged tokens"),
    (["--method", "holov"], "not the merged tokens"),
    (["--method", "divprune", "--image-size", "100"], "must be a multiple of 32 (patch x scale_factor) from 32 to 128"),
    (["--method", "divprune", "--image-size", "256"], "must be a multiple of 32 (patch x scale_factor) from 32 to 128"),
    (["--method", "divprune", "--feature-layer", "-2"], "reads the tower's last normed output only"),
])
def test_refusals_are_one_line(smolvlm_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", smolvlm_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)


def test_methods_lists_smolvlm_from_its_declarations():
    check_methods_listing("SmolVLM")


def test_preset_has_smolvlm_256m_tower_shapes():
    source = load_source("smolvlm-256m-512")
    pipe = source.pipeline
    assert source.family == "smolvlm" and source.image_size == 512 and source.patch_size == 16
    assert source.num_patches == 64 and source.num_blocks == 12 and not source.has_cls
    assert source.details["token_counts"] == {"image_size": 512, "patch_grid": [32, 32], "patches": 1024,
                                              "spatial_merge": 4, "merged_grid_thw": [1, 8, 8], "tokens": 64}
    tower = pipe.vision_model
    assert tower.config.hidden_size == 768 and tower.embeddings.position_embedding.weight.shape == (1024, 768)
    assert pipe.projector.modality_projection.proj.weight.shape == (576, 12288)
    params = sum(p.numel() for p in tower.parameters())
    assert 85e6 < params < 95e6  # SigLIP base patch16
    with torch.inference_mode():
        out = pipe(torch.zeros(1, 3, 512, 512))
    assert out.shape == (1, 64, 576) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- the LLM side


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm_llm"), 5, image_token_id=IMAGE, tokenizer=True,
                        vocab_size=VOCAB)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def llm_bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smolvlm_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8, with_llm=True))


def test_prompt_is_the_processors(llm_dir):
    """The prompt's ids are the chat template's text with <image> expanded as SmolVLM's processor expands one
    unsplit image (transformers' own get_image_prompt_string), tokenized."""
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    prompt = gen.build_prompt(vlm, PROMPT)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    expanded = text.replace("<image>", get_image_prompt_string(0, 0, TOKENS, "<fake_token_around_image>", "<image>",
                                                               "<global-img>"))
    assert prompt.before + [IMAGE] * TOKENS + prompt.after == tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert prompt.before[-2:] == [258, 259] and prompt.after[0] == 258  # <fake_token_around_image><global-img>


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    check_dense_splice(llm_dir, cat, PROMPT, TOKENS, WIDTH)


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions, give the logits of HF's own
    forward given its own tower's rows of those 8 tokens at those positions; other positions give others."""
    check_pruned_splice(llm_bundle, llm_dir, cat, PROMPT, TOKENS, IMAGE, _hf_rows)


def test_with_llm_on_ort_and_generate_cli(llm_bundle, llm_dir, cat):
    manifest = llm_bundle.manifest
    assert manifest["llm"]["positions"]["kind"] == "indices" and manifest["llm"]["dense_image_tokens"] == TOKENS
    graphs = manifest["llm_graphs"]
    assert graphs["parity"]["passed"] and graphs["parity"]["tokens_identical"]
    assert {"llm/prefill.onnx", "llm/decode.onnx"} <= set(manifest["files"])
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", cat,
                     "--prompt", PROMPT, "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "the bundle's LLM graphs" in result.output


def test_eval_reference_and_bundle(llm_bundle, llm_dir, tmp_path):
    """eval's harness holds (its dense splice is HF's forward), and the bundle's rows give its reference's figures."""
    check_eval(llm_bundle, llm_dir, tmp_path, [PROMPT, "describe it."], TOKENS)


def test_edgellm_refuses_smolvlm_in_one_line(llm_dir, tmp_path):
    one_line_error(run_cli("compile", llm_dir, "-o", tmp_path / "b", "--target", "orin", "--method", "divprune",
                           "--keep", "6", "--with-llm"), "is model type 'smolvlm'")
