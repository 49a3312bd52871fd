"""The compile's stages, each a public function from typed records to a typed record.

compile_model (the package's __init__) is their composition, and `--keep auto` (auto_keep), `check`,
`eval` and the pictures call the same functions instead of repeating them:

    validate_options(options) -> Plan          every option, once (pipeline.options)
    ready(model, plan)                         this machine and the model's config can make it
    load(model, plan) -> Loaded                the source and its family (load_bundle: a bundle's)
    export_dense(loaded, options, folder) -> DenseExport
    fit(plan, loaded) -> Plan                  the method fitted to the source's site
    lower(dense model, loaded, plan) -> Lowered    the target's pass pipeline: model.decomposed.onnx
    fuse(lowered, plan) -> Fused               the target's fusions, in place
    emit(fused, loaded, plan, folder) -> Emitted   the target's artifacts
    describe(loaded, plan, fused, emitted) -> Manifest
    export_llm(model, manifest, plan, folder) -> Manifest   --with-llm's graphs
    run_parity(loaded, dense, bundle, manifest, ...) -> ParityReport   (each stage's StageResult to progress)
    write_bundle(folder, manifest, report, ...) -> Manifest

Every stage after validate_options is handed the Plan and reads the validated options off it; none
validates them again. Nothing here branches on a model family, a method or a target: each is asked.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

import vlmprune.compiler.pipeline.cache as cache
from vlmprune.compiler import __version__, bundle, parity
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.contract import DECOMPOSED, DENSE, FEATURES, PARITY, README, PruneRecord
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import DenseRequest, Family, Source, images, load_fixed, roi_input
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.llm import handoff
from vlmprune.compiler.parity import reference
from vlmprune.compiler.pipeline.options import CompileOptions, Plan, options_of
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.crops import over_tokens
from vlmprune.passes.methods.dense import Dense
from vlmprune.passes.onnx_tower import OnnxTowerContractPass
from vlmprune.passes.positions import with_positions
from vlmprune.passes.prune import prune_record
from vlmprune.targets.base import EmitContext, PruneConfig, Target
from vlmprune.targets.runtime import ort_session, run_session

# A stage's progress: its lines as it works; run_parity's also each parity stage's record (a parity.StageResult) as
# the stage ends, which the caller renders (the CLI: render.progress_line) or keeps: the library sends data.
Progress = Callable[["str | parity.StageResult"], None]


def _quiet(_message: str | parity.StageResult) -> None:
    pass


# ------------------------------------------------------------------------ records


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The model source and its family, fixed for this compile (or for the bundle being checked)."""

    source: Source
    family: Family


@dataclasses.dataclass(frozen=True)
class DenseExport:
    """The dense tower: its graph, written to `path` (its weights beside it, compiler.contract.WEIGHTS)."""

    model: ir.Model
    path: Path


@dataclasses.dataclass(frozen=True)
class Lowered:
    """The target's pass pipeline run on the dense graph: the standard-op graph (model.decomposed.onnx where it was
    written: `path`), what the method inserted (None: dense) and the passes that ran."""

    model: ir.Model
    record: PruneRecord | None
    passes: tuple[str, ...]
    path: Path | None = None


@dataclasses.dataclass(frozen=True)
class Fused:
    """The lowered graph after the target's fusions (the same model, rewritten in place), the fusions that ran."""

    model: ir.Model
    record: PruneRecord | None
    fusions: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ParityBatch:
    """How parity feeds the graphs: `images` parity images, `chunk` at a time (a static batch takes only its own)."""

    images: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Emitted:
    """What the target's emit wrote: its manifest fields, the context it was handed (its parity stages get the same),
    and how parity feeds the bundle."""

    fields: dict
    context: EmitContext
    batch: ParityBatch


# ------------------------------------------------------------------------ stages


