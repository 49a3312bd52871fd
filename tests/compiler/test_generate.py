"""`vlmprune generate` and the manifest's `llm` section on a tiny random LLaVA with a real (offline) tokenizer.

Tiny random LLMs answer gibberish, so everything here compares token ids, logits and the
position ids that reach the model, never text meaning. Two bundles are compiled once for
the module: a dense one (--no-prune) and a pruned one (cls, K = 32 of 64 patches).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error as _one_line_error, run_cli as _run

IMAGE_TOKEN = 100
WORDS = ["<unk>", "<s>", "</s>", "USER:", "ASSISTANT:", "what", "is", "in", "the", "image", "picture", "describe",
         "?", "a", "cat"]
PROMPT = "what is in the image ?"


def tiny_vlm(path: Path, seed: int = 1, tokenizer: bool = True, tower: str = "clip") -> Path:
    """A LlavaForConditionalGeneration (2-block CLIP or SigLIP tower, 64 patches; 2-layer Llama, vocab 128) and a
    WordLevel tokenizer that knows <image> (id 100) and adds <s>. The LLM's weights are drawn wider than
    Llama's default (std 0.3) so that its greedy answers vary instead of repeating one token."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              SiglipVisionConfig)

    torch.manual_seed(seed)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
                  patch_size=14)
    vision = CLIPVisionConfig(**common) if tower == "clip" else SiglipVisionConfig(**common)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, initializer_range=0.3)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                         vision_feature_select_strategy="default" if tower == "clip" else "full",
                         image_token_index=IMAGE_TOKEN)
    LlavaForConditionalGeneration(config).eval().save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {w: i for i, w in enumerate(WORDS)}
        vocab.update({f"w{i}": i for i in range(len(WORDS), 128) if i != IMAGE_TOKEN})
        vocab["<image>"] = IMAGE_TOKEN
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                additional_special_tokens=["<image>"]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image
    from skimage import data

    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("generate")
    model = tiny_vlm(root / "model")
    image = root / "cat.png"
    Image.fromarray(data.chelsea()).save(image)
    dense = compile_model(str(model), root / "dense", CompileOptions(prune=False)).bundle
    pruned = compile_model(str(model), root / "cls32", CompileOptions(keep=32)).bundle
    return {"model": model, "image": image, "dense": dense, "pruned": pruned, "root": root}


