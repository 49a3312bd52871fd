"""What the families compiled over one image's processor tiles share (`--grid RxC`): InternVL3 and SmolVLM.

Their processors cut an image of the grid's aspect into R·C tiles of the tower's size in raster order and add the
whole image resized to one tile as a thumbnail when R·C > 1 (InternVL's crop_to_patches, SmolVLM's Idefics3-style
split_images); each tile runs the tower and connector alone, as the model's get_image_features does. The bundle's
input is those C tiles of one image as the tower's static batch [C, 3, S, S]; K is one budget over them
(passes.methods.crops, the layout LLaVA-NeXT's crops use: divprune and dart per tile, split `equal`); kept_indices
c·N + i, which is also the row's place among the image's C·N dense rows. The tiles are a static batch that ort, orin
and xavier (TensorRT; host parity through their ONNX Runtime stand-in) and openvino run as they run any other; a
target running batch 1 only is refused in one line (Family.check_crops_batch). `generate` and `eval` (`--grid`,
default the bundle's) cut the same tiles (llm_pixels) and place the kept rows among the image's C·N (TilesPositions);
text the processor writes between two tiles' rows (SmolVLM's row / column markers) is the family's to say
(Family.source_image_prompt: ImagePrompt.between), and generate places it at its dense positions.

A family declares what is its own: its processor's cut of a photo (cut_tiles, asked for exactly the grid's tiles of
an image of the grid's aspect), how many tiles it cuts at most (check_grid), the line describing the cut
(describe_tiles), how its tiles lie in the batch (crops_order) and its options' help.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from vlmprune.compiler.contract import CROP_BUDGETS, Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.family import IndicesPositions, image_positions
from vlmprune.compiler.frontend.images import parity_crops, parse_grid, read_rgb
from vlmprune.compiler.frontend.merged import MergedTokensFamily
from vlmprune.compiler.frontend.source import Source


def set_tiles(source: Source, grid: tuple[int, int]) -> None:
    """Fix the source to one grid of tiles (--grid): its input is then the processor's tiles of one image, the
    rows·cols tiles in raster order then the thumbnail when there is more than one tile, as the tower's batch.

    Each tile goes through the tower and connector alone (get_image_features), so its merged tokens are a tile's;
    kept_indices c·N + i index tile c's token i, which is also the token's place in the image's dense rows.
    """
    rows, cols = grid
    side = source.image_size // (source.patch_size * source.spatial_merge)
    count = rows * cols + (1 if rows * cols > 1 else 0)
    source.crops = {"grid": [rows, cols], "count": count, "side": side, "thumbnail": count > rows * cols,
                    "resolution": [rows * source.image_size, cols * source.image_size]}
    source.details.update(grid=f"{rows}x{cols}", crops=count, resolution=source.crops["resolution"],
                          input=(f"the processor's tiles of one image: {rows}x{cols} tiles of {source.image_size} px"
                                 + (" + the thumbnail" if count > 1 else "") + f" [{count}, 3, S, S]"))
    source.details["token_counts"] = {**source.details["token_counts"], "tiles": count,
                                      "image_tokens": count * side * side}


class TilesPositions(IndicesPositions):
    """1-D original positions over all of one image's tiles: the dense image is the tiles' rows end to end
    (count · N, with the text its processor writes between two tiles, if any, at its own places), and kept_indices
    c·N + i is each kept row's place among them."""

    meaning = ("kept_indices[b, j] is c·N + i for token i (raster order) of tile c (the processor's tiles in order, "
               "the thumbnail last; one tile without --grid) of row prefix + j of image_features")
    rule = ("prefix row r at offset + r; kept row j at offset + prefix + kept_indices[j] + the tokens of the text "
            "the processor writes between tiles before its tile (none for most families); text after the image from "
            "offset + dense_image_tokens + extra + the tokens of all that text")

    def dense_image_tokens(self, model: dict, dense: int | None) -> int | None:
        count = model.get("crops")
        return dense * count if dense and count else dense

    def place_pruned(self, source: Source, features, kept, kept_positions, prefix: int, extra: int):
        dense = prefix + source.num_patches * ((source.crops or {}).get("count") or 1)
        return features, lambda offset: image_positions(offset, dense, prefix, kept, extra)


