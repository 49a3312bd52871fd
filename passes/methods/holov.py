"""`holov`: HoloV's holistic crop budgets on the projector output (obananas/HoloV).

On the tokens the LLM sees (the tower's end, after the projector), scored by the [CLS] row
of the feature layer's attention, mean over heads (a_i; the official code reads
`attentions[select_layer][:, :, 0, 1:]`; the tower graph ends at the feature layer, so that is
the [CLS] row of the last block it runs, recomputed from that block's own Q and K):

1. Crops: P contiguous raster slices of the N tokens; with N = q·P + r the first r crops hold
   q + 1 tokens and the rest q (the official split). Default P = max(1, int((1024/576)·N/K)),
   the official Qwen2.5-VL code's (the LLaVA code fixes P = 16 for K = 64 of 576); option
   --partitions. P > N is read as P = N (the official code skips the empty crops).
2. Per crop of n >= 2 tokens: x̂ = x / (||x|| + 1e-6), S = x̂ x̂ᵀ with its diagonal set to 0,
   m_i = Σ_j S_ij / (n - 1), v_i = Σ_j (S_ij - m_i)² / (n - 1) over all n entries of row i,
   so the zeroed diagonal adds m_i² (the official arithmetic, kept as it is).
3. Token score t_i = 1000·a_i + 0.09 · v_i · mean_c|1000·a| / (mean_c|v| + 1e-6) (the
   variance rescaled to the crop's mean |1000·a|); crop weight s_c = mean of t over the crop.
   A crop of one token has s_c = a_i, unscaled (the official special case).
4. Budgets: w_c = s_c / (Σ s + 1e-6); k_c = floor(w_c·K); the K - Σ k_c leftovers go +1 to the
   crops of largest w (ties to the lower crop index).
5. Within crop c: keep its k_c tokens of largest a (ties to the lower index).
6. Output: [CLS, where the features keep it] + the K kept tokens in ascending raster order +
   one context token, the mean of the N - K pruned tokens (context re-injection: what was pruned comes back as one token):
   [B, (1)+N, D] -> [B, (1)+K+1, D]. K counts real tokens only, as cls's summary token.
   `--merge local` (passes.methods.merge, applied by the base class): the kept tokens merged
   with their pruned neighbours, and the context token the mean of those with none.

Deviations from the official code, and choices where it is batch-1 only or silent:
- a crop whose budget exceeds its size: the official code keeps the crop and pads the output
  with zero tokens (positions -1); here the surplus goes to the other crops in weight order
  (largest w first, ties to the lower index, each up to its size), so exactly K real tokens
  come out (K < N leaves room);
- kept tokens are in ascending raster order (the official code concatenates each crop's
  top-k, best first, crop by crop);
- ties go to the lower index, in the leftover ranking and in each crop's top-k (torch.topk
  leaves them open);
- the context token: the published re-injection passes the pruned tokens through a trained FFN;
  no trained weights for it exist, so the token is their unweighted mean, untrained;
- with a [CLS] token in the features (select strategy `full`), it passes through and only
  patch tokens are cropped and selected.

Graph: every shape is static (P, N and the crop sizes are constants), so the crops are at
most two groups of equal size, each reshaped [B, crops, n, D]; crop means are MatMuls with the
constant crop-membership matrix, the leftover and surplus order a pairwise comparison of the
P weights, each crop's top-k a pairwise rank within the crop (rank < k_c): a mask with exactly
K ones, which cls's selection (TopK, raster sort, gather, mean of the rest) turns into the
output. No Loop, no CumSum, no integer arithmetic (budgets are small integers held in fp32),
so every target takes it. The rescale is computed as v / (mean_c|v| + 1e-6) · mean_c|1000·a|,
the official v · (mean_c|1000·a| / (mean_c|v| + 1e-6)) reordered so that no factor can leave
fp16's range (the ratio is at most n). Precision: the selection is discrete in three places
(each floor, the weight order, each crop's attention cut); parity reports the smallest of their
margins as one greedy step (a lower precision, fp16 engines included, may resolve a choice
within it differently, and parity then says so).

What the official arithmetic implies (kept as written): the rescaled variance averages to the
crop's mean |1000·a|, so s_c = 1.09 · mean_c(1000·a) up to the 1e-6; the variance shapes the
token scores but barely moves the budgets, and the kept tokens are ranked by attention alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import SCORE_EPS, SITE_FEATURES
from vlmprune.compiler.errors import InputError, StructureError
import vlmprune.passes.methods.attention as attention
import vlmprune.passes.methods.relevance as relevance
from vlmprune.passes.methods.base import (GREEDY, GraphInputs, Method, Needs, SiteTensors, TorchResult,
                                          positive_int)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT
from vlmprune.passes.methods.cls import emit_selection, gather_summary
from vlmprune.passes.methods.selection import select_topk
from vlmprune.passes.graph.structure import static_dim

EPS = 1e-6  # the official code's `esp`: norms, the variance rescale and the weights
ATTN_SCALE = 1e3
BETA = 0.09


def default_partitions(n: int, keep: int) -> int:
    """The official Qwen code's P: max(1, int((1024/576)·N/K)), in its own float arithmetic."""
    return max(1, int(((1024 / 576) * n) / keep))


