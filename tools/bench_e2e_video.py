#!/usr/bin/env python
"""tools/bench_e2e.py's measurement for clips: time to first token and KV cache per clip, dense vs temporal pruning.

    python tools/bench_e2e_video.py [--frames 8,16,32] [--rates 0.5,0.75] [--layer 2] [--merging-ratio 0.7]
        [--repeats 3] [--text 64] [--warmup 2] [--workdir DIR]

Why: a clip multiplies the visual tokens by its frames (49 rows a frame here, 1,568 at 32 frames), so the LLM's
prefill, not the tower, is what temporal pruning mainly buys, except where it prunes inside the tower. Per frame
count F, the rows are the bundles `vlmprune compile --target ort --video-frames F` writes (each passed parity at
compile):

- dense: every frame's every pooled row;
- `evs` at each --rates q (vLLM's EVS, after the tower: K = max(49, floor(F·49·(1 - q))));
- `dycoke` at --merging-ratio r (DyCoke's TTM, after the tower; K follows from r and F);
- `evs-encoder` at each q after block --layer (the same rule inside the tower: blocks L+1.. run on the kept
  windows' patches, one sequence of F + 4K tokens under a per-frame mask).

Model: tools/bench_video_encoder.py's seeded LLaVA-NeXT-Video (CLIP ViT-B/16 at 224 px, feature layer -2, so 11
blocks run, 2x2 average pool: 49 rows a frame) with its projector to 896, and tools/bench_e2e.py's
Qwen2-0.5B-shaped decoder (24 layers, 896 wide, 14 / 2 heads, vocabulary 151,936), the prefill graph that target
ort ships (torch.onnx, each layer's attention fused to MultiHeadAttention). A LLaVA-OneVision-0.5B pairs the same
decoder with a SigLIP-400M tower at 384 px, about 40 times this tower's work a frame: 32 of its frames do not
run in a benchmark's time on a 2-core machine, so the tower is the smaller one and its share of TTFT is smaller
than on that model. The clip: compiler.frontend.video.clip_made_here (a still photograph, a moving square, a
scene cut at F/2), the prompt --text seeded token embeddings, half before the clip's rows and half after.

TTFT = tower graph (pixels [F, 3, 224, 224] -> the kept rows [1, K, 896]) + the embeddings assembled on the host
+ the LLM prefill (-> the last token's logits) + argmax; tower ms is the first part alone, inside the same runs.
KV per clip: the bytes of the clip's rows in every layer's present key and value (prefill outputs' shapes).

FLOP limit, counted as bench_e2e.py counts (2 per multiply-add): per frame the patch embedding and 11 blocks on
197 tokens (8·T·D² + 4·T²·D + 4·T·D·F), the pool, the projector on every pooled row (evs-encoder's tail runs on
the dense layout too); evs-encoder's blocks after L on one sequence S = F + 4K (8·S·D² + 4·S²·D + 4·S·D·F: its
masked attention spans all of S); the decoder on the text and K rows (bench_e2e.llm_flops). The scores (cosines)
are left out. share = measured speedup / FLOP speedup limit, per frame count against its dense row.

Timing: one LLM session for every row (the same graph; a 2 GB session built once), each row's tower session in
its own block, rows forwards then backwards (bench_e2e's blocks), --warmup untimed runs each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import bench_e2e
from bench_video_encoder import build
from machine_load import CpuMeter, busy_line, physical_cores

PATCH, IMAGE, D, MLP, BLOCKS, STRIDE = 16, 224, 768, 3072, 11, 2
GRID = IMAGE // PATCH
ROWS = (GRID // STRIDE) ** 2  # pooled rows a frame


def block_flops(tokens: int, d: int = D, f: int = MLP) -> float:
    return 8.0 * tokens * d * d + 4.0 * tokens * tokens * d + 4.0 * tokens * d * f


def tower_flops(frames: int, width: int, layer: int | None = None, keep: int | None = None) -> float:
    """The video tower's FLOPs: dense, or with evs-encoder's later blocks on one sequence of F + STRIDE²·K tokens."""
    per_frame = 1 + GRID * GRID
    flops = frames * 2.0 * GRID * GRID * 3 * PATCH * PATCH * D
    for block in range(1, BLOCKS + 1):
        if layer is not None and block > layer:
            flops += block_flops(frames + STRIDE * STRIDE * keep)
        else:
            flops += frames * block_flops(per_frame)
    return flops + frames * ROWS * 2.0 * (D * width + width * width)


def compile_rows(model: Path, folder: Path, frames: int, rates, ratio: float, layer: int, log) -> dict:
    """{row name: bundle folder}: the ort bundles of one frame count, compiled (parity must pass)
    unless already in folder."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    video = {"video_frames": frames}
    plan = {"dense": dict(prune=False)}
    for q in rates:
        plan[f"evs q={q:g}"] = dict(method="evs", keep=1, method_options={"video_pruning_rate": q})
    plan[f"dycoke r={ratio:g}"] = dict(method="dycoke", keep=1, method_options={"merging_ratio": ratio})
    for q in rates:
        plan[f"evs-encoder q={q:g} L={layer}"] = dict(method="evs-encoder", keep=1, layer=layer,
                                                      method_options={"video_pruning_rate": q})
    out = {}
    for name, options in plan.items():
        bundle = folder / f"f{frames}-{name.replace(' ', '_').replace('=', '')}"
        if not (bundle / "manifest.json").is_file():
            log(f"compile {frames} frames: {name}")
            result = compile_model(str(model), bundle, CompileOptions(target="ort", family_options=video,
                                                                      cache=False, **options))
            if not result.report.passed:
                raise SystemExit(f"{name} at {frames} frames failed parity; not timing it")
        out[name] = bundle
    return out


