"""Presets: models that work offline with seeded weights, for demos, tests and benchmarks.

- `demo`: a small LLaVA model (6-block CLIP tower at 336 px, 576 patches; 2-layer LLM),
  built through the llava family adapter like a checkpoint would be;
- `clip-l-336`: the shapes of LLaVA-1.5's CLIP ViT-L/14-336 tower and projector (24 blocks,
  1024 wide, quick_gelu; projector 1024 -> 4096 -> 4096), seeded in seconds;
- `siglip-so400m-384`: the shapes of SigLIP-so400m/14-384 (27 blocks, 1152 wide, 729 patches,
  no [CLS], with its attention-pooling head), the tower of LLaVA-OneVision and PaliGemma;
- `qwen2.5-vl-3b-448`: the shapes of Qwen2.5-VL-3B's vision tower and merger at 448x448 (32 blocks,
  1280 wide, window attention but in blocks 7, 15, 23, 31; 1024 patches -> 256 tokens of 2048);
- `qwen3-vl-2b-512`: the shapes of Qwen3-VL-2B's vision tower, merger and DeepStack mergers at 512x512 (24 blocks,
  1024 wide, patch 16, DeepStack after blocks 5, 11, 17; 1024 patches -> 256 tokens of 4 x 2048);
- `internvl3-1b-448`: the shapes of InternVL3-1B's InternViT-300M tower and connector at 448x448 (24 blocks,
  1024 wide, [CLS], layer scales; pixel shuffle 2x2 + MLP projector 4096 -> 896; 1024 patches -> 256 tokens);
- `smolvlm-256m-512`: the shapes of SmolVLM-256M's SigLIP base patch16 tower and connector at 512x512 (12 blocks,
  768 wide, no [CLS]; pixel shuffle 4x4 + Linear 12288 -> 576; 1024 patches -> 64 tokens);
- `gemma3-4b-896`: the shapes of Gemma 3 4B's SigLIP-So400m tower and connector at 896x896 (27 blocks, 1152 wide,
  patch 14, no pooling head; 4x4 average pooling + RMSNorm + 1152 -> 2560; 4096 patches -> 256 tokens);
- `lfm2-vl-450m-256`: the shapes of LFM2-VL-450M's SigLIP2 NaFlex base tower and projector at one 256x256 tile (12
  blocks, 768 wide, patch 16, no [CLS]; pixel unshuffle 2x2 + LayerNorm + MLP 3072 -> 2560 -> 1024; 256 patches -> 64
  tokens);
- `minicpm-v-4.6-448`: the shapes of MiniCPM-V 4.6's SigLIP-So400m tower, window merger and merger at one unsliced
  448x448 tile (27 blocks, 1152 wide, patch 14, the window merger after block 7; 1024 patches -> 256 -> 64 tokens of
  1024).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler.frontend.clip import ClipTowerAdapter, build_tower, tower_parts
from vlmprune.compiler.frontend.llava import LlavaAdapter
from vlmprune.compiler.frontend.source import (Source, feature_blocks, no_init_weights, quiet_transformers,
                                               seeded_init, sha256_state)
from vlmprune.compiler.frontend.tower import Projector, VisionPipeline

PRESETS = {"demo": "a small LLaVA model (CLIP tower, 576 patches), seeded", "clip-l-336":
           "LLaVA-1.5's CLIP ViT-L/14-336 tower and projector shapes, seeded",
           "siglip-so400m-384": "SigLIP-so400m/14-384's tower shapes (LLaVA-OneVision's, PaliGemma's) with its "
                                "attention-pooling head, seeded",
           "qwen2.5-vl-3b-448": "Qwen2.5-VL-3B's vision tower and merger shapes at 448x448 (1024 patches, 256 "
                                "merged tokens), seeded",
           "qwen3-vl-2b-512": "Qwen3-VL-2B's vision tower, merger and DeepStack mergers at 512x512 (1024 patches, 256 "
                              "merged tokens, each with its 3 DeepStack rows), seeded",
           "internvl3-1b-448": "InternVL3-1B's InternViT-300M tower, pixel shuffle and projector shapes at 448x448 "
                               "(1024 patches, 256 merged tokens of 896), seeded",
           "gemma3-4b-896": "Gemma 3 4B's SigLIP-So400m tower and connector shapes at 896x896 (4096 patches average-"
                            "pooled 4x4 into 256 tokens of 2560), seeded"}
PRESETS["smolvlm-256m-512"] = ("SmolVLM-256M's SigLIP base patch16 tower, pixel shuffle and connector shapes at "
                               "512x512 (1024 patches, 64 merged tokens of 576), seeded")
PRESETS["lfm2-vl-450m-256"] = ("LFM2-VL-450M's SigLIP2 NaFlex base tower, pixel unshuffle and projector shapes at one "
                               "256x256 tile (256 patches, 64 merged tokens of 1024), seeded")
PRESETS["gemma4-e2b-768"] = ("Gemma 4 E2B's vision tower, 3x3 pooling and embedder shapes at 768x768 (2304 patches "
                             "pooled into 256 tokens of 2304), seeded")

PRESETS["minicpm-v-4.6-448"] = ("MiniCPM-V 4.6's SigLIP-So400m tower, window merger and merger shapes at one unsliced "
                                "448x448 tile (1024 patches, 64 merged tokens of 1024), seeded")


def load_preset(name: str) -> Source:
    quiet_transformers()
    torch.manual_seed(0)
    if name == "siglip-so400m-384":
        return _siglip_so400m_384()
    if name == "qwen2.5-vl-3b-448":
        return _qwen2_5_vl_3b_448()
    if name == "qwen3-vl-2b-512":
        return _qwen3_vl_2b_512()
    if name == "internvl3-1b-448":
        return _internvl3_1b_448()
    if name == "gemma3-4b-896":
        return _gemma3_4b_896()
    if name == "smolvlm-256m-512":
        return _smolvlm_256m_512()
    if name == "lfm2-vl-450m-256":
        return _lfm2_vl_450m_256()
    if name == "minicpm-v-4.6-448":
        return _minicpm_v_4_6_448()
    if name == "gemma4-e2b-768":
        return _gemma4_e2b_768()
    return _demo() if name == "demo" else _clip_l_336()


def _demo() -> Source:
    return LlavaAdapter.from_model("demo", demo_model())


def demo_config():
    """The `demo` preset's LlavaConfig: what --with-llm's options are checked against before any work."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    quiet_transformers()
    vision = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                              image_size=336, patch_size=14, projection_dim=128)
    text = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1024)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_token_index=1000)
    config.vision_config._attn_implementation = "sdpa"
    return config


