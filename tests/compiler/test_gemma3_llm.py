"""Gemma 3's language model exported `--with-llm` (target ort, the torch exporter), against Hugging Face itself.

A tiny Gemma 3 built offline (tiny_models.tiny_gemma3, seed 11, every LLM matrix spread and every norm's scale drawn,
since transformers' init leaves the (1 + w) norms at 1 and the layer would then hide a wrong norm): 3 LLM layers 48
wide (sliding, sliding, global; sliding window 8, the two rotary bases 10k and 1M; query_pre_attn_scalar 256, not the
head size 24), vocabulary 320 so that a prompt without a tokenizer is UTF-8 bytes. What is checked:
- a divprune bundle compiled --with-llm passes its compile-time LLM parity (transformers' own text model under its own
  image-block masks), its prefill takes image_rows and every layer's attention is fused, the manifest says so;
- the exported prefill + decode, given the bundle's 8 kept tokens as HF's own tower gives them at their original
  positions inside generate's prompt (longer than the sliding window), give the logits of HF's own
  Gemma3ForConditionalGeneration forward (token_type_ids 1 at the image rows) and then HF's own greedy tokens, step
  by step on the cache; the image block counts (all-zero image_rows give other logits) and the window counts (a
  window wide enough to see the whole prompt gives other logits in HF);
- `vlmprune generate` answers through the bundle's graphs with HF's greedy tokens on the same pruned features (what
  --reference runs in transformers);
- FastV and attention softcapping are refused in one line before any work (Gemma 4's decoder:
  test_gemma4_llm.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import cat_image, check_generate_through_graphs, check_greedy_steps
from tiny_models import edited_copy, tiny_gemma3
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, BOI, EOI = 320, 300, 301, 302
TOKENS, KEEP, WINDOW = 16, 8, 8
PROMPT = "what is in the image?"
TEXT = dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=WINDOW, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_llm"), 11, image_token_id=IMAGE, boi=BOI, eoi=EOI,
                       spread_llm=True, **TEXT)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_with_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=KEEP, with_llm=True))


def test_with_llm_bundle_passes_its_llm_parity_and_says_what_it_takes(bundle):
    import onnx

    manifest = bundle.manifest
    assert bundle.report.passed, manifest["parity"]
    graphs = manifest["llm_graphs"]
    assert graphs["family"] == "gemma3_text" and graphs["layers"] == 3 and graphs["fastv"] is None
    assert graphs["image_block"] and graphs["sliding_window"] == WINDOW
    assert graphs["layer_types"] == TEXT["layer_types"]
    parity = graphs["parity"]
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= 1e-4
    assert parity["decomposed"]["passed"] and parity["prompt_tokens"] > WINDOW  # the window masks in the check
    assert [i["name"] for i in graphs["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids", "image_rows"]
    assert manifest["llm"]["image_block"]["llm_graph_input"] == "image_rows"
    for name in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(bundle.bundle / "llm" / name, load_external_data=False)
        assert sum(n.op_type == "MultiHeadAttention" for n in model.graph.node) == 3, name
    readme = (bundle.bundle / "README.md").read_text()
    assert "`image_rows` [batch, sequence, 1]" in readme and f"see the last {WINDOW} rows" in readme


def _graph_runner(bundle):
    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    return GraphRunner(bundle.bundle / "llm")


def _case(bundle, llm_dir, cat):
    """(vlm, prompt ids, HF's own tower rows at the kept tokens, their positions, the text's start) for one prompt."""
    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    pixel, _ = gen.load_pixels(vlm, cat)
    prompt = gen.build_prompt(vlm, PROMPT)
    tokens = gen.bundle_tokens(bundle.bundle, bundle.manifest, pixel, vlm)
    kept = np.asarray(tokens.kept)
    with torch.inference_mode():
        rows = vlm.model.model.get_image_features(pixel_values=torch.from_numpy(pixel)).pooler_output[0, kept]
    positions, text_start = gen.bundle_positions(tokens, len(prompt.before))
    return vlm, prompt, rows, positions, text_start


def test_graphs_are_hf_gemma3_forward_and_greedy_on_the_same_kept_tokens(bundle, llm_dir, cat):
    """Prefill logits = HF's Gemma3ForConditionalGeneration forward (its own rows of the 8 kept tokens through
    mm_encoder_outputs, token_type_ids 1 there, the kept tokens' original positions); then each decode step's logits
    and greedy token = HF's forward on its own cache."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    vlm, prompt, rows, positions, text_start = _case(bundle, llm_dir, cat)
    model, offset = vlm.model, len(prompt.before)
    ids = torch.tensor([prompt.before + [IMAGE] * KEEP + prompt.after])
    length = ids.shape[1]
    assert length > 3 * WINDOW  # the sliding layers see a part of the prompt only
    position_ids = torch.from_numpy(np.concatenate([np.arange(offset), positions,
                                                    text_start + np.arange(len(prompt.after))]))[None]
    assert position_ids[0, offset:offset + KEEP].tolist() == positions.tolist() and positions[-1] - positions[0] > KEEP
    types = (ids == IMAGE).long()
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=position_ids, token_type_ids=types,
                    attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                    mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=rows[None])})
        embed = model.get_input_embeddings()
        embeds = torch.cat([embed(torch.tensor([prompt.before])), rows[None],
                            embed(torch.tensor([prompt.after]))], dim=1)
    hf, cache = out.logits[0, -1].float(), out.cache

    graphs = _graph_runner(bundle)
    image_rows = types[..., None].float().numpy()
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy(), {"image_rows": image_rows})
    np.testing.assert_allclose(logits, hf.numpy(), rtol=0, atol=1e-4)
    blind, _ = graphs.prefill(embeds.numpy(), position_ids.numpy(), {"image_rows": 0 * image_rows})
    assert np.abs(blind - hf.numpy()).max() > 1e-3  # the bidirectional image block counts

    check_greedy_steps(model, embed, graphs, state, hf, cache, logits, int(position_ids[0, -1]) + 1)


