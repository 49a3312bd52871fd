"""The language model as two ONNX graphs in standard ops (torch.onnx, dynamo): prefill and decode step.

Why two graphs and not one with an optional cache: FastV gives the layers two cache lengths
(every prompt token below K, the kept ones from K on), and the prefill graph holds the
selection that produces them; the decode graph is the plain step every runtime knows, over
caches of whatever length each layer has. Why a position input: after FastV a layer's cache
length is not the next token's position.

prefill.onnx
    in:  inputs_embeds [batch, sequence, hidden] (the image span at the compiled place),
         position_ids [batch, sequence] (each token's position: 0, 1, ... for a dense prompt; a
         tower-pruned image keeps its patches' original positions, compiler.llm.handoff)
    out: logits [batch, 1, vocab] (the last prompt token's), kept_image_indices [batch, R]
         (FastV only: kept image tokens, indices within the span, ascending),
         present.{i}.key / present.{i}.value [batch, kv_heads, length_i, head_dim]
decode.onnx
    in:  inputs_embeds [batch, 1, hidden], position_ids [batch, 1] (original positions: the
         first step is the prompt's length), past_key_values.{i}.key / .value
    out: logits [batch, 1, vocab], present.{i}.key / .value (past + the new token)

The layer math is spelled out over the Hugging Face model's own modules (projections, norms,
MLP, rotary embedding): attention as MatMul/Softmax with GQA heads expanded, so the graph runs
on any ONNX runtime: that form is written as prefill.decomposed.onnx and decode.decomposed.onnx.
prefill.onnx and decode.onnx, what target ort runs, are the same graphs with each layer's
attention (and the prefill's per-layer causal mask) fused into ONNX Runtime's
com.microsoft.MultiHeadAttention by passes.llm_attention_fusion (the mask's Where and the Softmax
were a sixth of the dense prefill), and each RMSNorm into SimplifiedLayerNormalization, with the residual Add before
it into SkipSimplifiedLayerNormalization, by passes.llm_norm_fusion (seven elementwise nodes a norm, as
onnxruntime-genai's builder writes them). Both pairs are checked against the reference.
The parity reference (compiler.llm.fastv) runs the Hugging Face decoder
layers themselves.

Gemma 3's language model (gemma3_text; what differs is declared in compiler.llm.lm_source): the
layer's own norms and MLP, with its two extra norms (post-attention on the attention's output,
pre- and post-feedforward around the MLP) before each residual add; the q/k norm per head; the
module's own scaling (query_pre_attn_scalar); each layer type's own rotary embedding (the sliding
layers' rope_local_base_freq). Its prefill takes `image_rows` [batch, sequence, 1]: rows marked 1
that follow each other are one image block and see each other both ways, the rest causally, as
transformers' Gemma3Model builds the mask from token_type_ids. The sliding window is masked, not
refused: in prefill an additive mask per layer type (key index > query index - sliding_window,
token indices as transformers counts them, with the image block inside the window), in decode the
sliding layers' keys sliced to the last sliding_window rows; the caches keep every row, so any
prompt and answer length gives the model's own result. Gemma3ForConditionalGeneration applies no
final logit softcapping (its Gemma3ForCausalLM does), so neither do the graphs; attention
softcapping (unset in Gemma 3's configs) is refused. Its parity reference is transformers' own text
model forward under transformers' own masks (image_block_prefill, hf_generate).

Gemma 4's language model (gemma4_text) is Gemma 3's layer with what lm_source declares it adds: both graphs take
`per_layer_inputs` [batch, sequence, layers, width] (each token's own per-layer embedding, transformers'
get_per_layer_inputs: an image row the pad token's) and compute transformers' own project_per_layer_inputs of
inputs_embeds; a layer that shares KV (kv_sources) attends to its owner's keys and values (past and new) and has no
present of its own, so the presents are numbered over the owning layers; each layer's head size and key/value heads
are its own; the image block is on the sliding layers only; the logits are softcapped (final_logit_softcapping). Its
parity reference is transformers' own text model forward given the same per-layer embeddings.

LFM2's language model (lfm2) is hybrid: its short-convolution layers (lm_source.conv_layers) have no keys and values,
so the prefill gives, and the decode step takes and gives, each one's convolution state instead, `present.{i}.conv` /
`past_key_values.{i}.conv` [batch, hidden, L] (compiler.llm.short_conv); every cache is named by its layer's number,
so an attention layer's `present.{i}.key` is layer i's. Only the attention layers are fused. Its parity reference is
transformers' own forward on a cache built from its config (lm_source.reference_cache), every state compared by name.

Qwen3.5's language model (qwen3_5_text, MiniCPM-V 4.6's decoder) is hybrid too: its gated delta-net layers
(lm_source.recurrent_layers) carry two states each instead of keys and values, `present.{i}.conv` [batch, channels, L]
(the convolution's last L inputs) and `present.{i}.recurrent` [batch, value heads, dk, dv] (the delta rule's state),
taken back as `past_key_values.{i}.conv` / `.recurrent` (compiler.llm.gated_delta). The prefill runs the rule over a
prompt of any length as torch's scan, which torch.onnx lowers to one ONNX Scan (the recurrence token by token, as
transformers' recurrent form writes it); the decode step is one step of it. Its attention layers gate their output by
a sigmoid of a second half of q_proj (lm_source.GATED_QUERY) and rotate the first partial_rotary_factor of each head
only. Parity as LFM2's: transformers' own forward on a cache from its config, every state compared by name.

This is the default exporter of target ort (`--llm-exporter torch`, compiler.llm.exporter);
FastV is compiled in only here.
"""

from __future__ import annotations

import math
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

from vlmprune.compiler.contract import DEFAULT_OPSET, Manifest
from vlmprune.compiler import contract
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.export import torch_onnx
from vlmprune.compiler.llm import gated_delta, lm_source, short_conv
from vlmprune.compiler.llm.exporter import LLM_DIR, LlmExporter, LlmGraphRunner, tokens_note
from vlmprune.compiler.llm.fastv import FastVSpec, default_positions, gather_positions
from vlmprune.compiler.llm.lm_source import (GATED_QUERY, LAYER_SCALAR, QK_NORM, SANDWICH_NORM, SLIDING_BLOCK,
                                            conv_layers, decoder_of, deepstack_levels, has_image_block, kv_sources,
                                            layer_types, per_layer_width, recurrent_layers, uses_mrope)
from vlmprune.compiler.parity import figure_text

WEIGHTS = "llm.weights.bin"  # shared by prefill.onnx and decode.onnx (and their decomposed forms)
PREFILL, DECODE = "prefill.onnx", "decode.onnx"  # each layer's attention fused (passes.llm_attention_fusion)
PREFILL_DECOMPOSED, DECODE_DECOMPOSED = "prefill.decomposed.onnx", "decode.decomposed.onnx"  # standard ops only
DEEPSTACK = contract.DEEPSTACK  # prefill input [L, batch, sequence, hidden] of a language model with DeepStack
IMAGE_ROWS = contract.IMAGE_ROWS  # prefill input [batch, sequence, 1] of a language model with a bidirectional image block
PER_LAYER = contract.PER_LAYER_INPUTS  # prefill and decode input [batch, sequence, layers, width] of a decoder with PLE
SLIDING = "sliding_attention"  # the layer type whose keys are the last sliding_window tokens (lm_source.layer_types)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [B, H, T, d]; where cos and sin are narrower than the head (a partial rotary embedding,
    Qwen3.5's partial_rotary_factor), its first cos.shape[-1] features only, the rest passed through."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :width], x[..., width:]
    return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, d] -> [B, Hkv * groups, T, d] (GQA: each kv head serves `groups` query heads)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


