#!/usr/bin/env python
"""ONNX Runtime CPU: the fused vlmprune.TokenPrune op vs the decomposed selection subgraph and the memory floor.

    python tools/bench_fused_op.py [--repeats 50]

Both graphs come from the product (passes.methods.cls.selection_model, then the ort
target's fusion), so the decomposed side is exactly what `vlmprune compile` emits.
B in {1, 8}, N in {576, 1024}, D = 1024, K = N/3.

A speedup over the decomposed graph says nothing about how far the op is from
the hardware, so each row also times the memory floor. The op must read hidden
[B, 1+N, D] and scores [B, N] (R bytes) and write tokens [B, K+2, D] and kept
[B, K] int64 (W bytes). The floor reads a buffer of R bytes once and writes a
buffer of W bytes: it copies the first W bytes into the write buffer and
reduces the rest (a max, far below the memory bound in arithmetic). It runs as
numpy (1 thread) and as torch (the op's thread count); the faster is the floor.
An equal-bytes memcpy would not do: writes cost more than reads (write-allocate),
and the op reads three times what it writes. A third reference, an ONNX Runtime
graph that only slices out outputs of the same shapes, shows what one
session.run costs before any selection work.

Timing: every measurement of a row runs in the same rounds, order rotated each
round; within a round each one runs in a block, after a pause and an untimed
run, because the runtimes' thread pools spin after a call and would steal the
next one's cores (alternating single calls measured that, not the op). Medians
over all blocks are reported, with the share of the CPUs other processes took.

Hot and cold caches. The first table calls each function again and again on the same
buffers, so at B=1 (2.4-4.2 MB) the inputs stay in the two cores' L2 (2 MiB each) between
calls: the torch floor, which splits the buffer in two fixed halves, re-reads each half from
the same core's L2 every call and ran at up to 83 GB/s, more than the DRAM gives. The op splits
each image into chunks of 32 whole rows (kernels/cpu: each task streams one stretch of the input,
front to back); ONNX Runtime's intra-op pool gives a custom op's tasks no fixed thread, so part
of what a thread reads was last in the other core's L2. (The op used to split an image into
column strips of 256 values per row: a 1 KiB run per 4 KiB row, which the prefetcher follows
badly. Rows measured 0.152 vs 0.193 ms hot and 0.445 vs 0.525 ms cold at B=1, N=576, and equal
at B=8, in one side-by-side run of both libraries.) The second table ("cold caches") times every
call alone after a read of a buffer twice the last-level cache, so no input or output is cached:
the state a deployed tower leaves the op in. At B=8 the inputs exceed the caches and both tables
agree.

A third table times the [CLS]-row scorer (the op boundary question): the
standard-op scorer the pass emits vs the ClsAttentionScore op, fp32 and INT8.
The last lines are geometric means over the rows (with the worst row): fused time / memory
floor, hot and cold, then the fused-op speedup over the decomposed graph.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from vlmprune.targets.runtime import ort_session
from machine_load import CpuMeter, busy_line, physical_cores
from vlmprune.compiler.contract import KEPT
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.kernels.build import build_ort_library
from vlmprune.passes.methods import get_method
from vlmprune.targets.base import PruneConfig
from vlmprune.passes.methods.cls import selection_model
from vlmprune.targets.ort import OrtTarget



def _ort_fusion():
    """The cls method's fusion rules as the ort target applies them (FusionPass with its spelling)."""
    cls = get_method("cls")
    return OrtTarget().fusion(PruneConfig(cls, cls.parse(192, {})), CompileOptions())


def _session(model: ir.Model | onnx.ModelProto, libs=()):
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    return ort_session(proto.SerializeToString(), libs)


BLOCK = 10  # timed calls per measurement per round
SETTLE_S = 0.05  # pause before a block: long enough for spinning pool threads to park


