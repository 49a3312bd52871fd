"""Family `internvl`: InternVL3 and 3.5 (InternVLForConditionalGeneration, transformers' native `internvl` model_type).

Its vision tower (InternVisionModel: a [CLS] token, learned absolute positions, pre-norm blocks with
layer scales lambda_1 / lambda_2, optional q/k RMS norms) runs through VisionPipeline, as CLIP's does;
the connector is a pixel shuffle at downsample_ratio 0.5 followed by the projector (LayerNorm ->
Linear -> GELU -> Linear into the Qwen2 LLM's width). At InternVL3-1B's 448 px, patch 14: [CLS] +
32x32 = 1024 patches; the select strategy `default` drops [CLS]; the shuffle concatenates each 2x2
group of patches (channels ordered (row, column, width)) into one of 16x16 = 256 tokens, raster order.

What the graph computes, image by image equal to the model's own get_image_features (tested against
transformers, fp32): the tower (hidden_states[vision_feature_layer], the final layernorm only for -1
and only where use_mean_pooling is off), the shuffle as transformers writes it (4-D views and permutes
only), the projector. By default a bundle takes one 448 tile per image, each tile an image of the batch.

Tiles (`--grid RxC`, static at compile time, R·C at most the processor's max_patches, 12): InternVL's processor
(GotOcr2ImageProcessor's crop_to_patches) resizes an image to the grid of the aspect closest to its own, cuts R·C
tiles in raster order and adds the whole image resized as a thumbnail when R·C > 1; the bundle's input is those C
tiles of one image as the tower's batch [C, 3, S, S] (images.canvas_tiles: the processor itself, asked for the
grid's R·C tiles after a centre crop to the grid's aspect, so equal to its pixel_values for an image of that
aspect). Each tile runs the tower and connector alone, as get_image_features does; K is one budget over the tiles
(passes.methods.crops, the layout LLaVA-NeXT's crops use: divprune and dart per tile, split `equal`); kept_indices
c·N + i, which is also the row's place among the image's C·N dense rows. The tiles are a static batch that ort,
orin and xavier (TensorRT; host parity through their ONNX Runtime stand-in) and openvino run as they run any other;
a target running batch 1 only (rk3588, qnn) is refused in one line, as for LLaVA-NeXT's crops. The method's line says
the tiles as this family lays them out (crops_order: the grid, then the thumbnail). `--with-llm` takes a tiled
bundle's rows as any other's, and generate and eval (`--grid`, default the bundle's) cut the same tiles
(llm_pixels) and place the kept rows among the image's C·N (TilesPositions). What tiles take beyond the processor's
cut is frontend.tiles' (TiledFamily), which SmolVLM's tiles share.

Where pruning goes: after the connector, on the merged tokens (the features site; Source.spatial_merge
2): divprune, dart, and random / grid with --site features. Refused in one line before any work:
block-site methods (cls, visionzip, tome, ...), since the shuffle needs whole 2x2 groups of the full
grid and a method there keeps single patches; and methods that score by the tower's attention (holov,
cls --score attention, cdpruner's feature layer), since that attention runs over [CLS] + single
patches, not over the merged tokens. The patch Conv is spelled as one MatMul (as Qwen2-VL's is), so the
site finder counts the merged tokens at the features site. Kept tokens carry their index in the 16x16
merged grid (`positions` "indices"): the Qwen2 LLM's 1-D positions, original-positions rule.

The LLM side: its chat template writes an image as <IMG_CONTEXT>, which the processor expands to <img> + the rows of
all its tiles end to end + </img> (one pair per image, tiles or not); `generate` and `eval` write the kept rows so
(image_prompt), at their original positions.
`--with-llm` on ort exports its language model (compiler.llm.torch_exporter, the layers it knows; read from the
VLM's own decoder by compiler.llm.lm_source), FastV included: InternVL3's Qwen2 and InternVL3.5's Qwen3 (per-head q/k
norms), each also through onnxruntime-genai's builder (--llm-exporter genai); the bundle hands over nothing beyond the
rows and their positions. InternVL3.5's MoE checkpoints (Qwen3-MoE) are refused in one line (lm_source.check_family),
as is orin's Edge-LLM exporter (it takes LLaVA's and Qwen2.5-VL's checkpoints only; a Qwen3 language model with its
reason, edgellm.TEXT_REFUSED).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.images import canvas_tiles, parse_grid
from vlmprune.compiler.frontend.merged import load_tower_and_connector
from vlmprune.compiler.frontend.source import (Source, feature_blocks, feature_layer_of, built, sha256_files,
                                               sha256_state)
from vlmprune.compiler.frontend.tiles import TiledFamily
from vlmprune.compiler.frontend.tower import BlockParts, TowerParts, VisionPipeline

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MODEL_TYPES = ("internvl",)
START, END = "<img>", "</img>"  # the processor's marks around one image's rows (its tokenizer's start/end_image_token)
MAX_PATCHES = 12  # the processor's max_patches where its preprocessor_config.json does not say (InternVL3's own)


def square(value, what: str) -> int:
    """An int from a config's size (InternVL's are [h, w] pairs); non-square ones are refused in one line."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise InputError(f"InternVL {what} {list(value)} is not square; vlmprune compiles square tiles")
        value = value[0]
    return int(value)


