"""`vlmprune generate` and `vlmprune eval` for Qwen2-VL / Qwen2.5-VL (mRoPE) and LLaVA-NeXT (anyres crops).

Tiny checkpoints saved offline by transformers, without tokenizers (the prompt goes in as UTF-8
bytes, so the vocabularies are 320 and the special ids above 255). The numbers are checked
against the Hugging Face model itself:

- the harness check: the dense image through generate's splice (its positions: the full mRoPE
  grid, or consecutive over the packed crops) gives the first-token logits of the model's own
  forward on input_ids + pixel_values (+ image_grid_thw / image_sizes), to 1e-4;
- every token "kept" through the pruned path (the positions rule, LLaVA-NeXT's assembly) is the
  dense path;
- a compiled bundle's kept tokens reach the LLM at the positions HF's get_rope_index (Qwen) or
  its packed sequence (LLaVA-NeXT) gives them, and eval's bundle row equals its reference row.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tiny_models
from cli_helpers import eval_inputs, one_line_error as _one_line_error, run_cli as _run

VOCAB, IMAGE, VIDEO, START, END = 320, 300, 301, 302, 303
PROMPT = "what is in the image?"


def tiny_qwen(path, family: str = "qwen2_vl", seed: int = 20):
    """Qwen2-VL (2 blocks) or Qwen2.5-VL (3 blocks, windows of 56 px) with a 1-layer LLM, vocab 320."""
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return tiny_models.tiny_qwen(path, family, seed, ids, vocab_size=VOCAB, initializer_range=0.3)


def tiny_llava_next(path, seed: int = 21):
    """LLaVA-NeXT: CLIP tower at 56 px (16 patches a crop), grids 1x2, 2x1, 2x2; 1-layer Llama, vocab 320."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=56, patch_size=14)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.3)
    config = LlavaNextConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                             vision_feature_select_strategy="default", image_token_index=IMAGE,
                             image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]])
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_(0.0, 1.0)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from skimage import data

    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("generate_families")
    images, prompts = eval_inputs(root, {"cat.png": data.chelsea(), "coffee.png": data.coffee()[:, :300]},  # tall
                                  [PROMPT])
    models = {"qwen2_vl": tiny_qwen(root / "qwen2_vl"), "qwen2_5_vl": tiny_qwen(root / "qwen2_5_vl", "qwen2_5_vl", 22),
              "llava_next": tiny_llava_next(root / "llava_next")}
    bundles = {
        "qwen2_vl": compile_model(str(models["qwen2_vl"]), root / "qwen_divprune8",
                                  CompileOptions(method="divprune", keep=8, family_options={"image_size": 112})).bundle,
        "llava_next": compile_model(str(models["llava_next"]), root / "next_cls30", CompileOptions(keep=30)).bundle,
    }
    return {"root": root, "images": images, "image": images / "cat.png", "prompts": prompts, "models": models,
            "bundles": bundles}


def _vlm(setup, family, **kwargs):
    from vlmprune.compiler.generate import load_vlm

    return load_vlm(str(setup["models"][family]), **kwargs)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_next"])