def crop_groups(n: int, partitions: int) -> list[tuple[int, int, int]]:
    """(first token, crops, tokens per crop) of each run of equal crops, in raster order (at most two runs)."""
    p = min(partitions, n)
    q, r = divmod(n, p)
    groups, start = [], 0
    for count, size in ((r, q + 1), (p - r, q)):
        if count:
            groups.append((start, count, size))
            start += count * size
    return groups


def _membership(groups) -> np.ndarray:
    """[N, P]: 1 where token i lies in crop c."""
    sizes = [size for _, count, size in groups for _ in range(count)]
    crop = np.repeat(np.arange(len(sizes)), sizes)
    return (crop[:, None] == np.arange(len(sizes))[None, :]).astype(np.float32)


def _per_token(groups, value_ge2: float, value_1: float) -> np.ndarray:
    """[N]: a constant per token, by whether its crop has at least two tokens."""
    return np.concatenate([np.full(count * size, value_ge2 if size >= 2 else value_1, np.float32)
                           for _, count, size in groups])


class HolovMethod(Method):
    name = "holov"
    summary = ("HoloV: [CLS]-attention + similarity-variance crop budgets over P raster crops, top by attention "
               "per crop, + 1 context token")
    selection = GREEDY
    options = {"partitions": (int, "holov: P, the contiguous raster crops the budget is split over (default "
                                   "max(1, int((1024/576)·N/K)), the official Qwen code's)")}
    official = "https://github.com/obananas/HoloV"
    local_merge = True  # --merge local: merge's step replaces the kept rows + context token (base.Method)
    prompt_weight = True  # --prompt-weight: a' = a/max(a) + W·relevance wherever a is read (passes.methods.relevance)

    def parse(self, keep, options):
        params = super().parse(keep, options)
        if "partitions" in params:
            positive_int(self.name, "partitions", params["partitions"])
        return params

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES, cls=True, attention=True)

    def output_tokens(self, params: dict) -> int:
        return params["keep"] + 1

    def partitions(self, params: dict, n: int) -> int:
        return params.get("partitions") or default_partitions(n, params["keep"])

    def summary_params(self, params: dict, num_patches: int) -> dict:
        """P as its number at this site (the default P follows N and K)."""
        return {**params, "partitions": self.partitions(params, num_patches)}

    def describe(self, params: dict) -> str:
        p = params.get("partitions")
        crops = f"{p} raster crops" if p else "max(1, int((1024/576)·N/K)) raster crops"
        return f"HoloV: [CLS] attention + similarity variance over {crops}, {params['keep']} kept + 1 context token"

    # ------------------------------------------------------------------ reference

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        keep, prefix = params["keep"], inputs.prefix
        x = inputs.hidden[:, prefix:]
        n = x.shape[1]
        if inputs.q is None:
            raise InputError(f"method {self.name} needs the feature layer's Q and K, which this source's pipeline "
                             "does not hand over")
        a = attention.cls_attention(inputs.q, inputs.k, inputs.scale, inputs.k.shape[2] - n)
        a = relevance.weighted(params, inputs, a)  # --prompt-weight (a itself without it)
        groups = crop_groups(n, self.partitions(params, n))
        var = torch.cat([_crop_variance(x[:, s: s + c * m], c, m) for s, c, m in groups], dim=1)
        member = torch.from_numpy(_membership(groups)).to(x.dtype)
        sizes = member.sum(dim=0)
        crop_mean = lambda v: (v @ member) / sizes  # noqa: E731  [B, N] -> [B, P]
        scaled = a * torch.from_numpy(_per_token(groups, ATTN_SCALE, 1.0)).to(x.dtype)
        ratio = var / (crop_mean(var.abs()) @ member.T + EPS)
        beta = torch.from_numpy(_per_token(groups, BETA, 0.0)).to(x.dtype)
        token = scaled + beta * ratio * (crop_mean(scaled.abs()) @ member.T)
        weights = crop_mean(token)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
        budget, margin_budget = _budgets(weights, keep, sizes)
        rank, margin_attn = _crop_ranks(a, groups, budget)
        mask = (rank < budget @ member.T).to(x.dtype)
        kept = select_topk(mask, keep)
        margin = torch.minimum(margin_budget, margin_attn)
        return TorchResult(gather_summary(inputs.hidden, kept, prefix), kept,
                           {"steps": [(kept, margin)], "token_scores": token, "weights": weights, "budgets": budget})

    # ------------------------------------------------------------------ graph

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep, n, prefix = params["keep"], inputs.num_patches, inputs.prefix
        structure = inputs.structure
        if structure is None or not structure.blocks:
            raise StructureError(f"method {self.name} found no attention block in the graph (its score is the "
                                 "[CLS] row of the last block the tower runs)")
        block = structure.blocks[-1]
        tokens = static_dim(block.output, 1)
        if not isinstance(tokens, int) or tokens <= n:
            raise StructureError(f"method {self.name}: the last block has {tokens} tokens, not a [CLS] token and "
                                 f"the {n} patches of the features")
        d = static_dim(inputs.hidden, 2)
        if not isinstance(d, int):
            raise StructureError(f"method {self.name} needs the features' static width")
        groups = crop_groups(n, self.partitions(params, n))
        member = _membership(groups)
        sizes = member.sum(axis=0)
        mean_c = b.const("member_mean", member / sizes)  # [N, P]: the crop means
        spread = b.const("member_t", member.T.copy())  # [P, N]: a crop's value onto its tokens
        with b.role(SCORE):
            a = attention.emit_cls_attention(b, block, tokens - n)  # [B, N]
            a = relevance.emit_weighted(b, params, inputs, a)  # --prompt-weight (a itself without it)
            x = b.slice(inputs.hidden, prefix, INT64_MAX, 1, "patches") if prefix else inputs.hidden
            norm = b.reduce("ReduceL2", x, [-1], 1, "norm")
            xn = b.op("Div", [x, b.op("Add", [norm, b.scalar("norm_eps", EPS)], "norm_den")], "unit")
            var = self._variance(b, xn, a, groups, d)
            scaled = b.op("Mul", [a, b.const("attn_scale", _per_token(groups, ATTN_SCALE, 1.0))], "attn_scaled")
            mean_var = b.op("MatMul", [b.op("MatMul", [b.op("Abs", [var], "var_abs"), mean_c], "var_crop"), spread],
                            "var_crop_t")
            ratio = b.op("Div", [var, b.op("Add", [mean_var, b.scalar("var_eps", EPS)], "var_den")], "var_ratio")
            mean_attn = b.op("MatMul", [b.op("MatMul", [b.op("Abs", [scaled], "attn_abs"), mean_c], "attn_crop"),
                                        spread], "attn_crop_t")
            rescaled = b.op("Mul", [b.op("Mul", [ratio, mean_attn], "var_rescaled"),
                                    b.const("beta", _per_token(groups, BETA, 0.0))], "var_term")
            token = b.op("Add", [scaled, rescaled], "token_score")
            crop = b.op("MatMul", [token, mean_c], "crop_score")  # [B, P]
            total = b.reduce("ReduceSum", crop, [-1], 1, "crop_total")
            weights = b.op("Div", [crop, b.op("Add", [total, b.scalar("w_eps", EPS)], "w_den")], "weights")
        with b.role(SELECT):
            budget = self._emit_budgets(b, weights, keep, sizes)
            per_token = b.op("MatMul", [budget, spread], "budget_t")  # [B, N], exact small integers
            rank = self._emit_ranks(b, a, groups)
            mask = b.op("Cast", [b.op("Less", [rank, per_token], "in_budget")], "keep_mask", to=ir.DataType.FLOAT)
        return emit_selection(b, inputs.hidden, mask, keep, n, prefix)

    @staticmethod
    def _variance(b, xn: ir.Value, a: ir.Value, groups, d: int) -> ir.Value:
        """[B, N]: each token's variance of its cosines to its crop (0 for one-token crops)."""
        parts = []
        for g, (start, count, size) in enumerate(groups):
            if size < 2:
                zero = b.op("Mul", [b.slice(a, start, start + count, 1, f"g{g}_attn"), b.scalar(f"g{g}_zero", 0.0)],
                            f"g{g}_var")
                parts.append(zero)
                continue
            rows = b.slice(xn, start, start + count * size, 1, f"g{g}_rows")
            crops = b.op("Reshape", [rows, b.ints(f"g{g}_shape", [-1, count, size, d])], f"g{g}_crops")
            sim = b.op("MatMul", [crops, b.op("Transpose", [crops], f"g{g}_t", perm=[0, 1, 3, 2])], f"g{g}_sim")
            off = b.op("Mul", [sim, b.const(f"g{g}_offdiag", 1.0 - np.eye(size, dtype=np.float32))], f"g{g}_masked")
            inv = b.scalar(f"g{g}_inv", 1.0 / (size - 1))
            mean = b.op("Mul", [b.reduce("ReduceSum", off, [-1], 1, f"g{g}_sum"), inv], f"g{g}_mean")
            dev = b.op("Sub", [off, mean], f"g{g}_dev")
            sq = b.reduce("ReduceSum", b.op("Mul", [dev, dev], f"g{g}_sq"), [-1], 0, f"g{g}_sqsum")
            var = b.op("Mul", [sq, inv], f"g{g}_var3")
            parts.append(b.op("Reshape", [var, b.ints(f"g{g}_flat", [-1, count * size])], f"g{g}_var"))
        return b.op("Concat", parts, "variance", axis=1) if len(parts) > 1 else parts[0]

    @staticmethod
    def _emit_budgets(b, weights: ir.Value, keep: int, sizes: np.ndarray) -> ir.Value:
        """[B, P] float: floor(w·K), +1 for the leftovers by weight, the surplus over a crop's size moved on."""
        p = sizes.size
        alloc = b.op("Floor", [b.op("Mul", [weights, b.scalar("keep", float(keep))], "share")], "alloc")
        left = b.op("Sub", [b.scalar("keep_total", float(keep)), b.reduce("ReduceSum", alloc, [-1], 1, "alloc_sum")],
                    "leftover")
        before = _emit_before(b, weights, p, "w")  # [B, P, P] float: crop j ranks before crop i
        rank = b.reduce("ReduceSum", before, [-1], 0, "w_rank")
        bonus = b.op("Cast", [b.op("Less", [rank, left], "gets_leftover")], "leftover_one", to=ir.DataType.FLOAT)
        alloc = b.op("Add", [alloc, bonus], "alloc_left")
        size = b.const("crop_sizes", sizes.astype(np.float32))
        zero = b.scalar("zero", 0.0)
        over = b.op("Max", [b.op("Sub", [alloc, size], "over_raw"), zero], "over")
        surplus = b.reduce("ReduceSum", over, [-1], 1, "surplus")
        alloc = b.op("Min", [alloc, size], "alloc_capped")
        room = b.op("Sub", [size, alloc], "room")
        ahead = b.squeeze(b.op("MatMul", [before, b.unsqueeze(room, [2], "room3")], "room_ahead3"), [2], "room_ahead")
        extra = b.op("Min", [b.op("Max", [b.op("Sub", [surplus, ahead], "extra_raw"), zero], "extra_pos"), room],
                     "extra")
        return b.op("Add", [alloc, extra], "budget")

    @staticmethod
    def _emit_ranks(b, a: ir.Value, groups) -> ir.Value:
        """[B, N] float: each token's rank by attention within its crop (ties: the lower index first)."""
        parts = []
        for g, (start, count, size) in enumerate(groups):
            seg = b.slice(a, start, start + count * size, 1, f"r{g}_attn")
            if size < 2:
                parts.append(b.op("Mul", [seg, b.scalar(f"r{g}_zero", 0.0)], f"r{g}_rank"))
                continue
            crops = b.op("Reshape", [seg, b.ints(f"r{g}_shape", [-1, count, size])], f"r{g}_crops")
            ahead = _emit_before(b, crops, size, f"r{g}")  # [B, c, s, s]
            rank = b.reduce("ReduceSum", ahead, [-1], 0, f"r{g}_rank3")
            parts.append(b.op("Reshape", [rank, b.ints(f"r{g}_flat", [-1, count * size])], f"r{g}_rank"))
        return b.op("Concat", parts, "attn_rank", axis=1) if len(parts) > 1 else parts[0]


