"""Tiny checkpoints built offline from configs (Qwen2-VL, Qwen3-VL, LLaVA, InternVL3 / 3.5, Gemma 3, SmolVLM, LFM2-VL,
MiniCPM-V), for
the tests that need one.

One builder so that every test's tiny Qwen has the same tower shapes (Qwen2-VL: 2 blocks;
Qwen2.5-VL: 3 blocks, windows of 56 px, block 2 full attention) and differs only where the
test says (the language model's size, the vocabulary, which weights are spread).
"""

from __future__ import annotations

from pathlib import Path

import torch

QWEN_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def spread(model, prefixes: tuple[str, ...] = (), suffixes: tuple[str, ...] = (), std: float = 0.2) -> None:
    """transformers' init leaves tiny models near-uniform (attention blind to content and position): spread them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim > 1 and (name.startswith(prefixes) if prefixes else True) \
                    and (name.endswith(suffixes) if suffixes else True):
                param.normal_(0.0, std)


def spread_decoder(model, prefix: str) -> None:
    """A Llama-, Qwen2- or Qwen3-layer language model's weights (under prefix) spread for a parity test: its matrices
    and biases drawn (Qwen2's q/k/v biases start at zero), and every RMSNorm's scale drawn around 1 (transformers
    starts them at 1 exactly; Qwen3's per-head q_norm / k_norm among them), so that a projection, a bias or a norm
    spelled out wrongly shows in the logits."""
    spread(model, (prefix,))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(prefix) and param.ndim == 1:
                param.normal_(1.0, 0.3) if "norm" in name else param.normal_(0.0, 0.2)


def tiny_qwen(path: Path, family: str = "qwen2_vl", seed: int = 0, ids: dict | None = None, **text) -> Path:
    """A seeded tiny Qwen2-VL or Qwen2.5-VL saved (safetensors) at path, its tower's weights spread.

    text: overrides of the language model's config (default: 1 layer, 48 wide, 2 heads, vocab 128,
    mRoPE sections [4, 4, 4]).
    """
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=128,
                  rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0})
    config.update(text)
    ids = QWEN_IDS if ids is None else ids
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=config, **ids))
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=config["hidden_size"],
                      num_heads=2, window_size=56, fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, text_config=config, **ids))
    spread(model, ("visual.", "model.visual."))
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


def edited_copy(source: Path, copy: Path, edit) -> Path:
    """A copy of the checkpoint folder source at copy, its config.json changed in place by edit(config dict)."""
    import json
    import shutil

    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def tiny_llava_dinov2(path: Path, seed: int = 0, **llava) -> Path:
    """A seeded tiny LlavaForConditionalGeneration on a 3-block DINOv2 tower (112 px, patch 14: [CLS] + 64
    patches), its tower spread, saved (safetensors) at path. llava: overrides of LlavaConfig (feature layer, ...)."""
    from transformers import Dinov2Config, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = Dinov2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                          image_size=112, patch_size=14, layerscale_value=0.5)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=128)
    options = dict(vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_index=100)
    options.update(llava)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, **options))
    spread(model, ("model.vision_tower.",))
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_qwen3_vl(path: Path, seed: int = 0, ids: dict | None = None, **text) -> Path:
    """A seeded tiny Qwen3-VL saved (safetensors) at path, its tower's weights spread: 3 vision blocks 32 wide,
    patch 16 (S a multiple of 32), DeepStack after blocks 0 and 1, a 6x6 position table (resampled to the grid).

    text: overrides of the language model's config (default: 2 layers, so both DeepStack planes are added;
    48 wide, 2 heads of 24, vocab 128, mRoPE sections [4, 4, 4]).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=24, vocab_size=128,
                  rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0,
                                   "mrope_interleaved": True})
    config.update(text)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=config["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=36,
                  deepstack_visual_indexes=[0, 1])
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=vision, text_config=config,
                                                          **(QWEN_IDS if ids is None else ids)))
    spread(model, ("visual.", "model.visual."))
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


