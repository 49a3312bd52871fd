"""Where the language model comes from: the causal LM inside a VLM checkpoint, and the decoder families known.

Why a module of its own: every LLM exporter (compiler.llm.torch_exporter, genai, edgellm) and
FastV's reference read the language model the same way, so they all import it from here and
none imports another exporter for it.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError

# Hugging Face model_type values whose decoder layer the exporters know: Llama and Qwen2 (the language models of
# LLaVA, LLaVA-NeXT, InternVL3 and SmolVLM checkpoints, read from the VLM's own decoder), and the
# language models of Qwen2-VL / Qwen2.5-VL (Qwen2's layer; their rotary embedding takes mRoPE's
# (t, h, w) positions, [3, B, T], and hands the layers ordinary cos/sin).
# Qwen3 (the language model of InternVL3.5 checkpoints): Qwen2's layer without the q/k/v biases, and an RMSNorm over
# each head's queries and keys before the rotation (QK_NORM); 1-D positions, a causal-LM class of its own.
# Qwen3-VL's language model (qwen3_vl_text): Qwen3's layer (a per-head RMSNorm on the queries and keys, QK_NORM),
# mRoPE positions, and DeepStack: the vision tower's level-l rows added to the image rows after layer l-1.
# Gemma 3's language model (gemma3_text, transformers' modeling_gemma3): its layer norms with (1 + weight) (the
# layer's own modules, so nothing to spell), a per-head q/k norm (QK_NORM), the attention scaled by
# query_pre_attn_scalar ** -0.5 (the module's own `scaling`), a gelu_pytorch_tanh MLP (the module's own), and:
# SANDWICH_NORM, four norms a layer (the attention's and the MLP's outputs normed before each residual add);
# LAYER_TYPES, sliding-window and global layers interleaved (config.layer_types), each type with its own rotary base
# (rotary_emb(x, positions, layer_type): rope_local_base_freq for the sliding ones) and the sliding ones seeing the
# last sliding_window tokens only; IMAGE_BLOCK, the image rows attending to each other both ways (transformers builds
# that from token_type_ids in Gemma3Model.forward): the prefill graph takes which rows are image rows, and the
# parity reference asks transformers' own mask builder, named here (the module that holds get_block_sequence_ids_for_mask
# and create_masks_for_vision_model). Its embedding scale (sqrt(hidden)) is the embedding module's, before the graph:
# inputs_embeds are embeddings as the model's own get_input_embeddings gives them.
# Gemma 4's language model (gemma4_text, transformers' modeling_gemma4): Gemma 3's layer (QK_NORM, SANDWICH_NORM,
# LAYER_TYPES, its own `scaling`, 1.0) with a value norm (the module's own v_norm; the global layers of a checkpoint
# with attention_k_eq_v take the key projection as the values, the module's own v_proj None), a head size and key/value
# heads of each layer's own (per_layer_config: the global layers' global_head_dim), the global layers' proportional
# rotary embedding (the module's own), and: PER_LAYER_INPUTS, per-layer embeddings (PLE, hidden_size_per_layer_input):
# each layer adds a gated projection of its slice of (the context projection of inputs_embeds + the token's own
# per-layer embedding) * 2^-0.5, transformers' project_per_layer_inputs; the token part is what transformers'
# get_per_layer_inputs gives from the ids (the image rows: the pad token's), an input of the graphs as inputs_embeds
# is; LAYER_SCALAR, each layer's output times its layer_scalar; SHARED_KV, the last num_kv_shared_layers layers have no
# cache of their own and attend to the keys and values of the last earlier layer of their type (kv_sources);
# IMAGE_BLOCK on the sliding layers only (SLIDING_BLOCK; the global layers stay causal) and only where the config asks
# (use_bidirectional_attention "vision"); FINAL_SOFTCAP, the logits capped by final_logit_softcapping as
# Gemma4ForConditionalGeneration caps them. Refused: its mixture-of-experts blocks (enable_moe_block).
# LFM2's language model (lfm2, transformers' modeling_lfm2; LFM2-VL's decoder) is hybrid. CONV_STATE: the layers that
# config.layer_types names "conv" have no attention but a gated short convolution (Lfm2ShortConv: in_proj into B, C and
# x; B*x through a depthwise causal conv1d of kernel conv_L_cache; C times that; out_proj; compiler.llm.short_conv), so
# what a decode step needs of their past is a convolution state, the conv's last conv_L_cache inputs, not keys and
# values: the graphs carry it beside the attention layers' caches (`present.{i}.conv`, i the layer's number, as the
# attention layers' `present.{i}.key`). The attention layers: Llama's, with a per-head q/k norm (QK_NORM), 1-D RoPE. Its
# modules are named otherwise (MODULE_NAMES: the exporter asks for Llama's names). Its parity reference is transformers'
# own forward (OWN_FORWARD) on a cache built from its config (reference_cache), which holds the conv states.
# Qwen3.5's language model (qwen3_5_text, transformers' modeling_qwen3_5; MiniCPM-V 4.6's decoder) is hybrid too.
# RECURRENT_STATE: the layers that config.layer_types names "linear_attention" are gated delta-nets
# (Qwen3_5GatedDeltaNet: in_proj_qkv through a depthwise causal conv1d and SiLU, L2-normed q and k, the gated delta
# rule over a recurrent state [batch, value heads, dk, dv], a gated RMSNorm, out_proj; compiler.llm.gated_delta), so a
# decode step needs two states of each: the conv's last linear_conv_kernel_dim inputs (`present.{i}.conv`) and the
# recurrent state (`present.{i}.recurrent`). The attention layers (Qwen3_5Attention): a per-head q/k norm (QK_NORM, the
# modules' own (1 + weight) norms), GATED_QUERY (q_proj gives each head's queries and an output gate side by side; the
# attention's output times sigmoid(gate) before o_proj), a partial rotary embedding (partial_rotary_factor: the rotary
# embedding's cos/sin narrower than the head, the rest of each head passed through; the exporter reads the width off
# cos). Its rotary embedding is written for mRoPE's sections, but MiniCPM-V gives it 1-D positions ([batch, sequence],
# expanded to the three sections alike): not MROPE. Parity: transformers' own forward (OWN_FORWARD) on a cache built
# from its config (reference_cache), which holds both states of every linear-attention layer.
FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "gemma3_text",
            "gemma4_text", "lfm2", "qwen3_5_text")
MROPE = frozenset({"qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"})
QK_NORM = frozenset({"qwen3", "qwen3_vl_text", "gemma3_text", "gemma4_text", "lfm2", "qwen3_5_text"})
CONV_STATE = {"lfm2": "conv"}  # the layer type (config.layer_types) of the short-convolution layers
RECURRENT_STATE = {"qwen3_5_text": "linear_attention"}  # the layer type of the gated delta-net layers
GATED_QUERY = frozenset({"qwen3_5_text"})  # q_proj: each head's queries, then its output gate
# Where the decoder's modules are not named as Llama's: Llama's name -> the family's (what the exporter's layer reads).
MODULE_NAMES = {"lfm2": {"input_layernorm": "operator_norm", "post_attention_layernorm": "ffn_norm",
                         "mlp": "feed_forward", "q_norm": "q_layernorm", "k_norm": "k_layernorm", "o_proj": "out_proj",
                         "norm": "embedding_norm"}}
# parity's reference is transformers' own forward, whatever else the decoder has
OWN_FORWARD = frozenset({"lfm2", "qwen3_5_text"})
SANDWICH_NORM = frozenset({"gemma3_text", "gemma4_text"})
LAYER_TYPES = frozenset({"gemma3_text", "gemma4_text"})
IMAGE_BLOCK = {"gemma3_text": "transformers.models.gemma3.modeling_gemma3",
               "gemma4_text": "transformers.models.gemma4.modeling_gemma4"}
IMAGE_BLOCK_WHEN = {"gemma4_text": ("use_bidirectional_attention", "vision")}  # config attribute, value; else always
SLIDING_BLOCK = frozenset({"gemma4_text"})  # the image block on the sliding layers only
PER_LAYER_INPUTS = frozenset({"gemma4_text"})  # where hidden_size_per_layer_input is set
LAYER_SCALAR = frozenset({"gemma4_text"})
SHARED_KV = frozenset({"gemma4_text"})
FINAL_SOFTCAP = frozenset({"gemma4_text"})
# Decoders known by name and refused, with the reason (the others: "not supported" and the list).
REFUSED = {"qwen3_moe": "Qwen3-MoE's decoder (InternVL3.5's MoE checkpoints) replaces the MLP with a mixture of "
                        "experts (a router picking num_experts_per_tok of num_experts MLPs per token), which the "
                        "exporter's layer does not compute"}
# Decoders whose FastV the exporter refuses, with the reason: FastV's reference (compiler.llm.fastv) runs the layers
# under one causal mask with one rotary embedding.
NO_FASTV = {"gemma3_text": "FastV's reference runs every layer causally with one rotary embedding, and Gemma 3's "
                           "language model has a bidirectional image block, sliding-window layers and two rotary "
                           "bases; FastV's cut inside the image block is not defined",
            "gemma4_text": "FastV's reference runs every layer causally with one rotary embedding on caches of its "
                           "own, and Gemma 4's language model has sliding-window layers, two rotary bases, per-layer "
                           "embeddings and layers that share an earlier layer's cache",
            "lfm2": "FastV's reference runs every layer as attention on a KV cache, and LFM2's language model has "
                    "short-convolution layers, which carry a convolution state instead",
            "qwen3_5_text": "FastV's reference runs every layer as attention on a KV cache, and Qwen3.5's language "
                            "model has gated delta-net linear-attention layers, which carry a convolution and a "
                            "recurrent state instead"}
# text models with a causal-LM class of their own
_CAUSAL_LM_TYPES = ("llama", "qwen2", "qwen3", "lfm2", "qwen3_5_text")


def uses_mrope(config) -> bool:
    """Positions are [3, B, T] (t, h, w) rather than [B, T]."""
    return getattr(config, "model_type", None) in MROPE


def decoder_of(model):
    """(inner decoder model, its config) of a causal LM whose decoder layer the exporters know; one line for anything
    else."""
    config = getattr(model, "config", None)
    check_family(config)
    return model.model, config


def check_family(config) -> None:
    """One line for a language model whose decoder layer the exporters do not know."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise InputError(f"language model type {model_type!r} is not supported for export: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise InputError(f"language model type {model_type!r} is not supported for export "
                         f"(supported: {', '.join(FAMILIES)})")
    if getattr(config, "use_sliding_window", False):
        raise InputError("a sliding-window language model is not supported for export")
    if model_type in LAYER_TYPES:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise InputError(f"{model_type} with attn_logit_softcapping {config.attn_logit_softcapping} is not "
                             "supported for export: ONNX Runtime's MultiHeadAttention, which the exported graphs "
                             "run, has no softcap (Gemma 3's released configs leave it unset)")
        if getattr(config, "use_bidirectional_attention", None) in (True, "all"):
            raise InputError(f"{model_type} with use_bidirectional_attention (an embedding model, not a causal "
                             "decoder) is not supported for export")
        if getattr(config, "enable_moe_block", False):
            raise InputError(f"{model_type} with enable_moe_block (Gemma 4's mixture-of-experts layers: a router "
                             f"picking top_k_experts of num_experts experts beside the MLP) is not supported for "
                             "export: the exporter's layer computes the dense MLP only")
        shared = getattr(config, "num_kv_shared_layers", 0) or 0
        if model_type in SHARED_KV and shared and shared >= config.num_hidden_layers:
            raise InputError(f"{model_type} with every layer sharing KV (num_kv_shared_layers {shared} of "
                             f"{config.num_hidden_layers}: a draft model reading another model's cache) is not "
                             "supported for export: no layer of its own computes the keys and values")


