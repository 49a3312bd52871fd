#!/usr/bin/env python
"""A second compile of the same model, from the product cache (compiler.pipeline.cache), against the first, in one run.

    python tools/bench_recompile.py [--model clip-l-336] [--repeats 1]

Each round, with an empty product cache ($VLMPRUNE_CACHE/products, in a temporary folder):
1. `vlmprune compile MODEL --method cls`: the first compile, which fills the cache;
2. `vlmprune compile MODEL --method divprune`: the second, which reuses the dense export, the
   dense torch reference and the export parity stage;
3. `vlmprune compile MODEL --method divprune --no-cache`: the second compile's own peer.
Times are wall seconds of the whole command, as a user waits for it (interpreter start and
imports included). Each compile writes a bundle folder of its own, and before each one the
earlier bundles are deleted and the disk's pending writes are flushed (os.sync), untimed, so
that no command is charged for the one before it. The ONNX Runtime custom-op library, which
the ort target builds once into the same cache root, is built before timing: the product
cache is not what saves it.
The run reports how much CPU other processes took meanwhile (tools/machine_load.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_load import CpuMeter, busy_line  # noqa: E402

ROWS = {"cls, cold cache (the first)": ["--method", "cls"],
        "divprune, cached (the second)": ["--method", "divprune"],
        "divprune --no-cache (its peer)": ["--method", "divprune", "--no-cache"]}


def compile_seconds(model: str, args: list[str], out: Path, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(["vlmprune", "compile", model, *args, "-o", str(out), "--force"], env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: vlmprune compile {model} {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    print("\n".join("    " + line for line in proc.stderr.splitlines() if line.startswith("[")), flush=True)
    return seconds


def settle(root: Path) -> None:
    """Untimed, before each compile: the earlier bundles go and the disk has written what is pending.

    A compile returns while the kernel still writes its gigabytes back (a bundle, a cache
    entry); without this the next command's reads and its own writes queue behind the last
    one's, and the second compile is charged for the first's disk time.
    """
    for old in root.glob("bundle-*"):
        shutil.rmtree(old, ignore_errors=True)
    os.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="clip-l-336")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, each from an empty product cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recompile-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "VLMPRUNE_CACHE": str(root / "cache")}
        subprocess.run([sys.executable, "-c", "from vlmprune.kernels.build import build_ort_library as b; b()"],
                       env=env, check=True)  # untimed: the op library, into the same (temporary) cache root
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        meter = CpuMeter()
        for i in range(args.repeats):
            shutil.rmtree(root / "cache" / "products", ignore_errors=True)
            for j, (row, flags) in enumerate(ROWS.items()):
                settle(root)
                print(f"round {i + 1}: {row}", flush=True)
                times[row].append(compile_seconds(args.model, flags, root / f"bundle-{i}-{j}", env))
                print(f"  {times[row][-1]:.1f} s", flush=True)
        load = meter.report()
    first, second, peer = (statistics.median(t) for t in times.values())
    print(f"\nvlmprune compile {args.model} (median of {args.repeats} round(s), wall seconds):")
    for row, t in times.items():
        print(f"  {row:<32} {statistics.median(t):7.1f} s   ({', '.join(f'{v:.1f}' for v in t)})")
    print(f"  the second is {first / second:.2f}x faster than the first; the cache makes divprune "
          f"{peer / second:.2f}x faster than without it")
    line = busy_line(load)
    if line:
        print(line)


if __name__ == "__main__":
    main()