def demo_model():
    """The `demo` preset's whole LlavaForConditionalGeneration (its seeded LLM too), for `vlmprune generate`/`eval`."""
    from transformers import LlavaForConditionalGeneration

    config = demo_config()
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()


def _clip_l_336() -> Source:
    from transformers import CLIPVisionConfig

    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, hidden_act="quick_gelu")
    with no_init_weights():
        tower = build_tower(vision)
        projector = Projector(1024, 4096, 4096).eval()
    seeded_init(nn.ModuleList([tower, projector]), seed=0)
    pipeline = VisionPipeline(tower_parts(tower), projector, feature_blocks(-2, 24), True, True, 14).eval()
    return Source("clip-l-336", "preset", LlavaAdapter.family, sha256_state(pipeline), 336, 14, True, pipeline=pipeline,
                  details={"feature_layer": -2, "select_strategy": "default", "vision_layers": 24})


def _siglip_so400m_384() -> Source:
    """SigLIP-so400m/14-384 as a bare tower: 27 blocks 1152 wide (4304 MLP, 16 heads, gelu tanh), 729 patches,
    features after post_layernorm, and its attention-pooling head (for --score probe); no [CLS]."""
    from transformers import SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                                image_size=384, patch_size=14, hidden_act="gelu_pytorch_tanh", vision_use_head=True)
    with no_init_weights():
        tower = build_tower(vision)
    seeded_init(tower, seed=0)
    pipeline = VisionPipeline(tower_parts(tower, final_norm=True), None, 27, True, False, 14, final_norm=True).eval()
    return Source("siglip-so400m-384", "preset", ClipTowerAdapter.family, sha256_state(pipeline), 384, 14, False,
                  (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), pipeline=pipeline,
                  details={"feature_layer": -1, "select_strategy": "default", "vision_layers": 27})


