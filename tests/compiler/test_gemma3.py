"""Family `gemma3`: Gemma 3's SigLIP tower and 4x4-pooling connector, pruned after the connector, against transformers.

A tiny Gemma 3 built offline from a config (tiny_models.tiny_gemma3: 3 SigLIP blocks 32 wide, 128 px at patch 8:
16x16 patches average-pooled 4x4 into 4x4 = 16 tokens; a 2-layer Gemma 3 LLM, one sliding-window layer). What is
checked against Hugging Face itself:
- the dense pipeline's rows are get_image_features' (tower with post_layernorm, pooling, RMSNorm, projection);
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator), each gated on its
  toolchain as the other families' tests are;
- block-site and attention-scored methods are refused in one line, as is --with-llm on orin (Edge-LLM's exporter
  does not know Gemma 3's decoder; target ort's exports it: test_gemma3_llm.py), before any work; `vlmprune methods`
  lists Gemma 3;
- the gemma3-4b-896 preset has Gemma 3 4B's tower shapes;
- the LLM side: generate's dense splice gives HF's own forward's logits (image tokens bidirectional, as Gemma 3's
  processor marks them), a pruned bundle's rows spliced by generate give the logits of HF's forward given its own
  tower's rows of the same kept tokens at their original 1-D positions, one bidirectional image block between boi
  and eoi; `generate` and eval run through it.
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (OTHER_METHODS, QNN_RK3588_CASES, TENSORRT_CASES, assert_close, cat_image, check_dense_splice,
                           check_eval, check_methods_listing, check_openvino, check_other_method, check_pruned_splice,
                           check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt)
from tiny_models import gemma3_processor, tiny_gemma3
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, TOKENS, WIDTH = 128, 16, 48
VOCAB, IMAGE, BOI, EOI = 320, 300, 301, 302  # the LLM-side model: a vocabulary wide enough for UTF-8 bytes as ids


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"), 3)


@pytest.fixture(scope="module")
def hf_model(gemma3_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(gemma3_dir).eval()


def _hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.model.get_image_features(pixel_values=pixel).pooler_output


def test_dense_path_is_hf_image_features(gemma3_dir, hf_model):
    source = load_source(str(gemma3_dir))
    assert source.family == "gemma3" and not source.has_cls and source.num_patches == TOKENS
    assert source.spatial_merge == 4 and source.num_blocks == 3 and source.image_size == SIZE
    assert source.details["token_counts"]["merged_grid_thw"] == [1, 4, 4]
    assert source.mean == (0.5, 0.5, 0.5)
    for batch in (1, 3):
        x = torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, TOKENS, WIDTH)
        assert_close(got, _hf_rows(hf_model, x))


def test_the_check_has_teeth(gemma3_dir, hf_model):
    """Without the post_layernorm, or with the pooled groups taken from a transposed grid, it is not Gemma 3."""
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    expected = _hf_rows(hf_model, x)
    source = load_source(str(gemma3_dir))
    connector = source.pipeline.projector
    with torch.inference_mode():
        h = torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(8))
        transposed = h.reshape(2, 16, 16, 32).transpose(1, 2).reshape(2, 256, 32)
        assert (connector(h) - connector(transposed)).abs().max() > 1e-3
        source.pipeline.final_norm = False
        wrong = source.pipeline(x)
    assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


@pytest.fixture(scope="module")
def divprune_bundle(gemma3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_bundles") / "divprune"
    return compile_model(str(gemma3_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, gemma3_dir, hf_model):
    check_rows_on_ort(divprune_bundle, gemma3_dir, lambda pixel: _hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="gemma3", readme="Gemma 3 tokens")


@pytest.mark.parametrize(*OTHER_METHODS)
def test_other_methods_on_ort(gemma3_dir, tmp_path, method, options):
    check_other_method(gemma3_dir, tmp_path / "b", method, options, keep=6, width=WIDTH)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(gemma3_dir, tmp_path, target, method, batch, options):
    check_tensorrt(gemma3_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(gemma3_dir, tmp_path):
    check_openvino(gemma3_dir, tmp_path / "b")


@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, gemma3_dir, tmp_path, target, method):
    """The whole Gemma 3 graph, the 4x4 pooling too, on the HTP emulator (int16) and the RKNN simulator (fp16)."""
    check_qnn_or_rk3588(request, gemma3_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "average-pools each 4x4 group"),
    (["--method", "visionzip"], "average-pools each 4x4 group"),
    (["--method", "tome"], "average-pools each 4x4 group"),
    (["--method", "random"], "average-pools each 4x4 group"),
    (["--method", "cls", "--score", "attention"], "not over the pooled tokens"),
    (["--method", "holov"], "not over the pooled tokens"),
    (["--method", "cdpruner"], "not over the pooled tokens"),
    (["--image-size", "224"], "has a fixed image size"),
    (["--feature-layer", "-2"], "--feature-layer does not apply to gemma3"),
])
def test_refusals_are_one_line(gemma3_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", gemma3_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)
    assert not (tmp_path / "b").exists()


def test_methods_lists_gemma3_from_its_declarations():
    check_methods_listing("Gemma 3")


def test_preset_has_gemma3_4b_tower_shapes():
    source = load_source("gemma3-4b-896")
    pipe = source.pipeline
    assert source.family == "gemma3" and source.image_size == 896 and source.patch_size == 14
    assert source.num_patches == 256 and source.num_blocks == 27 and not source.has_cls
    assert source.details["token_counts"] == {"image_size": 896, "patch_grid": [64, 64], "patches": 4096,
                                              "spatial_merge": 4, "merged_grid_thw": [1, 16, 16], "tokens": 256}
    tower = pipe.vision_model
    assert tower.config.hidden_size == 1152 and tower.embeddings.position_embedding.weight.shape == (4096, 1152)
    assert tower.config.intermediate_size == 4304 and tower.config.num_attention_heads == 16
    assert pipe.projector.mm_input_projection_weight.shape == (1152, 2560)
    assert pipe.projector.kernel_size == 4
    params = sum(p.numel() for p in tower.parameters())
    assert 410e6 < params < 420e6  # SigLIP-So400m without its pooling head, at 896 px's 4096 positions
    # the connector on the tower's token count (a full forward at 896 px takes minutes on 2 cores)
    with torch.inference_mode():
        out = pipe.projector(torch.randn(1, 4096, 1152))
    assert out.shape == (1, 256, 2560) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ the LLM side


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_llm"), 5, image_token_id=IMAGE, boi=BOI, eoi=EOI,
                       vocab_size=VOCAB)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def llm_bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8))


def test_prompt_is_gemma3s_image_sequence(llm_dir):
    """The image sits where Gemma 3's processor puts it: "\\n\\n<boi>" before, "<eoi>\\n\\n" after."""
    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    prompt = gen.build_prompt(vlm, "what is in the image?")
    assert prompt.before[-3:] == [10, 10, BOI] and prompt.after[:3] == [EOI, 10, 10]
    assert "Gemma 3's chat convention" in prompt.how and prompt.text.startswith("<start_of_turn>user\n")


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    """generate's dense splice is HF's forward with the image tokens marked (token_type_ids 1, as Gemma 3's processor
    gives them): bidirectional among the image rows; the causal-only forward gives other logits."""
    from vlmprune.compiler import generate as gen

    vlm, prompt, pixel, hf = check_dense_splice(llm_dir, cat, "what is in the image?", TOKENS, WIDTH)
    ids = gen.hf_forward_ids(vlm, prompt, TOKENS)
    assert ids["token_type_ids"].sum() == TOKENS and ids["token_type_ids"][0, len(prompt.before)] == 1
    with torch.inference_mode():
        causal = vlm.model(input_ids=ids["input_ids"], pixel_values=torch.from_numpy(pixel),
                           logits_to_keep=1).logits[0, -1]
    assert (causal - hf).abs().max() > 1e-4  # the bidirectional image block counts


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions as one image block, give the logits
    of HF's own forward given its own tower's rows of those 8 tokens, token types 1 there, at those positions; other
    positions give others, and HF's forward without an attention mask does not give them (its mask builder then reads
    the positions' gaps as packed sequences)."""
    at_kept, hf = check_pruned_splice(
        llm_bundle, llm_dir, cat, "what is in the image?", TOKENS, IMAGE, _hf_rows, pooled=lambda rows: rows[None],
        extra=lambda ids: {"token_type_ids": (ids == IMAGE).long(), "attention_mask": torch.ones_like(ids)})
    try:  # why generate passes a mask of ones: without one, transformers 5.25's packed-sequence path raises here
        unmasked = at_kept(attention_mask=None)
    except IndexError:
        unmasked = None
    assert unmasked is None or (unmasked - hf).abs().max() > 1e-4


