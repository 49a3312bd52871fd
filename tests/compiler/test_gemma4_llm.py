"""Gemma 4's language model exported `--with-llm` (target ort, the torch exporter), against Hugging Face itself.

A tiny Gemma 4 built offline (tiny_models.tiny_gemma4, seed 13, spread_llm: every LLM matrix, embedding table, norm
scale and layer_scalar drawn): 5 LLM layers 48 wide (sliding, global, sliding, sliding, global; sliding window 8; the
global layers' head size 32, the sliding ones' 24, each type its own rotary embedding, the global one proportional),
the last 2 layers sharing KV (layer 3 reads layer 2's cache, layer 4 layer 1's), per-layer embeddings 8 wide, the
image block bidirectional in the sliding layers (use_bidirectional_attention "vision"), final logit softcapping 30,
vocabulary 320 so that a prompt without a tokenizer is UTF-8 bytes. What is checked:
- a divprune bundle (on the pooled tokens, Gemma 4's only site) compiled --with-llm passes its compile-time LLM parity
  (transformers' own text model under its own masks, given the per-layer embeddings), its prefill takes image_rows and
  per_layer_inputs, its decode per_layer_inputs, it has 3 caches for 5 layers and every layer's attention fused;
- the exported prefill + decode, given HF's own tower rows of the bundle's 8 kept tokens at their original positions
  inside generate's prompt (longer than the window), give HF's own Gemma4ForConditionalGeneration forward's logits
  (mm_token_type_ids 1 at the image rows, the image rows' per-layer embeddings the pad token's) and caches, then its
  greedy tokens and logits step by step on the cache; the image block, the per-layer embeddings and the shared KV
  each count;
- `vlmprune generate` answers through the bundle's graphs with HF's greedy tokens on the same pruned features
  (--reference);
- FastV and mixture-of-experts blocks are refused in one line before any work, as are the onnxruntime-genai and
  Edge-LLM exporters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import cat_image, check_generate_through_graphs, check_greedy_steps
from tiny_models import edited_copy, tiny_gemma4
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, BOI, EOI = 320, 300, 301, 302
KEEP, WINDOW = 8, 8
PROMPT = "what is in the image?"
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
TEXT = dict(num_hidden_layers=5, layer_types=TYPES, num_kv_shared_layers=2, sliding_window=WINDOW, vocab_size=VOCAB,
            global_head_dim=32, final_logit_softcapping=30.0)


def bound(want) -> float:
    """The fp32 contract's bound: 1e-4 + 1e-5 * max|want|."""
    return 1e-4 + 1e-5 * float(np.abs(np.asarray(want)).max())


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4_llm"), 13, image_token_id=IMAGE, boi=BOI, eoi=EOI,
                       spread_llm=True, **TEXT)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_with_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=KEEP, with_llm=True))


