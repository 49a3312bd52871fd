"""The compile's own steps, which `--keep auto` (pipeline.auto_keep) repeats per candidate K as the compile runs them.

CompileOptions validated into a Plan (validate_options: every option, before any work), the source
loaded (load_source), the dense tower exported (dense_model), and what a target's emit is handed
(emit_context). They live below the package's compile_model and check_bundle, which re-export
them, so that auto_keep uses them without importing the package that calls it: imports run one way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir

import vlmprune.compiler.pipeline.cache as cache
from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET, DENSE
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import (DenseRequest, Family, Source, check_family_options, images, load_fixed,
                                       roi_input)
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.pipeline.timings import StageTimer
from vlmprune.passes.methods import DEFAULT_METHOD, budget, get_method, schedule
from vlmprune.passes.methods.base import BLOCK
from vlmprune.passes.onnx_tower import OnnxTowerContractPass
from vlmprune.targets import DEFAULT_TARGET, get_target
from vlmprune.targets.base import EmitContext, PruneConfig, Target


@dataclasses.dataclass
class CompileOptions:
    target: str = DEFAULT_TARGET
    method: str = DEFAULT_METHOD
    keep: int | str = DEFAULT_KEEP  # "auto" (with latency_ms): the largest K whose latency fits (pipeline.auto_keep)
    latency_ms: float | None = None  # --keep auto's budget, ms per call on the target's runtime
    layer: int | None = None  # BLOCK methods: prune after this block; None: the feature layer (tower's end)
    prune: bool = True
    batch: int | None = None  # None: dynamic batch
    opset: int = DEFAULT_OPSET
    feature_layer: int | None = None
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
    # Options the model families declare (Family.options), e.g. {"grid": "2x2"}, {"crop_budget": "equal"},
    # {"image_size": 448}; each is refused for a model of another family.
    family_options: dict = dataclasses.field(default_factory=dict)
    cache: bool = True  # reuse (and keep) the dense export and its parity products (compiler.pipeline.cache); --no-cache


@dataclasses.dataclass
class Plan:
    """What validation resolved: the target, the method with its parameters, the target's options."""

    target: Target
    config: PruneConfig | None
    target_options: dict


def validate_options(options: CompileOptions) -> Plan:
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
    if get_target(options.target).opset_refusal(options.opset):  # the target's declared range, before any export
        raise InputError(get_target(options.target).opset_refusal(options.opset))
    if options.feature_layer is not None:
        integer("--feature-layer", options.feature_layer)
    if options.cls not in (None, "drop", "keep"):
        raise InputError(f"--cls is drop or keep, got {options.cls!r}")
    check_family_options(options.family_options)  # each family checks its own (--grid, --image-size, ...)
    target = get_target(options.target)
    config = None
    if options.prune:
        method = get_method(options.method)
        params = method.parse(options.keep, options.method_options or {})
        if options.layer is not None and method.needs(params).site != BLOCK:
            raise InputError(f"method {method.name} prunes the projector output (the tower's end); "
                             "--layer does not apply to it")
        layer = options.layer
        if params.get("schedule") is not None:  # --schedule: its last block is the method's layer
            last = schedule.layers(params)[-1]
            if layer is not None and layer != last:
                raise InputError(f"--layer {layer} is not the last block of --schedule {params['schedule']} ({last}); "
                                 "leave --layer out")
            layer = last
        # --budget adaptive: K per image; --schedule: the method in steps
        config = PruneConfig(schedule.wrap(budget.wrap(method, params), params), params, layer)
    elif options.method_options:
        raise InputError("--no-prune takes no method options")
    llm_export.check_llm_options(options)
    return Plan(target, config, target.check_options(options))


def load_source(spec: str, options: CompileOptions) -> tuple[Source, Family]:
    """The source and its family, fixed for this compile by the family (its options, --cls, the batch)."""
    return load_fixed(spec, options.feature_layer, options.family_options, prune=options.prune, batch=options.batch,
                      cls=options.cls)


def dense_model(source: Source, family: Family, options: CompileOptions, folder: Path, timer: StageTimer) -> ir.Model:
    """Export (or load) the dense tower, as its family does; its weights go to folder/WEIGHTS once, the graph to
    folder/DENSE.

    Every graph written later into the same folder (decomposed, target) refers to that
    one weights file instead of copying gigabytes per graph.
    """
    request = DenseRequest(options.batch, options.opset, options.cls, timer.step, onnx_contract=OnnxTowerContractPass)
    # The product cache (compiler.pipeline.cache): a hit skips the export; a family whose dense model is the
    # graph itself (an .onnx tower: its torch_reference is False) has nothing exported to keep.
    return cache.dense_export(source, family.id, request, lambda: family.dense_model(source, request), folder, DENSE,
                              options.cache and family.torch_reference)


def emit_context(config: PruneConfig | None, options: CompileOptions, target_options: dict, source: Source,
                 pixel: np.ndarray) -> EmitContext:
    """What a target's emit (and its parity stages) is handed: of the source, what calibration needs; the frontend's
    preprocessing for the targets' calibration images (frontend.images), and the fixed-seed ROI their calibration
    samples carry beside them (frontend.roi_input: parity's)."""
    return EmitContext(config, options, target_options, source.image_size, tuple(source.mean), tuple(source.std),
                       images, pixel, roi_input.parity_roi_feed)