def fastv_refusal(config) -> str | None:
    """Why FastV cannot be compiled into this language model, or None."""
    return NO_FASTV.get(getattr(config, "model_type", None))


def layer_types(config) -> list[str] | None:
    """Each layer's attention type ("sliding_attention" / "full_attention") where the decoder has them, else None."""
    return list(config.layer_types) if getattr(config, "model_type", None) in LAYER_TYPES else None


def _layers_of_type(config, types: dict) -> list[int]:
    """The layers whose config.layer_types entry is the one `types` names for the decoder's model_type, else []."""
    kind = types.get(getattr(config, "model_type", None))
    return [i for i, t in enumerate(config.layer_types) if t == kind] if kind is not None else []


def conv_layers(config) -> list[int]:
    """The layers that are short convolutions (CONV_STATE: a convolution state, no keys and values), else []."""
    return _layers_of_type(config, CONV_STATE)


def recurrent_layers(config) -> list[int]:
    """The layers that are gated delta-nets (RECURRENT_STATE: a convolution and a recurrent state, no keys and
    values), else []."""
    return _layers_of_type(config, RECURRENT_STATE)


def module_name(config, name: str) -> str:
    """The decoder's own name of the module Llama's layer calls `name` (MODULE_NAMES)."""
    return MODULE_NAMES.get(getattr(config, "model_type", None), {}).get(name, name)