def test_with_llm_bundle_passes_its_llm_parity_and_says_what_it_takes(bundle):
    import onnx

    manifest = bundle.manifest
    assert bundle.report.passed, manifest["parity"]
    graphs = manifest["llm_graphs"]
    assert graphs["family"] == "gemma4_text" and graphs["layers"] == 5 and graphs["fastv"] is None
    assert graphs["image_block"] and graphs["image_block_layers"] == "sliding" and graphs["sliding_window"] == WINDOW
    assert graphs["layer_types"] == TYPES and graphs["per_layer_inputs"] == 8
    assert graphs["cache_layers"] == 3 and graphs["kv_sources"] == [0, 1, 2, 2, 1]
    assert graphs["cache_shapes"] == [[1, 24], [1, 32], [1, 24]]
    parity = graphs["parity"]
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= 1e-4
    assert parity["decomposed"]["passed"] and parity["prompt_tokens"] > WINDOW  # the window masks in the check
    assert [i["name"] for i in graphs["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids", "image_rows",
                                                                     "per_layer_inputs"]
    decode_inputs = [i["name"] for i in graphs["io"]["decode"]["inputs"]]
    assert decode_inputs[:3] == ["inputs_embeds", "position_ids", "per_layer_inputs"] and len(decode_inputs) == 3 + 6
    assert len(graphs["io"]["prefill"]["outputs"]) == 1 + 6  # logits and 3 key/value pairs, not 5
    for name in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(bundle.bundle / "llm" / name, load_external_data=False)
        assert sum(n.op_type == "MultiHeadAttention" for n in model.graph.node) == 5, name
    readme = (bundle.bundle / "README.md").read_text()
    assert "`per_layer_inputs` [batch, sequence, 5, 8]" in readme and "layers 3-4 have no cache of their own" in readme
    assert "bidirectional in the sliding-window layers only" in readme


def _case(bundle, llm_dir, cat):
    """(vlm, prompt, HF's own tower rows at the kept tokens, the prompt's position ids [1, L], ids [1, L])."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.frontend.gemma4 import grid_positions, hf_patches

    vlm = gen.load_vlm(str(llm_dir))
    pixel, _ = gen.load_pixels(vlm, cat)
    prompt = gen.build_prompt(vlm, PROMPT)
    tokens = gen.bundle_tokens(bundle.bundle, bundle.manifest, pixel, vlm)
    kept = np.asarray(tokens.kept)
    source = bundle.manifest["model"]
    side = source["image_size"] // source["patch_size"]
    with torch.inference_mode():
        out = vlm.model.model.get_image_features(pixel_values=hf_patches(torch.from_numpy(pixel), source["patch_size"]),
                                                 image_position_ids=grid_positions(side))
    rows = torch.stack(out.pooler_output)[0, kept]
    positions, text_start = gen.bundle_positions(tokens, len(prompt.before))
    offset = len(prompt.before)
    position_ids = torch.from_numpy(np.concatenate([np.arange(offset), positions,
                                                    text_start + np.arange(len(prompt.after))]))[None]
    ids = torch.tensor([prompt.before + [IMAGE] * KEEP + prompt.after])
    return vlm, prompt, rows, position_ids, ids


def test_graphs_are_hf_gemma4_forward_and_greedy_on_the_same_kept_tokens(bundle, llm_dir, cat):
    """Prefill logits and caches = HF's Gemma4ForConditionalGeneration forward (its own rows of the 8 kept tokens
    through mm_encoder_outputs, mm_token_type_ids 1 there, the kept tokens' original positions); then each decode
    step's logits and greedy token = HF's forward on its own cache. Blanking the image block, the image rows'
    per-layer embeddings or a shared layer's reuse changes the logits."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    vlm, prompt, rows, position_ids, ids = _case(bundle, llm_dir, cat)
    model, offset = vlm.model, len(prompt.before)
    length = ids.shape[1]
    assert length > 3 * WINDOW  # the sliding layers see a part of the prompt only
    assert position_ids[0, offset + KEEP - 1] - position_ids[0, offset] > KEEP  # gaps: original positions
    types = (ids == IMAGE).long()
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=position_ids, mm_token_type_ids=types,
                    attention_mask=torch.ones_like(ids), use_cache=True,
                    mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=(rows,))})
        embed = model.get_input_embeddings()
        embeds = torch.cat([embed(torch.tensor([prompt.before])), rows[None],
                            embed(torch.tensor([prompt.after]))], dim=1)
        per_layer = vlm.rules.llm_embeds_args(model, prompt.before, KEEP, prompt.after)["per_layer_inputs"]
    hf, cache = out.logits[0, -1].float(), out.cache

    graphs = GraphRunner(bundle.bundle / "llm")
    extra = {"image_rows": types[..., None].float().numpy(), "per_layer_inputs": per_layer.numpy()}
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy(), extra)
    np.testing.assert_allclose(logits, hf.numpy(), rtol=0, atol=bound(hf))
    # the two shared layers keep no cache, in HF (a DummyLayer each) as in the graphs
    assert [type(layer).__name__ for layer in cache.layers[3:]] == ["DummyLayer"] * 2 and len(state) == 6
    for i, layer in enumerate(cache.layers[:3]):  # HF's sliding layers keep their last rows only: those compared
        for part, tensor in (("key", layer.keys), ("value", layer.values)):
            got = state[f"past_key_values.{i}.{part}"]
            assert got.shape[2] == length and tensor.shape[2] <= length
            want = tensor.numpy()
            np.testing.assert_allclose(got[:, :, length - want.shape[2]:], want, rtol=0, atol=bound(want))
    for name, blanked in (("image_rows", 0 * extra["image_rows"]),  # the bidirectional image block counts
                          ("per_layer_inputs", 0 * extra["per_layer_inputs"])):  # the per-layer embeddings count
        other, _ = graphs.prefill(embeds.numpy(), position_ids.numpy(), {**extra, name: blanked})
        assert np.abs(other - hf.numpy()).max() > 1e-3, name

    check_greedy_steps(model, embed, graphs, state, hf, cache, logits, int(position_ids[0, -1]) + 1,
                       step_extra=lambda token: {k: v.detach().numpy() for k, v in
                                                 vlm.rules.llm_embeds_args(model, token[0].tolist(), 0, []).items()},
                       atol=bound(hf))