# InternVL3's chat template as transformers' conversion writes it into its -hf checkpoints: ChatML turns, an image as
# <IMG_CONTEXT> and a newline (its processor expands <IMG_CONTEXT> to <img> + the tile's tokens + </img>).
INTERNVL_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
                     "{% if message['content'] is string %}{{ message['content'] }}"
                     "{% else %}{% for content in message['content'] %}"
                     "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
                     "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
                     "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
                     "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
                     "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}")


def tiny_internvl(path: Path, seed: int = 0, image_token_id: int = 120, spread_llm: bool = False,
                  tokenizer: bool = False, **text) -> Path:
    """A seeded tiny InternVL3 (InternVLForConditionalGeneration) saved (safetensors) at path, its tower and projector
    spread: 3 vision blocks 32 wide (2 heads, layer scales 0.5), 112 px at patch 14 ([CLS] + 8x8 patches, pixel-
    shuffled 2x2 into 4x4 = 16 tokens), a Qwen2 LLM (text: overrides; default 1 layer, 48 wide, vocab 128,
    image_token_id 120 by default). spread_llm: the LLM's weights spread too (spread_decoder). tokenizer: also a
    byte-level tokenizer (bytes 0-255, then <|im_start|>, <|im_end|>, <img>, </img>, <video>; <IMG_CONTEXT> at
    image_token_id, named as InternVL's tokenizer names them) with INTERNVL_TEMPLATE."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    config = dict(model_type="qwen2", hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    config.update(text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  image_size=[112, 112], patch_size=[14, 14], layer_scale_init_value=0.5)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(InternVLConfig(vision_config=vision, text_config=config,
                                                            image_token_id=image_token_id))
    spread(model, ("model.vision_tower.", "model.multi_modal_projector."))
    with torch.no_grad():  # the [CLS] token and position table start at zero: spread them too
        embeddings = model.model.vision_tower.embeddings
        embeddings.cls_token.normal_(0.0, 0.2)
        embeddings.position_embeddings.normal_(0.0, 0.2)
    if spread_llm:
        spread_decoder(model, "model.language_model.")
    if tokenizer:
        model.generation_config.eos_token_id = 257  # <|im_end|>
    model.eval().save_pretrained(path, safe_serialization=True)
    if tokenizer:
        byte_tokenizer(path, ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<video>"), image_token_id,
                       INTERNVL_TEMPLATE, image_token="<IMG_CONTEXT>", eos_token="<|im_end|>",
                       extra_special_tokens={"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
                                             "end_image_token": "</img>", "video_token": "<video>"})
    return Path(path)


def tiny_internvl35(path: Path, seed: int = 0, **kwargs) -> Path:
    """tiny_internvl with InternVL3.5's language model: Qwen3 (per-head q_norm / k_norm, no q/k/v biases), its head
    size 32 set apart from hidden / heads (48 / 2), as Qwen3's released configs set it (Qwen3-0.6B: 128 against
    1024 / 16), and a multiple of 16 so that onnxruntime-genai's GroupQueryAttention runs it on the CPU. kwargs:
    tiny_internvl's (text overrides included)."""
    return tiny_internvl(path, seed, **{"model_type": "qwen3", "head_dim": 32, **kwargs})


