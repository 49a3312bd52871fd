"""Where a sweep's cells run: in this process (the default) or on a Ray cluster (`--ray`).

A task is one setting (one compiled bundle): its worker factory and its chunks of samples.
A worker is built once per task and answers chunk after chunk, so a bundle and its model
are loaded once per task and worker, never per sample. The executors only place the work; the sweep (sweep.py)
stores what comes back as it comes, so whichever way a run ends, every finished chunk is kept.

Ray is imported lazily and is an optional extra (`pip install 'vlmprune[ray]'`). On a
cluster a fixed pool of actors (one CPU each, at most --ray-workers) takes the tasks one
after another, keeping its imports warm between them; a worker process that dies mid-chunk is
restarted (max_restarts) and its chunk retried (max_task_retries), and if it dies for good
the sweep stops with what it finished in the store, to resume from there. When there are
fewer tasks than workers, a task's chunks are split over several actors (each loads the
bundle once). The scheduling is Ray's: this module submits and collects, nothing more.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from vlmprune.compiler.errors import InputError

RESTARTS = 3  # how often a dead worker process is restarted, and its chunk retried


@dataclasses.dataclass(frozen=True)
class Task:
    key: str
    make: Callable[[], Callable[[list], list[dict]]]  # picklable: builds the worker that answers a chunk
    chunks: tuple[tuple, ...]


class InProcess:
    """Every task here, one after another: the default, and the reference a Ray run must equal cell by cell."""

    name = "in-process"

    def run(self, tasks: list[Task]) -> Iterator[tuple[str, list[dict]]]:
        for task in tasks:
            worker = task.make()
            for chunk in task.chunks:
                yield task.key, worker(list(chunk))


class Holder:
    """The actor body: answers chunks with the worker of their task, built on the task's first chunk and kept until
    another task comes (a restarted actor rebuilds it from the factory each call carries)."""

    def __init__(self):
        self.key, self.worker = None, None

    def run(self, key, make, chunk):
        if key != self.key:
            self.key, self.worker = None, None  # the old bundle and model are freed before the next one loads
            self.worker, self.key = make(), key
        return self.worker(list(chunk))


def runs_locally(address: str) -> bool:
    """`auto` with no cluster to join (no RAY_ADDRESS, none started on this machine): a local one is started."""
    return address == "auto" and not os.environ.get("RAY_ADDRESS") and \
        not (Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster").exists()


def import_ray(local: bool = False):
    if local and "ray" not in sys.modules:
        # Ray binds a cluster to the machine's reachable address unless it runs as a single-machine cluster; this
        # one serves this run only, so it listens on the loopback address.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray: pip install 'vlmprune[ray]'") from None
    return ray


class RayExecutor:
    """Tasks on a pool of Ray actors on the cluster at `address` (an address; "auto": the running cluster, else a
    local one started here on 127.0.0.1 for this run), at most `workers` actors (default: the cluster's CPUs)."""

    name = "ray"

    def __init__(self, address: str = "auto", workers: int | None = None):
        self.local = runs_locally(address)
        self.ray = import_ray(self.local)
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise InputError(f"--ray-workers must be an integer >= 1, got {workers!r}")
        self.address, self.workers = address, workers

    def _connect(self) -> bool:
        """Join the cluster unless this process already has; True when this call joined (and leaves it after)."""
        ray = self.ray
        if ray.is_initialized():
            return False
        common = dict(log_to_driver=False, logging_level="ERROR")
        try:
            if self.local:
                ray.init(address="local", include_dashboard=False, **common)
            else:
                ray.init(address=self.address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"--ray {self.address}: cannot join the Ray cluster ({str(exc).splitlines()[0]})") from None
        return True

    def run(self, tasks: list[Task]) -> Iterator[tuple[str, list[dict]]]:
        ray = self.ray
        joined = self._connect()
        try:
            slots = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
            yield from self._schedule(tasks, slots)
        finally:
            if joined:
                ray.shutdown()

    def _schedule(self, tasks: list[Task], slots: int) -> Iterator[tuple[str, list[dict]]]:
        ray = self.ray
        actor_class = ray.remote(num_cpus=1, max_restarts=RESTARTS, max_task_retries=RESTARTS)(Holder)
        parts = max(1, slots // max(1, len(tasks)))
        units = [(t, t.chunks[i::parts]) for t in tasks for i in range(min(parts, len(t.chunks)))]
        waiting = list(reversed(units))
        actors = [actor_class.remote() for _ in range(min(slots, len(units)))]
        running: dict = {}  # ObjectRef -> (task key, actor index)
        left = [0] * len(actors)  # chunks still out per actor

        def give(i: int) -> None:  # the actor's next unit: all its chunks, queued in order on that actor
            task, chunks = waiting.pop()
            left[i] = len(chunks)
            for chunk in chunks:
                running[actors[i].run.remote(task.key, task.make, chunk)] = (task.key, i)

        try:
            for i in range(len(actors)):
                give(i)
            while running:
                ready, _ = ray.wait(list(running), num_returns=1)
                key, i = running.pop(ready[0])
                try:
                    results = ray.get(ready[0])
                except ray.exceptions.RayTaskError as exc:
                    raise exc.as_instanceof_cause() from None
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(f"a Ray worker died {RESTARTS + 1} times on one chunk: {exc}") from None
                left[i] -= 1
                yield key, results
                if not left[i] and waiting:
                    give(i)
        finally:
            for actor in actors:
                ray.kill(actor)
