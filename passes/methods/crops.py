"""Anyres crops under one global budget: the C crops of one image (LLaVA-NeXT) pruned as one.

An anyres model runs its tower on C crops of one image (the base image, then the grid's
tiles), as a batch. `CropBudget` wraps a method so that K is a budget for the whole image:

1. Split K into per-crop budgets k_c (sum exactly K, each 0 <= k_c <= N):
   - `proportional` (default for methods with a score, Method.crop_form CROPS_SCORED: cls):
     k_c proportional to the crop's saliency mass, the sum of the method's own per-patch score
     over the crop (Method.crop_scores; cls: the normalised [CLS] attention, + λ · variance);
     a crop whose share exceeds N keeps all N and the rest is split again over the others (at
     most C rounds); the shares are rounded by largest remainder, ties to the lower crop index;
   - `equal` (the only split for methods run per crop, CROPS_EACH: divprune, dart): the same rule
     with equal masses (K = 192 over 5 crops: 39, 39, 38, 38, 38).
2. Prune each crop by the method with its k_c: cls keeps the k_c best-scored patches of
   the crop (rank within the crop < k_c: a mask with exactly K ones); divprune and dart run
   on each crop's tokens with k_c (equal budgets are constants, so each crop's selection is
   the method's own emission).
3. Output, per image: [CLS of the base crop, when the site has one] + the K kept tokens in
   crop-then-raster order (+ cls's one summary token: the mean of all C·N − K pruned
   tokens); `kept_indices` [1, K]: c·N + i for patch i of crop c, ascending (the family's
   position table turns them into `kept_positions` (crop, row, col), passes.positions).

Choices: pruning happens at the tower's end only (the last block the tower runs, or the
projector output): a block after it would attend across crops once their tokens are one
sequence. visionzip is not served (its contextual merge splits K into dominant and
contextual parts per image; a per-crop form is not defined by the paper). The split runs in
float32 in both the graph and the reference, op for op, so that both round alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import CROP_BUDGETS as BUDGETS, CROP_EQUAL as EQUAL, SCORE_EPS
from vlmprune.compiler.contract import CROP_PROPORTIONAL as PROPORTIONAL
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods import merge
from vlmprune.passes.methods.base import (BLOCK, CROPS_EACH, CROPS_SCORED, GraphInputs, Method, Needs, SiteSpec,
                                          SiteTensors, TorchResult, int8_scorer)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS, Builder
from vlmprune.passes.methods.selection import gather_rows



def crop_params(params: dict, crops: dict, budget: str, noun: str | None = None, order: str | None = None) -> dict:
    """The method's parameters with the crops and the split: {"crops": {grid, count, side, budget}}, and, where the
    family says them, what it calls one crop (noun) and how its crops lie in the batch (order), for describe."""
    words = {key: value for key, value in (("noun", noun), ("order", order)) if value is not None}
    return {**params, "crops": {"grid": list(crops["grid"]), "count": crops["count"], "side": crops["side"],
                                "budget": budget, **words}}


def default_budget(method: Method) -> str:
    return PROPORTIONAL if method.crop_form == CROPS_SCORED else EQUAL


def over_tokens(config, layout: dict | None):
    """The prune config over a family's token layout (Family.token_layout): the method over the crops of one image,
    under one global budget (the layout's, else the method's default); config itself for one image's tokens."""
    if layout is None:
        return config
    budget = layout["budget"] or default_budget(config.method)
    return dataclasses.replace(config, method=CropBudget(config.method),
                               params=crop_params(config.params, layout["crops"], budget, layout.get("noun"),
                                                  layout.get("order")))


def split_budget(mass: torch.Tensor, keep: int, per_crop: int) -> torch.Tensor:
    """Per-crop budgets [B, C] int64 summing to keep: capped proportional shares, largest remainder.

    mass [B, C] float32 (equal masses for the equal split). Mirrored op for op by emit_split.
    """
    mass = mass.float().clamp_min(SCORE_EPS)
    count = mass.shape[-1]
    free = torch.ones_like(mass)
    for _ in range(count + 1):  # the last round only computes the final shares
        rest = keep - per_crop * (count - free.sum(-1, keepdim=True))
        m = mass * free
        quota = rest * m / m.sum(-1, keepdim=True).clamp_min(SCORE_EPS)
        free = free - (quota > per_crop).float()
    floor = quota.floor()
    left = rest - (floor * free).sum(-1, keepdim=True)
    frac = (quota - floor) * free + (free - 1.0)  # saturated crops rank last
    lower = torch.ones(count, count).triu(1).bool()  # [c', c]: c' < c
    beats = (frac.unsqueeze(2) > frac.unsqueeze(1)) | ((frac.unsqueeze(2) == frac.unsqueeze(1)) & lower)
    rank = beats.float().sum(1)
    extra = (rank < left).float() * free
    return ((floor + extra) * free + per_crop * (1.0 - free)).long()