def tiny_gemma3(path: Path, seed: int = 0, image_token_id: int = 120, boi: int = 121, eoi: int = 122,
                spread_llm: bool = False, **text) -> Path:
    """A seeded tiny Gemma 3 (Gemma3ForConditionalGeneration) saved (safetensors) at path, its tower and projector
    spread: 3 SigLIP blocks 32 wide (2 heads, no pooling head), 128 px at patch 8 (16x16 patches, average-pooled 4x4
    into 4x4 = 16 tokens), a Gemma 3 LLM (text: overrides; default 2 layers 48 wide, one sliding-window layer of 8
    then one global, vocab 128; image, boi and eoi tokens 120, 121, 122 by default). spread_llm: the LLM's matrices
    spread too, and every norm's scale (zero at init, (1 + w)) drawn, so that a layer spelled out wrongly shows."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, vocab_size=128, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    config.update(text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=128,
                  patch_size=8, vision_use_head=False)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(Gemma3Config(vision_config=vision, text_config=config,
                                                        mm_tokens_per_image=16, image_token_index=image_token_id,
                                                        boi_token_index=boi, eoi_token_index=eoi))
    spread(model, ("model.vision_tower.", "model.multi_modal_projector."))
    with torch.no_grad():  # the connector's RMSNorm scale starts at zero (1 + w): spread it too
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0.0, 0.2)
        if spread_llm:
            spread(model, ("model.language_model.",))
            for name, param in model.model.language_model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


# Gemma 3's chat template as its checkpoints ship it, less the system-turn folding: <bos>, turns, the image as its
# boi token (which the processor expands).
GEMMA3_TEMPLATE = ("{{ bos_token }}{%- for message in messages -%}"
                   "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
                   "{{ '<start_of_turn>' + role + '\n' }}"
                   "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
                   "{%- else -%}{%- for item in message['content'] -%}"
                   "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
                   "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
                   "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
                   "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
GEMMA3_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                   "<image_soft_token>")


def gemma3_processor(path: Path, image_size: int = 128, tokens: int = 16) -> dict[str, int]:
    """A Gemma 3 processor (a byte-level tokenizer: the 256 bytes, then GEMMA3_SPECIALS as ids 256.., its chat template,
    Gemma 3's PIL image processor) saved at path; returns the special tokens' ids (image, boi, eoi for tiny_gemma3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(GEMMA3_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens={"boi_token": "<start_of_image>",
                                                         "eoi_token": "<end_of_image>",
                                                         "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    Gemma3Processor(image_processor=images, tokenizer=fast, chat_template=GEMMA3_TEMPLATE,
                    image_seq_length=tokens).save_pretrained(path)
    ids = {s: tok.token_to_id(s) for s in GEMMA3_SPECIALS}
    return {"image_token_id": ids["<image_soft_token>"], "boi": ids["<start_of_image>"], "eoi": ids["<end_of_image>"],
            "eos": ids["<eos>"], "bos": ids["<bos>"]}


def tiny_smolvlm(path: Path, seed: int = 0, image_token_id: int = 120, tokenizer: bool = False,
                 spread_llm: bool = False, **text) -> Path:
    """A seeded tiny SmolVLM (SmolVLMForConditionalGeneration) saved (safetensors) at path, its tower and connector
    spread: 3 vision blocks 32 wide (2 heads), 128 px at patch 8 (16x16 patches, pixel-shuffled 4x4 into 4x4 = 16
    tokens, as SmolVLM-256M's scale_factor 4), a Llama LLM (text: overrides; default 1 layer, 48 wide, vocab 128).
    tokenizer: also a byte-level tokenizer (bytes 0-255, then <|im_start|>, <end_of_utterance>,
    <fake_token_around_image>, <global-img>; <image> at image_token_id) with SmolVLM's chat template.
    spread_llm: the LLM's weights spread too (spread_decoder)."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    config = dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    config.update(text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=128,
                  patch_size=8)
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(SmolVLMConfig(vision_config=vision, text_config=config, scale_factor=4,
                                                          image_token_id=image_token_id))
    spread(model, ("model.vision_model.", "model.connector."))
    with torch.no_grad():  # the position table is an Embedding (1-D rows spread above, but keep it explicit)
        model.model.vision_model.embeddings.position_embedding.weight.normal_(0.0, 0.2)
    if spread_llm:
        spread_decoder(model, "model.text_model.")
    model.generation_config.eos_token_id = 257  # <end_of_utterance>
    model.eval().save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

        byte_tokenizer(path, ("<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<global-img>"),
                       image_token_id, DEFAULT_CHAT_TEMPLATE, bos_token="<|im_start|>", eos_token="<end_of_utterance>")
    return Path(path)


def byte_tokenizer(path: Path, specials: tuple[str, ...], image_token_id: int, chat_template: str,
                   image_token: str = "<image>", **named) -> None:
    """A byte-level tokenizer saved at path: bytes 0-255, then specials as ids 256.., image_token at image_token_id
    (<unusedN> between); named: its bos/eos tokens and extra_special_tokens, by their text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), image_token_id)})
    vocab[image_token] = image_token_id
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in [*specials, image_token]])
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **named).save_pretrained(path)


