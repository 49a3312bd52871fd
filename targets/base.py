"""The target adapter contract.

A target says which passes legalize a graph for it (one explicit pipeline, the same
shape for every target: insert, retarget, the target's own legalization, the support
check), how the method's fusion rules are spelled for its runtime, which nodes it can
run (supports: the one support check, asked of every node by passes.support), how it
writes its artifacts into a bundle, and how a bundle is run (runner) and checked
(stages). model.decomposed.onnx is, for every target, the graph its pipeline produced:
target-legal, standard ops only. Vendor SDKs are imported inside methods only, so one
missing SDK never breaks the CLI or the other targets.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.contract import PROBE_KEEP, Manifest, PruneRecord, QuantizationNeeds
from vlmprune.compiler.errors import InputError
from vlmprune.passes.fusion import FusionPass
from vlmprune.passes.methods.base import BLOCK, FusedOp, Method
from vlmprune.passes.outputs import BatchDimNamePass, ZeroPaddingPass
from vlmprune.passes.progressive import insertion_pass
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.passes.support import SupportCheckPass, TargetPipeline

# run(pixels, feeds): feeds, the graph's inputs beside the pixels by name (the prompt's rows, the ROI), built by the
# caller that knows them (targets.runtime: a missing prompt is refused, a missing ROI is no region); None: none.
Runner = Callable[[np.ndarray, Mapping[str, np.ndarray] | None], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """What to insert: a method with its parameters, after block `layer` (BLOCK sites; None: the feature layer).

    head: the source's attention-pooling head (compiler.frontend.tower.PoolingHead) or None, set
    once the model is loaded, for methods that score with it (--score probe).
    """

    method: Method
    params: dict
    layer: int | None = None
    head: object = dataclasses.field(default=None, compare=False)


class Preprocessing(Protocol):
    """The frontend's image preprocessing (compiler.frontend.images), as the targets that calibrate call it."""

    def preprocess(self, image: np.ndarray, size: int, mean, std) -> np.ndarray: ...

    def parity_inputs(self, batch: int, size: int, mean, std, seed: int = 0) -> tuple[np.ndarray, dict]: ...

    def read_rgb(self, path: str) -> tuple[np.ndarray, str]: ...


