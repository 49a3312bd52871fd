"""`--budget adaptive`: K per image from the entropy of a score-based method's own score (an entropy-driven budget: a peaked score needs fewer tokens).

For a method that ranks patches by one score S [B, N] (Method.selection == BY_SCORE: cls),
the budget of image b is

    p_i = S⁺_i / Σ_j S⁺_j          (S⁺ = max(S, 0); the image's normalised score distribution)
    H   = -Σ_i p_i · ln p_i         (nats; p · ln p = 0 at p = 0)
    ρ   = α · sigmoid(β · H) + γ
    K_b = clamp(round(ρ · N), K_min, K_max)      (round half to even, as torch and ONNX Round)

A flat score (nothing stands out, H near ln N) keeps more tokens; a peaked one (a few
patches hold the attention, H small) keeps fewer. Options (every method's, parsed by the
base class): --budget adaptive, --alpha α (default 1.0), --beta β (default 0.5), --gamma γ
(default -0.6), --kmin K_min (default 1); K_max is --keep. The defaults are vlmprune's (seed
001 gives the form, not the constants): β = 0.5 puts sigmoid(β·H) between 0.73 (H = 2) and
0.96 (H = ln 576 = 6.36), so with α = 1 and γ = -0.6 a 576-patch tower keeps ρ ≈ 0.13..0.36
of its patches (75..207), around the usual 144 and 192.

The method keeps its score and its extras: AdaptiveBudget(method) runs the method for
K_max, takes the score it ranks (the reference's trace["scores"]; in the graph, the data
input of the method's first selection TopK), keeps the K_b best of it (ties to the lower
index) in ascending order, and, where the method adds one summary token (cls), appends
the mean of the N - K_b pruned tokens right after the image's K_b rows. Output (passes.prune's
variable-K seam): [prefix] + K_max (+1) rows, each image's K_b (+1) first, zero rows after;
num_tokens [B] counts the valid rows; kept_indices [B, K_max] has -1 in the padded slots.
Served: BY_SCORE methods whose output is copied kept rows plus at most one summary token, no
local merge, no crops (cls: checked with --lambda, and with --score probe on SigLIP; --score attention on
Qwen2-VL is not checked); refused in one line otherwise
(visionzip's contextual merge and divprune's / dart's greedy picks have no single ranked score
to cut; prumerge+ sets its own K).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.errors import InputError
# The options' parsing is budget_options', below base (whose Method.parse runs it); re-exported here.
from vlmprune.passes.methods.budget_options import ADAPTIVE, DEFAULTS, FIXED, OPTIONS, parse, refusal  # noqa: F401
from vlmprune.passes.methods.base import BY_SCORE, GraphInputs, Method, SiteTensors, TorchResult
from vlmprune.passes.methods.builder import INT64_MAX, SELECT, TOKENS, role_of
from vlmprune.passes.methods.prumerge import sort_padded
from vlmprune.passes.methods.selection import gather_rows, split_prefix, topk_lower_index

P_FLOOR = 1e-30  # ln's argument floor: p = 0 contributes 0 · ln(1e-30) = 0


def wrap(method: Method, params: dict) -> Method:
    """The method as compiled with these (parsed) parameters: AdaptiveBudget(method) under --budget adaptive.

    What the method's output is made of is known only once its own parse has run (visionzip's split), so that
    refusal is here, not in parse."""
    if params.get("budget") != ADAPTIVE or isinstance(method, AdaptiveBudget):
        return method
    keep = params["keep"]
    if method.copied_rows(params) != keep or method.output_tokens(params) - keep not in (0, 1):
        raise InputError(f"method {method.name} does not take --budget adaptive: its output merges tokens beyond "
                         "its ranked ones")
    return AdaptiveBudget(method)


def adaptive_keep(scores: torch.Tensor, params: dict) -> torch.Tensor:
    """K_b [B] int64 from the scores [B, N] (module docstring)."""
    return torch.round(budget_rows(scores, params)).clamp(params["kmin"], params["keep"]).to(torch.int64)


def budget_rows(scores: torch.Tensor, params: dict) -> torch.Tensor:
    """ρ·N [B] before rounding and clamping: parity's trace holds it, since a lower precision may round a ρ·N
    within its own error of a half-integer to the other side (a K decision tie, compiler.parity)."""
    n = scores.shape[-1]
    positive = scores.clamp_min(0)
    p = positive / positive.sum(dim=-1, keepdim=True).clamp_min(P_FLOOR)
    entropy = -(p * p.clamp_min(P_FLOOR).log()).sum(dim=-1)
    rho = params["alpha"] * torch.sigmoid(params["beta"] * entropy) + params["gamma"]
    return rho * n


class AdaptiveBudget(Method):
    """`method` with K per image (module docstring); name, options and needs stay the method's own."""

    variable_k = True
    selection = BY_SCORE
    # Measured under rknn-toolkit2 2.5.0's hybrid int8 (targets.rk3588), which quantises the nodes after the selection.
    int8_loss = ("its padded rows and summary lose their values in int8 (cosine -0.57 on the tiny test LLaVA, "
                 "against 0.99 required)")

    def __init__(self, inner: Method):
        self.inner = inner
        self.name, self.summary, self.official = inner.name, inner.summary, inner.official
        self.options, self.choices, self.version = inner.options, inner.choices, inner.version

    def parse(self, keep, options):
        return self.inner.parse(keep, options)

    def needs(self, params):
        return self.inner.needs(params)

    def check(self, params, spec):
        self.inner.check(params, spec)

    def check_onnx_source(self, params):
        self.inner.check_onnx_source(params)

    def serves(self):
        return self.inner.serves()

    def output_tokens(self, params):
        return self.inner.output_tokens(params)

    def copied_rows(self, params):
        return params["keep"]

    def describe(self, params):
        return (f"{self.inner.describe(params)}; K per image by entropy (--budget adaptive, α={params['alpha']:g}, "
                f"β={params['beta']:g}, γ={params['gamma']:g}, K in [{params['kmin']}, {params['keep']}])")

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        k_max = params["keep"]
        scores = self.inner.reference(params, inputs).trace["scores"]
        count = adaptive_keep(scores, params)
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        n = patches.shape[1]
        ranked = topk_lower_index(scores, k_max)
        valid = torch.arange(k_max) < count.unsqueeze(-1)
        kept = torch.where(valid, ranked, torch.full_like(ranked, n)).sort(dim=-1).values
        kept = torch.where(valid, kept, torch.full_like(kept, -1))
        rows = gather_rows(patches, kept.clamp_min(0)) * valid.unsqueeze(-1)
        parts = [*cls, rows]
        rows_valid = count
        if self.inner.output_tokens(params) > k_max:  # the summary: mean of the pruned, right after the kept rows
            kept_mask = (torch.nn.functional.one_hot(ranked, n) * valid.unsqueeze(-1)).amax(dim=1)
            pruned = (1 - kept_mask).to(patches.dtype)
            summary = (pruned.unsqueeze(1) @ patches) / (n - count).clamp_min(1).to(patches.dtype)[:, None, None]
            at = (torch.arange(k_max + 1) == count.unsqueeze(-1)).to(patches.dtype).unsqueeze(-1)
            parts[-1] = torch.cat([rows, torch.zeros_like(rows[:, :1])], dim=1) + at * summary
            rows_valid = count + 1
        trace = {"scores": scores, "boundary": k_max, "num_tokens": rows_valid, "keep": count,
                 "budget_rows": budget_rows(scores, params), "budget_range": (params["kmin"], k_max)}
        return TorchResult(torch.cat(parts, dim=1), kept, trace)

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str):
        k_max, n = params["keep"], inputs.num_patches
        start = len(b.nodes)
        self.inner.emit(b, params, inputs, formulation)  # its tokens go unused (RemoveUnusedNodesPass drops them)
        topk = next((node for node in b.nodes[start:] if node.op_type == "TopK" and role_of(node) == SELECT), None)
        if topk is None:
            raise InputError(f"method {self.name} emitted no selection TopK to read its score from")
        scores = topk.inputs[0]  # [B, N]
        with b.role(SELECT):
            count = self._emit_keep(b, scores, params, n)  # [B, 1] (HTP casts to int64 at rank 2, not rank 1)
            _, ranked = b.op("TopK", [scores, b.ints("budget_k_max", [k_max])], "budget_ranked", num_outputs=2,
                             axis=-1, largest=1, sorted=1)
            slots = b.const("budget_slots", np.arange(k_max, dtype=np.int64)[None])
            valid = b.op("Less", [slots, count], "budget_valid")
            ascending = sort_padded(b, valid, ranked, n, k_max, "budget_ascending")
            kept = b.op("Where", [valid, ascending, b.ints("budget_minus_one", -1)], "budget_kept")
            safe = b.op("Where", [valid, ascending, b.ints("budget_zero", 0)], "budget_safe")
        with b.role(TOKENS):
            dtype = inputs.hidden.dtype or ir.DataType.FLOAT
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "budget_patches")
            valid_f = b.op("Cast", [b.unsqueeze(valid, [-1], "budget_valid_col")], "budget_valid_f", to=dtype)
            rows = b.op("Mul", [b.gather_rows(patches, safe, "budget_gather"), valid_f], "budget_rows")
            rows_valid = count
            if self.inner.output_tokens(params) > k_max:
                rows, rows_valid = self._emit_summary(b, patches, ranked, valid, count, rows, n, k_max, dtype)
            rows_valid = b.squeeze(rows_valid, [1], "budget_num_tokens")
            if inputs.prefix:
                rows = b.op("Concat", [b.slice(inputs.hidden, 0, inputs.prefix, 1, "budget_cls"), rows],
                            "budget_tokens", axis=1)
        return rows, kept, rows_valid

    @staticmethod
    def _emit_keep(b, scores, params: dict, n: int):
        """K_b [B, 1] int64 in the graph (adaptive_keep)."""
        positive = b.op("Max", [scores, b.scalar("budget_zero_f", 0.0)], "budget_positive")
        total = b.op("Max", [b.reduce("ReduceSum", positive, [1], 1, "budget_total_raw"),
                             b.scalar("budget_floor", P_FLOOR)], "budget_total")
        p = b.op("Div", [positive, total], "budget_p")
        log_p = b.op("Log", [b.op("Max", [p, b.scalar("budget_p_floor", P_FLOOR)], "budget_p_floored")], "budget_log_p")
        entropy = b.op("Neg", [b.reduce("ReduceSum", b.op("Mul", [p, log_p], "budget_plogp"), [1], 1,
                                        "budget_sum_plogp")], "budget_entropy")
        sig = b.op("Sigmoid", [b.op("Mul", [entropy, b.scalar("budget_beta", params["beta"])], "budget_beta_h")],
                   "budget_sigmoid")
        rho = b.op("Add", [b.op("Mul", [sig, b.scalar("budget_alpha", params["alpha"])], "budget_alpha_s"),
                           b.scalar("budget_gamma", params["gamma"])], "budget_rho")
        k = b.op("Round", [b.op("Mul", [rho, b.scalar("budget_n_f", float(n))], "budget_rho_n")], "budget_round")
        k = b.op("Min", [b.op("Max", [k, b.scalar("budget_kmin", float(params["kmin"]))], "budget_at_least"),
                         b.scalar("budget_kmax", float(params["keep"]))], "budget_clip")  # HTP takes no float Clip
        return b.op("Cast", [k], "budget_keep", to=ir.DataType.INT64)

    @staticmethod
    def _emit_summary(b, patches, ranked, valid, count, rows, n: int, k_max: int, dtype):
        """Rows [B, K_max + 1, D] with the mean of the pruned tokens at row K_b; the valid rows K_b + 1."""
        hit = b.op("And", [b.op("Equal", [b.unsqueeze(ranked, [-1], "budget_ranked_col"),
                                          b.const("budget_ids", np.arange(n, dtype=np.int64)[None, None])],
                                "budget_hit_all"), b.unsqueeze(valid, [-1], "budget_valid_hit")], "budget_hit")
        kept_mask = b.reduce("ReduceMax", b.op("Cast", [hit], "budget_hit_f", to=dtype), [1], 1, "budget_kept_mask")
        pruned = b.op("Sub", [b.scalar("budget_one", 1.0, dtype.numpy()), kept_mask], "budget_pruned")  # [B, 1, N]
        left = b.op("Cast", [b.op("Max", [b.op("Sub", [b.ints("budget_n_i", n), count], "budget_left_raw"),
                                          b.ints("budget_one_i", 1)], "budget_left")], "budget_left_f", to=dtype)
        summary = b.op("Div", [b.op("MatMul", [pruned, patches], "budget_pruned_sum"),
                               b.unsqueeze(left, [2], "budget_left_col")], "budget_summary")  # [B, 1, D]
        at = b.op("Equal", [b.const("budget_rows_ids", np.arange(k_max + 1, dtype=np.int64)[None]), count],
                  "budget_at")
        at = b.op("Cast", [b.unsqueeze(at, [-1], "budget_at_col")], "budget_at_f", to=dtype)
        zero_row = b.op("Mul", [b.slice(rows, 0, 1, 1, "budget_first_row"), b.scalar("budget_zero_row", 0.0,
                                                                                      dtype.numpy())], "budget_pad_row")
        padded = b.op("Concat", [rows, zero_row], "budget_rows_plus", axis=1)
        out = b.op("Add", [padded, b.op("Mul", [at, summary], "budget_summary_at")], "budget_with_summary")
        return out, b.op("Add", [count, b.ints("budget_one_row", 1)], "budget_rows_valid")
