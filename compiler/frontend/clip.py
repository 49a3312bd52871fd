"""Family `clip`: a bare CLIP or SigLIP vision tower (CLIPVisionModel, SiglipVisionModel), optionally with an
LLaVA-style `mm_projector.safetensors` beside it.

The features are the tower's own last_hidden_state (SigLIP's ends with its post_layernorm,
CLIP's does not), or hidden_states[L] for --feature-layer L; the select strategy is LLaVA's
`default` (a [CLS] token, where the tower has one, is dropped from the features). CLIP has a
[CLS] token; SigLIP has none, but usually an attention-pooling head (vision_use_head), which
tower_parts exposes (TowerParts.head) for the probe score (`--score probe` of cls and visionzip).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import CLS_TOKEN, FEATURE_LAYER, PATCH_TOKENS, POOLING_HEAD, Family
from vlmprune.compiler.frontend.source import (CLIP_MEAN, CLIP_STD, Source, feature_blocks, inner_tower, load_state,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.tower import BlockParts, PoolingHead, Projector, TowerParts, VisionPipeline

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
PROJECTOR_FILE = "mm_projector.safetensors"


def tower_class(model_type: str):
    from transformers import CLIPVisionModel, SiglipVisionModel

    return CLIPVisionModel if model_type.startswith("clip") else SiglipVisionModel


def build_tower(vision_config):
    """An SDPA tower of the config's type, weights uninitialised by transformers."""
    vision_config._attn_implementation = "sdpa"
    return tower_class(vision_config.model_type)(vision_config).eval()


def tower_parts(tower, final_norm: bool = False) -> TowerParts:
    """How VisionPipeline runs a CLIP or SigLIP vision transformer (transformers' layout).

    final_norm: SigLIP's last_hidden_state is after post_layernorm (CLIP's is not: its
    post_layernorm only feeds the pooled output), so a bare SigLIP tower's features end with it.
    """
    vm = inner_tower(tower)
    pre = getattr(vm, "pre_layrnorm", None)

    def embed(pixel_values):
        h = vm.embeddings(pixel_values)
        return pre(h) if pre is not None else h

    def parts(layer) -> BlockParts:
        a = layer.self_attn
        return BlockParts(layer.layer_norm1, a.q_proj, a.k_proj, a.v_proj, a.out_proj, a.num_heads, a.scale,
                          layer.layer_norm2, layer.mlp)

    post = getattr(vm, "post_layernorm", None) if final_norm else None
    return TowerParts(vm, embed, list(vm.encoder.layers), parts, post, pooling_head(vm))


def pooling_head(vm) -> PoolingHead | None:
    """SigLIP's attention-pooling head as the probe score reads it; None for towers without one.

    CLIP has none; SigLIP has one unless its config says vision_use_head=False (LLaVA-style
    checkpoints often drop it, see llava.py). The head runs on post_layernorm(last_hidden_state).
    """
    head = getattr(vm, "head", None) if getattr(vm, "use_head", False) else None
    norm = getattr(vm, "post_layernorm", None)
    attention = getattr(head, "attention", None)
    if head is None or norm is None or not isinstance(attention, nn.MultiheadAttention) or attention.in_proj_weight is None:
        return None
    d = attention.embed_dim
    weight, bias = attention.in_proj_weight, attention.in_proj_bias
    zeros = weight.new_zeros(3 * d) if bias is None else bias
    return PoolingHead(head.probe.reshape(-1), weight[:d], zeros[:d], weight[d:2 * d], zeros[d:2 * d],
                       attention.num_heads, norm)


class ClipTowerAdapter(ModelAdapter):
    family = "clip"
    model_types = ("clip_vision_model", "clip", "siglip_vision_model", "siglip")
    summary = "CLIP / SigLIP vision tower (+ optional mm_projector.safetensors)"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        vcfg = config.vision_config if hasattr(config, "vision_config") else config
        tower = build_tower(vcfg)
        state = read_safetensors(checkpoint.weights, ("model.vision_model.", "vision_model.", ""))
        load_state(inner_tower(tower), state, "vision tower")
        fl = -1 if feature_layer is None else feature_layer
        projector = None
        if (checkpoint.path / PROJECTOR_FILE).is_file():
            projector = projector_from_file(checkpoint.path / PROJECTOR_FILE, vcfg.hidden_size)
        siglip = vcfg.model_type.startswith("siglip")
        mean, std = checkpoint.preprocessing(SIGLIP_MEAN if siglip else CLIP_MEAN, SIGLIP_STD if siglip else CLIP_STD)
        has_cls = not siglip
        # The tower's own image features: its last_hidden_state (SigLIP's ends with post_layernorm); a chosen
        # --feature-layer is hidden_states[L], before any final norm.
        pipeline = VisionPipeline(tower_parts(tower, final_norm=siglip), projector,
                                  feature_blocks(fl, vcfg.num_hidden_layers), True, has_cls, vcfg.patch_size,
                                  final_norm=feature_layer is None).eval()
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files(PROJECTOR_FILE)),
                      vcfg.image_size, vcfg.patch_size, has_cls, mean, std, pipeline=pipeline,
                      details={"model_type": checkpoint.model_type, "feature_layer": fl, "select_strategy": "default",
                               "vision_layers": vcfg.num_hidden_layers, "projector": projector is not None})


def projector_from_file(path: Path, d_in: int) -> Projector:
    """LLaVA's 2-layer MLP projector from its own safetensors file (keys 0./2. or linear_1./linear_2.)."""
    state = read_safetensors([path], ("",))
    renames = {"0.": "linear_1.", "2.": "linear_2."}
    clean = {}
    for key, tensor in state.items():
        key = key.removeprefix("model.").removeprefix("mm_projector.").removeprefix("multi_modal_projector.")
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old):]
        clean[key] = tensor
    if "linear_1.weight" not in clean or "linear_2.weight" not in clean:
        raise InputError(f"{path.name}: expected a 2-layer MLP projector (linear_1/linear_2 or 0/2 weights)")
    w1, w2 = clean["linear_1.weight"], clean["linear_2.weight"]
    if w1.shape[1] != d_in:
        raise InputError(f"{path.name}: projector expects width {w1.shape[1]}, the tower has {d_in}")
    proj = Projector(w1.shape[1], w1.shape[0], w2.shape[0], bias="linear_1.bias" in clean)
    load_state(proj, clean, path.name)
    return proj.eval()


class ClipFamily(Family):
    id = "clip"
    adapter = ClipTowerAdapter
    has = {PATCH_TOKENS: "CLIP, SigLIP", CLS_TOKEN: "CLIP", FEATURE_LAYER: "CLIP, SigLIP",
           POOLING_HEAD: "SigLIP towers with their attention-pooling head"}