def clip_pixels(model: Path, frames: int) -> np.ndarray:
    from vlmprune.compiler.frontend import family_for, load_source
    from vlmprune.compiler.frontend.images import preprocess
    from vlmprune.compiler.frontend.video import clip_made_here

    source = load_source(str(model))
    family_for(source).fix(source, {"video_frames": frames}, prune=False, batch=None, cls=None)
    return np.ascontiguousarray(np.stack([preprocess(f, source.image_size, source.mean, source.std)
                                          for f in clip_made_here(frames, source.image_size)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--frames", default="8,16,32", help="frame counts of the clips")
    parser.add_argument("--rates", default="0.5,0.75", help="EVS pruning rates q (evs and evs-encoder)")
    parser.add_argument("--merging-ratio", type=float, default=0.7, help="DyCoke's r")
    parser.add_argument("--layer", type=int, default=2, help="evs-encoder after this tower block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", type=int, default=64, help="text tokens in the prompt (half before the clip)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per block before its timed ones")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the bundles and graphs here and reuse those already there (default: a temp dir)")
    args = parser.parse_args()
    from vlmprune.compiler.frontend.source import quiet_transformers
    from vlmprune.targets.runtime import ort_session, run_session

    frame_counts = [int(f) for f in args.frames.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    quiet_transformers()
    cores = physical_cores()
    torch.set_num_threads(cores)
    os.environ.setdefault("VLMPRUNE_ORT_THREADS", str(cores))
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:6.0f}s] {m}", file=sys.stderr, flush=True)  # noqa: E731
    folder = args.workdir or Path(tempfile.mkdtemp(prefix="bench-e2e-video-"))
    folder.mkdir(parents=True, exist_ok=True)
    before = args.text // 2

    lm = bench_e2e.qwen2_05b_shaped()
    width, layers = lm.config.hidden_size, lm.config.num_hidden_layers
    model = folder / "llava_next_video_b16_896"
    if not (model / "config.json").is_file():
        log("build the seeded LLaVA-NeXT-Video (CLIP B/16, projector to 896)")
        build(model, width=width)
    if not (folder / "llm_dense_fused.onnx").is_file():
        log("export the LLM prefill and fuse its attention (target ort's form)")
        if not (folder / "llm_dense.onnx").is_file():
            bench_e2e.save_graph(bench_e2e.export_prefill(lm, None), folder, "llm_dense")
        bench_e2e._fused(folder / "llm_dense.onnx", folder, "llm_dense_fused", layers)
    embed = lm.get_input_embeddings().weight.detach().numpy()
    ids = np.random.default_rng(0).integers(0, embed.shape[0], size=args.text)
    text_before, text_after = embed[ids[:before]][None], embed[ids[before:]][None]
    lm = embed = None

    bundles = {f: compile_rows(model, folder, f, rates, args.merging_ratio, args.layer, log) for f in frame_counts}
    clips = {f: clip_pixels(model, f) for f in frame_counts}  # once per length, not per row's block
    llm = ort_session(folder / "llm_dense_fused.onnx")
    kv, kept, first, tower_ms = {}, {}, {}, {}

    def make(frames: int, name: str, bundle: Path):
        row = (frames, name)
        tower_ms.setdefault(row, [])

        def build_row():
            """The row's tower session; its first run is the block's first warm-up (bench_e2e._blocks)."""
            pixels = clips[frames]
            tower = ort_session(bundle / "model.onnx")
            calls = [0]

            def features():
                start = time.perf_counter()
                out = run_session(tower, pixels)["image_features"]
                calls[0] += 1
                if calls[0] > args.warmup:  # the block's timed runs only
                    tower_ms[row].append((time.perf_counter() - start) * 1e3)
                return out

            run = bench_e2e.ttft_call(features, llm, text_before, text_after)
            token, outs = run()
            first[row], kv[row] = token, bench_e2e.kv_image_bytes(llm, outs, args.text)
            present = [o for meta, o in zip(llm.get_outputs(), outs) if meta.name.startswith("present.")]
            kept[row] = int(present[0].shape[2]) - args.text  # the cache's length: text + the clip's kept rows
            return run

        return build_row

    builders = {f"{f} frames, {name}": make(f, name, b) for f, rows in bundles.items() for name, b in rows.items()}
    keys = {f"{f} frames, {name}": (f, name) for f, rows in bundles.items() for name in rows}
    log(f"timing {len(builders)} rows: blocks forwards then backwards, {args.repeats} runs each")
    meter = CpuMeter()
    times = bench_e2e._blocks(builders, args.repeats, args.warmup, log)
    load = meter.report()

    print(f"video: seeded LLaVA-NeXT-Video tower (CLIP ViT-B/16, 224 px, 11 blocks, {ROWS} rows a frame, projector "
          f"to {width}) + Qwen2-0.5B-shaped decoder (prefill as target ort ships it, attention fused); batch 1, "
          f"{args.text} text tokens; the clip made here; ONNX Runtime CPU, {os.environ['VLMPRUNE_ORT_THREADS']} "
          f"intra-op threads; median of {args.repeats}, rows in blocks forwards then backwards")
    print("| frames | configuration | LLM rows | tower ms | TTFT ms (min-max) | speedup | GFLOP | FLOP speedup limit "
          "| share of limit | KV per clip | KV vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    flops = {row: tower_flops(row[0], width, *((args.layer, k) if row[1].startswith("evs-encoder") else ()))
             + bench_e2e.llm_flops(args.text + k, None) for row, k in kept.items()}
    shares = {}
    for label, times_ms in times.items():
        frames, name = row = keys[label]
        base_row = (frames, "dense")
        med, base_med = statistics.median(times_ms), statistics.median(times[f"{frames} frames, dense"])
        speed, limit = base_med / med, flops[base_row] / flops[row]
        if name != "dense":
            shares[label] = speed / limit
        print(f"| {frames} | {name} | {kept[row]} | {statistics.median(tower_ms[row]):.0f} | {med:.0f} "
              f"({min(times_ms):.0f}-{max(times_ms):.0f}) | {speed:.2f}x | {flops[row] / 1e9:.0f} | {limit:.2f}x | "
              f"{speed / limit:.0%} | {kv[row] / 2**20:.1f} MiB | {kv[row] / kv[base_row]:.2f} |")
    if busy_line(load):
        print(busy_line(load))
    print("first tokens: " + ", ".join(f"{label}: {first[keys[label]]}" for label in times))
    if shares:
        worst = min(shares, key=shares.get)
        print(f"min_share_of_flop_limit: {shares[worst]:.2f} ({worst})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