# LFM2-VL's chat turns (ChatML, <|startoftext|> first), the image as its <image> token, which its processor expands.
LFM2_VL_TEMPLATE = ("{{ bos_token }}{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' }}"
                    "{%- if message['content'] is string -%}{{ message['content'] }}"
                    "{%- else -%}{%- for item in message['content'] -%}"
                    "{%- if item['type'] == 'image' -%}{{ '<image>' }}"
                    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
                    "{%- endfor -%}{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}"
                    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
LFM2_VL_SPECIALS = ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|image_start|>", "<|image_end|>")


def tiny_lfm2_vl(path: Path, seed: int = 0, image_token_id: int = 120, tokenizer: bool = False,
                 spread_llm: bool = False, **text) -> Path:
    """A seeded tiny LFM2-VL (Lfm2VlForConditionalGeneration) saved (safetensors) at path, its tower and projector
    spread: 3 SigLIP2 NaFlex blocks 32 wide (2 heads, no pooling head), patch 8, an 8x8 position table (64 px at its
    own size; other sizes resample it), the projector's pixel unshuffle by 2, LayerNorm, 128 -> 40 -> the LLM's width;
    an LFM2 LLM (text: overrides; default 2 layers 48 wide, a short-conv layer then an attention layer, vocab 128).
    tokenizer: also a byte-level tokenizer (bytes 0-255, then LFM2_VL_SPECIALS as 256.., <image> at image_token_id)
    with LFM2_VL_TEMPLATE. spread_llm: every LLM weight drawn too (spread_decoder: the matrices, the short convolutions'
    kernels and biases, every norm scale around 1)."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    config = dict(model_type="lfm2", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=128, layer_types=["conv", "full_attention"],
                  block_auto_adjust_ff_dim=False)
    config.update(text)
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, patch_size=8, num_patches=64, vision_use_head=False)
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(Lfm2VlConfig(vision_config=vision, text_config=config, downsample_factor=2,
                                                        projector_hidden_size=40, image_token_id=image_token_id))
    spread(model, ("model.vision_tower.", "model.multi_modal_projector."))
    with torch.no_grad():  # 1-D rows are left alone above: the position table's rows and the projector's LayerNorm
        model.model.vision_tower.embeddings.position_embedding.weight.normal_(0.0, 0.2)
        model.model.multi_modal_projector.layer_norm.weight.normal_(1.0, 0.2)
    if spread_llm:
        spread_decoder(model, "model.language_model.")
    model.generation_config.eos_token_id = 258  # <|im_end|>
    model.eval().save_pretrained(path, safe_serialization=True)
    if tokenizer:
        byte_tokenizer(path, LFM2_VL_SPECIALS, image_token_id, LFM2_VL_TEMPLATE, bos_token="<|startoftext|>",
                       eos_token="<|im_end|>", extra_special_tokens={"image_token": "<image>",
                                                                     "image_start_token": "<|image_start|>",
                                                                     "image_end_token": "<|image_end|>"})
    return Path(path)


# MiniCPM-V 4.6's chat turns (ChatML), the image as its image token (<|image_pad|>, as Qwen3.5's tokenizer names it),
# which its processor expands to <image_id>0</image_id><image> + the image tokens + </image>.
MINICPM_V_TEMPLATE = ("{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' }}"
                      "{%- if message['content'] is string -%}{{ message['content'] }}"
                      "{%- else -%}{%- for item in message['content'] -%}"
                      "{%- if item['type'] == 'image' -%}{{ '<|image_pad|>' }}"
                      "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
                      "{%- endfor -%}{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}"
                      "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
MINICPM_V_SPECIALS = ("<|im_start|>", "<|im_end|>", "<image>", "</image>", "<image_id>", "</image_id>", "<slice>",
                      "</slice>")


def tiny_minicpm_v(path: Path, seed: int = 0, image_token_id: int = 120, tokenizer: bool = False,
                   spread_llm: bool = False, **text) -> Path:
    """A seeded tiny MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration) saved (safetensors) at path, its tower and
    merger spread: 4 SigLIP blocks 32 wide (2 heads), patch 8, a 16x16 position table (128 px, the default tile), the
    window merger after block 2 (insert_layer_id 1: 16x16 patches -> 8x8), then the merger's 2x2 into 4x4 = 16 tokens;
    a Qwen3.5 LLM (text: overrides; default 2 layers 48 wide, a linear-attention layer then a full-attention one, vocab
    128). tokenizer: also a byte-level tokenizer (bytes 0-255, then MINICPM_V_SPECIALS as 256.., the image token at
    image_token_id) with MINICPM_V_TEMPLATE. spread_llm: every LLM weight drawn too (spread_decoder: the matrices,
    the delta-nets' convolution kernels, every norm's scale around 1, the (1 + weight) norms' weights around 0; the
    1-D rest, A_log and dt_bias among them, around 0), so that a piece of the hybrid layer spelled out wrongly, or a
    state left out, shows."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration

    config = dict(model_type="qwen3_5_text", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=24, vocab_size=128,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
                  linear_key_head_dim=12, linear_value_head_dim=12)
    config.update(text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, image_size=128,
                  patch_size=8)
    torch.manual_seed(seed)
    model = MiniCPMV4_6ForConditionalGeneration(MiniCPMV4_6Config(
        vision_config=vision, text_config=config, insert_layer_id=1, image_size=128, image_token_id=image_token_id))
    spread(model, ("model.vision_tower.", "model.merger."))
    with torch.no_grad():  # 1-D rows are left alone above: the position table's rows and the norms' scales
        model.model.vision_tower.embeddings.position_embedding.weight.normal_(0.0, 0.2)
        model.model.vision_tower.vit_merger.pre_norm.weight.normal_(1.0, 0.2)
        model.model.merger.mlp[0].pre_norm.weight.normal_(1.0, 0.2)
    if spread_llm:
        spread_decoder(model, "model.language_model.")
        with torch.no_grad():  # Qwen3.5's RMSNorms scale by (1 + weight): theirs around 0 (the gated norm's around 1)
            for name, param in model.model.language_model.named_parameters():
                if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
                    param.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = 257  # <|im_end|>
    model.eval().save_pretrained(path, safe_serialization=True)
    if tokenizer:
        byte_tokenizer(path, MINICPM_V_SPECIALS, image_token_id, MINICPM_V_TEMPLATE, "<|image_pad|>",
                       eos_token="<|im_end|>",
                       extra_special_tokens={"image_token": "<|image_pad|>", "image_start_token": "<image>",
                                             "image_end_token": "</image>", "image_id_start_token": "<image_id>",
                                             "image_id_end_token": "</image_id>", "slice_start_token": "<slice>",
                                             "slice_end_token": "</slice>"})
    return Path(path)


