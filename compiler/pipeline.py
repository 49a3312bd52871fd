"""compile_model and check_bundle: the library functions behind `vlmprune compile` and `check`.

The data flow, each step asked of the module that owns it: the frontend loads the model
(one adapter per family), the method parses its options, the target checks its own and
builds its pass pipeline (insert the method, retarget, legalize, check support) and its
fusion pipeline, the target emits its artifacts, and parity runs every stage against the
reference. Nothing here branches on a model family, a method or a target by name.
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
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

from vlmprune.compiler import __version__, bundle, parity, reference
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import Source, export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_crops, parity_inputs
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.llm import handoff
from vlmprune.passes.legalize import StaticBatchPass
from vlmprune.passes.methods import DEFAULT as DEFAULT_METHOD
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import BLOCK, SiteSpec
from vlmprune.passes.methods.crops import BUDGETS, CropBudget, crop_params, default_budget
from vlmprune.passes.outputs import BatchDimNamePass, DropZeroAddPass, FeatureOutputPass
from vlmprune.passes.positions import with_positions
from vlmprune.passes.prune import prune_record
from vlmprune.passes.shapes import FoldStaticDimsPass
from vlmprune.passes.structure import find_tower_structure
from vlmprune.targets import get_target
from vlmprune.targets.base import PruneConfig, Target, anyres_readme
from vlmprune.targets.runtime import ort_session, run_session

Progress = Callable[[str], None]
WEIGHTS = "weights.bin"  # shared by every graph in a bundle
DENSE = ".dense.onnx"  # the unpruned export, kept only while parity runs


@dataclasses.dataclass
class CompileOptions:
    target: str = "ort"
    method: str = DEFAULT_METHOD
    keep: int = 192
    layer: int | None = None  # BLOCK methods: prune after this block; None: the feature layer (tower's end)
    prune: bool = True
    batch: int | None = None  # None: dynamic batch
    opset: int = 18
    feature_layer: int | None = None
    image_size: int | None = None  # dynamic-resolution families (qwen2_vl): the static size to compile for
    grid: str | None = None  # anyres families (llava_next): the crops' grid, "ROWSxCOLS"; None: the model's largest
    crop_budget: str | None = None  # anyres: split K over crops "proportional" | "equal"; None: the method's default
    cls: str | None = None  # "drop" | "keep" the [CLS] token in image_features; None: the model's select strategy
    with_llm: bool = False  # also export the language model (compiler.llm.export) into llm/
    llm_exporter: str | None = None  # ort: "torch" (default) or "genai" (onnxruntime-genai's builder)
    fastv_layer: int | None = None  # --with-llm: FastV after this LLM layer (from 1); None: dense LLM
    fastv_keep: float | None = None  # FastV: the share of image tokens kept (default 0.5)
    image_start: int | None = None  # FastV: prompt tokens before the image (the compiled image span)
    force: bool = False
    debug: bool = False  # on a failed fusion, report every near-match and why it failed
    method_options: dict = dataclasses.field(default_factory=dict)  # e.g. {"lambda": 0.3}, {"contextual": 30}
    target_options: dict = dataclasses.field(default_factory=dict)  # e.g. {"precision": "int8"}, {"soc": "SM8550"}


@dataclasses.dataclass
class CompileResult:
    bundle: Path
    manifest: dict
    report: parity.ParityReport
    seconds: float


class _Timer:
    def __init__(self, progress: Progress):
        self.progress, self.start = progress, time.perf_counter()

    def step(self, message: str):
        self.progress(f"[{time.perf_counter() - self.start:6.1f}s] {message}")


@dataclasses.dataclass
class _Plan:
    """What validation resolved: the target, the method with its parameters, the target's options."""

    target: Target
    config: PruneConfig | None
    target_options: dict


