"""FastV inside the language model: the contract, and its plain-torch reference on the Hugging Face model.

FastV (Chen et al. 2024, pkunlp-icler/FastV) drops image tokens inside the LLM: after layer K
the image tokens the last prompt token attends to least are gone for every later layer. The
contract (`FastVSpec`):

- Layers 1..K run on every token and cache every token. Layer K's attention row of the last
  prompt token (its own Q and K after RoPE, GQA heads expanded, softmax in fp32 over every
  key, averaged over heads) is read over the image span [start, start + N).
- The top R·N image tokens of that row are kept (equal scores go to the lower index; kept
  tokens stay in ascending order). Layers K+1.. run on [text before, kept image tokens, text
  after] with their ORIGINAL position ids, and cache only those tokens; decoding continues at
  the prompt's last position + 1 on that shorter cache.
- R = 1 keeps every token: the dense model, exactly.

Choices against the official code, and why:
- The official code takes `layer_outputs[1]` at index AGG_LAYER, i.e. the attention weights
  of layer K (1-based; 0-based K-1), the last layer that sees every token; that is the layer
  used here (the issue's "layer L's own Q/K" with layers counted from 1, as `--layer` counts
  tower blocks). Pruning starts at 0-based index K, as in the official code.
- The official code scores batch element 0 only (`[0]`) and applies its choice to the whole
  batch; here every prompt gets its own selection (same image span for all).
- The official KV-cache variant keeps position ids contiguous after pruning ("correct rope,
  todo"); here kept tokens keep their original positions, as the issue asks (and as
  TensorRT Edge-LLM keeps pruned visual tokens' positions).
- R is the share kept (FastV's paper states the share dropped); kept = round(R·N), at least 1.

The reference runs the Hugging Face model's own decoder layers (eager attention, so that
layer K's attention weights are the model's own, not a recomputation), its rotary
embedding, norm and head. Batches are prompts of equal length (no padding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm.lm_source import decoder_of, uses_mrope
from vlmprune.passes.methods.selection import topk_lower_index


@dataclasses.dataclass(frozen=True)
class FastVSpec:
    """Where the image sits in the prompt (a compile option: the graph is built for it) and how FastV prunes it."""

    image_start: int  # index of the first image token in the prompt
    image_len: int  # N image tokens
    layer: int = 2  # K: layers 1..K see every token, layer K's attention chooses
    keep: float = 0.5  # R: the share of image tokens kept

    @property
    def kept(self) -> int:
        return max(1, min(self.image_len, int(math.floor(self.keep * self.image_len + 0.5))))

    @property
    def image_end(self) -> int:
        return self.image_start + self.image_len

    def check(self, num_layers: int) -> None:
        """One line for a spec the model cannot serve, before any work."""
        for name, value in (("image start", self.image_start), ("image length", self.image_len),
                            ("--fastv-layer", self.layer)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"FastV {name} must be an integer, got {value!r}")
        if self.image_start < 0 or self.image_len < 1:
            raise InputError(f"FastV image span must have start >= 0 and length >= 1, "
                             f"got start {self.image_start}, length {self.image_len}")
        if num_layers < 2:  # FastV drops tokens for the layers after K: a one-layer LLM has none
            raise InputError(f"FastV needs a language model of at least 2 layers (this LLM has {num_layers})")
        if not 1 <= self.layer < num_layers:
            raise InputError(f"--fastv-layer must be between 1 and {num_layers - 1} "
                             f"(this LLM has {num_layers} layers), got {self.layer}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or not math.isfinite(self.keep) \
                or not 0 < self.keep <= 1:
            raise InputError(f"--fastv-keep is the share of image tokens kept, in (0, 1], got {self.keep!r}")

    def check_prompt(self, length: int) -> None:
        if length <= self.image_end:
            raise InputError(f"the prompt ({length} tokens) must end with text after the image span "
                             f"[{self.image_start}, {self.image_end}): FastV scores from the last prompt token")


def default_positions(config, batch: int, length: int) -> torch.Tensor:
    """0..T-1 for every token (a dense text prompt): [B, T], or [3, B, T] with t = h = w for mRoPE."""
    positions = torch.arange(length).expand(batch, -1)
    return positions.expand(3, batch, length) if uses_mrope(config) else positions


def gather_positions(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """positions [B, T] or [3, B, T] at index [B, T'] along the sequence."""
    if positions.dim() == 3:
        return torch.gather(positions, 2, index.unsqueeze(0).expand(positions.shape[0], -1, -1))
    return torch.gather(positions, 1, index)


@contextlib.contextmanager
def eager_attention(model):
    """Run the model with eager attention for a while: its attention weights are then the model's own."""
    inner, config = decoder_of(model)
    # Every config object the attention modules may read (a causal LM assembled around a VLM's
    # language model holds a copy of the text config); a layer without attention (LFM2's convolutions) reads none.
    attentions = (layer.self_attn for layer in inner.layers if hasattr(layer, "self_attn"))
    configs = {id(c): c for c in (config, inner.config, *(attn.config for attn in attentions))}
    saved = {key: c._attn_implementation for key, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = "eager"
    try:
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = saved[key]


def causal_mask(length: int, dtype=torch.float32) -> torch.Tensor:
    """[1, 1, T, T] additive mask: a token sees itself and the tokens before it (kept tokens stay in order)."""
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(future, torch.finfo(dtype).min)[None, None]


def keep_index(kept: torch.Tensor, spec: FastVSpec, length: int) -> torch.Tensor:
    """[B, T'] indices of the tokens the later layers run on: text before, kept image tokens, text after."""
    b = kept.shape[0]
    before = torch.arange(spec.image_start).expand(b, -1)
    after = torch.arange(spec.image_end, length).expand(b, -1)
    return torch.cat([before, kept + spec.image_start, after], dim=1)


@dataclasses.dataclass
class Prefill:
    logits: torch.Tensor  # [B, V], the last prompt token's
    cache: object  # transformers DynamicCache: full length for layers < K, shortened from K on (0-based)
    positions: torch.Tensor  # [B, T'] (mRoPE: [3, B, T']) positions of the tokens the later layers cache
    kept: torch.Tensor | None  # [B, R] kept image tokens, indices within the span (None: dense)
    scores: torch.Tensor | None  # [B, N] layer K's attention over the image span (None: dense)


def _layer_with_weights(layer, hidden, mask, rope, cache):
    """One Hugging Face decoder layer spelled out, so that its attention weights come back too.

    The same four steps as LlamaDecoderLayer / Qwen2DecoderLayer.forward (pre-norm attention
    and MLP with residuals); R = 1 checks it equals the model's own forward.
    """
    attn_out, weights = layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=mask,
                                        position_embeddings=rope, cache=cache)
    hidden = hidden + attn_out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), weights


