"""Family `llava`: LLaVA-1.5-style LlavaForConditionalGeneration (a CLIP or SigLIP tower + MLP projector).

Only the tower and projector weights are read (never the LLM's). The checkpoint's
vision_feature_layer (or --feature-layer) sets how many blocks run, and its
vision_feature_select_strategy whether [CLS] stays in the features (`default`: dropped,
`full`: kept). The dense pipeline equals transformers' get_image_features.
"""

from __future__ import annotations

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import SIGLIP_MEAN, SIGLIP_STD, build_tower, tower_parts
from vlmprune.compiler.frontend.family import CLS_TOKEN, FEATURE_LAYER, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.source import (CLIP_MEAN, CLIP_STD, Source, feature_blocks, feature_layer_of,
                                               inner_tower, load_state, read_safetensors, sha256_files, sha256_state,
                                               strip_prefix)
from vlmprune.compiler.frontend.tower import Projector, VisionPipeline

TOWERS = ("clip_vision_model", "siglip_vision_model")


def projector_for(config) -> Projector:
    """LLaVA's projector for config, with its activation."""
    text_hidden = config.text_config.hidden_size
    projector = Projector(config.vision_config.hidden_size, text_hidden, text_hidden,
                          bias=getattr(config, "multimodal_projector_bias", True))
    act = getattr(config, "projector_hidden_act", "gelu")
    if act != "gelu":
        from transformers.activations import ACT2FN

        projector.act = ACT2FN[act]
    return projector


def check_tower(vcfg, what: str) -> None:
    """One line for a vision tower type a LLaVA-style checkpoint may not bring here (CLIP or SigLIP only)."""
    if vcfg.model_type not in TOWERS:
        raise InputError(f"{what} vision tower type {vcfg.model_type!r} is not supported (CLIP or SigLIP)")


def tower_state(checkpoint: Checkpoint) -> dict:
    """The tower's weights of a LLaVA-style checkpoint, keyed as the bare vision model's."""
    return strip_prefix(read_safetensors(checkpoint.weights, ("model.vision_tower.", "vision_tower.")), "vision_model.")


def drop_absent_head(vision_config, state: dict) -> None:
    """A SigLIP tower whose checkpoint holds no pooling head (LLaVA and LLaVA-OneVision checkpoints usually drop it)
    is built without one, so that loading state finds every weight it expects; no --score probe then."""
    if getattr(vision_config, "vision_use_head", False) and not any(k.startswith("head.") for k in state):
        vision_config.vision_use_head = False


def load_vision(checkpoint: Checkpoint, state: dict):
    """(tower, projector) of a LLaVA-style checkpoint built from its config and loaded (state: tower_state's; a
    SigLIP pooling head the weights lack is left out of the build, drop_absent_head)."""
    config = checkpoint.config
    drop_absent_head(config.vision_config, state)
    tower = build_tower(config.vision_config)
    load_state(inner_tower(tower), state, "vision tower")
    projector = projector_for(config)
    pstate = read_safetensors(checkpoint.weights, ("model.multi_modal_projector.", "multi_modal_projector."))
    load_state(projector, pstate, "projector")
    return tower, projector.eval()


def tower_normalization(checkpoint: Checkpoint) -> tuple:
    """(mean, std): the checkpoint's processor's, else CLIP's or SigLIP's by the tower type."""
    siglip = checkpoint.config.vision_config.model_type == "siglip_vision_model"
    return checkpoint.preprocessing(SIGLIP_MEAN if siglip else CLIP_MEAN, SIGLIP_STD if siglip else CLIP_STD)


def pipeline_for(config, tower, projector, feature_layer: int | None) -> tuple[VisionPipeline, int, str]:
    vcfg = config.vision_config
    fl = feature_layer_of(config, feature_layer)
    strategy = config.vision_feature_select_strategy
    has_cls = vcfg.model_type == "clip_vision_model"
    if strategy == "default" and not has_cls:
        raise InputError("vision_feature_select_strategy 'default' on a SigLIP tower drops its first patch token "
                         "(transformers slices [:, 1:] as if it were [CLS]); vlmprune compiles SigLIP LLaVA models "
                         "with 'full', as LLaVA-OneVision and LLaVA-Interleave are configured")
    pipeline = VisionPipeline(tower_parts(tower), projector, feature_blocks(fl, vcfg.num_hidden_layers),
                              strategy == "default", has_cls, vcfg.patch_size).eval()
    return pipeline, fl, strategy


class LlavaAdapter(ModelAdapter):
    family = "llava"
    model_types = ("llava",)
    summary = "LLaVA-1.5 (LlavaForConditionalGeneration): CLIP/SigLIP tower + MLP projector"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        vcfg = config.vision_config
        check_tower(vcfg, "LLaVA")
        tower, projector = load_vision(checkpoint, tower_state(checkpoint))
        pipeline, fl, strategy = pipeline_for(config, tower, projector, feature_layer)
        mean, std = tower_normalization(checkpoint)
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                      vcfg.image_size, vcfg.patch_size, pipeline.has_cls, mean, std, pipeline=pipeline,
                      details={"model_type": "llava", "feature_layer": fl, "select_strategy": strategy,
                               "vision_layers": vcfg.num_hidden_layers, "projector": True})

    @staticmethod
    def from_model(name: str, llava, feature_layer: int | None = None) -> Source:
        """A Source from an in-memory LlavaForConditionalGeneration (the presets)."""
        inner = getattr(llava, "model", llava)  # transformers 5 nests the tower and projector under .model
        pipeline, fl, strategy = pipeline_for(llava.config, inner.vision_tower, inner.multi_modal_projector,
                                              feature_layer)
        vcfg = llava.config.vision_config
        return Source(name, "preset", LlavaAdapter.family, sha256_state(pipeline), vcfg.image_size, vcfg.patch_size,
                      pipeline.has_cls, pipeline=pipeline,
                      details={"feature_layer": fl, "select_strategy": strategy,
                               "vision_layers": vcfg.num_hidden_layers})


class LlavaFamily(Family):
    id = "llava"
    adapter = LlavaAdapter
    has = {PATCH_TOKENS: "LLaVA", CLS_TOKEN: "LLaVA on CLIP", FEATURE_LAYER: "LLaVA"}
    language_model = {"llava": "LlavaForConditionalGeneration"}
