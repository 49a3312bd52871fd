"""compile_model and check_bundle: the library functions behind `vlmprune compile` and `check`.

The data flow, each step asked of the module that owns it: the frontend loads the model
(one adapter per family), the method parses its options, the target checks its own and
builds its pass pipeline (insert the method, retarget, legalize, check support) and its
fusion pipeline, the target emits its artifacts, and parity runs every stage against the
reference. Nothing here branches on a model family, a method or a target: each is asked
(the family through compiler.frontend.family, with its own options and the prune config);
the defaults are the one place a name is spelled (CompileOptions: target "ort", the
registry's default method). The steps `--keep auto` repeats per candidate (validation, loading,
the dense export, the emit context) are pipeline.steps', below this module and auto_keep.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler import __version__, bundle, parity

from vlmprune.compiler.pipeline import auto_keep, cache
# The steps --keep auto repeats per candidate are steps.py's, below this module and auto_keep; re-exported here.
from vlmprune.compiler.pipeline.steps import (CompileOptions, Plan, dense_model, emit_context,  # noqa: F401
                                             load_source, validate_options)
from vlmprune.compiler.pipeline.timings import Span, StageTimer

from vlmprune.compiler.parity import reference
from vlmprune.compiler.contract import DECOMPOSED, DENSE, FEATURES, PARITY, README, PruneRecord
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import Family, Source, images
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.llm import handoff
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.crops import over_tokens
from vlmprune.passes.methods.dense import Dense
from vlmprune.passes.positions import with_positions
from vlmprune.passes.prune import prune_record
from vlmprune.targets import get_target
from vlmprune.targets.base import EmitContext, Target
from vlmprune.targets.runtime import ort_session, run_session

Progress = Callable[[str], None]


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

    Every option is validated before any work; the output is claimed before the model
    is loaded, so a second compile into the same directory fails at once.
    """
    timer = StageTimer(progress)
    output = Path(output)
    auto = auto_keep.requested(options)  # --keep auto --latency-ms X: K is timed first, inside the claimed output
    plan = validate_options(options if not auto else auto_keep.probe(options))  # every option, before any work
    llm_export.check_llm_model(model, options)  # --with-llm against the model's config, before any work
    target = plan.target
    ok, why = target.available()
    if not ok:
        raise InputError(f"target {target.name} is not available here: {why}")
    with bundle.staging(output, options.force) as tmp:
        keep_auto = None
        if auto:
            options, keep_auto = auto_keep.resolve(model, options, timer.step)
            plan = validate_options(options)
        timer.step(f"load {model}")
        source, family = load_source(model, options)
        family.check_target(source, target.name,
                            lambda count: target.check_options(dataclasses.replace(options, batch=count)))
        if plan.config is not None:
            plan.config = dataclasses.replace(plan.config, head=source.head)  # for --score probe
            plan.config = over_tokens(plan.config, family.token_layout(source, options.family_options))
            plan.config = family.fit_params(source, plan.config, SiteSpec)  # e.g. evs's --video-pruning-rate -> K
            family.check_method(source, plan.config, SiteSpec)  # what the insertion would reject, before the export
        dense = dense_model(source, family, options, tmp, timer)
        dense_path = tmp / DENSE
        pipeline = target.pipeline(plan.config, options)
        if source.position_table is not None:  # the kept tokens' LLM positions, on every target
            pipeline = with_positions(pipeline, source.position_table, source.positions)
        timer.step("passes: " + ", ".join(pipeline.names))
        decomposed = pipeline(dense).model
        ir.save(decomposed, tmp / DECOMPOSED)
        record = prune_record(decomposed)
        fusion = target.fusion(plan.config, options, record)
        if fusion is not None:
            timer.step("fusion: " + ", ".join(fusion.names))
            fusion(decomposed)
        batch = _parity_batch(_io(decomposed.graph.inputs)[0]["shape"][0], options.batch)
        pixel, _ = family.parity_pixels(source, batch.images)
        timer.step(f"emit target {target.name}")
        context = emit_context(plan.config, options, plan.target_options, source, pixel)
        target_fields = target.emit(decomposed, tmp, context)
        manifest = Manifest(_manifest(source, family, options, plan, record, decomposed, target_fields))
        if keep_auto is not None:  # the K -> latency curve --keep auto chose K on
            manifest = manifest.extended(keep_auto=keep_auto)
        manifest = manifest.extended(llm=handoff.llm_section(manifest))  # what an LLM runtime needs to splice tokens
        if options.with_llm:  # the language model's graphs beside the tower's (hashed like every file)
            manifest = manifest.extended(llm_graphs=llm_export.emit_llm(model, manifest, options, tmp, timer.step))
        timer.step("parity")
        report = _parity(source, family, dense_path, tmp, manifest, target, batch, context, progress=timer.step)
        dense_path.unlink()
        manifest = manifest.extended(parity={"passed": report.passed, "stages": report.summary()})
        (tmp / PARITY).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        (tmp / README).write_text(target.readme(manifest) + handoff.readme_section(manifest)
                                          + family.readme_section(manifest) + llm_export.readme_section(manifest))
        manifest = bundle.write_manifest(tmp, manifest)
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
    parity_batch = _parity_batch(manifest.inputs[0].shape[0], batch)  # refuses a batch the bundle cannot take
    target = get_target(manifest.target.name)
    source_spec = bundle.source_of(manifest, model)
    timer.step(f"load {source_spec}")
    options = options_of(manifest, debug=False, cache=cache)  # check's --no-cache
    source, family = load_source(source_spec, options)
    if source.content_hash != manifest.model.sha256:
        raise InputError(f"{source_spec} has changed since the bundle was compiled (content hash differs)"
                         if model is None else
                         f"--model {model} is not the bundle's source {manifest.model.source} "
                         "(content hash differs)")
    # what a target's stages get of the source, as its emit did (rk3588 rebuilds its .rknn with calibration images)
    pixel, _ = family.parity_pixels(source, parity_batch.images)
    context = emit_context(None, options, dict(options.target_options or {}), source, pixel)
    with tempfile.TemporaryDirectory(prefix="vlmprune-") as scratch:
        dense_model(source, family, options, Path(scratch), timer)
        timer.step("parity")
        report = _parity(source, family, Path(scratch) / DENSE, bundle_dir, manifest, target, parity_batch, context,
                         progress=timer.step, tolerances=tolerances)
    if manifest.llm_graphs:
        timer.step("LLM parity (the bundle's language-model graphs against the reference decoder)")
        report.stages.append(llm_export.check_llm(source_spec, bundle_dir, manifest))
    return report