def own_forward_reference(config) -> bool:
    """Whether the parity reference is transformers' own text model forward rather than its layers run one by one:
    what only that forward computes (Gemma 4's per-layer embeddings and shared KV, LFM2's convolution states, Qwen3.5's
    convolution and recurrent states)."""
    model_type = getattr(config, "model_type", None)
    return bool(per_layer_width(config)) or model_type in SHARED_KV or model_type in OWN_FORWARD


def reference_cache(config):
    """The transformers cache the reference forward fills: one built from the config where the decoder keeps states of
    other kinds (CONV_STATE, RECURRENT_STATE: those layers' cache layers hold them), else an unbounded DynamicCache
    (every row of every layer, the sliding ones too, so that they compare with the graphs' whole presents)."""
    from transformers import DynamicCache

    other = getattr(config, "model_type", None) in {**CONV_STATE, **RECURRENT_STATE}
    return DynamicCache(config=config) if other else DynamicCache()


def has_image_block(config) -> bool:
    """Whether the decoder's image rows attend to each other both ways (IMAGE_BLOCK, where the config asks)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in IMAGE_BLOCK:
        return False
    when = IMAGE_BLOCK_WHEN.get(model_type)
    return when is None or getattr(config, when[0], None) == when[1]


def per_layer_width(config) -> int:
    """The per-layer embeddings' width of a decoder with PLE (PER_LAYER_INPUTS), else 0."""
    if getattr(config, "model_type", None) not in PER_LAYER_INPUTS:
        return 0
    return int(getattr(config, "hidden_size_per_layer_input", 0) or 0)


