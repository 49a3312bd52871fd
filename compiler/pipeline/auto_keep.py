"""`--keep auto --latency-ms X`: the largest K whose latency on the target fits a budget.

K is chosen by measurement on the target's own runtime, never guessed from a formula: the
candidates are the graphs the compile would emit for each K, made by the compile's own stages
(pipeline.stages: the compile's one dense export and loaded source; fit, lower, fuse and emit per K,
each K's plan from Plan.with_keep, never a second validation of the options), run by the
target's runner (Target.runner, what `vlmprune run` uses) on the bundle's own batch (1 for a
dynamic-batch bundle), without parity: parity runs once, on the bundle finally compiled.

Search. A geometric ladder K = k0, 2·k0, 4·k0, ... up to N - 1 (N the tokens the method
ranks; k0 the smallest K the method takes, 1 for most), stopped at the first rung over the
budget (latency does not fall as K grows, so no larger rung can fit), then bisection between
the largest rung that fits and the first that does not, until the two are adjacent or their
medians differ by less than their own spread (a finer step cannot be told from noise). That
is log2(N) + log2(N/2) candidates at most (19 for N = 576), usually fewer.

Timing. WARMUP = 2 untimed calls (the first creates the session and its arenas, the second
still pays the first touch of their pages), then REPEATS = 5 timed calls, their median: the
median of 5 is unmoved by two outliers (the first candidate is also run once untimed before
the search: a process's first session sets up ONNX Runtime itself), the spikes another process's burst puts into a
shared machine's timings, at 7 calls a candidate (ViT-L at 336 px: ~1 s a call on 2 cores,
~20 candidates, a few minutes in all; a tiny tower: milliseconds). What other processes took
of the CPUs meanwhile is recorded with the curve (the manifest's keep_auto.load).

Selection (select): on the curve's running maximum over K (its monotone envelope), the
largest measured K whose envelope fits. A dip of a larger K below a smaller one is noise,
not a faster graph, so a K is taken only when every smaller measured K fits too; this makes
the chosen K monotone in the budget, and a budget between two measured points picks the
lower one.

A flat curve. Where K hardly changes the work (pruning at the tower's end: only the projector runs
on fewer tokens; demo: K=1 36.5 ms, K=575 40.7 ms), the latencies of every K timed lie within the
timings' own noise, and the K that "fits" a budget inside that band is picked by noise. flat()
says so (a warning line, and the manifest's keep_auto.flat) where the rise of the envelope from
the smallest to the largest K timed is at most FLAT_SPREADS interquartile ranges of the widest
candidate's runs: K is then to be chosen for accuracy, not latency.

Rounding to a tile size. Whether K + 1 rows rounded up to a multiple of 8/16/32/64 pays on
ONNX Runtime's CPU kernels was measured with tools/bench_keep_curve.py (demo tower, pruning
after block 2, K around 64, 128, 192 and 256, interleaved, median of 15). ROUND_TO holds the
result: no tile size made a rounded K faster than the K below it beyond the timings' spread, so
K is not rounded (the figures are beside ROUND_MEASUREMENT; taken on a busy shared machine).

Other targets. TensorRT (orin, xavier) builds its engine on the device (`build-engine`), so
its candidates can only be timed there: refused here in one line. rk3588 and qnn: neither
emulator gives a latency. rknn-toolkit2's simulator refuses eval_perf ("Not support in
simulator environment, please set target in init_runtime!"); its build prints an estimate
of cycles per layer (the "Cycles(DDR/NPU/Total)" column of its layer table), and
onnxruntime-qnn's HTP emulator reports emulated cycles per op (QNN profiling "detailed",
targets.qnn_tools.op_trace). Both are cycles, with no clock or memory model to turn them
into milliseconds, and the budget is in milliseconds: a cost model fitted to them would
answer in a unit the budget is not, so both are refused in one line saying so (Target.no_timing_why).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

import vlmprune.compiler.pipeline.stages as stages  # the compile's own stages, run per candidate
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.contract import WEIGHTS
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline.cpu_meter import CpuMeter
# --keep auto's options are validated with every other option (validate_options); re-exported where they are used.
from vlmprune.compiler.pipeline.options import AUTO, Plan, requested  # noqa: F401

WARMUP = 2
REPEATS = 5
# Tile size K + 1 rows are rounded up to: none, by measurement (ROUND_MEASUREMENT).
ROUND_TO = 1
# tools/bench_keep_curve.py --repeats 15 (demo, cls after block 2, ORT CPU, batch 1, interleaved; other processes
# took 75% of the 2 CPUs, so provisional): median ms of K = R-2 / R-1 (K + 1 = R rows) / R for R = 64: 78.5 / 82.1 /
# 85.5; 128: 94.9 / 86.3 / 89.5; 192: 93.5 / 102.1 / 96.8; 256: 108.7 / 105.8 / 106.9, every interquartile range
# 15-45 ms: the rounded K is +4.6 %, -9.1 %, +9.1 %, -2.7 % against the K below it, no sign and within the spread.
# A curve is flat where its envelope rises by at most this many spreads (interquartile ranges of the runs) from its
# smallest to its largest K: twice the bisection's own "cannot be told apart" bound (one spread), so that a curve
# called flat is flat beyond doubt of a single noisy candidate.
FLAT_SPREADS = 2.0
ROUND_MEASUREMENT = "no tile size made the rounded K faster beyond the timings' spread (ORT CPU, demo tower)"

Curve = list[tuple[int, float]]


def envelope(curve: Curve) -> Curve:
    """The curve sorted by K, each latency raised to the largest at any smaller K (its running maximum)."""
    out, top = [], -math.inf
    for k, ms in sorted(curve):
        top = max(top, ms)
        out.append((k, top))
    return out


def select(curve: Curve, budget_ms: float) -> int | None:
    """The largest measured K whose envelope latency fits budget_ms, or None where even the smallest does not."""
    fits = [k for k, ms in envelope(curve) if ms <= budget_ms]
    return max(fits) if fits else None


def flat(timed: dict[int, "Timing"]) -> str | None:
    """The sentence saying that K does not change the latency over the K timed (module docstring), or None."""
    if len(timed) < 2:
        return None
    curve = envelope([(k, t.ms) for k, t in timed.items()])
    (k0, ms0), (k1, ms1) = curve[0], curve[-1]
    spread = max(t.spread for t in timed.values())
    if ms1 - ms0 > FLAT_SPREADS * spread:
        return None
    return (f"K does not change the latency here: from K={k0} to K={k1} it rises {ms1 - ms0:.3f} ms "
            f"({ms0:.3f} to {ms1:.3f} ms), within {FLAT_SPREADS:g}x the timings' spread ({spread:.3f} ms), so the K "
            "chosen is picked by noise (pruning where little runs after it, e.g. at the tower's end); choose K for "
            "accuracy instead (vlmprune eval --dataset)")


def round_keep(keep: int, limit: int) -> int:
    """K with K + 1 rows rounded up to ROUND_TO (at most limit); ROUND_TO = 1 leaves it as it is."""
    rounded = -(-(keep + 1) // ROUND_TO) * ROUND_TO - 1
    return min(rounded, limit)


@dataclasses.dataclass
class Timing:
    keep: int
    runs_ms: list[float]

    @property
    def ms(self) -> float:
        return statistics.median(self.runs_ms)

    @property
    def spread(self) -> float:
        """The interquartile range of the runs: how far apart two candidates must be to be told apart."""
        q = statistics.quantiles(self.runs_ms, n=4) if len(self.runs_ms) > 1 else [self.ms] * 3
        return q[2] - q[0]


def search(time_k: Callable[[int], Timing | None], first: int, last: int, budget_ms: float,
           progress: Callable[[str], None] = lambda _m: None) -> tuple[int | None, dict[int, Timing]]:
    """The ladder, then bisection (the module's docstring): time_k(K) times one candidate (None: the method refuses
    that K). Returns (the chosen K or None, every timing)."""
    timed: dict[int, Timing] = {}

    def measure(k: int) -> Timing | None:
        if k not in timed:
            t = time_k(k)
            if t is None:
                return None
            timed[k] = t
            progress(f"  K={k}: {t.ms:.3f} ms (median of {len(t.runs_ms)})")
        return timed[k]

    def curve() -> Curve:
        return [(k, t.ms) for k, t in timed.items()]

    k = first
    while True:  # the ladder, up to the first rung over the budget
        t = measure(k)
        if t is not None and select(curve(), budget_ms) != k:
            break
        if k >= last:
            return select(curve(), budget_ms), timed
        k = min(2 * k, last)
    while True:  # bisection between the largest K that fits and the next measured one, which does not
        lo = select(curve(), budget_ms)
        if lo is None:
            return None, timed
        hi = min(k for k in timed if k > lo)
        if hi - lo <= 1 or timed[hi].ms - timed[lo].ms <= max(timed[hi].spread, timed[lo].spread):
            return lo, timed
        mid = (lo + hi) // 2
        if measure(mid) is None:  # a K the method refuses inside the bracket: keep what fits
            return lo, timed


def resolve(plan: Plan, loaded: stages.Loaded, dense: stages.DenseExport,
            progress: Callable[[str], None]) -> tuple[Plan, dict]:
    """(the plan at the chosen K, the manifest's keep_auto section): the candidates timed on the target's runner.

    plan: validate_options' for --keep auto (its budget, at the smallest K the method takes); loaded: the source
    the compile loaded; dense: the dense export the compile made (each candidate lowers its own copy of the file)."""
    budget = plan.budget_ms
    first, target = plan.options.keep, plan.target
    with tempfile.TemporaryDirectory(prefix="vlmprune-keep-auto-", dir=dense.path.parent) as scratch:
        bench = Candidates(plan, loaded, dense, Path(scratch))
        last = bench.limit(first) - 1
        progress(f"keep auto: timing K from {first} to {last} on {target.name} against {budget:g} ms")
        bench.time(first)  # untimed: a process's first session also sets up the runtime itself (thread pool, op library)
        meter = CpuMeter()
        chosen, timed = search(bench.time, first, last, budget, progress)
        load = meter.others()
        load = None if load is None else round(load, 3)
        runtime = bench.runtime
    if not timed:
        raise InputError(f"method {plan.options.method} took no K from {first} to {last} with these options")
    curve = sorted((k, round(t.ms, 4)) for k, t in timed.items())
    if chosen is None:
        k0, ms0 = curve[0]
        raise InputError(f"--latency-ms {budget:g}: even K={k0} takes {ms0:.3f} ms on {target.name} here "
                         f"(median of {REPEATS}, batch {bench.batch}); no K fits the budget")
    chosen = round_keep(chosen, last)
    section = {"budget_ms": budget, "chosen": chosen, "curve": [[k, ms] for k, ms in curve],
               "timed_on": f"{runtime}, batch {bench.batch}, median of {REPEATS} after {WARMUP} warm-up calls",
               "load": load, "source": "measured", "flat": flat(timed)}
    progress(f"keep auto: K={chosen} ({dict(curve)[chosen]:.3f} ms <= {budget:g} ms)")
    if section["flat"]:
        progress(f"warning: keep auto: {section['flat']}")
    return plan.with_keep(chosen), section


class Candidates:
    """Each K's graph as the compile would emit it (the same stages: fit, lower, fuse, emit), from one dense export,
    timed by the target's runner."""

    def __init__(self, plan: Plan, loaded: stages.Loaded, dense: stages.DenseExport, folder: Path):
        self.plan, self.loaded, self.dense_path, self.folder = plan, loaded, dense.path, Path(folder)
        self.target = plan.target
        static = dense.model.graph.inputs[0].shape[0]
        self.batch = static if isinstance(static, int) else 1
        self.pixel, _ = loaded.family.parity_pixels(loaded.source, self.batch)
        self.runtime = self.target.name

    def graph(self, keep: int, folder: Path) -> tuple[stages.Fused, Plan]:
        """The fused graph at K (its dense graph linked into folder), and the fitted plan it was made with."""
        plan = stages.fit(self.plan.with_keep(keep), self.loaded)
        lowered = stages.lower(ir.load(_linked(self.dense_path, folder)), self.loaded, plan)
        return stages.fuse(lowered, plan), plan

    def emit(self, fused: stages.Fused, plan: Plan, folder: Path) -> stages.Emitted:
        """The target's artifacts at K in folder, calibrated on the candidates' own batch."""
        return stages.emit(fused, self.loaded, plan, folder, pixel=self.pixel)

    def limit(self, keep: int) -> int:
        """N: the tokens the method ranks (K < N), read off the graph inserted at keep."""
        with tempfile.TemporaryDirectory(dir=self.folder) as folder:
            record = self.graph(keep, Path(folder))[0].record
        crops = (record.params.get("crops") or {}).get("count", 1)
        return record.num_patches * crops

    def time(self, keep: int) -> Timing | None:
        # Each candidate in a folder of its own: a runtime may hold the previous one's files (ONNX Runtime maps the
        # op library, which a copy over it would corrupt under the loaded session).
        with tempfile.TemporaryDirectory(dir=self.folder) as folder:
            return self._time(keep, Path(folder))

    def _time(self, keep: int, folder: Path) -> Timing | None:
        try:
            fused, plan = self.graph(keep, folder)
        except InputError:
            return None
        fields = self.emit(fused, plan, folder).fields
        run, self.runtime = self.target.runner(folder, Manifest({"target": {"name": self.target.name, **fields}}))
        for _ in range(WARMUP):
            run(self.pixel)
        runs = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            run(self.pixel)
            runs.append((time.perf_counter() - start) * 1e3)
        del run
        return Timing(keep, runs)


def _linked(dense_path: Path, folder: Path) -> Path:
    """The dense graph and its weights in folder, as hard links where the file system has them (no copy of the
    weights per candidate), else as copies."""
    for name in (dense_path.name, WEIGHTS):
        try:
            os.link(dense_path.parent / name, folder / name)
        except OSError:
            shutil.copyfile(dense_path.parent / name, folder / name)
    return folder / dense_path.name
