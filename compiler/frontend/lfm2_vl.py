"""Family `lfm2_vl`: LFM2-VL (Lfm2VlForConditionalGeneration, transformers' native `lfm2_vl` model_type).

Its vision tower is a SigLIP2 NaFlex encoder (Siglip2VisionModel without its pooling head: no [CLS], pre-norm blocks
laid out as SigLIP's, post_layernorm), run through VisionPipeline; the connector is Lfm2VlMultiModalProjector: a pixel
unshuffle by downsample_factor (2: each 2x2 group of patches, channels ordered (row, column, width), into one token),
a LayerNorm, Linear -> GELU -> Linear into the LFM2 LLM's width. At LFM2-VL-450M's 256 px, patch 16: 16x16 = 256
patches unshuffled into 8x8 = 64 tokens, raster order.

NaFlex fixed at compile time: the model takes any resolution (its processor keeps the aspect ratio, 64 to 256 tokens
an image, tiles of 512 px plus a thumbnail above that), its learned 16x16 position table bilinearly resampled to each
image's patch grid. A bundle takes one square tile at one static --image-size S (default the table's own size,
patch x its side: 256 px for LFM2-VL; a multiple of patch x downsample_factor, up to the processor's 256 tokens), so
the patch grid, the resampled positions (a constant: transformers' own resampling weights, computed once) and the
token count are fixed in the graph; no padding, so the tower's attention mask is all ones and is left out. An image
is resized to S x S, as the processor feeds a square image of that size; splitting into tiles with a thumbnail is
not compiled (each tile can be run as an image of the batch, without one budget over them).

What the graph computes, image by image equal to the model's own get_image_features (tested against transformers,
fp32): the patch embedding (SigLIP2's Linear over each patch's (row, column, channel) pixels: one MatMul, so that the
site finder counts the merged tokens at the features site), the resampled positions, the blocks, post_layernorm,
and transformers' own projector fed the patch grid as get_image_features lays it out for one unpadded image.

Where pruning goes: after the connector, on the unshuffled tokens (the features site; Source.spatial_merge 2):
divprune, dart, and random / grid with --site features. Refused in one line before any work (frontend.merged): block-
site methods, since the unshuffle needs whole 2x2 groups of the full grid and a method inside the tower keeps single
patches (the tower is a plain ViT stack that the block-site insertion could run, but its output would no longer
unshuffle), and methods that score by the tower's attention, a [CLS], a head or the feature layer, which LFM2-VL's
tower lacks or runs over single patches. Kept tokens carry their index in the merged grid (`positions` "indices"):
the LFM2 LLM's 1-D positions, original-positions rule.

The LLM side: LFM2 (hybrid: gated short-convolution layers and grouped-query attention layers with RoPE). `generate`
and `eval` splice the kept rows into its inputs_embeds between the <|image_start|> and <|image_end|> its processor
writes around one tile's <image> tokens (image_prompt), the attention layers at the rows' original positions; the
convolutions see the kept rows side by side, as they would any K image tokens. `--with-llm` exports it on target ort
(the torch exporter; compiler.llm.lm_source declares the decoder, compiler.llm.short_conv spells its convolution): the
prefill and decode graphs carry each convolution layer's state (`present.{i}.conv`, its last conv_L_cache inputs)
beside the attention layers' KV cache, and `generate` feeds them back step by step as it does the caches. FastV,
onnxruntime-genai's builder and Edge-LLM's exporter refuse it in one line each: nothing of this module is asked.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.merged import (MergedTokensFamily, load_tower_and_connector, patches, siglip_block,
                                               token_counts)
from vlmprune.compiler.frontend.source import Source, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tower import TowerParts, VisionPipeline

LFM2_VL_MEAN = LFM2_VL_STD = (0.5, 0.5, 0.5)  # Lfm2VlImageProcessor's defaults (IMAGENET_STANDARD)
MODEL_TYPES = ("lfm2_vl",)
MAX_TOKENS = 256  # Lfm2VlImageProcessor's max_image_tokens: the most one unsplit image gives
# Checkpoints saved before transformers flattened Siglip2VisionModel nest the tower as .vision_model
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
IMAGE_START, IMAGE_END = "<|image_start|>", "<|image_end|>"  # the processor's marks around one tile's rows


def build_tower(vision_config) -> nn.Module:
    """The Siglip2VisionModel of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

    return built(Siglip2VisionModel, vision_config, "sdpa")