def per_layer_inputs(lm, ids):
    """{"per_layer_inputs": the token part of the per-layer embeddings of ids [B, T]} (transformers' own
    get_per_layer_inputs), {} without PLE."""
    if not per_layer_width(lm.config):
        return {}
    return {"per_layer_inputs": lm.model.get_per_layer_inputs(ids)}


def kv_sources(config) -> list[int]:
    """Each layer's cache owner: itself, or (SHARED_KV, kv_sharing_modes "reuse") the last layer of its type before
    the shared ones, whose keys and values it attends to."""
    n = config.num_hidden_layers
    if getattr(config, "model_type", None) not in SHARED_KV or not getattr(config, "num_kv_shared_layers", 0):
        return list(range(n))
    first = n - config.num_kv_shared_layers
    types = list(config.layer_types)
    return [i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(n)]


def logits(lm, hidden):
    """The head's logits of hidden states: lm_head, then final_logit_softcapping where the VLM caps them
    (FINAL_SOFTCAP)."""
    import torch

    out = lm.lm_head(hidden)
    cap = getattr(lm.config, "final_logit_softcapping", None) if lm.config.model_type in FINAL_SOFTCAP else None
    return out if cap is None else torch.tanh(out / cap) * cap


def image_block_masks(config, embeds, positions, cache, image_rows):
    """transformers' own attention masks of a decoder with a bidirectional image block (IMAGE_BLOCK): its mask builder
    given the image rows ([B, T] bool), as the VLM's forward builds them from token_type_ids; a mask of ones, since
    positions with gaps otherwise read as packed sequences."""
    import importlib

    import torch

    import inspect

    hf = importlib.import_module(IMAGE_BLOCK[config.model_type])
    takes_device = "device" in inspect.signature(hf.get_block_sequence_ids_for_mask).parameters  # Gemma 4's
    ids = hf.get_block_sequence_ids_for_mask(image_rows.long(), *([embeds.device] if takes_device else []))
    ones = torch.ones(embeds.shape[:2], dtype=torch.long)
    return hf.create_masks_for_vision_model(config=config, inputs_embeds=embeds, attention_mask=ones, cache=cache,
                                            position_ids=positions, block_sequence_ids=ids)


def check_width(manifest: Manifest, config) -> None:
    """One line when the bundle's image features are not as wide as the language model's embeddings."""
    hidden = manifest.llm.hidden_size if manifest is not None and manifest.llm is not None else None
    if isinstance(hidden, int) and hidden != config.hidden_size:
        raise InputError(f"the bundle's image features are {hidden} wide, "
                         f"its language model takes {config.hidden_size}")


