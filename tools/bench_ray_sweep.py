#!/usr/bin/env python
"""One `eval --dataset` sweep timed in this process, on 1 Ray worker and on 2, side by side in one run.

    python tools/bench_ray_sweep.py [--dataset easyvqa|inspection|FILE.jsonl] [--model DIR] [--limit 64]
        [--keep 64] [--method cls] [--layer end]

--dataset and --model as tools/eval_quality.py takes them (easyvqa: tools/train_easyvqa.py's model;
inspection: the inspection benchmark's test split and model, e.g. --keep 96 --layer 2); the sweep
is the first --limit questions. The bundles (dense, cls, random and grid at K, at the tower's end) are compiled before
the clock starts (the product cache and the quality bundle folder keep them), and every timed run
starts from an empty store, so each computes every cell. One local Ray cluster (this machine, on the
loopback address) serves both Ray runs; its start is timed apart. A Ray run's time includes its
workers' start (imports, the bundle and model loads): that is what a sweep pays. Print: seconds per
run, cells per second, and the ratios 1 worker / 2 workers and in-process / 2 workers. The load of
the machine (os.getloadavg) is printed before and after: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_quality import Refused, dataset_and_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="easyvqa", help="easyvqa, inspection, or a questions .jsonl file")
    p.add_argument("--model", type=Path, default=None, help="default: the dataset's model (tools/eval_quality.py)")
    p.add_argument("--inspection-seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--keep", type=int, default=64)
    p.add_argument("--method", default="cls", help="an eval --dataset method spec")
    p.add_argument("--layer", default="end", help="a block (from 1) or end")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a single-machine cluster, loopback only
    from vlmprune.compiler.accuracy import evaluate_dataset
    from vlmprune.compiler.quality.executors import InProcess, RayExecutor

    try:
        data, model, _training = dataset_and_model(a, lambda m: print(m, file=sys.stderr))
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = str(model)
    print(f"{data}: first {a.limit} questions; {a.method} K={a.keep} at {a.layer}, beside dense, random and grid")
    common = dict(methods=[a.method], keeps=[a.keep], layers=[a.layer], limit=a.limit)
    with tempfile.TemporaryDirectory() as tmp:
        evaluate_dataset(model, data, **common, store=Path(tmp) / "warm.sqlite")  # compiles, then warms the caches
        print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
        import ray

        started = time.perf_counter()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        print(f"local Ray cluster started in {time.perf_counter() - started:.1f} s (not counted below)")
        seconds = {}
        for name, executor in (("in-process", InProcess()), ("ray, 1 worker", RayExecutor("auto", 1)),
                               ("ray, 2 workers", RayExecutor("auto", 2))):
            t = time.perf_counter()
            out = evaluate_dataset(model, data, **common, store=Path(tmp) / f"{len(seconds)}.sqlite",
                                   executor=executor)
            seconds[name] = time.perf_counter() - t
            print(f"{name:>15}: {seconds[name]:6.1f} s, {out['computed']} cells, "
                  f"{out['computed'] / seconds[name]:.2f} cells/s")
        ray.shutdown()
    print(f"ratio 1 worker / 2 workers: {seconds['ray, 1 worker'] / seconds['ray, 2 workers']:.2f}x; "
          f"in-process / 2 workers: {seconds['in-process'] / seconds['ray, 2 workers']:.2f}x")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
