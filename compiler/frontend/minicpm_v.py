"""Family `minicpm_v`: MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration, transformers' native `minicpmv4_6`).

Its connector is a merger, not a resampler: MiniCPM-V 4.6 dropped the earlier versions' perceiver resampler (a fixed
number of learned queries cross-attending to the patches). Its vision tower is SigLIP-So400m's layout (pre-norm
blocks, no [CLS], learned positions looked up by NaViT's nearest bucket, post_layernorm) with a window-attention
merger inside it: after block insert_layer_id + 1 (7 of 27), each 2x2 window of patches attends within itself, is
flattened, normed and run through an MLP (plus the window's mean) into one token, and the remaining blocks run on that
quarter grid. The connector (MiniCPMV4_6Merger) then folds each 2x2 group of the quarter grid, (row, column, width),
into one token: LayerNorm, Linear, GELU, Linear into the Qwen3.5 LLM's width. Overall each 4x4 group of patches is one
token (downsample_mode "16x"; "4x" skips the window merger, and each 2x2 group is one token). At 448 px, patch 14:
32x32 = 1024 patches, 16x16 after the window merger, 8x8 = 64 tokens, raster order.

What the graph computes, image by image equal to the model's own get_image_features (tested against transformers,
fp32): the patch Conv as one MatMul (so that the site finder counts the merged tokens at the features site), the
position ids a full tile of that size gets (a constant), blocks 1..insert_layer_id + 1, the window merger (its own
projections, windows taken by a static reshape in place of transformers' window index: the same order), the other
blocks, post_layernorm, and the merger's MLPs fed the groups as transformers' merger lays them out. VisionPipeline
runs the blocks up to the window merger as its blocks and the rest as its projector (block-site methods are refused,
so no method runs between them).

Slicing is not compiled: a bundle takes one square tile per image at one static --image-size S (a multiple of patch x
the total merge, 56 for MiniCPM-V 4.6; default the processor's scale_resolution, 448, or the tower's own size where
that is smaller), as MiniCPM-V's processor feeds an image that needs no slicing (slice_mode off, or an image of at
most scale_resolution² pixels), resized to S x S. Its slices plus the source image under one budget (as LLaVA-NeXT's
crops have) are not there; each slice can be run as an image of the batch.

Where pruning goes: after the connector, on the merged tokens (the features site; Source.spatial_merge 4, or 2 at
"4x"): divprune, dart, and random / grid with --site features. That is the one site with exact parity against Hugging
Face's own forward on the same kept set: a kept token's row is the model's own row of that token (equal to the rows
transformers gives, fp32 to 1e-5, tested), whatever else is kept. Inside the tower there is none: dropping single
patches breaks the 2x2 groups the window merger and the merger fold, and dropping whole groups after the window merger
changes the kept tokens' rows too, since the blocks after it attend over the whole quarter grid. Refused in one line
before any work (frontend.merged): block-site methods, since both the window merger and the connector need whole 2x2
groups of the full grid and a method inside the tower keeps single patches; and methods that score by the tower's
attention, a [CLS], a head or the feature layer, which MiniCPM-V's tower lacks or runs over single patches (or over
window-merged tokens that are not the LLM's). Kept tokens carry their index in the merged grid (`positions`
"indices"): the LLM's 1-D positions, original-positions rule.

The LLM side: Qwen3.5 (hybrid: gated delta-net linear-attention layers and gated full-attention layers with RoPE;
MiniCPM-V gives its image rows the text's 1-D positions, no mRoPE grid). `generate` and `eval` splice the kept rows
into its inputs_embeds between the <image> and </image> its processor writes around one unsliced image's tokens,
"<image_id>0</image_id>" before them as it writes by default (use_image_id; image_prompt), the attention layers at the
rows' original positions; the linear-attention layers' recurrence sees the kept rows side by side, as it would any K
image tokens. `--with-llm` exports it on target ort (the torch exporter; compiler.llm.lm_source declares qwen3_5_text):
each delta-net layer's convolution and recurrent states (`present.{i}.conv`, `present.{i}.recurrent`; the prefill's
delta rule an ONNX Scan, compiler.llm.gated_delta) beside the attention layers' keys and values. FastV, the
onnxruntime-genai builder and Edge-LLM's exporter are refused in one line each.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.merged import (MergedTokensFamily, conv_as_matmul, load_tower_and_connector,
                                               token_counts)
from vlmprune.compiler.frontend.source import Source, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tower import BlockParts, TowerParts, VisionPipeline, run_block

MINICPM_V_MEAN = MINICPM_V_STD = (0.5, 0.5, 0.5)  # MiniCPMV4_6ImageProcessor's defaults (IMAGENET_STANDARD)
MODEL_TYPES = ("minicpmv4_6",)
SCALE_RESOLUTION = 448  # MiniCPMV4_6ImageProcessor's scale_resolution: the side of an unsliced image
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
MERGER_PREFIXES = ("model.merger.", "merger.")
IMAGE_START, IMAGE_END = "<image>", "</image>"  # the processor's marks around one unsliced image's rows
ID_START, ID_END = "<image_id>", "</image_id>"  # ... and, with use_image_id, the image's id before them


def build_tower(vision_config) -> nn.Module:
    """The MiniCPMV4_6VisionModel of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6VisionModel

    return built(MiniCPMV4_6VisionModel, vision_config, "sdpa")


