"""`dycoke`: DyCoke's temporal token merging (TTM), its first stage, as the official code writes it (KD-TAO/DyCoke,
llava/model/llava_arch.py, dycole_ttm), compiled into the graph.

On the merged tokens of a video (T frames of N tokens each, frame by frame; for Qwen2-VL a frame is a temporal
patch), with k = int((1 - r)·N) tokens kept of each pruned frame (r: --merging-ratio, the official default 0.7):

1. Pairs (0, 1), (2, 3), ...: s_p = cosine between frame 2p + 1 and frame 2p, per position. Odd frame 2p + 1 keeps
   its k tokens of lowest similarity s_q with q = (2p - 2) // 2 as Python computes it: the previous pair's
   similarity, and for the first pair the last pair's (the official code's index, followed as written).
2. Groups of four: for i = 0, 4, ... while i < T - 4, frame i + 2 keeps its k tokens of lowest cosine to frame i
   (the last group of a clip is left out by that bound, as in the official code); every other even frame is
   kept whole.
3. K = N·(frames kept whole) + k·(frames pruned), known at compile time (Method.at_site sets it; --keep does not
   apply). Output: the kept tokens frame by frame.

The second stage of DyCoke (dynamic pruning of the KV cache while decoding) belongs to the LLM, not to the vision
graph, and is not part of this method.

Choices where the official code is batch-1 only or silent:
- batched: every clip of the batch has its own kept sets of the same sizes (no host sync);
- ties go to the lower index (torch.topk does not promise an order);
- each pruned frame's kept tokens come back in ascending order (the official code keeps topk's order, lowest
  similarity first): the project's rule, so that the kept tokens stay in raster order within their frame;
- an odd T is refused: the official code drops an unpaired last frame without saying so;
- the cosine of stage 1 is taken between L2-normalised rows (torch's normalize, eps 1e-12), as the official code
  does, which equals stage 2's cosine of the raw rows up to rounding.
The graph: standard ops, one TopK per pruned frame and one to sort it, static shapes throughout.
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

DEFAULT_RATIO = 0.7  # the official merging_ratio


def schedule(frames: int) -> dict[int, tuple[str, int]]:
    """Pruned frame -> (what its similarity compares, the other frame): ("pair", q) for an odd frame, scored by pair
    q's similarity (frame 2q + 1 against 2q); ("frame", i) for frame i + 2 scored against frame i."""
    pairs = frames // 2
    plan = {2 * p + 1: ("pair", (2 * p - 2) // 2 % pairs) for p in range(pairs)}
    plan.update({i + 2: ("frame", i) for i in range(0, frames - 4, 4)})
    return dict(sorted(plan.items()))


def kept_per_frame(tokens_per_frame: int, ratio: float) -> int:
    """k = int((1 - r)·N) as the official code computes it (merging_ratio = 1 - r, then int())."""
    return int((1 - ratio) * tokens_per_frame)


def total_kept(tokens_per_frame: int, frames: int, ratio: float) -> int:
    pruned = len(schedule(frames))
    return tokens_per_frame * (frames - pruned) + kept_per_frame(tokens_per_frame, ratio) * pruned


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(COSINE_EPS)  # noqa: E731
    return (unit(a) * unit(b)).sum(dim=-1)


class DyCokeMethod(Method):
    name = "dycoke"
    summary = ("DyCoke's temporal token merging: of every odd frame and every fourth frame, keep the tokens least "
               "like an earlier frame's (video: compile --video-frames F)")
    official = "https://github.com/KD-TAO/DyCoke"
    options = {"merging_ratio": (float, "dycoke: the share r of each pruned frame's tokens dropped (official default "
                                        "0.7): each keeps int((1 - r)·N); K follows from it (--keep does not apply)")}
    local_merge = False
    no_local_merge_why = "DyCoke keeps whole tokens at their (t, h, w)"

    def defaults(self, keep: int) -> dict:
        return {"merging_ratio": DEFAULT_RATIO}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        ratio = finite_option(self.name, "merging-ratio", params["merging_ratio"], 0.0)
        if ratio >= 1.0:
            raise InputError(f"--merging-ratio of method dycoke must be < 1, got {ratio:g}")
        params["merging_ratio"] = ratio
        return params

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES)

    def serves(self) -> tuple:
        return ((VIDEO, ""),)

    def at_site(self, params: dict, spec: SiteSpec) -> dict:
        frames = spec.frames
        if frames < 4 or frames % 2 or spec.num_patches % frames:
            return params  # check() refuses it
        return {**params, "keep": total_kept(spec.num_patches // frames, frames, params["merging_ratio"])}

    def check(self, params: dict, spec: SiteSpec) -> None:
        frames, n = spec.frames, spec.num_patches
        if frames < 4 or frames % 2:
            raise InputError(f"method dycoke prunes frames in pairs and groups of four and needs a video of an even "
                             f"number of frames, at least 4 (compile --video-frames F; Qwen: F/2 temporal patches), "
                             f"got {frames}")
        if n % frames:
            raise InputError(f"method dycoke needs whole frames: {n} tokens are not {frames} frames of equal size")
        params = self.at_site(params, spec)
        if kept_per_frame(n // frames, params["merging_ratio"]) < 1:
            raise InputError(f"--merging-ratio {params['merging_ratio']:g} keeps no token of a pruned frame "
                             f"({n // frames} tokens a frame)")
        super().check(params, spec)

    def describe(self, params: dict) -> str:
        return (f"DyCoke TTM: {params['keep']} tokens, each pruned frame keeping the {1 - params['merging_ratio']:.2g} "
                "of its tokens least like an earlier frame's")

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        b, n, d = patches.shape
        frames = inputs.frames
        per = n // frames
        k = kept_per_frame(per, params["merging_ratio"])
        x = patches.reshape(b, frames, per, d)
        pairs = _cosine(x[:, 1::2], x[:, 0::2])  # [B, T/2, N]: frame 2p + 1 against 2p
        plan = schedule(frames)
        blocks, cuts = [], []
        for j in range(frames):
            if j not in plan:
                blocks.append(torch.arange(per).expand(b, per) + j * per)
                continue
            kind, other = plan[j]
            sim = pairs[:, other] if kind == "pair" else _cosine(x[:, j], x[:, other])
            blocks.append(topk_lower_index(sim, k, largest=False).sort(dim=-1).values + j * per)
            cuts.append((j * per, -sim.detach(), k))  # higher kept: the k least similar
        kept = torch.cat(blocks, dim=1)
        # No clip-wide score: each pruned frame has its own TopK over its own positions. A still frame's tokens all
        # have cosine 1 to the frame they are compared with, up to rounding, so parity judges each mismatch against
        # its own frame's cut (compiler.parity.compare_local_cuts).
        return TorchResult(torch.cat([*cls, gather_rows(patches, kept)], dim=1), kept, {"local_cuts": cuts})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        n, frames = inputs.num_patches, inputs.frames
        per = n // frames
        k = kept_per_frame(per, params["merging_ratio"])
        with b.role(TOKENS):
            cls = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else inputs.hidden
        plan = schedule(frames)
        with b.role(SCORE):
            clip = b.op("Reshape", [patches, b.ints("clip_shape", [0, frames, per, -1])], "clip")
            unit = b.l2_normalize(clip, "unit", COSINE_EPS)
            odd = b.op("Slice", [unit, b.ints("odd_start", [1]), b.ints("odd_end", [frames]), b.ints("odd_axis", [1]),
                                 b.ints("odd_step", [2])], "odd_frames")
            even = b.op("Slice", [unit, b.ints("even_start", [0]), b.ints("even_end", [frames]),
                                  b.ints("even_axis", [1]), b.ints("even_step", [2])], "even_frames")
            pairs = b.reduce("ReduceSum", b.op("Mul", [odd, even], "pair_products"), [-1], 0, "pair_cosine")
            sims = {}
            for j, (kind, other) in plan.items():
                if kind == "pair":
                    sims[j] = b.op("Gather", [pairs, b.ints(f"pair_of_{j}", other)], f"similarity_{j}", axis=1)
                else:
                    frame = b.op("Gather", [unit, b.ints(f"frame_{j}", j)], f"unit_{j}", axis=1)
                    ref = b.op("Gather", [unit, b.ints(f"frame_{other}", other)], f"unit_{other}_for_{j}", axis=1)
                    sims[j] = b.reduce("ReduceSum", b.op("Mul", [frame, ref], f"products_{j}"), [-1], 0,
                                       f"similarity_{j}")
        with b.role(SELECT):
            batch = b.op("Shape", [patches], "batch", start=0, end=1)
            whole_shape = b.op("Concat", [batch, b.ints("whole_dims", [per])], "whole_shape", axis=0)
            blocks = []
            for j in range(frames):
                if j not in plan:
                    blocks.append(b.op("Expand", [b.ints(f"whole_{j}", np.arange(per)[None] + j * per), whole_shape],
                                       f"kept_{j}"))
                    continue
                _, low = b.op("TopK", [sims[j], b.ints(f"k_{j}", [k])], f"least_like_{j}", num_outputs=2, axis=-1,
                              largest=0, sorted=1)
                ordered = b.sort_ascending(low, k, f"sorted_{j}")
                blocks.append(b.op("Add", [ordered, b.ints(f"offset_{j}", j * per)], f"kept_{j}"))
            kept = b.op("Concat", blocks, "kept", axis=1)
        with b.role(TOKENS):
            gathered = b.gather_rows(patches, kept, "gather_kept")
            tokens = b.op("Concat", [*cls, gathered], "tokens", axis=1) if cls else gathered
        return tokens, kept