@dataclasses.dataclass(frozen=True)
class EmitContext:
    """What Target.emit is handed beside the graph: the compile's choices and what the quantizing targets calibrate on.

    A type rather than a dict so that a target reads a field it can name (a typo fails at once, not on the one
    target whose precision reaches the key), and so that a target reads no model: of the source it gets the
    geometry and normalisation calibration images need, and the frontend's preprocessing as an object the
    pipeline hands down (images), not a module the target would import against the data flow. The pipeline hands
    the same to a target's parity stages (Target.stages), compile's and `vlmprune check`'s.
    """

    config: PruneConfig | None  # the method inserted (None: a dense bundle)
    options: Any  # the compile's options (compiler.pipeline.CompileOptions, which sits below the targets)
    target_options: dict  # this target's options as its check_options resolved them
    image_size: int  # the tower's input: [B, 3, image_size, image_size]
    mean: tuple  # the source's normalisation, per channel
    std: tuple
    images: Preprocessing
    parity_inputs: np.ndarray  # the images parity will feed (a target that simulates runs them while it builds)
    # The ROI a calibration sample carries beside its pixels, for the ROI inputs among a graph's inputs (name and
    # shape): parity's fixed-seed one (compiler.frontend.roi_input.parity_roi_feed), handed down like images;
    # None: none, i.e. no region.
    calibration_roi: Callable[[np.ndarray, list], dict[str, np.ndarray]] | None = None
    # What the family's graph needs of a quantizing target beyond its default recipe (the family's declaration)
    quantization: QuantizationNeeds = QuantizationNeeds()

    def calibration_inputs(self, count: int, size: int | None = None) -> tuple[np.ndarray, list[str]]:
        """count preprocessed calibration images, disjoint from the parity images (targets.calibration)."""
        from vlmprune.targets.calibration import calibration_inputs

        return calibration_inputs(count, size or self.image_size, self.mean, self.std, self.images)

    def calibration_feed(self, inputs, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        """One calibration sample's arrays of a graph's inputs after the pixels (inputs: theirs, name and shape): the
        ROI of calibration_roi, checked as a runner's feeds are (targets.runtime.optional_feed)."""
        from vlmprune.targets.runtime import optional_feed

        inputs = list(inputs)
        given = self.calibration_roi(pixel_values, inputs) if self.calibration_roi is not None else {}
        return optional_feed(inputs, pixel_values, given)


def reads_projector_output(options) -> bool:
    """Whether the method compiled by options selects on the projector output (Method.reads_projector_output):
    the int8 modes that keep what feeds the selection in floating point refuse it."""
    from vlmprune.passes.methods import get_method

    method = get_method(options.method)
    return options.prune and method.reads_projector_output(method.parse(options.keep, options.method_options or {}))


@dataclasses.dataclass
class StageSpec:
    """One parity stage a target contributes: how to run a bundle file, at what precision."""

    stage: str
    runtime: str
    precision: str
    run: Runner


class Target(abc.ABC):
    name: str
    summary: str
    # The fused ops this target runs, by vlmprune name ("TokenPrune", ...), spelled for its runtime.
    spellings: ClassVar[dict[str, FusedOp]] = {}
    # Whether a selection written with control flow (an ONNX Loop) is chosen here; False takes each method's first
    # formulation without it (Formulation.control_flow; each target says why, by measurement).
    control_flow: ClassVar[bool] = True
    # Why this target takes no prompt input (text_embeds [B, T, D], T varying per request), or "" where it does:
    # Target.refusal refuses a prompt-aware method (Needs.text) with it.
    no_prompt_input: ClassVar[str] = ""
    # Why this target takes no ROI input (--roi: roi_mask, or roi_boxes + roi_count; static shapes), or "" where it
    # does: Target.refusal refuses --roi with it.
    no_roi_input: ClassVar[str] = ""
    # Why the graph runs below float32 here (fp16 or quantised), "" where it runs float32: a method that declares
    # float32_only is refused with both reasons.
    reduced_precision: ClassVar[str] = ""
    options: ClassVar[dict[str, str]] = {}  # target options (--precision, --soc) -> help
    # What `run --benchmark` times where this target's runner here is an emulator, not the device (its time is
    # no latency the device will show): named so wherever the figures are printed; "" where it is the runtime.
    emulated_time: ClassVar[str] = ""
    # Why `--keep auto` cannot time this target's candidates here (compiler.pipeline.auto_keep); "" where its
    # runner times them on this machine.
    no_timing_why: ClassVar[str] = ""
    # --with-llm: the LLM exporter ids (compiler.llm.export.EXPORTERS) this target takes, the first its default;
    # named as strings, since targets sit below the LLM side. None taken: why, in the refusal's words.
    # The --opset values this target compiles (inclusive; the exporter writes 17..23), and why not the others: the
    # pipeline refuses the rest before any work (Target.opset_refusal).
    opsets: ClassVar[tuple[int, int]] = (17, 23)
    opsets_why: ClassVar[str] = ""
    llm_exporters: ClassVar[tuple[str, ...]] = ()
    no_llm_why: ClassVar[str] = "no LLM toolchain"

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """Whether this machine can emit and check this target, and why not. Installs nothing."""

    @abc.abstractmethod
    def toolchain(self) -> dict[str, str]:
        """Versions recorded in the manifest (the device toolchain and the host tools used)."""

    def opset_refusal(self, opset: int) -> str:
        """One line if this target does not compile an export at opset, else ""."""
        low, high = self.opsets
        if low <= opset <= high:
            return ""
        return (f"--opset {opset}: target {self.name} compiles opsets {low} to {high}"
                + (f" ({self.opsets_why})" if self.opsets_why else ""))

    def check_options(self, options) -> dict:
        """Parse and check the target options before any work; one line for a bad or foreign one.

        Returns the parsed options (stored in the manifest). The default takes none.
        """
        if options.prune:
            from vlmprune.passes.methods import get_method

            method = get_method(options.method)
            params = method.parse(options.keep, options.method_options or {})
            refused = self.refusal(method, params)
            if refused:
                raise InputError(f"target {self.name} cannot run method {options.method}: {refused}")
            for op, option in method.required_ops(params).items():  # what the method's options run only in
                if op not in self.spellings:
                    raise InputError(f"{option} runs in the fused {op} op, which target {self.name} does not carry "
                                     "(it runs on ort, orin and xavier)")
        given = {k: v for k, v in (options.target_options or {}).items() if v is not None}
        foreign = sorted(set(given) - set(self.options))
        if foreign:
            flag = f"--{foreign[0]}"
            takes = f" (it takes {', '.join('--' + o for o in self.options)})" if self.options else ""
            raise InputError(f"target {self.name} has no {flag}{takes}")
        return given

    # ------------------------------------------------------------------ passes

    def formulation(self, method: Method) -> str:
        """The graph form of method's selection here: its first formulation this target takes."""
        taken = [f for f in method.formulations if self.control_flow or not getattr(f, "control_flow", False)]
        if not taken:
            raise InputError(f"target {self.name} takes no formulation of method {method.name}: each holds control "
                             "flow (an ONNX Loop)")
        return taken[0]

    def refusal(self, method: Method, params: dict | None = None) -> str | None:
        """Why this target cannot run method (with params; None: its defaults), from what the method declares, or
        None."""
        if self.no_prompt_input and method.needs(params if params is not None else method.parse(PROBE_KEEP, {})).text:
            return f"it reads the prompt (the text_embeds input), and {self.no_prompt_input}"
        if self.reduced_precision and method.float32_only:
            return f"{method.float32_only}, and {self.reduced_precision}"
        if self.no_roi_input and (params or {}).get("roi"):
            return f"--roi adds the ROI inputs beside the pixels, and {self.no_roi_input}"
        return None

    def legalization(self, config: PruneConfig | None, options) -> list[ir.passes.PassBase]:
        """This target's own passes, after insertion (the default has none)."""
        return []

    def pipeline(self, config: PruneConfig | None, options) -> TargetPipeline:
        """Dense export -> this target's decomposed graph (model.decomposed.onnx), in order."""
        passes: list[ir.passes.PassBase] = []
        if config is not None:
            # one site, or a --schedule's steps (passes.progressive)
            passes.append(insertion_pass(config.method, config.params, config.layer,
                                         self.formulation(config.method), config.head))
            if config.method.needs(config.params).site == BLOCK:
                passes.append(RetargetTokenCountPass())
            if config.method.variable_k:  # padded rows zero on the token output, num_tokens counting its rows
                passes.append(ZeroPaddingPass())
        passes += [*self.legalization(config, options), RemoveUnusedNodesPass(), TopologicalSortPass(),
                   BatchDimNamePass(), SupportCheckPass(self.name, self.supports, self.check_model)]
        return TargetPipeline(self.name, *passes)

    def fusion(self, config: PruneConfig | None, options, record: PruneRecord | None = None) -> TargetPipeline | None:
        """Decomposed graph -> model.onnx with the method's fused ops, or None where no rule applies here.

        record: what the insertion recorded in the decomposed graph (its site), for methods
        whose custom op covers some sites only.
        """
        rules = config.method.fusion_rules(self.spellings, record) if config is not None else []
        own, own_domains = self.own_fusion_rules(config, options)
        if not rules and not own:
            return None
        domains = {**{s.domain: s.version for s in self.spellings.values()}, **own_domains}
        return TargetPipeline(self.name, FusionPass(rules, domains, debug=getattr(options, "debug", False),
                                                    optional=own),
                              RemoveUnusedNodesPass(), TopologicalSortPass(),
                              SupportCheckPass(self.name, self.supports, self.check_model))

    def own_fusion_rules(self, config: PruneConfig | None, options) -> tuple[list, dict[str, int]]:
        """Rules this target adds to every fusion, dense bundles and methods without fused ops included, with
        the op domains they write: (rules, {domain: version}). They need not fire (the method's must). None
        by default."""
        return [], {}

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        """Whether this target's runtime runs node: standard ONNX, and the custom ops it spells."""
        if node.domain in ("", "ai.onnx"):
            return True, ""
        if any(s.domain == node.domain and s.op_type == node.op_type for s in self.spellings.values()):
            return True, ""
        return False, f"custom op of domain {node.domain!r} that {self.name} does not run"

    def check_model(self, model: ir.Model) -> list[str]:
        """Model-level reasons this target cannot run the graph (opset, shapes); none by default."""
        return []

    # ------------------------------------------------------------------ artifacts

    @abc.abstractmethod
    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """Write model.onnx (model: the fused graph, or the decomposed one) and the extras; return manifest fields."""

    @abc.abstractmethod
    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        """Parity stages over the bundle's own files (after the shared export/rewritten stages). context: what the
        pipeline hands the target of the source (compile's emit context, or check's), for a stage that builds again
        (rk3588's calibration images); None where the caller has none."""

    @abc.abstractmethod
    def runner(self, bundle_dir: Path, manifest: Manifest) -> tuple[Runner, str]:
        """How `vlmprune run` runs the bundle here: (runner, a line saying on what); one line if it cannot. The
        runner takes the inputs beside the pixels as explicit feeds (Runner)."""

    @abc.abstractmethod
    def readme(self, manifest: Manifest) -> str:
        """The bundle README: exact commands to build and run it on the device."""

    # ------------------------------------------------------------------ command line

    # What a target adds to `vlmprune` (as Polygraphy's tools register themselves): the CLI asks every target in
    # TARGETS and names none, so a target's own commands and listings live in its own module.

    def listing(self) -> list[str]:
        """Lines of `vlmprune targets` after the table (e.g. the values of a target option); none by default."""
        return []

    def commands(self) -> list:
        """click commands this target adds to `vlmprune` (e.g. building its device artifact); none by default.

        Each declares its name, options and help; its callback takes the parameters and `log` (a callable for the
        lines it says as it works) and returns the lines it ends with. The API runs it (api.target_command), and
        the CLI through the API. Targets sharing a module share its commands (by name).
        """
        return []

    def require_engine(self, bundle_dir: Path) -> str:
        """For `check --engine`: one line unless this bundle's engine stage can run here; returns that stage's name.

        The default: "", this target builds no engine on the device; the registry's require_engine refuses it,
        naming the targets that do (a target cannot name them: the registry is above the targets).
        """
        return ""
