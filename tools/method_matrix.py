#!/usr/bin/env python
"""Compile one model with every method for every target and print the parity of each stage, as a table.

    python tools/method_matrix.py [--model demo] [--keep 192] [--methods cls,dart,cls:budget=adaptive]
                                  [--targets ort,qnn] [--batch 3]

The check behind "every method compiles for every target or is refused in one line": each
cell is a real `vlmprune compile` (into a temporary folder), reported as its stages'
verdicts with the kept-index agreement and the minimum cosine, or as the one-line refusal.
The suite runs the same matrix on tiny models; this is for the real shapes (demo,
clip-l-336), which take minutes per cell on 2 cores. A method is a name or a NAME:OPTION=VALUE spec
(`cls:merge=local:width=3`, `cls:roi=boxes`), as eval --dataset takes it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from vlmprune.compiler.accuracy import parse_method_spec
from vlmprune.compiler.contract import FEATURES
from vlmprune.compiler.errors import VlmpruneError
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.passes.methods import METHODS
from vlmprune.targets import TARGETS


def _cell(report) -> str:
    parts = []
    for stage in report.stages:
        figures = []
        if stage.indices:
            figures.append(f"agree {stage.indices['agreement']:.3f}")
            if stage.indices.get("tie_resolved_images"):
                figures.append(f"ties {stage.indices['tie_resolved_images']}")
        features = stage.outputs.get(FEATURES, {})
        if "cosine_min" in features:
            figures.append(f"cos {features['cosine_min']:.5f}")
        parts.append(f"{stage.stage} {'PASS' if stage.passed else 'FAIL'} ({', '.join(figures)})")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--keep", type=int, default=192)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--batch", type=int, default=None, help="static batch (default: dynamic; parity feeds 2)")
    args = parser.parse_args()

    failures = 0
    print(f"{args.model}, keep {args.keep}, batch {args.batch or 'dynamic'}")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            for target in args.targets.split(","):
                name, method_options = parse_method_spec(method)
                options = CompileOptions(target=target, method=name, keep=args.keep, batch=args.batch,
                                         method_options=method_options)
                start = time.perf_counter()
                try:
                    result = compile_model(args.model, Path(tmp) / f"{method}-{target}", options)
                    line = _cell(result.report)
                    failures += not result.report.passed
                except VlmpruneError as exc:
                    line = f"refused: {exc}"
                print(f"{method:<18} {target:<7} {time.perf_counter() - start:6.0f} s  {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