def build_tower(vision_config) -> nn.Module:
    """The InternVisionModel of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers.models.internvl.modeling_internvl import InternVLVisionModel

    return built(InternVLVisionModel, vision_config, "sdpa")


def build_projector(config) -> nn.Module:
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

    return built(InternVLMultiModalProjector, config)


def tower_parts(model) -> TowerParts:
    """How VisionPipeline runs an InternVisionModel: layernorm_before/after, q/k norms, layer scales."""
    def parts(layer) -> BlockParts:
        a = layer.attention
        q = a.q_proj if isinstance(a.q_norm, nn.Identity) else (lambda x: a.q_norm(a.q_proj(x)))
        k = a.k_proj if isinstance(a.k_norm, nn.Identity) else (lambda x: a.k_norm(a.k_proj(x)))
        return BlockParts(layer.layernorm_before, q, k, a.v_proj, a.projection_layer, a.num_heads, a.scale,
                          layer.layernorm_after, layer.mlp, lambda x: layer.lambda_1 * x, lambda x: layer.lambda_2 * x)

    final = None if isinstance(model.layernorm, nn.Identity) else model.layernorm
    return TowerParts(model, lambda pixel_values: embed(model.embeddings, pixel_values), list(model.encoder.layer),
                      parts, final)


def embed(embeddings, pixel_values: torch.Tensor) -> torch.Tensor:
    """[B, 3, S, S] -> [CLS] + patch embeddings + positions [B, 1 + N, D], as InternVLVisionEmbeddings at its own size.

    The patch Conv is spelled as one MatMul over the flattened patches (Qwen2-VL's tower does the same): the site
    finder then reads the token count at the features site as the merged tokens', not the Conv's patch grid.
    """
    conv = embeddings.patch_embeddings.projection
    p = conv.kernel_size[0]
    b, c, s, _ = pixel_values.shape
    g = s // p
    x = pixel_values.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
    h = x @ conv.weight.reshape(conv.weight.shape[0], -1).t() + conv.bias
    h = torch.cat([embeddings.cls_token.expand(b, -1, -1), h], dim=1)
    return h if embeddings.position_embeddings is None else h + embeddings.position_embeddings


class PixelShuffleProjector(nn.Module):
    """[B, N, D] patch tokens (raster order, no [CLS]) -> pixel shuffle -> projector: [B, N·r², out].

    The shuffle is transformers' InternVLModel.pixel_shuffle (views and permutes of 4-D tensors), so merged
    token (i, j) of the (side·r)² grid holds patches (2i + a, 2j + c) for (a, c) in raster order.
    """

    def __init__(self, projector: nn.Module, side: int, ratio: float):
        super().__init__()
        self.projector = projector
        self.side = side
        self.ratio = ratio

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, _, d = h.shape
        s, r = self.side, self.ratio
        x = h.reshape(b, s, s, d)
        x = x.reshape(b, s, int(s * r), int(d / r)).permute(0, 2, 1, 3)
        x = x.reshape(b, int(s * r), int(s * r), int(d / (r * r))).permute(0, 2, 1, 3)
        return self.projector(x.reshape(b, -1, x.shape[-1]))


def internvl_source(spec: str, kind: str, config, tower: nn.Module, projector: nn.Module, content_hash: str | None,
                    feature_layer: int | None = None, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                    max_patches: int = MAX_PATCHES) -> Source:
    """The Source of a loaded InternVL tower and connector (checkpoints and presets alike)."""
    vcfg = config.vision_config
    image_size, patch = square(vcfg.image_size, "image_size"), square(vcfg.patch_size, "patch_size")
    ratio = float(config.downsample_ratio)
    merge = round(1 / ratio)
    side = image_size // patch
    if abs(merge * ratio - 1) > 1e-6 or side % merge:
        raise InputError(f"InternVL downsample_ratio {ratio:g} must be 1/n with n dividing the {side}-patch grid")
    strategy = config.vision_feature_select_strategy
    if strategy != "default":
        raise InputError(f"vision_feature_select_strategy {strategy!r}: InternVL's pixel shuffle needs the square "
                         "patch grid, [CLS] dropped ('default')")
    fl = feature_layer_of(config, feature_layer)
    blocks = feature_blocks(fl, vcfg.num_hidden_layers)
    connector = PixelShuffleProjector(projector, side, ratio)
    pipeline = VisionPipeline(tower_parts(tower), connector, blocks, True, True, patch, final_norm=fl == -1).eval()
    merged = side // merge
    tokens = {"image_size": image_size, "patch_grid": [side, side], "patches": side * side,
              "spatial_merge": merge, "merged_grid_thw": [1, merged, merged], "tokens": merged * merged}
    details = {"model_type": "internvl", "feature_layer": fl, "select_strategy": strategy,
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": tokens,
               "connector": f"pixel shuffle {merge}x{merge} (downsample_ratio {ratio:g}) + MLP projector",
               "input": "one tile per image (--grid ROWSxCOLS compiles the processor's tiles of one image)",
               "max_patches": max_patches}
    return Source(spec, kind, InternVLAdapter.family, content_hash or sha256_state(pipeline), image_size, patch,
                  True, tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=merge, details=details)


class InternVLAdapter(ModelAdapter):
    family = "internvl"
    model_types = MODEL_TYPES
    summary = "InternVL3 (InternVLForConditionalGeneration): InternViT tower + 2x2 pixel shuffle + MLP projector"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        tower = build_tower(config.vision_config)
        projector = build_projector(config)
        load_tower_and_connector(checkpoint, tower, ("model.vision_tower.", "vision_tower."), projector,
                                 ("model.multi_modal_projector.", "multi_modal_projector."))
        mean, std = checkpoint.preprocessing(IMAGENET_MEAN, IMAGENET_STD)
        return internvl_source(str(checkpoint.path.resolve()), "hf", config, tower, projector,
                               sha256_files(checkpoint.files()), feature_layer, mean, std, max_patches(checkpoint))


def max_patches(checkpoint: Checkpoint) -> int:
    """The most tiles the checkpoint's processor cuts an image into (preprocessor_config.json), else InternVL3's 12."""
    pre = checkpoint.path / "preprocessor_config.json"
    if not pre.is_file():
        return MAX_PATCHES
    try:
        return int(json.loads(pre.read_text()).get("max_patches", MAX_PATCHES))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise InputError(f"{pre}: no readable max_patches ({exc})") from None


def tiles_text(manifest: Manifest) -> str:
    """The bundle README's lines on what one call takes: one tile per image, or one image's tiles (--grid)."""
    model = manifest.model
    if not model.crops:
        return ("kept_indices index that grid. One tile per image: InternVL's processor tiles large images into "
                "tiles plus a thumbnail; compile with --grid ROWSxCOLS to take them, or run each tile as an image of "
                "the batch. ")
    rows, cols = parse_grid(model.grid)
    n = model.token_counts.get("tokens")
    thumbnail = ", then the thumbnail (the whole image resized)" if model.crops > rows * cols else ""
    return (f"Input: one image per call, as InternVL's processor tiles an image of the {rows}x{cols} grid's aspect "
            f"(crop_to_patches): the {rows * cols} tiles in raster order{thumbnail}, {model.crops} in all. "
            f"kept_indices c * {n} + i: token i of tile c, also the row's place among the image's "
            f"{model.crops * n} dense rows (positions offset + kept_indices). ")


class InternVLFamily(TiledFamily):
    """A [CLS] tower whose connector merges 2x2 patch groups: pruned on the merged tokens, after the connector."""

    id = "internvl"
    adapter = InternVLAdapter
    options = {
        "grid": (str, "Tiled models (internvl): compile the processor's ROWSxCOLS tiles of one image, at most "
                      "its max_patches (input [ROWS*COLS + 1, 3, S, S]: the tiles, then the thumbnail). Default: "
                      "one tile."),
        "crop_budget": (str, "Tiled models (internvl): split --keep over the tiles `equal` (the only split for "
                             "divprune and dart)."),
    }
    has = {PATCH_TOKENS: "InternVL3"}  # not CROPS: that capability is cls's scored split, refused here
    language_model = {"internvl": "InternVLForConditionalGeneration"}
    why_not_block = ("InternVL's connector pixel-shuffles each 2x2 group of the full patch grid into one token after "
                     "the tower, so pruning single patches inside it breaks the shuffle")
    why_not_scored = ("scores the merged tokens by the tower's attention or patches, and InternVL's attention runs "
                      "over [CLS] + single patches, not over the merged tokens")

    def check_grid(self, source: Source, rows: int, cols: int) -> None:
        limit = source.details.get("max_patches", MAX_PATCHES)
        if rows * cols > limit:
            raise InputError(f"--grid {rows}x{cols}: {rows * cols} tiles, and this model's processor cuts at most "
                             f"{limit} (max_patches)")

    def cut_tiles(self, image: np.ndarray, crops: dict, size: int, mean, std) -> np.ndarray:
        """InternVL's processor tiles (images.canvas_tiles: GotOcr2ImageProcessor's crop_to_patches)."""
        return canvas_tiles(image, crops, size, mean, std)

    def describe_tiles(self, width: int, height: int, depth: str, crops: dict, size: int) -> str:
        rows, cols = crops["grid"]
        thumbnail = " + the thumbnail (the whole crop resized)" if crops["count"] > rows * cols else ""
        return (f"{width}x{height} image{depth}: centre-cropped to the {rows}x{cols} grid's aspect ({cols}:{rows}), "
                f"InternVL's processor tiles: resized to {cols * size}x{rows * size}, cut into {rows * cols} tiles of "
                f"{size}x{size}{thumbnail} ({crops['count']} tiles)")

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """What InternVL's processor writes in place of the <IMG_CONTEXT> its chat template writes for one tile
        (transformers' InternVLProcessor.replace_image_token): the tile's rows between its start and end image
        tokens, the markers as its tokenizer names them. Without them the LLM reads rows it was never trained to
        see unbracketed."""
        return ImagePrompt(getattr(tokenizer, "start_image_token", None) or START,
                           getattr(tokenizer, "end_image_token", None) or END)

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m = manifest.model.merged_grid_thw[1:]
        return ("\n## InternVL tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} merged grid (each a pixel-shuffled 2x2 group "
                f"of the {counts['patch_grid'][0]}x{counts['patch_grid'][1]} patches), raster order, tile by tile. "
                + tiles_text(manifest) + "The prompt wraps an image's rows (all its tiles') in "
                f"`{START}` ... `{END}`, as its processor does.\n")