def test_the_sliding_window_counts(llm_dir, tmp_path):
    """The same model with a window wider than the prompt gives other logits in HF: the window the graphs mask is
    part of what they match."""
    from transformers import AutoModelForImageTextToText

    wide = edited_copy(llm_dir, tmp_path / "wide", lambda c: c["text_config"].update(sliding_window=4096))
    ids = torch.arange(40)[None] + 32
    with torch.inference_mode():
        narrow = AutoModelForImageTextToText.from_pretrained(llm_dir).eval()(input_ids=ids).logits[0, -1]
        other = AutoModelForImageTextToText.from_pretrained(wide).eval()(input_ids=ids).logits[0, -1]
    assert (narrow - other).abs().max() > 1e-3


def test_generate_answers_through_the_bundles_graphs_with_hfs_greedy_tokens(bundle, llm_dir, cat):
    """`vlmprune generate` decodes with the bundle's graphs and gives HF's greedy tokens on the same pruned features."""
    check_generate_through_graphs(bundle.bundle, llm_dir, cat, PROMPT, KEEP)


def test_fastv_is_refused_in_one_line_before_any_work(llm_dir, tmp_path):
    result = run_cli("compile", llm_dir, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm",
                     "--fastv-layer", "1", "--image-start", "3")
    one_line_error(result, "--fastv-layer with language model type 'gemma3_text' is not supported: FastV's reference")
    assert "export (torch.onnx" not in result.output and not (tmp_path / "b").exists()


def test_attention_softcapping_is_refused_in_one_line_before_any_work(llm_dir, tmp_path):
    capped = edited_copy(llm_dir, tmp_path / "capped",
                         lambda c: c["text_config"].update(attn_logit_softcapping=50.0))
    result = run_cli("compile", capped, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm")
    one_line_error(result, "gemma3_text with attn_logit_softcapping 50.0 is not supported for export")
    assert not (tmp_path / "b").exists()

