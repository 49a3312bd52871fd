"""Other processes' share of the CPUs while something was timed: every benchmark prints it beside its figures,
and `--keep auto` records it with its K -> latency curve (a leaf: it imports nothing of vlmprune, so the
library and tools/machine_load.py share it)."""

from __future__ import annotations

import os
import time
from pathlib import Path


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