def build_projector(config) -> nn.Module:
    from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlMultiModalProjector

    return built(Lfm2VlMultiModalProjector, config)


def position_weights(side: int, table_side: int) -> torch.Tensor | None:
    """[side², table_side²] the weights by which Siglip2VisionEmbeddings resamples its table_side² position table to a
    full (unpadded) side x side grid, in its own arithmetic (its resampling of an identity table); None at the table's
    own size, where the resampling is the identity."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    if side == table_side:
        return None
    identity = torch.eye(table_side * table_side).reshape(table_side, table_side, -1)
    with torch.no_grad():
        return Siglip2VisionEmbeddings.resize_positional_embeddings(identity, torch.tensor([[side, side]]),
                                                                    side * side)[0]


def tower_parts(model, side: int) -> TowerParts:
    """How VisionPipeline runs a Siglip2VisionModel on one unpadded side x side grid (SigLIP's block layout)."""
    embeddings = model.embeddings
    p = embeddings.patch_size
    weights = position_weights(side, embeddings.position_embedding_size)

    def embed(pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, N, D]: NaFlex's patches (row, column, channel), its Linear, the resampled positions."""
        table = embeddings.position_embedding.weight
        positions = table if weights is None else weights @ table
        return embeddings.patch_embedding(patches(pixel_values, p, channels_last=True)) + positions

    return TowerParts(model, embed, list(model.encoder.layers), siglip_block, model.post_layernorm)


class GridProjector(nn.Module):
    """transformers' Lfm2VlMultiModalProjector on one image's [B, N, D] patches: it takes them as a [B, rows, columns,
    D] grid (what get_image_features builds for an unpadded image), unshuffles and projects, and gives [B, T, D'] in
    raster order."""

    def __init__(self, projector: nn.Module, side: int):
        super().__init__()
        self.projector, self.side = projector, side

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, _, d = h.shape
        out = self.projector(h.reshape(b, self.side, self.side, d))
        return out.reshape(b, -1, out.shape[-1])


def table_side(vision_config) -> int:
    """The side of the tower's square position table (NaFlex resamples a square one); one line for another."""
    count = int(vision_config.num_patches)
    side = round(count ** 0.5)
    if side * side != count:
        raise InputError(f"LFM2-VL vision num_patches {count} is not a square position table (NaFlex resamples a "
                         "square one)")
    return side


def check_image_size(image_size, unit: int) -> int:
    """A static tile size: a multiple of patch x downsample_factor, of at most MAX_TOKENS tokens."""
    top = unit * int(MAX_TOKENS ** 0.5)
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < unit or image_size % unit \
            or image_size > top:
        raise InputError(f"--image-size for this LFM2-VL must be a multiple of {unit} (patch x downsample_factor) "
                         f"from {unit} to {top} (its processor's {MAX_TOKENS} tokens of one tile), got {image_size!r}")
    return image_size


def lfm2_vl_source(spec: str, kind: str, config, tower: nn.Module, projector: nn.Module, content_hash: str | None,
                   image_size: int | None = None, mean=LFM2_VL_MEAN, std=LFM2_VL_STD) -> Source:
    """The Source of a loaded LFM2-VL tower and projector at one static tile size (checkpoints and presets)."""
    vcfg = config.vision_config
    patch, merge = int(vcfg.patch_size), int(config.downsample_factor)
    size = check_image_size(table_side(vcfg) * patch if image_size is None else image_size, patch * merge)
    side = size // patch
    pipeline = VisionPipeline(tower_parts(tower, side), GridProjector(projector, side), vcfg.num_hidden_layers, True,
                              False, patch, final_norm=True).eval()
    counts = token_counts(size, patch, merge)
    norm = " + LayerNorm" if config.projector_use_layernorm else ""
    details = {"model_type": "lfm2_vl", "feature_layer": -1, "select_strategy": "full (no [CLS])",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": counts,
               "connector": f"pixel unshuffle {merge}x{merge} (downsample_factor {merge}){norm} + MLP projector",
               "input": f"one square tile per image at {size} px (NaFlex fixed at compile time; tiles + thumbnail are "
                        "not compiled)"}
    return Source(spec, kind, Lfm2VlAdapter.family, content_hash or sha256_state(pipeline), size, patch, False,
                  tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=merge, details=details)


class Lfm2VlAdapter(ModelAdapter):
    family = "lfm2_vl"
    model_types = MODEL_TYPES
    summary = "LFM2-VL (Lfm2VlForConditionalGeneration): SigLIP2 NaFlex tower + pixel unshuffle + MLP projector"
    dynamic_resolution = True  # one static --image-size per compile (one square tile)

    def load(self, checkpoint: Checkpoint, feature_layer: int | None, image_size: int | None = None) -> Source:
        if feature_layer not in (None, -1):
            raise InputError(f"--feature-layer {feature_layer}: LFM2-VL's projector reads the tower's last normed "
                             "output only (-1)")
        config = checkpoint.config
        if getattr(config.vision_config, "model_type", None) != "siglip2_vision_model":
            raise InputError(f"LFM2-VL vision tower type {config.vision_config.model_type!r} is not supported "
                             "(SigLIP2 NaFlex)")
        table_side(config.vision_config)  # before any weight is read
        tower = build_tower(config.vision_config)
        projector = build_projector(config)
        load_tower_and_connector(checkpoint, tower, TOWER_PREFIXES, projector, PROJECTOR_PREFIXES)
        mean, std = checkpoint.preprocessing(LFM2_VL_MEAN, LFM2_VL_STD)
        return lfm2_vl_source(str(checkpoint.path.resolve()), "hf", config, tower, projector,
                              sha256_files(checkpoint.files()), image_size, mean, std)


class Lfm2VlFamily(MergedTokensFamily):
    """A [CLS]-free SigLIP2 tower whose connector unshuffles 2x2 patch groups: pruned after the connector."""

    id = "lfm2_vl"
    adapter = Lfm2VlAdapter
    options = {"image_size": (int, "Static tile size S for lfm2_vl: a multiple of patch x downsample_factor (32 for "
                                   "LFM2-VL) up to 256 tokens (512 px). Default its position table's size (256).")}
    has = {PATCH_TOKENS: "LFM2-VL"}
    language_model = {"lfm2_vl": "Lfm2VlForConditionalGeneration"}
    why_not_block = ("LFM2-VL's connector pixel-unshuffles each 2x2 group of the full patch grid into one token after "
                     "the tower, so pruning single patches inside it breaks the unshuffle")
    why_not_scored = ("scores by a [CLS], a pooling head or the tower's attention, and LFM2-VL's tower has no [CLS] "
                      "nor head and attends over single patches, not the merged tokens")

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """Lfm2VlModel's forward takes NaFlex's patches [1, N, p·p·3] (row, column, channel), the grid's (rows,
        columns) and which patches are real (all of one unpadded tile)."""
        side = source.image_size // source.patch_size
        values = patches(torch.from_numpy(pixel), source.patch_size, channels_last=True)
        return {"pixel_values": values, "spatial_shapes": torch.tensor([[side, side]] * len(values)),
                "pixel_attention_mask": torch.ones(values.shape[:2], dtype=torch.bool)}

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """What LFM2-VL's processor writes around one unsplit image's <image> tokens (its _build_image_tokens with
        use_image_special_tokens), the marks as its tokenizer names them."""
        return ImagePrompt(getattr(tokenizer, "image_start_token", None) or IMAGE_START,
                           getattr(tokenizer, "image_end_token", None) or IMAGE_END)

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m, p, s = manifest.model.merged_grid_thw[1:], counts["patch_grid"], counts["spatial_merge"]
        return ("\n## LFM2-VL tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} merged grid (each a pixel-unshuffled {s}x{s} "
                f"group of the {p[0]}x{p[1]} patches, then the projector), raster order; kept_indices index that "
                f"grid. One square tile per image at {counts['image_size']} px, as LFM2-VL's processor feeds a square "
                f"image of that size unsplit; the prompt wraps the rows in `{IMAGE_START}` ... `{IMAGE_END}`.\n")
