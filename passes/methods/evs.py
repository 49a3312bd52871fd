"""`evs`: Efficient Video Sampling, as vLLM defines it (vllm/multimodal/evs.py), compiled into the graph.

On the merged tokens of a video (the projector output of T frames of H x W tokens, frame by
frame in raster order: the site's N = T·HW rows):

1. Dissimilarity of token (t, h, w) = 1 - cosine to the token at (t - 1, h, w), the same
   position in the previous frame; the first frame gets 255, above any 1 - cosine (at most 2),
   so that it is always kept.
2. A stable descending order over all T·HW positions (ties to the lower index: earlier frame,
   then raster order); the first K are kept, back in ascending order: the kept tokens keep their
   original (t, h, w) and so their positions for the LLM (the family's position table).
3. K: `--keep K` over the whole clip, or `--video-pruning-rate q` as vLLM names it,
   K = max(HW, floor(T·HW·(1 - q))) (vLLM's compute_retained_tokens_count, with its float
   arithmetic), resolved when the site's frames are known (Method.at_site).

Choices where vLLM's code is one clip at a time or silent:
- batched: every clip of the batch has its own K-subset of the same size (no host sync);
- cosine as torch.nn.functional.cosine_similarity computes it: each row divided by
  max(||x||, 1e-8), then the dot product (equal in float64 to torch 2.13's function);
- --keep K below HW is refused: vLLM never keeps fewer than the first frame;
- a [CLS] prefix in the features (LLaVA's `full` strategy) passes through, only patch tokens
  are pruned.

The graph: Reshape to [B, T, HW, D], L2-normalise, Mul + ReduceSum of frames 1.. with frames
..T-1, Concat with the first frame's 255, TopK (ONNX TopK returns equal values lower index
first: the stable order), TopK of the indices (ascending), GatherND: standard ops, static shapes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import COSINE_EPS, SITE_FEATURES, VIDEO
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import (GraphInputs, Method, Needs, SiteSpec, SiteTensors, TorchResult,
                                           finite_option)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, split_prefix, topk_lower_index

FIRST_FRAME = 255.0  # vLLM's score of every first-frame token: above any 1 - cosine


def retained_tokens(tokens_per_frame: int, frames: int, rate: float) -> int:
    """K for pruning rate q: max(HW, floor(T·HW·(1 - q))), in vLLM's arithmetic (a Python float, then int())."""
    return max(tokens_per_frame, int(tokens_per_frame * frames * (1 - rate)))


