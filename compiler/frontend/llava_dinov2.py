"""Family `llava_dinov2`: a LlavaForConditionalGeneration whose vision tower is DINOv2 (ViT-S/14 with [CLS]).

transformers builds LLaVA's tower with AutoModel.from_config, so a `vision_config` of model_type
"dinov2" gives a Dinov2Model under model.vision_tower. LLaVA reads hidden_states[L], which for
DINOv2 is before its final layernorm: the features never end with it. `default` drops [CLS],
`full` keeps it. Only the tower and projector weights are read. Preprocessing from
preprocessor_config.json, else ImageNet's mean and std (DINOv2's). The dense pipeline equals
transformers' get_image_features.
"""

from __future__ import annotations

from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.dinov2 import IMAGENET_MEAN, IMAGENET_STD, tower_parts
from vlmprune.compiler.frontend.family import CLS_TOKEN, FEATURE_LAYER, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.llava import projector_for, tower_state
from vlmprune.compiler.frontend.source import (Source, feature_blocks, feature_layer_of, load_state,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.tower import VisionPipeline


def _renamed(state: dict) -> dict:
    """The tower's weights under Dinov2Model's names: LLaVA saves it in DINOv2's legacy key layout, and
    transformers' own renames (its conversion mapping for Dinov2Model) are the ones that know it."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renames = [r for r in get_checkpoint_conversion_mapping("Dinov2Model") or () if isinstance(r, WeightRenaming)]
    out = {}
    for key, tensor in state.items():
        for rename in renames:
            key = rename.rename_source_key(key)[0]
        out[key] = tensor
    return out


class LlavaDinov2Adapter(ModelAdapter):
    family = "llava_dinov2"
    model_types = ("llava",)
    summary = "LLaVA (LlavaForConditionalGeneration) on a DINOv2 tower + MLP projector"

    @classmethod
    def claims(cls, checkpoint: Checkpoint) -> bool:
        """A LLaVA checkpoint whose tower is DINOv2 (without registers: LLaVA's `default` drops one prefix token)."""
        vision = checkpoint.raw.get("vision_config") or {}
        return checkpoint.model_type == "llava" and vision.get("model_type") == "dinov2"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        from transformers import Dinov2Model

        config = checkpoint.config
        vcfg = config.vision_config
        fl = feature_layer_of(config, feature_layer)
        vcfg._attn_implementation = "sdpa"
        tower = Dinov2Model(vcfg).eval()
        load_state(tower, _renamed(tower_state(checkpoint)), "vision tower")
        projector = projector_for(config)
        load_state(projector, read_safetensors(checkpoint.weights, ("model.multi_modal_projector.",
                                                                    "multi_modal_projector.")), "projector")
        strategy = config.vision_feature_select_strategy
        pipeline = VisionPipeline(tower_parts(tower), projector.eval(), feature_blocks(fl, vcfg.num_hidden_layers),
                                  strategy == "default", True, vcfg.patch_size).eval()
        mean, std = checkpoint.preprocessing(IMAGENET_MEAN, IMAGENET_STD)
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                      vcfg.image_size, vcfg.patch_size, True, mean, std, pipeline=pipeline,
                      details={"model_type": "llava", "feature_layer": fl, "select_strategy": strategy,
                               "vision_layers": vcfg.num_hidden_layers, "projector": True})


class LlavaDinov2Family(Family):
    id = "llava_dinov2"
    adapter = LlavaDinov2Adapter
    has = {PATCH_TOKENS: "LLaVA on DINOv2", CLS_TOKEN: "LLaVA on DINOv2", FEATURE_LAYER: "LLaVA on DINOv2"}
    language_model = {"llava": "LlavaForConditionalGeneration"}