def options_of(manifest: Manifest, **overrides) -> CompileOptions:
    """The options a bundle was compiled with, overrides applied. Bundles made before family_options hold the
    family options (--image-size, --grid, --crop-budget) as fields of their own: they become family_options."""
    saved = {**manifest.compile_options, **overrides}
    former = {k: saved.pop(k) for k in ("image_size", "grid", "crop_budget") if k in saved}
    saved["family_options"] = {**{k: v for k, v in former.items() if v is not None}, **saved.get("family_options", {})}
    return CompileOptions(**saved)


# ---------------------------------------------------------------------- validation


def _parity_batch(static: int | str | None, batch: int | None) -> ParityBatch:
    """static: the graph input's batch dimension (an int, or a symbolic name for a dynamic batch)."""
    if isinstance(static, int):
        if batch is not None and batch != static:
            raise InputError(f"this bundle has a static batch of {static}; --batch {batch} cannot be fed to it "
                             f"(omit --batch, or recompile with --batch {batch})")
        # Two images at least, so that parity never rests on one picture.
        return ParityBatch(-(-max(2, static) // static) * static, static)
    chunk = batch or 2
    return ParityBatch(chunk, chunk)


@dataclasses.dataclass(frozen=True)
class ParityBatch:
    """How parity feeds the graphs: `images` parity images, `chunk` at a time (a static batch takes only its own)."""

    images: int
    chunk: int



# ---------------------------------------------------------------------- manifest


def _io(values) -> list[dict]:
    out = []
    for v in values:
        shape = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        out.append({"name": v.name, "shape": shape, "dtype": v.dtype.name.lower() if v.dtype else None})
    return out


def _manifest(source: Source, family: Family, options: CompileOptions, plan: Plan, record: PruneRecord | None,
              model: ir.Model, target_fields: dict) -> dict:
    target = plan.target
    method = Dense().record() if record is None else record.manifest_section()
    return {
        "vlmprune_version": __version__,
        "target": {"name": target.name, "summary": target.summary, "toolchain": target.toolchain(),
                   "options": plan.target_options, **target_fields},
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
        "model": {"source": source.spec, "kind": source.kind, "family": family.id, "sha256": source.content_hash,
                  "image_size": source.image_size, "patch_size": source.patch_size, "positions": source.positions,
                  "feature_layer_override": options.feature_layer, **source.details},
        "method": method,
        "cls": {"in_features": _features_keep_cls(model, record), "option": options.cls,
                "default": "the model's select strategy (drop for towers without one)"},
        # How the bundle was made, not how this machine got there: --no-cache makes the same bundle.
        "compile_options": {k: v for k, v in dataclasses.asdict(options).items() if k != "cache"},
        "inputs": _io(model.graph.inputs),
        "outputs": _io(model.graph.outputs),
        "preprocess": {"mean": list(source.mean), "std": list(source.std), "size": source.image_size},
    }


def _features_keep_cls(model: ir.Model, record: PruneRecord | None) -> bool | None:
    """Whether image_features starts with the [CLS] token."""
    features = next((v for v in model.graph.outputs if v.name == FEATURES), None)
    if record is None or features is None or features.shape is None:
        return None
    tokens = features.shape[1]
    return isinstance(tokens, int) and record.has_cls and tokens == record.tokens_out


# ------------------------------------------------------------------------ parity


def in_chunks(run, chunk: int, feeds: dict[str, np.ndarray] | None = None):
    """run over a batch `chunk` images at a time (a static-batch graph takes only its own batch), a callable of the
    pixels: feeds ([B, ...] each, one row per image: parity.parity_feeds) go to every call, cut like the pixels."""
    feeds = feeds or {}

    def chunked(pixel: np.ndarray) -> dict[str, np.ndarray]:
        if len(pixel) <= chunk:
            return run(pixel, feeds)
        outs = [run(pixel[i: i + chunk], {name: value[i: i + chunk] for name, value in feeds.items()})
                for i in range(0, len(pixel), chunk)]
        return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}
    return chunked


def _parity(source: Source, family: Family, dense_path: Path, bundle_dir: Path, manifest: Manifest, target: Target,
            batch: ParityBatch, context: EmitContext,
            progress: Progress, tolerances: dict[str, dict] | None = None) -> parity.ParityReport:
    pixel, described = family.parity_pixels(source, batch.images)
    described["chunk"] = batch.chunk
    record = manifest.record
    stages: list[parity.StageResult] = []
    # what every stage's runner gets beside the pixels: the fixed-seed prompt rows and ROI, for the inputs it has
    feeds = parity.parity_feeds(pixel, manifest.inputs)

    def ort_file(path: Path):
        return in_chunks(lambda x, fed: run_session(ort_session(path), x, fed), batch.chunk, feeds)

    if family.torch_reference:
        dense_ref = cache.dense_reference(dense_path, pixel, lambda: reference.dense_reference(source, pixel), progress)
        dense_ref, pruned_ref = reference.torch_reference(source, record, pixel, dense_ref)
        source.release_weights()  # the stages below run the graphs only: one copy of the weights at a time
        stages.append(cache.export_stage(dense_path, pixel, tolerances, lambda: parity.run_stage(
            "export", "onnxruntime CPU (dense export)", "fp32", ort_file(dense_path), pixel, dense_ref,
            output_overrides=tolerances), progress))
        progress(_line(stages[-1]))
        expected = dense_ref if pruned_ref is None else pruned_ref
    else:  # an .onnx source: the original graph is the reference
        expected = reference.onnx_reference(dense_path, record, pixel,
                                            lambda run: in_chunks(lambda x, _fed: run(x), batch.chunk))
    progress("stage rewritten")
    stages.append(parity.run_stage("rewritten", "onnxruntime CPU (model.decomposed.onnx)", "fp32",
                                   ort_file(bundle_dir / DECOMPOSED), pixel, expected,
                                   output_overrides=tolerances))
    progress(_line(stages[-1]))
    for spec in target.stages(bundle_dir, manifest, context):
        progress(f"stage {spec.stage}")
        stages.append(parity.run_stage(spec.stage, spec.runtime, spec.precision,
                                       in_chunks(spec.run, batch.chunk, feeds), pixel, expected,
                                       output_overrides=tolerances))
        progress(_line(stages[-1]))
    return parity.ParityReport(described, stages, parity.reference_summary(expected))


def _line(stage: parity.StageResult) -> str:
    return "  " + parity.stage_line(stage)
