"""A sweep: every setting x sample cell that the store does not hold yet, run by an executor, stored as it comes.

Settings are whatever the caller compiled (compiler.evaluate: one bundle per method, K and
layer); each comes with the key that names its cells (setting_key) and a picklable worker
factory. Finished chunks go to the store in one transaction each, so an interrupted sweep
(Ctrl-C, a killed worker, a lost cluster) resumes with only the missing cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from typing import Callable

from vlmprune.compiler.quality.dataset import Sample, by_image
from vlmprune.compiler.quality.executors import InProcess, Task
from vlmprune.compiler.quality.store import Store

CHUNK = 16  # samples per chunk: an image's questions stay together, and a chunk is the unit stored and retried


def setting_key(description: dict) -> str:
    """The store key of a setting: a hash of everything that decides its answers (model hash, method, its version and
    parameters, K, layer, target, decoding length), as the caller describes it."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    description: dict
    make: Callable  # picklable worker factory (executors.Task.make)
    label: str = ""  # how progress lines name it (default: its key)


@dataclasses.dataclass
class SweepResult:
    cells: dict[str, dict[str, dict]]  # key -> sample digest -> {"answer", "correct", "extra"}
    computed: int
    reused: int


def run_sweep(settings: list[Setting], samples: list[Sample], store: Store, executor=None, chunk: int = CHUNK,
              progress: bool | None = None, on_chunk: Callable[[str, list[dict]], None] | None = None,
              log: Callable[[str], None] | None = None) -> SweepResult:
    """Run the missing cells of settings x samples and return every cell's result (stored and new).

    progress: a tqdm bar on stderr (None: only when stderr is a terminal). log: where there is no bar (CI, a log
    file), one line per finished setting, so that a long sweep says how far it is. on_chunk: called after each
    stored chunk."""
    executor = executor or InProcess()
    tasks, reused = [], 0
    for s in settings:
        store.describe(s.key, s.description)
        done = store.done(s.key)
        missing = [x for x in samples if x.digest not in done]
        reused += len(samples) - len(missing)
        if missing:
            tasks.append(Task(s.key, s.make, tuple(tuple(c) for c in by_image(missing, chunk))))
    total = sum(len(c) for t in tasks for c in t.chunks)
    computed = 0
    if tasks:
        from tqdm import tqdm

        shown = sys.stderr.isatty() if progress is None else progress
        left = {t.key: sum(len(c) for c in t.chunks) for t in tasks}
        label = {s.key: s.label or s.key for s in settings}
        started, finished = time.monotonic(), 0
        with tqdm(total=total, unit="cell", desc=f"eval ({executor.name})", file=sys.stderr, leave=False,
                  disable=not shown) as bar:
            for key, results in executor.run(tasks):
                store.put(key, results)
                computed += len(results)
                bar.update(len(results))
                left[key] -= len(results)
                finished += left[key] <= 0
                if left[key] <= 0 and log is not None and not shown:
                    log(f"eval: {label[key]} done ({finished} of {len(tasks)} settings, {computed} of {total} cells, "
                        f"{time.monotonic() - started:.0f} s)")
                if on_chunk is not None:
                    on_chunk(key, results)
    digests = {x.digest for x in samples}
    cells = {s.key: {d: c for d, c in store.cells(s.key).items() if d in digests} for s in settings}
    return SweepResult(cells, computed, reused)


def stored(settings: list[Setting], samples: list[Sample], store: Store) -> int:
    """How many of the settings x samples cells the store holds (what a rerun reuses)."""
    digests = {x.digest for x in samples}
    return sum(len(store.done(s.key) & digests) for s in settings)