def dissimilarity(patches: torch.Tensor, frames: int) -> torch.Tensor:
    """[B, T·HW, D] -> [B, T·HW]: 1 - cosine to the same position one frame earlier; 255 on the first frame."""
    b, n, d = patches.shape
    x = patches.reshape(b, frames, n // frames, d)
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(COSINE_EPS)
    moved = 1.0 - (unit[:, 1:] * unit[:, :-1]).sum(dim=-1)
    first = torch.full_like(moved[:, :1], FIRST_FRAME) if frames > 1 else torch.full_like(x[:, :1, :, 0],
                                                                                         FIRST_FRAME)
    return torch.cat([first, moved], dim=1).reshape(b, n)


def parse_rate(method: str, params: dict) -> dict:
    """--video-pruning-rate q, vLLM's q in [0, 1), checked (evs and evs-encoder take it alike)."""
    if params.get("video_pruning_rate") is not None:
        rate = finite_option(method, "video-pruning-rate", params["video_pruning_rate"], 0.0)
        if rate >= 1.0:
            raise InputError(f"--video-pruning-rate of method {method} must be < 1 (vLLM's q in [0, 1)), got {rate:g}")
        params["video_pruning_rate"] = rate
    return params


def emit_dissimilarity(b, patches: ir.Value, frames: int, per_frame: int) -> ir.Value:
    """dissimilarity in the graph: [B, T·HW, D] -> [B, T, HW] (1 - cosine to the same position one frame earlier,
    255 on the first frame); evs ranks it over the clip, evs-encoder at block L per pooling window."""
    clip = b.op("Reshape", [patches, b.ints("clip_shape", [0, frames, per_frame, -1])], "clip")
    unit = b.l2_normalize(clip, "unit", COSINE_EPS)
    later = b.slice(unit, 1, frames, 1, "later_frames")
    earlier = b.slice(unit, 0, frames - 1, 1, "earlier_frames")
    cosine = b.reduce("ReduceSum", b.op("Mul", [later, earlier], "products"), [-1], 0, "cosine")
    moved = b.op("Sub", [b.scalar("one", 1.0), cosine], "dissimilarity")  # [B, T-1, HW]
    batch = b.op("Shape", [patches], "batch", start=0, end=1)
    first_shape = b.op("Concat", [batch, b.ints("first_frame_dims", [1, per_frame])], "first_shape", axis=0)
    first = b.op("Expand", [b.scalar("first_frame", FIRST_FRAME), first_shape], "first_frame_scores")
    return b.op("Concat", [first, moved], "frame_scores", axis=1)


class EvsMethod(Method):
    name = "evs"
    summary = ("EVS (vLLM's efficient video sampling): per position, keep the tokens that changed most since the "
               "previous frame; the first frame always (video: compile --video-frames F)")
    official = "https://github.com/vllm-project/vllm/blob/main/vllm/multimodal/evs.py"
    options = {"video_pruning_rate": (float, "evs: vLLM's pruning rate q in [0, 1): K = max(tokens per frame, "
                                             "floor(T·HW·(1 - q))) over the clip, in place of --keep")}
    local_merge = False
    no_local_merge_why = "EVS keeps tokens at their (t, h, w); merging them with neighbours is not EVS"

    def parse(self, keep, options):
        return parse_rate(self.name, super().parse(keep, options))

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES)

    def serves(self) -> tuple:
        return ((VIDEO, ""),)

    def at_site(self, params: dict, spec: SiteSpec) -> dict:
        """With --video-pruning-rate q: K from the site's frames and tokens per frame (vLLM's count)."""
        rate = params.get("video_pruning_rate")
        if rate is None or spec.frames < 2 or spec.num_patches % spec.frames:
            return params  # check() refuses what is not a video of whole frames
        return {**params, "keep": retained_tokens(spec.num_patches // spec.frames, spec.frames, rate)}

    def check(self, params: dict, spec: SiteSpec) -> None:
        frames, n = spec.frames, spec.num_patches
        if frames < 2:
            raise InputError("method evs prunes tokens that repeat the previous frame and needs a video of at least "
                             "2 frames (compile --video-frames F with a family that takes video: "
                             "`vlmprune methods`)")
        if n % frames:
            raise InputError(f"method evs needs whole frames: {n} tokens are not {frames} frames of equal size")
        params = self.at_site(params, spec)
        per_frame, keep = n // frames, params["keep"]
        if not per_frame <= keep < n:
            raise InputError(f"--keep of method evs must satisfy {per_frame} <= keep < {n} (EVS always keeps the "
                             f"first frame's {per_frame} tokens; the clip has {n}), got {keep}")
        super().check(params, spec)

    def describe(self, params: dict) -> str:
        rate = params.get("video_pruning_rate")
        return (f"EVS: {params['keep']} tokens of the clip that changed most since the previous frame, the first "
                "frame always" + (f" (--video-pruning-rate {rate:g})" if rate is not None else ""))

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        scores = dissimilarity(patches, inputs.frames)
        kept = topk_lower_index(scores, params["keep"]).sort(dim=-1).values
        return TorchResult(torch.cat([*cls, gather_rows(patches, kept)], dim=1), kept,
                           {"scores": scores, "boundary": params["keep"]})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep, n, frames = params["keep"], inputs.num_patches, inputs.frames
        per_frame = n // frames
        with b.role(TOKENS):
            cls = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else inputs.hidden
        with b.role(SCORE):
            scores = b.op("Reshape", [emit_dissimilarity(b, patches, frames, per_frame),
                                      b.ints("scores_shape", [0, n])], "scores")
        with b.role(SELECT):
            _, top = b.op("TopK", [scores, b.ints("keep", [keep])], "topk", num_outputs=2, axis=-1, largest=1,
                          sorted=1)
            kept = b.sort_ascending(top, keep, "kept")
        with b.role(TOKENS):
            gathered = b.gather_rows(patches, kept, "gather_kept")
            tokens = b.op("Concat", [*cls, gathered], "tokens", axis=1) if cls else gathered
        return tokens, kept

