"""Presets: models that work offline with seeded weights, for demos, tests and benchmarks.

- `demo`: a small LLaVA model (6-block CLIP tower at 336 px, 576 patches; 2-layer LLM),
  built through the llava family adapter like a checkpoint would be;
- `clip-l-336`: the shapes of LLaVA-1.5's CLIP ViT-L/14-336 tower and projector (24 blocks,
  1024 wide, quick_gelu; projector 1024 -> 4096 -> 4096), seeded in seconds.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler.frontend.clip import build_tower, tower_parts
from vlmprune.compiler.frontend.llava import LlavaAdapter
from vlmprune.compiler.frontend.source import (Source, feature_blocks, no_init_weights, quiet_transformers,
                                               seeded_init, sha256_state)
from vlmprune.compiler.frontend.tower import Projector, VisionPipeline

PRESETS = {"demo": "a small LLaVA model (CLIP tower, 576 patches), seeded", "clip-l-336":
           "LLaVA-1.5's CLIP ViT-L/14-336 tower and projector shapes, seeded"}


def load_preset(name: str) -> Source:
    quiet_transformers()
    torch.manual_seed(0)
    return _demo() if name == "demo" else _clip_l_336()


def _demo() -> Source:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                              image_size=336, patch_size=14, projection_dim=128)
    text = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1024)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_token_index=1000)
    config.vision_config._attn_implementation = "sdpa"
    return LlavaAdapter.from_model("demo", LlavaForConditionalGeneration(config).eval())


def _clip_l_336() -> Source:
    from transformers import CLIPVisionConfig

    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, hidden_act="quick_gelu")
    with no_init_weights():
        tower = build_tower(vision)
        projector = Projector(1024, 4096, 4096).eval()
    seeded_init(nn.ModuleList([tower, projector]), seed=0)
    pipeline = VisionPipeline(tower_parts(tower), projector, feature_blocks(-2, 24), True, True, 14).eval()
    return Source("clip-l-336", "preset", "llava", sha256_state(pipeline), 336, 14, True, pipeline=pipeline,
                  details={"feature_layer": -2, "select_strategy": "default", "vision_layers": 24})