def equal_budgets(keep: int, count: int, per_crop: int) -> list[int]:
    return split_budget(torch.ones(1, count), keep, per_crop)[0].tolist()


def rank_within(scores: torch.Tensor) -> torch.Tensor:
    """[..., N] -> the rank of each entry in a descending stable sort (0 = best; ties to the lower index)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    return ranks.scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order).contiguous())


class CropBudget(Method):
    """`inner` over the crops of each image, under one global budget (see the module docstring)."""

    def __init__(self, inner: Method):
        self.inner = inner
        self.name = inner.name
        self.summary = inner.summary
        self.selection = inner.selection
        self.options = inner.options
        self.formulations = inner.formulations
        self.official = inner.official
        self.crop_form = inner.crop_form

    # ------------------------------------------------------------------ parameters

    def parse(self, keep, options):
        return self.inner.parse(keep, options)

    def defaults(self, keep):
        return self.inner.defaults(keep)

    def needs(self, params: dict) -> Needs:
        return self.inner.needs(params)

    @staticmethod
    def _spec(params: dict) -> tuple[int, int, int, str]:
        crops = params["crops"]
        return crops["count"], crops["side"] ** 2, crops["side"], crops["budget"]

    def _inner_params(self, params: dict, keep: int) -> dict:
        return {**{k: v for k, v in params.items() if k != "crops"}, "keep": keep}

    def check(self, params: dict, spec: SiteSpec) -> None:
        count, n, _, budget = self._spec(params)
        name, keep = self.name, params["keep"]
        if self.inner.baseline:
            raise InputError(f"method {name} is a baseline of one fixed patch set per image; anyres crops have no "
                             f"defined form of it (use {_served()})")
        if self.crop_form not in (CROPS_SCORED, CROPS_EACH):
            raise InputError(f"method {name} is not available for anyres crops: it has no form of one budget "
                             f"split over the crops (use {_served()})")
        if params.get("merge"):
            merge.refuse_crops()
        if int8_scorer(params):  # the global selection over crops is not the fused kernel's form
            raise InputError("--scorer int8 is not available for anyres crops (their global budget is scored in "
                             "standard ops)")
        if params.get("score", "cls") != "cls":
            raise InputError(f"--score {params['score']} is not available for anyres crops "
                             "(their towers score by [CLS])")
        if budget not in BUDGETS:
            raise InputError(f"--crop-budget is proportional or equal, got {budget!r}")
        if budget == PROPORTIONAL and self.crop_form != CROPS_SCORED:
            raise InputError(f"method {name} has no per-patch score to split the budget by saliency; "
                             "use --crop-budget equal")
        if spec.num_patches != n:
            raise InputError(f"the site has {spec.num_patches} patch tokens per crop, the crops {n}")
        if self.needs(params).site == BLOCK and spec.layer is not None and spec.num_blocks is not None \
                and spec.layer != spec.num_blocks:
            raise InputError(f"--layer {spec.layer}: anyres crops are pruned at the tower's end (block "
                             f"{spec.num_blocks}), since a later block would attend across the crops' kept tokens")
        if not 1 <= keep < count * n:
            raise InputError(f"--keep must satisfy 1 <= keep < {count * n} (the {count} crops have {count * n} "
                             f"patch tokens), got {keep}")
        inner_spec = SiteSpec(n, spec.has_cls, spec.layer, spec.num_blocks, spec.has_pixels, spec.prefix)
        if self.crop_form == CROPS_SCORED:  # what the method needs of a crop ([CLS], the pixels), at any crop's budget
            self.inner.check(self._inner_params(params, 1), inner_spec)
        else:
            for k in equal_budgets(keep, count, n):
                if k:
                    self.inner.check(self._inner_params(params, k), inner_spec)

    def output_tokens(self, params: dict) -> int:
        return params["keep"] + (1 if self.crop_form == CROPS_SCORED else 0)

    def copied_rows(self, params: dict) -> int:
        return params["keep"]

    def output_batch(self, params: dict, batch):
        """The graph's batch of crops becomes one row per image."""
        return batch // params["crops"]["count"] if isinstance(batch, int) else batch

    def describe(self, params: dict) -> str:
        """The inner method's line, over the crops as their family names and orders them (its crops_order: the
        base image first, or the thumbnail last); a record without them says the grid alone."""
        count, _, _, budget = self._spec(params)
        crops = params["crops"]
        rows, cols = crops["grid"]
        return (f"{self.inner.describe(self._inner_params(params, params['keep']))}, over {count} "
                f"{crops.get('noun', 'crops')} ({crops.get('order', f'{rows}x{cols} grid')}; {budget} budget)")

    def fusion_rules(self, spellings, record=None) -> list:
        # Per-crop methods are the method's own emission per crop: its fusions apply to each. The scored
        # selection is per-crop ranks, not the TopK the TokenPrune rule matches: standard ops.
        return self.inner.fusion_rules(spellings, record) if self.crop_form == CROPS_EACH else []

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str):
        tokens, kept = (self._emit_scored(b, params, inputs) if self.crop_form == CROPS_SCORED
                        else self._emit_per_crop(b, params, inputs, formulation))
        return tokens, kept

    # ------------------------------------------------------------------ reference

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        if self.crop_form == CROPS_SCORED:
            return self._reference_scored(params, inputs)
        return self._reference_per_crop(params, inputs)

    def scores(self, params: dict, inputs: SiteTensors) -> torch.Tensor:
        """The method's own per-patch score of every crop (Method.crop_scores): [B·C, N]."""
        return self.inner.crop_scores(self._inner_params(params, params["keep"]), inputs)

    def _reference_scored(self, params: dict, inputs: SiteTensors) -> TorchResult:
        count, n, _, budget = self._spec(params)
        keep, prefix = params["keep"], inputs.prefix
        scores = self.scores(params, inputs).float().reshape(-1, count, n)  # [B, C, N]
        batch = scores.shape[0]
        mass = scores.sum(-1) if budget == PROPORTIONAL else torch.ones(batch, count)
        budgets = split_budget(mass, keep, n)  # [B, C]
        mask = (rank_within(scores) < budgets.unsqueeze(-1)).reshape(batch, count * n)
        kept = torch.sort(mask.float(), dim=-1, descending=True, stable=True).indices[:, :keep]
        hidden = inputs.hidden
        patches = hidden[:, prefix:].reshape(batch, count * n, -1)
        weights = (~mask).to(patches.dtype) / (count * n - keep)
        summary = weights.unsqueeze(1) @ patches
        tokens = torch.cat([hidden[::count, :prefix], gather_rows(patches, kept), summary], dim=1)
        return TorchResult(tokens, kept, {"scores": _cut_scores(scores, budgets).reshape(batch, -1),
                                          "boundary": keep, "budgets": budgets})

    def _reference_per_crop(self, params: dict, inputs: SiteTensors) -> TorchResult:
        count, n, _, _ = self._spec(params)
        tokens, kept, steps = [], [], []
        for c, k in enumerate(equal_budgets(params["keep"], count, n)):
            if not k:
                continue
            part = SiteTensors(inputs.hidden[c::count], inputs.has_cls, patch_size=inputs.patch_size,
                               prefix=inputs.prefix,
                               pixel_values=None if inputs.pixel_values is None else inputs.pixel_values[c::count])
            result = self.inner.reference(self._inner_params(params, k), part)
            tokens.append(result.tokens if not kept or not inputs.prefix else result.tokens[:, inputs.prefix:])
            kept.append(result.kept + c * n)
            steps += [(pick + c * n, gap) for pick, gap in result.trace.get("steps", [])]
        return TorchResult(torch.cat(tokens, dim=1), torch.cat(kept, dim=1), {"steps": steps})

    # ------------------------------------------------------------------ graph

    def _emit_scored(self, b, params: dict, inputs: GraphInputs):
        count, n, _, budget = self._spec(params)
        keep, prefix = params["keep"], inputs.prefix
        scores = self.inner.emit_crop_scores(b, self._inner_params(params, keep), inputs)
        with b.role(SCORE):
            per_crop = b.op("Reshape", [scores, b.ints("crops_shape", [-1, count, n])], "crop_scores")  # [B, C, N]
        with b.role(SELECT):
            if budget == PROPORTIONAL:
                mass = b.reduce("ReduceSum", per_crop, [-1], 0, "crop_mass")
                budgets = emit_split(b, mass, keep, count, n)  # [B, C] int64
            else:
                budgets = b.ints("budgets", [equal_budgets(keep, count, n)])  # [1, C]
            _, order = b.op("TopK", [per_crop, b.ints("k_all", [n])], "crop_order", num_outputs=2, axis=-1,
                            largest=1, sorted=1)
            ranks = b.op("ScatterElements", [order, order, b.op("Expand", [b.ints("arange", np.arange(n)),
                                                                            b.op("Shape", [order], "order_shape")],
                                                                 "arange_b")], "crop_ranks", axis=-1)
            mask = b.op("Less", [ranks, b.unsqueeze(budgets, [-1], "budgets_col")], "kept_mask")
            maskf = b.op("Reshape", [b.op("Cast", [mask], "kept_maskf", to=ir.DataType.FLOAT),
                                     b.ints("flat_shape", [-1, count * n])], "kept_flat")
            # Kept patches rank first, lower flat indices first: key = mask · C·N − index (exact below 2^24).
            key = b.op("Sub", [b.op("Mul", [maskf, b.scalar("cn", float(count * n))], "key_mask"),
                               b.const("flat_positions", np.arange(count * n, dtype=np.float32)[None])], "kept_key")
            _, kept = b.op("TopK", [key, b.ints("k", [keep])], "kept", num_outputs=2, axis=-1, largest=1, sorted=1)
        with b.role(TOKENS):
            d = inputs.hidden.shape[2]
            np_dtype = (inputs.hidden.dtype or ir.DataType.FLOAT).numpy()
            patches = b.op("Reshape", [b.slice(inputs.hidden, prefix, INT64_MAX, 1, "patches"),
                                       b.ints("patches_shape", [-1, count * n, d])], "crop_patches")  # [B, C·N, D]
            gathered = b.gather_rows(patches, kept, "gather_kept")
            pruned = b.op("Sub", [b.scalar("one", 1.0), maskf], "pruned_mask")
            weights = b.op("Mul", [b.op("Cast", [pruned], "pruned_cast", to=inputs.hidden.dtype or ir.DataType.FLOAT),
                                   b.const("inv_pruned", np.array(1.0 / (count * n - keep), dtype=np_dtype))],
                           "summary_w")
            summary = b.op("MatMul", [b.unsqueeze(weights, [1], "summary_w3"), patches], "summary")
            parts = [gathered, summary]
            if prefix:
                base = b.op("Slice", [inputs.hidden, b.ints("base_starts", [0, 0]),
                                      b.ints("base_ends", [INT64_MAX, prefix]), b.ints("base_axes", [0, 1]),
                                      b.ints("base_steps", [count, 1])], "base_cls")  # [CLS] of each base crop
                parts.insert(0, base)
            tokens = b.op("Concat", parts, "tokens", axis=1)
        return tokens, kept

    def _emit_per_crop(self, b, params: dict, inputs: GraphInputs, formulation: str):
        count, n, _, _ = self._spec(params)
        tokens, kept = [], []
        for c, k in enumerate(equal_budgets(params["keep"], count, n)):
            if not k:
                continue
            crop = Builder(b.graph, b.opset, f"{b.prefix}/crop{c}")
            with crop.role(TOKENS):
                hidden = crop.op("Slice", [inputs.hidden, crop.ints("starts", [c]), crop.ints("ends", [INT64_MAX]),
                                           crop.ints("axes", [0]), crop.ints("steps", [count])], "hidden")
            if inputs.hidden.shape is not None:
                batch = self.output_batch(params, inputs.hidden.shape[0])
                hidden.shape, hidden.type = ir.Shape([batch, *inputs.hidden.shape[1:]]), inputs.hidden.type
            part = GraphInputs(hidden, inputs.has_cls, n, None, inputs.structure, inputs.prefix)
            tokens_c, kept_c = self.inner.emit(crop, self._inner_params(params, k), part, formulation)
            if tokens and inputs.prefix:
                with crop.role(TOKENS):
                    tokens_c = crop.slice(tokens_c, inputs.prefix, INT64_MAX, 1, "tokens_patches")
            with crop.role(SELECT):
                kept_c = crop.op("Add", [kept_c, crop.ints("offset", [c * n])], "kept_flat")
            b.nodes.extend(crop.nodes)
            tokens.append(tokens_c)
            kept.append(kept_c)
        with b.role(TOKENS):
            joined = b.op("Concat", tokens, "tokens", axis=1) if len(tokens) > 1 else tokens[0]
        with b.role(SELECT):
            flat = b.op("Concat", kept, "kept", axis=1) if len(kept) > 1 else kept[0]
        return joined, flat