def _hf_inputs(setup, tokens: int):
    """input_ids and pixel_values the way transformers' own LlavaProcessor builds them (the pixels preprocessed
    as the bundle's manifest says, so that both sides see the same image)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.frontend.images import load_image_file

    pre = load_manifest(setup["dense"])["preprocess"]
    pixel, _, _ = load_image_file(str(setup["image"]), pre["size"], pre["mean"], pre["std"])
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 112},
                                                                  crop_size={"height": 112, "width": 112}),
                               tokenizer=AutoTokenizer.from_pretrained(setup["model"]), patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    from PIL import Image

    ids = processor(images=Image.open(setup["image"]), text=f"USER: <image>\n{PROMPT} ASSISTANT:",
                    return_tensors="pt")["input_ids"]
    assert int((ids == IMAGE_TOKEN).sum()) == tokens
    return ids, torch.from_numpy(pixel)


def test_dense_bundle_generates_what_transformers_generates(setup):
    from vlmprune.compiler.generate import generate, load_vlm

    result = generate(setup["dense"], None, setup["image"], PROMPT, max_new_tokens=12)
    assert result.answer.image_tokens == 64 and result.kept is None
    ids, pixel = _hf_inputs(setup, 64)
    expected = result.prompt.before + [IMAGE_TOKEN] * 64 + result.prompt.after
    assert ids[0].tolist() == expected  # the prompt, built as transformers' processor builds it
    vlm = load_vlm(str(setup["model"]))
    with torch.inference_mode():
        hf = vlm.model.generate(input_ids=ids, pixel_values=pixel, max_new_tokens=12, do_sample=False)
    hf_tokens = hf[0, ids.shape[1]:].tolist()
    assert result.answer.tokens == hf_tokens, (result.answer.tokens, hf_tokens)
    assert len(set(hf_tokens)) > 2  # an answer that varies, so the comparison means something
    assert result.answer.position_ids == list(range(len(expected)))
    dense = generate(setup["dense"], None, setup["image"], PROMPT, dense=True, max_new_tokens=12)
    assert dense.answer.tokens == hf_tokens and dense.path == "dense"


def test_pruned_tokens_reach_the_llm_at_their_original_positions(setup):
    from vlmprune.compiler import generate as gen

    result = gen.generate(setup["pruned"], None, setup["image"], PROMPT, max_new_tokens=6)
    kept, before, after = result.kept, result.prompt.before, result.prompt.after
    assert len(kept) == 32 and kept == sorted(kept) and result.answer.image_tokens == 33  # K + summary
    offset = len(before)
    expected = (list(range(offset)) + [offset + k for k in kept] + [offset + 64]
                + [offset + 65 + i for i in range(len(after))])
    assert result.answer.position_ids == expected

    vlm = gen.load_vlm(str(setup["model"]))
    seen = []
    hook = vlm.model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True)
    try:
        from vlmprune.compiler.bundle import load_manifest
        from vlmprune.compiler.frontend.images import load_image_file

        manifest = load_manifest(setup["pruned"])
        pre = manifest["preprocess"]
        pixel, _, _ = load_image_file(str(setup["image"]), pre["size"], pre["mean"], pre["std"])
        tokens = gen.bundle_tokens(setup["pruned"], manifest, pixel)
        positions, text_start = gen.bundle_positions(tokens, offset)
        again = gen.answer(vlm, result.prompt, tokens.features, positions, text_start, 3)
    finally:
        hook.remove()
    assert seen[0] == expected  # what the model was given, not what we say we gave it
    assert [s[0] for s in seen[1:]] == [expected[-1] + 1, expected[-1] + 2]  # decoding continues after the prompt
    assert again.tokens == result.answer.tokens[:3]

    # A hand-built call: the bundle's rows in place of the placeholder, the same positions.
    embed = vlm.model.get_input_embeddings()
    rows = torch.cat([embed(torch.tensor([before])), tokens.features[None], embed(torch.tensor([after]))], 1)
    with torch.inference_mode():
        logits = vlm.model(inputs_embeds=rows, position_ids=torch.tensor([expected])).logits[0, -1]
    torch.testing.assert_close(logits, result.answer.first_logits, rtol=0, atol=1e-5)
    assert int(logits.argmax()) == result.answer.tokens[0]
    # Pruning moved the distribution (KL > 0), the dense bundle against itself did not.
    from vlmprune.compiler.evaluate import kl_divergence

    dense = gen.generate(setup["dense"], None, setup["image"], PROMPT, max_new_tokens=1)
    assert kl_divergence(dense.answer.first_logits, dense.answer.first_logits) == 0.0
    assert kl_divergence(dense.answer.first_logits, result.answer.first_logits) > 1e-6


def test_positions_rule():
    from vlmprune.compiler.frontend.family import image_positions
    from vlmprune.compiler.frontend.qwen2_vl import thw_positions

    positions, text = image_positions(5, 65, 1, np.array([0, 3, 63]), 1)  # [CLS] kept, 3 patches, a summary
    assert positions.tolist() == [5, 6, 9, 69, 70] and text == 71
    positions, text = image_positions(2, 4, 0, None, 0)
    assert positions.tolist() == [2, 3, 4, 5] and text == 6
    positions, text = thw_positions(3, np.array([[0, 0, 1], [0, 2, 3]]), (1, 4, 6))  # Qwen2-VL's mRoPE rule
    assert positions.tolist() == [[3, 3], [3, 5], [4, 6]] and text == 9


def test_manifest_llm_section_and_readme(setup):
    from vlmprune.compiler.bundle import load_manifest

    llm = load_manifest(setup["pruned"])["llm"]
    assert llm["image_tokens"] == 33 and llm["dense_image_tokens"] == 64 and llm["hidden_size"] == 64
    assert llm["dtype"] == "float32" and llm["rows"] == {"prefix": 0, "kept": 32, "extra": 1}
    assert llm["positions"]["kind"] == "indices" and llm["positions"]["outputs"] == ["kept_indices"]
    assert llm["text_resumes_at"] == 65
    dense = load_manifest(setup["dense"])["llm"]
    assert dense["image_tokens"] == 64 and dense["positions"]["outputs"] == [] and dense["rows"]["extra"] == 0
    readme = (setup["pruned"] / "README.md").read_text()
    section = readme.split("## Handing the tokens to the language model")[1]
    assert "**33 image tokens**" in section and "hidden size **64**" in section
    for call in ("prompt_table=table", "torch.arange(vocab_size, vocab_size + 33)", "llama_batch_init(33, 64, 1)",
                 ".n_image_tokens = 33", "--minImageTokens 33", '"image_features": "image_features"',
                 "from offset + 65"):
        assert call in section, call


def test_generate_cli(setup):
    result = _run("generate", setup["pruned"], "--image", setup["image"], "--prompt", PROMPT, "--max-new-tokens", 4,
                  "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == "pruned" and data["image_tokens"] == 33 and len(data["tokens"]) <= 4
    assert len(data["kept_indices"]) == 32 and isinstance(data["text"], str)
    assert data["image_start"] == 2  # <s> USER: before <image>: FastV's --image-start for this template
    result = _run("generate", setup["pruned"], "--image", setup["image"], "--prompt", PROMPT, "--max-new-tokens", 4,
                  "--dense")
    assert result.exit_code == 0 and "dense: 64 image tokens" in result.output, result.output


def test_generate_bad_input(setup, tiny_clip_dir):
    bundle, image = setup["pruned"], setup["image"]
    _one_line_error(_run("generate", bundle, "--image", setup["root"] / "none.png", "--prompt", PROMPT),
                    "no such image file")
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", PROMPT, "--max-new-tokens", 0),
                    "--max-new-tokens must be an integer >= 1")
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", "  "), "--prompt is empty")
    from vlmprune.compiler.generate import supported

    # The list is every family that declares a language model, in the families' own words.
    # main's families first, in table order; the families added since after them
    assert supported().startswith("LLaVA on DINOv2, LLaVA, LLaVA-NeXT, LLaVA-OneVision clips, Qwen2-VL / Qwen2.5-VL, "
                                  "Qwen3-VL, InternVL3")
    assert "SmolVLM" in supported() and "Gemma 3" in supported()
    assert supported().endswith(" checkpoints (their ...ForConditionalGeneration)")
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", PROMPT, "--model", tiny_clip_dir),
                    f"generate and eval run {supported()}; this one is 'clip_vision_model'")
    other = tiny_vlm(setup["root"] / "other", seed=2)
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", PROMPT, "--model", other),
                    "is not the model this bundle was compiled from")
    _one_line_error(_run("generate", setup["root"], "--image", image, "--prompt", PROMPT), "not a vlmprune bundle")


def test_chat_template_prompt(setup):
    """A tokenizer's text-only chat template: the placeholder goes into the text, a BOS it writes is not doubled."""
    from vlmprune.compiler.generate import build_prompt, load_vlm

    vlm = load_vlm(str(setup["model"]))
    vlm.tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}USER: {{ m['content'] }}{% endfor %}"
                                   "{% if add_generation_prompt %} ASSISTANT:{% endif %}")
    vlm.chat_template = vlm.tokenizer
    prompt = build_prompt(vlm, PROMPT)
    assert prompt.text == f"<s>USER: <image>\n{PROMPT} ASSISTANT:" and prompt.how == "the checkpoint's chat template"
    assert prompt.before == [1, 3] and prompt.after == vlm.tokenizer(f"{PROMPT} ASSISTANT:",
                                                                     add_special_tokens=False)["input_ids"]


