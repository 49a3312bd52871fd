"""The method interface: what every pruning method gives the compiler, in one place.

A method is one module holding one `Method` subclass. It says what it needs from the
model (a [CLS] token, block L's own Q and K, the pixels, the projector output), refuses
what it cannot serve in one line, computes its plain-torch reference (the parity
reference), emits itself into the graph in standard ONNX ops, and optionally brings
the fusion rules that replace part of that emission by a custom op where one pays.
The insertion pass, the targets and parity read what a method declares here and what
the insertion pass records in the IR (passes.prune.prune_record), not its name; only the
registry's default (DEFAULT_METHOD) names one.

Where the official code of a method is batch-1 only or leaves a case undefined, the
method's docstring lists the choice made; two rules hold for all of them: ties go to
the lower index, and kept patch tokens come back in ascending (raster) order.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import (CLS_TOKEN, PATCH_TOKENS, PROBE_KEEP, SITE_BLOCK as BLOCK, SITE_FEATURES,
                                         Capability, PruneRecord, SiteTensors)
from vlmprune.compiler.errors import InputError
# The generic options every method takes (Method.parse, check, __init_subclass__): modules below this one, which
# import nothing of it (imports run one way: tests/test_layers.py); the option value checks and the selection kinds
# they share live below it too, and are re-exported here.
import vlmprune.passes.methods.budget_options as budget_options
import vlmprune.passes.methods.coverage as coverage
import vlmprune.passes.methods.merge as merge
import vlmprune.passes.methods.relevance as relevance
import vlmprune.passes.methods.roi as roi
import vlmprune.passes.methods.schedule_steps as schedule_steps
from vlmprune.passes.methods.options import finite_option, positive_int
from vlmprune.passes.methods.selection import BY_SCORE, GREEDY

__all__ = ["BLOCK", "BY_SCORE", "CROPS_EACH", "CROPS_SCORED", "FEATURES", "GREEDY", "Formulation", "FusedOp",
           "GraphInputs", "Method", "Needs", "PromptSiteTensors", "SiteSpec", "SiteTensors", "TorchResult", "finite_option",
           "positive_int"]

# Sites: BLOCK, after block L on the residual stream ([CLS] at index 0 when the tower has one);
# FEATURES, on the tower's output after the projector (the tokens the LLM sees).
# BY_SCORE, GREEDY (passes.methods.selection): how parity compares a method's kept indices.
# How a method serves anyres crops pruned under one global budget (Method.crop_form, passes.methods.crops).
CROPS_SCORED, CROPS_EACH = "scored", "each"


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a method reads from the model."""

    site: str  # BLOCK or FEATURES
    cls: bool = False  # a [CLS] token at index 0 of the site's tokens
    # block L's own Q and K (after its projections); at a FEATURES site, the last block's the graph runs (the
    # feature layer's), and with cls=True its [CLS] row, whether or not the features keep the [CLS] token
    attention: bool = False
    pixels: bool = False  # the normalised pixels (a per-patch pixel term)
    head: bool = False  # the tower's attention-pooling head (SigLIP's), for the probe score
    # The tower features at the feature layer (the last block's output) beside a FEATURES site's projector output.
    tower_features: bool = False
    text: bool = False  # the prompt: the bundle input `text_embeds` [B, T, D_llm] (compiler.prompt)

    def describe(self) -> str:
        parts = ["block L's hidden states" if self.site == BLOCK else "the projector output (the tower's end)"]
        if self.attention:
            parts.append("block L's Q and K" if self.site == BLOCK else "the feature layer's Q and K")
        if self.cls:
            parts.append("a [CLS] token")
        if self.pixels:
            parts.append("the pixels")
        if self.head:
            parts.append("an attention-pooling head (SigLIP's)")
        if self.tower_features:
            parts.append("the feature layer's hidden states")
        if self.text:
            parts.append("the prompt (text_embeds)")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What the insertion point offers: the same fields whether read from a graph or a torch model."""

    num_patches: int  # N: patch tokens at the site
    has_cls: bool  # a [CLS] token precedes them
    layer: int | None = None  # 1-based block after which the site is (BLOCK sites)
    num_blocks: int | None = None  # blocks the tower runs
    has_pixels: bool = True  # the pixel input and patch grid are known
    prefix: int | None = None  # leading non-patch tokens ([CLS], registers); None: 1 with [CLS], else 0
    head: bool = False  # the tower's attention-pooling head is available (SigLIP's; torch sources only)
    merge: int | None = None  # patches merged per side into a site token (Qwen: 2; 1: none; None: unknown, a graph)
    tower_cls: bool | None = None  # a [CLS] token leads the tower's blocks, kept at the site or not; None: has_cls
    frames: int = 1  # a video's frames at the site: N = frames x tokens per frame, frame by frame (compiler.contract)

    def __post_init__(self):
        if self.prefix is None:
            object.__setattr__(self, "prefix", int(self.has_cls))


@dataclasses.dataclass
class TorchResult:
    """The reference's answer: the site's new tokens, the patch index of each kept token, and a trace for parity.

    trace for BY_SCORE methods: {"scores": [B, N], "boundary": K'} (the scores the TopK ran
    on, and where its cut is); for GREEDY methods: {"steps": [(picked [B, n], margin [B]), ...]}
    in pick order, margin being how far the step's last pick is ahead of the best candidate
    left out, relative to the largest candidate value of the step (selection.relative_margin).
    """

    tokens: torch.Tensor
    kept: torch.Tensor  # [B, K'] int64
    trace: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GraphInputs:
    """What the emission gets at the site: graph values, and the block and tower structure where known."""

    hidden: ir.Value  # [B, prefix + N, D]
    has_cls: bool
    num_patches: int
    block: Any = None  # passes.graph.structure.AttentionBlock (BLOCK sites)
    structure: Any = None  # passes.graph.structure.TowerStructure
    prefix: int | None = None  # leading non-patch tokens ([CLS], registers); None: 1 with [CLS], else 0
    head: Any = None  # compiler.frontend.tower.PoolingHead, where the tower has one (its weights become initializers)
    features: ir.Value | None = None  # Needs.tower_features: the last block's output [B, prefix' + N, Dv]
    text: ir.Value | None = None  # Needs.text: the graph input text_embeds [B, T, D]
    forced: ir.Value | None = None  # --roi: F [B, N] float, 1 where a patch is forced (passes.methods.roi)
    frames: int = 1  # a video's frames: the N patches are frames x tokens per frame, frame by frame

    def __post_init__(self):
        if self.prefix is None:
            self.prefix = int(self.has_cls)


@dataclasses.dataclass
class PromptSiteTensors(SiteTensors):
    """SiteTensors with what Needs.tower_features, Needs.text and --roi add (the parity reference builds it)."""

    features: torch.Tensor | None = None  # [B, prefix' + N, Dv], the last block's output
    text: torch.Tensor | None = None  # [B, T, D], text_embeds
    forced: torch.Tensor | None = None  # --roi: F [B, N] bool (passes.methods.roi.forced_reference)


class Method(abc.ABC):
    """One pruning method. Subclasses set the class attributes and implement the abstract methods."""

    name: ClassVar[str]
    summary: ClassVar[str]
    prunes: ClassVar[bool] = True  # every method in METHODS prunes; methods.dense.Dense is the one that does not
    # Bump when what the method keeps or outputs changes: `eval --dataset` keys stored answers by it.
    version: ClassVar[int] = 1
    baseline: ClassVar[bool] = False  # a reference point for accuracy tables (random keep, a grid), not to deploy
    # The baseline every other row of an accuracy table is paired with at the same K and place, or after the
    # earliest block for a row spread over blocks (the report's vs_random): random keep's, which declares it; one
    # method at most.
    paired: ClassVar[bool] = False
    selection: ClassVar[str] = BY_SCORE  # BY_SCORE or GREEDY: how parity compares the kept indices
    options: ClassVar[dict[str, tuple[type, str]]] = {}  # option name -> (type, help); the CLI flag is --NAME
    # Graph forms of the selection, in the method's order of preference ([0] is the default); each says what a
    # target asks of it (Formulation.control_flow), so that a target chooses without naming the method.
    formulations: ClassVar[tuple[str, ...]] = ("standard",)
    # Why int8 quantisation of the method's own nodes (its merge, after the selection) loses its output, by
    # measurement; "" where it does not. An int8 mode that quantises those nodes refuses the method with it.
    int8_loss: ClassVar[str] = ""
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}  # option -> its named values (--score), listed per value
    official: ClassVar[str] = ""  # where the official algorithm lives
    # K varies per image (prumerge+, --budget adaptive): emit returns (tokens, kept, num_tokens [B] int64), the
    # tokens padded to K_max = --keep with zero rows and kept with -1; the reference's trace holds "num_tokens".
    variable_k: ClassVar[bool] = False
    # --merge local (passes.methods.merge) after the selection: declare it where the output is [prefix] + the site's
    # rows at the kept indices (ascending) + at most one summary token; __init_subclass__ applies it.
    local_merge: ClassVar[bool] = False
    no_local_merge_why: ClassVar[str] = ""  # why not, for the refusal, where the method says
    # --prompt-weight W (passes.methods.relevance): the method's reference and emission pass the score they rank
    # through relevance.weighted / emit_weighted; __init_subclass__ adds the prompt to its needs when W > 0.
    prompt_weight: ClassVar[bool] = False
    # --roi (passes.methods.roi): the method adds roi.emit_force_scores / roi.force_scores before its TopK, lifting
    # forced patches by roi_bound(params) + 1; False (the default): --roi is refused.
    roi_keep: ClassVar[bool] = False
    # The method acts inside blocks 1..L (between each block's attention and its MLP, and on later blocks' attention
    # logits), not on block L's output alone: its reference is reference_blocks, and its emission rewrites those
    # blocks through Builder.after / Builder.reroute (token merging).
    in_blocks: ClassVar[bool] = False
    # The method runs the blocks after L too, on a token layout of its own (reference_later), and gives the tower's
    # tail the dense layout back, keeping the kept rows of the features (the in-encoder temporal drop of a clip:
    # its frames' kept tokens as one sequence under a per-frame mask); its emission restores it (RESTORED_META).
    later_blocks: ClassVar[bool] = False
    # Why the method's output is lost below float32, by measurement; "" where it is not. A target that runs the
    # graph in fp16 or quantised (Target.reduced_precision) refuses the method with it.
    float32_only: ClassVar[str] = ""
    # Anyres crops under one global budget (passes.methods.crops): CROPS_SCORED, the method has a per-patch score
    # (crop_scores / emit_crop_scores) that splits K by each crop's score mass and ranks the patches within a crop;
    # CROPS_EACH, it runs on each crop's tokens with an equal share of K; "" (the default): crops are refused.
    crop_form: ClassVar[str] = ""

    def roi_bound(self, params: dict) -> float:
        """With roi_keep: an upper bound of the scores the TopK ranks with these parameters."""
        raise NotImplementedError(f"method {self.name} declares no score bound for --roi")

    def __init_subclass__(cls, **kwargs):
        """Apply --merge local after any declaring method's selection, so that no method has code of its own for it:
        the reference, emission and description a subclass defines are wrapped (_merging_*), and with --merge local
        their output becomes passes.methods.merge's over the method's kept indices."""
        super().__init_subclass__(**kwargs)
        for name, wrap in (("reference", _merging_reference), ("emit", _merging_emit),
                           ("describe", _merging_describe)):
            own = cls.__dict__.get(name)
            if own is not None and not getattr(own, "__isabstractmethod__", False):
                setattr(cls, name, wrap(own))
        own = cls.__dict__.get("needs")
        if own is not None and not getattr(own, "__isabstractmethod__", False):
            cls.needs = relevance.with_prompt(own)  # --prompt-weight W > 0: the prompt too (Needs.text)

    # ------------------------------------------------------------------ parameters

    def parse(self, keep: int, options: dict[str, Any]) -> dict[str, Any]:
        """The method's parameters from --keep and its options; unknown or bad values are one line."""
        unknown = sorted(set(options) - set(self.options) - set(GENERIC_OPTIONS))
        if unknown:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in unknown)
            taken = self.taken_options(keep if isinstance(keep, int) and not isinstance(keep, bool) else 64)
            raise InputError(f"{flags} {'is not an option' if len(unknown) == 1 else 'are not options'} of method "
                             f"{self.name}" + (f" (it takes {', '.join('--' + o.replace('_', '-') for o in taken)})"
                                               if taken else " (it takes none)"))
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InputError(f"--keep must be an integer >= 1, got {keep!r}")
        params = {"keep": keep, **self.defaults(keep), **{k: v for k, v in options.items() if v is not None}}
        params = budget_options.parse(self, parse_scorer(self, roi.parse(self, merge.parse(self, params))))
        # --coverage builds on --roi's forced keep; --schedule asks what the others made of the method
        return schedule_steps.parse(self, coverage.parse(self, relevance.parse(self, params)))

    def taken_options(self, keep: int = 64) -> list[str]:
        """Every option this method takes, from the declarations: its own, and the generic ones (GENERIC_OPTIONS) it
        declares (local_merge, prompt_weight, roi_keep, a [CLS]-kernel score, a ranked score for --budget)."""
        params = {"keep": keep, **self.defaults(keep)}
        taken = list(self.options)
        if self.local_merge:
            taken += list(merge.GENERIC)
        if self.prompt_weight:
            taken += list(relevance.GENERIC)
        if self.roi_keep:
            taken += list(roi.GENERIC)
        if not budget_options.refusal(self, params):
            taken += ["budget", *budget_options.OPTIONS]
        if self.scores_by_cls_kernel(params):
            taken.append("scorer")
        return list(dict.fromkeys(taken))

    def defaults(self, keep: int) -> dict[str, Any]:
        """Default values of the method's options for this K."""
        return {}

    @abc.abstractmethod
    def needs(self, params: dict) -> Needs:
        """What the method reads from the model with these parameters."""

    def at_site(self, params: dict, spec: SiteSpec) -> dict:
        """The parameters this method runs with at this site, where an option is relative to it (evs's
        --video-pruning-rate: K from the clip's frames); as given by default. The compile calls it once the source
        is loaded, before anything reads params["keep"]."""
        return params

    def check_onnx_source(self, params: dict) -> None:
        """Refuse, before any work, what an .onnx source cannot serve: its reference reads the graph's own tensors
        (compiler.parity.reference), not a family's torch pipeline. Nothing by default."""

    def check(self, params: dict, spec: SiteSpec) -> None:
        """Refuse, in one line naming what is missing, a site this method cannot serve."""
        needs = self.needs(params)
        # A FEATURES site that reads the feature layer's attention needs the [CLS] row there, not in the features.
        tower_cls = spec.has_cls if spec.tower_cls is None else spec.tower_cls
        if needs.cls and not (spec.has_cls or needs.site == SITE_FEATURES and needs.attention and tower_cls):
            raise InputError(f"method {self.name} needs a [CLS] token, and this tower has none "
                             "(methods for towers without one: `vlmprune methods`)")
        if needs.head and not spec.head:
            raise InputError(f"method {self.name} with --score probe needs an attention-pooling head (SigLIP's), and "
                             "this tower has none (CLIP, vision_use_head=False, a checkpoint without the head's "
                             "weights, or an .onnx source)")
        if needs.pixels and not spec.has_pixels:
            raise InputError(f"method {self.name} with these options needs the pixel input and patch grid, "
                             "which this graph does not show (no patch-embedding Conv found)")
        merge.check(params, spec)
        roi.check(params, spec)
        coverage.check(params, spec)
        n, keep = spec.num_patches, params["keep"]
        if not 1 <= keep < n:
            raise InputError(f"--keep must satisfy 1 <= keep < {n} (the tower has {n} patch tokens), got {keep}")

    def serves(self) -> tuple[tuple[Capability, str], ...]:
        """What the method needs of a model, for `vlmprune methods`: (capability, the options that use it) pairs,
        any one of which serves (compiler.contract's capabilities; the families say which have them). By default what
        needs() says: a [CLS] token, or patch tokens only."""
        return ((CLS_TOKEN if self.needs(self.parse(PROBE_KEEP, {})).cls else PATCH_TOKENS, ""),)

    def reads_projector_output(self, params: dict) -> bool:
        """Whether the selection reads the projector output (a FEATURES site): then the whole tower decides the
        kept set, so an int8 mode that keeps what feeds the selection in floating point would keep all of it so."""
        return self.needs(params).site == SITE_FEATURES

    def output_tokens(self, params: dict) -> int:
        """Patch-derived tokens in the output (without [CLS]): K, plus a summary token where the method adds one
        (every method under --merge local: the summary of the pruned tokens with no kept neighbour)."""
        return params["keep"] + (1 if params.get("merge") else 0)

    def output_batch(self, params: dict, batch):
        """The output's batch for the site's batch `batch` (an int, or a symbolic dim kept as it is): the same,
        unless the method folds rows together (methods.crops: the crops of one image become one row)."""
        return batch

    def summary_params(self, params: dict, num_patches: int) -> dict:
        """The parameters as the prune record's summary line says them at a site of num_patches tokens: a count the
        method derives from N and K (holov's P) filled in as its number, so that the line names what the graph
        runs; as given by default."""
        return params

    def site_tokens(self, params: dict, spec: SiteSpec) -> int:
        """The tokens the blocks after the site run on, [CLS] and registers included: the prefix and the output's
        patch-derived tokens, unless the method lays them out otherwise (later_blocks)."""
        return spec.prefix + self.output_tokens(params)

    def min_text_rows(self, params: dict) -> int:
        """The fewest text_embeds rows (prompt tokens) the method runs on with these parameters (Needs.text)."""
        return 0

    def comparable_rows(self, params: dict, ref_kept: np.ndarray, cand_kept: np.ndarray) -> np.ndarray:
        """Where parity's two sides kept different sets (a boundary tie): the kept indices both share whose output rows
        do not depend on the difference. All shared ones by default: a copied row is its input row, whatever else
        was kept (merged rows are left out by copied_rows)."""
        return np.intersect1d(ref_kept[ref_kept >= 0], cand_kept[cand_kept >= 0])

    def copied_rows(self, params: dict) -> int:
        """How many leading output patch tokens are copies of input rows (at kept[:, :n]); the rest are merged."""
        return 0 if params.get("merge") else params["keep"]

    @abc.abstractmethod
    def describe(self, params: dict) -> str:
        """One line for the manifest and the CLI."""

    # ------------------------------------------------------------------ semantics

    @abc.abstractmethod
    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        """The method in plain torch, batched, without host synchronisation: the parity reference."""

    def reference_blocks(self, params: dict, blocks: list, inputs: SiteTensors) -> TorchResult:
        """With in_blocks: the method over the tower's blocks 1..L (compiler.frontend.tower.BlockRunner each),
        from the embeddings (inputs.hidden); its TorchResult is that of block L's output."""
        raise NotImplementedError(f"method {self.name} does not act inside the blocks")

    def reference_later(self, params: dict, blocks: list, inputs: SiteTensors) -> TorchResult:
        """With later_blocks: the method at block L's output (inputs.hidden) and over the blocks after it
        (compiler.frontend.tower.BlockRunner each); its TorchResult's tokens are the last block's output in the
        dense layout again (the site's shape), its kept the feature rows the tower's output keeps."""
        raise NotImplementedError(f"method {self.name} does not run the later blocks")

    @abc.abstractmethod
    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        """Append the method's nodes through builder b; return (tokens, kept_indices), or (tokens, kept_indices,
        num_tokens) for a variable_k method."""

    def fusion_rules(self, spellings, record: PruneRecord | None = None) -> list:
        """onnxscript rewrite rules that fuse part of the emission into a custom op (none by default).

        record: what the insertion recorded (passes.prune.prune_record), so that a method can
        decline a site its custom op does not cover; None: any site.
        """
        return []

    def fused_into(self, spellings: dict[str, FusedOp], params: dict) -> list[str]:
        """The ops of `spellings` this method fuses into with these parameters, for `vlmprune methods`: its rules
        asked about the site the parameters read (one [CLS] token where they need one, no prefix otherwise)."""
        needs = self.needs(params)
        record = PruneRecord(self.name, params, needs.site, None, prefix=int(needs.cls))
        return [op for op, spelling in spellings.items() if self.fusion_rules({op: spelling}, record)]

    def crop_scores(self, params: dict, inputs: SiteTensors) -> torch.Tensor:
        """With crop_form CROPS_SCORED: the per-patch score [B, N] of each crop (B crops), the one the method ranks
        by, so that the crops' budget split and their selection rank by the method's own score."""
        raise NotImplementedError(f"method {self.name} declares no per-patch score for anyres crops")

    def emit_crop_scores(self, b, params: dict, inputs: GraphInputs) -> ir.Value:
        """crop_scores in the graph, through builder b: [B, N] float (the same ops the method's own emission ranks)."""
        raise NotImplementedError(f"method {self.name} declares no per-patch score for anyres crops")

    def scores_by_cls_kernel(self, params: dict) -> bool:
        """Whether the selection ranks by the recomputed [CLS] row (attention.cls_attention): the score that
        kernels' ClsAttentionScore computes, and so the one --scorer int8 can run in INT8. False by default."""
        return False

    def required_ops(self, params: dict) -> dict[str, str]:
        """The fused ops these parameters run only in, each with the option that asks for it: a target that does not
        spell one of them refuses the compile before any work (--scorer int8: the INT8 decision exists only as the
        ClsAttentionScore kernel, CLS_SCORE). None by default."""
        return {CLS_SCORE: "--scorer int8"} if int8_scorer(params) else {}

    def check_formulation(self, formulation: str) -> str:
        if formulation not in self.formulations:
            raise InputError(f"method {self.name} has no {formulation!r} formulation "
                             f"(it has {', '.join(self.formulations)})")
        return formulation


