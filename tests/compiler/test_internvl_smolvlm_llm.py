"""InternVL3's, InternVL3.5's and SmolVLM's language models exported `--with-llm` (target ort, the torch exporter),
against Hugging Face itself.

Their decoders are layers the exporter knows (InternVL3: Qwen2, q/k/v biases; InternVL3.5: Qwen3, a per-head RMSNorm
on the queries and keys before the rotation, head size 32 apart from hidden / heads; SmolVLM: Llama), read from the
VLM's own decoder (lm_source.language_model); what is theirs is the prompt around the image (Family.image_prompt:
InternVL's <img> ... </img>, SmolVLM's <fake_token_around_image><global-img> ... <fake_token_around_image>) and the
kept rows' original 1-D positions. Each family gets a tiny checkpoint built offline with a byte-level tokenizer and
its chat template (tiny_models, seed 7): 2 LLM layers 48 wide, 2 query heads on 1 KV head (GQA), the embedding tied
to the head as the released InternVL3-1B and SmolVLM-256M have it, their rotary bases (1M, 100k), vocabulary 320, and
every LLM weight spread (matrices, Qwen2's biases, each RMSNorm's scale around 1, Qwen3's q_norm / k_norm among
them), so that a layer spelled wrongly
shows. What is checked:
- InternVL3's prompt is its processor's: the template's <IMG_CONTEXT> expanded as transformers' InternVLProcessor
  expands one tile (SmolVLM's is checked in test_smolvlm);
- a divprune K=8 bundle compiled --with-llm passes its compile-time LLM parity (figures in the manifest), its llm/
  holds the fused pair (one MultiHeadAttention a layer) and the decomposed pair (standard ops only, the ONNX
  checker passes), the prefill takes inputs_embeds and position_ids only; `vlmprune check` passes its llm stage;
- the exported prefill + decode, given HF's own tower rows of the bundle's 8 kept tokens at their original positions
  inside generate's prompt, give the logits of HF's own full-model forward (mm_encoder_outputs) and then HF's own
  greedy tokens step by step on its cache; consecutive positions give other logits (the positions count);
- `vlmprune generate` answers through the bundle's graphs with HF's greedy tokens on the same pruned features
  (--reference runs them in transformers);
- FastV compiles into their prefill (--image-start: the prompt tokens before the image, as generate prints it): its
  first logits, kept tokens and greedy tokens are FastV's reference's, not the dense decoder's;
- refused in one line before any work: FastV at a layer past the decoder's last but one, and an InternVL checkpoint
  whose language model is a decoder the exporter does not know (InternVL3.5's MoE checkpoints: Qwen3-MoE); --with-llm
  on a bare tower names the checkpoints that hold a language model, InternVL3 and SmolVLM among them.
InternVL3.5's further checks (its caches against HF's, the q/k norms counting, onnxruntime-genai, orin) are in
test_internvl35_llm.
"""

from __future__ import annotations

import json
import types

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import cat_image, check_generate_through_graphs, check_greedy_steps
from tiny_models import edited_copy, tiny_internvl, tiny_internvl35, tiny_smolvlm
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, TOKENS, KEEP, LAYERS = 320, 300, 16, 8, 2
PROMPT = "what is in the image?"
LLM = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS, num_key_value_heads=1, tie_word_embeddings=True)
# family -> (its tiny checkpoint's builder, its LLM's model_type, its rotary base)
FAMILIES = {"internvl": (tiny_internvl, "qwen2", 1e6), "internvl35": (tiny_internvl35, "qwen3", 1e6),
            "smolvlm": (tiny_smolvlm, "llama", 1e5)}


