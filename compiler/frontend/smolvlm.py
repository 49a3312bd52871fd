"""Family `smolvlm`: SmolVLM (SmolVLMForConditionalGeneration, transformers' native `smolvlm` model_type).

Its vision tower (SmolVLMVisionTransformer: SigLIP's pre-norm blocks, no [CLS], a post_layernorm, learned
positions looked up through NaViT-style bucketed coordinates) runs through VisionPipeline, as SigLIP's does;
the connector is a pixel shuffle by scale_factor (4 for SmolVLM-256M/500M) followed by one bias-free Linear
into the Llama LLM's width. At SmolVLM-256M's 512 px, patch 16: 32x32 = 1024 patches; the shuffle
concatenates each 4x4 group (channels ordered (row, column, width)) into one of 8x8 = 64 tokens, raster order.

What the graph computes, image by image equal to the model's own get_image_features (tested against
transformers, fp32): the embeddings (the patch Conv spelled as one MatMul, as Qwen2-VL's and InternVL's are,
so that the site finder counts the merged tokens at the features site; the position ids are those the
model's bucketing gives a full, unpadded tile of that size, a constant), the blocks, post_layernorm, the
connector (transformers' own SmolVLMConnector).

Tiles: a bundle takes one tile per image, at one static --image-size (default the tower's, 512), as SmolVLM's
processor feeds an image with do_image_splitting=False (resized to one square tile; the prompt wraps its rows
in <fake_token_around_image><global-img> ... <fake_token_around_image>). Splitting into tiles plus a global
thumbnail is not compiled: each tile can be run as an image of the batch, but one budget over the tiles (as
LLaVA-NeXT's crops have) is not there yet.

Where pruning goes: after the connector, on the merged tokens (the features site; Source.spatial_merge = the
scale factor): divprune, dart, and random / grid with --site features. Refused in one line before any work:
block-site methods (cls, visionzip, tome, ...), since the shuffle needs whole groups of the full grid and a
method there keeps single patches; and methods that score by the tower's attention, a [CLS] or a pooling head
(holov, cls --score attention, cdpruner's feature layer), which SmolVLM's tower lacks or runs over single
patches. Kept tokens carry their index in the merged grid (`positions` "indices"): the Llama LLM's 1-D
positions, original-positions rule.

The LLM side: `generate` and `eval` write the kept rows at their original positions between the markers its
processor writes around one unsplit image (image_prompt). `--with-llm` on ort exports its Llama language model
(compiler.llm.torch_exporter, the layer it knows; read from the VLM's text_model by compiler.llm.lm_source), FastV
included; the bundle hands over nothing beyond the rows and their positions. Orin's Edge-LLM exporter refuses it (it
takes LLaVA's and Qwen2.5-VL's checkpoints only).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.merged import (MergedTokensFamily, conv_as_matmul, load_tower_and_connector,
                                               siglip_block, token_counts)
from vlmprune.compiler.frontend.source import Source, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tower import TowerParts, VisionPipeline

SMOLVLM_MEAN = SMOLVLM_STD = (0.5, 0.5, 0.5)
MODEL_TYPES = ("smolvlm",)
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"  # the processor's marks around one tile's rows


def build_tower(vision_config) -> nn.Module:
    """The SmolVLMVisionTransformer of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

    return built(SmolVLMVisionTransformer, vision_config, "sdpa")


def build_connector(config) -> nn.Module:
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector

    return built(SmolVLMConnector, config)


def position_ids(side: int, table_side: int) -> torch.Tensor:
    """[side²] the position ids SmolVLMVisionEmbeddings gives a full (unpadded) tile of side x side patches, whose
    table is table_side x table_side: its bucketing of fractional coordinates, in its own arithmetic."""
    boundaries = torch.arange(1 / table_side, 1.0, 1 / table_side)
    coords = torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor([side]))
    bucket = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)
    return (bucket[:, None] * table_side + bucket[None, :]).reshape(-1)


def tower_parts(model, side: int) -> TowerParts:
    """How VisionPipeline runs a SmolVLMVisionTransformer at side x side patches (SigLIP's layout)."""
    embeddings = model.embeddings
    ids = position_ids(side, embeddings.num_patches_per_side)

    def embed(pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, N, D]; the patch Conv as one MatMul over the flattened patches."""
        return conv_as_matmul(embeddings.patch_embedding, pixel_values) + embeddings.position_embedding.weight[ids]

    return TowerParts(model, embed, list(model.encoder.layers), siglip_block, model.post_layernorm)


def check_image_size(image_size, unit: int, table: int) -> int:
    """A static tile size: a multiple of patch x scale_factor, at most the tower's own (its position table)."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < unit or image_size % unit \
            or image_size > table:
        raise InputError(f"--image-size for this SmolVLM must be a multiple of {unit} (patch x scale_factor) from "
                         f"{unit} to {table} (its tower's size), got {image_size!r}")
    return image_size


