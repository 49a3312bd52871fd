"""FastV's plain-torch reference against the Hugging Face model itself (torch only, seconds).

Two independent checks: R = 1 is the dense model exactly, and the gathered form (later layers
run on the kept tokens only, original positions) equals FastV's official attention-mask form
(every token stays, layers after K cannot attend to the dropped image tokens), with the kept
set taken from the model's own `output_attentions`.
"""

from __future__ import annotations

import pytest
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm.fastv import FastVSpec, causal_mask, eager_attention, reference_generate, reference_prefill
from vlmprune.compiler.llm.lm_source import decoder_of


def tiny_lm(family: str, layers: int = 3, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if family == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**common)))
    return model.eval()


SPAN = dict(image_start=3, image_len=16)  # 3 text tokens, 16 image tokens, then text


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_keeping_every_image_token_is_the_dense_model(family, batch):
    model = tiny_lm(family)
    embeds = torch.randn(batch, 24, 32, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        dense = model(inputs_embeds=embeds, use_cache=True)
    ours = reference_prefill(model, embeds, FastVSpec(**SPAN, layer=2, keep=1.0))
    torch.testing.assert_close(ours.logits, dense.logits[:, -1], rtol=0, atol=1e-5)
    for mine, theirs in zip(ours.cache.layers, dense.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)


def _official_kept(model, embeds, spec):
    """The kept set from layer K's attention weights, as the model itself reports them (output_attentions)."""
    with torch.no_grad(), eager_attention(model):
        attentions = model(inputs_embeds=embeds, output_attentions=True).attentions
    row = attentions[spec.layer - 1][:, :, -1, spec.image_start:spec.image_end].mean(dim=1)
    return torch.sort(row, dim=-1, descending=True, stable=True).indices[:, :spec.kept].sort(dim=-1).values


def _official_mask_form(model, embeds, spec, kept):
    """FastV's evaluated implementation: every token stays, and every layer after K runs with the dropped
    image tokens masked out as keys. Returns the last token's logits."""
    inner, _config = decoder_of(model)
    b, length, _ = embeds.shape
    dropped = torch.ones(b, length, dtype=torch.bool)
    dropped[:, :spec.image_start] = False
    dropped[:, spec.image_end:] = False
    dropped.scatter_(1, kept + spec.image_start, False)
    full = causal_mask(length).expand(b, 1, length, length)
    pruned = full.masked_fill(dropped[:, None, None, :], torch.finfo(torch.float32).min)
    positions = torch.arange(length).expand(b, -1)
    hidden = embeds
    with torch.no_grad(), eager_attention(model):
        rope = inner.rotary_emb(hidden, positions)
        for i, layer in enumerate(inner.layers):
            hidden = layer(hidden, attention_mask=full if i < spec.layer else pruned, position_embeddings=rope)
        return model.lm_head(inner.norm(hidden[:, -1:]))[:, 0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_gathered_fastv_equals_the_official_mask_form(family, batch):
    model = tiny_lm(family, layers=4)
    spec = FastVSpec(**SPAN, layer=2, keep=0.5)
    embeds = torch.randn(batch, 24, 32, generator=torch.Generator().manual_seed(10 + batch))
    ours = reference_prefill(model, embeds, spec)
    kept = _official_kept(model, embeds, spec)
    logits = _official_mask_form(model, embeds, spec, kept)
    assert torch.equal(ours.kept, kept)
    torch.testing.assert_close(ours.logits, logits, rtol=0, atol=1e-5)
    lengths = [layer.keys.shape[2] for layer in ours.cache.layers]
    assert lengths == [24, 24, 24 - 16 + 8, 24 - 16 + 8]  # layers 1..K cache every token, later layers the kept
    assert torch.equal(ours.positions[:, :3], torch.arange(3).expand(batch, -1))  # original positions
    assert torch.equal(ours.positions[:, 3:11], kept + 3)
    # Pruning changes the answer (the test could fail): the dense logits differ.
    with torch.no_grad():
        assert (model(inputs_embeds=embeds).logits[:, -1] - ours.logits).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_on_the_shortened_cache_equals_the_mask_form(family):
    """A decode step at original position S on the FastV cache = the mask form over prompt + that token."""
    from vlmprune.compiler.llm.fastv import reference_decode

    model = tiny_lm(family)
    spec = FastVSpec(**SPAN, layer=1, keep=0.25)
    embeds = torch.randn(2, 22, 32, generator=torch.Generator().manual_seed(3))
    step = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))
    prefill = reference_prefill(model, embeds, spec)
    logits = reference_decode(model, step, torch.full((2, 1), 22), prefill.cache)
    expected = _official_mask_form(model, torch.cat([embeds, step], dim=1), spec, prefill.kept)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    tokens = reference_generate(model, embeds, spec, 3)
    assert tokens.shape == (2, 3) and torch.equal(tokens[:, 0], prefill.logits.argmax(-1))


@pytest.mark.parametrize("spec,message", [
    (FastVSpec(**SPAN, layer=3), "--fastv-layer must be between 1 and 2"),
    (FastVSpec(**SPAN, layer=0), "--fastv-layer must be between 1 and 2"),
    (FastVSpec(**SPAN, keep=0.0), "--fastv-keep is the share"),
    (FastVSpec(**SPAN, keep=float("nan")), "--fastv-keep is the share"),
    (FastVSpec(image_start=3, image_len=21), "must end with text after the image span"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(InputError, match=message):
        reference_prefill(tiny_lm("llama"), torch.zeros(1, 24, 32), spec)


def test_unsupported_language_model_is_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(InputError, match="language model type 'gpt2' is not supported"):
        reference_prefill(model, torch.zeros(1, 24, 32), FastVSpec(**SPAN))


def test_a_one_layer_language_model_cannot_take_fastv():
    """No layer follows K in a one-layer LLM: say so instead of "between 1 and 0"."""
    with pytest.raises(InputError, match=r"^FastV needs a language model of at least 2 layers \(this LLM has 1\)$"):
        FastVSpec(**SPAN, layer=1).check(1)