def _emit_before(b, values: ir.Value, m: int, name: str) -> ir.Value:
    """[..., m, m] float, [i, j] = 1 where entry j ranks before entry i: larger, or equal with j < i."""
    rows = b.unsqueeze(values, [-1], f"{name}_i")  # [..., m, 1]: entry i
    cols = b.unsqueeze(values, [-2], f"{name}_j")  # [..., 1, m]: entry j
    lower = b.const(f"{name}_lower", np.tril(np.ones((m, m), dtype=bool), -1))  # j < i
    larger = b.op("Greater", [cols, rows], f"{name}_gt")
    tied = b.op("And", [b.op("Equal", [cols, rows], f"{name}_eq"), lower], f"{name}_tie")
    return b.op("Cast", [b.op("Or", [larger, tied], f"{name}_before_b")], f"{name}_before", to=ir.DataType.FLOAT)


# ---------------------------------------------------------------------------- reference helpers


def _crop_variance(x: torch.Tensor, count: int, size: int) -> torch.Tensor:
    """[B, count·size]: the official per-crop variance of cosines (step 2 of the module docstring)."""
    if size < 2:
        return torch.zeros(x.shape[0], count * size, dtype=x.dtype)
    unit = x / (x.norm(dim=-1, keepdim=True) + EPS)
    crops = unit.reshape(x.shape[0], count, size, -1)
    sim = (crops @ crops.transpose(-1, -2)) * (1.0 - torch.eye(size, dtype=x.dtype))
    mean = sim.sum(dim=-1, keepdim=True) / (size - 1)
    return (((sim - mean) ** 2).sum(dim=-1) / (size - 1)).reshape(x.shape[0], count * size)


