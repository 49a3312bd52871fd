"""Where an ONNX Runtime run spends its time: per op type, the MatMul rate by row count, and the time no kernel took.

A FLOP-limit ratio below 1 says a pruned graph is slower than its arithmetic allows, not why.
These aids answer the why from ONNX Runtime's own profiler, on the same graph, with the same
session options as the timed rows:

- kernel milliseconds per op type, per run (median over the profiled runs), and how many nodes of
  each type ran;
- the FLOP-counted ops (MatMul, Gemm, Conv, FusedMatMul, MatMulNBits, the attention ops) apart
  from the uncounted ones (normalisations, activations, softmax, reshapes, gathers), whose time
  does not shrink with the FLOP count in the same way;
- each MatMul's achieved GFLOP/s, grouped by its row count M, because small-M products (a
  pruned tower's 66 tokens, a decoder's one-token head) run at a lower rate than large ones;
- the run's wall time minus the kernels' (sequential graphs: the executor's own cost per node,
  output allocation), beside the number of nodes run: a cost that scales with the node count and
  not with the tokens is a fixed cost of the graph's structure.

Used by tools/bench_e2e.py (--profile) and tools/bench_tower.py (--op-profile); a profiled run is never a
timed one (the profiler itself costs time).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

# Ops whose work the benchmarks' FLOP models count; everything else is "uncounted".
COUNTED = {"MatMul", "Gemm", "Conv", "FusedMatMul", "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat",
           "QLinearMatMul", "DynamicQuantizeMatMul", "MultiHeadAttention", "Attention", "GroupQueryAttention", "FusedGemm",
           "FusedConv"}  # MatMulIntegerToFloat: what ORT fuses an int8 bundle's QDQ MatMul into
M_BUCKETS = (1, 16, 128, 512, 2048)  # MatMul row-count groups: [1], (1, 16], ... (2048, inf)


def _bucket(m: int) -> str:
    low = 0
    for high in M_BUCKETS:
        if m <= high:
            return f"M={high}" if high == 1 else f"M {low + 1}-{high}"
        low = high
    return f"M>{M_BUCKETS[-1]}"


def _matmul_flops(args: dict) -> tuple[int, float] | None:
    """(M, FLOPs) of one MatMul / FusedMatMul / Gemm event from the shapes the profiler recorded."""
    try:
        a = list(args["input_type_shape"][0].values())[0]
        out = list(args["output_type_shape"][0].values())[0]
    except (KeyError, IndexError, AttributeError):
        return None
    if not a or not out:
        return None
    rows = int(np.prod(out[:-1])) if len(out) > 1 else 1
    m = out[-2] if len(out) > 1 else 1
    k = a[-1]  # MatMul and FusedMatMul
    if args.get("op_name") == "Gemm" and len(a) == 2 and a[0] != m:
        k = a[0]  # transA=1: A is [K, M] (when K == M, either axis is K)
    return int(m), 2.0 * rows * out[-1] * k


def profile(session_factory, feeds: dict, runs: int = 3) -> dict:
    """Profile `runs` calls of a session made by session_factory(options) (after one untimed warm-up);
    the last run's outputs come back under "outputs", by name.

    session_factory gets an onnxruntime.SessionOptions with profiling switched on and must apply
    the caller's own options (threads, op libraries) to it, so that the profile is of the timed setup.
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ort-profile-") as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "p")
        session = session_factory(options)
        for _ in range(runs + 1):
            outputs = session.run(None, feeds)
        names = [o.name for o in session.get_outputs()]
        events = json.loads(Path(session.end_profiling()).read_text())
        del session
    run_events = [e for e in events if e.get("name") == "model_run"]
    # every run but the warm-up: nodes between that run's start and end
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in run_events][1:]
    per_run_ops: list[dict[str, float]] = [defaultdict(float) for _ in spans]
    per_run_nodes = [0 for _ in spans]
    per_run_counts: list[dict[str, int]] = [defaultdict(int) for _ in spans]
    per_run_mm: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0]) for _ in spans]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name")
        if op is None:
            continue
        for i, (start, end) in enumerate(spans):
            if start <= e["ts"] <= end:
                per_run_ops[i][op] += e["dur"] / 1e3
                per_run_nodes[i] += 1
                per_run_counts[i][op] += 1
                if op in ("MatMul", "FusedMatMul", "Gemm"):
                    mf = _matmul_flops(e["args"])
                    if mf is not None:
                        cell = per_run_mm[i][_bucket(mf[0])]
                        cell[0] += e["dur"] / 1e3
                        cell[1] += mf[1]
                break
    ops = {op: statistics.median(r.get(op, 0.0) for r in per_run_ops) for op in {o for r in per_run_ops for o in r}}
    matmul = {}
    for bucket in {b for r in per_run_mm for b in r}:
        ms = statistics.median(r[bucket][0] for r in per_run_mm if bucket in r)
        flops = per_run_mm[0][bucket][1] if bucket in per_run_mm[0] else 0.0
        matmul[bucket] = {"ms": ms, "gflop": flops / 1e9, "gflops_per_s": flops / 1e9 / (ms / 1e3) if ms else 0.0}
    run_ms = statistics.median((end - start) / 1e3 for start, end in spans)
    kernels = sum(ops.values())
    return {"run_ms": run_ms, "kernel_ms": kernels, "ops": ops, "matmul": matmul,
            "outputs": dict(zip(names, outputs)), "nodes": int(statistics.median(per_run_nodes)),
            "counts": dict(per_run_counts[0]) if per_run_counts else {},
            "counted_ms": sum(ms for op, ms in ops.items() if op in COUNTED),
            "uncounted_ms": sum(ms for op, ms in ops.items() if op not in COUNTED),
            "outside_kernels_ms": run_ms - kernels}