def _pixels(family: str, pixel: np.ndarray) -> torch.Tensor:
    """get_image_features' pixel input for one preprocessed image (SmolVLM's takes [batch, images, 3, S, S])."""
    x = torch.from_numpy(pixel)
    return x[:, None] if family == "smolvlm" else x


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    """(family, checkpoint dir, divprune K=8 bundle compiled --with-llm) of one family."""
    family = request.param
    build, _, base = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"{family}_llm")
    ckpt = build(root / "ckpt", 7, image_token_id=IMAGE, tokenizer=True, spread_llm=True,
                 rope_parameters={"rope_type": "default", "rope_theta": base}, **LLM)
    bundle = compile_model(str(ckpt), root / "divprune", CompileOptions(method="divprune", keep=KEEP, with_llm=True))
    return family, ckpt, bundle


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


def test_internvl_prompt_is_the_processors(tmp_path):
    """The prompt's ids are the chat template's text with <IMG_CONTEXT> expanded as transformers' InternVLProcessor
    expands one tile (its replace_image_token: <img>, the tile's tokens, </img>), tokenized."""
    from transformers import AutoTokenizer
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    from vlmprune.compiler import generate as gen

    ckpt = tiny_internvl(tmp_path / "ckpt", 7, image_token_id=IMAGE, tokenizer=True, vocab_size=VOCAB)
    prompt = gen.build_prompt(gen.load_vlm(str(ckpt)), PROMPT)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    processor = types.SimpleNamespace(start_image_token=tokenizer.start_image_token, image_token="<IMG_CONTEXT>",
                                      end_image_token=tokenizer.end_image_token, image_seq_length=TOKENS)
    expanded = text.replace("<IMG_CONTEXT>", InternVLProcessor.replace_image_token(processor, {"num_patches": [1]}, 0))
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert prompt.before + [IMAGE] * TOKENS + prompt.after == ids
    start, end = tokenizer.convert_tokens_to_ids(["<img>", "</img>"])
    assert prompt.before[-1] == start and prompt.after[0] == end and prompt.text == text


