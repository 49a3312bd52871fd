"""`visionzip`: VisionZip's dominant + contextual tokens (dvlab-research/VisionZip; K split k1:k2 between the two).

At block L (default: the feature layer), from that block's own attention and keys:

1. Dominant: the K_d patches with the highest recomputed [CLS] attention (mean over heads).
2. Contextual: the R = N - K_d remaining patches, in ascending order, are compared by
   their keys of block L (key projection, averaged over heads, L2-normalised). K_c of them
   are targets: positions 0, s, 2s, ... of that remaining list, s = max(1, R // K_c), the
   first K_c. Every other remaining token joins the target whose key is most similar
   (cosine); a contextual token is the target's hidden state plus the mean of the hidden
   states that joined it (a target nobody joined stays as it is).

Output: [CLS?] + K_d dominant (raster order) + K_c contextual (target order), K = K_d + K_c.
kept_indices holds the dominant patches, then the target patches: each output token's
patch position. Default K_c = round(10·K/64) (10, 20, 30 for K = 64, 128, 192, the
official ratios); option --contextual.

Choices where the official code is batch-1 only or silent:
- ties: the dominant TopK goes to the lower index; a token equally similar to two targets
  joins the first (argmax's first occurrence, as torch and ONNX ArgMax both do);
- [CLS]: the official code hands [CLS] to the LLM as one of its dominant tokens; here
  [CLS] follows the model's select strategy (LLaVA's default drops it), recorded in the
  manifest; it is never counted in K;
- key normalisation divides by max(||k||, 1e-12) (the official code divides by ||k||);
- the dominant scores are the mean over heads (the official sum ranks identically).

`--scorer int8` (base.GENERIC_OPTIONS): the dominant score is cls's [CLS] row, so it is emitted in
cls's kernel form and fused into `ClsAttentionScore` with int8=1 wherever a target spells it (ort;
orin and xavier as their VlmpClsScore plugin), with cls's rules: the decision in INT8, the
contextual merge, its keys and values as they are. Not with --score probe.

Without [CLS] (SigLIP), `--score probe` ranks the dominant tokens by the probe score of the
tower's attention-pooling head instead (passes.methods.probe); the contextual merge is
unchanged: it never needed [CLS], only block L's keys of the patch tokens (all tokens there).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import NORM_EPS, PruneRecord
from vlmprune.compiler.errors import InputError
import vlmprune.passes.methods.attention as attention
import vlmprune.passes.methods.probe as probe
from vlmprune.passes.methods.base import BLOCK, BY_SCORE, FusedOp, GraphInputs, Method, Needs, SiteTensors, \
    TorchResult, int8_scorer
from vlmprune.passes.methods.cls import CLS_SCORE, ClsScoreFusion, check_scorer_prefix, emit_kernel_scores
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, pruned_mask, select_topk, split_prefix


def contextual_default(keep: int) -> int:
    return round(10 * keep / 64)


def target_positions(remaining: int, contextual: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the targets, positions of the others) in the ascending list of remaining tokens."""
    step = max(1, remaining // contextual)
    targets = np.arange(0, remaining, step, dtype=np.int64)[:contextual]
    others = np.setdiff1d(np.arange(remaining, dtype=np.int64), targets)
    return targets, others


def n_rows(inputs: SiteTensors) -> int:
    return inputs.hidden.shape[0]


def assignment_margins(similarity: torch.Tensor) -> torch.Tensor:
    """Per contextual token [B, K_c], how close any of its merges came to going elsewhere.

    For every remaining token, the margin between its most and second most similar
    target (relative to the larger); a contextual token gets the smallest margin of the
    tokens that chose it or had it as runner-up. Parity leaves out the contextual tokens
    whose margin lies in the tie band: a lower precision may merge there differently.
    """
    top = torch.topk(similarity, min(2, similarity.shape[-1]), dim=-1)
    b, _, k_c = similarity.shape
    if k_c == 1:
        return torch.full((b, 1), float("inf"), dtype=similarity.dtype)
    margin = (top.values[..., 0] - top.values[..., 1]) / top.values[..., 0].abs().clamp_min(NORM_EPS)
    rows = torch.full((b, k_c), float("inf"), dtype=similarity.dtype)
    for rank in range(2):
        rows = rows.scatter_reduce(1, top.indices[..., rank], margin, reduce="amin")
    return rows


class VisionZipMethod(Method):
    name = "visionzip"
    summary = "VisionZip: K_d dominant tokens by [CLS] attention + K_c contextual tokens merged by key similarity"
    selection = BY_SCORE
    options = {"contextual": (int, "visionzip: contextual tokens K_c of the K (default round(10·K/64), the official ratio)"),
               "score": (str, f"visionzip: {probe.SCORE_HELP}")}
    choices = {"score": probe.SCORES}
    official = "https://github.com/dvlab-research/VisionZip"
    # Measured under rknn-toolkit2 2.5.0's hybrid int8 (targets.rk3588), which quantises the merge.
    int8_loss = "its contextual merge loses its values in int8 (cosine 0.938 on demo, against 0.99 required)"
    no_local_merge_why = ("its contextual tokens take every pruned token already, so none is left to merge locally; "
                          "with --contextual 0 it is cls's selection: use cls --merge local")

    def defaults(self, keep: int) -> dict:
        return {"contextual": contextual_default(keep)}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        contextual = params["contextual"]
        if isinstance(contextual, bool) or not isinstance(contextual, int) or not 0 <= contextual < keep:
            raise InputError(f"--contextual of method visionzip must be an integer with 0 <= contextual < keep "
                             f"({keep}), got {contextual!r}")
        params["dominant"] = keep - contextual
        if "score" in params:  # absent: [CLS] attention
            params["score"] = probe.parse_score(self.name, params["score"])
        return params

    def needs(self, params: dict) -> Needs:
        by_cls = params.get("score", "cls") == "cls"
        return Needs(site=BLOCK, cls=by_cls, attention=True, head=not by_cls)

    def serves(self) -> tuple:
        return (*super().serves(), probe.PROBE_SERVES)

    def copied_rows(self, params: dict) -> int:
        return params["dominant"]

    def scores_by_cls_kernel(self, params: dict) -> bool:
        return params.get("score", "cls") == "cls"  # the dominant TopK ranks the kernel's A itself

    def check(self, params: dict, spec) -> None:
        super().check(params, spec)
        check_scorer_prefix(params, spec)

    def describe(self, params: dict) -> str:
        by = " (by probe attention)" if params.get("score") == "probe" else \
            " (INT8 scorer)" if int8_scorer(params) else ""
        return f"VisionZip: {params['dominant']} dominant{by} + {params['contextual']} contextual tokens"

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        k_d, k_c = params["dominant"], params["contextual"]
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        n = patches.shape[1]
        if params.get("score") == "probe":
            attn = probe.probe_attention(inputs.hidden, inputs.head, inputs.prefix)
        else:
            attn = attention.cls_attention(inputs.q, inputs.k, inputs.scale, inputs.prefix)
        dominant = select_topk(attn, k_d)
        parts = [*cls, gather_rows(patches, dominant)]
        kept = [dominant]
        if k_c:
            keys = inputs.k.mean(dim=1)[:, inputs.prefix:]  # [B, N, dh]
            keys = keys / keys.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
            # Remaining patches in ascending order: a stable sort of the mask keeps index order.
            remaining = torch.sort(pruned_mask(dominant, n), dim=-1, descending=True, stable=True).indices[:, : n - k_d]
            t_pos, o_pos = (torch.from_numpy(p) for p in target_positions(n - k_d, k_c))
            targets, others = remaining[:, t_pos], remaining[:, o_pos]
            similarity = gather_rows(keys, others) @ gather_rows(keys, targets).transpose(1, 2)
            assign = torch.nn.functional.one_hot(similarity.argmax(dim=-1), k_c).to(patches.dtype)  # [B, R-K_c, K_c]
            counts = assign.sum(dim=1).clamp_min(1).unsqueeze(-1)
            merged = assign.transpose(1, 2) @ gather_rows(patches, others) / counts
            parts.append(gather_rows(patches, targets) + merged)
            kept.append(targets)
            margins = [torch.full((n_rows(inputs), k_d), float("inf"), dtype=similarity.dtype), assignment_margins(similarity)]
        else:
            margins = [torch.full((n_rows(inputs), k_d), float("inf"))]
        if inputs.prefix:
            margins.insert(0, torch.full((n_rows(inputs), inputs.prefix), float("inf"), dtype=margins[0].dtype))
        return TorchResult(torch.cat(parts, dim=1), torch.cat(kept, dim=1),
                           {"scores": attn, "boundary": k_d, "row_margins": torch.cat(margins, dim=1)})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        k_d, k_c, n = params["dominant"], params["contextual"], inputs.num_patches
        if params.get("score") == "probe":
            attn = probe.emit_probe_attention(b, inputs.hidden, inputs.head, inputs.prefix)
        elif int8_scorer(params):  # the form ClsScoreFusion turns into the INT8 kernel (cls.py)
            attn = emit_kernel_scores(b, inputs.block, inputs.prefix)
        else:
            attn = attention.emit_cls_attention(b, inputs.block, inputs.prefix)
        with b.role(SELECT):
            k = b.ints("k_dominant", [k_d])
            _, top = b.op("TopK", [attn, k], "topk_dominant", num_outputs=2, axis=-1, largest=1, sorted=1)
            dominant = b.sort_ascending(top, k_d, "dominant")
        with b.role(TOKENS):
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches")
            parts = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []  # no empty slice
            parts.append(b.gather_rows(patches, dominant, "gather_dominant"))
        kept = [dominant]
        if k_c:
            targets, others = self._remaining(b, attn, dominant, n, k_d, k_c)
            keys = self._keys(b, inputs.block, inputs.prefix)
            with b.role(SELECT):  # the assignment is discrete: it stays with the selection's precision
                similarity = b.op("MatMul", [b.gather_rows(keys, others, "keys_others"),
                                             b.op("Transpose", [b.gather_rows(keys, targets, "keys_targets")],
                                                  "keys_targets_t", perm=[0, 2, 1])], "similarity")
                assign = b.op("ArgMax", [similarity], "assign", axis=-1, keepdims=0, select_last_index=0)
            with b.role(TOKENS):
                dtype = inputs.hidden.dtype or ir.DataType.FLOAT
                onehot = b.op("Cast", [b.op("Equal", [b.unsqueeze(assign, [-1], "assign_col"),
                                                      b.const("target_ids", np.arange(k_c, dtype=np.int64)[None, None])],
                                            "assign_eq")], "assign_onehot", to=dtype)
                counts = b.op("Max", [b.reduce("ReduceSum", onehot, [1], 1, "counts_raw"),
                                      b.const("one", np.array(1.0, dtype=dtype.numpy()))], "counts")  # [B, 1, K_c]
                summed = b.op("MatMul", [b.op("Transpose", [onehot], "onehot_t", perm=[0, 2, 1]),
                                         b.gather_rows(patches, others, "gather_others")], "merged_sum")
                merged = b.op("Div", [summed, b.op("Transpose", [counts], "counts_t", perm=[0, 2, 1])], "merged")
                parts.append(b.op("Add", [b.gather_rows(patches, targets, "gather_targets"), merged], "contextual"))
            kept.append(targets)
        with b.role(TOKENS):
            tokens = b.op("Concat", parts, "tokens", axis=1)
        with b.role(SELECT):
            kept_all = b.op("Concat", kept, "kept", axis=1) if len(kept) > 1 else dominant
        return tokens, kept_all

    def fusion_rules(self, spellings: dict[str, FusedOp], record: PruneRecord | None = None) -> list:
        """--scorer int8: the dominant score in cls's ClsAttentionScore kernel (its rules; one [CLS], no registers)."""
        scorer = spellings.get(CLS_SCORE)
        params = record.params if record is not None else {}
        if scorer is None or not int8_scorer(params) or record is not None and record.prefix != 1:
            return []
        return [ClsScoreFusion.rule(scorer, transposed, axes_input) for transposed in (True, False)
                for axes_input in (True, False)]

    @staticmethod
    def _remaining(b, attn: ir.Value, dominant: ir.Value, n: int, k_d: int, k_c: int) -> tuple[ir.Value, ir.Value]:
        """Targets and others among the patches not kept as dominant, in ascending order."""
        with b.role(SELECT):
            ones = b.op("ConstantOfShape", [b.op("Shape", [attn], "attn_shape")], "ones",
                        value=ir.tensor(np.ones([1], np.float32)))
            zeros = b.op("ConstantOfShape", [b.op("Shape", [dominant], "dominant_shape")], "zeros",
                         value=ir.tensor(np.zeros([1], np.float32)))
            remaining = b.op("ScatterElements", [ones, dominant, zeros], "remaining_mask", axis=1)
            # Remaining patches rank above dominant ones, lower indices first: key = mask * N - index
            # (exact in float32 for N < 2^24).
            order = b.op("Sub", [b.op("Mul", [remaining, b.scalar("n", float(n))], "mask_n"),
                                 b.const("positions", np.arange(n, dtype=np.float32)[None])], "remaining_key")
            _, ascending = b.op("TopK", [order, b.ints("k_remaining", [n - k_d])], "remaining", num_outputs=2,
                                axis=-1, largest=1, sorted=1)
            t_pos, o_pos = target_positions(n - k_d, k_c)
            targets = b.op("Gather", [ascending, b.const("target_positions", t_pos)], "targets", axis=1)
            others = b.op("Gather", [ascending, b.const("other_positions", o_pos)], "others", axis=1)
        return targets, others

    @staticmethod
    def _keys(b, block, prefix: int) -> ir.Value:
        """Block L's keys of the patch tokens, mean over heads, L2-normalised: [B, N, dh]."""
        with b.role(SCORE):
            mean = b.reduce("ReduceMean", block.k, [1], 0, "keys_mean")  # [B, dh, T] or [B, T, dh]
            if block.k_transposed:
                mean = b.op("Transpose", [mean], "keys_mean_t", perm=[0, 2, 1])
            keys = b.slice(mean, prefix, INT64_MAX, 1, "keys_patches")
            return b.l2_normalize(keys, "keys_n")