def _qwen2_5_vl_3b_448() -> Source:
    """Qwen2.5-VL-3B's vision tower and merger (its config.json's vision_config): 32 blocks 1280 wide (gated SiLU
    MLP 3420, 16 heads), 112-px windows except blocks 7, 15, 23, 31, merger 4 x 1280 -> 2048; at 448 px."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from vlmprune.compiler.frontend.qwen2_vl import build_visual, qwen_source

    vision = Qwen2_5_VLVisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                    out_hidden_size=2048, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu")
    visual = build_visual("qwen2_5_vl", vision)
    seeded_init(visual, seed=0)
    with torch.no_grad():  # seeded_init knows nn.LayerNorm; Qwen2.5-VL's norms are RMSNorms: unit scales too
        for module in visual.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(1.0)
    return qwen_source("qwen2.5-vl-3b-448", "preset", "qwen2_5_vl", visual, 448, sha256_state(visual))


def _qwen3_vl_2b_512() -> Source:
    """Qwen3-VL-2B's vision tower (its config.json's vision_config): 24 blocks 1024 wide (MLP 4096, gelu tanh, 16
    heads), patch 16, a 48x48 learned position table, merger 4 x 1024 -> 2048 and DeepStack mergers after blocks
    5, 11, 17; at 512 px."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from vlmprune.compiler.frontend.qwen3_vl import build_visual, qwen3_source

    vision = Qwen3VLVisionConfig(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                 out_hidden_size=2048, num_position_embeddings=2304, patch_size=16,
                                 spatial_merge_size=2, temporal_patch_size=2, hidden_act="gelu_pytorch_tanh",
                                 deepstack_visual_indexes=[5, 11, 17])
    visual = build_visual(vision)
    seeded_init(visual, seed=0)  # its norms are LayerNorms: unit scales
    return qwen3_source("qwen3-vl-2b-512", "preset", visual, 512, sha256_state(visual))


def _internvl3_1b_448() -> Source:
    """InternVL3-1B's vision side (its config.json): InternViT-300M, 24 blocks 1024 wide (MLP 4096, gelu, 16 heads,
    LayerNorm, layer scales, no q/k norm, mean pooling: no final norm), 448 px at patch 14 ([CLS] + 1024 patches),
    pixel shuffle 0.5 into 256 tokens of 4096, projector LayerNorm -> 4096 -> 896 (Qwen2.5-0.5B's width)."""
    from transformers import InternVLConfig

    from vlmprune.compiler.frontend.internvl import build_projector, build_tower, internvl_source

    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=[448, 448], patch_size=[14, 14], norm_type="layer_norm", use_qk_norm=False,
                  use_mean_pooling=True, layer_scale_init_value=0.1, hidden_act="gelu")
    text = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151674)
    config = InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5, vision_feature_layer=-1,
                            vision_feature_select_strategy="default", projector_hidden_act="gelu")
    tower, projector = build_tower(config.vision_config), build_projector(config)
    seeded_init(nn.ModuleList([tower, projector]), seed=0)
    with torch.no_grad():  # seeded_init draws every non-norm parameter N(0, 0.02): layer scales at their 0.1
        for layer in tower.encoder.layer:
            layer.lambda_1.fill_(0.1)
            layer.lambda_2.fill_(0.1)
    return internvl_source("internvl3-1b-448", "preset", config, tower, projector, None)


def _gemma3_4b_896() -> Source:
    """Gemma 3 4B's vision side (its config.json): SigLIP-So400m, 27 blocks 1152 wide (MLP 4304, 16 heads,
    gelu_pytorch_tanh, LayerNorm eps 1e-6, no pooling head), 896 px at patch 14 (4096 patches), the connector's 4x4
    average pooling into 256 tokens, RMSNorm, and the projection 1152 -> 2560 (Gemma 3 4B's LLM width)."""
    from transformers import Gemma3Config

    from vlmprune.compiler.frontend.gemma3 import build_projector, build_tower, gemma3_source

    vision = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                  num_attention_heads=16, image_size=896, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False,
                  hidden_act="gelu_pytorch_tanh")
    text = dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=256)
    tower, projector = build_tower(config.vision_config), build_projector(config)
    seeded_init(nn.ModuleList([tower, projector]), seed=0)  # the connector's RMSNorm scale (1 + w) near 1
    return gemma3_source("gemma3-4b-896", "preset", config, tower, projector, None)