def test_with_llm_bundle_passes_its_llm_parity_and_says_what_it_takes(case):
    family, _ckpt, bundle = case
    manifest = bundle.manifest
    assert bundle.report.passed, manifest["parity"]
    assert manifest["llm"]["positions"]["kind"] == "indices" and manifest["llm"]["dense_image_tokens"] == TOKENS
    graphs = manifest["llm_graphs"]
    assert graphs["family"] == FAMILIES[family][1] and graphs["layers"] == LAYERS and graphs["kv_heads"] == 1
    assert graphs["fastv"] is None and not graphs["mrope"] and not graphs["image_block"]
    parity = graphs["parity"]
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= 1e-4
    assert parity["decomposed"]["passed"] and parity["fused_vs_decomposed"] <= 1e-4
    assert parity["prompt_tokens"] == KEEP + 4  # the bundle's K image rows, then text
    assert [i["name"] for i in graphs["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids"]
    llm = bundle.bundle / "llm"
    assert {f"llm/{n}" for n in ("prefill.onnx", "decode.onnx", "prefill.decomposed.onnx", "decode.decomposed.onnx",
                                 "llm.weights.bin")} <= set(manifest["files"])
    for name in ("prefill.onnx", "decode.onnx"):
        ops = [n.op_type for n in onnx.load(llm / name, load_external_data=False).graph.node]
        assert ops.count("MultiHeadAttention") + ops.count("GroupQueryAttention") == LAYERS and "Softmax" not in ops, name
    for name in ("prefill.decomposed.onnx", "decode.decomposed.onnx"):
        onnx.checker.check_model(str(llm / name))
        model = onnx.load(llm / name, load_external_data=False)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, name
        assert sum(n.op_type == "Softmax" for n in model.graph.node) == LAYERS, name
    readme = (bundle.bundle / "README.md").read_text()
    assert "## The language model (`--with-llm`)" in readme and f"({graphs['family']}, {LAYERS} layers" in readme


def test_check_reruns_the_llm_parity_on_the_bundles_files(case):
    _family, ckpt, bundle = case
    checked = run_cli("check", bundle.bundle, "--model", ckpt, "--json")
    assert checked.exit_code == 0, checked.output
    stages = {s["stage"]: s for s in json.loads(checked.stdout)["stages"]}
    assert stages["llm"]["passed"] and stages["llm"]["runtime"] == "onnxruntime (prefill + decode)"
    assert all(o["passed"] for o in stages["llm"]["outputs"].values()) and len(stages["llm"]["outputs"]) == 4


def _graph_runner(bundle):
    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    return GraphRunner(bundle.bundle / "llm")


def test_graphs_are_hf_forward_and_greedy_on_the_same_kept_tokens(case, cat):
    """Prefill logits = HF's own full-model forward (its own tower's rows of the 8 kept tokens through
    mm_encoder_outputs, at their original positions); then each decode step's logits and greedy token = HF's forward
    on its own cache. The same rows at consecutive positions give other logits."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from vlmprune.compiler import generate as gen

    family, ckpt, bundle = case
    vlm = gen.load_vlm(str(ckpt))
    pixel, _ = gen.load_pixels(vlm, cat)
    prompt = gen.build_prompt(vlm, PROMPT)
    tokens = gen.bundle_tokens(bundle.bundle, bundle.manifest, pixel, vlm)
    kept = np.asarray(tokens.kept)
    offset = len(prompt.before)
    positions, text_start = gen.bundle_positions(tokens, offset)
    np.testing.assert_array_equal(positions, offset + kept)  # original 1-D positions: the dense image's
    assert text_start == offset + TOKENS and positions[-1] - positions[0] >= KEEP

    model = vlm.model
    with torch.inference_mode():
        rows = model.model.get_image_features(pixel_values=_pixels(family, pixel)).pooler_output[0][kept]
    torch.testing.assert_close(torch.as_tensor(np.asarray(tokens.features)), rows, rtol=0, atol=1e-4)
    ids = torch.tensor([prompt.before + [IMAGE] * KEEP + prompt.after])
    position_ids = torch.from_numpy(np.concatenate([np.arange(offset), positions,
                                                    text_start + np.arange(len(prompt.after))]))[None]
    with torch.inference_mode():
        encoded = {"image": BaseModelOutputWithPooling(pooler_output=rows[None])}
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids), use_cache=True,
                    logits_to_keep=1, mm_encoder_outputs=encoded)
        embed = model.get_input_embeddings()
        embeds = torch.cat([embed(torch.tensor([prompt.before])), rows[None], embed(torch.tensor([prompt.after]))], 1)
    hf, cache = out.logits[0, -1].float(), out.cache

    graphs = _graph_runner(bundle)
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy())
    np.testing.assert_allclose(logits, hf.numpy(), rtol=0, atol=1e-4)
    packed = position_ids.clone()
    packed[0, offset:] = offset + torch.arange(ids.shape[1] - offset)
    other, _ = graphs.prefill(embeds.numpy(), packed.numpy())
    assert np.abs(other - hf.numpy()).max() > 1e-3  # the original positions count

    check_greedy_steps(model, embed, graphs, state, hf, cache, logits, int(position_ids[0, -1]) + 1)


def test_generate_answers_through_the_bundles_graphs_with_hfs_greedy_tokens(case, cat):
    """`vlmprune generate` decodes with the bundle's graphs and gives HF's greedy tokens on the same pruned features,
    through the checkpoint's own chat template."""
    _family, ckpt, bundle = case
    output = check_generate_through_graphs(bundle.bundle, ckpt, cat, PROMPT, KEEP)
    assert "the checkpoint's chat template" in output


def test_fastv_compiles_into_their_prefill(case, cat, tmp_path):
    """--fastv-layer 1 --fastv-keep 0.5 at the image start generate prints: the bundle's prefill keeps FastV's 4 of
    the 8 kept rows, its first logits and greedy tokens are FastV's reference's on the same embeddings and original
    positions, and not the dense decoder's."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.llm.fastv import FastVSpec, reference_generate, reference_prefill
    from vlmprune.compiler.llm.lm_source import language_model

    _family, ckpt, _bundle = case
    vlm = gen.load_vlm(str(ckpt))
    start = len(gen.build_prompt(vlm, PROMPT).before)
    bundle = compile_model(str(ckpt), tmp_path / "fastv", CompileOptions(
        method="divprune", keep=KEEP, with_llm=True, fastv_layer=1, fastv_keep=0.5, image_start=start)).bundle
    manifest = load_manifest(bundle)
    assert manifest["llm_graphs"]["fastv"]["kept"] == KEEP // 2 and manifest["llm_graphs"]["parity"]["kept_identical"]
    graph = gen.generate(bundle, str(ckpt), cat, PROMPT, max_new_tokens=4)
    reference = gen.generate(bundle, str(ckpt), cat, PROMPT, max_new_tokens=4, reference=True)
    assert graph.fastv_warning is None and len(graph.fastv_kept) == KEEP // 2
    assert graph.answer.position_ids == reference.answer.position_ids

    pixel, _ = gen.load_pixels(vlm, cat, manifest.preprocess)
    tokens = gen.bundle_tokens(bundle, manifest, pixel, vlm)
    embed = vlm.model.get_input_embeddings()
    with torch.inference_mode():
        embeds = torch.cat([embed(torch.tensor([graph.prompt.before])), torch.as_tensor(tokens.features)[None],
                            embed(torch.tensor([graph.prompt.after]))], 1)
    positions = torch.tensor([graph.answer.position_ids])
    lm, spec = language_model(str(ckpt)), FastVSpec(start, KEEP, 1, 0.5)
    fastv = reference_prefill(lm, embeds, spec, positions)
    torch.testing.assert_close(graph.answer.first_logits, fastv.logits[0].float(), rtol=0, atol=1e-4)
    assert graph.fastv_kept == fastv.kept[0].tolist()
    assert (graph.answer.first_logits - reference.answer.first_logits).abs().max() > 1e-3  # FastV changed them
    assert graph.answer.tokens == reference_generate(lm, embeds, spec, len(graph.answer.tokens), positions)[0].tolist()


def test_fastv_past_the_decoders_layers_is_refused_in_one_line(case, tmp_path):
    """FastV's layer must leave a layer to run on the kept tokens: checked from the config, before any work."""
    _family, ckpt, _bundle = case
    result = run_cli("compile", ckpt, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm",
                     "--fastv-layer", str(LAYERS + 1), "--image-start", "3")
    one_line_error(result, f"--fastv-layer must be between 1 and {LAYERS - 1} (this LLM has {LAYERS} layers), got "
                           f"{LAYERS + 1}")
    assert "export (torch.onnx" not in result.output and not (tmp_path / "b").exists()


def test_an_internvl_whose_llm_the_exporter_does_not_know_is_refused_in_one_line(tmp_path):
    """InternVL3.5's MoE checkpoints hold a Qwen3-MoE decoder (a router over expert MLPs), which no exporter here
    spells: refused from the config alone, before the tower's export, with the reason."""
    ckpt = tiny_internvl(tmp_path / "ckpt", 7, image_token_id=IMAGE, vocab_size=VOCAB)
    moe = edited_copy(ckpt, tmp_path / "moe", lambda c: c["text_config"].update(model_type="qwen3_moe"))
    result = run_cli("compile", moe, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm")
    one_line_error(result, "language model type 'qwen3_moe' is not supported for export: Qwen3-MoE's decoder")
    assert "mixture of experts" in result.output
    assert "export (torch.onnx" not in result.output and not (tmp_path / "b").exists()


def test_with_llm_on_a_bare_tower_names_the_checkpoints_that_hold_a_language_model(tmp_path):
    """The line is read from the families' declarations (Family.language_model), so InternVL3 and SmolVLM are in it."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=56, patch_size=14)).save_pretrained(tmp_path / "clip")
    result = run_cli("compile", tmp_path / "clip", "-o", tmp_path / "b", "--keep", "6", "--with-llm")
    one_line_error(result, "--with-llm needs `demo` or a VLM checkpoint that holds its language model (")
    assert "InternVL3, SmolVLM" in result.output and "is model type 'clip_vision_model'" in result.output
    assert not (tmp_path / "b").exists()
