"""Family `dinov2`: a Hugging Face Dinov2Model or Dinov2WithRegistersModel directory.

DINOv2's blocks scale each branch (layer_scale1, layer_scale2); the features are the model's
last_hidden_state (after its final layernorm), or hidden_states[L] for --feature-layer L.
Register tokens (Dinov2WithRegisters: [CLS], R registers, then the patches) are part of the
prefix: they attend and are attended to, but are never pruned and never counted in K; like
[CLS], LLaVA's default select strategy drops them from the features (--cls keep keeps them).
Preprocessing from preprocessor_config.json, else ImageNet's mean and std (DINOv2's).
"""

from __future__ import annotations

from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import CLS_TOKEN, FEATURE_LAYER, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.source import Source, feature_blocks, from_pretrained, sha256_files
from vlmprune.compiler.frontend.tower import BlockParts, TowerParts, VisionPipeline

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def tower_parts(model) -> TowerParts:
    """How VisionPipeline runs a DINOv2 model (encoder.layer, norm1/norm2, layer scales)."""
    def parts(layer) -> BlockParts:
        a = layer.attention
        return BlockParts(layer.norm1, a.q_proj, a.k_proj, a.v_proj, a.o_proj, model.config.num_attention_heads,
                          a.scaling, layer.norm2, layer.mlp, layer.layer_scale1, layer.layer_scale2)

    return TowerParts(model, model.embeddings, list(model.encoder.layer), parts, model.layernorm)


class Dinov2Adapter(ModelAdapter):
    family = "dinov2"
    model_types = ("dinov2", "dinov2_with_registers")
    summary = "DINOv2 (Dinov2Model, with or without register tokens): features = last_hidden_state"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        from transformers import Dinov2Model, Dinov2WithRegistersModel

        config = checkpoint.config
        registers = checkpoint.model_type == "dinov2_with_registers"
        model = from_pretrained(Dinov2WithRegistersModel if registers else Dinov2Model, checkpoint, "DINOv2")
        fl = -1 if feature_layer is None else feature_layer
        prefix = 1 + (config.num_register_tokens if registers else 0)
        pipeline = VisionPipeline(tower_parts(model), None, feature_blocks(fl, config.num_hidden_layers), True, True,
                                  config.patch_size, prefix=prefix, final_norm=feature_layer is None).eval()
        mean, std = checkpoint.preprocessing(IMAGENET_MEAN, IMAGENET_STD)
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                      config.image_size, config.patch_size, True, mean, std, pipeline=pipeline,
                      details={"model_type": checkpoint.model_type, "feature_layer": fl, "select_strategy": "default",
                               "vision_layers": config.num_hidden_layers, "register_tokens": prefix - 1})


class Dinov2Family(Family):
    id = "dinov2"
    adapter = Dinov2Adapter
    has = {PATCH_TOKENS: "DINOv2", CLS_TOKEN: "DINOv2", FEATURE_LAYER: "DINOv2"}
