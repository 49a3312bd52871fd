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
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.llava_next import packed_length, parse_grid
from vlmprune.passes.fusion import FusionPass
from vlmprune.passes.methods.base import BLOCK, FusedOp, Method
from vlmprune.passes.outputs import BatchDimNamePass
from vlmprune.passes.prune import InsertPruningPass
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.passes.support import SupportCheckPass, TargetPipeline

Runner = Callable[[np.ndarray], dict[str, np.ndarray]]


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


def reads_projector_output(options) -> bool:
    """Whether the method compiled by options selects on the projector output (a FEATURES site).

    Quantizing a graph around such a selection would have to leave everything before it in
    floating point to keep the kept set: the int8 modes refuse these methods.
    """
    from vlmprune.passes.methods import get_method
    from vlmprune.passes.methods.base import FEATURES

    method = get_method(options.method)
    return options.prune and method.needs(method.parse(options.keep, options.method_options or {})).site == FEATURES


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
    # Per method, the graph form of its selection on this target (chosen by measurement; see each target).
    formulations: ClassVar[dict[str, str]] = {}
    options: ClassVar[dict[str, str]] = {}  # target options (--precision, --soc) -> help

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """Whether this machine can emit and check this target, and why not. Installs nothing."""

    @abc.abstractmethod
    def toolchain(self) -> dict[str, str]:
        """Versions recorded in the manifest (the device toolchain and the host tools used)."""

    def check_options(self, options) -> dict:
        """Parse and check the target options before any work; one line for a bad or foreign one.

        Returns the parsed options (stored in the manifest). The default takes none.
        """
        if options.prune:
            from vlmprune.passes.methods import get_method

            refused = self.refusal(get_method(options.method))
            if refused:
                raise InputError(f"target {self.name} cannot run method {options.method}: {refused}")
        given = {k: v for k, v in (options.target_options or {}).items() if v is not None}
        foreign = sorted(set(given) - set(self.options))
        if foreign:
            flag = f"--{foreign[0]}"
            takes = f" (it takes {', '.join('--' + o for o in self.options)})" if self.options else ""
            raise InputError(f"target {self.name} has no {flag}{takes}")
        return given

    # ------------------------------------------------------------------ passes

    # Methods this target cannot run, with the reason (measured, and named in one line).
    refusals: ClassVar[dict[str, str]] = {}

    def formulation(self, method: Method) -> str:
        return self.formulations.get(method.name, method.formulations[0])

    def refusal(self, method: Method) -> str | None:
        """Why this target cannot run method, or None."""
        return self.refusals.get(method.name)

    def legalization(self, config: PruneConfig | None, options) -> list[ir.passes.PassBase]:
        """This target's own passes, after insertion (the default has none)."""
        return []

    def pipeline(self, config: PruneConfig | None, options) -> TargetPipeline:
        """Dense export -> this target's decomposed graph (model.decomposed.onnx), in order."""
        passes: list[ir.passes.PassBase] = []
        if config is not None:
            passes.append(InsertPruningPass(config.method, config.params, config.layer,
                                            self.formulation(config.method), config.head))
            if config.method.needs(config.params).site == BLOCK:
                passes.append(RetargetTokenCountPass())
        passes += [*self.legalization(config, options), RemoveUnusedNodesPass(), TopologicalSortPass(),
                   BatchDimNamePass(), SupportCheckPass(self.name, self.supports, self.check_model)]
        return TargetPipeline(self.name, *passes)

    def fusion(self, config: PruneConfig | None, options, record: dict | None = None) -> TargetPipeline | None:
        """Decomposed graph -> model.onnx with the method's fused ops, or None where no rule applies here.

        record: what the insertion recorded in the decomposed graph (its site), for methods
        whose custom op covers some sites only.
        """
        rules = config.method.fusion_rules(self.spellings, record) if config is not None else []
        if not rules:
            return None
        domains = {s.domain: s.version for s in self.spellings.values()}
        return TargetPipeline(self.name, FusionPass(rules, domains, debug=getattr(options, "debug", False)),
                              RemoveUnusedNodesPass(), TopologicalSortPass(),
                              SupportCheckPass(self.name, self.supports, self.check_model))

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
    def emit(self, model: ir.Model, out_dir: Path, context: dict) -> dict:
        """Write model.onnx (model: the fused graph, or the decomposed one) and the extras; return manifest fields."""

    @abc.abstractmethod
    def stages(self, bundle_dir: Path, manifest: dict) -> list[StageSpec]:
        """Parity stages over the bundle's own files (after the shared export/rewritten stages)."""

    @abc.abstractmethod
    def runner(self, bundle_dir: Path, manifest: dict) -> tuple[Runner, str]:
        """How `vlmprune run` runs the bundle here: (runner, a line saying on what); one line if it cannot."""

    @abc.abstractmethod
    def readme(self, manifest: dict) -> str:
        """The bundle README: exact commands to build and run it on the device."""