def ready(model: str, plan: Plan) -> None:
    """Before any work: the target can be emitted and checked on this machine, and --with-llm fits the model's
    config."""
    llm_export.check_llm_model(model, plan.options)
    ok, why = plan.target.available()
    if not ok:
        raise InputError(f"target {plan.target.name} is not available here: {why}")


def load_source(spec: str, options: CompileOptions) -> tuple[Source, Family]:
    """The source and its family, fixed for this compile by the family (its options, --cls, the batch)."""
    return load_fixed(spec, options.feature_layer, options.family_options, prune=options.prune, batch=options.batch,
                      cls=options.cls)


def load(model: str, plan: Plan, progress: Progress = _quiet) -> Loaded:
    """MODEL loaded as the plan says, and refused at once where its family and the target cannot meet (a static
    batch the family's input needs that the target's options refuse)."""
    progress(f"load {model}")
    source, family = load_source(model, plan.options)
    target, options = plan.target, plan.options
    family.check_target(source, target.name,
                        lambda count: target.check_options(dataclasses.replace(options, batch=count)))
    why = family.why_not_fastv(source) if options.fastv_layer is not None else None
    if why:
        raise InputError(f"--fastv-layer is not supported here: {why}")
    return Loaded(source, family)


def load_bundle(manifest: Manifest, model: str | None = None, cache: bool = True, how: str = "pass --model PATH",
                progress: Progress = _quiet) -> tuple[Loaded, CompileOptions]:
    """A bundle's source loaded as it was compiled (model: where it is now, if it moved; how: what to tell the user
    then), with the options the bundle records (cache: check's --no-cache); its content hash must be the bundle's."""
    spec = bundle.source_of(manifest, model, how)
    progress(f"load {spec}")
    options = options_of(manifest, debug=False, cache=cache)
    source, family = load_source(spec, options)
    if source.content_hash != manifest.model.sha256:
        raise InputError(f"{spec} has changed since the bundle was compiled (content hash differs)"
                         if model is None else
                         f"--model {model} is not the bundle's source {manifest.model.source} "
                         "(content hash differs)")
    return Loaded(source, family), options


def export_dense(loaded: Loaded, options: CompileOptions, folder: Path, progress: Progress = _quiet) -> DenseExport:
    """Export (or load) the dense tower, as its family does; its weights go to folder/WEIGHTS once, the graph to
    folder/DENSE.

    Every graph written later into the same folder (decomposed, target) refers to that one weights file instead
    of copying gigabytes per graph. options: the compile's (batch, opset, --cls, --no-cache).
    """
    source, family = loaded.source, loaded.family
    request = DenseRequest(options.batch, options.opset, options.cls, progress, onnx_contract=OnnxTowerContractPass)
    # The product cache (compiler.pipeline.cache): a hit skips the export; a family whose dense model is the
    # graph itself (an .onnx tower: its torch_reference is False) has nothing exported to keep.
    model = cache.dense_export(source, family.id, request, lambda: family.dense_model(source, request), folder, DENSE,
                               options.cache and family.torch_reference)
    return DenseExport(model, Path(folder) / DENSE)


def fit_config(config: PruneConfig | None, loaded: Loaded, family_options: dict) -> PruneConfig | None:
    """config as the method will run at this source's site: the source's scoring head (--score probe), over the
    family's token layout (crops), the method's site-relative options resolved (e.g. evs's --video-pruning-rate
    -> K), and checked against the site, before the export, as the insertion would check it."""
    if config is None:
        return None
    source, family = loaded.source, loaded.family
    config = dataclasses.replace(config, head=source.head)
    config = over_tokens(config, family.token_layout(source, family_options))
    config = family.fit_params(source, config, SiteSpec)
    family.check_method(source, config, SiteSpec)
    return config


def fit(plan: Plan, loaded: Loaded) -> Plan:
    """The plan with its method fitted to the loaded source (fit_config): what lower, fuse and emit take."""
    return dataclasses.replace(plan, config=fit_config(plan.config, loaded, plan.options.family_options), fitted=True)