def _merges(method: Method, params: dict, name: str, wrapper) -> bool:
    """Whether this call applies --merge local: the method declares it, and this is the outermost call (a subclass
    whose override calls super() runs two wrappers; only the one the class itself holds merges)."""
    return bool(params.get("merge")) and method.local_merge and getattr(type(method), name, None) is wrapper


def _merging_reference(own):
    @functools.wraps(own)
    def reference(self, params, inputs):
        result = own(self, params, inputs)
        return merge.merged_reference(self, params, inputs, result) if _merges(self, params, "reference",
                                                                               reference) else result
    return reference


def _merging_emit(own):
    @functools.wraps(own)
    def emit(self, b, params, inputs, formulation):
        emitted = own(self, b, params, inputs, formulation)
        return merge.merged_emission(b, self, params, inputs, emitted) if _merges(self, params, "emit",
                                                                                  emit) else emitted
    return emit


def _merging_describe(own):
    @functools.wraps(own)
    def describe(self, params):
        text = own(self, params)
        return text + merge.describe(params) if _merges(self, params, "describe", describe) else text
    return describe


SCORERS = ("fp32", "int8")
CLS_SCORE = "ClsAttentionScore"  # the fused op --scorer int8 runs in (kernels' INT8 [CLS]-attention decision)
# Options every method takes, parsed here (the CLI's --merge, --width, --scorer): name -> (type, help).
GENERIC_OPTIONS: dict[str, tuple[type, str]] = {
    **merge.GENERIC,
    **relevance.GENERIC,  # --prompt-weight (passes.methods.relevance)
    **roi.GENERIC,
    **coverage.GENERIC,  # --coverage F (passes.methods.coverage): a uniform grid forced into K
    **schedule_steps.GENERIC,  # --schedule (passes.methods.schedule): progressive pruning in steps across blocks
    # --budget adaptive (passes.methods.budget): K per image from the entropy of the method's score
    "budget": (str, "fixed (default) or adaptive: K per image = clamp(round((α·sigmoid(β·H) + γ)·N), --kmin, "
                    "--keep), H the entropy of the image's normalised score (score-based methods: cls)"),
    "alpha": (float, "--budget adaptive: α (default 1.0)"),
    "beta": (float, "--budget adaptive: β (default 0.5)"),
    "gamma": (float, "--budget adaptive: γ (default -0.6)"),
    "kmin": (int, "--budget adaptive: the smallest K of an image (default 1); the largest is --keep"),
    "scorer": (str, "fp32 (default) or int8: the [CLS]-attention decision in INT8 inside the fused op (the "
                    "ClsAttentionScore kernel: ort; the VlmpClsScore plugin: orin, xavier), the model itself unchanged"),
}


