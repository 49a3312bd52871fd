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

Tiles: by default a bundle takes one tile per image, at one static --image-size S (default the tower's, 512), as
SmolVLM's processor feeds an image with do_image_splitting=False (resized to one square tile; the prompt wraps its rows
in <fake_token_around_image><global-img> ... <fake_token_around_image>). `--grid RxC` (static at compile time, at most
the processor's size.longest_edge / max_image_size tiles along a side: 4 for SmolVLM-256M/500M's 2048 / 512) compiles
the processor's tiles of one image, as do_image_splitting=True cuts them (transformers' SmolVLMImageProcessor, as
Idefics3's): the image resized so that its longest edge is a multiple of S (max_image_size) and its other edge rounded
up to one, R·C tiles of S x S cut in raster order, then the whole image resized to one tile as the global thumbnail
(none for 1x1). The bundle's input is those R·C + 1 tiles as the tower's batch [R·C + 1, 3, S, S] (smolvlm_tiles: the
processor itself, asked for the grid's tiles after a centre crop to the grid's aspect, so equal to its pixel_values
for an image of that aspect); each tile runs the tower and connector alone, as get_image_features does. What tiles
take beyond the cut is frontend.tiles' (TiledFamily), as InternVL's do: K one budget over the tiles and the thumbnail
(passes.methods.crops, split `equal`), kept_indices c·N + i; ort, orin and xavier (host parity) run the static batch,
a batch-1 target (rk3588, qnn) is refused in one line.

Where pruning goes: after the connector, on the merged tokens (the features site; Source.spatial_merge = the
scale factor): divprune, dart, and random / grid with --site features. Refused in one line before any work:
block-site methods (cls, visionzip, tome, ...), since the shuffle needs whole groups of the full grid and a
method there keeps single patches; and methods that score by the tower's attention, a [CLS] or a pooling head
(holov, cls --score attention, cdpruner's feature layer), which SmolVLM's tower lacks or runs over single
patches. Kept tokens carry their index in the merged grid (`positions` "indices"): the Llama LLM's 1-D
positions, original-positions rule.

The LLM side: `generate` and `eval` write the kept rows at their original positions between the markers its
processor writes around one unsplit image (image_prompt). With --grid (default the bundle's) they cut the same tiles
and write the processor's prompt for them (transformers' _prompt_split_image; source_image_prompt):
`<fake_token_around_image><row_r_col_c>` before each tile's rows, a newline after each row of tiles, then
`\n<fake_token_around_image><global-img>` + the thumbnail's rows + `<fake_token_around_image>`; each kept row sits
among its tile's N places, the markers at theirs (ImagePrompt.between, generate.between_tiles). `--with-llm` on ort exports its Llama language model
(compiler.llm.torch_exporter, the layer it knows; read from the VLM's text_model by compiler.llm.lm_source), FastV
included; the bundle hands over nothing beyond the rows and their positions. Orin's Edge-LLM exporter refuses it (it
takes LLaVA's and Qwen2.5-VL's checkpoints only).
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
from vlmprune.compiler.frontend.images import crop_to_grid, parse_grid
from vlmprune.compiler.frontend.merged import conv_as_matmul, load_tower_and_connector, siglip_block, token_counts
from vlmprune.compiler.frontend.source import Source, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tiles import TiledFamily
from vlmprune.compiler.frontend.tower import TowerParts, VisionPipeline

SMOLVLM_MEAN = SMOLVLM_STD = (0.5, 0.5, 0.5)
MODEL_TYPES = ("smolvlm",)
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"  # the processor's marks around one tile's rows
GRID_SIDE = 4  # tiles along a side: size.longest_edge / max_image_size where preprocessor_config.json does not say
MAX_IMAGE_SIZE = 4096  # the processor's cap on an image's longest edge (transformers' MAX_IMAGE_SIZE)


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
                   image_size: int | None = None, mean=SMOLVLM_MEAN, std=SMOLVLM_STD,
                   grid_side: int = GRID_SIDE) -> Source:
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
               "input": "one tile per image (do_image_splitting=False; --grid ROWSxCOLS compiles the processor's "
                        "tiles of one image and its global thumbnail)",
               "grid_side": grid_side}
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
                              sha256_files(checkpoint.files()), image_size, mean, std, grid_side(checkpoint))