def test_demo_model_is_the_preset_and_prompts_without_a_tokenizer():
    """`--model demo` is the preset's own weights (same content hash), and with no tokenizer the prompt is bytes."""
    from vlmprune.compiler.frontend.presets import load_preset
    from vlmprune.compiler.generate import build_prompt, load_vlm

    vlm = load_vlm("demo")
    assert vlm.source.content_hash == load_preset("demo").content_hash
    prompt = build_prompt(vlm, "hi")
    assert prompt.before == list(b"USER: ") and prompt.after == list(b"\nhi ASSISTANT:")
    assert "UTF-8 bytes" in prompt.how


def test_a_moved_source_is_named_and_found_with_model(setup, tmp_path):
    """generate's default model and eval's MODEL as the bundle records it: the source moved, so say so."""
    from cli_helpers import eval_inputs
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    source = tiny_vlm(tmp_path / "model")
    bundle = compile_model(str(source), tmp_path / "dense", CompileOptions(prune=False)).bundle
    moved = source.rename(tmp_path / "moved")
    args = ["--image", setup["image"], "--prompt", PROMPT, "--max-new-tokens", 1]
    result = _run("generate", bundle, *args)
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: the bundle's source {source} was not found (moved?); pass --model PATH"], result.output
    result = _run("generate", bundle, *args, "--model", moved)
    assert result.exit_code == 0, result.output
    images, prompts = eval_inputs(tmp_path, {"cat.png": np.zeros((28, 28, 3), np.uint8)}, [PROMPT])
    result = _run("eval", source, "--images", images, "--prompts", prompts, "--bundle", bundle)
    assert result.stderr.splitlines() == [
        f"error: the bundle's source {source} was not found (moved?); pass its new path as MODEL"], result.output