def test_the_shared_kv_counts(llm_dir, tmp_path):
    """The same weights with no shared layers (layers 3 and 4 with caches of their own) give other logits in HF: the
    reuse the graphs compute is part of what they match."""
    from transformers import AutoModelForImageTextToText

    own = edited_copy(llm_dir, tmp_path / "own", lambda c: c["text_config"].update(num_kv_shared_layers=0))
    ids = torch.arange(20)[None] + 32
    with torch.inference_mode():
        shared = AutoModelForImageTextToText.from_pretrained(llm_dir).eval()(input_ids=ids).logits[0, -1]
        other = AutoModelForImageTextToText.from_pretrained(own).eval()(input_ids=ids).logits[0, -1]
    assert (shared - other).abs().max() > 1e-3


def test_generate_answers_through_the_bundles_graphs_with_hfs_greedy_tokens(bundle, llm_dir, cat):
    """`vlmprune generate` decodes with the bundle's graphs (the prompt's per-layer embeddings, the pad token's at the
    image rows, then each token's) and gives HF's greedy tokens on the same pruned features."""
    check_generate_through_graphs(bundle.bundle, llm_dir, cat, PROMPT, KEEP)


def test_fastv_is_refused_in_one_line_before_any_work(llm_dir, tmp_path):
    result = run_cli("compile", llm_dir, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm",
                     "--fastv-layer", "1", "--image-start", "3")
    one_line_error(result, "--fastv-layer with language model type 'gemma4_text' is not supported: FastV's reference")
    assert "export (torch.onnx" not in result.output and not (tmp_path / "b").exists()


@pytest.mark.parametrize("config, line", [
    (dict(enable_moe_block=True), "gemma4_text with enable_moe_block (Gemma 4's mixture-of-experts layers"),
    (dict(num_kv_shared_layers=5), "gemma4_text with every layer sharing KV (num_kv_shared_layers 5 of 5"),
    (dict(use_bidirectional_attention="all"), "gemma4_text with use_bidirectional_attention (an embedding model")],
    ids=["moe", "all-shared", "bidirectional"])
def test_what_the_exporter_does_not_compute_is_refused_in_one_line(config, line):
    """Gemma 4's mixture-of-experts blocks (26B-A4B), a model whose every layer reads another's cache and a
    bidirectional (embedding) model: one line each, from the config alone, naming the feature."""
    from types import SimpleNamespace

    from vlmprune.compiler.errors import InputError
    from vlmprune.compiler.llm.lm_source import check_family

    with pytest.raises(InputError, match=line.replace("(", r"\(")) as caught:
        check_family(SimpleNamespace(model_type="gemma4_text", num_hidden_layers=5, **config))
    assert "is not supported for export" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("args", [["--llm-exporter", "genai"], ["--target", "orin"]], ids=["genai", "edgellm"])
def test_the_other_exporters_refuse_it_in_one_line_before_any_work(llm_dir, tmp_path, args):
    """onnxruntime-genai's builder (--llm-exporter genai) and Edge-LLM's exporter (orin) do not know Gemma 4's decoder:
    refused before the tower's export, nothing written."""
    result = run_cli("compile", llm_dir, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm",
                     *args)
    one_line_error(result, "gemma4")
    assert "export (torch.onnx" not in result.output and not (tmp_path / "b").exists()


def test_a_gemma4_with_k_eq_v_and_neither_ple_nor_image_block_matches_hf(tmp_path):
    """The config's other branches, the export and its parity on their own: global layers whose values are the key
    projection (attention_k_eq_v) with key/value heads of their own (num_global_key_value_heads 2), no per-layer
    embeddings (no per_layer_inputs input), no bidirectional image block (no image_rows), no softcapping; no shared
    KV."""
    from vlmprune.compiler.llm import lm_source
    from vlmprune.compiler.llm.torch_exporter import export_decoder, llm_parity

    model_dir = tiny_gemma4(tmp_path / "m", 17, image_token_id=IMAGE, boi=BOI, eoi=EOI, spread_llm=True,
                            num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            vocab_size=VOCAB, sliding_window=WINDOW, attention_k_eq_v=True, num_global_key_value_heads=2,
                            hidden_size_per_layer_input=0, use_bidirectional_attention=None)
    lm = lm_source.language_model(str(model_dir))
    assert lm.model.layers[2].self_attn.v_proj is None and not lm_source.has_image_block(lm.config)
    written = export_decoder(lm, None, tmp_path / "llm")
    assert [i["name"] for i in written["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids"]
    assert [i["name"] for i in written["io"]["decode"]["inputs"]][2] == "past_key_values.0.key"
    got = llm_parity(lm, None, tmp_path / "llm", 8)
    assert got["passed"] and got["tokens_identical"] and got["logits_max_abs"] <= 1e-4, got