def grid_side(checkpoint: Checkpoint) -> int:
    """The most tiles along a side the checkpoint's processor cuts (preprocessor_config.json's size.longest_edge over
    max_image_size.longest_edge: it resizes every image's longest edge to the former), else SmolVLM-256M's 4."""
    pre = checkpoint.path / "preprocessor_config.json"
    if not pre.is_file():
        return GRID_SIDE
    try:
        prep = json.loads(pre.read_text())
        longest, tile = prep.get("size", {}).get("longest_edge"), prep.get("max_image_size", {}).get("longest_edge")
        return GRID_SIDE if not longest or not tile else max(1, int(longest) // int(tile))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise InputError(f"{pre}: no readable size / max_image_size ({exc})") from None


def smolvlm_tiles(image: np.ndarray, crops: dict, size: int, mean, std, fill: bool = True) -> np.ndarray:
    """uint8 HxWx3 -> [C, 3, size, size]: SmolVLM's processor tiles (do_image_splitting=True) for the bundle's grid:
    the rows x cols tiles in raster order, then the global thumbnail (the whole image resized to size x size) when
    there is more than one tile.

    The processor resizes the longest edge to its size.longest_edge, then both edges up to multiples of the tile
    (max_image_size); asked for a longest edge of max(rows, cols) tiles, it cuts the bundle's grid from an image of
    that grid's aspect. fill: the photo is first centre-cropped to the grid's aspect, its short side rounded down
    (images.crop_to_grid within), so that any photo gives the bundle's grid, as a static graph needs.
    """
    from PIL import Image
    from transformers import SmolVLMImageProcessorPil

    rows, cols = crops["grid"]
    if fill:
        image = crop_to_grid(image, rows, cols, within=True)
    processor = SmolVLMImageProcessorPil(do_image_splitting=True, size={"longest_edge": max(rows, cols) * size},
                                         max_image_size={"longest_edge": size}, image_mean=list(mean),
                                         image_std=list(std))
    out = processor(images=Image.fromarray(np.ascontiguousarray(image[..., :3])), return_tensors="np",
                    return_row_col_info=True)
    pixel = out["pixel_values"][0]
    cut = (int(out["rows"][0][0]), int(out["cols"][0][0]))
    if cut != ((rows, cols) if rows * cols > 1 else (0, 0)) or pixel.shape[0] != crops["count"]:
        raise AssertionError(f"the processor cut {pixel.shape[0]} tiles ({cut[0]}x{cut[1]}), the grid is "
                             f"{rows}x{cols} ({crops['count']} tiles)")
    return pixel.astype(np.float32)


def split_prompt(tokenizer, rows: int, cols: int) -> ImagePrompt:
    """What SmolVLM's processor writes around and between the rows of one image cut into rows x cols tiles
    (transformers' _prompt_split_image), the markers as its tokenizer names them: before the first tile's rows, between
    each two tiles' (the last entry: before the thumbnail's), after the thumbnail's."""
    fake = getattr(tokenizer, "fake_image_token", None) or FAKE
    heads = [f"{fake}<row_{r + 1}_col_{c + 1}>" for r in range(rows) for c in range(cols)]
    between = [("\n" if (k + 1) % cols == 0 else "") + heads[k + 1] for k in range(rows * cols - 1)]
    between.append("\n\n" + fake + (getattr(tokenizer, "global_image_token", None) or GLOBAL))
    return ImagePrompt(heads[0], fake, between=tuple(between))


class SmolVLMFamily(TiledFamily):
    """A [CLS]-free SigLIP tower whose connector merges s x s patch groups: pruned after the connector."""

    id = "smolvlm"
    adapter = SmolVLMAdapter
    options = {"image_size": (int, "Static tile size S for smolvlm: a multiple of patch x scale_factor (64 for "
                                   "SmolVLM-256M/500M) up to the tower's 512. Default the tower's size."),
               "grid": (str, "Tiled models (smolvlm): compile the processor's ROWSxCOLS tiles of one image "
                             "(do_image_splitting), at most its size.longest_edge / max_image_size along a side (input "
                             "[ROWS*COLS + 1, 3, S, S]: the tiles, then the global thumbnail). Default: one tile."),
               "crop_budget": (str, "Tiled models (smolvlm): split --keep over the tiles and the thumbnail `equal` "
                                    "(the only split for divprune and dart).")}
    has = {PATCH_TOKENS: "SmolVLM"}
    language_model = {"smolvlm": "SmolVLMForConditionalGeneration"}
    why_not_block = ("SmolVLM's connector pixel-shuffles each group of the full patch grid into one token after the "
                     "tower, so pruning single patches inside it breaks the shuffle")
    why_not_scored = ("scores by a [CLS], a pooling head or the tower's attention, and SmolVLM's tower has no [CLS] "
                      "nor head and attends over single patches, not the merged tokens")

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """SmolVLM's forward takes [batch, images, 3, S, S]: one image of one tile, or of its tiles (--grid)."""
        return {"pixel_values": torch.from_numpy(pixel)[None]}

    def check_grid(self, source: Source, rows: int, cols: int) -> None:
        limit = source.details.get("grid_side", GRID_SIDE)
        side = max(rows, cols)
        if side > limit or side * source.image_size > MAX_IMAGE_SIZE:
            raise InputError(f"--grid {rows}x{cols}: {side} tiles along a side, and this model's processor cuts at "
                             f"most {min(limit, MAX_IMAGE_SIZE // source.image_size)} (its size.longest_edge over "
                             "max_image_size)")

    def cut_tiles(self, image: np.ndarray, crops: dict, size: int, mean, std) -> np.ndarray:
        return smolvlm_tiles(image, crops, size, mean, std)

    def describe_tiles(self, width: int, height: int, depth: str, crops: dict, size: int) -> str:
        rows, cols = crops["grid"]
        thumbnail = " + the global thumbnail (the whole crop resized)" if crops["count"] > rows * cols else ""
        return (f"{width}x{height} image{depth}: centre-cropped to the {rows}x{cols} grid's aspect ({cols}:{rows}), "
                f"SmolVLM's processor tiles (do_image_splitting): resized to {cols * size}x{rows * size}, cut into "
                f"{rows * cols} tiles of {size}x{size}{thumbnail} ({crops['count']} tiles)")

    def why_not_fastv(self, source: Source) -> str | None:
        """Tiles (--grid): the processor writes row/column markers between the tiles' rows (split_prompt), so the
        image rows are no one run that FastV's compiled span could cover."""
        if source.crops is not None and source.crops["count"] > 1:
            return ("SmolVLM's processor writes row/column markers between the tiles' rows (--grid), so they are not "
                    "the one run of image rows FastV prunes")
        return None

    def source_image_prompt(self, tokenizer, source: Source) -> ImagePrompt:
        """With --grid (more than one tile), the processor's split-image prompt (split_prompt); else one image's."""
        crops = source.crops
        if crops is None or crops["count"] == 1:
            return self.image_prompt(tokenizer)
        return split_prompt(tokenizer, *crops["grid"])

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """What SmolVLM's processor writes around one unsplit image's rows in place of its <image> (transformers'
        _prompt_single_image), the markers as its tokenizer names them."""
        fake = getattr(tokenizer, "fake_image_token", None) or FAKE
        return ImagePrompt(fake + (getattr(tokenizer, "global_image_token", None) or GLOBAL), fake)

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        model = manifest.model
        m, s = model.merged_grid_thw[1:], counts["spatial_merge"]
        head = ("\n## SmolVLM tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} merged grid (each a pixel-shuffled {s}x{s} "
                f"group of the {counts['patch_grid'][0]}x{counts['patch_grid'][1]} patches), raster order")
        if not model.crops:
            return (head + "; kept_indices index that grid. One tile per image, as SmolVLM's processor feeds it with "
                    f"do_image_splitting=False; the prompt wraps the rows in `{FAKE}{GLOBAL}` ... `{FAKE}`.\n")
        rows, cols = parse_grid(model.grid)
        n = counts.get("tokens")
        thumbnail = ", then the global thumbnail (the whole image resized)" if model.crops > rows * cols else ""
        return (head + f", tile by tile. Input: one image per call, as SmolVLM's processor tiles an image of the "
                f"{rows}x{cols} grid's aspect (do_image_splitting): the {rows * cols} tiles in raster order{thumbnail}, "
                f"{model.crops} in all. kept_indices c * {n} + i: token i of tile c. The prompt is the processor's "
                f"for the split image: `{FAKE}<row_r_col_c>` before each tile's rows, a newline after each row of "
                f"tiles, then `\\n{FAKE}{GLOBAL}` + the thumbnail's rows + `{FAKE}`; a kept row's position is offset "
                f"+ kept_indices + the marker tokens before its tile (dense_image_tokens counts the {model.crops * n} "
                "image rows only; the text after the image resumes after the markers too).\n")
