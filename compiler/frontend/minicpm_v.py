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
so no method runs between them). The patch grid need not be square (a sliced image's source is not).

By default a bundle takes one square tile per image at one static --image-size S (a multiple of patch x the total
merge, 56 for MiniCPM-V 4.6; default the processor's scale_resolution, 448, or the tower's own size where that is
smaller), as MiniCPM-V's processor feeds an image that needs no slicing (slice_mode off, or an image of at most
scale_resolution² pixels), resized to S x S.

Slicing (`--grid RxC`): the processor (MiniCPMV4_6ImageProcessor) cuts a large image into a source image
(find_best_resize: the whole image at about S² pixels, its aspect kept) and R x C slices (get_sliced_grid,
get_refine_size, divide_to_patches), and the source and the slices differ in size, so they are no one static batch.
A compile fixes the image's shape to the grid's, R·S x C·S (each slice's region S x S), and takes the sizes the
processor itself derives for it (slice_layout: at 448, 1x2 gives a 336x616 source and two 448x448 slices); a grid
the processor would not cut from that shape (one slice, more than its max_slice_nums, another grid by its aspect
search) or parts the merges do not divide are refused in one line. The bundle's input is the processor's own
pixel_values of one image, its NaViT-packed patches [B, 3, p, L·p] (the source's patches, then each slice's);
minicpm_slices centre-crops a photo to the grid's aspect and lets the processor cut it, the crop resized to the
grid's shape first where the processor would cut it otherwise. The graph (SlicedPipeline) runs the tower and merger
twice on the same weights, on the source's patch grid and on the slices' as a batch of R·C, each with its grid's
position ids, as transformers' packed forward does (its attention never crosses two parts); the image's rows are the
source's tokens then each slice's, and K is one budget over all of them (the method sees the image's rows as one
set), kept_indices their place among those rows. ort, orin, xavier (host parity) and openvino (CPU) run it;
`--batch B` takes B images, each its own source and slices and its own K rows (tested on ort); rk3588 and qnn, which
run batch 1, are refused in one line, as tiles are. generate and eval (`--grid`, default the bundle's) slice the
same and write the processor's prompt for a sliced image (slice_prompt): the source's rows in <image> ... </image>,
each slice's in <slice> ... </slice>, a newline between two rows of slices, every kept row and marker at its dense
place (ImagePrompt.between with the parts' own row counts, tile_rows).

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

import dataclasses
import json

import numpy as np
import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.export import export_onnx
from vlmprune.compiler.frontend.family import PATCH_TOKENS, DenseRequest, ImagePrompt
from vlmprune.compiler.frontend.images import crop_to_grid, parity_crops, parse_grid, read_rgb
from vlmprune.compiler.frontend.merged import (MergedTokensFamily, load_tower_and_connector, patch_matmul, patches,
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
SLICE_START, SLICE_END = "<slice>", "</slice>"  # ... and around each slice's rows (slice_start/end_token)
MAX_SLICE_NUMS = 9  # the processor's max_slice_nums where preprocessor_config.json does not say


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


def fold(h: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """[B, rows·cols, D] raster (cols: rows, a square grid) -> [B, (rows/2)·(cols/2), 4·D]: each 2x2 group's rows
    (row, column) side by side, raster order of the groups (transformers' window index and its merger's
    view/permute, spelled as one static reshape)."""
    cols = rows if cols is None else cols
    b, _, d = h.shape
    return h.reshape(b, rows // 2, 2, cols // 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(b, rows * cols // 4, 4 * d)


def window_merge(merger: nn.Module, h: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """MiniCPMV4_6ViTWindowAttentionMerger on [B, rows·cols, D]: attention within each 2x2 window (its layer_norm1
    and projections), the residual, then per window pre_norm(flat) -> linear_1 -> act -> linear_2 + the window's
    mean."""
    b, _, d = h.shape
    windows = fold(h, rows, cols).reshape(-1, 4, d)  # [B·W, 4, D]
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

    def __init__(self, tower: nn.Module, merger: nn.Module, grid: tuple[int, int], window: bool):
        super().__init__()
        self.tower, self.merger, self.grid, self.window = tower, merger, grid, window
        self.rest = list(tower.encoder.layers)[tower.config.insert_layer_id + 1:] if window else []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows, cols = self.grid
        if self.window:
            h = window_merge(self.tower.vit_merger, h, rows, cols)
            rows, cols = rows // 2, cols // 2
            for layer in self.rest:
                h, _ = run_block(block(layer), h)
        h = self.tower.post_layernorm(h)
        b = h.shape[0]
        for mlp in self.merger.mlp:
            h = mlp(fold(h, rows, cols)).reshape(b, -1, mlp.linear_2.out_features)
            rows, cols = rows // 2, cols // 2
        return h


def position_ids(grid: tuple[int, int], table_side: int) -> torch.Tensor:
    """[rows·cols] the position ids MiniCPMV4_6VisionEmbeddings gives a full rows x cols patch grid (transformers' own
    nearest bucketing, get_vision_nearest_position_ids, computed once)."""
    from transformers.vision_utils import get_vision_nearest_position_ids

    return get_vision_nearest_position_ids(torch.tensor([list(grid)]), table_side)


def tower_parts(model, grid: tuple[int, int], window: bool, packed: bool = False) -> TowerParts:
    """How VisionPipeline runs the blocks before the window merger (all of them without it; SigLIP's layout) on a
    rows x cols patch grid. packed: its input is the grid's flattened patches [B, N, 3·p·p], as the processor packs
    them (a sliced image), not a picture."""
    embeddings = model.embeddings
    ids = position_ids(grid, embeddings.num_patches_per_side)
    conv = embeddings.patch_embedding

    def embed(pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] (or packed patches) -> [B, N, D]; the patch Conv as one MatMul over the flattened patches."""
        x = pixel_values if packed else patches(pixel_values, conv.kernel_size[0])
        return patch_matmul(conv, x) + embeddings.position_embedding.weight[ids]

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


def dense_pipeline(tower: nn.Module, merger: nn.Module, window: bool, grid: tuple[int, int],
                   packed: bool = False) -> VisionPipeline:
    """The tower and merger on one rows x cols patch grid, as get_image_features runs one image (or one slice):
    VisionPipeline runs the blocks up to the window merger, AfterWindowMerge the rest as its projector."""
    vcfg = tower.config
    first = vcfg.insert_layer_id + 1 if window else vcfg.num_hidden_layers
    return VisionPipeline(tower_parts(tower, grid, window, packed), AfterWindowMerge(tower, merger, grid, window),
                          first, True, False, int(vcfg.patch_size)).eval()


def minicpm_v_source(spec: str, kind: str, config, tower: nn.Module, merger: nn.Module, content_hash: str | None,
                     image_size: int | None = None, mean=MINICPM_V_MEAN, std=MINICPM_V_STD,
                     slicing: dict | None = None) -> Source:
    """The Source of a loaded MiniCPM-V tower and merger at one static tile size (checkpoints and presets).

    slicing: what its processor slices by (preprocessor_config.json's max_slice_nums, slice_mode), for --grid."""
    vcfg = config.vision_config
    patch, merge = int(vcfg.patch_size), total_merge(config)
    table = int(vcfg.image_size) // patch * patch
    size = check_image_size(min(SCALE_RESOLUTION, table) if image_size is None else image_size, patch * merge, table)
    side = size // patch
    window = uses_window_merger(config)
    first = vcfg.insert_layer_id + 1 if window else vcfg.num_hidden_layers
    pipeline = dense_pipeline(tower, merger, window, (side, side))
    counts = token_counts(size, patch, merge)
    inside = f"window merger 2x2 after block {first} + " if window else ""
    details = {"model_type": "minicpmv4_6", "feature_layer": -1, "select_strategy": "full (no [CLS])",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": counts,
               "connector": f"{inside}merger 2x2 x{config.merger_times} (LayerNorm + MLP) into {merge}x{merge} groups",
               "input": f"one square tile per image at {size} px (unsliced; --grid ROWSxCOLS compiles the "
                        "processor's source image and slices of one image)",
               "slicing": {"max_slice_nums": MAX_SLICE_NUMS, "slice_mode": True,
                           "downsample_mode": "16x" if window else "4x", **(slicing or {})}}
    return Source(spec, kind, MiniCPMVAdapter.family, content_hash or sha256_state(pipeline), size, patch, False,
                  tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=merge, details=details)


# ---------------------------------------------------------------------------------------------- slicing (--grid)


@dataclasses.dataclass(frozen=True)
class Slices:
    """One sliced image as the processor cuts an image of the grid's shape (rows·S x cols·S, S the tile size, its
    scale_resolution): the source image (find_best_resize: the whole image at about S² pixels, its aspect kept) and
    the rows x cols slices (get_refine_size, divide_to_patches), each (height, width) in pixels. The manifest holds it
    (model.slices), so that `vlmprune run` cuts the same."""

    grid: tuple[int, int]
    source: tuple[int, int]
    slice: tuple[int, int]
    size: int  # S: the processor's scale_resolution
    patch: int
    merge: int  # patches along a side folded into one token (4, or 2 at "4x")
    max_slice_nums: int
    downsample_mode: str

    @property
    def count(self) -> int:
        return self.grid[0] * self.grid[1]

    def patch_grid(self, pixels: tuple[int, int]) -> tuple[int, int]:
        return pixels[0] // self.patch, pixels[1] // self.patch

    def tokens(self, pixels: tuple[int, int]) -> int:
        h, w = self.patch_grid(pixels)
        return (h // self.merge) * (w // self.merge)

    @property
    def tile_rows(self) -> tuple[int, ...]:
        """The rows of the source image, then of each slice: the LLM reads them in this order."""
        return (self.tokens(self.source),) + (self.tokens(self.slice),) * self.count

    @property
    def patches(self) -> int:
        (a, b), (c, d) = self.patch_grid(self.source), self.patch_grid(self.slice)
        return a * b + self.count * c * d

    @property
    def target_sizes(self) -> list[list[int]]:
        """The processor's target_sizes for one such image: each part's patch grid."""
        return [list(self.patch_grid(self.source))] + [list(self.patch_grid(self.slice))] * self.count

    def pixel_shape(self) -> tuple[int, int, int]:
        """One image's input: the processor's pixel_values, NaViT-packed patches [3, p, L·p]."""
        return 3, self.patch, self.patches * self.patch

    def processor(self, mean, std):
        """MiniCPM-V's image processor at these settings (the PIL backend: transformers' torch backend needs
        torchvision, and both cut alike)."""
        from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

        return MiniCPMV4_6ImageProcessorPil(scale_resolution=self.size, patch_size=self.patch,
                                            max_slice_nums=self.max_slice_nums, downsample_mode=self.downsample_mode,
                                            image_mean=list(mean), image_std=list(std))

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> Slices:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def slice_layout(grid: tuple[int, int], size: int, patch: int, merge: int, slicing: dict) -> Slices:
    """The processor's own cut of an image of the grid's shape (rows·S x cols·S), or one line where it would not cut
    that grid (slice_mode off, one slice, more than max_slice_nums, a grid its aspect search does not choose) or cuts
    parts whose patch grids its merges do not divide."""
    rows, cols = grid
    layout = Slices(grid, (0, 0), (0, 0), size, patch, merge, int(slicing["max_slice_nums"]),
                    slicing["downsample_mode"])
    processor = layout.processor((0.5,) * 3, (0.5,) * 3)
    shape = (rows * size, cols * size)
    what = (f"--grid {rows}x{cols}: MiniCPM-V's processor (scale_resolution {size}, max_slice_nums "
            f"{layout.max_slice_nums})")
    if not slicing.get("slice_mode", True):
        raise InputError(f"{what} has slice_mode off in its preprocessor_config.json: it never slices")
    cut = processor.get_sliced_grid(shape, layout.max_slice_nums, size)
    if cut is None:
        raise InputError(f"{what} does not slice an image of {shape[1]}x{shape[0]} (one slice's size): compile without "
                         "--grid for one unsliced tile")
    if list(cut) != [rows, cols]:
        raise InputError(f"{what} cuts an image of that grid's shape ({shape[1]}x{shape[0]}) into {cut[0]}x{cut[1]} "
                         f"slices, not {rows}x{cols}")
    source = processor.find_best_resize(shape, size, patch, layout.downsample_mode)
    refine = processor.get_refine_size(shape, [rows, cols], size, patch, layout.downsample_mode, allow_upscale=True)
    layout = dataclasses.replace(layout, source=tuple(source), slice=(refine[0] // rows, refine[1] // cols))
    unit = patch * merge
    if any(v % unit for v in layout.source + layout.slice):
        raise InputError(f"{what} cuts a {layout.source[1]}x{layout.source[0]} source and {layout.slice[1]}x"
                         f"{layout.slice[0]} slices, and this model merges {unit} px groups: they do not divide")
    return layout


def minicpm_slices(image: np.ndarray, layout: Slices, mean, std) -> np.ndarray:
    """uint8 HxWx3 -> [1, 3, p, L·p]: MiniCPM-V's processor's pixel_values for the bundle's grid (the source image's
    patches, then each slice's, raster order, NaViT-packed).

    The photo is first centre-cropped to the grid's aspect (images.crop_to_grid, its short side rounded down); the
    processor itself then cuts it. Where it would cut that photo otherwise (a photo smaller than the grid's shape
    slices less, an aspect a pixel off can round a part's size elsewhere), the crop is first resized (bicubic) to
    the grid's shape rows·S x cols·S, which it cuts as the bundle was compiled: a static graph takes one layout."""
    from PIL import Image

    rows, cols = layout.grid
    crop = Image.fromarray(np.ascontiguousarray(crop_to_grid(image, rows, cols, within=True)[..., :3]))
    processor = layout.processor(mean, std)
    for attempt in (crop, crop.resize((cols * layout.size, rows * layout.size), Image.BICUBIC)):
        out = processor(images=attempt, return_tensors="np")
        if list(out["grids"][0]) == [rows, cols] and out["target_sizes"].tolist() == layout.target_sizes:
            return out["pixel_values"].astype(np.float32)
    raise AssertionError(f"the processor cut {out['grids'][0]} slices of {out['target_sizes'].tolist()}, the bundle's "
                         f"layout is {layout.grid} of {layout.target_sizes}")


def describe_slices(width: int, height: int, depth: str, layout: Slices) -> str:
    rows, cols = layout.grid
    (sh, sw), (ph, pw) = layout.source, layout.slice
    return (f"{width}x{height} image{depth}: centre-cropped to the {rows}x{cols} grid's aspect ({cols}:{rows}), "
            f"MiniCPM-V's processor slices: the source image resized to {sw}x{sh}, then {rows}x{cols} slices of "
            f"{pw}x{ph} ({layout.count + 1} parts, {sum(layout.tile_rows)} tokens)")


class SlicedPipeline(VisionPipeline):
    """One sliced image, as get_image_features runs it: the processor's packed patches [B, 3, p, L·p] (per image: the
    source image's patches, then each slice's) -> [B, Ts + R·C·Tp, D'], the source's merged tokens then each slice's.

    The source and the slices have two patch grids, so the tower runs twice in one graph on the same weights: once on
    the source [B, Ns, ·], once on the slices as a batch [B·R·C, Np, ·], each with the position ids its grid gets (as
    transformers' packed forward, whose attention never crosses two parts). With a FEATURES pruner the image's rows
    are one set: K one budget over the source and the slices."""

    def __init__(self, source_part: VisionPipeline, slice_part: VisionPipeline, layout: Slices, pruner=None):
        super().__init__(source_part.tower, source_part.projector, source_part.num_blocks, True, False,
                         source_part.patch_size, pruner=pruner)
        self.source_part, self.slice_part, self.layout = source_part, slice_part, layout
        # the layout as plain settings: the product cache keys an export on them (cache.export_parts)
        self.grid, self.source_pixels, self.slice_pixels = layout.grid, layout.source, layout.slice

    def with_pruner(self, pruner) -> SlicedPipeline:
        return SlicedPipeline(self.source_part, self.slice_part, self.layout, pruner)

    def forward(self, pixel_values: torch.Tensor):
        layout, p = self.layout, self.patch_size
        b = pixel_values.shape[0]
        flat = pixel_values.reshape(b, 3, p, layout.patches, p).permute(0, 3, 1, 2, 4).reshape(b, layout.patches, -1)
        sh, sw = layout.patch_grid(layout.source)
        parts = self.slice_part(flat[:, sh * sw:].reshape(b * layout.count, -1, flat.shape[-1]))
        h = torch.cat([self.source_part(flat[:, : sh * sw]), parts.reshape(b, -1, parts.shape[-1])], dim=1)
        if self.pruner is None:
            return h
        return self.prune_features(h, pixel_values)


def slice_source(source: Source, grid: tuple[int, int]) -> None:
    """Fix the source to one sliced image (--grid): its input is then the processor's pixel_values of an image of
    the grid's shape, its rows the source image's merged tokens then each slice's (SlicedPipeline)."""
    pipe = source.pipeline
    layout = slice_layout(grid, source.image_size, source.patch_size, source.spatial_merge, source.details["slicing"])
    tower, merger, window = pipe.vision_model, pipe.projector.merger, pipe.projector.window
    source.pipeline = SlicedPipeline(dense_pipeline(tower, merger, window, layout.patch_grid(layout.source), True),
                                     dense_pipeline(tower, merger, window, layout.patch_grid(layout.slice), True),
                                     layout).eval()
    rows = layout.tile_rows
    source.tokens_per_frame = sum(rows)  # one image's rows: not its square tile's grid
    (sh, sw), (ph, pw) = layout.source, layout.slice
    source.details.update(
        grid=f"{grid[0]}x{grid[1]}", slices=layout.to_json(), resolution=[grid[0] * layout.size, grid[1] * layout.size],
        input=(f"MiniCPM-V's processor's pixel_values of one image of the {grid[0]}x{grid[1]} grid's shape: the source "
               f"image at {sw}x{sh} px, then {layout.count} slices of {pw}x{ph} px, NaViT-packed "
               f"[3, {layout.patch}, {layout.patches * layout.patch}]"))
    source.details["token_counts"] = {**source.details["token_counts"], "slices": layout.count,
                                      "source_tokens": rows[0], "slice_tokens": rows[1], "image_tokens": sum(rows)}


class MiniCPMVAdapter(ModelAdapter):
    family = "minicpm_v"
    model_types = MODEL_TYPES
    summary = "MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration): SigLIP tower with a window merger + 2x2 merger"
    dynamic_resolution = True  # one static --image-size per compile (one square tile, or --grid's slices)

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
                                sha256_files(checkpoint.files()), image_size, mean, std, slicing(checkpoint))


def slicing(checkpoint: Checkpoint) -> dict:
    """What the checkpoint's processor slices by (preprocessor_config.json's max_slice_nums and slice_mode, where it
    says them), for --grid."""
    pre = checkpoint.path / "preprocessor_config.json"
    if not pre.is_file():
        return {}
    try:
        prep = json.loads(pre.read_text())
        return {k: type(d)(prep[k]) for k, d in (("max_slice_nums", MAX_SLICE_NUMS), ("slice_mode", True)) if k in prep}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise InputError(f"{pre}: no readable max_slice_nums / slice_mode ({exc})") from None


def sliced(source) -> Slices | None:
    """The source's slicing (--grid), or None: one unsliced tile per image."""
    data = getattr(source, "details", {}).get("slices")
    return None if data is None else Slices.from_json(data)


def slice_prompt(tokenizer, layout: Slices) -> ImagePrompt:
    """What MiniCPM-V's processor writes around and between the rows of one sliced image (replace_image_token, its
    image id first), the marks as its tokenizer names them: the source image's rows in <image> ... </image>, then each
    slice's in <slice> ... </slice>, a newline between two rows of slices."""
    unsliced = MiniCPMVFamily().image_prompt(tokenizer)
    end = getattr(tokenizer, "image_end_token", None) or IMAGE_END
    start_slice = getattr(tokenizer, "slice_start_token", None) or SLICE_START
    end_slice = getattr(tokenizer, "slice_end_token", None) or SLICE_END
    cols = layout.grid[1]
    between = [end + start_slice] + [end_slice + ("\n" if k % cols == 0 else "") + start_slice
                                     for k in range(1, layout.count)]
    return ImagePrompt(unsliced.before, end_slice, between=tuple(between), tile_rows=layout.tile_rows)


class MiniCPMVFamily(MergedTokensFamily):
    """A [CLS]-free SigLIP tower with a window merger inside, then a 2x2 merger: pruned after the connector."""

    id = "minicpm_v"
    adapter = MiniCPMVAdapter
    options = {"image_size": (int, "Static tile size S for minicpm_v: a multiple of patch x its merges (56 for "
                                   "MiniCPM-V 4.6) up to the tower's 980. Default its processor's 448."),
               "grid": (str, "Sliced models (minicpm_v): compile its processor's slicing of one image of ROWSxCOLS "
                             "tiles' shape (ROWS*S x COLS*S): the source image and the ROWS*COLS slices, one budget "
                             "over them (input: the processor's pixel_values). Default: one unsliced tile.")}
    has = {PATCH_TOKENS: "MiniCPM-V"}
    language_model = {"minicpmv4_6": "MiniCPMV4_6ForConditionalGeneration"}
    why_not_block = ("MiniCPM-V's window merger and connector each fold 2x2 groups of the full patch grid into one "
                     "token, so pruning single patches inside the tower breaks the groups")
    why_not_scored = ("scores by a [CLS], a pooling head or the tower's attention, and MiniCPM-V's tower has no [CLS] "
                      "nor head and attends over single patches or windows, not the merged tokens")

    # ------------------------------------------------------------------ slicing (--grid)

    def check_options(self, given: dict) -> None:
        if given.get("grid") is not None:
            parse_grid(given["grid"])

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        if options.get("grid") is not None:
            slice_source(source, parse_grid(options["grid"]))
        super().fix(source, options, prune=prune, batch=batch, cls=cls)

    def check_target(self, source: Source, target: str, check_batch) -> None:
        """The slices run as a batch of R·C inside the graph: a target that runs batch 1 only is refused before the
        export, in one line (as tiles are)."""
        layout = sliced(source)
        if layout is None:
            return super().check_target(source, target, check_batch)
        try:
            check_batch(layout.count)
        except InputError as exc:
            raise InputError(f"target {target} cannot run --grid slices: the graph runs the tower on the "
                             f"{layout.count} slices of one image as a batch of {layout.count}, and "
                             f"{str(exc).split(': ')[0]}") from None

    def dense_model(self, source: Source, request: DenseRequest):
        """A sliced source's input is the processor's packed patches of one image [B, 3, p, L·p], static batch."""
        layout = sliced(source)
        if layout is None:
            return super().dense_model(source, request)
        batch = request.batch or 1
        request.step(f"export (torch.onnx dynamo, opset {request.opset}, batch {batch})")
        return export_onnx(source.pipeline, source.image_size, batch, request.opset, layout.pixel_shape())

    def parity_pixels(self, source: Source, images: int) -> tuple[np.ndarray, dict]:
        """A sliced source: each parity photo as the processor slices it for the bundle's grid, one photo a batch
        item (the tiles' photos and their fallback without scikit-image: images.parity_crops)."""
        layout = sliced(source)
        if layout is None:
            return super().parity_pixels(source, images)
        rows, cols = layout.grid
        shape = {"resolution": [rows * layout.size, cols * layout.size], "count": layout.count, "grid": [rows, cols]}
        pixel, meta = parity_crops(max(2, images), shape, source.image_size, source.mean, source.std,
                                   cut=lambda raw, _shape, _size, mean, std: minicpm_slices(raw, layout, mean, std))
        meta.pop("crops")
        return pixel, {**meta, "slices": layout.count}

    def cannot_draw(self, manifest: Manifest) -> str | None:
        return "a sliced bundle (a source image and its slices per image)" if manifest.model.get("slices") else None

    def slice_image(self, path: str, layout: Slices, mean, std) -> tuple[np.ndarray, str]:
        rgb, depth = read_rgb(path)
        return minicpm_slices(rgb, layout, mean, std), describe_slices(rgb.shape[1], rgb.shape[0], depth, layout)

    def load_images(self, manifest: Manifest, image_files, static) -> tuple[np.ndarray, list[str]]:
        """A sliced bundle: each image as the processor slices it for the bundle's grid."""
        data = manifest.model.get("slices")
        if not data:
            return super().load_images(manifest, image_files, static)
        if isinstance(static, int) and static != len(image_files):
            raise InputError(f"this bundle has a static batch of {static}: pass --image {static} times "
                             f"(got {len(image_files)}), or recompile with --batch {len(image_files)}")
        layout, pre, batch, notes = Slices.from_json(data), manifest.preprocess, [], []
        for image in image_files:
            try:
                pixel, described = self.slice_image(image, layout, pre.mean, pre.std)
            except Exception as exc:
                raise InputError(f"{image}: cannot read the image ({exc})") from None
            batch.append(pixel)
            notes.append(f"{image}: {described}")
        return np.concatenate(batch), notes

    def llm_source(self, checkpoint, options: dict) -> Source:
        source = super().llm_source(checkpoint, options)
        if options.get("grid") is not None:
            slice_source(source, parse_grid(options["grid"]))
        return source

    def llm_pixels(self, source: Source, image: str, preprocess: dict | None) -> tuple[np.ndarray, str]:
        layout = sliced(source)
        if layout is None:
            return super().llm_pixels(source, image, preprocess)
        return self.slice_image(image, layout, source.mean, source.std)

    def source_image_prompt(self, tokenizer, source: Source) -> ImagePrompt:
        """With --grid, the processor's prompt for a sliced image (slice_prompt); else one unsliced image's."""
        layout = sliced(source)
        return self.image_prompt(tokenizer) if layout is None else slice_prompt(tokenizer, layout)

    def hf_image_features(self, out):
        """One image's rows: get_image_features gives a list of its parts' rows (the source image, then the slices):
        end to end."""
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output])

    # ------------------------------------------------------------------ the model's own forward

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """MiniCPM-V's forward takes NaViT-packed patches [1, 3, p, B·N·p] (each image's patches in raster order, its
        processor's reshape_by_patch) and each image's patch grid; a sliced image's parts (the processor's own
        pixel_values per image) end to end, each part's patch grid."""
        layout = sliced(source)
        x = torch.from_numpy(pixel)
        b, c = x.shape[:2]
        if layout is not None:
            packed = x.permute(1, 2, 0, 3).reshape(1, c, x.shape[2], -1)
            return {"pixel_values": packed, "target_sizes": torch.tensor(layout.target_sizes * b, dtype=torch.int32)}
        p, side = source.patch_size, source.image_size // source.patch_size
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
        head = ("\n## MiniCPM-V tokens\n\n"
                f"`image_features` rows are tokens of merged grids (each a {s}x{s} group of patches: the tower's window "
                "merger, then the merger), raster order")
        data = manifest.model.get("slices")
        if not data:
            return (head + f"; kept_indices index the {m[0]}x{m[1]} grid of the {p[0]}x{p[1]} patches. One square tile "
                    f"per image at {counts['image_size']} px, as MiniCPM-V's processor feeds an image unsliced; the "
                    f"prompt wraps the rows in `{ID_START}0{ID_END}{IMAGE_START}` ... `{IMAGE_END}`.\n")
        layout = Slices.from_json(data)
        (rows, cols), (sh, sw), (ph, pw) = layout.grid, layout.source, layout.slice
        ts, tp = layout.tile_rows[:2]
        return (head + f". Input: per image, MiniCPM-V's processor's pixel_values for an image of the {rows}x{cols} "
                f"grid's shape ({cols * layout.size}x{rows * layout.size}): the source image resized to {sw}x{sh} "
                f"({ts} tokens), then {layout.count} slices of {pw}x{ph} ({tp} tokens each), NaViT-packed; `vlmprune "
                "run` centre-crops a photo to the grid's aspect first. kept_indices index the image's "
                f"{sum(layout.tile_rows)} rows end to end (the source's, then slice by slice, raster order); K is one "
                f"budget over them. The prompt is the processor's: `{ID_START}0{ID_END}{IMAGE_START}` + the source's "
                f"rows + `{IMAGE_END}`, then each slice's rows in `{SLICE_START}` ... `{SLICE_END}`, a newline between "
                "two rows of slices; a kept row's position is offset + kept_indices + the marker tokens before its "
                "part.\n")