def _interleaved_medians(fns, repeats: int) -> list[float]:
    """Median ms of each fn over rounds; in a round each fn runs a block (after a pause and an untimed call)."""
    times: list[list[float]] = [[] for _ in fns]
    rounds = max(1, -(-repeats // BLOCK))
    for r in range(rounds):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            time.sleep(SETTLE_S)
            fns[i]()
            for _ in range(min(BLOCK, repeats)):
                start = time.perf_counter()
                fns[i]()
                times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _llc_bytes() -> int:
    """The largest CPU cache this process shares (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


class Evictor:
    """Reads one float per cache line of a buffer 2x the last-level cache (at most 512 MiB: a VM may report the
    host's): afterwards no input or output of the op is cached. Reads only, so that no dirty line of the
    sweep is written back during the timed call."""

    def __init__(self):
        self.buffer = np.ones(min(512 << 20, max(64 << 20, 2 * _llc_bytes())) // 4, np.float32)

    def __call__(self):
        float(self.buffer[::16].sum())


def _cold_medians(fns, repeats: int, evict) -> list[float]:
    """Median ms of each fn, every call timed alone right after the caches were flushed (order rotated per round)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            evict()
            start = time.perf_counter()
            fns[i]()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _copy_model(b: int, n: int, d: int, k: int) -> onnx.ModelProto:
    """Same inputs, outputs of the same shapes and dtypes, no selection: the cost of one session.run that writes them."""
    c = lambda name, vals: helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)  # noqa: E731
    nodes = [helper.make_node("Slice", ["hidden", "z", "rows", "ax1"], ["tokens"]),
             helper.make_node("Slice", ["scores", "z", "k", "ax1"], ["top"]),
             helper.make_node("Cast", ["top"], [KEPT], to=TensorProto.INT64)]
    graph = helper.make_graph(nodes, "copy", [
        helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [b, n + 1, d]),
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [b, n])], [
        helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [b, k + 2, d]),
        helper.make_tensor_value_info(KEPT, TensorProto.INT64, [b, k])],
        [c("z", [0]), c("rows", [k + 2]), c("k", [k]), c("ax1", [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _scorer_model(b: int, h: int, t: int, dh: int) -> onnx.ModelProto:
    """The scorer as InsertTokenPrunePass emits it: q[:, :, :1] · kᵀ -> softmax -> mean over heads -> normalise."""
    c = lambda name, vals: helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)  # noqa: E731
    nodes = [
        helper.make_node("Slice", ["q", "z", "o", "ax2"], ["qc"]),
        helper.make_node("MatMul", ["qc", "kt"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
        helper.make_node("ReduceMean", ["p", "ax12"], ["a"], keepdims=0),
        helper.make_node("Slice", ["a", "o", "big", "ax1"], ["pa"]),
        helper.make_node("ReduceMax", ["pa", "ax1"], ["m"], keepdims=1),
        helper.make_node("Max", ["m", "eps"], ["den"]),
        helper.make_node("Div", ["pa", "den"], ["scores"]),
    ]
    inits = [c("z", [0]), c("o", [1]), c("ax2", [2]), c("ax12", [1, 2]), c("ax1", [1]), c("big", [2**62]),
             helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6])]
    graph = helper.make_graph(nodes, "scorer", [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [b, h, t, dh]),
        helper.make_tensor_value_info("kt", TensorProto.FLOAT, [b, h, dh, t])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [b, t - 1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _fused_scorer_model(b: int, h: int, t: int, dh: int, int8: int) -> onnx.ModelProto:
    node = helper.make_node("ClsAttentionScore", ["q", "kt"], ["a"], domain="vlmprune", scale=1.0, has_cls=1,
                            int8=int8, k_transposed=1)
    norm = [helper.make_node("ReduceMax", ["a", "ax1"], ["m"], keepdims=1),
            helper.make_node("Max", ["m", "eps"], ["den"]), helper.make_node("Div", ["a", "den"], ["scores"])]
    graph = helper.make_graph([node, *norm], "scorer_fused", [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [b, h, t, dh]),
        helper.make_tensor_value_info("kt", TensorProto.FLOAT, [b, h, dh, t])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [b, t - 1])],
        [helper.make_tensor("ax1", TensorProto.INT64, [1], [1]), helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("vlmprune", 1)])


def _row(b, n, k, read, written, dec, fused, floor, by, copy) -> str:
    """One line of a TokenPrune table (hot or cold): times in ms, bytes read and written, the ratios."""
    return (f"{b:>3} {n:>5} {k:>4} {read / 1e6:>6.2f} {written / 1e6:>6.2f} {dec:>14.3f} {fused:>9.3f} "
            f"{floor:>9.3f} {by:>6} {copy:>12.3f} {dec / fused:>7.2f}x {fused / floor:>11.2f}x "
            f"{(read + written) / fused / 1e6:>11.1f}")


def _geo(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    lib = build_ort_library()
    rng = np.random.default_rng(0)
    d = args.dim
    threads = int(os.environ.get("VLMPRUNE_ORT_THREADS", "0")) or physical_cores()
    torch.set_num_threads(threads)

    print(f"TokenPrune (select + gather + summary), ONNX Runtime CPU, D={d}, median of {args.repeats}, "
          f"{threads} intra-op threads")
    print("R / W: bytes the op must read (hidden, scores) / write (tokens, kept int64). floor: read an R-byte buffer "
          "once and write a W-byte one (copy W bytes, max-reduce the rest), the faster of numpy (1 thread) and "
          f"torch ({threads} threads). ort copy: one session.run that only slices out outputs of the same shapes.")
    header = (f"{'B':>3} {'N':>5} {'K':>4} {'R MB':>6} {'W MB':>6} {'decomposed ms':>14} {'fused ms':>9} "
              f"{'floor ms':>9} {'by':>6} {'ort copy ms':>12} {'speedup':>8} {'fused/floor':>12} {'fused GB/s':>11}")
    print(header)
    speedups, vs_floor, cold_vs_floor, cold = [], [], [], []
    evict = Evictor()
    meter = CpuMeter()
    for b in (1, 8):
        for n in (576, 1024):
            k = n // 3
            decomposed = selection_model(b, n, d, k)
            fused = selection_model(b, n, d, k)
            _ort_fusion()(fused)  # the ort target's own fusion: fails in one line if it does not fire
            feeds = {"hidden": rng.standard_normal((b, n + 1, d)).astype(np.float32),
                     "scores": rng.random((b, n), dtype=np.float32)}
            read = feeds["hidden"].nbytes + feeds["scores"].nbytes
            written = b * (k + 2) * d * 4 + b * k * 8
            w = written // 4  # float32 elements written
            src = np.ascontiguousarray(np.concatenate([feeds["hidden"].ravel(), feeds["scores"].ravel()]))
            dst = np.empty(w, np.float32)
            src_t, dst_t = torch.from_numpy(src), torch.from_numpy(np.empty(w, np.float32))

            def floor_numpy():
                np.copyto(dst, src[:w])
                np.maximum.reduce(src[w:])

            def floor_torch():
                dst_t.copy_(src_t[:w])
                src_t[w:].amax()

            s_dec, s_fused = _session(decomposed), _session(fused, (lib,))
            s_copy = _session(_copy_model(b, n, d, k))
            t_dec, t_fused, t_np, t_torch, t_copy = _interleaved_medians([
                lambda: s_dec.run(None, feeds), lambda: s_fused.run(None, feeds), floor_numpy, floor_torch,
                lambda: s_copy.run(None, feeds)], args.repeats)
            floor, by = (t_np, "numpy") if t_np <= t_torch else (t_torch, "torch")
            speedups.append(t_dec / t_fused)
            vs_floor.append(t_fused / floor)
            print(_row(b, n, k, read, written, t_dec, t_fused, floor, by, t_copy))
            c_dec, c_fused, c_np, c_torch, c_copy = _cold_medians([
                lambda: s_dec.run(None, feeds), lambda: s_fused.run(None, feeds), floor_numpy, floor_torch,
                lambda: s_copy.run(None, feeds)], args.repeats, evict)
            c_floor, c_by = (c_np, "numpy") if c_np <= c_torch else (c_torch, "torch")
            cold_vs_floor.append(c_fused / c_floor)
            cold.append(_row(b, n, k, read, written, c_dec, c_fused, c_floor, c_by, c_copy))

    print(f"\nCold caches: the same, every call timed alone after a {evict.buffer.nbytes >> 20} MiB buffer was "
          "read (no input or output left in any cache), as in a tower where the op's inputs were written "
          "by the previous layer's threads and are not where this call's threads look for them")
    print(header)
    print("\n".join(cold))
    print(f"\n[CLS]-row scorer, ONNX Runtime CPU, H=16, dh=64, median of {args.repeats}")
    print(f"{'B':>3} {'T':>5} {'standard ops ms':>16} {'op fp32 ms':>11} {'op int8 ms':>11}")
    for b in (1, 8):
        for t in (577, 1025):
            feeds = {"q": rng.standard_normal((b, 16, t, 64)).astype(np.float32) * 0.125,
                     "kt": rng.standard_normal((b, 16, 64, t)).astype(np.float32) * 0.125}
            sessions = [_session(_scorer_model(b, 16, t, 64)), _session(_fused_scorer_model(b, 16, t, 64, 0), (lib,)),
                        _session(_fused_scorer_model(b, 16, t, 64, 1), (lib,))]
            t_std, t_f32, t_i8 = _interleaved_medians([lambda s=s: s.run(None, feeds) for s in sessions], args.repeats)
            print(f"{b:>3} {t:>5} {t_std:>16.3f} {t_f32:>11.3f} {t_i8:>11.3f}")

    line = busy_line(meter.report())
    if line:
        print(line)
    print(f"fused_vs_memory_floor: {_geo(vs_floor):.2f} (worst row {max(vs_floor):.2f})")
    print(f"fused_vs_memory_floor_cold: {_geo(cold_vs_floor):.2f} (worst row {max(cold_vs_floor):.2f})")
    print(f"fused_vs_decomposed_speedup: {_geo(speedups):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
