"""What the families pruned after a patch-merging connector share: SmolVLM, Gemma 3, LFM2-VL, InternVL3.

Each runs its tower through VisionPipeline (SmolVLM, Gemma 3 and LFM2-VL a SigLIP-layout one: pre-norm blocks, no
[CLS], post_layernorm), then a connector that folds each s x s group of the full patch grid into one token
(SmolVLM's and InternVL's pixel shuffle, Gemma 3's average pooling, LFM2-VL's pixel unshuffle). Pruning goes after
the connector, on the merged tokens (the features site; Source.spatial_merge = s), and only there: a method inside
the tower keeps single patches, which breaks the groups the connector needs, and a method that scores by the
tower's attention, [CLS], pooling head or feature layer reads single patches, not merged tokens. Why a module: that
refusal, the SigLIP block layout, loading the tower and the connector by key prefix, the patch embedding spelled as
one MatMul (so that the site finder counts the merged tokens at the features site, not a Conv's patch grid) and the
token counts were written once per family; one change of the rule now reaches them all.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.family import Family
from vlmprune.compiler.frontend.source import Source, load_state, read_safetensors
from vlmprune.compiler.frontend.tower import BLOCK, BlockParts

FEATURES_METHODS = "divprune, dart, or random / grid --site features"  # what serves the merged tokens


def siglip_block(layer) -> BlockParts:
    """One SigLIP-layout encoder layer (SigLIP's, SigLIP2's, SmolVLM's) as VisionPipeline runs it."""
    a = layer.self_attn
    return BlockParts(layer.layer_norm1, a.q_proj, a.k_proj, a.v_proj, a.out_proj, a.num_heads, a.scale,
                      layer.layer_norm2, layer.mlp)


def patches(pixel_values: torch.Tensor, p: int, channels_last: bool = False) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)·(W/p), C·p·p] raster order, each patch flattened as a Conv's weight is (C, row, col),
    or (row, col, C) with channels_last (SigLIP2's NaFlex processor): the patch embedding then is one MatMul."""
    b, c, h, w = pixel_values.shape
    gh, gw = h // p, w // p
    order = (0, 2, 4, 3, 5, 1) if channels_last else (0, 2, 4, 1, 3, 5)
    return pixel_values.reshape(b, c, gh, p, gw, p).permute(*order).reshape(b, gh * gw, c * p * p)


def patch_matmul(conv, x: torch.Tensor) -> torch.Tensor:
    """Flattened patches [B, N, C·p·p] (a Conv's weight order) through a patch Conv as one MatMul: [B, N, D]. Apart
    from conv_as_matmul for a family whose processor hands over patches, not a picture (MiniCPM-V's NaViT packing)."""
    return x @ conv.weight.reshape(conv.weight.shape[0], -1).t() + conv.bias


def conv_as_matmul(conv, pixel_values: torch.Tensor) -> torch.Tensor:
    """A patch Conv (kernel = stride = p) applied as one MatMul over the flattened patches: [B, N, D]."""
    return patch_matmul(conv, patches(pixel_values, conv.kernel_size[0]))


def token_counts(image_size: int, patch: int, merge: int) -> dict:
    """The manifest's token_counts of one square image whose side x side patches merge s x s into tokens."""
    side = image_size // patch
    merged = side // merge
    return {"image_size": image_size, "patch_grid": [side, side], "patches": side * side, "spatial_merge": merge,
            "merged_grid_thw": [1, merged, merged], "tokens": merged * merged}


def load_tower_and_connector(checkpoint, tower, tower_prefixes: tuple[str, ...], connector,
                             connector_prefixes: tuple[str, ...], connector_name: str = "projector") -> None:
    """The tower's and the connector's weights from the checkpoint's safetensors, by key prefix (first match wins);
    no vision weights, a missing weight or a shape that disagrees with config.json is one line."""
    state = read_safetensors(checkpoint.weights, tower_prefixes)
    if not state:
        raise InputError(f"{checkpoint.path}: no vision weights ({tower_prefixes[-2]}* or {tower_prefixes[-1]}*) in "
                         "the safetensors")
    load_state(tower, state, "vision tower")
    load_state(connector, read_safetensors(checkpoint.weights, connector_prefixes), connector_name)


class MergedTokensFamily(Family):
    """A family pruned on its connector's merged tokens only (the module docstring says why).

    why_not_block: why a method inside the tower breaks its connector; why_not_scored: why the tower's attention,
    [CLS], head or feature layer does not score its merged tokens.
    """

    why_not_block: ClassVar[str]
    why_not_scored: ClassVar[str]

    def check_method(self, source: Source, config, site_spec: type) -> None:
        """Before the export: only methods that read the merged tokens alone serve this family."""
        name, needs = config.method.name, config.method.needs(config.params)
        if needs.site == BLOCK:
            raise InputError(f"method {name} prunes inside the tower, and {self.why_not_block}: prune the merged "
                             f"tokens ({FEATURES_METHODS})")
        if needs.cls or needs.attention or needs.head or needs.tower_features or \
                config.params.get("score") == "attention":
            raise InputError(f"method {name} with these options {self.why_not_scored}: prune them with "
                             f"{FEATURES_METHODS}")
        super().check_method(source, config, site_spec)

    def llm_source(self, checkpoint, options: dict) -> Source:
        """At the bundle's static --image-size, where the family takes one (SmolVLM's, LFM2-VL's tile)."""
        if "image_size" in self.options:
            return self.adapter().load(checkpoint, None, image_size=options.get("image_size"))
        return super().llm_source(checkpoint, options)