def test_generate_cli_and_eval(llm_bundle, llm_dir, cat, tmp_path):
    """`vlmprune generate` answers through Gemma 3's LLM (transformers); eval's harness holds (its dense splice is
    HF's forward) and the bundle's rows give its reference's figures."""
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", cat,
                     "--prompt", "what is in the image?", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "Gemma 3's chat convention" in result.output
    check_eval(llm_bundle, llm_dir, tmp_path, ["what is in the image?"], TOKENS)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    """The LLM-side model with a Gemma 3 processor: a byte-level tokenizer, its chat template, its image processor."""
    path = tmp_path_factory.mktemp("tiny_gemma3_processor")
    ids = gemma3_processor(path, SIZE, TOKENS)
    return tiny_gemma3(path, 5, image_token_id=ids["image_token_id"], boi=ids["boi"], eoi=ids["eoi"],
                       vocab_size=VOCAB)


def test_generate_through_gemma3s_chat_template_and_processor(processor_dir, cat, tmp_path):
    """generate's prompt is the processor's own: its chat template, the boi token expanded to "\n\n<boi>", the image
    tokens and "<eoi>\n\n", the same token types; its dense splice gives HF's forward on the processor's own inputs;
    `vlmprune generate` on a pruned bundle answers through it."""
    from PIL import Image
    from transformers import AutoProcessor

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(processor_dir))
    prompt = gen.build_prompt(vlm, "what is in the image?")
    assert prompt.how == "the checkpoint's chat template"
    processor = AutoProcessor.from_pretrained(processor_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(cat).convert("RGB")], return_tensors="pt")
    ids = gen.hf_forward_ids(vlm, prompt, TOKENS)
    assert ids["input_ids"].tolist() == inputs["input_ids"].tolist()
    assert ids["token_type_ids"].tolist() == inputs["token_type_ids"].tolist()
    image = gen.dense_image(vlm, inputs["pixel_values"].numpy())
    ours = gen.answer(vlm, prompt, image.rows, *image.place(len(prompt.before)), 1)
    with torch.inference_mode():
        hf = vlm.model(**inputs, logits_to_keep=1).logits[0, -1].float()
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)

    bundle = compile_model(str(processor_dir), tmp_path / "b", CompileOptions(method="divprune", keep=8))
    result = run_cli("generate", bundle.bundle, "--image", cat, "--prompt", "what is in the image?",
                     "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "the checkpoint's chat template" in result.output


def test_with_llm_on_orin_is_refused_in_one_line_before_any_work(llm_dir, tmp_path):
    """Edge-LLM's exporter (orin) does not know Gemma 3's decoder: refused before the tower's export, nothing written
    (target ort's torch exporter takes it: test_gemma3_llm.py)."""
    result = run_cli("compile", llm_dir, "-o", tmp_path / "c", "--target", "orin", "--method", "divprune", "--keep",
                     "6", "--with-llm")
    one_line_error(result, "gemma3")
    assert not (tmp_path / "c").exists()
