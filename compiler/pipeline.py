"""compile_model and check_bundle: the library functions behind `vlmprune compile` and `check`."""

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

from vlmprune.compiler import __version__, bundle, images, parity
from vlmprune.compiler.errors import InputError, VlmpruneError
from vlmprune.compiler.frontend import PruneSpec, Source, export_onnx, load_source
from vlmprune.compiler.reference import cls_attention, combine_scores, patch_variance, select_topk
from vlmprune.compiler.runtime import ort_session, run_session
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
    """Load MODEL, export it, insert pruning, emit the target's bundle at output, and check parity."""
    timer = _Timer(progress)
    output = Path(output)
    target = get_target(options.target)
    ok, why = target.available()
    if not ok:
        raise VlmpruneError(f"target {target.name} is not available here: {why}")
    bundle.prepare_output(output, options.force)
    _validate(options)

    timer.step(f"load {model}")
    source = load_source(model, options.feature_layer)
    if options.prune and source.pipeline is not None:
        _validate_against(source, options)
    config = PruneConfig(options.keep, options.layer, options.lam, source.has_cls) if options.prune else None
    with bundle.staging(output, options.force) as tmp:
        dense = _dense_model(source, options, tmp, timer)
        dense_path = tmp / DENSE
        passes = target.pipeline(config)
        timer.step("passes: " + ", ".join(type(p).__name__ for p in passes))
        decomposed, site = _run_pipeline(passes, dense)
        ir.save(decomposed, tmp / "model.decomposed.onnx")
        timer.step(f"emit target {target.name}")
        target_fields = target.emit(decomposed, tmp, {"site": site, "options": options, "debug": options.debug,
                                                      "source": source})
        manifest = _manifest(source, options, target, site, decomposed, target_fields)
        timer.step("parity")
        report = _parity(source, dense_path, tmp, manifest, target, options.batch or 2, progress=timer.step)
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
    target = get_target(manifest["target"]["name"])
    source_spec = manifest["model"]["source"]
    timer.step(f"load {source_spec}")
    source = load_source(source_spec, manifest["model"].get("feature_layer_override"))
    if source.content_hash != manifest["model"]["sha256"]:
        raise InputError(f"{source_spec} has changed since the bundle was compiled (content hash differs)")
    options = CompileOptions(**{**manifest["compile_options"], "debug": False})
    with tempfile.TemporaryDirectory(prefix="vlmprune-") as scratch:
        _dense_model(source, options, Path(scratch), timer)
        timer.step("parity")
        fixed = manifest["inputs"][0]["shape"][0]
        b = batch or (fixed if isinstance(fixed, int) else 2)
        return _parity(source, Path(scratch) / DENSE, bundle_dir, manifest, target, b, progress=timer.step)


def _validate(options: CompileOptions) -> None:
    if options.prune and options.keep < 1:
        raise InputError(f"--keep must be >= 1, got {options.keep}")
    if options.layer is not None and options.layer < 1:
        raise InputError(f"--layer counts blocks from 1, got {options.layer}")
    if options.batch is not None and options.batch < 1:
        raise InputError(f"--batch must be >= 1, got {options.batch}")
    if not 17 <= options.opset <= 23:
        raise InputError(f"--opset must be between 17 and 23, got {options.opset}")


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
    that one weights file instead of copying gigabytes per graph.
    """
    if source.kind == "onnx":
        model = ir.load(source.onnx_path)
        if options.batch is not None:
            raise InputError("--batch cannot change an .onnx source; re-export it with the batch you need")
    else:
        timer.step(f"export (torch.onnx dynamo, opset {options.opset}, batch {options.batch or 'dynamic'})")
        try:
            model = export_onnx(source.pipeline, source.image_size, options.batch, options.opset)
        except Exception as exc:  # the exporter's failure is the user's to act on, in one line
            raise VlmpruneError(f"torch.onnx export failed: {str(exc).splitlines()[0]}") from exc
    ir.external_data.unload_from_model(model, folder, WEIGHTS, size_threshold_bytes=1024)
    ir.save(model, folder / DENSE)
    return model


def _run_pipeline(passes: list[ir.passes.PassBase], model: ir.Model):
    """Run the target's passes in order; return the model and what the insertion pass resolved."""
    site = None
    for p in passes:
        result = p(model)
        model = result.model
        if isinstance(p, InsertTokenPrunePass):
            site = p.site
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


def _onnx_reference(dense_path: Path, method: dict, pixel: np.ndarray):
    """For an .onnx source: the reference selection from block L's own Q and K.

    The original graph is run with block L's Q and K exposed; the reference
    pruner's score and selection are computed from them in torch (fp64).
    """
    model = ir.load(dense_path)
    structure = find_tower_structure(model.graph)
    block = structure.blocks[method["layer"] - 1]
    model.graph.outputs.extend([block.q, block.k])
    probe = dense_path.with_name(".probe.onnx")  # beside the weights it refers to
    ir.save(model, probe)
    try:
        outputs = run_session(ort_session(probe), pixel)
    finally:
        probe.unlink()
    q = torch.from_numpy(outputs[block.q.name]).double()
    k = torch.from_numpy(outputs[block.k.name]).double()
    attn = cls_attention(q, k.transpose(-1, -2) if block.k_transposed else k, block.scale)
    variance = patch_variance(torch.from_numpy(pixel).double(), structure.patch_size) if method["lambda"] else None
    scores = combine_scores(attn, variance, method["lambda"])
    kept = select_topk(scores, method["keep"]).numpy()
    return {parity.KEPT: kept}, scores.numpy()


def _parity(source: Source, dense_path: Path, bundle_dir: Path, manifest: dict, target: Target, batch: int,
            progress: Progress) -> parity.ParityReport:
    pixel, described = images.parity_inputs(batch, source.image_size, source.mean, source.std)
    method = manifest["method"]
    stages: list[parity.StageResult] = []

    def ort_file(path: Path):
        return lambda x: run_session(ort_session(path), x)

    if source.pipeline is not None:
        dense_ref, pruned_ref, scores = _torch_reference(source, method, pixel)
        stages.append(parity.run_stage("export", "onnxruntime CPU (dense export)", "fp32", ort_file(dense_path),
                                       pixel, dense_ref))
        progress(_line(stages[-1]))
        reference = dense_ref if pruned_ref is None else pruned_ref
    elif method["name"] == "none":  # an .onnx source, dense: the original graph is the reference
        reference, scores = ort_file(dense_path)(pixel), None
    else:
        reference, scores = _onnx_reference(dense_path, method, pixel)
    stages.append(parity.run_stage("rewritten", "onnxruntime CPU (model.decomposed.onnx)", "fp32",
                                   ort_file(bundle_dir / "model.decomposed.onnx"), pixel, reference, scores))
    progress(_line(stages[-1]))
    for spec in target.stages(bundle_dir, manifest):
        stages.append(parity.run_stage(spec.stage, spec.runtime, spec.precision, spec.run, pixel, reference, scores))
        progress(_line(stages[-1]))
    return parity.ParityReport(described, stages)


def _line(stage: parity.StageResult) -> str:
    s = parity.stage_summary(stage)
    figures = ", ".join(f"{k} {v:.6g}" for k, v in s.items() if isinstance(v, float))
    return f"  {stage.stage:<10} {'PASS' if stage.passed else 'FAIL'}  {figures}" + (f"  ({stage.error})" if stage.error else "")
