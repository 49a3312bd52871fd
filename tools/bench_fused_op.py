#!/usr/bin/env python
"""ONNX Runtime CPU: the fused vlmprune.TokenPrune op vs the decomposed selection subgraph, side by side.

    python tools/bench_fused_op.py [--repeats 50]

Both graphs come from the product (passes.token_prune.selection_model, then
passes.fusion), so the decomposed side is exactly what `vlmprune compile` emits.
B in {1, 8}, N in {576, 1024}, D = 1024, K = N/3. Runs alternate between the two
sessions so that machine noise hits both alike; medians are reported.

A second table times the [CLS]-row scorer (the op boundary question): the
standard-op scorer the pass emits vs the ClsAttentionScore op, fp32 and INT8.
The last line is the geometric mean of the fused-op speedups.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from vlmprune.compiler.runtime import ort_session
from vlmprune.kernels.build import build_ort_library
from vlmprune.passes.fusion import TokenPruneFusionPass
from vlmprune.passes.token_prune import selection_model


def _session(model: ir.Model | onnx.ModelProto, libs=()):
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    return ort_session(proto.SerializeToString(), libs)


def _paired_medians(a, b, feeds, repeats: int) -> tuple[float, float]:
    ta, tb = [], []
    for s in (a, b):
        s.run(None, feeds)
    for _ in range(repeats):
        for s, acc in ((a, ta), (b, tb)):
            start = time.perf_counter()
            s.run(None, feeds)
            acc.append((time.perf_counter() - start) * 1e3)
    return statistics.median(ta), statistics.median(tb)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    lib = build_ort_library()
    rng = np.random.default_rng(0)
    d = args.dim

    print(f"TokenPrune (select + gather + summary), ONNX Runtime CPU, D={d}, median of {args.repeats}")
    print(f"{'B':>3} {'N':>5} {'K':>4} {'decomposed ms':>14} {'fused ms':>9} {'speedup':>8}")
    speedups = []
    for b in (1, 8):
        for n in (576, 1024):
            k = n // 3
            decomposed = selection_model(b, n, d, k)
            fused = selection_model(b, n, d, k)
            if not TokenPruneFusionPass()(fused).modified:
                raise SystemExit("fusion did not fire")
            feeds = {"hidden": rng.standard_normal((b, n + 1, d)).astype(np.float32),
                     "scores": rng.random((b, n), dtype=np.float32)}
            t_dec, t_fused = _paired_medians(_session(decomposed), _session(fused, (lib,)), feeds, args.repeats)
            speedups.append(t_dec / t_fused)
            print(f"{b:>3} {n:>5} {k:>4} {t_dec:>14.3f} {t_fused:>9.3f} {t_dec / t_fused:>7.2f}x")

    print(f"\n[CLS]-row scorer, ONNX Runtime CPU, H=16, dh=64, median of {args.repeats}")
    print(f"{'B':>3} {'T':>5} {'standard ops ms':>16} {'op fp32 ms':>11} {'op int8 ms':>11}")
    for b in (1, 8):
        for t in (577, 1025):
            feeds = {"q": rng.standard_normal((b, 16, t, 64)).astype(np.float32) * 0.125,
                     "kt": rng.standard_normal((b, 16, 64, t)).astype(np.float32) * 0.125}
            std = _session(_scorer_model(b, 16, t, 64))
            t_std, t_f32 = _paired_medians(std, _session(_fused_scorer_model(b, 16, t, 64, 0), (lib,)), feeds,
                                           args.repeats)
            _, t_i8 = _paired_medians(std, _session(_fused_scorer_model(b, 16, t, 64, 1), (lib,)), feeds,
                                      args.repeats)
            print(f"{b:>3} {t:>5} {t_std:>16.3f} {t_f32:>11.3f} {t_i8:>11.3f}")

    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print(f"fused_vs_decomposed_speedup: {geo:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