def int8_scorer(params) -> bool:
    """Whether the parameters run the [CLS]-attention decision in INT8 (--scorer int8): the one spelling of the test
    that the methods' emission and fusion, and the targets' parity precision, each make."""
    return params.get("scorer") == "int8"


def parse_scorer(method: Method, params: dict) -> dict:
    """--scorer: fp32 (the default, left out of params) or int8, for a method that ranks by the [CLS] kernel's
    score. Which targets carry it is theirs to say (Target.check_options)."""
    scorer = params.get("scorer")
    if scorer is None:
        return params
    if scorer not in SCORERS:
        raise InputError(f"--scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    if scorer == "fp32":
        del params["scorer"]  # the default: a bundle's params (and cache keys) as without the flag
        return params
    if not method.scores_by_cls_kernel(params):
        raise InputError(f"--scorer int8 runs the [CLS]-attention kernel in INT8, and method {method.name} with "
                         "these options does not rank by that score")
    return params


class Formulation(str):
    """A graph form of a selection: its name (what the manifest records and `emit` receives), and whether it holds
    control flow (an ONNX Loop), which a target that compiles none, or runs it badly, does not take."""

    control_flow: bool

    def __new__(cls, name: str, control_flow: bool = False):
        form = super().__new__(cls, name)
        form.control_flow = control_flow
        return form


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """How a target spells a fused custom op: op_type, domain (imported at `version`), extra constant attributes.

    Each method's fusion rules name the op they produce by its vlmprune name (e.g.
    "TokenPrune"); a target maps the names it can run to its spelling: ONNX Runtime's
    custom-op domain "vlmprune", or TensorRT's plugin convention (op_type = the plugin's
    name, attributes plugin_version / plugin_namespace). A rule whose op the target
    does not spell is not applied there.
    """

    op_type: str
    domain: str = "vlmprune"
    version: int = 1
    attributes: tuple[tuple[str, int | float | str], ...] = ()