def lower(dense: ir.Model, loaded: Loaded, plan: Plan, progress: Progress = _quiet,
          folder: Path | None = None) -> Lowered:
    """The target's pass pipeline (insert the method, retarget, legalize, check support; the kept tokens' LLM
    positions where the source has them) on dense, which it rewrites. folder: where model.decomposed.onnx is
    written (None: nowhere, as --keep auto's candidates)."""
    _require_fitted(plan, "lower")
    source = loaded.source
    pipeline = plan.target.pipeline(plan.config, plan.options)
    if source.position_table is not None:  # the kept tokens' LLM positions, on every target
        pipeline = with_positions(pipeline, source.position_table, source.positions)
    progress("passes: " + ", ".join(pipeline.names))
    model = pipeline(dense).model
    path = None
    if folder is not None:
        path = Path(folder) / DECOMPOSED
        ir.save(model, path)
    return Lowered(model, prune_record(model), tuple(pipeline.names), path)


def fuse(lowered: Lowered, plan: Plan, progress: Progress = _quiet) -> Fused:
    """The target's fusion pipeline on the lowered graph, in place (model.decomposed.onnx was written before)."""
    _require_fitted(plan, "fuse")
    fusion = plan.target.fusion(plan.config, plan.options, lowered.record)
    if fusion is None:
        return Fused(lowered.model, lowered.record, ())
    progress("fusion: " + ", ".join(fusion.names))
    fusion(lowered.model)
    return Fused(lowered.model, lowered.record, tuple(fusion.names))


def emit(fused: Fused, loaded: Loaded, plan: Plan, folder: Path, progress: Progress = _quiet,
         pixel: np.ndarray | None = None) -> Emitted:
    """The target's artifacts written to folder. pixel: the images its calibration and context get (default: the
    parity images, as many as parity feeds; --keep auto's candidates pass their own batch)."""
    _require_fitted(plan, "emit")
    batch = parity_batch(_io(fused.model.graph.inputs)[0]["shape"][0], plan.options.batch)
    if pixel is None:
        pixel, _ = loaded.family.parity_pixels(loaded.source, batch.images)
    progress(f"emit target {plan.target.name}")
    context = emit_context(plan.config, plan.options, plan.target_options, loaded, pixel)
    return Emitted(plan.target.emit(fused.model, folder, context), context, batch)


def describe(loaded: Loaded, plan: Plan, fused: Fused, emitted: Emitted, keep_auto: dict | None = None) -> Manifest:
    """The bundle's manifest before parity: the source, the method, the target's fields, the graph's inputs and
    outputs, what an LLM runtime needs to splice the tokens, and --keep auto's curve where K was chosen by it."""
    manifest = Manifest(_manifest(loaded.source, loaded.family, plan, fused.record, fused.model, emitted.fields))
    if keep_auto is not None:  # the K -> latency curve --keep auto chose K on
        manifest = manifest.extended(keep_auto=keep_auto)
    return manifest.extended(llm=handoff.llm_section(manifest))


def export_llm(model: str, manifest: Manifest, plan: Plan, folder: Path, progress: Progress = _quiet) -> Manifest:
    """--with-llm: the language model's graphs beside the tower's (hashed like every file); else manifest as is."""
    if not plan.options.with_llm:
        return manifest
    return manifest.extended(llm_graphs=llm_export.emit_llm(model, manifest, plan.options, folder, progress))