def compile_model(model: str, output: Path, options: CompileOptions, progress: Progress = lambda _m: None) -> CompileResult:
    """Load MODEL, export it, insert pruning, emit the target's bundle at output, and check parity.

    Every option is validated before any work; the output is claimed before the model
    is loaded, so a second compile into the same directory fails at once.
    """
    timer = _Timer(progress)
    output = Path(output)
    plan = validate_options(options)
    llm_export.check_llm_model(model, options)  # --with-llm against the model's config, before any work
    target = plan.target
    ok, why = target.available()
    if not ok:
        raise InputError(f"target {target.name} is not available here: {why}")
    with bundle.staging(output, options.force) as tmp:
        timer.step(f"load {model}")
        source = _load(model, options)
        if source.crops is not None:
            _crops_on_target(source, options, target)
        if plan.config is not None and source.pipeline is not None:
            plan.config = dataclasses.replace(plan.config, head=source.head)  # for --score probe
            plan.config = _over_crops(source, plan.config, options)
            _check_against(source, plan.config)
        elif plan.config is not None:  # an .onnx source: what needs a torch tower; the insertion checks its site
            plan.config.method.check_onnx_source(plan.config.params)
        if source.kind == "onnx" and options.batch is not None:
            raise InputError("--batch cannot change an .onnx source; re-export it with the batch you need")
        dense = _dense_model(source, options, tmp, timer)
        dense_path = tmp / DENSE
        pipeline = target.pipeline(plan.config, options)
        if source.position_table is not None:  # the kept tokens' LLM positions, on every target
            pipeline = with_positions(pipeline, source.position_table, source.positions)
        timer.step("passes: " + ", ".join(pipeline.names))
        decomposed = pipeline(dense).model
        ir.save(decomposed, tmp / "model.decomposed.onnx")
        record = prune_record(decomposed)
        fusion = target.fusion(plan.config, options, record)
        if fusion is not None:
            timer.step("fusion: " + ", ".join(fusion.names))
            fusion(decomposed)
        batch = _parity_batch({"inputs": _io(decomposed.graph.inputs)}, options.batch)
        pixel, _ = _parity_pixels(source, batch)
        timer.step(f"emit target {target.name}")
        target_fields = target.emit(decomposed, tmp, {
            "config": plan.config, "options": options, "target_options": plan.target_options, "source": source,
            "parity_inputs": pixel, "debug": options.debug})
        manifest = _manifest(source, options, plan, record, decomposed, target_fields)
        manifest["llm"] = handoff.llm_section(manifest)  # what an LLM runtime needs to splice the tokens
        if options.with_llm:  # the language model's graphs beside the tower's (hashed like every file)
            manifest["llm_graphs"] = llm_export.emit_llm(model, manifest, options, tmp, timer.step)
        timer.step("parity")
        report = _parity(source, dense_path, tmp, manifest, target, batch, progress=timer.step)
        dense_path.unlink()
        manifest["parity"] = {"passed": report.passed, "stages": report.summary()}
        (tmp / "parity.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        (tmp / "README.md").write_text(target.readme(manifest) + handoff.readme_section(manifest)
                                          + anyres_readme(manifest) + llm_export.readme_section(manifest))
        manifest = bundle.write_manifest(tmp, manifest)
    timer.step(f"bundle written to {output}")
    return CompileResult(output, manifest, report, time.perf_counter() - timer.start)


def check_bundle(bundle_dir: Path, batch: int | None = None, progress: Progress = lambda _m: None,
                 tolerances: dict[str, dict] | None = None, model: str | None = None) -> parity.ParityReport:
    """Re-run every parity stage of a bundle against a freshly loaded reference.

    tolerances: per-output Tolerance overrides (parity.parse_overrides: check's --atol/--rtol/--cosine).
    model: where the bundle's source is now (check's --model), if it moved; its content hash must match.
    """
    timer = _Timer(progress)
    bundle_dir = Path(bundle_dir)
    manifest = bundle.load_manifest(bundle_dir, verify=True)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise InputError(f"--batch must be >= 1, got {batch}")
    parity_batch = _parity_batch(manifest, batch)  # refuses a batch the bundle cannot take, before any work
    target = get_target(manifest["target"]["name"])
    source_spec = bundle.source_of(manifest, model)
    timer.step(f"load {source_spec}")
    options = CompileOptions(**{**manifest["compile_options"], "debug": False})
    source = _load(source_spec, options)
    if source.content_hash != manifest["model"]["sha256"]:
        raise InputError(f"{source_spec} has changed since the bundle was compiled (content hash differs)"
                         if model is None else
                         f"--model {model} is not the bundle's source {manifest['model']['source']} "
                         "(content hash differs)")
    with tempfile.TemporaryDirectory(prefix="vlmprune-") as scratch:
        _dense_model(source, options, Path(scratch), timer)
        timer.step("parity")
        report = _parity(source, Path(scratch) / DENSE, bundle_dir, manifest, target, parity_batch,
                         progress=timer.step, tolerances=tolerances)
    if manifest.get("llm_graphs"):
        timer.step("LLM parity (the bundle's language-model graphs against the reference decoder)")
        report.stages.append(llm_export.check_llm(source_spec, bundle_dir, manifest))
    return report


# ---------------------------------------------------------------------- validation