def build_merger(config) -> nn.Module:
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Merger

    return built(MiniCPMV4_6Merger, config)


def block(layer) -> BlockParts:
    """One MiniCPMV4_6VisionEncoderLayer (SigLIP's layout; its attention names its scale `scaling`)."""
    a = layer.self_attn
    return BlockParts(layer.layer_norm1, a.q_proj, a.k_proj, a.v_proj, a.out_proj, a.num_heads, a.scaling,
                      layer.layer_norm2, layer.mlp)


def uses_window_merger(config) -> bool:
    """Whether get_image_features runs the tower's window merger (downsample_mode "16x"; "4x" skips it)."""
    return config.downsample_mode != "4x" and config.vision_config.insert_layer_id >= 0


def total_merge(config) -> int:
    """The side of the patch group one token folds: 2 per merger round, 2 more for the window merger."""
    return 2 ** (int(config.merger_times) + uses_window_merger(config))


def fold(h: torch.Tensor, side: int) -> torch.Tensor:
    """[B, side², D] raster -> [B, (side/2)², 4·D]: each 2x2 group's rows (row, column) side by side, raster order of
    the groups (transformers' window index and its merger's view/permute, spelled as one static reshape)."""
    b, _, d = h.shape
    half = side // 2
    return h.reshape(b, half, 2, half, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(b, half * half, 4 * d)


def window_merge(merger: nn.Module, h: torch.Tensor, side: int) -> torch.Tensor:
    """MiniCPMV4_6ViTWindowAttentionMerger on [B, side², D]: attention within each 2x2 window (its layer_norm1 and
    projections), the residual, then per window pre_norm(flat) -> linear_1 -> act -> linear_2 + the window's mean."""
    b, _, d = h.shape
    windows = fold(h, side).reshape(-1, 4, d)  # [B·W, 4, D]
    a = merger.self_attn
    x = merger.layer_norm1(windows)
    heads = a.num_heads
    q, k, v = (proj(x).view(x.shape[0], 4, heads, -1).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=a.scaling)
    windows = windows + a.out_proj(o.transpose(1, 2).reshape(x.shape[0], 4, d))
    out = merger.linear_2(merger.act(merger.linear_1(merger.pre_norm(windows.reshape(-1, 4 * d)))))
    return (out + windows.mean(dim=1)).reshape(b, -1, d)


class AfterWindowMerge(nn.Module):
    """What follows the first blocks, as VisionPipeline's projector: the window merger and the blocks after it (where
    the checkpoint runs it), post_layernorm, then transformers' merger MLPs round by round: [B, N, D] -> [B, T, D']."""

    def __init__(self, tower: nn.Module, merger: nn.Module, side: int, window: bool):
        super().__init__()
        self.tower, self.merger, self.side, self.window = tower, merger, side, window
        self.rest = list(tower.encoder.layers)[tower.config.insert_layer_id + 1:] if window else []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        side = self.side
        if self.window:
            h = window_merge(self.tower.vit_merger, h, side)
            side //= 2
            for layer in self.rest:
                h, _ = run_block(block(layer), h)
        h = self.tower.post_layernorm(h)
        b = h.shape[0]
        for mlp in self.merger.mlp:
            h = mlp(fold(h, side)).reshape(b, -1, mlp.linear_2.out_features)
            side //= 2
        return h


def position_ids(side: int, table_side: int) -> torch.Tensor:
    """[side²] the position ids MiniCPMV4_6VisionEmbeddings gives a full side x side tile (transformers' own nearest
    bucketing, get_vision_nearest_position_ids, computed once)."""
    from transformers.vision_utils import get_vision_nearest_position_ids

    return get_vision_nearest_position_ids(torch.tensor([[side, side]]), table_side)


def tower_parts(model, side: int, window: bool) -> TowerParts:
    """How VisionPipeline runs the blocks before the window merger (all of them without it; SigLIP's layout)."""
    embeddings = model.embeddings
    ids = position_ids(side, embeddings.num_patches_per_side)

    def embed(pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, N, D]; the patch Conv as one MatMul over the flattened patches."""
        return conv_as_matmul(embeddings.patch_embedding, pixel_values) + embeddings.position_embedding.weight[ids]

    layers = list(model.encoder.layers)
    first = layers[: model.config.insert_layer_id + 1] if window else layers
    return TowerParts(model, embed, first, block)


def check_image_size(image_size, unit: int, top: int) -> int:
    """A static tile size: a multiple of patch x the total merge, at most the tower's own (its position table)."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < unit or image_size % unit \
            or image_size > top:
        raise InputError(f"--image-size for this MiniCPM-V must be a multiple of {unit} (patch x its merges) from "
                         f"{unit} to {top} (its tower's size), got {image_size!r}")
    return image_size


def minicpm_v_source(spec: str, kind: str, config, tower: nn.Module, merger: nn.Module, content_hash: str | None,
                     image_size: int | None = None, mean=MINICPM_V_MEAN, std=MINICPM_V_STD) -> Source:
    """The Source of a loaded MiniCPM-V tower and merger at one static tile size (checkpoints and presets)."""
    vcfg = config.vision_config
    patch, merge = int(vcfg.patch_size), total_merge(config)
    table = int(vcfg.image_size) // patch * patch
    size = check_image_size(min(SCALE_RESOLUTION, table) if image_size is None else image_size, patch * merge, table)
    side = size // patch
    window = uses_window_merger(config)
    first = vcfg.insert_layer_id + 1 if window else vcfg.num_hidden_layers
    pipeline = VisionPipeline(tower_parts(tower, side, window), AfterWindowMerge(tower, merger, side, window), first,
                              True, False, patch).eval()
    counts = token_counts(size, patch, merge)
    inside = f"window merger 2x2 after block {first} + " if window else ""
    details = {"model_type": "minicpmv4_6", "feature_layer": -1, "select_strategy": "full (no [CLS])",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": counts,
               "connector": f"{inside}merger 2x2 x{config.merger_times} (LayerNorm + MLP) into {merge}x{merge} groups",
               "input": f"one square tile per image at {size} px (slicing is not compiled)"}
    return Source(spec, kind, MiniCPMVAdapter.family, content_hash or sha256_state(pipeline), size, patch, False,
                  tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=merge, details=details)


class MiniCPMVAdapter(ModelAdapter):
    family = "minicpm_v"
    model_types = MODEL_TYPES
    summary = "MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration): SigLIP tower with a window merger + 2x2 merger"
    dynamic_resolution = True  # one static --image-size per compile (one square tile, unsliced)

    def load(self, checkpoint: Checkpoint, feature_layer: int | None, image_size: int | None = None) -> Source:
        if feature_layer not in (None, -1):
            raise InputError(f"--feature-layer {feature_layer}: MiniCPM-V's merger reads the tower's last normed "
                             "output only (-1)")
        config = checkpoint.config
        if tuple(config.merge_kernel_size) != (2, 2) or tuple(config.vision_config.window_kernel_size) != (2, 2):
            raise InputError(f"MiniCPM-V merge_kernel_size {list(config.merge_kernel_size)} / window_kernel_size "
                             f"{list(config.vision_config.window_kernel_size)} are not supported (2x2, as "
                             "transformers' merger)")
        tower = build_tower(config.vision_config)
        merger = build_merger(config)
        load_tower_and_connector(checkpoint, tower, TOWER_PREFIXES, merger, MERGER_PREFIXES, "merger")
        mean, std = checkpoint.preprocessing(MINICPM_V_MEAN, MINICPM_V_STD)
        return minicpm_v_source(str(checkpoint.path.resolve()), "hf", config, tower, merger,
                                sha256_files(checkpoint.files()), image_size, mean, std)


class MiniCPMVFamily(MergedTokensFamily):
    """A [CLS]-free SigLIP tower with a window merger inside, then a 2x2 merger: pruned after the connector."""

    id = "minicpm_v"
    adapter = MiniCPMVAdapter
    options = {"image_size": (int, "Static tile size S for minicpm_v: a multiple of patch x its merges (56 for "
                                   "MiniCPM-V 4.6) up to the tower's 980. Default its processor's 448.")}
    has = {PATCH_TOKENS: "MiniCPM-V"}
    language_model = {"minicpmv4_6": "MiniCPMV4_6ForConditionalGeneration"}
    why_not_block = ("MiniCPM-V's window merger and connector each fold 2x2 groups of the full patch grid into one "
                     "token, so pruning single patches inside the tower breaks the groups")
    why_not_scored = ("scores by a [CLS], a pooling head or the tower's attention, and MiniCPM-V's tower has no [CLS] "
                      "nor head and attends over single patches or windows, not the merged tokens")

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """MiniCPM-V's forward takes NaViT-packed patches [1, 3, p, B·N·p] (each image's patches in raster order, its
        processor's reshape_by_patch) and each image's patch grid."""
        p, side = source.patch_size, source.image_size // source.patch_size
        x = torch.from_numpy(pixel)
        b, c = x.shape[:2]
        packed = x.reshape(b, c, side, p, side, p).permute(1, 3, 0, 2, 4, 5).reshape(1, c, p, -1)
        return {"pixel_values": packed, "target_sizes": torch.tensor([[side, side]] * b, dtype=torch.int32)}

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """What MiniCPM-V's processor writes around one unsliced image's tokens (replace_image_token, with its
        use_image_id prefix for the first image), the marks as its tokenizer names them."""
        start = getattr(tokenizer, "image_start_token", None) or IMAGE_START
        end = getattr(tokenizer, "image_end_token", None) or IMAGE_END
        ids = (getattr(tokenizer, "image_id_start_token", None) or ID_START,
               getattr(tokenizer, "image_id_end_token", None) or ID_END)
        return ImagePrompt(f"{ids[0]}0{ids[1]}{start}", end)

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m, p, s = manifest.model.merged_grid_thw[1:], counts["patch_grid"], counts["spatial_merge"]
        return ("\n## MiniCPM-V tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} merged grid (each a {s}x{s} group of the "
                f"{p[0]}x{p[1]} patches: the tower's window merger, then the merger), raster order; kept_indices index "
                f"that grid. One square tile per image at {counts['image_size']} px, as MiniCPM-V's processor feeds an "
                f"image unsliced; the prompt wraps the rows in `{ID_START}0{ID_END}{IMAGE_START}` ... `{IMAGE_END}`.\n")
