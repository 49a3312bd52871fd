"""How busy the machine is while a benchmark times: the shared measuring aids of tools/bench_*.py.

A benchmark's ratios are only worth printing side by side when nothing else took the CPUs
meanwhile; these say how many compute threads to use and how much of the machine other
processes took during the timed section.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from vlmprune.compiler.pipeline.cpu_meter import CpuMeter  # noqa: F401  (in the library: --keep auto meters its timings too)

BUSY_WARNING = 0.05  # other processes' share of the CPUs above which the figures are flagged


def physical_cores() -> int:
    """Cores (not hyperthreads) this process may run on: one compute thread each is the fastest setting."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))



def busy_line(load: tuple[float, float] | None) -> str | None:
    """The line every benchmark prints about the machine's load, flagged above BUSY_WARNING."""
    if load is None:
        return None
    others, steal = load
    flag = "  WARNING: the machine was busy, these figures are not a quiet-machine measurement" \
        if others > BUSY_WARNING else ""
    return f"other processes used {others:.0%} of the {os.cpu_count()} CPUs while timing, steal {steal:.0%}{flag}"


def interleaved(runs: dict, repeats: int, settle_s: float, log=None) -> dict[str, list[float]]:
    """ms per call of every run, round by round (A B C, A B C, ...), a pause before each call.

    Why interleaved: a load that comes and goes then hits every row alike, so the ratios of
    one run hold even where the absolute times drift; why the pause: ONNX Runtime's pool
    threads spin for a while after a run and would tax the next one. Callers warm up first.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, fn in runs.items():
            time.sleep(settle_s)
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
        if log is not None:
            log(f"  round {i + 1}: " + ", ".join(f"{name} {t[-1]:.0f}" for name, t in times.items()) + " ms")
    return times