def validate_options(options: CompileOptions) -> _Plan:
    """The one validation layer: every option, before any work (export, load, even the output claim)."""
    def integer(name: str, value, minimum: int | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{name} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise InputError(f"{name} must be >= {minimum}, got {value}")

    if options.layer is not None:
        integer("--layer", options.layer)
        if options.layer < 1:
            raise InputError(f"--layer counts blocks from 1, got {options.layer}")
    if options.batch is not None:
        integer("--batch", options.batch, 1)
    integer("--opset", options.opset)
    if not 17 <= options.opset <= 23:
        raise InputError(f"--opset must be between 17 and 23, got {options.opset}")
    if options.feature_layer is not None:
        integer("--feature-layer", options.feature_layer)
    if options.image_size is not None:
        integer("--image-size", options.image_size, 1)
    if options.cls not in (None, "drop", "keep"):
        raise InputError(f"--cls is drop or keep, got {options.cls!r}")
    if options.crop_budget not in (None, *BUDGETS):
        raise InputError(f"--crop-budget is {' or '.join(BUDGETS)}, got {options.crop_budget!r}")
    if options.grid is not None:
        from vlmprune.compiler.frontend.llava_next import parse_grid

        parse_grid(options.grid)
    target = get_target(options.target)
    config = None
    if options.prune:
        method = get_method(options.method)
        params = method.parse(options.keep, options.method_options or {})
        if options.layer is not None and method.needs(params).site != BLOCK:
            raise InputError(f"method {method.name} prunes the projector output (the tower's end); "
                             "--layer does not apply to it")
        config = PruneConfig(method, params, options.layer)
    elif options.method_options:
        raise InputError("--no-prune takes no method options")
    llm_export.check_llm_options(options)
    return _Plan(target, config, target.check_options(options))


def _check_against(source: Source, config: PruneConfig) -> None:
    """Catch what the insertion would reject before spending time on the export."""
    method, params = config.method, config.params
    blocks = source.num_blocks
    if config.layer is not None and not 1 <= config.layer <= blocks:
        raise InputError(f"--layer {config.layer} is out of range: this tower runs {blocks} blocks (1..{blocks})")
    pipe = source.pipeline
    prefix = pipe.prefix if method.needs(params).site == BLOCK or not pipe.drop_cls else 0
    method.check(params, SiteSpec(source.num_patches, bool(source.has_cls and prefix), config.layer or blocks, blocks,
                                  prefix=prefix, head=config.head is not None, merge=source.spatial_merge))


def _parity_batch(manifest: dict, batch: int | None) -> ParityBatch:
    static = manifest["inputs"][0]["shape"][0]
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



# --------------------------------------------------------------------- the model


def _load(spec: str, options: CompileOptions) -> Source:
    source = load_source(spec, options.feature_layer, options.image_size)
    _fix_crops(source, options)
    if source.pipeline is not None and options.cls is not None:
        source.pipeline.drop_cls = options.cls == "drop"
        source.details["select_strategy"] = f"{source.details.get('select_strategy')} (--cls {options.cls})"
    return source


def _fix_crops(source: Source, options: CompileOptions) -> None:
    """Anyres sources (llava_next): the grid to compile for, and whether the export packs the crops.

    A pruned bundle prunes each crop's features, so its export stops before HF's packing
    (which the LLM runtime does on the kept tokens); a dense one packs like HF.
    """
    given = [(flag, value) for flag, value in (("--grid", options.grid), ("--crop-budget", options.crop_budget))
             if value is not None]
    if source.crops is None:
        if given:
            what = source.details.get("model_type", source.family)  # qwen2_5_vl, not its family's qwen2_vl
            raise InputError(f"{given[0][0]} applies to anyres models (llava_next), not to this {what} model")
        return
    if options.grid is not None:
        source.regrid(options.grid)
    count = source.crops["count"]
    if options.cls == "keep":
        raise InputError("--cls keep is not available for anyres crops: each crop is packed as a patch grid, "
                         "without [CLS]")
    if options.batch is not None:
        raise InputError(f"--batch does not apply to anyres models: the input is the {count} crops of one image "
                         f"[{count}, 3, {source.image_size}, {source.image_size}]; run one image per call")
    if not options.prune and options.crop_budget is not None:
        raise InputError("--no-prune takes no --crop-budget")
    source.pipeline.pack = not options.prune


def _crops_on_target(source: Source, options: CompileOptions, target: Target) -> None:
    """The crops of one image are the graph's batch: refuse, before the export, a target that cannot run it."""
    count = source.crops["count"]
    try:
        target.check_options(dataclasses.replace(options, batch=count))
    except InputError as exc:
        why = str(exc).split(": ")[0]
        raise InputError(f"target {target.name} cannot run an anyres model: its input is the {count} crops of one "
                         f"image as a batch of {count}, and {why}") from None


def _over_crops(source: Source, config: PruneConfig, options: CompileOptions) -> PruneConfig:
    """The method over an anyres source's crops, under one global budget (passes.methods.crops)."""
    if source.crops is None:
        return config
    budget = options.crop_budget or default_budget(config.method)
    return dataclasses.replace(config, method=CropBudget(config.method),
                               params=crop_params(config.params, source.crops, budget))


def _parity_pixels(source: Source, batch: ParityBatch) -> tuple[np.ndarray, dict]:
    """The parity photos, preprocessed as the model's processor does (an anyres model: each photo's crops)."""
    if source.crops is None:
        return parity_inputs(batch.images, source.image_size, source.mean, source.std)
    photos = max(2, batch.images // source.crops["count"])  # one photo per chunk of C crops, two at least
    return parity_crops(photos, source.crops, source.image_size, source.mean, source.std)


def _dense_model(source: Source, options: CompileOptions, folder: Path, timer: _Timer) -> ir.Model:
    """Export (or load) the dense tower; its weights go to folder/WEIGHTS once, the graph to folder/DENSE.

    Every graph written later into the same folder (decomposed, target) refers to that
    one weights file instead of copying gigabytes per graph. An .onnx source is given
    the bundle's output contract first (passes.outputs); one exported with static shapes
    has its run-time shape computations folded for that shape, and under a dynamic batch
    those that read static dims only (passes.shapes).
    """
    if source.kind == "onnx":
        timer.step(f"load {source.onnx_path.name} (ONNX, opset {_opset_of(source.onnx_path)})")
        try:
            model = ir.load(source.onnx_path)
        except Exception as exc:  # external data that ONNX cannot read, after the frontend's checks
            raise InputError(f"{source.onnx_path}: cannot be loaded ({str(exc).splitlines()[0]})") from None
        static = [v.shape[0] for v in model.graph.inputs
                  if v.shape is not None and all(isinstance(d, int) for d in v.shape)]
        if static and len(static) == len(model.graph.inputs):
            StaticBatchPass(static[0], "the .onnx tower")(model)
        ShapeInferencePass()(model)  # what the exporter left unannotated, for the rewrites below
        FoldStaticDimsPass()(model)  # sizes computed from static dims (a dynamic batch left them unfolded)
        DropZeroAddPass()(model)
        structure = find_tower_structure(model.graph)
        # The patch Conv's kernel, which the frontend cannot read without the passes' finder: pictures need it.
        source.patch_size = source.patch_size or structure.patch_size
        FeatureOutputPass(drop_cls=_drop_cls(source, options), num_patches=structure.num_patches)(model)
        RemoveUnusedNodesPass()(model)  # what fed only the dropped outputs (e.g. SigLIP's pooling head)
        BatchDimNamePass()(model)
    else:
        batch = source.crops["count"] if source.crops is not None else options.batch  # one image's crops
        timer.step(f"export (torch.onnx dynamo, opset {options.opset}, batch {batch or 'dynamic'})")
        model = export_onnx(source.pipeline, source.image_size, batch, options.opset)
    ir.external_data.unload_from_model(model, folder, WEIGHTS, size_threshold_bytes=1024)
    ir.save(model, folder / DENSE)
    return model


def _opset_of(path: Path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _drop_cls(source: Source, options: CompileOptions) -> bool:
    """--cls drop|keep, else the model's select strategy (LLaVA's `default` drops [CLS]; bare towers follow it)."""
    if options.cls is not None:
        return options.cls == "drop"
    return source.pipeline.drop_cls if source.pipeline is not None else True


# ---------------------------------------------------------------------- manifest


def _io(values) -> list[dict]:
    out = []
    for v in values:
        shape = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        out.append({"name": v.name, "shape": shape, "dtype": v.dtype.name.lower() if v.dtype else None})
    return out


def _manifest(source: Source, options: CompileOptions, plan: _Plan, record: dict | None, model: ir.Model,
              target_fields: dict) -> dict:
    target = plan.target
    if record is None:
        method = {"name": "none", "summary": "dense (no pruning)"}
    else:
        where = (f"after block {record['layer']}/{record['num_blocks']}" if record["site"] == BLOCK
                 else "on the projector output")
        method = {"name": record["method"], "params": record["params"], "keep": record["params"]["keep"],
                  "site": record["site"], "layer": record["layer"], "num_blocks": record["num_blocks"],
                  "formulation": record["formulation"], "tokens_in": record["tokens_in"],
                  "tokens_out": record["tokens_out"], "num_patches": record["num_patches"],
                  "has_cls": record["has_cls"], "prefix": record["prefix"], "kept_count": record["kept_count"],
                  "summary": f"{record['summary']} ({where}, {record['num_patches']} patch tokens)"}
    return {
        "vlmprune_version": __version__,
        "target": {"name": target.name, "summary": target.summary, "toolchain": target.toolchain(),
                   "options": plan.target_options, **target_fields},
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
        "model": {"source": source.spec, "kind": source.kind, "family": source.family, "sha256": source.content_hash,
                  "image_size": source.image_size, "patch_size": source.patch_size, "positions": source.positions,
                  "feature_layer_override": options.feature_layer, **source.details},
        "method": method,
        "cls": {"in_features": _features_keep_cls(model, record), "option": options.cls,
                "default": "the model's select strategy (drop for towers without one)"},
        "compile_options": dataclasses.asdict(options),
        "inputs": _io(model.graph.inputs),
        "outputs": _io(model.graph.outputs),
        "preprocess": {"mean": list(source.mean), "std": list(source.std), "size": source.image_size},
    }


def _features_keep_cls(model: ir.Model, record: dict | None) -> bool | None:
    """Whether image_features starts with the [CLS] token."""
    features = next((v for v in model.graph.outputs if v.name == reference.FEATURES), None)
    if record is None or features is None or features.shape is None:
        return None
    tokens = features.shape[1]
    return isinstance(tokens, int) and record["has_cls"] and tokens == record["tokens_out"]


# ------------------------------------------------------------------------ parity


def in_chunks(run, chunk: int):
    """run over a batch `chunk` images at a time (a static-batch graph takes only its own batch)."""
    def chunked(pixel: np.ndarray) -> dict[str, np.ndarray]:
        if len(pixel) <= chunk:
            return run(pixel)
        outs = [run(pixel[i: i + chunk]) for i in range(0, len(pixel), chunk)]
        return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}
    return chunked


def _record_of(manifest: dict) -> dict | None:
    method = manifest["method"]
    if method["name"] == "none":
        return None
    return {"method": method["name"], "params": method["params"], "site": method["site"], "layer": method["layer"],
            "has_cls": method["has_cls"], "num_patches": method["num_patches"],
            "prefix": method.get("prefix", int(method["has_cls"]))}


def _parity(source: Source, dense_path: Path, bundle_dir: Path, manifest: dict, target: Target, batch: ParityBatch,
            progress: Progress, tolerances: dict[str, dict] | None = None) -> parity.ParityReport:
    pixel, described = _parity_pixels(source, batch)
    described["chunk"] = batch.chunk
    record = _record_of(manifest)
    stages: list[parity.StageResult] = []

    def ort_file(path: Path):
        return in_chunks(lambda x: run_session(ort_session(path), x), batch.chunk)

    if source.pipeline is not None:
        dense_ref, pruned_ref = reference.torch_reference(source, record, pixel)
        stages.append(parity.run_stage("export", "onnxruntime CPU (dense export)", "fp32", ort_file(dense_path),
                                       pixel, dense_ref, output_overrides=tolerances))
        progress(_line(stages[-1]))
        expected = dense_ref if pruned_ref is None else pruned_ref
    else:  # an .onnx source: the original graph is the reference
        expected = reference.onnx_reference(dense_path, record, pixel, lambda run: in_chunks(run, batch.chunk))
    stages.append(parity.run_stage("rewritten", "onnxruntime CPU (model.decomposed.onnx)", "fp32",
                                   ort_file(bundle_dir / "model.decomposed.onnx"), pixel, expected,
                                   output_overrides=tolerances))
    progress(_line(stages[-1]))
    for spec in target.stages(bundle_dir, manifest):
        stages.append(parity.run_stage(spec.stage, spec.runtime, spec.precision, in_chunks(spec.run, batch.chunk),
                                       pixel, expected, output_overrides=tolerances))
        progress(_line(stages[-1]))
    return parity.ParityReport(described, stages, parity.reference_summary(expected))


def _line(stage: parity.StageResult) -> str:
    s = parity.stage_summary(stage)
    bounds = parity.summary_bounds(stage.tolerance, stage.outputs.get(parity.FEATURES))
    figures = ", ".join(f"{k} {parity.figure_text(v, 6, **bounds.get(k, {}))}" for k, v in s.items()
                        if isinstance(v, float))
    return f"  {stage.stage:<10} {'PASS' if stage.passed else 'FAIL'}  {figures}" + (f"  ({stage.error})" if stage.error else "")