@torch.no_grad()
def reference_prefill(model, embeds: torch.Tensor, spec: FastVSpec | None,
                      positions: torch.Tensor | None = None) -> Prefill:
    """The prompt through the HF model's layers, FastV applied after layer K (spec None: dense).

    positions [B, T] ([3, B, T] for mRoPE): each token's position (default 0..T-1; a tower-pruned
    image keeps its patches' original positions, with gaps).
    """
    from transformers import DynamicCache

    inner, config = decoder_of(model)
    b, length, _ = embeds.shape
    if spec is not None:
        spec.check(config.num_hidden_layers)
        spec.check_prompt(length)
    cache = DynamicCache()
    if positions is None:
        positions = default_positions(config, b, length)
    hidden = embeds
    kept = scores = None
    with eager_attention(model):
        rope = inner.rotary_emb(hidden, positions)
        mask = causal_mask(length, hidden.dtype)
        for i, layer in enumerate(inner.layers):
            if spec is not None and i == spec.layer - 1:
                hidden, weights = _layer_with_weights(layer, hidden, mask, rope, cache)
                row = weights[:, :, -1, spec.image_start:spec.image_end].float().mean(dim=1)  # [B, N]
                scores = row
                kept = topk_lower_index(row, spec.kept).sort(dim=-1).values
                index = keep_index(kept, spec, length)
                positions = gather_positions(positions, index)
                hidden = torch.gather(hidden, 1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
                rope = inner.rotary_emb(hidden, positions)
                mask = causal_mask(positions.shape[-1], hidden.dtype)
                continue
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, cache=cache)
        logits = model.lm_head(inner.norm(hidden[:, -1:]))[:, 0]
    return Prefill(logits.float(), cache, positions, kept, scores)


@torch.no_grad()
def reference_decode(model, embeds: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
    """One decode step: embeds [B, 1, D] at position [B, 1] ([3, B, 1]), appended to each layer's own cache."""
    inner, _config = decoder_of(model)
    with eager_attention(model):
        rope = inner.rotary_emb(embeds, position)
        hidden = embeds
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rope, cache=cache)
        return model.lm_head(inner.norm(hidden))[:, 0].float()


@torch.no_grad()
def reference_generate(model, embeds: torch.Tensor, spec: FastVSpec | None, steps: int,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy tokens [B, steps]: prefill, then steps-1 decode steps on the (FastV-shortened) cache.

    Decoding continues at the prompt's last position + 1.
    """
    first = reference_prefill(model, embeds, spec, positions)
    tokens = [first.logits.argmax(-1)]
    embed = model.get_input_embeddings()
    if positions is None:
        positions = default_positions(decoder_of(model)[1], embeds.shape[0], embeds.shape[1])
    position = positions[..., -1:] + 1  # the last prompt token is text: for mRoPE t = h = w there
    for _ in range(steps - 1):
        logits = reference_decode(model, embed(tokens[-1])[:, None], position, first.cache)
        tokens.append(logits.argmax(-1))
        position = position + 1
    return torch.stack(tokens, dim=1)
