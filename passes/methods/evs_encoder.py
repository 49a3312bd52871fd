"""`evs-encoder`: EVS's temporal rule inside the tower, so that its later blocks run on fewer tokens.

`evs` prunes the projector output, after the whole tower has run on every frame: it saves the
LLM's prefill, not the encoder. For a per-frame family (LLaVA-NeXT-Video, compile --video-frames F:
the clip's frames are the tower's batch, each a still image) this method drops, after block L,
the tokens that repeat the previous frame, and the blocks L+1.. run on what is left:

1. At block L's output, per patch position: 1 - cosine of the token to the same position in the
   previous frame (evs.dissimilarity, the cosine as torch computes it), 255 on the first frame, so
   that it is always kept.
2. The unit kept is the pooling window (the resampler's stride x stride patches, 2x2 by default):
   the pooled row is the token the LLM reads, and a window with a patch missing cannot be pooled
   as the model was trained (AvgPool over all of them). A window's score is the mean of its
   patches' dissimilarities (stride 1, no pooling: exactly the per-patch rule).
3. A stable descending TopK over the clip's F·M windows (ties to the lower index: earlier frame,
   then raster order, as ONNX TopK returns them), the first K kept, in ascending order: K counts
   LLM rows, as evs's --keep does; `--video-pruning-rate q` gives vLLM's K = max(M, floor(F·M·(1 - q))).
4. The blocks after L run on the clip's kept tokens flattened into one sequence: the F frames'
   [CLS] tokens, then the kept windows' patches, [1, F + K·stride², D], under a block-diagonal
   per-frame mask (0 within a frame, -1e4 across: exp of it is 0 in fp32 and fp16), so that each
   token attends exactly to its own frame's kept tokens and [CLS], as the dense tower attends within
   a frame. Why flattened and not equal per-frame counts: EVS's rule is one TopK over the clip with
   the first frame whole, so the counts per frame are ragged by construction (a still frame may keep
   nothing, a scene cut everything); equal counts would keep still frames' tokens and drop a cut's.
   The cost of the choice: the masked attention spans the whole sequence, (F + K·s²)² logits where
   the dense tower has F·(1 + HW)²; the QKV, output and MLP matmuls, most of a block's work at these
   sizes, scale with the F + K·s² tokens.
5. After the last block the graph runs, the tokens are scattered back to the dense layout
   [F, 1 + HW, D] (dropped positions zero) and the family's own tail runs unchanged (select
   strategy, resampler, projector); the output keeps the K kept windows' rows, [1, K, D], and
   kept_indices [1, K] are their row indices f·M + m in the clip's dense features (as evs's).
   The tail runs on every window, the dropped ones' zeros too: the projector over F·M rows is a
   few percent of a tower's work, and the tail stays the model's own code whatever its pooling
   (average, max or conv).

Refused in one line: a site at the last block the graph runs (nothing after it would run on fewer
tokens: use evs), a patch grid the stride does not divide, a tower whose attention is the fused
ONNX `Attention` op (the mask goes on the Softmax's logits), --keep outside M <= K < F·M.
Standard ONNX ops, static shapes; the kept rows equal the reference's at parity (ort), and each
frame's kept tokens through the later blocks equal the HF tower's layers run on that frame alone
(tests/compiler/test_llava_next_video.py).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import BATCH_META, RESTORED_META, TOKENS_META
from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.compiler.contract import FRAME_TOWER
from vlmprune.passes.methods.base import BLOCK, GraphInputs, Method, Needs, SiteSpec, SiteTensors, TorchResult
from vlmprune.passes.methods.builder import SCORE, SELECT, TOKENS
from vlmprune.passes.methods.evs import dissimilarity, emit_dissimilarity, parse_rate, retained_tokens
from vlmprune.passes.methods.selection import gather_rows, topk_lower_index

MASKED = -1e4  # across frames: finite, as the Qwen window masks (exp(-1e4 + logit) is 0 in fp32 and fp16)


def window_order(side: int, stride: int) -> np.ndarray:
    """[HW] patch indices in pooling-window order: window m (raster over the side/stride grid), then its
    stride x stride patches in raster order; window m's patches are order[m·s² : (m + 1)·s²]."""
    g = np.arange(side * side).reshape(side // stride, stride, side // stride, stride)
    return g.transpose(0, 2, 1, 3).reshape(-1)


def window_scores(patches: torch.Tensor, frames: int, stride: int) -> torch.Tensor:
    """[n·F, HW, D] block-L patches -> [n, F·M]: the mean over each pooling window of its patches' dissimilarity
    (1 - cosine to the same position one frame earlier; 255 on the first frame)."""
    nf, hw, d = patches.shape
    order = torch.from_numpy(window_order(math.isqrt(hw), stride))
    moved = dissimilarity(patches.reshape(nf // frames, frames * hw, d), frames)
    moved = moved.reshape(nf // frames, frames, hw)[:, :, order]
    return moved.reshape(nf // frames, frames, -1, stride * stride).mean(dim=-1).reshape(nf // frames, -1)


class EvsEncoderMethod(Method):
    name = "evs-encoder"
    summary = ("EVS inside the tower (per-frame video towers: LLaVA-NeXT-Video --video-frames F): after block L, "
               "keep the pooling windows that changed most since the previous frame, the first frame always; the "
               "later blocks run on them")
    official = "https://github.com/vllm-project/vllm/blob/main/vllm/multimodal/evs.py"
    options = {"video_pruning_rate": (float, "evs-encoder: vLLM's pruning rate q in [0, 1): K = max(rows per frame, "
                                             "floor(F·M·(1 - q))) pooled rows over the clip, in place of --keep")}
    later_blocks = True

    def parse(self, keep, options):
        return parse_rate(self.name, super().parse(keep, options))

    def needs(self, params: dict) -> Needs:
        return Needs(site=BLOCK)

    def serves(self) -> tuple:
        return ((FRAME_TOWER, ""),)

    def at_site(self, params: dict, spec: SiteSpec) -> dict:
        """The clip's frames and the pool stride (the source's spatial merge) join the parameters: the graph shows
        neither; with --video-pruning-rate q, K from them (vLLM's count)."""
        if spec.merge is None or spec.frames < 2:  # a graph's site: the family's at_site ran before
            return params
        per_frame = spec.num_patches // (spec.merge * spec.merge)
        params = {**params, "frames": spec.frames, "stride": spec.merge, "rows_per_frame": per_frame}
        rate = params.get("video_pruning_rate")
        if rate is not None:
            params["keep"] = retained_tokens(per_frame, spec.frames, rate)
        return params

    def check(self, params: dict, spec: SiteSpec) -> None:
        params = self.at_site(params, spec)
        if spec.frames < 2 or "frames" not in params:
            raise InputError(f"method {self.name} drops tokens that repeat the previous frame inside a per-frame "
                             "video tower and needs a clip (compile --video-frames F with LLaVA-NeXT-Video; "
                             "`vlmprune methods`)")
        if spec.layer is not None and spec.num_blocks is not None and spec.layer >= spec.num_blocks:
            raise InputError(f"method {self.name} at block {spec.layer} of {spec.num_blocks}: no block after it would "
                             "run on fewer tokens (pass --layer L below the last, or use evs on the features)")
        hw, stride, frames = spec.num_patches, params["stride"], params["frames"]
        side = math.isqrt(hw)
        if side * side != hw or side % stride:
            raise InputError(f"method {self.name} keeps whole pooling windows of {stride}x{stride} patches, and this "
                             f"tower's {hw} patches per frame are not a square grid they tile")
        per_frame = hw // (stride * stride)
        keep = params["keep"]
        if not per_frame <= keep < frames * per_frame:
            raise InputError(f"--keep of method {self.name} must satisfy {per_frame} <= keep < {frames * per_frame} "
                             f"(pooled rows: the first frame's {per_frame} always; the clip has "
                             f"{frames * per_frame}), got {keep}")

    def site_tokens(self, params: dict, spec: SiteSpec) -> int:
        """The later blocks' sequence: every frame's prefix ([CLS]), then the kept windows' patches."""
        return params["frames"] * spec.prefix + params["keep"] * params["stride"] ** 2

    def comparable_rows(self, params: dict, ref_kept: np.ndarray, cand_kept: np.ndarray) -> np.ndarray:
        """A kept row depends on its frame's kept set (the per-frame mask) and on nothing else: where a tie kept other
        windows, the rows of the frames whose kept windows agree on both sides are comparable, and only those."""
        per_frame = params["rows_per_frame"]
        same = [f for f in range(params["frames"])
                if np.array_equal(ref_kept[ref_kept // per_frame == f], cand_kept[cand_kept // per_frame == f])]
        return np.intersect1d(ref_kept[np.isin(ref_kept // per_frame, same)], cand_kept)

    def output_batch(self, params: dict, batch):
        return 1 if isinstance(batch, int) else batch  # one clip: its frames become one sequence

    def describe(self, params: dict) -> str:
        rate = params.get("video_pruning_rate")
        return (f"EVS in the encoder: after block L, the {params['keep']} pooled rows of the clip that changed most "
                "since the previous frame, the first frame always; the later blocks run on their patches"
                + (f" (--video-pruning-rate {rate:g})" if rate is not None else ""))

    # ------------------------------------------------------------------ the reference

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        raise NotImplementedError(f"method {self.name} runs the later blocks too: reference_later")

    def reference_later(self, params: dict, blocks: list, inputs: SiteTensors) -> TorchResult:
        frames, stride, keep, p = params["frames"], params["stride"], params["keep"], inputs.prefix
        h = inputs.hidden  # [n·F, p + HW, D]
        nf, tokens, d = h.shape
        n, hw, w = nf // frames, tokens - p, stride * stride
        per_frame = hw // w
        order = torch.from_numpy(window_order(math.isqrt(hw), stride))
        scores = window_scores(h[:, p:], frames, stride)
        kept = topk_lower_index(scores, keep).sort(dim=-1).values  # [n, K] window rows f·M + m
        windows = h[:, p:][:, order].reshape(n, frames * per_frame, w * d)
        seq = torch.cat([h[:, :p].reshape(n, frames * p, d), gather_rows(windows, kept).reshape(n, keep * w, d)], 1)
        frame_of = torch.cat([torch.arange(frames).repeat_interleave(p)[None].expand(n, -1),
                              (kept // per_frame).repeat_interleave(w, dim=1)], dim=1)  # [n, T]
        mask = torch.where(frame_of[:, :, None] == frame_of[:, None, :], 0.0, MASKED)[:, None].to(h.dtype)
        for run in blocks:
            seq, _ = run(seq, bias=mask)
        # back to the dense layout: slot of each token in [F·(p + HW)] rows
        prefix_slots = (torch.arange(frames)[:, None] * tokens + torch.arange(p)[None]).reshape(1, -1).expand(n, -1)
        patch_slots = (kept // per_frame * tokens + p)[..., None] + order.reshape(per_frame, w)[kept % per_frame]
        slots = torch.cat([prefix_slots, patch_slots.reshape(n, -1)], dim=1)
        dense = torch.zeros(n, frames * tokens, d, dtype=h.dtype).scatter(1, slots[..., None].expand(-1, -1, d), seq)
        return TorchResult(dense.reshape(nf, tokens, d), kept, {"scores": scores, "boundary": keep})

    # ------------------------------------------------------------------ the graph

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        frames, stride, keep, p = params["frames"], params["stride"], params["keep"], inputs.prefix
        hw, w = inputs.num_patches, stride * stride
        per_frame, tokens = hw // w, p + hw
        order = window_order(math.isqrt(hw), stride)
        later = inputs.structure.blocks[inputs.block.index:]
        if any(block.softmax is None for block in later):
            raise StructureError(f"method {self.name} masks the later blocks' attention logits per frame, and this "
                                 "graph's attention is the fused ONNX Attention op (export it decomposed)")
        with b.role(TOKENS):
            patches = b.slice(inputs.hidden, p, tokens, 1, "patches")  # [F, HW, D]
            windows = b.op("Reshape", [b.op("Gather", [patches, b.ints("window_order", order)], "window_major",
                                            axis=1), b.ints("windows_shape", [frames * per_frame, -1])], "windows")
        with b.role(SCORE):
            clip = b.op("Reshape", [patches, b.ints("clip_shape", [1, frames * hw, -1])], "clip")
            moved = emit_dissimilarity(b, clip, frames, hw)  # [1, F, HW]
            moved = b.op("Reshape", [b.op("Gather", [moved, b.ints("score_order", order)], "scores_by_window",
                                          axis=2), b.ints("window_scores_shape", [1, frames, per_frame, w])],
                         "window_dissimilarity")
            scores = b.op("Reshape", [b.reduce("ReduceMean", moved, [-1], 0, "window_mean"),
                                      b.ints("scores_shape", [1, frames * per_frame])], "scores")
        with b.role(SELECT):
            _, top = b.op("TopK", [scores, b.ints("keep", [keep])], "topk", num_outputs=2, axis=-1, largest=1,
                          sorted=1)
            kept = b.sort_ascending(top, keep, "kept")  # [1, K]
            flat = b.op("Reshape", [kept, b.ints("kept_flat_shape", [keep])], "kept_flat")
            frame_of = b.op("Div", [flat, b.ints("per_frame", per_frame)], "frame_of")
            within = b.op("Mod", [flat, b.ints("per_frame_mod", per_frame)], "window_of")
        with b.role(TOKENS):
            chosen = b.op("Gather", [windows, flat], "kept_windows", axis=0)  # [K, w·D]
            parts = [b.op("Reshape", [b.slice(inputs.hidden, 0, p, 1, "prefix"), b.ints("prefix_shape",
                                                                                     [1, frames * p, -1])],
                          "prefixes")] if p else []
            seq = b.op("Concat", [*parts, b.op("Reshape", [chosen, b.ints("kept_shape", [1, keep * w, -1])],
                                               "kept_patches")], "sequence", axis=1)
            # each token's frame: the per-frame mask of the later blocks
            ids = b.op("Reshape", [b.op("Expand", [b.unsqueeze(frame_of, [1], "frame_col"), b.ints("w", [1, w])],
                                        "frame_of_patches"), b.ints("ids_shape", [keep * w])], "patch_frames")
            if p:
                ids = b.op("Concat", [b.ints("prefix_frames", np.repeat(np.arange(frames), p)), ids], "frames",
                           axis=0)
            same = b.op("Equal", [b.unsqueeze(ids, [1], "ids_col"), b.unsqueeze(ids, [0], "ids_row")], "same_frame")
            mask = b.unsqueeze(b.op("Where", [same, b.scalar("inside", 0.0), b.scalar("across", MASKED)],
                                    "frame_mask"), [0, 1], "mask")  # [1, 1, T, T]
        seq.metadata_props[BATCH_META] = f"{frames},1"
        for block in later:
            logits = block.softmax.inputs[0]
            with b.after(logits.producer()), b.role(TOKENS):
                b.reroute(logits, b.op("Add", [logits, mask], f"frame_mask_{block.index}"))
        last = inputs.structure.blocks[-1].output
        with b.after(last.producer()), b.role(TOKENS):
            slots = [b.ints("prefix_slots", (np.arange(frames)[:, None] * tokens + np.arange(p)).reshape(-1))] \
                if p else []
            base = b.op("Add", [b.op("Mul", [frame_of, b.ints("tokens", tokens)], "frame_base"),
                                b.ints("p", p)], "patch_base")
            patch_slots = b.op("Add", [b.unsqueeze(base, [1], "base_col"),
                                       b.op("Gather", [b.ints("window_patches", order.reshape(per_frame, w)), within],
                                            "patch_of", axis=0)], "patch_slots")
            slots = b.op("Concat", [*slots, b.op("Reshape", [patch_slots, b.ints("patch_slots_shape", [-1])],
                                                 "patch_slots_flat")], "slots", axis=0)
            rows = b.op("Reshape", [last, b.ints("rows_shape", [frames * p + keep * w, -1])], "rows")
            zeros = b.op("ConstantOfShape", [b.op("Concat", [b.ints("dense_rows", [frames * tokens]),
                                                             b.op("Shape", [rows], "width", start=1)], "dense_shape",
                                                  axis=0)], "zeros", value=ir.tensor(np.zeros(1, np.float32)))
            scattered = b.op("ScatterND", [zeros, b.unsqueeze(slots, [1], "slots_nd"), rows], "scattered")
            restored = b.op("Reshape", [scattered, b.ints("dense_layout", [frames, tokens, -1])], "restored")
            b.reroute(last, restored)
        restored.metadata_props[RESTORED_META] = f"{frames * p + keep * w},{tokens}"
        restored.shape = ir.Shape([frames, tokens, last.shape[2] if last.shape is not None else None])
        restored.type = last.type
        output = next(v for v in b.graph.outputs if v.shape is not None and len(v.shape) == 3)
        with b.after(output.producer()), b.role(TOKENS):
            features = b.op("Gather", [output, flat], "kept_rows", axis=1)  # [1, K, D]
        features.shape = ir.Shape([1, keep, output.shape[2]])
        features.type = output.type
        features.metadata_props[TOKENS_META] = f"{output.shape[1]},{keep}"
        b.replace_output(output, features)
        return seq, kept