def tiny_llava_next_video(path: Path, seed: int = 0, video_token_id: int = 101, image_size: int = 56,
                          **text) -> Path:
    """A seeded tiny LLaVA-NeXT-Video (LlavaNextVideoForConditionalGeneration) saved (safetensors) at path, its tower
    and projector spread: 3 CLIP blocks 32 wide (2 heads), `image_size` px at patch 14 ([CLS] + s x s patches, the
    resampler's 2x2 average pool: (s/2)² tokens per frame), feature layer -2 (2 blocks run), `default` strategy, a
    Llama LLM (text: overrides; default 1 layer, 48 wide, vocab 128), image token 100, video token video_token_id."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=128)
    config.update(text)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=image_size, patch_size=14)
    torch.manual_seed(seed)
    model = LlavaNextVideoForConditionalGeneration(LlavaNextVideoConfig(
        vision_config=vision, text_config=LlamaConfig(**config), vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_token_index=100, video_token_index=video_token_id,
        image_grid_pinpoints=[[image_size, image_size], [image_size, 2 * image_size]]))
    spread(model, ("model.vision_tower.", "model.multi_modal_projector."))
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_llava_onevision(path: Path, seed: int = 0, image_size: int = 56, image_token: int = 100,
                         video_token: int = 101, **text) -> Path:
    """A seeded tiny LLaVA-OneVision (LlavaOnevisionForConditionalGeneration) saved (safetensors) at path, its tower
    and projector spread: 3 SigLIP blocks 32 wide (2 heads, no pooling head), `image_size` px at patch 14 (s x s
    patches, no [CLS]; a clip's frame pooled bilinearly to ceil(s/2)²), feature layer -1 (every block), `full`
    strategy, a Qwen2 LLM (text: overrides; default 1 layer, 48 wide, vocab 128), image token 100, video token 101
    (image_token, video_token: others, above the bytes where a prompt is given as UTF-8 bytes)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, SiglipVisionConfig

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=128)
    config.update(text)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                image_size=image_size, patch_size=14, vision_use_head=False)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
        vision_config=vision, text_config=Qwen2Config(**config), vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_token_index=image_token, video_token_index=video_token,
        image_grid_pinpoints=[[image_size, image_size]]))
    spread(model, ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline"))
    model.eval().save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_gemma4(path: Path, seed: int = 0, image_token_id: int = 120, boi: int = 121, eoi: int = 122,
                soft_tokens: int = 70, spread_llm: bool = False, **text) -> Path:
    """A seeded tiny Gemma 4 (Gemma4ForConditionalGeneration, no audio tower) saved (safetensors) at path, with a
    preprocessor_config.json of max_soft_tokens `soft_tokens` (70: a square image is 96 px, 24x24 patches of 4 pooled
    3x3 into 8x8 = 64 tokens); its tower and embedder spread: 3 blocks 32 wide (2 query heads of 16, 1 key/value
    head: grouped), a 64-row position table per axis, standardised output. A Gemma 4 LLM (text: overrides; default 2
    layers 48 wide, one sliding-window layer of 8 then one global, per-layer embeddings of 8, the image block
    bidirectional, vocab 128; image, boi and eoi tokens 120, 121, 122 by default; video/audio tokens inside the
    vocabulary, as transformers embeds them to find placeholders). spread_llm: every LLM weight drawn (spread_decoder)
    and each layer's layer_scalar too, so that a piece of the layer spelled out wrongly shows."""
    import json

    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, global_head_dim=24, vocab_size=128, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=128, use_bidirectional_attention="vision")
    config.update(text)
    config["vocab_size_per_layer_input"] = config["vocab_size"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64,
                  standardize=True)
    vocab = config["vocab_size"]
    ids = dict(image_token_id=image_token_id, boi_token_id=boi, eoi_token_id=eoi, video_token_id=vocab - 4,
               audio_token_id=vocab - 3, boa_token_id=vocab - 2, eoa_token_index=vocab - 1)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=config, vision_config=vision, audio_config=None,
                                                        **ids))
    spread(model, ("model.vision_tower.", "model.embed_vision."))
    with torch.no_grad():  # the RMSNorm scales start at one and the standardisation is a fresh buffer: spread them
        tower = model.model.vision_tower
        for name, param in tower.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0, 0.2)
        tower.std_bias.normal_(0.0, 0.2)
        tower.std_scale.normal_(1.0, 0.2)
    if spread_llm:  # every LLM matrix and norm scale drawn, and each layer's layer_scalar (a buffer, 1 at init)
        spread_decoder(model, "model.language_model.")
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.layer_scalar.normal_(1.0, 0.3)
    model.eval().save_pretrained(path, safe_serialization=True)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "pooling_kernel_size": 3,
         "max_soft_tokens": soft_tokens, "do_normalize": False, "image_mean": [0.0, 0.0, 0.0],
         "image_std": [1.0, 1.0, 1.0], "do_rescale": True, "rescale_factor": 1 / 255}))
    return Path(path)
