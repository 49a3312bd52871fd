"""Family `qwen2_vl`: Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration).

Their vision tower takes the processor's flattened patches and grid_thw: a dynamic
resolution. A bundle is compiled for one static image size S (`--image-size`, a multiple
of patch x merge = 28; default 448): the input stays `pixel_values` [B, 3, S, S]
(normalised with the checkpoint's mean and std), and everything that depends only on the
grid is a constant of the graph. At 448: 32x32 = 1024 patches, merged 2x2 into 16x16 =
256 tokens, the tokens the LLM sees.

What the graph computes, image by image equal to the model's own get_image_features on the
patches Qwen2VLImageProcessor makes (tested against transformers, fp32):
- patch embedding: the processor repeats a still image temporal_patch_size times and the
  Conv3d spans those equal frames, which equals one MatMul with the kernel summed over
  time (half the FLOPs, no 9-D transpose in the graph);
- token order: the processor's merge-window order (each 2x2 group contiguous), and for
  Qwen2.5-VL then its window order (window_index), as one constant Gather;
- 2-D rotary cos/sin: transformers' own rotary module on the static grid, constants;
- attention: blocks listed in fullatt_block_indexes (every block of Qwen2-VL) attend over
  the whole image; the other Qwen2.5-VL blocks within windows: equal windows as a batch of
  windows (a reshape), unequal ones (S not a multiple of window_size) through a constant
  block-diagonal mask (a finite -1e4, which quantizers and fp16 toolchains can hold);
  batched throughout, no cu_seqlens and no loop over images;
- the patch merger (ln_q, then the MLP over each 2x2 group), then for Qwen2.5-VL the
  inverse window permutation: output [B, (S/28)^2, out_hidden] in raster order of the merged grid.

Only the vision weights are read (model.visual.* or visual.*, transformers 4 and 5 layouts),
never the LLM's. There is no [CLS]: divprune and dart prune the merged tokens, and so does
cls with `--score attention` (passes.methods.received: the attention each merged token receives
at the last full-attention block, whose Q and K the pipeline hands to the pruner with their
tokens grouped in the features' raster order); cls by [CLS] and visionzip are refused in one line.
Kept tokens carry their mRoPE positions (t, h, w)
(`positions` "thw", Source.position_table): merged token i sits at (0, i // W, i % W) of the
W x W merged grid, which plus the text offset is what get_rope_index gives the LLM.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import nn

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import (MERGED_TOKENS, PATCH_TOKENS, VIDEO, ChatPrompt, Family,
                                              IndicesPositions, Place)
from vlmprune.compiler.frontend.source import (CLIP_MEAN, CLIP_STD, Source, load_state, built,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.video import ClipInput
from vlmprune.compiler.frontend.tower import FEATURES, Pruner, SiteTensors

DEFAULT_IMAGE_SIZE = 448
WINDOW_MASK = -1e4  # finite: exp(-1e4 + logit) is 0 in fp32 and fp16 alike
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def visual_class(model_type: str):
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def build_visual(model_type: str, vision_config) -> nn.Module:
    """The vision tower of the config, its weights left to the caller (transformers' slow init skipped)."""
    return built(visual_class(model_type), vision_config, "sdpa")


def check_image_size(image_size, unit: int) -> int:
    """S, or one line: the merger needs whole merge x merge groups of patches, so S is a multiple of patch x merge."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < unit or image_size % unit:
        lower = max(unit, (image_size // unit) * unit) if isinstance(image_size, int) else unit
        raise InputError(f"--image-size must be a multiple of {unit} (patch x spatial merge) and >= {unit}, "
                         f"got {image_size!r} (e.g. {lower} or {lower + unit})")
    return image_size


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class QwenGrid(nn.Module):
    """Everything that depends only on the static grid, computed once with transformers' own helpers.

    Buffers (constants of the export, not weights: never in the state dict):
    order [N]: the raster patch index at each position of the tower's token order;
    cos, sin [N, dh]: the rotary tables in that order; unorder [M] or None: merged tokens of
    that order back to raster order; mask [N, N] or None: the window mask (unequal windows).
    """

    def __init__(self, visual: nn.Module, image_size: int, windowed: bool):
        super().__init__()
        from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

        cfg = visual.config
        self.patch, self.merge = cfg.patch_size, cfg.spatial_merge_size
        self.image_size = image_size
        self.side = image_size // self.patch  # patches along each side
        self.merged_side = self.side // self.merge
        unit = self.merge ** 2
        grid = torch.tensor([[1, self.side, self.side]])
        position_ids = get_vision_position_ids(grid, self.merge)  # (h, w) in merge-window order
        order = position_ids[:, 0] * self.side + position_ids[:, 1]
        with torch.no_grad():
            cos, sin = visual.rotary_pos_emb(torch.zeros(1), position_ids)
        self.windows: int | None = None  # equal windows: how many; None with a mask or no windows
        self.full_blocks = set(range(len(visual.blocks)))
        unorder = mask = None
        if windowed:
            self.full_blocks = set(cfg.fullatt_block_indexes)
            window_index, cu = get_vision_window_index(grid, self.merge, cfg.window_size, self.patch)

            def permute(t):
                return t.reshape(-1, unit, *t.shape[1:])[window_index].reshape(-1, *t.shape[1:])

            order, cos, sin = permute(order), permute(cos), permute(sin)
            unorder = torch.argsort(window_index)
            sizes = (cu[1:] - cu[:-1]).tolist()
            if len(set(sizes)) == 1:
                self.windows = len(sizes)
            else:
                ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
                mask = torch.where(ids[:, None] == ids[None, :], 0.0, WINDOW_MASK)
        self.register_buffer("order", order.long(), persistent=False)
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)
        self.register_buffer("unorder", unorder, persistent=False)
        self.register_buffer("mask", mask, persistent=False)

    @property
    def num_patches(self) -> int:
        return self.side * self.side

    @property
    def num_tokens(self) -> int:
        return self.merged_side * self.merged_side

    def positions(self) -> np.ndarray:
        """[M, 3] int64: (t, h, w) of each merged token (raster order) in the LLM's merged grid."""
        i = np.arange(self.num_tokens, dtype=np.int64)
        return np.stack([np.zeros_like(i), i // self.merged_side, i % self.merged_side], axis=1)


class QwenVisionPipeline(nn.Module):
    """pixel_values [B, 3, S, S] -> merged image features [B, M, out_hidden], with an optional FEATURES pruner.

    The interface compiler code asks of a pipeline (VisionPipeline's): with_pruner, num_blocks,
    prefix, has_cls, drop_cls, patch_size, last_trace. The blocks are spelled out over the
    checkpoint's own modules (norms, qkv, proj, MLP, merger) so that they run batched, export
    with torch.onnx dynamo, and compile with torch.compile.
    """

    def __init__(self, visual: nn.Module, grid: QwenGrid, pruner: Pruner | None = None, clip: int | None = None):
        super().__init__()
        if pruner is not None and pruner.site != FEATURES:
            raise InputError("qwen2_vl towers are pruned on the merged tokens (the features site) only")
        # Video (--video-frames F): the input is clips of F frames [n·F, 3, S, S]; the tower sees F / T temporal
        # patches of T = temporal_patch_size frames each, and the features are [n, (F / T)·M, D], frame by frame.
        self.clip = clip
        self.temporal = visual.config.temporal_patch_size
        self.visual = visual
        self.vision_model = visual
        self.grid = grid
        self.pruner = pruner
        self.num_blocks = len(visual.blocks)
        self.has_cls, self.prefix, self.drop_cls = False, 0, True
        self.patch_size = visual.config.patch_size
        self.last_trace: dict | None = None

    def with_pruner(self, pruner: Pruner | None) -> QwenVisionPipeline:
        """The same weights, grid and clip length, pruning (or not) as given."""
        return QwenVisionPipeline(self.visual, self.grid, pruner, self.clip)

    @property
    def frames(self) -> int:
        """Temporal patches per clip (the features' frames); 1 for a still image."""
        return self.clip // self.temporal if self.clip else 1

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> patch embeddings [B, N, D] in the tower's token order."""
        g, p = self.grid.side, self.grid.patch
        b, c = pixel_values.shape[0], pixel_values.shape[1]
        weight = self.visual.patch_embed.proj.weight  # [D, C, T, P, P]
        if self.clip:  # T consecutive frames per temporal patch, flattened (C, T, P, P) as the processor does
            t = self.temporal
            x = pixel_values.reshape(b // t, t, c, g, p, g, p).permute(0, 3, 5, 2, 1, 4, 6)
            h = x.reshape(b // t, g * g, c * t * p * p) @ weight.reshape(weight.shape[0], -1).t()
        else:
            x = pixel_values.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
            h = x @ weight.sum(dim=2).reshape(weight.shape[0], -1).t()
        return torch.index_select(h, 1, self.grid.order)  # one Gather on axis 1 (not GatherND)

    def block(self, index: int, h: torch.Tensor, capture: list | None = None) -> torch.Tensor:
        blk, grid = self.visual.blocks[index], self.grid
        attn = blk.attn
        b, n, d = h.shape
        heads = attn.num_heads
        qkv = attn.qkv(blk.norm1(h)).reshape(b, n, 3, heads, d // heads)
        q, k, v = qkv.unbind(2)  # [B, N, H, dh]
        cos, sin = grid.cos.unsqueeze(1), grid.sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if capture is not None:  # --score attention: this block's Q and K, [B, H, N, dh] (received.py)
            capture[:] = [q.transpose(1, 2), k.transpose(1, 2), attn.scaling]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if index in grid.full_blocks or (grid.windows is None and grid.mask is None):
            a = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=attn.scaling).transpose(1, 2)
        elif grid.windows is not None:  # equal windows, contiguous in the tower's order: a batch of windows
            w = n // grid.windows
            q, k, v = (t.reshape(b * grid.windows, w, heads, -1).transpose(1, 2) for t in (q, k, v))
            a = sdpa(q, k, v, scale=attn.scaling).transpose(1, 2)
        else:
            a = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=grid.mask,
                     scale=attn.scaling).transpose(1, 2)
        h = h + attn.proj(a.reshape(b, n, d))
        return h + blk.mlp(blk.norm2(h))

    def merge(self, h: torch.Tensor) -> torch.Tensor:
        """The patch merger over each group of merge² tokens, back to raster order of the merged grid."""
        merger = self.visual.merger
        b, n, d = h.shape
        unit = self.grid.merge ** 2
        out = merger.mlp(merger.ln_q(h).reshape(b, n // unit, d * unit))
        return out if self.grid.unorder is None else torch.index_select(out, 1, self.grid.unorder)

    # --- cls --score attention (passes.methods.received): the score block's Q and K for the pruner
    def score_block(self) -> int:
        """0-based: the last block whose attention spans the whole image (a single window counts)."""
        grid = self.grid
        whole = grid.windows == 1 or (grid.windows is None and grid.mask is None)
        return max(i for i in range(self.num_blocks) if whole or i in grid.full_blocks)

    def features_order(self) -> torch.Tensor:
        """[N]: tower positions of the patches of merged token 0, 1, ... (raster order), merge² each."""
        unit, m = self.grid.merge ** 2, self.grid.num_tokens
        groups = torch.arange(m) if self.grid.unorder is None else self.grid.unorder
        return (groups[:, None] * unit + torch.arange(unit)).reshape(-1)
    # --- end --score attention

    def forward(self, pixel_values: torch.Tensor):
        h = self.embed(pixel_values)
        capture: list = []
        score_block = self.score_block() if self.pruner is not None else -1
        for i in range(self.num_blocks):
            h = self.block(i, h, capture if i == score_block else None)
        h = self.merge(h)
        frames = self.frames
        if self.clip:  # each temporal patch attends within itself (HF's cu_seqlens per t): clips are batches of them
            h = h.reshape(h.shape[0] // frames, frames * h.shape[1], h.shape[2])
        if self.pruner is None:
            return h
        if self.clip:
            q = k = scale = None  # a video's methods read the features only (Qwen2VLFamily refuses the others)
        else:
            order = self.features_order()
            q, k, scale = capture[0][:, :, order], capture[1][:, :, order], capture[2]
        tokens, kept, self.last_trace = self.pruner(SiteTensors(h, False, q=q, k=k, scale=scale,
                                                                pixel_values=None if self.clip else pixel_values,
                                                                patch_size=self.patch_size, prefix=0, frames=frames))
        return tokens, kept


def qwen_source(spec: str, kind: str, model_type: str, visual: nn.Module, image_size: int, content_hash: str,
                mean=CLIP_MEAN, std=CLIP_STD) -> Source:
    """The Source of a loaded Qwen vision tower at a static image size (checkpoints and presets alike)."""
    cfg = visual.config
    check_image_size(image_size, cfg.patch_size * cfg.spatial_merge_size)
    windowed = model_type == "qwen2_5_vl"
    grid = QwenGrid(visual, image_size, windowed)
    pipeline = QwenVisionPipeline(visual, grid).eval()
    m = grid.merged_side
    tokens = {"image_size": image_size, "patch_grid": [grid.side, grid.side], "patches": grid.num_patches,
              "spatial_merge": grid.merge, "merged_grid_thw": [1, m, m], "tokens": grid.num_tokens}
    details = {"model_type": model_type, "feature_layer": -1, "select_strategy": "every merged token (no [CLS])",
               "vision_layers": len(visual.blocks), "token_counts": tokens,
               "positions_layout": "kept_positions [B, K, 3] = (t, h, w) in the merged grid; add the text offset "
                                   "(get_rope_index's start position) for the LLM's mRoPE"}
    if windowed:
        details["attention"] = {"full_blocks": sorted(grid.full_blocks), "window_size": cfg.window_size,
                                "windows": "equal" if grid.windows else "unequal (masked)"}
    return Source(spec, kind, Qwen2VLAdapter.family, content_hash, image_size, cfg.patch_size, False, tuple(mean),
                  tuple(std), pipeline=pipeline, positions="thw", spatial_merge=grid.merge,
                  position_table=grid.positions(), details=details)


def video_positions(grid: QwenGrid, frames: int, interval: float) -> np.ndarray:
    """[T·M, 3] int64: (t, h, w) of each merged token of a clip of T temporal patches, frame by frame, as
    get_rope_index places a video: t = floor(frame · interval) (Qwen2.5-VL: tokens_per_second x seconds per
    temporal patch; Qwen2-VL: 1), (h, w) the image's."""
    table = np.tile(grid.positions(), (frames, 1))
    table[:, 0] = (np.repeat(np.arange(frames), grid.num_tokens) * interval).astype(np.int64)
    return table


def video_patches(clip: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """[F, C, S, S] -> [T·N, C·temporal·P·P]: the flattened patches of one clip, laid out as transformers'
    Qwen2VLVideoProcessor lays them out (frames in groups of `temporal`, merge windows contiguous, each patch
    (C, T, P, P)): Hugging Face's get_video_features input, for generate's dense path and the tests."""
    f, c, s, _ = clip.shape
    g = s // patch
    x = clip.reshape(f // temporal, temporal, c, g // merge, merge, patch, g // merge, merge, patch)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(f // temporal * g * g, c * temporal * patch * patch)


def set_video(source: Source, frames: int) -> None:
    """Make the source a video one: clips of F frames, F / temporal_patch_size temporal patches of tokens.

    Seconds per temporal patch are get_rope_index's default (1: the processor's temporal_patch_size / fps is not
    known for frames sampled from a folder); the manifest records the interval the positions use.
    """
    pipe = source.pipeline
    cfg = pipe.visual.config
    t = frames // pipe.temporal
    interval = float(getattr(cfg, "tokens_per_second", 1) or 1) if source.details["model_type"] == "qwen2_5_vl" \
        else 1.0
    pipe.clip = frames
    source.frames = t
    source.position_table = video_positions(pipe.grid, t, interval)
    m = pipe.grid.merged_side
    counts = source.details["token_counts"]
    counts.update({"video_frames": frames, "temporal_patches": t, "merged_grid_thw": [t, m, m],
                   "tokens": t * pipe.grid.num_tokens, "time_interval": interval})
    source.details["video_frames"] = frames
    source.details["input"] = (f"one clip per call: pixel_values [{frames}, 3, S, S], its frames in order, each "
                               "preprocessed as a still image; features [1, T·M, D] frame by frame")


def check_mrope(checkpoint: Checkpoint) -> None:
    """mRoPE splits each head's rotary frequencies into (t, h, w) sections, which must cover them exactly.

    Hugging Face's own forward fails otherwise, deep in a torch.onnx export or a generate;
    a config like that is refused before any work.
    """
    text = getattr(checkpoint.config, "text_config", checkpoint.config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    section = rope.get("mrope_section")
    if section is None:
        return
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if not all(isinstance(n, int) for n in section) or sum(section) != head_dim // 2:
        raise InputError(f"{checkpoint.path}: mrope_section {list(section)} must sum to {head_dim // 2} (half the "
                         f"language model's head_dim {head_dim}); the checkpoint and config disagree")


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2_vl"
    model_types = MODEL_TYPES
    summary = "Qwen2-VL / Qwen2.5-VL vision tower + merger at a static --image-size; kept (t, h, w) positions"
    dynamic_resolution: ClassVar[bool] = True  # takes --image-size

    def load(self, checkpoint: Checkpoint, feature_layer: int | None, image_size: int | None = None) -> Source:
        if feature_layer is not None:
            raise InputError(f"--feature-layer does not apply to {checkpoint.model_type}: its image features are "
                             "the patch merger's output after the last block")
        config = checkpoint.config
        check_mrope(checkpoint)
        vcfg = config.vision_config
        unit = vcfg.patch_size * vcfg.spatial_merge_size
        image_size = check_image_size(DEFAULT_IMAGE_SIZE if image_size is None else image_size, unit)
        visual = build_visual(checkpoint.model_type, vcfg)
        state = read_safetensors(checkpoint.weights, ("model.visual.", "visual."))
        if not state:
            raise InputError(f"{checkpoint.path}: no vision weights (model.visual.* or visual.*) in the safetensors")
        load_state(visual, state, "vision tower")
        mean, std = checkpoint.preprocessing(CLIP_MEAN, CLIP_STD)
        return qwen_source(str(checkpoint.path.resolve()), "hf", checkpoint.model_type, visual, image_size,
                           sha256_files(checkpoint.files()), mean, std)


def thw_positions(offset: int, kept_positions: np.ndarray, grid_thw: tuple[int, int, int], extra: int = 0,
                  ) -> tuple[np.ndarray, int]:
    """mRoPE (Qwen2-VL): ([3, K + extra] (t, h, w) positions of the rows, the text position after the image).

    As Qwen2-VL's get_rope_index places an image: each axis starts at the placeholder's position,
    and the text resumes one past the largest position of the dense grid, offset + max(t, h, w).
    Extra rows (a method's summary token) sit there, equal on every axis, and the text after them.
    A dense image is kept_positions = the whole position table (Source.position_table).
    """
    kept_positions = np.asarray(kept_positions, dtype=np.int64).reshape(-1, 3)
    after = offset + max(grid_thw[1:])  # get_rope_index: the text resumes max(h, w) after a video's start too
    tail = np.broadcast_to(after + np.arange(extra, dtype=np.int64), (3, extra))
    return np.concatenate([offset + kept_positions.T, tail], axis=1).astype(np.int64), after + extra


class ThwPositions(IndicesPositions):
    """mRoPE: each kept row at its dense (t, h, w) (thw_positions), the text after the dense grid's largest axis."""

    kind = "thw"
    meaning = "kept_positions[b, j] is the (t, h, w) grid position of row prefix + j (mRoPE's three position axes)"
    rule = ("row prefix + j at offset + kept_positions[j] on each mRoPE axis (t, h, w); extra row e at "
            "offset + max(h, w) of the dense merged grid + e on every axis; text after the image from "
            "offset + max(h, w) + extra")
    needs_model = True

    def text_resumes_at(self, model: dict, dense: int | None, extra: int) -> int | None:
        grid = (model.get("token_counts") or {}).get("merged_grid_thw")
        return max(grid[1:]) + extra if grid else None

    def readme_places(self, rows: dict, dense, after) -> str:
        return (f"- row {rows['prefix']} + j: offset + kept_positions[j] on each mRoPE axis (t, h, w)\n"
                f"- merged row e: offset + {after - rows['extra'] if isinstance(after, int) else after} + e "
                "on every axis\n"
                f"- the text after the image: from offset + {after}")

    def place_dense(self, source: Source, tokens: int) -> Place:
        table, grid = source.position_table, merged_grid(source)
        if len(table) != tokens:
            raise ValueError(f"{tokens} dense rows for a {grid} merged grid")
        return lambda offset: thw_positions(offset, table, grid)

    def place_pruned(self, source: Source, features, kept, kept_positions, prefix: int, extra: int):
        table, grid = self.kept_table(source, kept, kept_positions, prefix), merged_grid(source)
        return features, lambda offset: thw_positions(offset, table, grid, extra)


def merged_grid(source: Source) -> tuple[int, int, int]:
    return tuple(source.details["token_counts"]["merged_grid_thw"])


class Qwen2VLFamily(ClipInput, Family):
    """Dynamic resolution: compiled at one static image size (--image-size); merged tokens, (t, h, w) positions."""

    id = "qwen2_vl"
    adapter = Qwen2VLAdapter
    options = {"image_size": (int, "Static image size S for dynamic-resolution models (qwen2_vl, qwen2_5_vl): a "
                                   "multiple of patch x merge (28). Default 448 (1024 patches, 256 merged tokens)."),
               "video_frames": (int, "Video (qwen2_vl, qwen2_5_vl): compile for clips of F frames (static, a multiple "
                                     "of the temporal patch, 2): the input is one clip's frames [F, 3, S, S] "
                                     "(run/check --video PATH), the features its F/2 temporal patches of tokens")}
    has = {PATCH_TOKENS: "Qwen2-VL / Qwen2.5-VL", MERGED_TOKENS: "Qwen2-VL / Qwen2.5-VL", VIDEO: "Qwen2-VL / Qwen2.5-VL"}
    positions = ThwPositions()
    language_model = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                      "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
    whole_vlm_llm = ("qwen2_5_vl",)  # Edge-LLM exports Qwen2.5-VL's language model from the whole checkpoint

    vision_span = ("vision_start_token_id", "vision_end_token_id")
    chat = ChatPrompt("<|image_pad|>", "<|vision_start|>{mark}<|vision_end|>{prompt}",
                      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                      "<|vision_start|>{mark}<|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n",
                      "Qwen2-VL's chat convention", span=("<|vision_start|>", "<|vision_end|>"))

    def llm_source(self, checkpoint, options: dict) -> Source:
        source = self.adapter().load(checkpoint, None, image_size=options.get("image_size"))
        if options.get("video_frames"):
            self.fix(source, {"video_frames": options["video_frames"]}, prune=False, batch=None, cls=None)
        return source

    def hf_image_inputs(self, config, source: Source, pixel: np.ndarray) -> dict:
        """The processor's patches and image_grid_thw of the already-resized image; of a video source, the video
        processor's patches and video_grid_thw of the clip's frames [F, 3, S, S]."""
        from transformers import Qwen2VLImageProcessorPil

        if source.frames > 1:
            vcfg = config.vision_config
            patches = video_patches(torch.from_numpy(pixel), vcfg.patch_size, vcfg.spatial_merge_size,
                                    vcfg.temporal_patch_size)
            side = source.image_size // vcfg.patch_size
            return {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([[source.frames, side, side]])}

        vcfg = config.vision_config
        processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False,
                                             do_convert_rgb=False, patch_size=vcfg.patch_size,
                                             merge_size=vcfg.spatial_merge_size,
                                             temporal_patch_size=vcfg.temporal_patch_size)
        inputs = processor(images=list(pixel), return_tensors="pt", input_data_format="channels_first")
        return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        frames = options.get("video_frames")
        if frames is not None:
            temporal = source.pipeline.temporal
            if frames % temporal or frames < 2 * temporal:
                raise InputError(f"--video-frames must be a multiple of the temporal patch ({temporal}) and at least "
                                 f"{2 * temporal} (two temporal patches), got {frames}")
            if batch is not None:
                raise InputError(f"--batch does not apply to video: the input is the {frames} frames of one clip "
                                 f"[{frames}, 3, {source.image_size}, {source.image_size}]; run one clip per call")
            set_video(source, frames)
        super().fix(source, options, prune=prune, batch=batch, cls=cls)

    def check_method(self, source: Source, config, site_spec: type) -> None:
        self.refuse_video_reads(source, config)
        super().check_method(source, config, site_spec)

    def check_options(self, given: dict) -> None:
        self.check_frames(given)
        size = given.get("image_size")
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int):
            raise InputError(f"--image-size must be an integer, got {size!r}")
        if size < 1:
            raise InputError(f"--image-size must be >= 1, got {size}")