def test_harness_dense_splice_is_the_hf_forward(setup, family):
    """generate's dense path (HF's own image features, spliced at our positions) = the model's own forward."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits, kl_divergence

    vlm = _vlm(setup, family, **({"image_size": 112} if family.startswith("qwen") else {}))
    pixel, _ = gen.load_pixels(vlm, setup["image"])
    prompt = gen.build_prompt(vlm, PROMPT)
    image = gen.dense_image(vlm, pixel)
    dense = 16 if family.startswith("qwen") else 16 + 8 * 9  # 4x4 merged; base + 8 grid rows of 8 + newline
    assert image.rows.shape == (dense, 48)
    positions, text_start = image.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, image.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, len(image.rows))
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    assert kl_divergence(hf, ours.first_logits) < 1e-8
    if family.startswith("qwen"):
        assert prompt.before[-1] == START and prompt.after[0] == END  # <|vision_start|> pads <|vision_end|>
        o = len(prompt.before)
        assert np.array(ours.position_ids).shape == (3, o + dense + len(prompt.after))
        assert text_start == o + 4 and positions[:, -1].tolist() == [o, o + 3, o + 3]
        # The check has teeth: 1-D consecutive positions are not Qwen's mRoPE.
        wrong = gen.answer(vlm, prompt, image.rows, np.arange(o, o + dense), o + dense, 1)
        assert (wrong.first_logits - hf).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_next"])
def test_every_token_kept_is_the_dense_path(setup, family):
    """K = the dense count through the pruned path (positions rule; LLaVA-NeXT's assembly) equals the dense path."""
    from vlmprune.compiler import generate as gen

    vlm = _vlm(setup, family, **({"image_size": 112} if family.startswith("qwen") else {}))
    pixel, _ = gen.load_pixels(vlm, setup["image"])
    prompt = gen.build_prompt(vlm, PROMPT)
    source = vlm.source
    with torch.inference_mode():
        if source.crops is None:
            features = source.pipeline(torch.from_numpy(pixel))[0]
        else:
            source.pipeline.pack = False  # each crop's features: what a pruned bundle selects from
            features = source.pipeline(torch.from_numpy(pixel)).reshape(-1, 48)
            source.pipeline.pack = True
    everything = gen.pruned_image(vlm, features, np.arange(len(source.position_table)), None, 0, 0)
    dense = gen.dense_image(vlm, pixel)
    torch.testing.assert_close(everything.rows, dense.rows, rtol=1e-5, atol=1e-5)
    offset = len(prompt.before)
    (p_all, t_all), (p_dense, t_dense) = everything.place(offset), dense.place(offset)
    assert np.array_equal(p_all, p_dense) and t_all == t_dense
    a = gen.answer(vlm, prompt, everything.rows, p_all, t_all, 4)
    b = gen.answer(vlm, prompt, dense.rows, p_dense, t_dense, 4)
    torch.testing.assert_close(a.first_logits, b.first_logits, rtol=0, atol=1e-4)
    assert a.tokens == b.tokens


def test_qwen_bundle_tokens_at_their_mrope_positions(setup):
    """The pruned bundle's 8 of 16 merged tokens reach the LLM at get_rope_index's (t, h, w) of the dense image."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import kl_divergence

    bundle = setup["bundles"]["qwen2_vl"]
    vlm = _vlm(setup, "qwen2_vl", image_size=112)
    seen = []
    hook = vlm.model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        from vlmprune.compiler.bundle import load_manifest

        manifest = load_manifest(bundle)
        pixel, _ = gen.load_pixels(vlm, setup["image"], manifest["preprocess"])
        prompt = gen.build_prompt(vlm, PROMPT)
        tokens = gen.bundle_tokens(bundle, manifest, pixel, vlm)
        o = len(prompt.before)
        positions, text_start = gen.bundle_positions(tokens, o)
        pruned = gen.answer(vlm, prompt, tokens.features, positions, text_start, 3)
    finally:
        hook.remove()
    kept = np.array(tokens.kept)
    assert len(kept) == 8 and tokens.features.shape == (8, 48)
    # HF's own mRoPE index of the dense prompt: the kept tokens' columns, and where the text resumes.
    ids = gen.hf_forward_ids(vlm, prompt, 16)
    rope, _ = vlm.model.model.get_rope_index(ids["input_ids"], ids["mm_token_type_ids"],
                                             image_grid_thw=torch.tensor([[1, 8, 8]]))
    rope = rope[:, 0].numpy()
    expected = np.concatenate([rope[:, :o], rope[:, o + kept], rope[:, o + 16:]], axis=1)
    assert np.array_equal(seen[0][:, 0].numpy(), expected)  # what the model was given
    assert text_start == rope[0, o + 16]
    assert [int(s[0, 0, 0]) for s in seen[1:]] == [expected.max() + 1, expected.max() + 2]  # decoding continues
    dense = gen.generate(bundle, None, setup["image"], PROMPT, dense=True, max_new_tokens=3)
    again = gen.generate(bundle, None, setup["image"], PROMPT, max_new_tokens=3)
    assert again.answer.tokens == pruned.tokens and again.kept == kept.tolist() and again.path == "pruned"
    kl = kl_divergence(dense.answer.first_logits, pruned.first_logits)
    assert np.isfinite(kl) and kl > 1e-6


def test_llava_next_bundle_rows_at_their_packed_positions(setup):
    """cls K = 30 over the 5 crops (+ a summary): rows assembled with image_newline, at dense packed positions."""
    from vlmprune.compiler import generate as gen

    bundle = setup["bundles"]["llava_next"]
    result = gen.generate(bundle, None, setup["image"], PROMPT, max_new_tokens=3)
    kept = np.array(result.kept)
    assert len(kept) == 30 and np.array_equal(kept, np.sort(kept))
    o = len(result.prompt.before)
    pos = np.array(result.answer.position_ids)
    image = pos[o: o + result.answer.image_tokens]
    # Each kept token's packed position, from its flat index c * 16 + r * 4 + x, independently of handoff.
    crop, r, x = kept // 16, kept % 16 // 4, kept % 4
    y, xg = (crop - 1) // 2 * 4 + r, (crop - 1) % 2 * 4 + x
    packed = np.where(crop == 0, r * 4 + x, 16 + y * 9 + xg)
    newlines = 16 + np.unique(y[crop > 0]) * 9 + 8
    assert np.array_equal(image, np.concatenate([np.sort(np.concatenate([packed, newlines])) + o, [o + 88]]))
    assert pos[o + len(image)] == o + 89  # the text after the summary token
    dense = gen.generate(bundle, None, setup["image"], PROMPT, dense=True, max_new_tokens=3)
    assert dense.answer.image_tokens == 88 and dense.answer.position_ids == list(range(len(dense.answer.position_ids)))
    assert len(result.answer.tokens) == 3


def test_eval_qwen_and_llava_next(setup):
    """eval's reference rows and a bundle's: the harness holds, figures finite, the bundle equals its reference."""
    from vlmprune.compiler.evaluate import evaluate

    for family, method, keep in (("qwen2_vl", "divprune", 8), ("llava_next", "cls", 30)):
        report = evaluate(str(setup["models"][family]), setup["images"], setup["prompts"], [method], [keep],
                          max_new_tokens=2, bundles=[setup["bundles"][family]])
        assert report["harness_kl_max"] < 1e-8, family
        reference, compiled = report["results"]
        assert reference["from"] == "reference" and compiled["from"].startswith("bundle")
        for a, b in zip(reference["samples"], compiled["samples"]):
            assert np.isfinite(a["kl"]) and a["kl"] > 0
            assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6) and a["pruned_tokens"] == b["pruned_tokens"]
        assert report["dense_image_tokens"] == (16 if family == "qwen2_vl" else 88)


def test_generate_and_eval_cli_and_bad_input(setup):
    bundle, image = setup["bundles"]["qwen2_vl"], setup["image"]
    result = _run("generate", bundle, "--image", image, "--prompt", PROMPT, "--max-new-tokens", 2, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == "pruned" and data["image_tokens"] == 8 and len(data["position_ids"]) == 3
    result = _run("generate", setup["bundles"]["llava_next"], "--image", image, "--prompt", PROMPT,
                  "--max-new-tokens", 2, "--dense")
    assert result.exit_code == 0 and "dense: 88 image tokens" in result.output, result.output
    # The wrong checkpoint for a bundle, a family option on the other family, a bundle at another size.
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", PROMPT, "--model",
                         setup["models"]["llava_next"]), "is not the model this bundle was compiled from")
    _one_line_error(_run("generate", bundle, "--image", image, "--prompt", PROMPT, "--model",
                         setup["models"]["qwen2_5_vl"]), "is not the model this bundle was compiled from")
    args = ["--images", setup["images"], "--prompts", setup["prompts"]]
    _one_line_error(_run("eval", setup["models"]["llava_next"], *args, "--image-size", 112, "-m", "dart", "-k", 8),
                    "--image-size applies to Qwen2-VL")
    _one_line_error(_run("eval", setup["models"]["qwen2_vl"], *args, "--bundle", bundle, "--image-size", 140),
                    "compiled at --image-size 112")
    _one_line_error(_run("eval", setup["models"]["qwen2_vl"], *args, "--image-size", 100, "-m", "dart", "-k", 8),
                    "--image-size must be a multiple of 28")
    _one_line_error(_run("eval", setup["models"]["llava_next"], *args, "--grid", "3x3", "-m", "dart", "-k", 8),
                    "this model's grids are")
    _one_line_error(_run("eval", setup["models"]["llava_next"], *args, "-m", "visionzip", "-k", 8),
                    "not available for anyres crops")