def test_a_fastv_graph_compiled_for_another_image_start_is_named():
    """generate warns when the bundle's FastV prefill graph expects the image elsewhere than this prompt puts it."""
    from vlmprune.compiler.bundle.manifest import Manifest
    from vlmprune.compiler.generate import fastv_mismatch

    manifest = Manifest({"llm_graphs": {"fastv": {"image_start": 5, "image_tokens": 33, "layer": 1, "keep": 0.5}}})
    assert fastv_mismatch(manifest, 5) is None
    assert fastv_mismatch(Manifest({"llm_graphs": {"fastv": None}}), 2) is None and fastv_mismatch(Manifest(), 2) is None
    assert fastv_mismatch(manifest, 2) == ("this bundle's FastV prefill graph was compiled with --image-start 5, but "
                                           "this prompt puts the image at token 2: recompile with --image-start 2")


def test_a_fastv_bundle_answers_with_its_own_llm_graph_and_reference_with_transformers(setup):
    """A --with-llm FastV bundle: generate decodes with llm/prefill.onnx + decode.onnx (FastV inside) by default.

    Shown by the numbers: the answer's first-token logits are FastV's (the plain-torch FastV reference on the same
    embeddings and positions, 1e-4) and not the dense decoder's (transformers, which --reference runs); the graph's
    kept image tokens are FastV's, and greedy tokens follow the FastV reference step by step.
    """
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.llm.fastv import FastVSpec, reference_generate, reference_prefill
    from vlmprune.compiler.llm.lm_source import language_model
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    bundle = compile_model(str(setup["model"]), setup["root"] / "fastv", CompileOptions(
        keep=32, with_llm=True, fastv_layer=1, fastv_keep=0.25, image_start=2)).bundle
    steps = 4
    graph = gen.generate(bundle, None, setup["image"], PROMPT, max_new_tokens=steps)
    assert graph.llm == "the bundle's LLM graphs (llm/prefill.onnx + llm/decode.onnx, ONNX Runtime)"
    assert graph.fastv_warning is None and len(graph.fastv_kept) == 8  # 0.25 of the 33 image rows
    reference = gen.generate(bundle, None, setup["image"], PROMPT, max_new_tokens=steps, reference=True)
    assert reference.llm.startswith("transformers (--reference") and reference.fastv_kept is None
    assert reference.answer.position_ids == graph.answer.position_ids and reference.kept == graph.kept

    manifest = load_manifest(bundle)
    vlm = gen.load_vlm(str(setup["model"]), bundle=manifest)
    pixel, _ = gen.load_pixels(vlm, setup["image"], manifest.preprocess)
    tokens = gen.bundle_tokens(bundle, manifest, pixel, vlm)
    embed = vlm.model.get_input_embeddings()
    ids = lambda values: torch.tensor([values])  # noqa: E731
    with torch.inference_mode():
        embeds = torch.cat([embed(ids(graph.prompt.before)), tokens.features[None], embed(ids(graph.prompt.after))], 1)
    positions = torch.tensor([graph.answer.position_ids])
    lm = language_model(str(setup["model"]))
    spec = FastVSpec(2, 33, 1, 0.25)
    fastv = reference_prefill(lm, embeds, spec, positions)
    torch.testing.assert_close(graph.answer.first_logits, fastv.logits[0].float(), rtol=0, atol=1e-4)
    assert graph.fastv_kept == fastv.kept[0].tolist()
    assert (graph.answer.first_logits - reference.answer.first_logits).abs().max() > 1e-3  # FastV changed them
    expected = reference_generate(lm, embeds, spec, len(graph.answer.tokens), positions)[0].tolist()
    assert graph.answer.tokens == expected
    for flags, said in (((), "language model: the bundle's LLM graphs (llm/prefill.onnx + llm/decode.onnx"),
                        (("--reference",), "language model: transformers (--reference")):
        result = _run("generate", bundle, "--image", setup["image"], "--prompt", PROMPT, "--max-new-tokens", 2, *flags)
        assert result.exit_code == 0 and said in result.output, result.output


def test_a_bundle_without_an_llm_says_transformers_answered(setup):
    result = _run("generate", setup["pruned"], "--image", setup["image"], "--prompt", PROMPT, "--max-new-tokens", 2)
    assert result.exit_code == 0, result.output
    assert "language model: transformers (the bundle holds no language model" in result.output
