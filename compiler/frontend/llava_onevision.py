"""Family `llava_onevision`: LLaVA-OneVision's video path (LlavaOnevisionForConditionalGeneration), --video-frames F.

A clip's F frames are the tower's batch, each a still image through the SigLIP (or CLIP) tower to the feature
layer, then the projector, then get_video_features' pooling (apply_pooling: each frame's s x s grid of projected
rows resized bilinearly to ceil(s/2) x ceil(s/2), align_corners False, as transformers calls
nn.functional.interpolate), the frames laid end to end: [1, F·M, D] with M = ceil(s/2)². Tested equal to
transformers' get_video_features for the same frames, less its last row.

That last row is image_newline, which transformers appends once after a clip's rows (not per frame, not per row as
its images do). It is not a token a method should rank or drop, and it sits after the rows whatever is kept, so the
graph outputs the clip's rows and the bundle hands the newline over: the manifest's model section records it (its
checkpoint, the row after the kept ones), and the README says to append it once after the kept rows. The rows go
to the LLM as they come, so the kept rows' positions are their dense indices (the plain `indices` rule), the newline
at offset + F·M, the text after it. `generate` and `eval` do exactly that (NewlinePositions.place_pruned; a dense
bundle's rows: dense_rows), with the prompt its processor writes for a video (`chat`: {"type": "video"}, <video>).

Why a family of its own and not LLaVA-NeXT's: the pooling sits after the projector and is a resize, not a window
pool, so the in-encoder drop (evs-encoder, which keeps whole pooling windows) has no window to keep and is refused;
and OneVision's images are anyres_max crops with per-crop unpadding and pooling, not compiled here: a compile without
--video-frames is refused in one line.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import tower_parts
from vlmprune.compiler.frontend.family import (PATCH_TOKENS, VIDEO, ChatPrompt, Family, IndicesPositions,
                                               image_positions)
from vlmprune.compiler.frontend.llava import check_tower, load_vision, tower_normalization, tower_state
from vlmprune.compiler.frontend.source import (Source, check_floating, feature_blocks, feature_layer_of,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.tower import VisionPipeline
from vlmprune.compiler.frontend.video import ClipInput


class PooledFrames(nn.Module):
    """The path after the feature select, as get_video_features runs it: the projector, apply_pooling (a bilinear
    resize of each frame's s x s grid to ceil(s/2)), then each clip's F frames end to end [n, F·M, D]. Being the
    pipeline's projector, a FEATURES-site method (evs, dycoke, divprune) sees the clip's rows frame by frame."""

    def __init__(self, projector: nn.Module, side: int, frames: int, newline: torch.Tensor | None = None):
        super().__init__()
        self.projector, self.side, self.frames = projector, side, frames
        # model.image_newline [D]: a plain attribute, not a buffer (no graph output holds it; generate appends it)
        self.newline = newline

    @property
    def pooled(self) -> int:
        return math.ceil(self.side / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.projector(x)
        n, _, d = x.shape
        grid = x.reshape(n, self.side, self.side, d).permute(0, 3, 1, 2)
        grid = nn.functional.interpolate(grid, size=[self.pooled, self.pooled], mode="bilinear")
        x = grid.permute(0, 2, 3, 1).reshape(n, self.pooled * self.pooled, d)
        return x.reshape(-1, self.frames * x.shape[1], d)


class LlavaOnevisionAdapter(ModelAdapter):
    family = "llava_onevision"
    model_types = ("llava_onevision",)
    summary = "LLaVA-OneVision (LlavaOnevisionForConditionalGeneration): its clips with --video-frames"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        config = checkpoint.config
        vcfg = config.vision_config
        check_tower(vcfg, "LLaVA-OneVision")
        has_cls = vcfg.model_type == "clip_vision_model"
        strategy = config.vision_feature_select_strategy
        if (strategy == "default") != has_cls:  # SigLIP: `full` (no [CLS]); CLIP: `default` ([CLS] dropped)
            raise InputError(f"vision_feature_select_strategy {strategy!r} with a {vcfg.model_type} tower is not "
                             "supported for LLaVA-OneVision: the pooling resizes each frame's patch grid, which needs "
                             "exactly the patches (SigLIP `full`, CLIP `default`)")
        fl = feature_layer_of(config, feature_layer)
        tower, projector = load_vision(checkpoint, tower_state(checkpoint))
        tensors = read_safetensors(checkpoint.weights, ("model.image_newline", "image_newline"))
        newline = tensors.get("")
        d_text = config.text_config.hidden_size
        if newline is None or tuple(newline.shape) != (d_text,):
            raise InputError(f"{checkpoint.path}: no image_newline [{d_text}] in the checkpoint (the row "
                             "LLaVA-OneVision appends after a clip's rows)")
        check_floating(tensors, "", "image_newline")
        pipeline = VisionPipeline(tower_parts(tower), projector, feature_blocks(fl, vcfg.num_hidden_layers),
                                  has_cls, has_cls, vcfg.patch_size).eval()
        pipeline.image_newline = newline.float()  # a plain attribute (set_video hands it to PooledFrames)
        mean, std = tower_normalization(checkpoint)
        return Source(str(checkpoint.path.resolve()), "hf", self.family, sha256_files(checkpoint.files()),
                      vcfg.image_size, vcfg.patch_size, has_cls, mean, std, pipeline=pipeline,
                      details={"model_type": checkpoint.model_type, "feature_layer": fl, "select_strategy": strategy,
                               "vision_layers": vcfg.num_hidden_layers, "projector": True})


def set_video(source: Source, frames: int) -> None:
    """Make the source a video one: input [F, 3, S, S] as the tower's batch, features [1, F·M, D] (M = ceil(s/2)²)."""
    pipe = source.pipeline
    side = source.image_size // source.patch_size
    pooled = PooledFrames(pipe.projector, side, frames, getattr(pipe, "image_newline", None))
    source.pipeline = VisionPipeline(pipe.tower, pooled, pipe.num_blocks, pipe.drop_cls, pipe.has_cls,
                                     pipe.patch_size, frames=frames).eval()
    m = pooled.pooled
    # spatial_merge 2: the site's tokens are not the blocks' patches (a BLOCK-site baseline is sent to --site features)
    source.frames, source.tokens_per_frame, source.positions, source.spatial_merge = frames, m * m, "indices", 2
    source.details["video_frames"] = frames
    source.details["token_counts"] = {
        "image_size": source.image_size, "patch_grid": [side, side], "patches": side * side, "spatial_merge": 2,
        "merged_grid_thw": [frames, m, m], "tokens": frames * m * m, "video_frames": frames, "tokens_per_frame": m * m,
        "pool": ["bilinear", 2]}
    source.details["image_newline"] = "one row after the clip's rows: the checkpoint's model.image_newline"
    source.details["input"] = (f"one clip per call: pixel_values [{frames}, 3, S, S], its frames in order, each "
                               f"preprocessed as a still image; features [1, F·M, D] frame by frame, M = {m * m}; "
                               "append image_newline once after them")


class NewlinePositions(IndicesPositions):
    """The clip's rows at their dense index, then image_newline once at F·M (transformers' get_video_features), the
    text after it: the placeholder expands to F·M + 1 tokens without pruning. generate appends the newline (the
    source's model.image_newline) after the kept rows and places it there (needs_model: the row is the model's)."""

    rule = ("prefix row r at offset + r; kept row j at offset + prefix + kept_indices[j]; then image_newline (not an "
            "output: the checkpoint's model.image_newline) at offset + dense_image_tokens - 1; extra row e at offset "
            "+ dense_image_tokens + e; text after the image from offset + dense_image_tokens + extra")
    needs_model = True

    def dense_image_tokens(self, model: dict, dense: int | None) -> int | None:
        return None if dense is None else dense + 1

    def readme_places(self, rows: dict, dense, after) -> str:
        return (f"- kept row j: offset + {rows['prefix']} + kept_indices[j]\n"
                f"- then image_newline (the checkpoint's model.image_newline, [D]), once: offset + {dense - 1}\n"
                f"- the text after the image: from offset + {after}")

    @staticmethod
    def newline(source: Source, like: torch.Tensor) -> torch.Tensor:
        row = getattr(source.pipeline.projector, "newline", None)
        if row is None:
            raise ValueError("a LLaVA-OneVision source without its image_newline (not a clip source: set_video)")
        return row.to(like.dtype)[None]

    def dense_rows(self, source: Source, features):
        """A dense bundle's F·M rows, then the newline: F·M + 1 rows at consecutive positions."""
        rows = torch.cat([features, self.newline(source, features)])
        return rows, self.place_dense(source, len(rows))

    def place_pruned(self, source: Source, features, kept: np.ndarray, kept_positions: np.ndarray | None,
                     prefix: int, extra: int):
        """prefix, the K kept rows, the newline, the extra rows; the newline at offset + prefix + F·M."""
        dense, at = prefix + source.num_patches, prefix + len(kept)
        rows = torch.cat([features[:at], self.newline(source, features), features[at:]])

        def place(offset: int) -> tuple[np.ndarray, int]:
            positions, text = image_positions(offset, dense + 1, prefix, kept, extra)
            return np.insert(positions, at, offset + dense), text

        return rows, place


class LlavaOnevisionFamily(ClipInput, Family):
    """LLaVA-OneVision's clips (ClipInput: the frames are the graph's batch); its images are not compiled here."""

    id = "llava_onevision"
    adapter = LlavaOnevisionAdapter
    options = {"video_frames": (int, "Video (llava_onevision): compile for clips of F frames (static, at least 2): "
                                     "each frame through the tower and projector, pooled bilinearly to ceil(s/2)² "
                                     "rows as get_video_features does; the features [1, F·M, D] frame by frame")}
    has = {PATCH_TOKENS: "LLaVA-OneVision clips", VIDEO: "LLaVA-OneVision"}
    positions = NewlinePositions()
    language_model = {"llava_onevision": "LlavaOnevisionForConditionalGeneration"}
    # A clip is written as its processor writes a video: the template's {"type": "video"}, <video> expanded to F·M + 1
    # video tokens (replace_video_token); the template of the released checkpoints where one has none.
    chat = ChatPrompt("<video>", "{mark}\n{prompt}", "<|im_start|>user {mark}\n{prompt}<|im_end|><|im_start|>assistant\n",
                      "LLaVA-OneVision's chat template (its video turn)", video=True)

    def check_options(self, given: dict) -> None:
        self.check_frames(given)

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        frames = options.get("video_frames")
        if frames is None:
            raise InputError("LLaVA-OneVision images (anyres_max crops, unpadded and pooled per crop) are not "
                             "compiled here: compile its clips with --video-frames F")
        if frames < 2:
            raise InputError(f"--video-frames must be at least 2 (a clip; the temporal methods compare frames), got "
                             f"{frames}")
        if batch is not None:
            raise InputError(f"--batch does not apply to video: the input is the {frames} frames of one clip "
                             f"[{frames}, 3, {source.image_size}, {source.image_size}]; run one clip per call")
        if cls is not None:
            raise InputError(f"--cls {cls} is not available for LLaVA-OneVision clips: the pooling resizes each "
                             "frame's patch grid, without [CLS]")
        set_video(source, frames)

    def check_method(self, source: Source, config, site_spec: type) -> None:
        self.refuse_video_reads(source, config)
        super().check_method(source, config, site_spec)

    def llm_source(self, checkpoint, options: dict) -> Source:
        """The checkpoint's clip source (its images are refused in one line, as compile refuses them)."""
        source = self.adapter().load(checkpoint, None)
        self.fix(source, {"video_frames": options.get("video_frames")}, prune=False, batch=None, cls=None)
        return source

    def hf_image_inputs(self, config, source: Source, pixel: np.ndarray) -> dict:
        """A clip's frames [1, F, 3, S, S]: get_video_features' input (and the model's own forward's)."""
        return {"pixel_values_videos": torch.from_numpy(pixel)[None]}

    def llm_handoff(self, model: dict) -> dict:
        """The row after the kept ones that no output holds (the positions rule places it)."""
        return {"after_rows": {"row": "image_newline", "weight": "model.image_newline", "count": 1}}

    def cannot_draw(self, manifest: Manifest) -> str | None:
        return None

    def readme_section(self, manifest: Manifest) -> str:
        """Why in the README: the newline is a row of the LLM's input that no graph output holds."""
        return """
## Assembling the LLM input (LLaVA-OneVision clips)

`image_features` holds the clip's kept rows frame by frame. Append the checkpoint's `model.image_newline` vector
([D]) once after them, as transformers' get_video_features does after a clip's rows; it takes the position after the
dense clip's rows (offset + F·M), and the text follows it (the manifest's `llm.after_rows` and `llm.positions`).
"""
