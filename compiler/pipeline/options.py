"""The compile's options and the one validation that turns them into a Plan (the first stage, pipeline.stages' input).

validate_options checks every option once, before any work (export, load, even the output claim), and
returns the typed Plan every later stage is handed: the target, the method with its parameters, the
target's parsed options, and the options themselves as validated. No later stage validates them again.
`--keep auto` is validated here too: its budget, and the smallest K of the ladder the method takes; the
K the search then tries (pipeline.auto_keep) come from Plan.with_keep, which parses only what depends
on K (the method's parameters and the target's check of them), since every other option is unchanged.
"""

from __future__ import annotations

import dataclasses
import math

from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET, Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import check_family_options
from vlmprune.compiler.llm import export as llm_export
from vlmprune.passes.methods import DEFAULT_METHOD, budget, get_method, schedule
from vlmprune.passes.methods.base import BLOCK
from vlmprune.targets import DEFAULT_TARGET, TARGETS, get_target
from vlmprune.targets.base import PruneConfig, Target

AUTO = "auto"
# --keep auto's ladder starts at the smallest K the method takes: 1, 2, 4, ... (2 ** 12 at most).
LADDER_START = tuple(2 ** i for i in range(13))


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What validation resolved, handed to every later stage instead of the options.

    options: the options as validated (for --keep auto: at the K planned, latency_ms cleared, so that they are
    what the bundle records and recompiles with). config: the method with its parameters (None: --no-prune);
    fitted says whether it was fitted to a loaded source (stages.fit), which lower, fuse and emit require.
    budget_ms: --keep auto's budget while K is still to be chosen (pipeline.auto_keep), else None.
    """

    options: CompileOptions
    target: Target
    config: PruneConfig | None
    target_options: dict
    budget_ms: float | None = None
    fitted: bool = False

    def with_keep(self, keep: int) -> Plan:
        """This plan at another K (--keep auto's candidates and its choice): only what depends on K is parsed again,
        the method's parameters and the target's check of them; an unfitted plan, with no budget left."""
        return _at_keep(dataclasses.replace(self.options, keep=keep), self.target)


def validate_options(options: CompileOptions) -> Plan:
    """The one validation layer: every option, before any work (export, load, even the output claim)."""
    budget_ms = float(options.latency_ms) if requested(options) else None  # --keep auto's rules, before the rest
    _check_fixed(options)
    target = get_target(options.target)
    if budget_ms is None:
        return _at_keep(options, target)
    base, error = dataclasses.replace(options, latency_ms=None), None
    for keep in LADDER_START:  # the smallest K the method's options take; bad at every K: refused as that K is
        try:
            return dataclasses.replace(_at_keep(dataclasses.replace(base, keep=keep), target), budget_ms=budget_ms)
        except InputError as exc:
            error = error or exc
    raise error


def requested(options: CompileOptions) -> bool:
    """Whether options ask for --keep auto; one line for a bad combination or value, before any work."""
    keep, budget_ms = options.keep, options.latency_ms
    if isinstance(keep, str):
        if keep.strip().lower() != AUTO:
            raise InputError(f"--keep must be an integer >= 1 or auto, got {keep!r}")
        if budget_ms is None:
            raise InputError("--keep auto needs --latency-ms (the latency budget, ms per call on the target)")
    elif budget_ms is not None:
        raise InputError(f"--latency-ms is the budget of --keep auto; with --keep {keep} it would do nothing "
                         "(use --keep auto, or drop --latency-ms)")
    else:
        return False
    if (isinstance(budget_ms, bool) or not isinstance(budget_ms, (int, float)) or not math.isfinite(budget_ms)
            or budget_ms <= 0):
        raise InputError(f"--latency-ms must be a positive number of milliseconds, got {budget_ms!r}")
    if not options.prune:
        raise InputError("--no-prune compiles the dense tower: --keep auto does not apply to it")
    target = TARGETS.get(options.target)  # the target declares why its candidates cannot be timed here
    why = target.no_timing_why if target is not None else ""
    if why:
        raise InputError(f"--keep auto cannot time candidates for target {options.target} here: {why}")
    return True


def prune_config(options: CompileOptions) -> PruneConfig | None:
    """The method the options name, with its parameters parsed at options.keep (None: --no-prune), before it meets
    a source (stages.fit_config fits it to one)."""
    if not options.prune:
        if options.method_options:
            raise InputError("--no-prune takes no method options")
        return None
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
    return PruneConfig(schedule.wrap(budget.wrap(method, params), params), params, layer)


def options_of(manifest: Manifest, **overrides) -> CompileOptions:
    """The options a bundle was compiled with (its Manifest), overrides applied. Bundles made before family_options
    hold the family options (--image-size, --grid, --crop-budget) as fields of their own: they become family_options."""
    saved = {**manifest.compile_options, **overrides}
    former = {k: saved.pop(k) for k in ("image_size", "grid", "crop_budget") if k in saved}
    saved["family_options"] = {**{k: v for k, v in former.items() if v is not None}, **saved.get("family_options", {})}
    return CompileOptions(**saved)


def _check_fixed(options: CompileOptions) -> None:
    """Every option K does not change."""
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
    llm_export.check_llm_options(options)


def _at_keep(options: CompileOptions, target: Target) -> Plan:
    """What depends on K: the method's parameters, and the target's check of the method at them."""
    return Plan(options, target, prune_config(options), target.check_options(options))
