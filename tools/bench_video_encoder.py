#!/usr/bin/env python
"""Tower time of a video bundle: dense, evs (after the tower), evs-encoder (inside it), side by side in one run.

    python tools/bench_video_encoder.py [--frames 8] [--layer 2] [--rates 0.5,0.75] [--repeats 5] [--workdir DIR]

Why: evs prunes the projector output, so the tower runs on every frame's every token whatever K is;
evs-encoder drops the repeating tokens after block L, so blocks L+1.. run on fewer. The figure is
the time of the tower graph (pixels -> image features), the bundle's model.onnx as the ort target
ships it, on the clip made here (compiler.frontend.video.clip_made_here: a still photograph, a
moving square, a scene cut).

Model: a seeded LLaVA-NeXT-Video (LlavaNextVideoForConditionalGeneration built offline from a config,
no download) with a CLIP ViT-B/16 tower at 224 px (12 blocks, 768 wide, 14x14 patches: 49 pooled
rows per frame after the resampler's 2x2 average pool), feature layer -2 (11 blocks run), and a
1-layer 512-wide LLM that the tower time does not include. ONNX Runtime CPU, one session per
bundle, the rows interleaved per repeat (machine_load.interleaved) so that load on a shared machine
falls on all of them alike; median of --repeats after one warm-up run each; the last line says how
much of the CPUs other processes took while timing (machine_load.busy_line).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from machine_load import CpuMeter, busy_line, interleaved


def build(path: Path, seed: int = 0, width: int = 512) -> Path:
    """The seeded checkpoint; width: the language model's (the projector's output; tools/bench_e2e_video.py sets
    Qwen2-0.5B's 896 so that the tower feeds its decoder)."""
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextVideoConfig,
                              LlavaNextVideoForConditionalGeneration)

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=16)
    text = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=1024)
    model = LlavaNextVideoForConditionalGeneration(LlavaNextVideoConfig(
        vision_config=vision, text_config=text, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_token_index=1000, video_token_index=1001, image_grid_pinpoints=[[224, 224]]))
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--rates", default="0.5,0.75")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from vlmprune.compiler.frontend import family_for, load_source
    from vlmprune.compiler.frontend.images import preprocess
    from vlmprune.compiler.frontend.video import clip_made_here
    from vlmprune.compiler.pipeline import CompileOptions, compile_model
    from vlmprune.targets.runtime import ort_session, run_session

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_video_encoder_"))
    model = work / "llava_next_video_b16"
    if not (model / "config.json").exists():
        build(model)
    video = {"video_frames": args.frames}
    rows: dict[str, Path] = {}

    def bundle(name: str, **options) -> None:
        out = work / name
        if not (out / "model.onnx").exists():
            result = compile_model(str(model), out, CompileOptions(target="ort", family_options=video, cache=False,
                                                                   **options))
            assert result.report.passed, name
        rows[name] = out

    bundle("dense", prune=False)
    for rate in (float(r) for r in args.rates.split(",")):
        bundle(f"evs q={rate:g}", method="evs", keep=1, method_options={"video_pruning_rate": rate})
        bundle(f"evs-encoder q={rate:g} L={args.layer}", method="evs-encoder", keep=1, layer=args.layer,
               method_options={"video_pruning_rate": rate})
    source = load_source(str(model))
    family_for(source).fix(source, video, prune=False, batch=None, cls=None)
    clip = np.stack([preprocess(f, source.image_size, source.mean, source.std)
                     for f in clip_made_here(args.frames, source.image_size)])
    sessions = {name: ort_session(str(path / "model.onnx")) for name, path in rows.items()}
    shapes = {}
    for name, session in sessions.items():  # warm-up, and the rows each gives the LLM
        shapes[name] = run_session(session, clip)["image_features"].shape[1]
    meter = CpuMeter()
    times = interleaved({name: (lambda s=session: run_session(s, clip)) for name, session in sessions.items()},
                        args.repeats, settle_s=0.5)
    load = meter.report()
    dense = statistics.median(times["dense"])
    print(f"tower time, {args.frames} frames of 224 px, ORT CPU, median of {args.repeats} (ms):")
    print(f"{'bundle':<26} {'LLM rows':>8} {'ms':>9} {'x dense':>8}")
    for name, ms in times.items():
        median = statistics.median(ms)
        print(f"{name:<26} {shapes[name]:>8} {median:>9.1f} {dense / median:>8.2f}")
    if busy_line(load):
        print(busy_line(load))


if __name__ == "__main__":
    main()