def _before(values: torch.Tensor) -> torch.Tensor:
    """[..., m, m], [i, j] = 1 where entry j ranks before entry i (larger, or equal with j < i)."""
    m = values.shape[-1]
    rows, cols = values.unsqueeze(-1), values.unsqueeze(-2)
    lower = torch.ones(m, m, dtype=torch.bool).tril(-1)
    return ((cols > rows) | ((cols == rows) & lower)).to(values.dtype)


def _budgets(weights: torch.Tensor, keep: int, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_c [B, P], margin [B]): step 4 and the surplus rule; margin is how near the weights came to another
    budget: the nearest share to an integer (over K) and the closest two weights (over the largest)."""
    share = weights * keep
    alloc = share.floor()
    before = _before(weights)
    rank = before.sum(dim=-1)
    alloc = alloc + (rank < keep - alloc.sum(dim=-1, keepdim=True)).to(weights.dtype)
    surplus = (alloc - sizes).clamp_min(0).sum(dim=-1, keepdim=True)
    alloc = torch.minimum(alloc, sizes)
    room = sizes - alloc
    ahead = (before @ room.unsqueeze(-1)).squeeze(-1)
    budget = alloc + torch.minimum((surplus - ahead).clamp_min(0), room)
    frac = (share - share.round()).abs().amin(dim=-1) / keep
    ordered = weights.sort(dim=-1, descending=True).values
    top = weights.abs().amax(dim=-1).clamp_min(SCORE_EPS)
    gap = (ordered[:, :-1] - ordered[:, 1:]).amin(dim=-1) / top if weights.shape[-1] > 1 else torch.full_like(top, 1.0)
    return budget, torch.minimum(frac, gap)


def _crop_ranks(a: torch.Tensor, groups, budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank [B, N] by attention within each crop, margin [B]: the smallest attention gap at a crop's cut, over
    the largest attention)."""
    ranks, gaps, crop = [], [], 0
    for start, count, size in groups:
        seg = a[:, start: start + count * size].reshape(a.shape[0], count, size)
        ranks.append(_before(seg).sum(dim=-1).reshape(a.shape[0], count * size))
        if size >= 2:
            ordered = seg.sort(dim=-1, descending=True).values  # [B, c, s]
            k = budget[:, crop: crop + count].long()  # [B, c]
            inside = (k > 0) & (k < size)
            hi = ordered.gather(-1, (k - 1).clamp(0, size - 1).unsqueeze(-1)).squeeze(-1)
            lo = ordered.gather(-1, k.clamp(0, size - 1).unsqueeze(-1)).squeeze(-1)
            gaps.append(torch.where(inside, hi - lo, torch.full_like(hi, float("inf"))).amin(dim=-1))
        crop += count
    top = a.abs().amax(dim=-1).clamp_min(SCORE_EPS)
    gap = torch.stack(gaps, dim=-1).amin(dim=-1) / top if gaps else torch.full_like(top, float("inf"))
    return torch.cat(ranks, dim=1), gap