def run_parity(loaded: Loaded, dense_path: Path, bundle_dir: Path, manifest: Manifest, target: Target,
               batch: ParityBatch, context: EmitContext, progress: Progress = _quiet,
               tolerances: dict[str, dict] | None = None) -> parity.ParityReport:
    """Every stage of the bundle at bundle_dir against the reference: the dense export (dense_path), the rewritten
    graph, then the target's own stages. tolerances: per-output Tolerance overrides (parity.parse_overrides).
    progress gets a line as each stage begins and the stage's StageResult as it ends (data: the CLI renders it)."""
    progress("parity")
    source, family = loaded.source, loaded.family
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
        progress(stages[-1])
        expected = dense_ref if pruned_ref is None else pruned_ref
    else:  # an .onnx source: the original graph is the reference
        expected = reference.onnx_reference(dense_path, record, pixel,
                                            lambda run: in_chunks(lambda x, _fed: run(x), batch.chunk))
    progress("stage rewritten")
    stages.append(parity.run_stage("rewritten", "onnxruntime CPU (model.decomposed.onnx)", "fp32",
                                   ort_file(Path(bundle_dir) / DECOMPOSED), pixel, expected,
                                   output_overrides=tolerances))
    progress(stages[-1])
    for spec in target.stages(bundle_dir, manifest, context):
        progress(f"stage {spec.stage}")
        stages.append(parity.run_stage(spec.stage, spec.runtime, spec.precision,
                                       in_chunks(spec.run, batch.chunk, feeds), pixel, expected,
                                       output_overrides=tolerances))
        progress(stages[-1])
    return parity.ParityReport(described, stages, parity.reference_summary(expected))


def write_bundle(folder: Path, manifest: Manifest, report: parity.ParityReport, loaded: Loaded, target: Target,
                 dense_path: Path) -> Manifest:
    """The bundle's last files in folder: the dense graph removed (the bundle ships the decomposed and target
    graphs), parity.json, README.md and the manifest with the parity summary and every file's sha256."""
    Path(dense_path).unlink()
    manifest = manifest.extended(parity={"passed": report.passed, "stages": report.summary()})
    folder = Path(folder)
    (folder / PARITY).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (folder / README).write_text(target.readme(manifest) + handoff.readme_section(manifest)
                                 + loaded.family.readme_section(manifest) + llm_export.readme_section(manifest))
    return bundle.write_manifest(folder, manifest)


# ------------------------------------------------------------------------ shared by the stages and check


def emit_context(config: PruneConfig | None, options: CompileOptions, target_options: dict, loaded: Loaded,
                 pixel: np.ndarray) -> EmitContext:
    """What a target's emit (and its parity stages) is handed: of the source, what calibration needs; the frontend's
    preprocessing for the targets' calibration images (frontend.images), and the fixed-seed ROI their calibration
    samples carry beside them (frontend.roi_input: parity's); of the family, what its graph needs of a quantizing
    target (Family.quantization)."""
    source = loaded.source
    return EmitContext(config, options, target_options, source.image_size, tuple(source.mean), tuple(source.std),
                       images, pixel, roi_input.parity_roi_feed, loaded.family.quantization)


def parity_batch(static: int | str | None, batch: int | None) -> ParityBatch:
    """How parity feeds a graph whose input batch dimension is static (an int, or a symbolic name for a dynamic
    batch), at --batch (None: not given); one line for a batch a static-batch graph cannot take."""
    if isinstance(static, int):
        if batch is not None and batch != static:
            raise InputError(f"this bundle has a static batch of {static}; --batch {batch} cannot be fed to it "
                             f"(omit --batch, or recompile with --batch {batch})")
        # Two images at least, so that parity never rests on one picture.
        return ParityBatch(-(-max(2, static) // static) * static, static)
    chunk = batch or 2
    return ParityBatch(chunk, chunk)


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


# ------------------------------------------------------------------------ helpers


def _require_fitted(plan: Plan, stage: str) -> None:
    if not plan.fitted:
        raise InputError(f"{stage} takes a plan fitted to its source (pipeline.fit(plan, loaded)); "
                         "this one was not")


def _io(values) -> list[dict]:
    out = []
    for v in values:
        shape = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        out.append({"name": v.name, "shape": shape, "dtype": v.dtype.name.lower() if v.dtype else None})
    return out


def _manifest(source: Source, family: Family, plan: Plan, record: PruneRecord | None, model: ir.Model,
              target_fields: dict) -> dict:
    target, options = plan.target, plan.options
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
