"""compile_model and check_bundle: the library functions behind `vlmprune compile` and `check`."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler import __version__, bundle, images, parity
from vlmprune.compiler.errors import InputError, VlmpruneError
from vlmprune.compiler.frontend import PruneSpec, Source, export_onnx, load_source
from vlmprune.compiler.reference import cls_attention, combine_scores, patch_variance, select_topk
from vlmprune.compiler.runtime import ort_session, run_session
from vlmprune.passes.legalize import StaticBatchPass
from vlmprune.passes.outputs import BatchDimNamePass, FeatureOutputPass
from vlmprune.passes.structure import find_tower_structure
from vlmprune.passes.token_prune import InsertTokenPrunePass, PruneConfig
from vlmprune.targets import get_target
from vlmprune.targets.base import Target

Progress = Callable[[str], None]
WEIGHTS = "weights.bin"  # shared by every graph in a bundle
DENSE = ".dense.onnx"  # the unpruned export, kept only while parity runs


@dataclasses.dataclass
class CompileOptions:
    target: str = "ort"
    keep: int = 192
    layer: int | None = None  # None: the feature layer (end of the tower)
    lam: float = 0.0
    prune: bool = True
    batch: int | None = None  # None: dynamic batch
    opset: int = 18
    feature_layer: int | None = None
    cls: str | None = None  # "drop" | "keep" the [CLS] token in image_features; None: the model's select strategy
    force: bool = False
    debug: bool = False  # on a failed fusion, report every near-match and why it failed
    precision: str | None = None  # target-specific, e.g. rk3588 "fp16,int8", qnn "int16"; None: the target's default
    soc: str | None = None  # qnn: the SoC the EPContext binary is compiled for; None: the target's default


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


def compile_model(model: str, output: Path, options: CompileOptions, progress: Progress = lambda _m: None) -> CompileResult:
    """Load MODEL, export it, insert pruning, emit the target's bundle at output, and check parity.

    Every option is validated before any work; the output is claimed before the model
    is loaded, so a second compile into the same directory fails at once.
    """
    timer = _Timer(progress)
    output = Path(output)
    validate_options(options)
    target = get_target(options.target)
    ok, why = target.available()
    if not ok:
        raise VlmpruneError(f"target {target.name} is not available here: {why}")
    with bundle.staging(output, options.force) as tmp:
        timer.step(f"load {model}")
        source = _load(model, options)
        if options.prune and source.pipeline is not None:
            _validate_against(source, options)
        if source.kind == "onnx" and options.batch is not None:
            raise InputError("--batch cannot change an .onnx source; re-export it with the batch you need")
        config = PruneConfig(options.keep, options.layer, options.lam, source.has_cls) if options.prune else None
        dense = _dense_model(source, options, tmp, timer)
        dense_path = tmp / DENSE
        passes = target.pipeline(config)
        timer.step("passes: " + ", ".join(type(p).__name__ for p in passes))
        decomposed, site = _run_pipeline(passes, dense)
        ir.save(decomposed, tmp / "model.decomposed.onnx")
        timer.step(f"emit target {target.name}")
        batch = _parity_batch({"inputs": _io(decomposed.graph.inputs)}, options.batch)
        pixel, _ = images.parity_inputs(batch.images, source.image_size, source.mean, source.std)
        target_fields = target.emit(decomposed, tmp, {"site": site, "options": options, "debug": options.debug,
                                                      "source": source, "parity_inputs": pixel})
        manifest = _manifest(source, options, target, site, decomposed, target_fields)
        timer.step("parity")
        report = _parity(source, dense_path, tmp, manifest, target, batch, progress=timer.step)
        dense_path.unlink()
        manifest["parity"] = {"passed": report.passed, "stages": report.summary()}
        (tmp / "parity.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        (tmp / "README.md").write_text(target.readme(manifest))
        manifest = bundle.write_manifest(tmp, manifest)
    timer.step(f"bundle written to {output}")
    return CompileResult(output, manifest, report, time.perf_counter() - timer.start)


def check_bundle(bundle_dir: Path, batch: int | None = None, progress: Progress = lambda _m: None) -> parity.ParityReport:
    """Re-run every parity stage of a bundle against a freshly loaded reference."""
    timer = _Timer(progress)
    bundle_dir = Path(bundle_dir)
    manifest = bundle.load_manifest(bundle_dir, verify=True)
    if batch is not None and batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}")
    parity_batch = _parity_batch(manifest, batch)  # refuses a batch the bundle cannot take, before any work
    target = get_target(manifest["target"]["name"])
    source_spec = manifest["model"]["source"]
    timer.step(f"load {source_spec}")
    options = CompileOptions(**{**manifest["compile_options"], "debug": False})
    source = _load(source_spec, options)
    if source.content_hash != manifest["model"]["sha256"]:
        raise InputError(f"{source_spec} has changed since the bundle was compiled (content hash differs)")
    with tempfile.TemporaryDirectory(prefix="vlmprune-") as scratch:
        _dense_model(source, options, Path(scratch), timer)
        timer.step("parity")
        return _parity(source, Path(scratch) / DENSE, bundle_dir, manifest, target, parity_batch, progress=timer.step)


@dataclasses.dataclass(frozen=True)
class ParityBatch:
    """How parity feeds the graphs: `images` parity images, `chunk` at a time (a static batch takes only its own)."""

    images: int
    chunk: int


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


def validate_options(options: CompileOptions) -> None:
    """The one validation layer: every option, before any work (export, load, even the output claim)."""
    def integer(name: str, value, minimum: int | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{name} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise InputError(f"{name} must be >= {minimum}, got {value}")

    if options.prune:
        integer("--keep", options.keep, 1)
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
    finite("--lambda", options.lam, minimum=0.0)
    if options.cls not in (None, "drop", "keep"):
        raise InputError(f"--cls is drop or keep, got {options.cls!r}")
    get_target(options.target).check_options(options)


def finite(name: str, value, minimum: float | None = None, maximum: float | None = None) -> float:
    """A float option: a finite number inside [minimum, maximum], else one line naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be >= {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise InputError(f"{name} must be <= {maximum:g}, got {value:g}")
    return float(value)


def _validate_against(source: Source, options: CompileOptions) -> None:
    """Catch what the pass would reject before spending time on the export."""
    blocks = source.num_blocks
    if options.layer is not None and not 1 <= options.layer <= blocks:
        raise InputError(f"--layer {options.layer} is out of range: this tower runs {blocks} blocks (1..{blocks})")
    if not source.has_cls:
        raise InputError("the tower has no [CLS] token, and the [CLS]-attention method needs one")
    n = (source.image_size // source.patch_size) ** 2
    if not 1 <= options.keep < n:
        raise InputError(f"--keep must satisfy 1 <= keep < {n} (the tower has {n} patch tokens), got {options.keep}")


def _dense_model(source: Source, options: CompileOptions, folder: Path, timer: _Timer) -> ir.Model:
    """Export (or load) the dense tower; its weights go to folder/WEIGHTS once, the graph to folder/DENSE.

    Every graph written later into the same folder (decomposed, target) refers to
    that one weights file instead of copying gigabytes per graph. An .onnx source is
    given the bundle's output contract first (passes.outputs).
    """
    if source.kind == "onnx":
        timer.step(f"load {source.onnx_path.name} (ONNX, opset {_opset_of(source.onnx_path)})")
        try:
            model = ir.load(source.onnx_path)
        except Exception as exc:  # external data that ONNX cannot read, after the frontend's checks
            raise InputError(f"{source.onnx_path}: cannot be loaded ({str(exc).splitlines()[0]})") from None
        static = [v.shape[0] for v in model.graph.inputs if v.shape is not None and
                  all(isinstance(d, int) for d in v.shape)]
        if static and len(static) == len(model.graph.inputs):
            # A static-shape export (the usual edge form) computes its token count with Shape ops
            # at run time; fold them for that shape first, so every block has a static token count.
            StaticBatchPass(static[0], "the .onnx tower")(model)
        structure = find_tower_structure(model.graph)
        FeatureOutputPass(drop_cls=_drop_cls(source, options), num_patches=structure.num_patches)(model)
        BatchDimNamePass()(model)
    else:
        timer.step(f"export (torch.onnx dynamo, opset {options.opset}, batch {options.batch or 'dynamic'})")
        try:
            model = export_onnx(source.pipeline, source.image_size, options.batch, options.opset)
        except Exception as exc:  # the exporter's failure is the user's to act on, in one line
            raise VlmpruneError(f"torch.onnx export failed: {str(exc).splitlines()[0]}") from exc
    ir.external_data.unload_from_model(model, folder, WEIGHTS, size_threshold_bytes=1024)
    ir.save(model, folder / DENSE)
    return model


def _load(spec: str, options: CompileOptions) -> Source:
    source = load_source(spec, options.feature_layer)
    if source.pipeline is not None and options.cls is not None:
        source.pipeline.drop_cls = options.cls == "drop"
        source.details["select_strategy"] = f"{source.details.get('select_strategy')} (--cls {options.cls})"
    return source


def _opset_of(path: Path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _drop_cls(source: Source, options: CompileOptions) -> bool:
    """--cls drop|keep, else the model's select strategy (LLaVA's `default` drops [CLS]; bare towers follow it)."""
    if options.cls is not None:
        return options.cls == "drop"
    return source.pipeline.drop_cls if source.pipeline is not None else True


def _run_pipeline(passes: list[ir.passes.PassBase], model: ir.Model):
    """Run the target's passes in order; return the model and what the insertion pass resolved."""
    site = None
    for p in passes:
        result = p(model)
        model = result.model
        if isinstance(p, InsertTokenPrunePass):
            site = p.site
    BatchDimNamePass()(model)
    return model, site


def _io(values) -> list[dict]:
    out = []
    for v in values:
        shape = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        out.append({"name": v.name, "shape": shape, "dtype": v.dtype.name.lower() if v.dtype else None})
    return out


def _manifest(source: Source, options: CompileOptions, target: Target, site, model: ir.Model, target_fields: dict) -> dict:
    if site is None:
        method = {"name": "none", "summary": "dense (no pruning)"}
    else:
        method = {"name": "cls-attention", "keep": options.keep, "layer": site.layer, "lambda": options.lam,
                  "num_blocks": site.num_blocks, "tokens_in": site.tokens_in, "tokens_out": site.tokens_out,
                  "num_patches": site.num_patches, "has_cls": site.has_cls,
                  "summary": f"[CLS]-attention pruning after block {site.layer}/{site.num_blocks}: "
                             f"{site.num_patches} -> {options.keep} patch tokens + 1 summary (lambda {options.lam})"}
    return {
        "vlmprune_version": __version__,
        "target": {"name": target.name, "summary": target.summary, "toolchain": target.toolchain(), **target_fields},
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
        "model": {"source": source.spec, "kind": source.kind, "sha256": source.content_hash,
                  "image_size": source.image_size, "patch_size": source.patch_size,
                  "feature_layer_override": options.feature_layer, **source.details},
        "method": method,
        "compile_options": dataclasses.asdict(options),
        "inputs": _io(model.graph.inputs),
        "outputs": _io(model.graph.outputs),
        "preprocess": {"mean": list(source.mean), "std": list(source.std), "size": source.image_size},
    }


def _torch_reference(source: Source, method: dict, pixel: np.ndarray):
    x = torch.from_numpy(pixel)
    with torch.no_grad():
        dense = {parity.FEATURES: source.pipeline(x).numpy()}
        if method["name"] == "none":
            return dense, None, None
        pruned_pipe = source.pipeline.with_prune(PruneSpec(method["keep"], method["layer"], method["lambda"]))
        feats, kept = pruned_pipe(x)
        pruned = {parity.FEATURES: feats.numpy(), parity.KEPT: kept.numpy()}
        return dense, pruned, pruned_pipe.last_scores.numpy()


def _onnx_reference(dense_path: Path, method: dict, pixel: np.ndarray, chunk: int):
    """For an .onnx source: the reference selection from block L's own Q and K, and values at the tower's end.

    The original graph is run with block L's Q and K exposed; the reference
    pruner's score and selection are computed from them in torch (fp64). When the
    pruning is after the last block and only per-token ops lie between that block and
    `image_features`, the reference features are the original output's kept rows (and
    [CLS] if kept); the summary row is its pruned rows' mean where nothing but slicing
    lies in between, and undefined (not compared) otherwise: a LayerNorm of a mean is
    not the mean of LayerNorms.
    """
    model = ir.load(dense_path)
    structure = find_tower_structure(model.graph)
    block = structure.blocks[method["layer"] - 1]
    features = model.graph.outputs[0]
    path = token_path(block.output, features) if method["layer"] == len(structure.blocks) else None
    model.graph.outputs.extend([block.q, block.k])
    probe = dense_path.with_name(".probe.onnx")  # beside the weights it refers to
    ir.save(model, probe)
    try:
        outputs = in_chunks(lambda x: run_session(ort_session(probe), x), chunk)(pixel)
    finally:
        probe.unlink()
    q = torch.from_numpy(outputs[block.q.name]).double()
    k = torch.from_numpy(outputs[block.k.name]).double()
    attn = cls_attention(q, k.transpose(-1, -2) if block.k_transposed else k, block.scale)
    variance = patch_variance(torch.from_numpy(pixel).double(), structure.patch_size) if method["lambda"] else None
    scores = combine_scores(attn, variance, method["lambda"])
    kept = select_topk(scores, method["keep"]).numpy()
    reference = {parity.KEPT: kept}
    if path is not None:
        dense = outputs[features.name]
        has_cls = dense.shape[1] == structure.num_patches + 1
        reference[parity.FEATURES] = _kept_rows(dense, kept, has_cls, summary=path == "slice")
    return reference, scores.numpy()


def _kept_rows(dense: np.ndarray, kept: np.ndarray, has_cls: bool, summary: bool) -> np.ndarray:
    """[CLS?] + the kept rows + the pruned rows' mean (NaN where the reference does not define it)."""
    patches = dense[:, 1:] if has_cls else dense
    rows = np.take_along_axis(patches, kept[..., None], axis=1)
    mask = np.ones(patches.shape[:2], dtype=bool)
    np.put_along_axis(mask, kept, False, axis=1)
    if summary:
        mean = (patches * mask[..., None]).sum(1, keepdims=True) / mask.sum(1)[:, None, None]
    else:
        mean = np.full((dense.shape[0], 1, dense.shape[2]), np.nan, dtype=dense.dtype)
    return np.concatenate(([dense[:, :1]] if has_cls else []) + [rows, mean.astype(dense.dtype)], axis=1)


# Ops that act on each token alone, with at most one runtime input: gathering rows commutes with them.
_PER_TOKEN = {"LayerNormalization", "Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Gelu", "Erf", "Tanh", "Sigmoid",
              "Relu", "Cast", "Identity", "Slice"}


def token_path(start: ir.Value, end: ir.Value) -> str | None:
    """How `end` follows from `start`: "slice" (Slice/Identity only), "per-token", or None (anything else)."""
    kind, value = "slice", end
    while value is not start:
        node = value.producer()
        if node is None or node.op_type not in _PER_TOKEN:
            return None
        runtime = [v for v in node.inputs if v is not None and ir.convenience.get_const_tensor(v) is None]
        if len(runtime) != 1:
            return None
        if node.op_type == "Slice":
            axes = ir.convenience.get_const_tensor(node.inputs[3]) if len(node.inputs) > 3 else None
            if axes is None or axes.numpy().reshape(-1).tolist() not in ([1], [-2]):
                return None
        elif node.op_type != "Identity":
            kind = "per-token"
        value = runtime[0]
    return kind


def in_chunks(run, chunk: int):
    """run over a batch `chunk` images at a time (a static-batch graph takes only its own batch)."""
    def chunked(pixel: np.ndarray) -> dict[str, np.ndarray]:
        if len(pixel) <= chunk:
            return run(pixel)
        outs = [run(pixel[i: i + chunk]) for i in range(0, len(pixel), chunk)]
        return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}
    return chunked


def _parity(source: Source, dense_path: Path, bundle_dir: Path, manifest: dict, target: Target, batch: ParityBatch,
            progress: Progress) -> parity.ParityReport:
    pixel, described = images.parity_inputs(batch.images, source.image_size, source.mean, source.std)
    described["chunk"] = batch.chunk
    method = manifest["method"]
    stages: list[parity.StageResult] = []

    def ort_file(path: Path):
        return in_chunks(lambda x: run_session(ort_session(path), x), batch.chunk)

    if source.pipeline is not None:
        dense_ref, pruned_ref, scores = _torch_reference(source, method, pixel)
        stages.append(parity.run_stage("export", "onnxruntime CPU (dense export)", "fp32", ort_file(dense_path),
                                       pixel, dense_ref))
        progress(_line(stages[-1]))
        reference = dense_ref if pruned_ref is None else pruned_ref
    elif method["name"] == "none":  # an .onnx source, dense: the original graph is the reference
        reference, scores = ort_file(dense_path)(pixel), None
    else:
        reference, scores = _onnx_reference(dense_path, method, pixel, batch.chunk)
    stages.append(parity.run_stage("rewritten", "onnxruntime CPU (model.decomposed.onnx)", "fp32",
                                   ort_file(bundle_dir / "model.decomposed.onnx"), pixel, reference, scores))
    progress(_line(stages[-1]))
    for spec in target.stages(bundle_dir, manifest):
        stages.append(parity.run_stage(spec.stage, spec.runtime, spec.precision, in_chunks(spec.run, batch.chunk),
                                       pixel, reference, scores))
        progress(_line(stages[-1]))
    return parity.ParityReport(described, stages)


def _line(stage: parity.StageResult) -> str:
    s = parity.stage_summary(stage)
    figures = ", ".join(f"{k} {v:.6g}" for k, v in s.items() if isinstance(v, float))
    return f"  {stage.stage:<10} {'PASS' if stage.passed else 'FAIL'}  {figures}" + (f"  ({stage.error})" if stage.error else "")
