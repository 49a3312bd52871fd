"""How busy the machine is while a benchmark times: the shared measuring aids of tools/bench_*.py.

A benchmark's ratios are only worth printing side by side when nothing else took the CPUs
meanwhile; these say how many compute threads to use and how much of the machine other
processes took during the timed section.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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


class CpuMeter:
    """CPU time the rest of the machine used while we timed (from /proc/stat; None where there is none)."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = sum(fields[:3]) + sum(fields[5:7])  # user nice system, irq softirq (not idle, iowait)
        steal = fields[7] if len(fields) > 7 else 0
        own = os.times()
        # Our own CPU includes the children we waited for (a benchmark that times subprocesses).
        mine = own.user + own.system + own.children_user + own.children_system
        return time.perf_counter(), busy / tick, steal / tick, mine

    def report(self) -> tuple[float, float] | None:
        """(others' share of all CPUs, steal share), both over the wall time since start."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall = end[0] - self.start[0]
        cpus = os.cpu_count() or 1
        others = max(0.0, (end[1] - self.start[1]) - (end[3] - self.start[3]))
        return others / (wall * cpus), (end[2] - self.start[2]) / (wall * cpus)

    def others(self) -> float | None:
        """Other processes' share of all CPUs since start (None where /proc/stat is not readable)."""
        load = self.report()
        return None if load is None else load[0]


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

