"""compile_model and check_bundle: the library functions behind `vlmprune compile` and `check`.

compile_model is the composition of the public stages (pipeline.stages; their list is its docstring):
the options validated once into a Plan (pipeline.options.validate_options), the model loaded by its
family, the dense tower exported, the method fitted to the source's site, the target's pass pipeline
(insert the method, retarget, legalize, check support) and fusion pipeline run, the target's
artifacts emitted, the manifest described, and parity run on every stage against the reference.
`--keep auto` (auto_keep), check_bundle, `eval` and the pictures call the same stages. Nothing here
branches on a model family, a method or a target: each is asked (the family through
compiler.frontend.family, with its own options and the prune config); the defaults are the one place
a name is spelled (CompileOptions: target "ort", the registry's default method).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from vlmprune.compiler import bundle, parity
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.pipeline import auto_keep, cache  # noqa: F401 (cache: the product cache, pipeline.cache)
from vlmprune.compiler.pipeline.options import (CompileOptions, Plan, options_of, prune_config,  # noqa: F401
                                                validate_options)
from vlmprune.compiler.pipeline.stages import (DenseExport, Emitted, Fused, Loaded, Lowered,  # noqa: F401
                                               ParityBatch, Progress, describe, emit, emit_context, export_dense,
                                               export_llm, fit, fit_config, fuse, in_chunks, load, load_bundle,
                                               load_source, lower, parity_batch, ready, run_parity,
                                               write_bundle)
from vlmprune.compiler.pipeline.timings import Span, StageTimer
from vlmprune.targets import get_target


@dataclasses.dataclass
class CompileResult:
    """What compile_model made: the bundle, its manifest, its parity report, the seconds it took."""

    bundle: Path
    manifest: Manifest
    report: parity.ParityReport
    seconds: float
    timings: list[Span] = dataclasses.field(default_factory=list)  # one per progress step (compile --timings)


def compile_model(model: str, output: Path, options: CompileOptions, progress: Progress = lambda _m: None) -> CompileResult:
    """Load MODEL, export it, insert pruning, emit the target's bundle at output, and check parity.

    Every option is validated once, before any work; the output is claimed before the model
    is loaded, so a second compile into the same directory fails at once.
    """
    timer = StageTimer(progress)
    output = Path(output)
    plan = validate_options(options)  # every option, before any work
    ready(model, plan)
    with bundle.staging(output, plan.options.force) as tmp:
        loaded = load(model, plan, timer.step)
        dense = export_dense(loaded, plan.options, tmp, timer.step)
        keep_auto = None
        if plan.budget_ms is not None:  # --keep auto --latency-ms X: K timed on the target, inside the claimed output
            plan, keep_auto = auto_keep.resolve(plan, loaded, dense, timer.step)
        plan = fit(plan, loaded)
        lowered = lower(dense.model, loaded, plan, timer.step, folder=tmp)
        fused = fuse(lowered, plan, timer.step)
        emitted = emit(fused, loaded, plan, tmp, timer.step)
        manifest = describe(loaded, plan, fused, emitted, keep_auto)
        manifest = export_llm(model, manifest, plan, tmp, timer.step)
        report = run_parity(loaded, dense.path, tmp, manifest, plan.target, emitted.batch, emitted.context,
                            timer.step)
        manifest = write_bundle(tmp, manifest, report, loaded, plan.target, dense.path)
    timer.step(f"bundle written to {output}")
    return CompileResult(output, manifest, report, time.perf_counter() - timer.start, timer.finish())


def check_bundle(bundle_dir: Path, batch: int | None = None, progress: Progress = lambda _m: None,
                 tolerances: dict[str, dict] | None = None, model: str | None = None,
                 cache: bool = True) -> parity.ParityReport:
    """Re-run every parity stage of a bundle against a freshly loaded reference.

    tolerances: per-output Tolerance overrides (parity.parse_overrides: check's --atol/--rtol/--cosine).
    model: where the bundle's source is now (check's --model), if it moved; its content hash must match.
    """
    timer = StageTimer(progress)
    bundle_dir = Path(bundle_dir)
    manifest = bundle.load_manifest(bundle_dir, verify=True)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise InputError(f"--batch must be >= 1, got {batch}")
    batching = parity_batch(manifest.inputs[0].shape[0], batch)  # refuses a batch the bundle cannot take
    target = get_target(manifest.target.name)
    loaded, options = load_bundle(manifest, model, cache, progress=timer.step)  # check's --no-cache
    # what a target's stages get of the source, as its emit did (rk3588 rebuilds its .rknn with calibration images)
    pixel, _ = loaded.family.parity_pixels(loaded.source, batching.images)
    context = emit_context(None, options, dict(options.target_options or {}), loaded, pixel)
    with tempfile.TemporaryDirectory(prefix="vlmprune-") as scratch:
        dense = export_dense(loaded, options, Path(scratch), timer.step)
        report = run_parity(loaded, dense.path, bundle_dir, manifest, target, batching, context, timer.step,
                            tolerances)
    if manifest.llm_graphs:
        timer.step("LLM parity (the bundle's language-model graphs against the reference decoder)")
        report.stages.append(llm_export.check_llm(bundle.source_of(manifest, model), bundle_dir, manifest))
    return report
