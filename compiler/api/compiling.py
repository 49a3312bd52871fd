"""`vlmprune compile` as a call: a model into a bundle, checked, with the figures as data.

The lines the CLI prints of the result are the CLI's (compiler/cli/render.py); here is what a script reads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vlmprune.compiler import pipeline
from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.passes.methods import DEFAULT_METHOD
from vlmprune.targets import DEFAULT_TARGET


@dataclasses.dataclass
class CompileResult(pipeline.CompileResult):
    """A compiled bundle: where it is, its manifest, the parity report it was checked with, and how long it took
    (the pipeline's result, with its verdict and its --json summary)."""

    @property
    def passed(self) -> bool:
        return self.report.passed

    def to_json(self) -> dict:
        """`vlmprune compile --json`'s summary."""
        m = self.manifest
        return {"bundle": str(self.bundle), "target": m.target.name, "method": dict(m.method),
                "outputs": [dict(o) for o in m.outputs], "parity": dict(m.parity), "seconds": round(self.seconds, 2),
                "timings": [s.to_json() for s in self.timings]}


def compile(model: str, output: str | Path = "build", *, target: str = DEFAULT_TARGET,
            method: str = DEFAULT_METHOD, keep: int | str = DEFAULT_KEEP, layer: int | None = None, prune: bool = True,
            batch: int | None = None, opset: int = DEFAULT_OPSET,
            feature_layer: int | None = None, cls: str | None = None, with_llm: bool = False,
            llm_exporter: str | None = None, fastv_layer: int | None = None, fastv_keep: float | None = None,
            image_start: int | None = None, method_options: dict | None = None, target_options: dict | None = None,
            family_options: dict | None = None, cache: bool = True, force: bool = False, debug: bool = False,
            progress: Progress = None, latency_ms: float | None = None) -> CompileResult:
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle at output.

    The keywords are `vlmprune compile`'s options (prune=False is --no-prune; method_options,
    target_options and family_options hold the options the tables declare, e.g. {"lambda": 0.3},
    {"precision": "int8"}, {"grid": "2x2"}); keep="auto" with latency_ms picks the largest K whose latency on
    the target fits that budget (compiler.pipeline.auto_keep). Returns the CompileResult even when a parity stage
    fails (result.passed is False; the CLI exits 1). Raises InputError for bad options or a model
    it cannot compile, ToolchainError where a target's toolchain is missing.
    """
    options = CompileOptions(target=target, method=method, keep=keep, layer=layer, prune=prune, batch=batch,
                             opset=opset, feature_layer=feature_layer, force=force, debug=debug, cls=cls,
                             method_options=dict(method_options or {}), target_options=dict(target_options or {}),
                             family_options={k: v for k, v in (family_options or {}).items() if v is not None},
                             cache=cache, with_llm=with_llm, llm_exporter=llm_exporter, fastv_layer=fastv_layer,
                             fastv_keep=fastv_keep, image_start=image_start, latency_ms=latency_ms)
    if not str(output).strip():  # Path("") is ".": the current directory, which nobody means
        raise InputError("output is empty: name the bundle's directory")
    result = compile_model(model, Path(output), options, reporter(progress))
    return CompileResult(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})