class _Decoder(nn.Module):
    """The shared layer math; holds the Hugging Face causal LM so both graphs name its weights alike."""

    def __init__(self, model):
        super().__init__()
        inner, config = decoder_of(model)
        self.lm = model
        self.heads = config.num_attention_heads
        self.names = {n: lm_source.module_name(config, n) for n in ("input_layernorm", "post_attention_layernorm",
                                                                    "mlp", "q_norm", "k_norm", "o_proj", "norm")}
        self.num_layers = config.num_hidden_layers
        self.convs = frozenset(conv_layers(config))  # short-convolution layers: a convolution state, no attention
        self.deltas = frozenset(recurrent_layers(config))  # gated delta-nets: a conv and a recurrent state
        # the layers that keep states other than keys and values, each with its operator's module (what it declares:
        # MODULE, STATES, state_shapes, prefill, step)
        self.stateful = {**{i: short_conv for i in self.convs}, **{i: gated_delta for i in self.deltas}}
        self.attending = [i for i in range(self.num_layers) if i not in self.stateful]
        self.gated = config.model_type in GATED_QUERY  # q_proj gives the queries and an output gate per head
        first = model.model.layers[self.attending[0]].self_attn  # Gemma 4's config has a head size per layer
        self.head_dim = getattr(first, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qk_norm = config.model_type in QK_NORM
        self.sandwich = config.model_type in SANDWICH_NORM
        self.image_block = has_image_block(config)
        self.sliding_block = config.model_type in SLIDING_BLOCK  # the image block on the sliding layers only
        self.deepstack = deepstack_levels(model)
        self.types = layer_types(config)  # None: one rotary embedding, every layer global
        self.window = getattr(config, "sliding_window", None) if self.types is not None else None
        self.per_layer = per_layer_width(config)  # PLE's width, 0 without
        self.scalar = config.model_type in LAYER_SCALAR
        self.sources = kv_sources(config)  # each layer's cache owner (itself, or an earlier layer: shared KV)
        # the layers with a key/value cache of their own
        self.cached = [i for i in self.attending if self.sources[i] == i]
        attns = {i: model.model.layers[i].self_attn for i in self.cached}
        # each cached layer's (kv heads, head size): Gemma 4's global layers have their own
        self.cache_shapes = [(attns[i].k_proj.out_features // getattr(attns[i], "head_dim", self.head_dim),
                              getattr(attns[i], "head_dim", self.head_dim)) for i in self.cached]

    def state_shapes(self, i: int) -> list[list[int]]:
        """Layer i's states' shapes past the batch, as its operator declares them (stateful layers only)."""
        op = self.stateful[i]
        return op.state_shapes(getattr(self.lm.model.layers[i], op.MODULE))

    def part(self, owner: nn.Module, name: str) -> nn.Module:
        """owner's module that Llama's layer calls name, by the decoder's own name (lm_source.MODULE_NAMES)."""
        return getattr(owner, self.names[name])

    def state_names(self, prefix: str) -> list[str]:
        """The graphs' cache inputs or outputs in layer order: prefix.{i}.conv for a short-convolution layer,
        prefix.{i}.conv and .recurrent for a gated delta-net, prefix.{i}.key and .value for a layer with a key/value
        cache of its own (none for one that shares another's)."""
        names = []
        for i in range(self.num_layers):
            if i in self.stateful:
                names += [f"{prefix}.{i}.{state}" for state in self.stateful[i].STATES]
            elif self.sources[i] == i:
                names += [f"{prefix}.{i}.key", f"{prefix}.{i}.value"]
        return names

    @property
    def inner(self):
        return self.lm.model

    def ropes(self, x, positions) -> list:
        """Each layer's (cos, sin): one rotary embedding for all, or one per layer type (Gemma 3's two bases)."""
        if self.types is None:
            rope = self.inner.rotary_emb(x, positions)
            return [rope] * self.num_layers
        by_type = {t: self.inner.rotary_emb(x, positions, t) for t in sorted(set(self.types))}
        return [by_type[t] for t in self.types]

    def biases(self, image_rows, length: int) -> list:
        """Each layer's additive prefill mask [B, 1, T, T] (0 where a key is seen, -inf where not), for decoders with
        layer types: causal, or the same image block (image_rows [B, T, 1] > 0.5, consecutive rows one block:
        transformers' get_block_sequence_ids_for_mask), and for sliding layers only keys less than sliding_window
        rows back (transformers' sliding_window_overlay: kv > q - window, token indices, not positions). The window
        is masked, not refused: any prompt length gives the model's own result."""
        steps = torch.arange(length)
        seen = (steps[None, :] <= steps[:, None])[None]  # [1, T, T] causal
        if image_rows is not None:
            rows = image_rows[..., 0] > 0.5  # [B, T]
            before = torch.cat([torch.zeros_like(rows[:, :1]), rows[:, :-1]], dim=1)
            block = torch.cumsum((rows & ~before).long(), dim=1)
            block = torch.where(rows, block, torch.zeros_like(block))  # 0: text, 1..: the image blocks
            seen = seen | ((block[:, :, None] == block[:, None, :]) & rows[:, :, None])
        near = (steps[:, None] - steps[None, :]) < self.window
        causal = (steps[None, :] <= steps[:, None])[None]
        full = torch.zeros(seen.shape).masked_fill(~(causal if self.sliding_block else seen), float("-inf"))[:, None]
        sliding = torch.zeros(seen.shape).masked_fill(~(seen & near), float("-inf"))[:, None]
        return [sliding if t == SLIDING else full for t in self.types]

    def attention(self, layer, x, rope, past=None, causal=True, bias=None, index=None, shared=None):
        """(attention output, new k, new v, q, expanded k): the last two for FastV's score row.

        bias: an additive mask in place of the causal one (prefill of a decoder with layer types); index: the
        layer's number, whose type says whether a decode step sees only the last sliding_window keys; shared: the
        (k, v) of the earlier layer whose cache this one reads (shared KV: no projection of its own)."""
        attn = layer.self_attn
        b, t, _ = x.shape
        head_dim = getattr(attn, "head_dim", None) or self.head_dim  # Gemma 4's global layers: their own
        q = attn.q_proj(x).view(b, t, self.heads, head_dim * (2 if self.gated else 1))
        gate = None
        if self.gated:  # Qwen3.5: each head's queries, then its output gate
            q, gate = torch.chunk(q, 2, dim=-1)
            gate = gate.reshape(b, t, self.heads * head_dim)
        if self.qk_norm:  # Qwen3's layer: an RMSNorm over each head's queries and keys, before the rotation
            q = self.part(attn, "q_norm")(q)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        q = _rotate(q.transpose(1, 2), cos, sin)
        if shared is not None:
            k, v = shared
        else:
            k = attn.k_proj(x).view(b, t, -1, head_dim)
            # Gemma 4's global layers under attention_k_eq_v: the key projection is the values too
            v = (attn.v_proj(x).view(b, t, -1, head_dim) if getattr(attn, "v_proj", None) is not None else k)
            if self.qk_norm:
                k = self.part(attn, "k_norm")(k)
            if getattr(attn, "v_norm", None) is not None:  # Gemma 4: an RMSNorm (no scale) over each value head
                v = attn.v_norm(v)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            k = _rotate(k, cos, sin)
            if past is not None:
                k = torch.cat([past[0], k], dim=2)
                v = torch.cat([past[1], v], dim=2)
        groups = self.heads // k.shape[1]
        kx, vx = _expand_heads(k, groups), _expand_heads(v, groups)
        if not causal and bias is None and self.types is not None and self.types[index] == SLIDING:  # a decode step
            kx, vx = kx[:, :, -self.window:], vx[:, :, -self.window:]  # the new token and window - 1 before it
        scores = torch.matmul(q, kx.transpose(-1, -2)) * attn.scaling
        if bias is not None:
            scores = scores + bias
        elif causal:
            n = scores.shape[-1]
            steps = torch.arange(n)
            scores = scores.masked_fill(steps[None, :] > steps[:, None], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(weights, vx).transpose(1, 2).reshape(b, t, self.heads * head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.part(attn, "o_proj")(out), k, v, q, kx

    def state_layer(self, i: int, layer, hidden, states=None):
        """(hidden, its new states) of layer i, one that keeps states other than keys and values (LFM2's short
        convolutions: compiler.llm.short_conv; Qwen3.5's gated delta-nets: compiler.llm.gated_delta): its operator
        on the normed rows in place of attention, over the prompt (states None) or one row on states; then the MLP."""
        op = self.stateful[i]
        mixer, x = getattr(layer, op.MODULE), self.part(layer, "input_layernorm")(hidden)
        out, *states = op.prefill(mixer, x) if states is None else op.step(mixer, x, *states)
        hidden = hidden + out
        return hidden + self.part(layer, "mlp")(self.part(layer, "post_attention_layernorm")(hidden)), states

    def layer(self, layer, hidden, rope, past=None, causal=True, bias=None, index=None, shared=None,
              per_layer=None):
        out, k, v, q, kx = self.attention(layer, self.part(layer, "input_layernorm")(hidden), rope, past, causal, bias,
                                          index, shared)
        if self.sandwich:  # Gemma 3: each branch's output normed before its residual add, the MLP's input too
            hidden = hidden + layer.post_attention_layernorm(out)
            hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
            if per_layer is not None:  # Gemma 4's PLE: the layer's slice, gated by the hidden state, projected back
                gate = layer.act_fn(layer.per_layer_input_gate(hidden)) * per_layer
                hidden = hidden + layer.post_per_layer_input_norm(layer.per_layer_projection(gate))
            if self.scalar:
                hidden = hidden * layer.layer_scalar
            return hidden, k, v, q, kx
        hidden = hidden + out
        hidden = hidden + self.part(layer, "mlp")(self.part(layer, "post_attention_layernorm")(hidden))
        return hidden, k, v, q, kx

    def head(self, hidden):
        return lm_source.logits(self.lm, self.part(self.inner, "norm")(hidden))

    def per_layer_inputs(self, inputs_embeds, per_layer_inputs):
        """Each layer's PLE input [B, T, width] (transformers' own project_per_layer_inputs: the context projection of
        inputs_embeds and the tokens' own per-layer embeddings), or Nones without PLE."""
        if not self.per_layer:
            return [None] * self.num_layers
        combined = self.inner.project_per_layer_inputs(inputs_embeds, per_layer_inputs)
        return [combined[:, :, i] for i in range(self.num_layers)]


class PrefillGraph(_Decoder):
    """The prompt -> last-token logits and every layer's cache; FastV after layer spec.layer when given."""

    def __init__(self, model, spec: FastVSpec | None):
        super().__init__(model)
        if spec is not None:
            spec.check(self.num_layers)
        self.spec = spec

    def forward(self, inputs_embeds, position_ids, *further):
        """further: the decoder's further inputs, in the order export_prefill names them: deepstack_embeds
        [L, B, T, D] (Qwen3-VL): level l's rows at the image rows, zero elsewhere, added after layer l (what
        transformers' _deepstack_process adds at visual_pos_masks); image_rows [B, T, 1] (Gemma 3): 1 at the rows of
        an image, which see each other both ways, 0 elsewhere; per_layer_inputs [B, T, layers, width] (Gemma 4's PLE):
        the tokens' own per-layer embeddings (transformers' get_per_layer_inputs, the pad token's at image rows)."""
        further = list(further)
        deepstack_embeds = further.pop(0) if self.deepstack else None
        image_rows = further.pop(0) if self.image_block else None
        per_layer = self.per_layer_inputs(inputs_embeds, further.pop(0) if self.per_layer else None)
        b, length, width = inputs_embeds.shape
        ropes = self.ropes(inputs_embeds, position_ids)
        biases = self.biases(image_rows, length) if self.types is not None else [None] * self.num_layers
        hidden, presents, kept, caches = inputs_embeds, [], None, {}
        spec = self.spec
        for i, layer in enumerate(self.inner.layers):
            if i in self.stateful:  # a short convolution or a gated delta-net: its states, no keys and values
                hidden, states = self.state_layer(i, layer, hidden)
                presents += states
                continue
            shared = caches.get(self.sources[i]) if self.sources[i] != i else None
            hidden, k, v, q, kx = self.layer(layer, hidden, ropes[i], bias=biases[i], shared=shared,
                                             per_layer=per_layer[i])
            if shared is None:
                caches[i] = (k, v)
                presents += [k, v]
            if deepstack_embeds is not None and i < self.deepstack:
                hidden = hidden + deepstack_embeds[i]
            if spec is not None and i == spec.layer - 1:
                # Layer K's attention row of the last prompt token, recomputed from its own Q and K:
                # O(T·d), so the layer's attention itself stays whatever the runtime makes of it.
                row = torch.softmax((torch.matmul(q[:, :, -1:], kx.transpose(-1, -2)) * layer.self_attn.scaling)
                                    .float(), dim=-1)
                score = row.mean(dim=1)[:, 0, spec.image_start:spec.image_end]  # [B, N]
                kept = torch.topk(score, spec.kept, dim=-1).indices.sort(dim=-1).values
                index = torch.cat([torch.arange(spec.image_start).unsqueeze(0).expand(b, spec.image_start),
                                   kept + spec.image_start,
                                   torch.arange(spec.image_end, length).unsqueeze(0)
                                   .expand(b, length - spec.image_end)],
                                  dim=1)
                hidden = torch.gather(hidden, 1, index.unsqueeze(-1).expand(b, index.shape[1], width))
                ropes = self.ropes(hidden, gather_positions(position_ids, index))  # original positions
        logits = self.head(hidden[:, -1:])
        return (logits, kept, *presents) if spec is not None else (logits, *presents)


class DecodeGraph(_Decoder):
    """One token on top of each layer's cache (whatever its length), at an explicit original position."""

    def forward(self, inputs_embeds, position_ids, *past):
        """past: the caches in layer order (state_names: each short-convolution layer's state, each gated delta-net's
        conv and recurrent states, each cached layer's key and value); with PLE, the new token's per_layer_inputs
        [B, 1, layers, width] first."""
        per_layer = self.per_layer_inputs(inputs_embeds, past[0] if self.per_layer else None)
        past = list(past[1:] if self.per_layer else past)
        ropes = self.ropes(inputs_embeds, position_ids)
        hidden, presents, caches = inputs_embeds, [], {}
        for i, layer in enumerate(self.inner.layers):
            if i in self.stateful:  # a short convolution or a gated delta-net: this row on its states
                states = [past.pop(0) for _ in self.stateful[i].STATES]
                hidden, states = self.state_layer(i, layer, hidden, states)
                presents += states
                continue
            if self.sources[i] != i:  # shared KV: the owner's cache with this token's row
                hidden, *_ = self.layer(layer, hidden, ropes[i], causal=False, index=i, shared=caches[self.sources[i]],
                                        per_layer=per_layer[i])
                continue
            own = (past.pop(0), past.pop(0))
            hidden, k, v, _q, _kx = self.layer(layer, hidden, ropes[i], own, causal=False, index=i,
                                               per_layer=per_layer[i])
            caches[i] = (k, v)
            presents += [k, v]
        return (self.head(hidden), *presents)


def _export(module: nn.Module, args: tuple, input_names, output_names, dynamic, opset: int) -> ir.Model:
    return torch_onnx("torch.onnx export of the language model", module, args, input_names=input_names,
                      output_names=output_names, dynamic_shapes=dynamic, opset_version=opset)


def export_prefill(model, spec: FastVSpec | None, opset: int = DEFAULT_OPSET) -> ir.Model:
    graph = PrefillGraph(model, spec)
    _inner, config = decoder_of(model)
    start = spec.image_end + 1 if spec is not None else 1
    example = torch.zeros(2, start + 2, config.hidden_size)
    positions = default_positions(config, 2, start + 2).clone()
    batch = torch.export.Dim("batch", min=1, max=1024)
    sequence = torch.export.Dim("sequence", min=start, max=config.max_position_embeddings)
    outputs = ["logits", *(["kept_image_indices"] if spec is not None else []),
               *graph.state_names("present")]
    position_dims = {1: batch, 2: sequence} if uses_mrope(config) else {0: batch, 1: sequence}
    args, names, dims = (example, positions), ["inputs_embeds", "position_ids"], ({0: batch, 1: sequence}, position_dims)
    further, further_dims = [], []  # PrefillGraph.forward's *further, in its order
    if graph.deepstack:  # Qwen3-VL: the DeepStack rows, one plane per level
        further.append(torch.zeros(graph.deepstack, 2, start + 2, config.hidden_size))
        names.append(DEEPSTACK)
        further_dims.append({1: batch, 2: sequence})
    if graph.image_block:  # Gemma 3: which rows are image rows
        further.append(torch.zeros(2, start + 2, 1))
        names.append(IMAGE_ROWS)
        further_dims.append({0: batch, 1: sequence})
    if graph.per_layer:  # Gemma 4: the tokens' own per-layer embeddings
        further.append(torch.zeros(2, start + 2, graph.num_layers, graph.per_layer))
        names.append(PER_LAYER)
        further_dims.append({0: batch, 1: sequence})
    if further:  # *further is one argument to torch.export
        args, dims = (*args, *further), (*dims, tuple(further_dims))
    return _export(graph, args, names, outputs, dims, opset)


def export_decode(model, spec: FastVSpec | None, opset: int = DEFAULT_OPSET) -> ir.Model:
    graph = DecodeGraph(model)
    _inner, config = decoder_of(model)
    batch = torch.export.Dim("batch", min=1, max=1024)
    full = torch.export.Dim("past_sequence", min=1, max=config.max_position_embeddings)
    pruned = spec is not None and spec.kept < spec.image_len
    kept = torch.export.Dim("past_sequence_kept", min=1, max=config.max_position_embeddings) if pruned else full
    shapes = dict(zip(graph.cached, graph.cache_shapes))
    past, dims = [], []  # in state_names' order: layer by layer
    for i in range(graph.num_layers):
        if i in graph.stateful:  # a short convolution's or a gated delta-net's states: fixed shapes past the batch
            state_shapes = graph.state_shapes(i)
            past += [torch.zeros(2, *shape) for shape in state_shapes]
            dims += [{0: batch} for _ in state_shapes]
        elif i in shapes:
            n = 9 if spec is None or i < spec.layer else 6 if pruned else 9
            past += [torch.zeros(2, shapes[i][0], n, shapes[i][1]) for _ in range(2)]
            dims += [{0: batch, 2: full if spec is None or i < spec.layer else kept} for _ in range(2)]
    names = graph.state_names("past_key_values")
    if graph.per_layer:  # Gemma 4: the new token's own per-layer embeddings, before the caches
        past, dims = [torch.zeros(2, 1, graph.num_layers, graph.per_layer), *past], [{0: batch}, *dims]
        names = [PER_LAYER, *names]
    mrope = uses_mrope(config)
    position = torch.full((3, 2, 1) if mrope else (2, 1), 9, dtype=torch.long)
    args = (torch.zeros(2, 1, config.hidden_size), position, *past)
    dynamic = ({0: batch}, {1: batch} if mrope else {0: batch}, tuple(dims))  # *past is one argument to torch.export
    return _export(graph, args, ["inputs_embeds", "position_ids", *names], ["logits", *graph.state_names("present")],
                   dynamic, opset)


def fuse_attention(model: ir.Model, layers: int) -> ir.Model:
    """model (an exported prefill or decode graph) as target ort ships it, in place: every layer's attention fused
    (all or a clear error); then, where their form allows, the prefill's causal attention GroupQueryAttention, the
    rotations of q and K RotaryEmbedding, and the RMSNorms with the residual Adds feeding them
    SkipSimplifiedLayerNormalization. Last, repeated subexpressions are merged (torch.export leaves each one as
    often as the code wrote it: each rotation's Transpose and Reshape twice, each RotaryEmbedding's row tables once
    per layer; a Qwen2-0.5B-shaped prefill goes from 1,876 nodes to 1,147), the same numbers by construction."""
    from onnx_ir.passes.common import CommonSubexpressionEliminationPass

    from vlmprune.passes.llm_attention_fusion import LlmAttentionFusionPass
    from vlmprune.passes.llm_gqa_fusion import LlmGroupQueryAttentionPass
    from vlmprune.passes.llm_norm_fusion import LlmNormFusionPass
    from vlmprune.passes.llm_rotary_fusion import LlmRotaryFusionPass

    model = LlmAttentionFusionPass(layers)(model).model
    for step in (LlmGroupQueryAttentionPass(), LlmRotaryFusionPass(), LlmNormFusionPass(),
                 CommonSubexpressionEliminationPass()):
        model = step(model).model
    return model


def export_decoder(model, spec: FastVSpec | None, folder: Path, opset: int = DEFAULT_OPSET) -> dict:
    """prefill.onnx and decode.onnx (attention fused) and their .decomposed.onnx forms in folder, the weights in one
    llm.weights.bin; returns what was written.

    The decode graph's initializers are the prefill graph's where their content agrees
    (share_weights), so the weights are stored once; the fused graphs point at the same file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefill = export_prefill(model, spec, opset)
    decode = export_decode(model, spec, opset)
    ir.external_data.unload_from_model(prefill, folder, WEIGHTS, size_threshold_bytes=1024)
    share_weights(decode, prefill)
    if _has_large_inline(decode):  # a weight only decode uses (none expected): keep the .onnx small anyway
        ir.external_data.unload_from_model(decode, folder, f"decode.{WEIGHTS}", size_threshold_bytes=1024)
    ir.save(prefill, folder / PREFILL_DECOMPOSED)
    ir.save(decode, folder / DECODE_DECOMPOSED)
    io = {"prefill": _io(prefill), "decode": _io(decode)}
    layers = len(DecodeGraph(model).attending)  # the attention layers (not LFM2's convolutions, Qwen3.5's delta-nets)
    ir.save(fuse_attention(prefill, layers), folder / PREFILL)
    ir.save(fuse_attention(decode, layers), folder / DECODE)
    return {"prefill": PREFILL, "decode": DECODE, "prefill_decomposed": PREFILL_DECOMPOSED,
            "decode_decomposed": DECODE_DECOMPOSED, "weights": WEIGHTS, "io": io}


def share_weights(model: ir.Model, owner: ir.Model) -> int:
    """Point model's large initializers at owner's (external) tensors of the same content; returns how many.

    By content, not by name: the exporter names folded weights (a Linear's transposed matrix)
    per graph, so two exports of the same model name the same matrix differently.
    """
    by_content = {_digest(v.const_value): v.const_value for v in owner.graph.initializers.values()
                  if v.const_value is not None and v.const_value.nbytes > 1024}
    shared = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.const_value.nbytes > 1024:
            tensor = by_content.get(_digest(value.const_value))
            if tensor is not None:
                value.const_value = tensor
                shared += 1
    return shared


def _digest(tensor) -> tuple:
    import hashlib

    array = tensor.numpy()
    return array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest()


def _has_large_inline(model: ir.Model) -> bool:
    return any(v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
               and v.const_value.nbytes > 1024 for v in model.graph.initializers.values())


def _io(model: ir.Model) -> dict:
    def one(v):
        return {"name": v.name, "shape": [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape else None,
                "dtype": v.dtype.name.lower() if v.dtype else None}
    return {"inputs": [one(v) for v in model.graph.inputs], "outputs": [one(v) for v in model.graph.outputs]}


PARITY_ATOL = 1e-4  # fp32 logits and caches, as the tower's fp32 stages
DECODE_STEPS = 3


def parity_positions(config, batch: int, length: int, image_start: int, image_tokens: int) -> torch.Tensor:
    """The parity prompt's positions: 0..T-1, or for mRoPE an image span laid out as a grid.

    mRoPE: text tokens have t = h = w; image token j of a g-wide grid sits at (s, s + j // g, s + j % g)
    and the text after it resumes at the span's largest position + 1, as Qwen2-VL numbers a prompt,
    so the three sections of the rotary embedding see different positions.
    """
    positions = default_positions(config, batch, length).clone()
    if positions.dim() == 3 and image_tokens > 0:
        g = max(1, math.isqrt(image_tokens - 1) + 1)
        j = torch.arange(image_tokens)
        span = slice(image_start, image_start + image_tokens)
        positions[0, :, span] = image_start
        positions[1, :, span] = image_start + (j // g)
        positions[2, :, span] = image_start + (j % g)
        resume = int(positions[:, :, span].max()) + 1
        positions[:, :, image_start + image_tokens:] = resume + torch.arange(length - image_start - image_tokens)
    return positions


@torch.no_grad()
def llm_parity(lm, spec: FastVSpec | None, folder: Path, image_tokens: int,
               graphs: tuple[str, str] = (PREFILL, DECODE)) -> dict:
    """Prefill logits, every present, kept tokens and greedy decode of the graphs vs the reference, batch 2, seed 0.

    graphs: (prefill, decode) file names in folder, the fused pair by default; where the folder holds the
    decomposed prefill too, the result also has the fused prefill's max-abs gap to it (`fused_vs_decomposed`).
    """
    import numpy as np

    from vlmprune.compiler.llm.fastv import reference_generate, reference_prefill
    from vlmprune.targets.runtime import ort_session

    _inner, config = decoder_of(lm)
    length = (spec.image_end if spec is not None else image_tokens) + 4
    embeds = torch.randn(2, length, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = parity_positions(config, 2, length, spec.image_start if spec is not None else 0,
                                 spec.image_len if spec is not None else image_tokens)
    feed = {"inputs_embeds": embeds.numpy(), "position_ids": positions.numpy()}
    levels = deepstack_levels(lm)
    block = has_image_block(config)
    hf_masks = block or lm_source.own_forward_reference(config)  # transformers' own forward
    ids = None
    if per_layer_width(config):  # random token ids, the image rows the pad token's: their per-layer embeddings
        ids = torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(2))
        ids[:, 1:1 + image_tokens] = config.pad_token_id
        feed[PER_LAYER] = lm_source.per_layer_inputs(lm, ids)["per_layer_inputs"].numpy()
    if levels:  # random DeepStack rows at the image span, zero at the text rows
        deepstack = torch.randn(levels, 2, length, config.hidden_size, generator=torch.Generator().manual_seed(1))
        deepstack[:, :, image_tokens:] = 0
        feed[DEEPSTACK] = deepstack.numpy()
        ref = deepstack_prefill(lm, embeds, positions, deepstack, image_tokens)
    elif hf_masks:  # the image block after one text row: text before it, inside it and after it all checked
        rows = torch.zeros(2, length, dtype=torch.bool)
        rows[:, 1:1 + image_tokens] = True
        if block:
            feed[IMAGE_ROWS] = rows[..., None].float().numpy()
        ref = image_block_prefill(lm, embeds, positions, rows if block else None,
                                  lm_source.per_layer_inputs(lm, ids) if ids is not None else {})
    else:
        ref = reference_prefill(lm, embeds, spec, positions)
    prefill = ort_session(folder / graphs[0])
    names = [o.name for o in prefill.get_outputs()]
    got = dict(zip(names, prefill.run(None, feed)))
    between = None
    if graphs[0] == PREFILL and (folder / PREFILL_DECOMPOSED).is_file():
        plain = ort_session(folder / PREFILL_DECOMPOSED)
        other = dict(zip([o.name for o in plain.get_outputs()], plain.run(None, feed)))
        between = max(float(np.abs(got[k].astype(np.float64) - other[k]).max()) for k in names)
    worst = float(np.abs(got["logits"][:, 0] - ref.logits.numpy()).max())
    states = reference_states(ref.cache)
    if set(states) != {k for k in names if k.startswith("present.")}:  # a cache the graphs lack, or one too many
        worst = float("inf")
    for name, tensor in states.items():
        if name in got:
            worst = max(worst, float(np.abs(got[name] - tensor.numpy()).max()))
    kept_ok = spec is None or bool(np.array_equal(got["kept_image_indices"], ref.kept.numpy()))
    expected = (deepstack_generate(lm, ref, positions) if levels else hf_generate(lm, ref, positions) if hf_masks else
                reference_generate(lm, embeds, spec, DECODE_STEPS, positions)).numpy()
    decode = ort_session(folder / graphs[1])
    out_names = [o.name for o in decode.get_outputs()]
    embed = lm.get_input_embeddings()  # the module, not its table: Gemma 3's scales the rows by sqrt(hidden)
    past = {f"past_key_values.{k.split('.', 1)[1]}": v for k, v in got.items() if k.startswith("present.")}
    tokens = [got["logits"][:, 0].argmax(-1)]
    for step in range(1, DECODE_STEPS):
        token = torch.from_numpy(tokens[-1])[:, None]
        feed = {"inputs_embeds": embed(token).numpy(), "position_ids": (positions[..., -1:] + step).numpy(), **past,
                **{k: v.numpy() for k, v in lm_source.per_layer_inputs(lm, token).items()}}
        outs = dict(zip(out_names, decode.run(None, feed)))
        tokens.append(outs["logits"][:, 0].argmax(-1))
        past = {f"past_key_values.{k.split('.', 1)[1]}": v for k, v in outs.items() if k.startswith("present.")}
    same = bool(np.array_equal(np.stack(tokens, axis=1), expected))
    return {"batch": 2, "prompt_tokens": length, "seed": 0, "logits_max_abs": worst, "tolerance": PARITY_ATOL,
            "kept_identical": kept_ok, "decode_steps": DECODE_STEPS, "tokens_identical": same,
            "graphs": list(graphs), **({"fused_vs_decomposed": between} if between is not None else {}),
            "passed": worst <= PARITY_ATOL and kept_ok and same and (between is None or between <= PARITY_ATOL)}


def reference_states(cache) -> dict:
    """A transformers cache as the graphs name its tensors, layer by layer: `present.{i}.key` / `.value` where layer i
    holds keys and values, `present.{i}.conv` where it holds a convolution state (LFM2's conv layers, Qwen3.5's
    linear-attention layers), `present.{i}.recurrent` where it holds a recurrent state (Qwen3.5's); a layer that
    holds none (a shared-KV layer's DummyLayer) has none."""
    states = {}
    for i, layer in enumerate(cache.layers):
        conv = (getattr(layer, "conv_states", None) or {}).get(0)
        if conv is not None:
            states[f"present.{i}.conv"] = conv
        recurrent = (getattr(layer, "recurrent_states", None) or {}).get(0)
        if recurrent is not None:
            states[f"present.{i}.recurrent"] = recurrent
        if getattr(layer, "keys", None) is not None:
            states[f"present.{i}.key"], states[f"present.{i}.value"] = layer.keys, layer.values
    return states


def deepstack_prefill(lm, embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor, image_tokens: int):
    """The reference prefill of a language model with DeepStack: transformers' own text model forward, given the
    image rows' mask (the first image_tokens rows) and each level's rows there (visual_pos_masks,
    deepstack_visual_embeds), eager attention; its logits and cache as reference_prefill gives them."""
    from transformers import DynamicCache

    from vlmprune.compiler.llm.fastv import Prefill, eager_attention

    b, length, _ = embeds.shape
    mask = torch.zeros(b, length, dtype=torch.bool)
    mask[:, :image_tokens] = True
    cache = DynamicCache()
    with eager_attention(lm):
        out = lm.model(inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True,
                       visual_pos_masks=mask, deepstack_visual_embeds=[d[mask] for d in deepstack])
        logits = lm.lm_head(out.last_hidden_state[:, -1:])[:, 0]
    return Prefill(logits.float(), cache, positions, None, None)


def deepstack_generate(lm, first, positions: torch.Tensor) -> torch.Tensor:
    """Greedy tokens [B, DECODE_STEPS] after deepstack_prefill (DeepStack adds nothing to the decode steps)."""
    from vlmprune.compiler.llm.fastv import reference_decode

    tokens, embed = [first.logits.argmax(-1)], lm.get_input_embeddings()
    position = positions[..., -1:] + 1
    for _ in range(DECODE_STEPS - 1):
        tokens.append(reference_decode(lm, embed(tokens[-1])[:, None], position, first.cache).argmax(-1))
        position = position + 1
    return torch.stack(tokens, dim=1)


def image_block_prefill(lm, embeds: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                        extra: dict | None = None):
    """The reference prefill of a language model with a bidirectional image block (Gemma 3, Gemma 4), or of one that
    only transformers' own forward computes (Gemma 4's per-layer embeddings and shared KV, LFM2's convolution states;
    rows None: its own masks): transformers' own text model forward under transformers' own masks for those image rows
    ([B, T] bool; lm_source.image_block_masks), eager attention, lm_source.reference_cache (every row of every layer,
    so that the sliding layers' cache compares with the graph's whole present, their masks still seeing only the
    window; the convolution states where the decoder has them); its logits and cache as
    reference_prefill gives them. extra: the forward's further arguments (Gemma 4's per_layer_inputs)."""
    from vlmprune.compiler.llm.fastv import Prefill, eager_attention
    from vlmprune.compiler.llm.lm_source import image_block_masks

    cache = lm_source.reference_cache(lm.config)
    with eager_attention(lm):
        masks = (image_block_masks(lm.config, embeds, positions, cache, rows) if rows is not None
                 else torch.ones(embeds.shape[:2], dtype=torch.long))
        out = lm.model(inputs_embeds=embeds, attention_mask=masks, position_ids=positions, cache=cache,
                       use_cache=True, **(extra or {}))
        logits = lm_source.logits(lm, out.last_hidden_state[:, -1:])[:, 0]
    return Prefill(logits.float(), cache, positions, None, None)


def hf_generate(lm, first, positions: torch.Tensor) -> torch.Tensor:
    """Greedy tokens [B, DECODE_STEPS] after a prefill, each step transformers' own text model forward on the cache
    (its own masks: a decode step sees every cached row, the sliding layers the last window of them)."""
    from vlmprune.compiler.llm.fastv import eager_attention

    tokens, embed = [first.logits.argmax(-1)], lm.get_input_embeddings()
    position = positions[..., -1:] + 1
    with eager_attention(lm):
        for _ in range(DECODE_STEPS - 1):
            token = tokens[-1][:, None]
            out = lm.model(inputs_embeds=embed(token), position_ids=position, cache=first.cache, use_cache=True,
                           **lm_source.per_layer_inputs(lm, token))
            tokens.append(lm_source.logits(lm, out.last_hidden_state)[:, 0].float().argmax(-1))
            position = position + 1
    return torch.stack(tokens, dim=1)


def spec_of(llm: dict) -> FastVSpec | None:
    """The FastVSpec a bundle's llm_graphs section was compiled with (None: a dense decoder)."""
    fastv = llm.get("fastv")
    if not fastv:
        return None
    return FastVSpec(fastv["image_start"], fastv["image_tokens"], fastv["layer"], fastv["keep"])


def _layers(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def readme_section(manifest: Manifest) -> str:
    """The bundle README's language-model section for the torch.onnx graphs."""
    llm = manifest.llm_graphs
    files, fastv = llm["files"], llm["fastv"]
    n = llm["layers"]
    if fastv:
        how = (f"FastV is compiled into `{files['prefill']}`: {_layers(1, fastv['layer'])} see every token; layer "
               f"{fastv['layer']}'s attention row of the last prompt token over the image span (prompt positions "
               f"{fastv['image_start']}..{fastv['image_start'] + fastv['image_tokens'] - 1}, averaged over heads) "
               f"keeps {fastv['kept']} of the {fastv['image_tokens']} image tokens (`kept_image_indices`), and "
               f"{_layers(fastv['layer'] + 1, n)} run on them at their original positions and cache only them. "
               f"The prompt must put the image at token {fastv['image_start']} and end with text after it.")
    else:
        how = "The decoder is dense (every prompt token in every layer)."
    fused_note = (f" `{files['prefill_decomposed']}` and `{files['decode_decomposed']}` are the same graphs in "
                  "standard ONNX ops only (any ONNX runtime), on the same weights." if "prefill_decomposed" in files
                  else "")
    if llm.get("mrope"):
        positions, step = "[3, batch, sequence]", "[3, batch, 1]"
        how += (" Positions are mRoPE's (t, h, w) rows: text tokens have t = h = w, image tokens the bundle's "
                "`kept_positions` (offset by the image's place in the prompt).")
    else:
        positions, step = "[batch, sequence]", "[batch, 1]"
    if llm.get("image_block"):
        how += (f" The prefill also takes `{IMAGE_ROWS}` [batch, sequence, 1] (float): 1 at the image's rows, which "
                "attend to each other both ways (the model's bidirectional image block, token_type_ids 1 in "
                "transformers), 0 at the text rows.")
    if llm.get("image_block_layers") == "sliding":
        how += " The image block is bidirectional in the sliding-window layers only; the global layers are causal."
    if llm.get("sliding_window"):
        how += (f" Its sliding-window layers see the last {llm['sliding_window']} rows (masked in both graphs: any "
                "length gives the model's own result; the caches keep every row).")
    if llm.get("per_layer_inputs"):
        how += (f" Both graphs also take `{PER_LAYER}` [batch, sequence, {n}, {llm['per_layer_inputs']}] (float): "
                "each token's own per-layer embeddings, as transformers' `get_per_layer_inputs` gives them from its "
                "id (an image row: the pad token's); the graphs add the projection of `inputs_embeds`.")
    if llm.get("kv_sources"):
        shared = [i for i, s in enumerate(llm["kv_sources"]) if s != i]
        how += (f" {_layers(shared[0], shared[-1])} have no cache of their own: each attends to the keys and values "
                f"of an earlier layer of its type, so there are {llm['cache_layers']} `present` pairs, not {n}.")
    if llm.get("conv_layers"):
        hidden, width = llm["conv_state"]
        how += (f" Layers {', '.join(map(str, llm['conv_layers']))} are short convolutions, not attention: instead of "
                f"keys and values each has `present.{{i}}.conv` [batch, {hidden}, {width}] (its convolution's last "
                f"{width} inputs), which the decode step takes back as `past_key_values.{{i}}.conv`; the caches are "
                f"numbered by layer, so the {llm['cache_layers']} key/value pairs are those of the attention layers.")
    if llm.get("recurrent_layers"):
        (channels, width), (heads, dk, dv) = llm["recurrent_states"]
        how += (f" Layers {', '.join(map(str, llm['recurrent_layers']))} are gated delta-nets (linear attention), not "
                f"attention: instead of keys and values each has `present.{{i}}.conv` [batch, {channels}, {width}] "
                f"(its convolution's last {width} inputs) and `present.{{i}}.recurrent` [batch, {heads}, {dk}, {dv}] "
                f"(the delta rule's state after the last row), which the decode step takes back as "
                f"`past_key_values.{{i}}.conv` / `.recurrent`; the prefill runs the rule over the prompt as an ONNX "
                f"`Scan`. The caches are numbered by layer, so the {llm['cache_layers']} key/value pairs are those of "
                f"the attention layers.")
    return f"""
## The language model (`--with-llm`)

`{files['prefill']}` and `{files['decode']}` ({llm['family']}, {n} layers, weights in `{files['weights']}`),
exported with {llm['exporter']}; each layer's attention is ONNX Runtime's `com.microsoft.MultiHeadAttention`
(causal in prefill) and its RMSNorms ONNX Runtime's (Skip)SimplifiedLayerNormalization, so they run in ONNX Runtime.{fused_note} {how}

- prefill: `inputs_embeds` [batch, sequence, {llm['hidden_size']}] (text embeddings with `image_features` in
  the image's place) and `position_ids` {positions} (the positions above) -> `logits` [batch, 1,
  {llm['vocab_size']}] of the last prompt token, and `present.{{i}}.key` / `.value` [batch, {llm['kv_heads']},
  length_i, {llm['head_dim']}] per layer.
- decode: `inputs_embeds` [batch, 1, {llm['hidden_size']}], `position_ids` {step} (the prompt's last position
  + 1, then + 1 per step: with FastV the later layers' caches are shorter than the position),
  `past_key_values.{{i}}.key` / `.value` (the presents) -> `logits` and the presents with the new token.

```python
import numpy as np, onnxruntime as ort
prefill = ort.InferenceSession("{files['prefill']}"); decode = ort.InferenceSession("{files['decode']}")
names = [o.name for o in prefill.get_outputs()]
out = dict(zip(names, prefill.run(None, {{"inputs_embeds": embeds, "position_ids": positions}})))
past = {{"past_key_values." + k[len("present."):]: v for k, v in out.items() if k.startswith("present.")}}
token, position = out["logits"][:, -1].argmax(-1), positions[..., -1:] + 1
# each step: decode.run(None, {{"inputs_embeds": embed(token)[:, None], "position_ids": position, **past}})
```

Checked at compile time against the PyTorch reference (batch 2, seed 0): logits and caches max-abs
{llm['parity']['logits_max_abs']:.2g}, greedy tokens over {llm['parity']['decode_steps']} steps
{'identical' if llm['parity']['tokens_identical'] else 'DIFFERENT'} (`manifest.json`, `llm_graphs`).
"""


class GraphRunner(LlmGraphRunner):
    """prefill.onnx + decode.onnx of a bundle's llm/ under ONNX Runtime: the graphs the bundle ships, as shipped."""

    def __init__(self, folder: Path, prefill: str = PREFILL, decode: str = DECODE):
        from vlmprune.targets.runtime import ort_session

        self._prefill, self._decode = ort_session(folder / prefill), ort_session(folder / decode)
        self._prefill_names = [o.name for o in self._prefill.get_outputs()]
        self._decode_names = [o.name for o in self._decode.get_outputs()]
        self.describe = f"{LLM_DIR}/{prefill} + {LLM_DIR}/{decode}, ONNX Runtime"
        self.kept = None  # FastV: the kept image tokens of the last prefill (indices within the image span)

    @staticmethod
    def _past(outputs: dict) -> dict:
        return {f"past_key_values.{k.split('.', 1)[1]}": v for k, v in outputs.items() if k.startswith("present.")}

    def prefill(self, embeds, positions, extra=None):
        import numpy as np

        feed = {"inputs_embeds": np.ascontiguousarray(embeds, dtype=np.float32),
                "position_ids": np.ascontiguousarray(positions, dtype=np.int64),
                **{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in (extra or {}).items()}}
        out = dict(zip(self._prefill_names, self._prefill.run(None, feed)))
        self.kept = out.get("kept_image_indices")
        return out["logits"][0, -1], self._past(out)

    def step(self, embeds, positions, state, extra=None):
        import numpy as np

        feed = {"inputs_embeds": np.ascontiguousarray(embeds, dtype=np.float32),
                "position_ids": np.ascontiguousarray(positions, dtype=np.int64), **state,
                **{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in (extra or {}).items()}}
        out = dict(zip(self._decode_names, self._decode.run(None, feed)))
        return out["logits"][0, -1], self._past(out)


def _refuse_fastv(config) -> None:
    """One line for FastV on a language model whose FastV the exporter does not compile (lm_source.NO_FASTV)."""
    why = lm_source.fastv_refusal(config)
    if why:
        raise InputError(f"--fastv-layer with language model type {config.model_type!r} is not supported: {why}")


class TorchExporter(LlmExporter):
    """torch.onnx (dynamo): prefill + decode in standard ops, original positions, FastV compiled in."""

    id = "torch"
    name = "torch.onnx"
    summary = "torch.onnx prefill + decode"
    features = "original positions, FastV"
    runtime = "onnxruntime (prefill + decode)"
    atol = PARITY_ATOL

    def check_model(self, spec: str, fastv) -> None:
        """The default's checks, and FastV on a language model whose FastV is not compiled here, before any work."""
        super().check_model(spec, fastv)
        config = lm_source.text_config(spec)
        if config is not None and fastv is not None:
            _refuse_fastv(config)

    def export(self, model_spec: str, manifest: Manifest, options, folder: Path, progress, fastv) -> dict:
        """Export the LLM's prefill and decode graphs into folder/llm, check them against the reference.

        The image span's length is the bundle's image-token count (manifest.llm["image_tokens"]).
        """
        from vlmprune.compiler.errors import ParityError

        spec = fastv
        lm = lm_source.language_model(model_spec)
        _inner, config = decoder_of(lm)
        tokens = manifest.llm.image_tokens if manifest.llm is not None else None
        if spec is not None and deepstack_levels(lm):
            raise InputError("--fastv-layer with a DeepStack language model (Qwen3-VL) is not supported: FastV drops "
                             "image rows that the DeepStack levels still add to after its layer")
        if spec is not None:
            _refuse_fastv(config)
        if spec is not None:
            if not isinstance(tokens, int):
                raise InputError(f"FastV needs a fixed image-token count; this bundle's is {tokens!r}")
            spec = FastVSpec(spec.image_start, tokens, spec.layer, spec.keep)
            spec.check(config.num_hidden_layers)
        lm_source.check_width(manifest, config)
        progress(f"export LLM ({config.model_type}, {config.num_hidden_layers} layers"
                 + (f", FastV after layer {spec.layer} keeping {spec.kept} of {spec.image_len} image tokens)"
                    if spec is not None else ", dense)") + " with torch.onnx (dynamo)")
        written = export_decoder(lm, spec, folder / LLM_DIR, options.opset)
        graph = DecodeGraph(lm)
        shapes = graph.cache_shapes
        image_tokens = tokens if isinstance(tokens, int) else 8
        parity = llm_parity(lm, spec, folder / LLM_DIR, image_tokens)
        parity["decomposed"] = llm_parity(lm, spec, folder / LLM_DIR, image_tokens, (PREFILL_DECOMPOSED, DECODE_DECOMPOSED))
        parity["passed"] = parity["passed"] and parity["decomposed"]["passed"]
        gap = figure_text(parity["logits_max_abs"], 3, at_most=PARITY_ATOL)  # a failing figure must read as failing
        plain = figure_text(parity["decomposed"]["logits_max_abs"], 3, at_most=PARITY_ATOL)
        between = figure_text(parity["fused_vs_decomposed"], 3, at_most=PARITY_ATOL)
        progress(f"  llm        {'PASS' if parity['passed'] else 'FAIL'}  logits max-abs {gap} (fused attention), "
                 f"{plain} (decomposed), fused vs decomposed {between}, greedy tokens "
                 f"{'identical' if parity['tokens_identical'] and parity['decomposed']['tokens_identical'] else 'DIFFER'}")
        if not parity["passed"]:
            raise ParityError(f"the exported language model disagrees with its PyTorch reference "
                              f"(logits max-abs {gap}, tolerance {PARITY_ATOL})")
        return {
            "exporter": f"torch.onnx (dynamo) {torch.__version__}, opset {options.opset}",
            "runtime": "ONNX Runtime (com.microsoft.MultiHeadAttention, (Skip)SimplifiedLayerNormalization); "
                       "the .decomposed.onnx pair: standard ops only",
            "family": config.model_type, "mrope": uses_mrope(config), "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "deepstack_levels": deepstack_levels(lm),
            "image_block": has_image_block(config), "layer_types": layer_types(config),
            "image_block_layers": ("sliding" if config.model_type in lm_source.SLIDING_BLOCK else "all")
            if has_image_block(config) else None,
            "per_layer_inputs": per_layer_width(config) or None,
            "cache_layers": len(graph.cached),  # the layers with keys and values of their own
            # the short-convolution layers, each with a convolution state [batch, hidden, L] (present.{i}.conv)
            "conv_layers": sorted(graph.convs) or None,
            "conv_state": graph.state_shapes(min(graph.convs))[0] if graph.convs else None,
            # the gated delta-net layers, each with a convolution state [batch, channels, L] (present.{i}.conv) and a
            # recurrent state [batch, value heads, dk, dv] (present.{i}.recurrent), as the operator declares them
            "recurrent_layers": sorted(graph.deltas) or None,
            "recurrent_states": graph.state_shapes(min(graph.deltas)) if graph.deltas else None,
            "kv_sources": kv_sources(config) if kv_sources(config) != list(range(config.num_hidden_layers)) else None,
            "sliding_window": getattr(config, "sliding_window", None) if layer_types(config) else None,
            "kv_heads": shapes[0][0], "head_dim": shapes[0][1], "vocab_size": config.vocab_size,
            # each present's [kv heads, head size] where they differ (Gemma 4's global layers)
            "cache_shapes": [list(x) for x in shapes] if len(set(shapes)) > 1 else None,
            "files": {k: f"{LLM_DIR}/{written[k]}"
                      for k in ("prefill", "decode", "prefill_decomposed", "decode_decomposed", "weights")},
            "io": written["io"],
            "fastv": None if spec is None else {
                "layer": spec.layer, "keep": spec.keep, "image_start": spec.image_start, "image_tokens": spec.image_len,
                "kept": spec.kept,
                "cache_lengths": f"{_layers(1, spec.layer)} cache every prompt token, "
                                 f"{_layers(spec.layer + 1, config.num_hidden_layers)} the prompt minus the "
                                 f"{spec.image_len - spec.kept} dropped image tokens"},
            "parity": parity,
        }

    def parity(self, model_spec: str, bundle_dir: Path, manifest: Manifest) -> tuple[bool, dict]:
        llm = manifest.llm_graphs
        tokens = manifest.llm.image_tokens if manifest.llm is not None else None
        got = llm_parity(lm_source.language_model(model_spec), spec_of(llm), bundle_dir / LLM_DIR,
                         tokens if isinstance(tokens, int) else 8)
        outputs = {
            "logits + present": {"note": f"max-abs {got['logits_max_abs']:.3g} (≤ {PARITY_ATOL:g}), "
                                         f"batch {got['batch']}, {got['prompt_tokens']} prompt tokens, "
                                         f"seed {got['seed']}",
                                 "passed": got["logits_max_abs"] <= PARITY_ATOL},
            "greedy tokens": tokens_note(got),
        }
        if llm.get("fastv"):
            outputs["kept_image_indices"] = {"note": "identical" if got["kept_identical"] else "DIFFER",
                                             "passed": got["kept_identical"]}
        passed = got["passed"]
        if "fused_vs_decomposed" in got:  # a bundle with both forms: the decomposed pair against the reference too
            plain = llm_parity(lm_source.language_model(model_spec), spec_of(llm), bundle_dir / LLM_DIR,
                               tokens if isinstance(tokens, int) else 8, (PREFILL_DECOMPOSED, DECODE_DECOMPOSED))
            outputs["fused vs decomposed prefill"] = {
                "note": f"max-abs {got['fused_vs_decomposed']:.3g} (≤ {PARITY_ATOL:g})",
                "passed": got["fused_vs_decomposed"] <= PARITY_ATOL}
            outputs["decomposed: logits + present, greedy tokens"] = {
                "note": f"max-abs {plain['logits_max_abs']:.3g} (≤ {PARITY_ATOL:g}), " + tokens_note(plain)["note"],
                "passed": plain["passed"]}
            passed = passed and plain["passed"]
        return passed, outputs

    def graph_runner(self, bundle_dir: Path, manifest: Manifest) -> tuple[LlmGraphRunner | None, str]:
        """The shipped prefill.onnx + decode.onnx under ONNX Runtime (here whenever onnxruntime imports)."""
        import importlib.util

        if importlib.util.find_spec("onnxruntime") is None:
            return None, "onnxruntime is not installed"
        files = manifest.llm_graphs["files"]
        folder = Path(bundle_dir)
        runner = GraphRunner(folder / Path(files["prefill"]).parent, Path(files["prefill"]).name,
                             Path(files["decode"]).name)
        return runner, runner.describe

    def readme_section(self, manifest: Manifest) -> str:
        return readme_section(manifest)
