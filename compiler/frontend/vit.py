"""Family `vit`: a Hugging Face ViTModel directory (a [CLS] token, pre-norm blocks, a final layernorm).

The features are the model's last_hidden_state (after its final layernorm), or
hidden_states[L] for --feature-layer L; as LLaVA's default select strategy does, [CLS] is
dropped from them (--cls keep keeps it). Preprocessing from preprocessor_config.json, else
ViT's mean and std of 0.5.
"""

from __future__ import annotations

from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import CLS_TOKEN, FEATURE_LAYER, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.source import Source, feature_blocks, from_pretrained, sha256_files
from vlmprune.compiler.frontend.tower import BlockParts, TowerParts, VisionPipeline

VIT_MEAN = VIT_STD = (0.5, 0.5, 0.5)


def tower_parts(vm) -> TowerParts:
    """How VisionPipeline runs a ViTModel (transformers 5's layout: .layers, q/k/v/o_proj, layernorm_before/after)."""
    def parts(layer) -> BlockParts:
        a = layer.attention
        return BlockParts(layer.layernorm_before, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                          vm.config.num_attention_heads, a.scaling, layer.layernorm_after, layer.mlp)

    return TowerParts(vm, vm.embeddings, list(vm.layers), parts, vm.layernorm)


class VitAdapter(ModelAdapter):
    family = "vit"
    model_types = ("vit",)
    summary = "ViT (ViTModel): [CLS] + patches, features = last_hidden_state"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        from transformers import ViTModel

        config = checkpoint.config
        model = from_pretrained(ViTModel, checkpoint, "ViT", add_pooling_layer=False)
        fl = -1 if feature_layer is None else feature_layer
        pipeline = VisionPipeline(tower_parts(model), None, feature_blocks(fl, config.num_hidden_layers), True, True,
                                  config.patch_size, final_norm=feature_layer is None).eval()
        mean, std = checkpoint.preprocessing(VIT_MEAN, VIT_STD)
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                      config.image_size, config.patch_size, True, mean, std, pipeline=pipeline,
                      details={"model_type": checkpoint.model_type, "feature_layer": fl, "select_strategy": "default",
                               "vision_layers": config.num_hidden_layers})


class VitFamily(Family):
    id = "vit"
    adapter = VitAdapter
    has = {PATCH_TOKENS: "ViT", CLS_TOKEN: "ViT", FEATURE_LAYER: "ViT"}
