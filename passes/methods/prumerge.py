"""`prumerge+`: PruMerge+ (42Shawn/LLaVA-PruMerge), a K that varies per image.

At block L (default: the feature layer), from that block's own attention and keys:

1. Score: A_i, the recomputed [CLS] row of block L's attention, mean over heads
   (passes.methods.attention), over the N patch keys.
2. Outliers: the patches with A_i > Q3 + 1.5 · (Q3 - Q1), the quartiles of that image's
   A (linear interpolation between order statistics, numpy's default percentile). Their
   count m decides the image's budget.
3. Spatially uniform extra samples (the "+" of PruMerge+): every patch index i < N - 1 with
   i mod s = 0, s = max(1, (N // max(m, 1)) // 3). Kept set = outliers ∪ samples.
4. Merge: each kept token x_i += Σ_j A_j · x_j over its 32 nearest other tokens j (kept or
   not, itself excluded) by the cosine of block L's keys (the key projection output, all
   heads concatenated, as the official hook on k_proj reads it).
5. The extra token (the official `extra_one_token`): e = Σ_{j pruned} A_j · x_j, the
   attention-weighted sum of the N - K_b tokens not kept (unmerged, at block L), one row
   after the image's K_b merged tokens. Every image has one: K_max < N leaves at least one
   token pruned.

The count K_b = |kept set| varies per image. A static graph cannot have a per-image row
count, so the output is padded (the seam of passes.prune and passes.outputs):
image_features [B, (prefix +) K_max + 1, D] holding each image's K_b merged tokens in
ascending patch order, then its extra token, then zero rows; `num_tokens` [B] int64, the
valid rows of each image (K_b + 1, plus a prefix the output keeps); kept_indices [B, K_max]
with -1 in the padded slots (the extra token is no patch: it has no slot there). K_max is
`--keep`. Where the kept set is larger than K_max, the K_max best-scoring of it are kept
(outliers first: they out-score every non-outlier), and the ones cut go to the extra token.
The whole selection is static-shaped: the mask is built by comparisons, the count by
ReduceSum, the order by TopK over a key that puts padding last, the extra token's row by
an Equal against the count; no Loop, no NonZero, so every target takes it.

Where the score is not the official one (the issue's contract: one [CLS] score for cls,
visionzip and prumerge+): the official attention is ONE softmax over the concatenated
q_proj / k_proj outputs (all heads as one, scale C^-0.5 with C the hidden width, 1024 on
CLIP-L) of `layers[23]`, CLIP-L's last block, which runs after the feature layer
(hidden_states[-2], that block's input); its keys also give the merge's cosines. Here
both come from block L itself, the block whose output is the features: the score is its
per-head [CLS] row, mean over heads, with the block's own scale, and the keys are its
k_proj output.

Choices where the official code is batch-1 only or silent (listed in docs/design.md too):
- per image: the official `outlier_dectection` flattens the whole batch's scores into one
  IQR, so one image's kept set depends on the others; here the quartiles are per image;
- the official ratio m/N and its step int(1/ratio) are floats: here s = (N // m) // 3 in
  integers (the float form may floor 2.9999 to 2);
- no outlier (m = 0) divides by zero in the official code; here m counts as 1;
- s is floored at 1 (the official arange fails at a step of 0); it cannot be reached, as the IQR
  fence leaves at most a quarter of the patches above it (N // m >= 4);
- the official samples arange(0, 575, s), hard-coded for 576 patches: here range(0, N - 1, s);
- the official appends the samples after the TopK order (not raster order) and may hand
  the LLM a sample twice where torch's `not in` over a tensor misses; here the kept set is
  a set, in ascending (raster) order;
- ties: the kept set is a threshold, not a TopK; the 32 nearest go to the lower index on
  equal cosines; truncation to K_max goes by score, ties to the lower index;
- fewer than 33 patches: the merge takes the N - 1 others;
- keys are L2-normalised by max(‖k‖, 1e-12) (the official F.normalize's eps);
- [CLS] follows the model's select strategy (LLaVA's default drops it); never counted in K.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import NORM_EPS
import vlmprune.passes.methods.attention as attention
from vlmprune.passes.methods.base import BLOCK, BY_SCORE, GraphInputs, Method, Needs, SiteTensors, TorchResult, \
    positive_int
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, split_prefix, topk_lower_index

NEIGHBOURS = 32  # the official merge's cluster size
IQR_FACTOR = 1.5


def neighbours(n: int) -> int:
    return min(NEIGHBOURS, n - 1)


def keep_mask(attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept set [B, N] bool, outliers [B, N] bool) of PruMerge+: IQR outliers ∪ uniform samples, per image."""
    n = attn.shape[-1]
    q1, q3 = torch.quantile(attn, torch.tensor([0.25, 0.75], dtype=attn.dtype), dim=-1, keepdim=True)
    outliers = attn > q3 + IQR_FACTOR * (q3 - q1)
    m = outliers.sum(dim=-1, keepdim=True).clamp_min(1)
    step = ((n // m) // 3).clamp_min(1)
    index = torch.arange(n)
    samples = (index % step == 0) & (index < n - 1)
    return outliers | samples, outliers


def padded_selection(scores: torch.Tensor, mask: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [B, k_max] ascending with -1 padding, count [B]): the masked patches, at most k_max by score."""
    n = scores.shape[-1]
    ranked = topk_lower_index(torch.where(mask, scores, torch.full_like(scores, -1.0)), k_max)
    count = mask.sum(dim=-1).clamp_max(k_max)
    valid = torch.arange(k_max) < count.unsqueeze(-1)
    ascending = torch.where(valid, ranked, torch.full_like(ranked, n)).sort(dim=-1).values
    return torch.where(valid, ascending, torch.full_like(ascending, -1)), count


def pruned_sum(attn: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The extra token's weights [B, 1, N]: A_j for the tokens not kept, 0 for the kept ones (official
    `extra_one_token` = Σ over the pruned of x_j · A_j)."""
    hit = (torch.arange(attn.shape[-1]) == safe.unsqueeze(-1)) & valid.unsqueeze(-1)  # [B, K_max, N]
    return torch.where(hit.any(dim=1), torch.zeros_like(attn), attn).unsqueeze(1)


def sort_padded(b, valid: ir.Value, ranked: ir.Value, n: int, k_max: int, name: str) -> ir.Value:
    """The valid slots' indices [B, k_max] in ascending order, the padded ones (as N) after them.

    Sorted as float32 (exact for N < 2^24): TensorRT 8.5 sorts no integers, and a Where-padded index has no bound
    its legaliser can prove."""
    key = b.op("Where", [valid, b.op("Cast", [ranked], f"{name}_f", to=ir.DataType.FLOAT),
                         b.scalar(f"{name}_pad", float(n))], f"{name}_key")
    ordered, _ = b.op("TopK", [key, b.ints(f"{name}_k", [k_max])], f"{name}_sort", num_outputs=2, axis=-1,
                      largest=0, sorted=1)
    return b.op("Cast", [ordered], name, to=ir.DataType.INT64)


class PruMergePlusMethod(Method):
    name = "prumerge+"
    summary = ("PruMerge+: IQR outliers of [CLS] attention + uniform samples, each merged with its 32 nearest by key, "
               "+ 1 extra token (the pruned, attention-weighted); K varies per image (padded to --keep, num_tokens)")
    selection = BY_SCORE
    official = "https://github.com/42Shawn/LLaVA-PruMerge"
    version = 2  # 2: the extra token (the attention-weighted sum of the pruned tokens) after the merged ones
    variable_k = True
    # Measured under rknn-toolkit2 2.5.0's hybrid int8 (targets.rk3588), which quantises the merge.
    int8_loss = "its merge loses its values in int8 (cosine -0.009 on the tiny test LLaVA, against 0.99 required)"

    def needs(self, params: dict) -> Needs:
        return Needs(site=BLOCK, cls=True, attention=True)

    def copied_rows(self, params: dict) -> int:
        return 0  # every kept row is merged

    def output_tokens(self, params: dict) -> int:
        return params["keep"] + 1  # K_max merged rows (K_b valid) + the extra token

    def describe(self, params: dict) -> str:
        return (f"PruMerge+: IQR outliers + uniform samples, merged with their {NEIGHBOURS} nearest by key, + 1 "
                f"extra token (the attention-weighted sum of the pruned); K per image, at most {params['keep']} "
                "(num_tokens)")

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        k_max = positive_int(self.name, "keep", params["keep"])
        cls, patches = split_prefix(inputs.hidden, inputs.prefix)
        attn = attention.cls_attention(inputs.q, inputs.k, inputs.scale, inputs.prefix)
        mask, _ = keep_mask(attn)
        kept, count = padded_selection(attn, mask, k_max)
        valid = kept >= 0
        safe = kept.clamp_min(0)
        b, h, t, dh = inputs.k.shape
        keys = inputs.k.transpose(1, 2).reshape(b, t, h * dh)[:, inputs.prefix:]
        keys = keys / keys.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
        similarity = gather_rows(keys, safe) @ keys.transpose(1, 2)  # [B, K_max, N]
        self_hit = torch.arange(patches.shape[1]) == safe.unsqueeze(-1)
        similarity = similarity.masked_fill(self_hit, -3.0)  # below any cosine: never its own neighbour
        near = topk_lower_index(similarity, neighbours(patches.shape[1]))  # [B, K_max, 32]
        weights = torch.zeros_like(similarity).scatter(2, near, attn.unsqueeze(1).expand_as(similarity).gather(2, near))
        merged = (gather_rows(patches, safe) + weights.to(patches.dtype) @ patches) * valid.unsqueeze(-1)
        extra = pruned_sum(attn, safe, valid).to(patches.dtype) @ patches  # [B, 1, D]
        at = (torch.arange(k_max + 1) == count.unsqueeze(-1)).to(patches.dtype).unsqueeze(-1)  # row K_b
        rows = torch.cat([merged, torch.zeros_like(merged[:, :1])], dim=1) + at * extra
        return TorchResult(torch.cat([*cls, rows], dim=1), kept,
                           {"scores": attn, "boundary": k_max, "num_tokens": count + 1, "keep": count, "mask": mask})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str):
        k_max, n = params["keep"], inputs.num_patches
        attn = attention.emit_cls_attention(b, inputs.block, inputs.prefix)  # [B, N]
        with b.role(SELECT):
            mask = self._mask(b, attn, n)
            ranked_key = b.op("Where", [mask, attn, b.scalar("minus_one", -1.0)], "ranked_key")
            _, ranked = b.op("TopK", [ranked_key, b.ints("k_max", [k_max])], "ranked", num_outputs=2, axis=-1,
                             largest=1, sorted=1)
            mask_count = b.reduce("ReduceSum", b.op("Cast", [mask], "mask_f", to=ir.DataType.FLOAT), [1], 1,
                                  "mask_count")
            count_col = b.op("Cast", [b.op("Min", [mask_count, b.scalar("k_max_f", float(k_max))], "count_f")],
                             "count_col", to=ir.DataType.INT64)  # [B, 1]
            slots = b.const("slots", np.arange(k_max, dtype=np.int64)[None])
            valid = b.op("Less", [slots, count_col], "valid")  # [B, K_max]
            # The valid rows: K_b merged + the extra token (the Add at rank 2, as HTP casts int64 there).
            num_tokens = b.squeeze(b.op("Add", [count_col, b.ints("extra_row", 1)], "rows_col"), [1], "num_tokens")
            ascending = sort_padded(b, valid, ranked, n, k_max, "ascending")
            kept = b.op("Where", [valid, ascending, b.ints("minus_one_index", -1)], "kept")
            safe = b.op("Where", [valid, ascending, b.ints("zero_index", 0)], "safe")
            hit = b.op("And", [b.op("Equal", [b.unsqueeze(safe, [-1], "safe_hit_col"),
                                              b.const("hit_ids", np.arange(n, dtype=np.int64)[None, None])],
                                    "hit_all"), b.unsqueeze(valid, [-1], "valid_hit")], "hit")  # [B, K_max, N]
            kept_mask = b.reduce("ReduceMax", b.op("Cast", [hit], "hit_f", to=ir.DataType.FLOAT), [1], 0,
                                 "kept_mask")  # [B, N], 1 where kept
        keys = self._keys(b, inputs.block, inputs.prefix)
        with b.role(SELECT):  # which 32 neighbours: discrete, stays with the selection's precision
            similarity = b.op("MatMul", [b.gather_rows(keys, safe, "keys_kept"),
                                         b.op("Transpose", [keys], "keys_t", perm=[0, 2, 1])], "similarity")
            self_hit = b.op("Equal", [b.unsqueeze(safe, [-1], "safe_col"),
                                      b.const("patch_ids", np.arange(n, dtype=np.int64)[None, None])], "self_hit")
            similarity = b.op("Where", [self_hit, b.scalar("below_cosine", -3.0), similarity], "similarity_others")
            _, near = b.op("TopK", [similarity, b.ints("k_near", [neighbours(n)])], "near", num_outputs=2, axis=-1,
                           largest=1, sorted=1)  # [B, K_max, 32]
        with b.role(TOKENS):
            dtype = inputs.hidden.dtype or ir.DataType.FLOAT
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches")
            attn_rows = b.op("Expand", [b.unsqueeze(attn, [1], "attn_row"), b.op("Shape", [similarity], "sim_shape")],
                             "attn_rows")  # [B, K_max, N]
            weights = b.op("ScatterElements", [b.op("Mul", [attn_rows, b.scalar("zero", 0.0)], "zeros"), near,
                                               b.op("GatherElements", [attn_rows, near], "near_attn", axis=2)],
                           "weights", axis=2)
            if dtype != ir.DataType.FLOAT:
                weights = b.op("Cast", [weights], "weights_cast", to=dtype)
            merged = b.op("Add", [b.gather_rows(patches, safe, "gather_kept"),
                                  b.op("MatMul", [weights, patches], "merged_sum")], "merged")
            rows = b.op("Cast", [b.unsqueeze(valid, [-1], "valid_col")], "valid_rows", to=dtype)
            tokens = b.op("Mul", [merged, rows], "merged_padded")
            tokens = self._extra_row(b, tokens, attn, kept_mask, patches, count_col, k_max, dtype)
            if inputs.prefix:
                tokens = b.op("Concat", [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls"), tokens], "tokens", axis=1)
        return tokens, kept, num_tokens

    @staticmethod
    def _extra_row(b, tokens, attn, kept_mask, patches, count_col, k_max: int, dtype) -> ir.Value:
        """[B, K_max + 1, D]: the merged rows, with the extra token Σ_{j pruned} A_j · x_j at row K_b (pruned_sum)."""
        pruned_w = b.op("Mul", [attn, b.op("Sub", [b.scalar("one", 1.0), kept_mask], "pruned_mask")],
                        "pruned_attn")  # [B, N]
        if dtype != ir.DataType.FLOAT:
            pruned_w = b.op("Cast", [pruned_w], "pruned_attn_cast", to=dtype)
        extra = b.op("MatMul", [b.unsqueeze(pruned_w, [1], "pruned_row"), patches], "extra_token")  # [B, 1, D]
        at = b.op("Equal", [b.const("row_ids", np.arange(k_max + 1, dtype=np.int64)[None]), count_col], "extra_at")
        at = b.op("Cast", [b.unsqueeze(at, [-1], "extra_at_col")], "extra_at_f", to=dtype)  # [B, K_max + 1, 1]
        pad_row = b.op("Mul", [b.slice(tokens, 0, 1, 1, "first_row"), b.scalar("zero_row", 0.0, dtype.numpy())],
                       "pad_row")
        padded = b.op("Concat", [tokens, pad_row], "rows_plus_one", axis=1)
        return b.op("Add", [padded, b.op("Mul", [at, extra], "extra_placed")], "rows_with_extra")

    @staticmethod
    def _mask(b, attn: ir.Value, n: int) -> ir.Value:
        """The kept set [B, N] bool: IQR outliers of attn per image ∪ the uniform samples (keep_mask)."""
        ordered, _ = b.op("TopK", [attn, b.ints("n_all", [n])], "ordered", num_outputs=2, axis=-1, largest=0,
                          sorted=1)

        def quantile(q: float, name: str) -> ir.Value:
            pos = q * (n - 1)
            lo, hi = int(np.floor(pos)), int(np.ceil(pos))
            below = b.op("Gather", [ordered, b.ints(f"{name}_lo", [lo])], f"{name}_below", axis=1)
            above = b.op("Gather", [ordered, b.ints(f"{name}_hi", [hi])], f"{name}_above", axis=1)
            step = b.op("Sub", [above, below], f"{name}_gap")
            return b.op("Add", [below, b.op("Mul", [step, b.scalar(f"{name}_frac", pos - lo)], f"{name}_part")], name)

        q1, q3 = quantile(0.25, "q1"), quantile(0.75, "q3")  # [B, 1]
        bound = b.op("Add", [q3, b.op("Mul", [b.op("Sub", [q3, q1], "iqr"), b.scalar("iqr_factor", IQR_FACTOR)],
                                      "iqr_scaled")], "upper_bound")
        outliers = b.op("Greater", [attn, bound], "outliers")
        # Integer arithmetic in float32, exact for N < 2^24 (a floor of a/b cannot round across an integer there):
        # TensorRT 8.5 sums, divides and takes remainders of floats only.
        m = b.op("Max", [b.reduce("ReduceSum", b.op("Cast", [outliers], "outliers_f", to=ir.DataType.FLOAT), [1], 1,
                                  "outlier_count"), b.scalar("one_count", 1.0)], "outliers_at_least_one")  # [B, 1]
        n_over_m = b.op("Floor", [b.op("Div", [b.scalar("n_count", float(n)), m], "n_over_m_raw")], "n_over_m")
        step = b.op("Max", [b.op("Floor", [b.op("Div", [n_over_m, b.scalar("three", 3.0)], "step_raw")], "step_floor"),
                            b.scalar("one_step", 1.0)], "step")
        index = b.const("index", np.arange(n, dtype=np.float32)[None])
        multiple = b.op("Mul", [b.op("Floor", [b.op("Div", [index, step], "index_over_step")], "index_quot"), step],
                        "index_multiple")
        on_grid = b.op("Equal", [multiple, index], "on_grid")
        samples = b.op("And", [on_grid, b.const("below_last", (np.arange(n) < n - 1)[None])], "samples")
        return b.op("Or", [outliers, samples], "kept_set")

    @staticmethod
    def _keys(b, block, prefix: int) -> ir.Value:
        """Block L's keys of the patch tokens, heads concatenated ([B, N, H·dh]), L2-normalised."""
        with b.role(SCORE):
            perm = [0, 3, 1, 2] if block.k_transposed else [0, 2, 1, 3]  # -> [B, T, H, dh]
            keys = b.op("Transpose", [block.k], "keys_bthd", perm=perm)
            keys = b.op("Reshape", [keys, b.ints("keys_shape", [0, 0, -1])], "keys_concat")
            keys = b.slice(keys, prefix, INT64_MAX, 1, "keys_patches")
            return b.l2_normalize(keys, "keys_n")
