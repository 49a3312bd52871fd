#!/usr/bin/env python
"""Latency of the vision tower, dense vs pruned, PyTorch eager vs ONNX Runtime, side by side in one run.

    python tools/bench_tower.py [--model clip-l-336] [--keep 192] [--layer 2] [--repeats 5]

Measures at batch 1 on this machine's CPU, one process, interleaving nothing else:
dense PyTorch eager, pruned PyTorch eager (the reference pruner), dense ONNX
Runtime, and pruned ONNX Runtime with pruning after --layer and at the tower's end.
Prints medians and ratios; the last line is the headline ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx_ir as ir
import torch

from vlmprune.compiler.frontend import PruneSpec, export_onnx, load_source
from vlmprune.compiler.images import parity_inputs
from vlmprune.compiler.runtime import ort_session, run_session
from vlmprune.passes.token_prune import PruneConfig
from vlmprune.targets.ort import OrtTarget


def _median_ms(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _pruned_onnx(dense_path: Path, folder: Path, keep: int, layer: int | None, name: str) -> Path:
    model = ir.load(dense_path)
    for p in OrtTarget().pipeline(PruneConfig(keep, layer)):
        model = p(model).model
    path = folder / name
    ir.save(model, path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="clip-l-336")
    parser.add_argument("--keep", type=int, default=192)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    source = load_source(args.model)
    x_np, _ = parity_inputs(1, source.image_size, source.mean, source.std)
    x = torch.from_numpy(x_np)
    end = source.num_blocks
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dense = export_onnx(source.pipeline, source.image_size, 1, 18)
        ir.external_data.unload_from_model(dense, folder, "weights.bin", size_threshold_bytes=1024)
        ir.save(dense, folder / "dense.onnx")
        paths = {
            "dense": folder / "dense.onnx",
            f"pruned L{args.layer}": _pruned_onnx(folder / "dense.onnx", folder, args.keep, args.layer, "l.onnx"),
            f"pruned L{end} (end)": _pruned_onnx(folder / "dense.onnx", folder, args.keep, None, "e.onnx"),
        }
        eager = {
            "dense": source.pipeline,
            f"pruned L{args.layer}": source.pipeline.with_prune(PruneSpec(args.keep, args.layer)),
            f"pruned L{end} (end)": source.pipeline.with_prune(PruneSpec(args.keep, end)),
        }
        rows = {}
        with torch.inference_mode():
            for name, module in eager.items():
                rows[f"torch eager, {name}"] = _median_ms(lambda m=module: m(x), args.repeats)
        for name, path in paths.items():
            session = ort_session(path)
            rows[f"onnxruntime, {name}"] = _median_ms(lambda s=session: run_session(s, x_np), args.repeats)
            del session

    base = rows["torch eager, dense"]
    print(f"{args.model}, batch 1, keep {args.keep} of {(source.image_size // source.patch_size) ** 2}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'configuration':<40} {'ms':>10} {'speedup vs torch dense':>24}")
    for name, ms in rows.items():
        print(f"{name:<40} {ms:>10.1f} {base / ms:>23.2f}x")
    ort_l = rows[f"onnxruntime, pruned L{args.layer}"]
    print(f"ort_pruned_L{args.layer}_vs_torch_pruned_L{args.layer}: {rows[f'torch eager, pruned L{args.layer}'] / ort_l:.2f}")
    print(f"ort_pruned_L{args.layer}_vs_torch_dense: {base / ort_l:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