def smolvlm_source(spec: str, kind: str, config, tower: nn.Module, connector: nn.Module, content_hash: str | None,
                   image_size: int | None = None, mean=SMOLVLM_MEAN, std=SMOLVLM_STD) -> Source:
    """The Source of a loaded SmolVLM tower and connector at one static tile size (checkpoints and presets)."""
    vcfg = config.vision_config
    patch, merge = int(vcfg.patch_size), int(config.scale_factor)
    size = check_image_size(int(vcfg.image_size) if image_size is None else image_size, patch * merge,
                            int(vcfg.image_size))
    side = size // patch
    pipeline = VisionPipeline(tower_parts(tower, side), connector, vcfg.num_hidden_layers, True, False, patch,
                              final_norm=True).eval()
    tokens = token_counts(size, patch, merge)
    details = {"model_type": "smolvlm", "feature_layer": -1, "select_strategy": "full",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": tokens,
               "connector": f"pixel shuffle {merge}x{merge} (scale_factor {merge}) + Linear projector",
               "input": "one tile per image (do_image_splitting=False: tiles + global thumbnail are not compiled)"}
    return Source(spec, kind, SmolVLMAdapter.family, content_hash or sha256_state(pipeline), size, patch,
                  False, tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=merge, details=details)


class SmolVLMAdapter(ModelAdapter):
    family = "smolvlm"
    model_types = MODEL_TYPES
    summary = "SmolVLM (SmolVLMForConditionalGeneration): SigLIP tower + pixel shuffle + Linear connector"
    dynamic_resolution = True  # one static --image-size per compile (a tile of at most the tower's size)

    def load(self, checkpoint: Checkpoint, feature_layer: int | None, image_size: int | None = None) -> Source:
        if feature_layer not in (None, -1):
            raise InputError(f"--feature-layer {feature_layer}: SmolVLM's connector reads the tower's last "
                             "normed output only (-1)")
        config = checkpoint.config
        tower = build_tower(config.vision_config)
        connector = build_connector(config)
        load_tower_and_connector(checkpoint, tower, ("model.vision_model.", "vision_model."), connector,
                                 ("model.connector.", "connector."), "connector")
        mean, std = checkpoint.preprocessing(SMOLVLM_MEAN, SMOLVLM_STD)
        return smolvlm_source(str(checkpoint.path.resolve()), "hf", config, tower, connector,
                              sha256_files(checkpoint.files()), image_size, mean, std)


class SmolVLMFamily(MergedTokensFamily):
    """A [CLS]-free SigLIP tower whose connector merges s x s patch groups: pruned after the connector."""

    id = "smolvlm"
    adapter = SmolVLMAdapter
    options = {"image_size": (int, "Static tile size S for smolvlm: a multiple of patch x scale_factor (64 for "
                                   "SmolVLM-256M/500M) up to the tower's 512. Default the tower's size.")}
    has = {PATCH_TOKENS: "SmolVLM"}
    language_model = {"smolvlm": "SmolVLMForConditionalGeneration"}
    why_not_block = ("SmolVLM's connector pixel-shuffles each group of the full patch grid into one token after the "
                     "tower, so pruning single patches inside it breaks the shuffle")
    why_not_scored = ("scores by a [CLS], a pooling head or the tower's attention, and SmolVLM's tower has no [CLS] "
                      "nor head and attends over single patches, not the merged tokens")

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """SmolVLM's forward takes [batch, images, 3, S, S]: one image of one tile."""
        return {"pixel_values": torch.from_numpy(pixel)[None]}

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """What SmolVLM's processor writes around one unsplit image's rows in place of its <image> (transformers'
        _prompt_single_image), the markers as its tokenizer names them."""
        fake = getattr(tokenizer, "fake_image_token", None) or FAKE
        return ImagePrompt(fake + (getattr(tokenizer, "global_image_token", None) or GLOBAL), fake)

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m, s = manifest.model.merged_grid_thw[1:], counts["spatial_merge"]
        return ("\n## SmolVLM tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} merged grid (each a pixel-shuffled {s}x{s} "
                f"group of the {counts['patch_grid'][0]}x{counts['patch_grid'][1]} patches), raster order; "
                "kept_indices index that grid. One tile per image, as SmolVLM's processor feeds it with "
                f"do_image_splitting=False; the prompt wraps the rows in `{FAKE}{GLOBAL}` ... `{FAKE}`.\n")