def _served() -> str:
    """The methods that serve anyres crops (a crop_form), in the registry's order, for the refusals."""
    from vlmprune.passes.methods import METHODS  # the registry imports every method, this module among their users

    names = [name for name, method in METHODS.items() if method.crop_form]
    return ", ".join(names[:-1]) + " or " + names[-1]


def emit_split(b, mass: ir.Value, keep: int, count: int, per_crop: int) -> ir.Value:
    """split_budget in the graph: mass [B, C] float -> budgets [B, C] int64 (same ops, same order)."""
    mass = b.op("Max", [mass, b.scalar("mass_eps", SCORE_EPS)], "mass")
    free = b.op("ConstantOfShape", [b.op("Shape", [mass], "mass_shape")], "free0",
                value=ir.tensor(np.ones([1], np.float32)))
    cap = b.scalar("per_crop", float(per_crop))
    for r in range(count + 1):
        saturated = b.op("Sub", [b.scalar(f"count{r}", float(count)),
                                 b.reduce("ReduceSum", free, [-1], 1, f"free_n{r}")], f"saturated{r}")
        rest = b.op("Sub", [b.scalar(f"keep{r}", float(keep)), b.op("Mul", [cap, saturated], f"taken{r}")],
                    f"rest{r}")
        m = b.op("Mul", [mass, free], f"m{r}")
        total = b.op("Max", [b.reduce("ReduceSum", m, [-1], 1, f"total_raw{r}"), b.scalar(f"eps{r}", SCORE_EPS)],
                     f"total{r}")
        quota = b.op("Div", [b.op("Mul", [rest, m], f"rest_m{r}"), total], f"quota{r}")
        over = b.op("Cast", [b.op("Greater", [quota, cap], f"over_b{r}")], f"over{r}", to=ir.DataType.FLOAT)
        free = b.op("Sub", [free, over], f"free{r + 1}")
    floor = b.op("Floor", [quota], "quota_floor")
    left = b.op("Sub", [rest, b.reduce("ReduceSum", b.op("Mul", [floor, free], "floor_free"), [-1], 1, "floor_sum")],
                "left")
    frac = b.op("Add", [b.op("Mul", [b.op("Sub", [quota, floor], "frac_raw"), free], "frac_free"),
                        b.op("Sub", [free, b.scalar("one_f", 1.0)], "frac_last")], "frac")
    a, c = b.unsqueeze(frac, [2], "frac_a"), b.unsqueeze(frac, [1], "frac_c")
    lower = b.const("lower", np.triu(np.ones((count, count), dtype=bool), 1))
    beats = b.op("Or", [b.op("Greater", [a, c], "frac_gt"),
                        b.op("And", [b.op("Equal", [a, c], "frac_eq"), lower], "frac_tie")], "beats")
    rank = b.reduce("ReduceSum", b.op("Cast", [beats], "beats_f", to=ir.DataType.FLOAT), [1], 0, "crop_rank")
    extra = b.op("Mul", [b.op("Cast", [b.op("Less", [rank, left], "extra_b")], "extra_f", to=ir.DataType.FLOAT),
                         free], "extra")
    share = b.op("Mul", [b.op("Add", [floor, extra], "share_raw"), free], "share")
    full = b.op("Mul", [cap, b.op("Sub", [b.scalar("one_s", 1.0), free], "saturated_f")], "full")
    return b.op("Cast", [b.op("Add", [share, full], "budgets_f")], "budgets", to=ir.DataType.INT64)


def _cut_scores(scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Each score minus its crop's cut (midway between the k_c-th and (k_c+1)-th best): positive = kept.

    The global top K of these is the kept set, so parity's tie band measures how close each
    crop's boundary was (a crop keeping none or all of its patches has no boundary: ±1 away).
    """
    ordered = torch.sort(scores, dim=-1, descending=True, stable=True).values  # [B, C, N]
    n = scores.shape[-1]
    k = budgets.unsqueeze(-1)
    above = torch.gather(ordered, -1, (k - 1).clamp(0, n - 1))
    below = torch.gather(ordered, -1, k.clamp(0, n - 1))
    cut = torch.where(k == 0, ordered[..., :1] + 1.0,
                      torch.where(k == n, ordered[..., -1:] - 1.0, 0.5 * (above + below)))
    return scores - cut
