"""Does rounding K + 1 rows up to a tile size pay on ONNX Runtime's CPU kernels? K -> latency around multiples.

    python tools/bench_keep_curve.py [--model demo] [--layer 2] [--tiles 64,128,192,256] [--repeats 15]

For each tile size R in --tiles it compiles (as `--keep auto` would: one dense export, the
target's pipeline, fusion and emit per K, no parity) the graphs with K + 1 = R - 1, R and
R + 1 rows, i.e. K = R - 2, R - 1, R, and times them all interleaved in one run (round by
round, tools/machine_load.interleaved), batch 1, median. Rounding K + 1 up to R pays where
the rounded K (R - 1) is no slower than the one below it (R - 2): then the rounded graph
keeps one token more for nothing. It prints the curve side by side, ms per kept token, the
verdict per tile and the machine's load (figures on a shared machine are provisional).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_load import CpuMeter, busy_line, interleaved  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--method", default="cls")
    ap.add_argument("--layer", type=int, default=2, help="prune after this block (the tower's later blocks scale with K)")
    ap.add_argument("--tiles", default="64,128,192,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--settle", type=float, default=0.05, help="seconds of pause before each timed call")
    args = ap.parse_args()

    from vlmprune.compiler.bundle.manifest import Manifest
    from vlmprune.compiler import pipeline
    from vlmprune.compiler.pipeline import CompileOptions, auto_keep

    tiles = [int(t) for t in args.tiles.split(",")]
    plan = pipeline.validate_options(CompileOptions(method=args.method, keep=1, layer=args.layer))
    target = plan.target
    progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-keep-") as scratch:
        scratch = Path(scratch)
        t0 = time.perf_counter()
        loaded = pipeline.load(args.model, plan, progress)
        dense = pipeline.export_dense(loaded, plan.options, scratch, progress)
        bench = auto_keep.Candidates(plan, loaded, dense, scratch)
        runs = {}
        for rows in tiles:
            for keep in (rows - 2, rows - 1, rows):
                folder = scratch / f"k{keep}"
                folder.mkdir()
                fused, fitted = bench.graph(keep, folder)
                fields = bench.emit(fused, fitted, folder).fields
                run, runtime = target.runner(folder, Manifest({"target": {"name": target.name, **fields}}))
                runs[keep] = (lambda r: (lambda: r(bench.pixel)))(run)
        print(f"{len(runs)} candidate graphs built in {time.perf_counter() - t0:.1f}s; runtime: {runtime}, "
              f"batch {bench.batch}, pruning after block {args.layer}")
        for fn in runs.values():  # warm-up: sessions created, arenas touched
            fn(), fn()
        meter = CpuMeter()
        times = interleaved(runs, args.repeats, args.settle)
        load = meter.report()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'K':>5} {'K+1 rows':>9} {'median ms':>10} {'p25-p75 ms':>14} {'ms/token':>9}")
    for k, v in times.items():
        q = statistics.quantiles(v, n=4)
        print(f"{k:>5} {k + 1:>9} {med[k]:>10.3f} {q[0]:>6.3f}-{q[2]:<7.3f} {med[k] / k:>9.5f}")
    print("\nrounding K+1 up to a multiple of R (rounded K = R-1 against K = R-2 below it):")
    iqr = {k: (lambda q: q[2] - q[0])(statistics.quantiles(v, n=4)) for k, v in times.items()}
    for rows in tiles:
        below, rounded, above = med[rows - 2], med[rows - 1], med[rows]
        noise = max(iqr[rows - 2], iqr[rows - 1])
        verdict = ("within the spread (no difference measurable)" if abs(rounded - below) <= noise else
                   "rounding is faster" if rounded < below else "rounding is slower")
        print(f"  R={rows}: K={rows - 2} {below:.3f} ms, K={rows - 1} {rounded:.3f} ms ({rounded / below - 1:+.1%}), "
              f"K={rows} {above:.3f} ms ({above / rounded - 1:+.1%} over the rounded); spread {noise:.3f} ms -> "
              f"{verdict}")
    line = busy_line(load)
    if line:
        print(line)


if __name__ == "__main__":
    main()