def anyres_readme(manifest: dict) -> str:
    """The bundle README's section on assembling an anyres model's LLM input (LLaVA-NeXT crops); "" otherwise.

    Why in the README: which grid rows still hold tokens is known only at run time, so the
    pruned graph outputs the kept tokens and their (crop, row, col), and the runtime packs them.
    """
    model = manifest["model"]
    if not model.get("grid") or not model.get("crops"):
        return ""
    rows, cols = parse_grid(model["grid"])
    count, size, patch = model["crops"], model["image_size"], model["patch_size"]
    s = size // patch
    height, width = model.get("resolution", [rows * size, cols * size])
    method = manifest["method"]
    dense = packed_length((rows, cols), s)
    head = f"""
## Assembling the LLM input (LLaVA-NeXT anyres crops)

For this anyres bundle, this section supersedes the token counts and positions of any generic hand-off above
(those count one crop). Input `pixel_values` [{count}, 3, {size}, {size}]: what LlavaNextImageProcessor gives for an image of this
bundle's grid, {rows}x{cols} tiles at {height}x{width} (`vlmprune compile --grid`): crop 0 is the whole image
resized to {size}x{size}, crops 1..{count - 1} the tiles in raster order. Another image size is resized to fit
{height}x{width} keeping its aspect and padded (as the processor does), then cut the same way. One call is one image.
"""
    if method["name"] == "none":
        return head + f"""
`image_features` [1, {dense}, D] is the LLM's image sequence as transformers builds it (`get_image_features`,
i.e. `pack_image_features`): the {s * s} base tokens, then the {rows * s} grid rows of {cols * s} tokens, each
followed by `image_newline`. For an image whose aspect differs from the grid's, drop the padded rows or columns
first (unpad_image, rule 2 below), with their newlines.
"""
    keep = method["keep"]
    summary = method["tokens_out"] - method["prefix"] - keep
    return head + f"""
`image_features` [1, {keep + summary}, D]: the K = {keep} kept tokens in crop-then-raster order
{"then one summary token (the mean of every pruned token)" if summary else "(no summary token)"};
`kept_positions` [1, {keep}, 3]: (crop c, row r, col x) of each, r and x within the crop's {s}x{s} patch grid
(`kept_indices` = c * {s * s} + r * {s} + x). The dense model's sequence is [{dense}, D]; the pruned one is
assembled with the same layout rule, keeping only the kept tokens:

1. Base: the kept tokens of crop 0, in the order given.
2. Grid: a kept token of crop c >= 1 sits at grid row Y = ((c - 1) // {cols}) * {s} + r and column
   X = ((c - 1) % {cols}) * {s} + x of the {rows * s} x {cols * s} token grid. Unpadding (an image of original size
   h x w whose aspect differs from the grid's; transformers' unpad_image): if w / h > {cols * s} / {rows * s}, drop rows
   Y < p and Y >= {rows * s} - p with p = ({rows * s} - int(round(h * {cols * s} / w, 7))) // 2; otherwise drop columns
   X < p and X >= {cols * s} - p with p = ({cols * s} - int(round(w * {rows * s} / h, 7))) // 2 (Python's int(round(., 7)),
   as transformers computes it). An image of {height}x{width} drops nothing.
3. Order the remaining grid tokens by (Y, X); after the last token of every grid row Y that holds at least one kept
   token, insert `image_newline` (the checkpoint's LlavaNextModel.image_newline vector, [D]); a row with no kept
   token gets no newline.
4. The LLM input is: base tokens, grid tokens with their newlines{", then the summary token" if summary else ""}.
   Its length is {keep + summary} + (grid rows holding a kept token): set the prompt's image placeholder count
   from it, per image.
5. Positions (a runtime that takes them; others renumber): each assembled row keeps its place in the dense
   packed sequence of an image of {height}x{width}: base token (r, x) at offset + r * {s} + x, grid token (Y, X) at
   offset + {s * s} + Y * {cols * s + 1} + X, row Y's newline at offset + {s * s} + Y * {cols * s + 1} + {cols * s};
   {f"the summary token at offset + {dense}; " if summary else ""}the text after the image from offset + {dense + summary}
   (the manifest's `llm.positions`; `vlmprune generate` feeds exactly these).

The budget K is split over the crops by `{method["params"]["crops"]["budget"]}` (manifest `method.params.crops`);
padded tokens, when there are any, count in K and are dropped by rule 2.
"""