def _smolvlm_256m_512() -> Source:
    """SmolVLM-256M's vision side (its config.json): SigLIP base patch16, 12 blocks 768 wide (MLP 3072,
    gelu_pytorch_tanh, 12 heads), 512 px (32x32 patches, no [CLS]), post_layernorm, pixel shuffle by scale_factor 4
    into 64 tokens of 12288, a bias-free Linear into 576 (SmolLM2-135M's width)."""
    from transformers import SmolVLMConfig

    from vlmprune.compiler.frontend.smolvlm import build_connector, build_tower, smolvlm_source

    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    text = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49280)
    config = SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=4, image_token_id=49190)
    tower, connector = build_tower(config.vision_config), build_connector(config)
    seeded_init(nn.ModuleList([tower, connector]), seed=0)  # LayerNorms at unit scales
    return smolvlm_source("smolvlm-256m-512", "preset", config, tower, connector, None)


def _lfm2_vl_450m_256() -> Source:
    """LFM2-VL-450M's vision side (its config.json): SigLIP2 NaFlex base patch16, 12 blocks 768 wide (MLP 3072,
    gelu_pytorch_tanh, 12 heads, no pooling head), a 16x16 position table (256 px at its own size: the processor's
    min_image_tokens, 64), pixel unshuffle by downsample_factor 2 into 64 tokens of 3072, LayerNorm, Linear 3072 ->
    2560, GELU, Linear 2560 -> 1024 (LFM2-350M's width)."""
    from transformers import Lfm2VlConfig

    from vlmprune.compiler.frontend.lfm2_vl import build_projector, build_tower, lfm2_vl_source

    vision = dict(model_type="siglip2_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, patch_size=16, num_patches=256, vision_use_head=False,
                  hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    text = dict(model_type="lfm2", hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=65536)
    config = Lfm2VlConfig(vision_config=vision, text_config=text, downsample_factor=2, projector_hidden_size=2560,
                          image_token_id=396)
    tower, projector = build_tower(config.vision_config), build_projector(config)
    seeded_init(nn.ModuleList([tower, projector]), seed=0)  # LayerNorms at unit scales
    return lfm2_vl_source("lfm2-vl-450m-256", "preset", config, tower, projector, None)


def _minicpm_v_4_6_448() -> Source:
    """MiniCPM-V 4.6's vision side (its config.json): SigLIP-So400m, 27 blocks 1152 wide (MLP 4304, 16 heads,
    gelu_pytorch_tanh, LayerNorm eps 1e-6), patch 14, a 70x70 position table (980 px), the window merger after block 7
    (insert_layer_id 6), the merger's 2x2 (LayerNorm, Linear 4608 -> 4608, GELU, Linear 4608 -> 1024: the Qwen3.5
    LLM's width), at its processor's unsliced 448 px: 32x32 patches, 16x16 after the window merger, 64 tokens."""
    from transformers import MiniCPMV4_6Config

    from vlmprune.compiler.frontend.minicpm_v import build_merger, build_tower, minicpm_v_source

    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=980, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    text = dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=248320)
    config = MiniCPMV4_6Config(vision_config=vision, text_config=text, insert_layer_id=6, image_size=1120)
    tower, merger = build_tower(config.vision_config), build_merger(config)
    seeded_init(nn.ModuleList([tower, merger]), seed=0)  # LayerNorms at unit scales
    return minicpm_v_source("minicpm-v-4.6-448", "preset", config, tower, merger, None)


def _gemma4_e2b_768() -> Source:
    """Gemma 4 E2B's vision side (transformers' Gemma4VisionConfig defaults, documented as google/gemma-4-e2b-it's):
    16 blocks 768 wide (gated MLP 3072, gelu_pytorch_tanh, 12 heads of 64, RMSNorms, 2-D RoPE theta 100), patch 16, a
    10240-row position table per axis, 3x3 pooling; at its processor's default 280-token budget a square image is 768
    px (48x48 = 2304 patches -> 256 tokens); the embedder 768 -> 2304 (Gemma4TextConfig's default width, documented as
    the same checkpoint's). Not read from a downloaded config.json: the sizes are transformers' defaults."""
    from transformers import Gemma4Config

    from vlmprune.compiler.frontend.gemma4 import build_embedder, build_tower, gemma4_source

    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=10240)
    config = Gemma4Config(vision_config=vision, text_config={}, audio_config=None)  # the text defaults: 2304 wide
    tower, embedder = build_tower(config.vision_config), build_embedder(config)
    seeded_init(nn.ModuleList([tower, embedder]), seed=0)
    with torch.no_grad():  # seeded_init knows nn.LayerNorm; Gemma 4's norms are RMSNorms: unit scales too
        for module in tower.modules():
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "with_scale", False):
                module.weight.fill_(1.0)
    return gemma4_source("gemma4-e2b-768", "preset", config, tower, embedder, None)