class TiledFamily(MergedTokensFamily):
    """A family pruned on the merged tokens whose bundles may take one image's processor tiles (the module
    docstring). Without --grid, one tile per image, as MergedTokensFamily."""

    positions = TilesPositions()
    crop_noun = "tiles"
    grid_help: ClassVar[str] = "--grid tiles"  # how a batch-1 target's refusal names the input

    # ------------------------------------------------------------------ what a tiled family declares

    def check_grid(self, source: Source, rows: int, cols: int) -> None:
        """Refuse, in one line, a grid its processor never cuts (more tiles than it takes)."""

    def cut_tiles(self, image: np.ndarray, crops: dict, size: int, mean, std) -> np.ndarray:
        """uint8 HxWx3 -> [C, 3, size, size]: its processor's tiles of the photo for the grid crops["grid"]."""
        raise NotImplementedError

    def describe_tiles(self, width: int, height: int, depth: str, crops: dict, size: int) -> str:
        """One line of what cut_tiles does to a width x height image (depth: read_rgb's note)."""
        raise NotImplementedError

    def crops_order(self, crops: dict) -> str:
        """The grid's tiles in raster order, then the thumbnail (the whole image resized): the processors put the
        whole image last, and the method's line says so."""
        rows, cols = crops["grid"]
        return f"{rows}x{cols} grid, then the thumbnail" if crops["thumbnail"] else f"{rows}x{cols} grid"

    # ------------------------------------------------------------------ what the pipeline asks

    def tiles(self, source: Source, grid: str) -> None:
        """--grid on a loaded source: checked against its processor, then fixed (set_tiles)."""
        rows, cols = parse_grid(grid)
        self.check_grid(source, rows, cols)
        set_tiles(source, (rows, cols))

    def check_options(self, given: dict) -> None:
        budget = given.get("crop_budget")
        if budget is not None and budget not in CROP_BUDGETS:
            raise InputError(f"--crop-budget is {' or '.join(CROP_BUDGETS)}, got {budget!r}")
        if given.get("grid") is not None:
            parse_grid(given["grid"])

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        """--grid: the tiles of one image are the graph's batch, so --batch is refused with it; --crop-budget needs
        tiles to split over, and a pruned bundle."""
        grid = options.get("grid")
        if grid is None:
            if options.get("crop_budget") is not None:
                raise InputError("--crop-budget splits K over an image's tiles: it needs --grid ROWSxCOLS")
            return super().fix(source, options, prune=prune, batch=batch, cls=cls)
        self.tiles(source, grid)
        count = source.crops["count"]
        if batch is not None:
            raise InputError(f"--batch does not apply with --grid: the input is the {count} tiles of one image "
                             f"[{count}, 3, {source.image_size}, {source.image_size}]; run one image per call")
        if not prune and options.get("crop_budget") is not None:
            raise InputError("--no-prune takes no --crop-budget")
        super().fix(source, options, prune=prune, batch=batch, cls=cls)

    def check_target(self, source: Source, target: str, check_batch) -> None:
        """The tiles of one image are the graph's batch: refuse, before the export, a target that cannot run it."""
        if source.crops is None:
            return super().check_target(source, target, check_batch)
        self.check_crops_batch(source, target, check_batch, self.grid_help)

    def token_layout(self, source: Source, options: dict) -> dict | None:
        """With --grid, the method runs over the tiles under one global budget (passes.methods.crops)."""
        return None if source.crops is None else self.crops_layout(source, options)

    def export_batch(self, source: Source, batch: int | None) -> int | None:
        return batch if source.crops is None else source.crops["count"]

    def parity_pixels(self, source: Source, images: int) -> tuple[np.ndarray, dict]:
        if source.crops is None:
            return super().parity_pixels(source, images)
        photos = max(2, images // source.crops["count"])  # one photo per chunk of C tiles, two at least
        return parity_crops(photos, source.crops, source.image_size, source.mean, source.std, cut=self.cut_tiles)

    def cannot_draw(self, manifest: Manifest) -> str | None:
        return "a tiled bundle (several tiles per image)" if manifest.model.crops else None

    def tile_image(self, path: str, crops: dict, size: int, mean, std) -> tuple[np.ndarray, str]:
        """An image file -> ([C, 3, size, size] the processor's tiles for the bundle's grid, a description)."""
        rgb, depth = read_rgb(path)
        return self.cut_tiles(rgb, crops, size, mean, std), self.describe_tiles(rgb.shape[1], rgb.shape[0], depth,
                                                                                crops, size)

    def load_images(self, manifest: Manifest, image_files, static) -> tuple[np.ndarray, list[str]]:
        """With --grid, one image per call: the processor's tiles of it for the bundle's grid."""
        model = manifest.model
        if not model.crops:
            return super().load_images(manifest, image_files, static)
        if len(image_files) != 1:
            raise InputError(f"this bundle takes one image per call (its {static} tiles): pass --image once")
        pre = manifest.preprocess
        rows, cols = parse_grid(model.grid)
        crops = {"grid": [rows, cols], "count": model.crops, "thumbnail": model.crops > rows * cols}
        try:
            pixel, described = self.tile_image(image_files[0], crops, pre.size, pre.mean, pre.std)
        except Exception as exc:
            raise InputError(f"{image_files[0]}: cannot read the image ({exc})") from None
        return pixel, [f"{image_files[0]}: {described}"]

    def llm_source(self, checkpoint, options: dict) -> Source:
        source = super().llm_source(checkpoint, options)
        if options.get("grid") is not None:
            self.tiles(source, options["grid"])
        return source

    def llm_pixels(self, source: Source, image: str, preprocess: dict | None) -> tuple[np.ndarray, str]:
        """With --grid, the tiles [C, 3, S, S] of one image at the source's grid."""
        if source.crops is None:
            return super().llm_pixels(source, image, preprocess)
        return self.tile_image(image, source.crops, source.image_size, source.mean, source.std)

    def hf_image_features(self, out):
        """One image's rows: its tiles' rows end to end (get_image_features gives them tile by tile, or, as SmolVLM's,
        a list of them per image)."""
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(features, (list, tuple)):
            return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1])
