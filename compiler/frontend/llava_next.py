"""Family `llava_next`: LLaVA-NeXT (LLaVA-1.6, LlavaNextForConditionalGeneration) with anyres crops.

LLaVA-NeXT sees one image as crops of the tower's own size S (336 for LLaVA-1.6): the base
image (the whole picture resized to S x S) followed by the tiles of one grid chosen from the
checkpoint's `image_grid_pinpoints` (2 x 2 tiles at 672 x 672: 5 x 576 = 2880 patch tokens).
Choices, and why:

- Input: `pixel_values` [C, 3, S, S], static, C = 1 + rows * cols, for one grid fixed at
  compile time (`--grid RxC`, rows x cols; default the pinpoint of largest area, ties to the
  first listed): an edge runtime allocates once. It is what LlavaNextImageProcessor gives for
  an image of that grid's resolution (compiler.frontend.images.anyres_crops). One bundle call
  is one image; a batch of images is several calls.
- Dense output (`--no-prune`): exactly transformers' `get_image_features` (whose pooler_output
  is `pack_image_features`' result) for that grid and an image of the grid's resolution
  (rows·S x cols·S): no unpadding happens, so the packed sequence is static: the base crop's
  N tokens, then the grid's rows of patch tokens, each row followed by `image_newline`:
  [1, N + rows·s · (cols·s + 1), D] with s = S / patch. Tested against the HF model in fp32.
- Pruned: every crop runs the tower as a batch; pruning happens at the tower's end (after
  the feature layer), on each crop's tokens, under one global budget K split across the
  crops (passes.methods.crops); the output is the K kept tokens (+ the method's summary) and
  their (crop, row, col). Packing (reordering, image_newline) is the LLM runtime's, by the
  rule in the bundle README, because which rows still hold tokens is known only at run time.
- Methods: cls (budget split `proportional` to each crop's saliency mass by default, or
  `--crop-budget equal`), divprune and dart (equal split only: they have no score to split
  by); visionzip is refused. Outputs: `image_features`, `kept_indices` (c·N + i) and
  `kept_positions` (crop, row, col) from this family's position table (positions "cyx").
- Targets: ort, orin and xavier. rk3588 and qnn run batch 1 only, and the crops are the
  graph's batch: refused before the export, in one line (LlavaNextFamily.check_target).
- The select strategy must be `default`: pack_image_features lays each crop out as an s x s
  grid, which a [CLS] token in the features (`full`, or --cls keep) breaks; both are refused.

LLaVA-NeXT-Video (LlavaNextVideoForConditionalGeneration, model_type llava_next_video) is this
family: its images are LLaVA-NeXT's anyres crops, and `--video-frames F` compiles its video path
(set_video): the F frames of one clip are the tower's batch, each a still image through the
CLIP/SigLIP tower to the feature layer, [CLS] dropped, then the checkpoint's vision_resampler
(HF's LlavaNextVideoPooler: a 2x2 average pool of each frame's patch grid by default) and the
projector, the frames laid end to end: [1, F·M, D], exactly HF's get_video_features (tested).
The LLM takes those rows as they come (no image_newline for video), so a video bundle's
positions are the plain `indices` rule (VideoPositions).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from vlmprune.compiler.contract import CROP_BUDGETS, CROP_EQUAL, CROP_PROPORTIONAL, Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import tower_parts
from vlmprune.compiler.frontend.family import (BLOCK, CROPS, FRAME_TOWER, PATCH_TOKENS, VIDEO, Family,
                                               IndicesPositions)
from vlmprune.compiler.frontend.images import anyres_crops, load_image_crops, parity_crops, parse_grid, read_rgb
from vlmprune.compiler.frontend.llava import check_tower, load_vision, tower_normalization, tower_state
from vlmprune.compiler.frontend.merged import token_counts
from vlmprune.compiler.frontend.source import (Source, check_floating, feature_blocks, feature_layer_of, load_state,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.tower import VisionPipeline
from vlmprune.compiler.frontend.video import ClipInput


# --crop-budget: how K is split over the crops (passes.methods.crops); the names live in the contract
PROPORTIONAL, EQUAL, BUDGETS = CROP_PROPORTIONAL, CROP_EQUAL, CROP_BUDGETS


class AnyresPipeline(VisionPipeline):
    """VisionPipeline over the crops of images: [n·C, 3, S, S] -> [n, tokens, D].

    pack: the dense output is HF's packed sequence (base tokens, grid rows with
    image_newline); False gives each crop's features [n·C, N, D], the form the pruning
    passes read (a pruned bundle's dense stage). A pruner (passes.methods.crops) merges the
    crops of each image itself.
    """

    def __init__(self, *args, image_newline: torch.Tensor, grid: tuple[int, int], pack: bool = True,
                 video_pooler: nn.Module | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_newline = image_newline
        self.grid = grid
        self.pack = pack
        self.video_pooler = video_pooler  # LLaVA-NeXT-Video's vision_resampler (set_video); None for LLaVA-NeXT

    @property
    def crops(self) -> int:
        return 1 + self.grid[0] * self.grid[1]

    def with_pruner(self, pruner) -> AnyresPipeline:
        return AnyresPipeline(self.tower, self.projector, self.num_blocks, self.drop_cls, self.has_cls,
                              self.patch_size, self.prefix, self.final_norm, pruner, image_newline=self.image_newline,
                              grid=self.grid, pack=self.pack, video_pooler=self.video_pooler)

    def forward(self, pixel_values: torch.Tensor):
        out = super().forward(pixel_values)
        if self.pruner is not None or not self.pack:
            return out
        return pack_features(out, self.grid, self.image_newline)


def pack_features(features: torch.Tensor, grid: tuple[int, int], newline: torch.Tensor) -> torch.Tensor:
    """HF's pack_image_features for images that fill the grid (no unpadding): [n·C, s², D] -> [n, T, D]."""
    rows, cols = grid
    crops = 1 + rows * cols
    nc, n_tok, d = features.shape
    side = int(round(n_tok ** 0.5))
    x = features.reshape(nc // crops, crops, n_tok, d)
    base, tiles = x[:, 0], x[:, 1:]
    tiles = tiles.reshape(-1, rows, cols, side, side, d).permute(0, 1, 3, 2, 4, 5)
    tiles = tiles.reshape(-1, rows * side, cols * side, d)
    nl = newline.to(tiles.dtype).reshape(1, 1, 1, d).expand(tiles.shape[0], rows * side, 1, d)
    tiles = torch.cat([tiles, nl], dim=2).reshape(tiles.shape[0], -1, d)
    return torch.cat([base, tiles], dim=1)


def grids_of(config) -> list[tuple[int, int]]:
    """The checkpoint's pinpoints (height, width) as grids of tiles (rows, cols)."""
    size = config.vision_config.image_size
    grids = []
    for h, w in config.image_grid_pinpoints:
        if h % size or w % size:
            raise InputError(f"image_grid_pinpoint {[h, w]} is not a multiple of the tower's image size {size}")
        grids.append((h // size, w // size))
    return grids


def choose_grid(config, grid: str | None) -> tuple[int, int]:
    grids = grids_of(config)
    if grid is None:  # the largest resolution the model was trained for (LLaVA-1.6: 2x2 at 672x672)
        return max(grids, key=lambda g: (g[0] * g[1], -grids.index(g)))
    chosen = parse_grid(grid)
    if chosen not in grids:
        raise InputError(f"--grid {grid}: this model's grids are {', '.join(f'{r}x{c}' for r, c in grids)} "
                         "(image_grid_pinpoints / image size)")
    return chosen


class VideoProjector(nn.Module):
    """LLaVA-NeXT-Video's path after the feature select, as get_video_features runs it: the resampler (HF's own
    LlavaNextVideoPooler over each frame's patch grid), the projector, then each clip's F frames end to end
    [n, F·M, D]. Being the pipeline's projector, a FEATURES-site method (evs) sees the clip's rows frame by frame."""

    def __init__(self, pooler: nn.Module, projector: nn.Module, frames: int):
        super().__init__()
        self.pooler, self.projector, self.frames = pooler, projector, frames

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.projector(self.pooler(x))
        return x.reshape(-1, self.frames * x.shape[1], x.shape[2])


def video_pooler(checkpoint: Checkpoint) -> nn.Module:
    """The checkpoint's vision_resampler as transformers builds it (average, max or a strided conv), its weights
    (the conv's) loaded."""
    from transformers.models.llava_next_video.modeling_llava_next_video import LlavaNextVideoPooler

    pooler = LlavaNextVideoPooler(checkpoint.config)
    state = read_safetensors(checkpoint.weights, ("model.vision_resampler.", "vision_resampler."))
    if state or checkpoint.config.spatial_pool_mode == "conv":
        load_state(pooler, state, "vision_resampler")
    return pooler.eval()


class LlavaNextAdapter(ModelAdapter):
    family = "llava_next"
    model_types = ("llava_next", "llava_next_video")
    summary = ("LLaVA-NeXT (LlavaNextForConditionalGeneration): anyres crops of one grid, CLIP/SigLIP tower + "
               "projector; LLaVA-NeXT-Video's clips with --video-frames")

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        vcfg = config.vision_config
        check_tower(vcfg, "LLaVA-NeXT")
        strategy = config.vision_feature_select_strategy
        if strategy != "default":
            raise InputError(f"vision_feature_select_strategy {strategy!r} is not supported for LLaVA-NeXT: its "
                             "crops are packed as patch grids, which needs `default` ([CLS] dropped)")
        fl = feature_layer_of(config, feature_layer)
        tower, projector = load_vision(checkpoint, tower_state(checkpoint))
        tensors = read_safetensors(checkpoint.weights, ("model.image_newline", "image_newline"))
        newline = tensors.get("")
        if newline is not None:
            check_floating(tensors, "", "image_newline")
        d_text = config.text_config.hidden_size
        if newline is None or tuple(newline.shape) != (d_text,):
            raise InputError(f"{checkpoint.path}: no image_newline [{d_text}] in the checkpoint "
                             "(LLaVA-NeXT's row separator)")
        grid = choose_grid(config, None)
        has_cls = vcfg.model_type == "clip_vision_model"
        video = checkpoint.model_type == "llava_next_video"
        pipeline = AnyresPipeline(tower_parts(tower), projector, feature_blocks(fl, vcfg.num_hidden_layers),
                                  True, has_cls, vcfg.patch_size, image_newline=newline.float(), grid=grid,
                                  video_pooler=video_pooler(checkpoint) if video else None).eval()
        mean, std = tower_normalization(checkpoint)
        source = Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                        vcfg.image_size, vcfg.patch_size, has_cls, mean, std, pipeline=pipeline, positions="cyx",
                        details={"model_type": checkpoint.model_type, "feature_layer": fl, "select_strategy": strategy,
                                 "vision_layers": vcfg.num_hidden_layers, "projector": True,
                                 "grids": [f"{r}x{c}" for r, c in grids_of(config)]})
        set_grid(source, grid)
        source.regrid = lambda text: set_grid(source, choose_grid(config, text))
        return source


def set_video(source: Source, frames: int) -> None:
    """Make a LLaVA-NeXT-Video source a video one (--video-frames F): its input one clip's frames [F, 3, S, S] as the
    tower's batch, its features get_video_features' [1, F·M, D] (M = (s // stride)² pooled tokens per frame).

    The crops are gone (a frame is one still image at the tower's size, as LlavaNextVideoImageProcessor resizes
    it); the pool stride is the source's spatial_merge, so that the site's tokens count the pooled rows the LLM sees.
    """
    anyres = source.pipeline
    pooler, config = anyres.video_pooler, source.details
    stride = pooler.pool.stride if isinstance(pooler.pool.stride, int) else pooler.pool.stride[0]
    side = source.image_size // source.patch_size
    per_frame = (side // stride) ** 2
    source.pipeline = VisionPipeline(anyres.tower, VideoProjector(pooler, anyres.projector, frames),
                                     anyres.num_blocks, True, anyres.has_cls, anyres.patch_size, frames=frames).eval()
    source.crops, source.regrid, source.positions, source.position_table = None, None, "indices", None
    source.spatial_merge, source.frames = stride, frames
    for key in ("grid", "crops", "resolution"):
        config.pop(key, None)
    config["video_frames"] = frames
    pooled = side // stride
    # The keys every merging tower's token_counts has (one frame's patch grid, the pool as its merge), then the clip's;
    # merged_grid_thw as Qwen's video records it (here t = frames): what `run --show` draws a clip's frames by
    config["token_counts"] = {**token_counts(source.image_size, source.patch_size, stride),
                              "video_frames": frames, "tokens_per_frame": per_frame, "tokens": frames * per_frame,
                              "merged_grid_thw": [frames, pooled, pooled], "pool": [type(pooler.pool).__name__, stride]}
    config["input"] = (f"one clip per call: pixel_values [{frames}, 3, S, S], its frames in order, each "
                       f"preprocessed as a still image; features [1, F·M, D] frame by frame, M = {per_frame}")


def packed_length(grid: tuple[int, int], side: int) -> int:
    """The length of transformers' packed sequence of one image at the grid's resolution (pack_image_features):
    side² base tokens, then the rows·side grid rows of cols·side tokens, each followed by image_newline."""
    rows, cols = grid
    return side * side + rows * side * (cols * side + 1)


def set_grid(source: Source, grid: tuple[int, int]) -> None:
    """Fix the source to one grid: its input is then [1 + rows·cols, 3, S, S]."""
    source.pipeline.grid = grid
    rows, cols = grid
    side = source.image_size // source.patch_size
    source.crops = {"grid": [rows, cols], "count": 1 + rows * cols, "side": side,
                    "resolution": [rows * source.image_size, cols * source.image_size]}
    source.details["grid"] = f"{rows}x{cols}"
    source.details["crops"] = 1 + rows * cols
    source.details["resolution"] = [rows * source.image_size, cols * source.image_size]
    # kept_positions (passes.positions): flat index c·N + i of a kept token -> (crop c, row, col) in its crop.
    flat = np.arange((1 + rows * cols) * side * side)
    within = flat % (side * side)
    source.position_table = np.stack([flat // (side * side), within // side, within % side], axis=1).astype(np.int64)


def assemble_llm_input(tokens: torch.Tensor, positions: torch.Tensor, newline: torch.Tensor, grid: tuple[int, int],
                       side: int, original_size: tuple[int, int] | None = None) -> torch.Tensor:
    """The bundle README's assembly rule, for one image: kept tokens [K, D] + (crop, row, col) [K, 3] -> [T, D].

    Base tokens (crop 0) in the order given, then the grid tokens by (row Y, column X) of the
    rows·s x cols·s token grid, those in padding dropped (transformers' unpad_image, by the
    original (height, width)), and image_newline after every grid row holding a kept token.
    With every token kept this is pack_image_features (tested); rows after K (a summary
    token) are the caller's to append.
    """
    rows, cols = grid
    height, width = rows * side, cols * side
    crop, r, x = positions[:, 0], positions[:, 1], positions[:, 2]
    base = crop == 0
    y = (crop - 1).clamp_min(0) // cols * side + r
    xg = (crop - 1).clamp_min(0) % cols * side + x
    keep = ~base
    if original_size is not None:
        h, w = original_size
        if w / h > width / height:
            pad = (height - int(round(h * (width / w), 7))) // 2
            keep &= (y >= pad) & (y < height - pad)
        else:
            pad = (width - int(round(w * (height / h), 7))) // 2
            keep &= (xg >= pad) & (xg < width - pad)
    order = torch.argsort(y[keep] * width + xg[keep], stable=True)
    grid_tokens, grid_rows = tokens[keep][order], y[keep][order]
    out = [tokens[base]]
    for row in torch.unique_consecutive(grid_rows).tolist():
        out += [grid_tokens[grid_rows == row], newline.to(tokens.dtype).reshape(1, -1)]
    return torch.cat(out)


def anyres_positions(offset: int, kept_positions: np.ndarray, grid: tuple[int, int], side: int, extra: int = 0,
                     ) -> tuple[np.ndarray, int]:
    """Anyres crops: (1-D position of every row of the assembled sequence, the text position after it).

    The assembled sequence is assemble_llm_input's (image at the grid's resolution, nothing
    unpadded): the base tokens (crop 0) in the order given, the grid tokens by (row Y, column X),
    image_newline after each grid row that keeps a token; then `extra` rows. Each row sits where
    it sits in the dense packed sequence (pack_image_features): base token (r, x) at r * side + x,
    grid token (Y, X) at N + Y * (W + 1) + X and row Y's newline at N + Y * (W + 1) + W
    (N = side², W = cols * side); extra row e at dense + e, the text at dense + extra, all from
    offset. With every token kept: offset, offset + 1, ...
    """
    rows, cols = grid
    n, width = side * side, cols * side
    kept_positions = np.asarray(kept_positions, dtype=np.int64).reshape(-1, 3)
    crop, r, x = kept_positions.T
    base = crop == 0
    tile = np.maximum(crop - 1, 0)
    y, xg = (tile // cols * side + r)[~base], (tile % cols * side + x)[~base]
    grid_positions = np.sort(n + y * (width + 1) + xg, kind="stable")  # by (Y, X), as the assembly orders them
    grid_rows = (grid_positions - n) // (width + 1)
    out = [r[base] * side + x[base]]
    for row in np.unique(grid_rows):
        out += [grid_positions[grid_rows == row], np.array([n + row * (width + 1) + width])]
    dense = packed_length(grid, side)
    out.append(dense + np.arange(extra))
    return (offset + np.concatenate(out)).astype(np.int64), offset + dense + extra


class CyxPositions(IndicesPositions):
    """Anyres crops: the kept rows assembled over the crops (assemble_llm_input), each at its position in the dense
    packed sequence of one image at the grid's resolution (anyres_positions)."""

    kind = "cyx"
    meaning = "kept_positions[b, j] is the (crop, row, col) of row prefix + j (crop 0: the base image, then the tiles)"
    rule = ("assemble the sequence as the anyres section of the bundle README says (base tokens, then the "
            "tiles' tokens by global row and column with image_newline after each row that keeps one); each "
            "assembled row (newlines included) at offset + its position in the dense packed sequence (base "
            "r * s + x; grid N + Y * (cols * s + 1) + X; row Y's newline N + Y * (cols * s + 1) + cols * s); "
            "extra row e at offset + dense_image_tokens + e; text from offset + dense_image_tokens + extra")
    needs_model = True
    repeats_batch = False  # the batch is one image's crops

    def dense_image_tokens(self, model: dict, dense: int | None) -> int | None:
        """HF's pack_image_features of one image at the grid's resolution: the base crop's N, then the tiles'
        (rows·side) x (cols·side) grid with one image_newline per row (no unpadding at that size)."""
        if not model.get("grid"):
            return dense
        size, patch = model.get("image_size"), model.get("patch_size")
        return packed_length(parse_grid(model["grid"]), size // patch) if size and patch else None

    def readme_places(self, rows: dict, dense, after) -> str:
        return ("- the rows are assembled as the anyres section below says; each assembled row (image_newline "
                f"included) takes offset + its position in the dense packed sequence of {dense} rows\n"
                f"- merged row e: offset + {dense} + e\n- the text after the image: from offset + {after}")

    def place_pruned(self, source: Source, features, kept, kept_positions, prefix: int, extra: int):
        if source.crops is None:  # a LLaVA-NeXT-Video clip: its rows as they come (LlavaNextFamily.positions_of)
            return super().place_pruned(source, features, kept, kept_positions, prefix, extra)
        table = self.kept_table(source, kept, kept_positions, prefix)
        grid, side, k = tuple(source.crops["grid"]), source.crops["side"], len(kept)
        newline = source.pipeline.image_newline
        rows = torch.cat([assemble_llm_input(features[:k], torch.from_numpy(table), newline, grid, side),
                          features[k:]])
        place = lambda offset: anyres_positions(offset, table, grid, side, extra)  # noqa: E731
        if len(place(0)[0]) != len(rows):
            raise ValueError(f"the assembly gives {len(rows)} rows, the positions rule {len(place(0)[0])}")
        return rows, place


class LlavaNextFamily(ClipInput, Family):
    """Anyres crops: the input is the C crops of one image at one grid fixed at compile time (--grid); LLaVA-NeXT-Video's
    clips of F frames with --video-frames (ClipInput: the frames are the graph's batch)."""

    id = "llava_next"
    adapter = LlavaNextAdapter
    options = {
        "grid": (str, "Anyres models (llava_next): the crops' grid ROWSxCOLS, one of the model's image_grid_pinpoints "
                      "(input [1 + ROWS*COLS, 3, S, S]). Default: the largest (LLaVA-1.6: 2x2 at 672x672)."),
        "crop_budget": (str, "Anyres models: split --keep over the crops `proportional` to each crop's saliency mass "
                             "(the default for cls) or `equal` (the default, and only split, for divprune and dart)."),
        "video_frames": (int, "Video (llava_next_video): compile for clips of F frames (static, at least 2): the input "
                              "is one clip's frames [F, 3, S, S], each through the tower, pooled and projected as "
                              "get_video_features does; the features [1, F·M, D] frame by frame"),
    }
    has = {PATCH_TOKENS: "LLaVA-NeXT", CROPS: "LLaVA-NeXT", VIDEO: "LLaVA-NeXT-Video", FRAME_TOWER: "LLaVA-NeXT-Video"}
    positions = CyxPositions()
    language_model = {"llava_next": "LlavaNextForConditionalGeneration",
                      "llava_next_video": "LlavaNextVideoForConditionalGeneration"}

    def positions_of(self, model: dict) -> IndicesPositions:
        """A video bundle's rows go to the LLM as they come (get_video_features adds no image_newline): indices."""
        return IndicesPositions() if (model.get("token_counts") or {}).get("video_frames") else self.positions

    def check_options(self, given: dict) -> None:
        self.check_frames(given)
        budget = given.get("crop_budget")
        if budget is not None and budget not in BUDGETS:
            raise InputError(f"--crop-budget is {' or '.join(BUDGETS)}, got {budget!r}")
        if given.get("grid") is not None:
            parse_grid(given["grid"])

    def refuse_elsewhere(self, name: str, source: Source) -> str:
        what = source.details.get("model_type", source.family)  # qwen2_5_vl, not its family's qwen2_vl
        return f"--{name.replace('_', '-')} applies to anyres models (llava_next), not to this {what} model"

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        """The grid to compile for, and whether the export packs the crops.

        A pruned bundle prunes each crop's features, so its export stops before HF's packing
        (which the LLM runtime does on the kept tokens); a dense one packs like HF.
        """
        frames = options.get("video_frames")
        if frames is not None:
            self.fix_video(source, options, frames, prune=prune, batch=batch, cls=cls)
            return
        if options.get("grid") is not None:
            source.regrid(options["grid"])
        count = source.crops["count"]
        if cls == "keep":
            raise InputError("--cls keep is not available for anyres crops: each crop is packed as a patch grid, "
                             "without [CLS]")
        if batch is not None:
            raise InputError(f"--batch does not apply to anyres models: the input is the {count} crops of one image "
                             f"[{count}, 3, {source.image_size}, {source.image_size}]; run one image per call")
        if not prune and options.get("crop_budget") is not None:
            raise InputError("--no-prune takes no --crop-budget")
        source.pipeline.pack = not prune
        super().fix(source, options, prune=prune, batch=batch, cls=cls)

    def fix_video(self, source: Source, options: dict, frames: int, *, prune: bool, batch: int | None,
                  cls: str | None) -> None:
        """--video-frames F: LLaVA-NeXT-Video only, one clip per call, no crops; [CLS] dropped as the pooler needs."""
        what = source.details.get("model_type")
        if what != "llava_next_video":
            raise InputError(f"--video-frames applies to video models (llava_next_video, qwen2_vl, qwen2_5_vl), not to "
                             f"this {what} model")
        if frames < 2:
            raise InputError(f"--video-frames must be at least 2 (a clip; the temporal methods compare frames), got "
                             f"{frames}")
        for name in ("grid", "crop_budget"):
            if options.get(name) is not None:
                raise InputError(f"--{name.replace('_', '-')} applies to anyres images, not to a clip "
                                 "(--video-frames): each frame is one still image at the tower's size")
        if batch is not None:
            raise InputError(f"--batch does not apply to video: the input is the {frames} frames of one clip "
                             f"[{frames}, 3, {source.image_size}, {source.image_size}]; run one clip per call")
        if cls == "keep":
            raise InputError("--cls keep is not available for LLaVA-NeXT-Video clips: the resampler pools each "
                             "frame's patch grid, without [CLS]")
        set_video(source, frames)
        super().fix(source, options, prune=prune, batch=batch, cls=cls)

    def check_method(self, source: Source, config, site_spec: type) -> None:
        self.refuse_video_reads(source, config)
        super().check_method(source, config, site_spec)

    def site(self, source: Source, config, site_spec: type):
        """A clip's block site holds one frame's patches per batch row (the frames are the tower's batch), not the
        clip's pooled rows the features hold; the pool stride is the source's spatial merge."""
        spec = super().site(source, config, site_spec)
        if source.frames > 1 and config.method.needs(config.params).site == BLOCK:
            spec = dataclasses.replace(spec, num_patches=(source.image_size // source.patch_size) ** 2)
        return spec

    def llm_source(self, checkpoint, options: dict) -> Source:
        source = self.adapter().load(checkpoint, None)
        if options.get("video_frames"):
            self.fix(source, {"video_frames": options["video_frames"]}, prune=False, batch=None, cls=None)
            return source
        if options.get("grid") is not None:
            source.regrid(options["grid"])
        return source

    def llm_pixels(self, source: Source, image: str, preprocess: dict | None) -> tuple[np.ndarray, str]:
        """The crops [C, 3, S, S] of one image at the source's grid (a bundle's preprocess is one image's, unused)."""
        rgb, depth = read_rgb(image)
        pixel = anyres_crops(rgb, source.crops, source.image_size, source.mean, source.std, fill=True)
        (height, width), (rows, cols) = source.crops["resolution"], source.crops["grid"]
        return pixel, (f"{rgb.shape[1]}x{rgb.shape[0]} image{depth}: centre-cropped to the {rows}x{cols} grid's "
                       f"aspect and resized to {width}x{height} (nothing padded), LlavaNextImageProcessor's "
                       f"{source.crops['count']} crops of {source.image_size}x{source.image_size}")

    def hf_image_inputs(self, config, source: Source, pixel: np.ndarray) -> dict:
        """One image's crops and size; of a clip, its frames [1, F, 3, S, S] (get_video_features' input)."""
        if source.crops is None:
            return {"pixel_values_videos": torch.from_numpy(pixel)[None]}
        return {"pixel_values": torch.from_numpy(pixel)[None], "image_sizes": torch.tensor([source.crops["resolution"]])}

    def check_target(self, source: Source, target: str, check_batch) -> None:
        """The crops of one image are the graph's batch: refuse, before the export, a target that cannot run it."""
        if source.crops is None:  # a clip (ClipInput)
            return super().check_target(source, target, check_batch)
        self.check_crops_batch(source, target, check_batch, "an anyres model")

    def token_layout(self, source: Source, options: dict) -> dict | None:
        """The method runs over the crops under one global budget (passes.methods.crops)."""
        if source.crops is None:  # a clip: the frames' tokens, frame by frame
            return None
        return self.crops_layout(source, options)

    def crops_order(self, crops: dict) -> str:
        """The base image (the whole picture at S x S) first, then the grid's crops."""
        rows, cols = crops["grid"]
        return f"base + {rows}x{cols} grid"

    def export_batch(self, source: Source, batch: int | None) -> int | None:
        if source.crops is None:  # a clip (ClipInput)
            return super().export_batch(source, batch)
        return source.crops["count"]  # one image's crops

    def parity_pixels(self, source: Source, images: int) -> tuple[np.ndarray, dict]:
        if source.crops is None:  # a clip (ClipInput)
            return super().parity_pixels(source, images)
        photos = max(2, images // source.crops["count"])  # one photo per chunk of C crops, two at least
        return parity_crops(photos, source.crops, source.image_size, source.mean, source.std)

    def cannot_draw(self, manifest: Manifest) -> str | None:
        return None if self.takes_video(manifest) else "an anyres bundle (several crops per image)"

    def load_images(self, manifest: Manifest, image_files, static) -> tuple[np.ndarray, list[str]]:
        """One image per call: the processor's crops of it for the bundle's grid."""
        if self.takes_video(manifest):
            return super().load_images(manifest, image_files, static)
        if len(image_files) != 1:
            raise InputError(f"this bundle takes one image per call (its {static} crops): pass --image once")
        model, pre = manifest.model, manifest.preprocess
        rows, cols = parse_grid(model.grid)
        crops = {"grid": [rows, cols], "count": model.crops, "resolution": model.resolution}
        try:
            pixel, described = load_image_crops(image_files[0], crops, pre.size, pre.mean, pre.std)
        except Exception as exc:
            raise InputError(f"{image_files[0]}: cannot read the image ({exc})") from None
        return pixel, [f"{image_files[0]}: {described}"]

    def readme_section(self, manifest: Manifest) -> str:
        """The bundle README's section on assembling the LLM input from the crops.

        Why in the README: which grid rows still hold tokens is known only at run time, so the
        pruned graph outputs the kept tokens and their (crop, row, col), and the runtime packs them.
        """
        model = manifest.model
        if not model.grid or not model.crops:
            return ""
        rows, cols = parse_grid(model.grid)
        count, size, patch = model.crops, model.image_size, model.patch_size
        s = size // patch
        height, width = model.resolution or [rows * size, cols * size]
        dense = packed_length((rows, cols), s)
        head = f"""
## Assembling the LLM input (LLaVA-NeXT anyres crops)

For this anyres bundle, this section supersedes the token counts and positions of any generic hand-off above
(those count one crop). Input `pixel_values` [{count}, 3, {size}, {size}]: what LlavaNextImageProcessor gives for an image of this
bundle's grid, {rows}x{cols} tiles at {height}x{width} (`vlmprune compile --grid`): crop 0 is the whole image
resized to {size}x{size}, crops 1..{count - 1} the tiles in raster order. Another image size is resized to fit
{height}x{width} keeping its aspect and padded (as the processor does), then cut the same way. One call is one image.
"""
        if not manifest.method.pruned:
            return head + f"""
`image_features` [1, {dense}, D] is the LLM's image sequence as transformers builds it (`get_image_features`,
i.e. `pack_image_features`): the {s * s} base tokens, then the {rows * s} grid rows of {cols * s} tokens, each
followed by `image_newline`. For an image whose aspect differs from the grid's, drop the padded rows or columns
first (unpad_image, rule 2 below), with their newlines.
"""
        method = manifest.method
        keep = method.keep
        summary = method.tokens_out - method.prefix - keep
        return head + f"""
`image_features` [1, {keep + summary}, D]: the K = {keep} kept tokens in crop-then-raster order
{"then one summary token (the mean of every pruned token)" if summary else "(no summary token)"};
`kept_positions` [1, {keep}, 3]: (crop c, row r, col x) of each, r and x within the crop's {s}x{s} patch grid
(`kept_indices` = c * {s * s} + r * {s} + x). The dense model's sequence is [{dense}, D]; the pruned one is
assembled with the same layout rule, keeping only the kept tokens:

1. Base: the kept tokens of crop 0, in the order given.
2. Grid: a kept token of crop c >= 1 sits at grid row Y = ((c - 1) // {cols}) * {s} + r and column
   X = ((c - 1) % {cols}) * {s} + x of the {rows * s} x {cols * s} token grid. Unpadding (an image of original size
   h x w whose aspect differs from the grid's; transformers' unpad_image): if w / h > {cols * s} / {rows * s}, drop rows
   Y < p and Y >= {rows * s} - p with p = ({rows * s} - int(round(h * {cols * s} / w, 7))) // 2; otherwise drop columns
   X < p and X >= {cols * s} - p with p = ({cols * s} - int(round(w * {rows * s} / h, 7))) // 2 (Python's int(round(., 7)),
   as transformers computes it). An image of {height}x{width} drops nothing.
3. Order the remaining grid tokens by (Y, X); after the last token of every grid row Y that holds at least one kept
   token, insert `image_newline` (the checkpoint's LlavaNextModel.image_newline vector, [D]); a row with no kept
   token gets no newline.
4. The LLM input is: base tokens, grid tokens with their newlines{", then the summary token" if summary else ""}.
   Its length is {keep + summary} + (grid rows holding a kept token): set the prompt's image placeholder count
   from it, per image.
5. Positions (a runtime that takes them; others renumber): each assembled row keeps its place in the dense
   packed sequence of an image of {height}x{width}: base token (r, x) at offset + r * {s} + x, grid token (Y, X) at
   offset + {s * s} + Y * {cols * s + 1} + X, row Y's newline at offset + {s * s} + Y * {cols * s + 1} + {cols * s};
   {f"the summary token at offset + {dense}; " if summary else ""}the text after the image from offset + {dense + summary}
   (the manifest's `llm.positions`; `vlmprune generate` feeds exactly these).

The budget K is split over the crops by `{method.params["crops"]["budget"]}` (manifest `method.params.crops`);
padded tokens, when there are any, count in K and are dropped by rule 2.
"""
