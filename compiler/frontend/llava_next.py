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
  graph's batch: refused before the export, in one line (pipeline._crops_on_target).
- The select strategy must be `default`: pack_image_features lays each crop out as an s x s
  grid, which a [CLS] token in the features (`full`, or --cls keep) breaks; both are refused.
"""

from __future__ import annotations

import numpy as np
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import tower_parts
from vlmprune.compiler.frontend.llava import check_tower, load_vision, tower_normalization, tower_state
from vlmprune.compiler.frontend.source import Source, check_floating, feature_blocks, read_safetensors, sha256_files
from vlmprune.compiler.frontend.tower import VisionPipeline


def parse_grid(text: str) -> tuple[int, int]:
    """`RxC` -> (rows, cols); one line for anything else."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"--grid is ROWSxCOLS (e.g. 2x2), got {text!r}")
    return int(parts[0]), int(parts[1])


class AnyresPipeline(VisionPipeline):
    """VisionPipeline over the crops of images: [n·C, 3, S, S] -> [n, tokens, D].

    pack: the dense output is HF's packed sequence (base tokens, grid rows with
    image_newline); False gives each crop's features [n·C, N, D], the form the pruning
    passes read (a pruned bundle's dense stage). A pruner (passes.methods.crops) merges the
    crops of each image itself.
    """

    def __init__(self, *args, image_newline: torch.Tensor, grid: tuple[int, int], pack: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_newline = image_newline
        self.grid = grid
        self.pack = pack

    @property
    def crops(self) -> int:
        return 1 + self.grid[0] * self.grid[1]

    def with_pruner(self, pruner) -> AnyresPipeline:
        return AnyresPipeline(self.tower, self.projector, self.num_blocks, self.drop_cls, self.has_cls,
                              self.patch_size, self.prefix, self.final_norm, pruner, image_newline=self.image_newline,
                              grid=self.grid, pack=self.pack)

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


class LlavaNextAdapter(ModelAdapter):
    family = "llava_next"
    model_types = ("llava_next",)
    summary = "LLaVA-NeXT (LlavaNextForConditionalGeneration): anyres crops of one grid, CLIP/SigLIP tower + projector"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        vcfg = config.vision_config
        check_tower(vcfg, "LLaVA-NeXT")
        strategy = config.vision_feature_select_strategy
        if strategy != "default":
            raise InputError(f"vision_feature_select_strategy {strategy!r} is not supported for LLaVA-NeXT: its "
                             "crops are packed as patch grids, which needs `default` ([CLS] dropped)")
        fl = config.vision_feature_layer if feature_layer is None else feature_layer
        if not isinstance(fl, int):
            raise InputError(f"multi-layer vision_feature_layer {fl} is not supported; pass --feature-layer")
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
        pipeline = AnyresPipeline(tower_parts(tower), projector, feature_blocks(fl, vcfg.num_hidden_layers),
                                  True, has_cls, vcfg.patch_size, image_newline=newline.float(), grid=grid).eval()
        mean, std = tower_normalization(checkpoint)
        source = Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                        vcfg.image_size, vcfg.patch_size, has_cls, mean, std, pipeline=pipeline, positions="cyx",
                        details={"model_type": "llava_next", "feature_layer": fl, "select_strategy": strategy,
                                 "vision_layers": vcfg.num_hidden_layers, "projector": True,
                                 "grids": [f"{r}x{c}" for r, c in grids_of(config)]})
        set_grid(source, grid)
        source.regrid = lambda text: set_grid(source, choose_grid(config, text))
        return source


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