def merge(*profiles: dict) -> dict:
    """The sum of several graphs' profiles (a row that runs a tower and then an LLM)."""
    ops: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    matmul: dict[str, dict] = {}
    for p in profiles:
        for op, ms in p["ops"].items():
            ops[op] += ms
        for op, n in p.get("counts", {}).items():
            counts[op] += n
        for bucket, cell in p["matmul"].items():
            acc = matmul.setdefault(bucket, {"ms": 0.0, "gflop": 0.0})
            acc["ms"] += cell["ms"]
            acc["gflop"] += cell["gflop"]
    for cell in matmul.values():
        cell["gflops_per_s"] = cell["gflop"] / (cell["ms"] / 1e3) if cell["ms"] else 0.0
    keys = ("run_ms", "kernel_ms", "counted_ms", "uncounted_ms", "outside_kernels_ms", "nodes")
    return {"ops": dict(ops), "counts": dict(counts), "matmul": matmul,
            **{k: sum(p[k] for p in profiles) for k in keys}}


def table(rows: dict[str, dict], top: int = 8) -> list[str]:
    """Markdown lines: per row, run / counted / uncounted / outside ms, the top uncounted ops, MatMul rate by M."""
    lines = ["| row | nodes run | run ms | counted-op ms | uncounted-op ms | outside kernels ms | top uncounted ops (ms) |",
             "|---|---|---|---|---|---|---|"]
    for name, p in rows.items():
        others = sorted(((ms, op) for op, ms in p["ops"].items() if op not in COUNTED), reverse=True)[:top]
        lines.append(f"| {name} | {p['nodes']} | {p['run_ms']:.1f} | {p['counted_ms']:.1f} | {p['uncounted_ms']:.1f} "
                     f"({p['uncounted_ms'] / p['run_ms']:.0%}) | {p['outside_kernels_ms']:.1f} | "
                     + ", ".join(f"{op} {ms:.1f}" for ms, op in others) + " |")
    buckets = sorted({b for p in rows.values() for b in p["matmul"]},
                     key=lambda b: int(b.split("=")[-1].split("-")[-1].lstrip(">")) + (1 if ">" in b else 0))
    lines += ["", "| row | " + " | ".join(f"MatMul {b}: ms, GFLOP/s" for b in buckets) + " |",
              "|---|" + "---|" * len(buckets)]
    for name, p in rows.items():
        cells = [f"{p['matmul'][b]['ms']:.1f}, {p['matmul'][b]['gflops_per_s']:.0f}" if b in p["matmul"] else "-"
                 for b in buckets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