class CausalLM(nn.Module):
    """A VLM's own text model and head, seen as a causal LM (no copy of the weights).

    For the VLMs whose text model has no causal-LM class of its own (Qwen2-VL's and
    Qwen2.5-VL's take mRoPE positions): what decoder_of, the reference and the graphs read.
    """

    def __init__(self, model: nn.Module, lm_head: nn.Module, config, deepstack: int = 0):
        super().__init__()
        self.model, self.lm_head, self.config = model, lm_head, config
        self.deepstack = deepstack  # DeepStack levels its prefill adds after layers 0..deepstack-1 (Qwen3-VL)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens


def llm_checkpoint(spec: str):
    """The Checkpoint of a VLM directory whose language model --with-llm exports; one line for anything else."""
    from vlmprune.compiler.frontend.adapter import Checkpoint

    path = Path(spec)
    checkpoint = Checkpoint(path) if path.is_dir() else None
    if checkpoint is None or checkpoint.model_type not in vlm_classes():
        kind = f"model type {checkpoint.model_type!r}" if checkpoint is not None else "not a checkpoint directory"
        raise InputError(f"--with-llm needs `demo` or a VLM checkpoint that holds its language model ({vlm_names()}); "
                         f"{spec} is {kind}")
    return checkpoint


def vlm_classes() -> dict[str, str]:
    """Checkpoints whose language model --with-llm exports -> the transformers class that loads them: what the
    families declare (Family.language_model)."""
    from vlmprune.compiler.frontend import FAMILIES

    return {t: name for f in FAMILIES for t, name in f.language_model.items()}


def vlm_names() -> str:
    """The families that declare a full VLM (Family.language_model), in their own words, for llm_checkpoint's line:
    the decoder each holds is checked after (check_family), with its reason where it is refused."""
    from vlmprune.compiler.contract import PATCH_TOKENS
    from vlmprune.compiler.frontend import FAMILIES

    return ", ".join(dict.fromkeys(f.has[PATCH_TOKENS] for f in FAMILIES if f.language_model))


def text_config(spec: str):
    """MODEL's language-model config from its config alone (no weights); None where MODEL does not exist
    (the frontend says what is missing)."""
    if spec == "demo":
        from vlmprune.compiler.frontend.presets import demo_config

        return demo_config().text_config
    if not Path(spec).exists():
        return None
    return llm_checkpoint(spec).config.text_config


def language_model(spec: str):
    """The causal LM of MODEL (`demo` or a checkpoint of a family that declares its VLM): the VLM's own, no copy."""
    from vlmprune.compiler.frontend.source import no_init_weights, quiet_transformers

    quiet_transformers()
    if spec == "demo":
        from vlmprune.compiler.frontend.presets import demo_model

        vlm = demo_model()
    else:
        import transformers

        from vlmprune.compiler.frontend.source import from_pretrained

        checkpoint = llm_checkpoint(spec)
        vlm = from_pretrained(getattr(transformers, vlm_classes()[checkpoint.model_type]), checkpoint, "checkpoint")
    text = vlm.config.text_config
    check_family(text)
    # The VLM's decoder: language_model in most, text_model in SmolVLM's (get_decoder names either)
    decoder = vlm.model.language_model if hasattr(vlm.model, "language_model") else vlm.model.get_decoder()
    if text.model_type in _CAUSAL_LM_TYPES:
        from transformers import AutoModelForCausalLM

        with no_init_weights():
            lm = AutoModelForCausalLM.from_config(text)
        lm.model = decoder
        lm.lm_head = vlm.lm_head
        return lm.eval()
    levels = len(getattr(vlm.config.vision_config, "deepstack_visual_indexes", None) or ())  # Qwen3-VL's
    return CausalLM(decoder, vlm.lm_head, text, levels).eval()


def deepstack_levels(model) -> int:
    """How many DeepStack levels a causal LM's prefill takes (0 for every language model but Qwen3-VL's)."""
    return model.deepstack if isinstance(model, CausalLM) else 0


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: it has one


def has_tokenizer(path: Path) -> bool:
    """Whether a checkpoint directory ships a tokenizer: `generate` decodes with it, genai's builder copies it."""
    return any((path / f).is_file() for f in TOKENIZER_FILES)
