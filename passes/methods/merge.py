"""Local merging (`--merge local --width W`): pruned tokens merge into a kept neighbour, not into the summary.

Local clustering, as one post-selection step any selection method can call
(its reference and its emission), driven by options the base class parses (GENERIC):

- Neighbourhood: patch i's W×W window of the patch grid, centred on it: every patch j with
  |row_i - row_j| <= (W-1)/2 and |col_i - col_j| <= (W-1)/2. W is odd and >= 3 (default 3).
- Similarity: key cosine. At a BLOCK site the keys are block L's key projection averaged
  over heads (as visionzip's contextual merge reads them), L2-normalised with the norm
  floored at 1e-12; at a FEATURES site there is no block to read keys from, so the tokens
  themselves are the keys (the projector output the LLM reads: what DivPrune and DART
  compare too).
- Assignment: each pruned token joins the kept token of its window with the highest key
  cosine; equal cosines go to the lower kept index (ArgMax's first occurrence over the kept
  set in raster order, in torch and ONNX alike).
- "Merged into": a kept token becomes the unweighted mean of itself and the tokens that
  joined it, (x_k + Σ x_j) / (1 + n_k), as ToMe's and PruMerge's clustering average
  (each token of size 1). Not the sum, nor VisionZip's target + mean of the joined: both
  grow a token's norm with its cluster (up to W² - 1 members), while the mean stays on the
  scale of the tokens the later blocks' LayerNorms and the projector were trained on; the
  merged token is a better-sampled version of its own region, not a louder one.
- The summary: tokens with no kept token in their window go to the one summary token, the
  unweighted mean of those orphans. An image where every pruned token found a neighbour has
  no orphan: its summary is then the mean of all pruned tokens (the unmerged summary), so
  the output keeps its static shape and the token is never a zero row the LLM has not seen.

Output: [prefix] + K merged tokens (raster order of the kept patches) + 1 summary;
kept_indices unchanged (each merged token sits at its kept patch's position). A method
without a summary token of its own (divprune, dart, random, grid) gains this one, so its
output is K + 1 tokens (Method.output_tokens) and its manifest says so (Method.describe).

Applied after any method's selection, by the base class: a method declares
Method.local_merge when its output is [prefix] + the site's rows at its kept indices
(ascending) + at most one summary token, and passes.methods.base wraps its reference and
emission (Method.__init_subclass__) so that, with --merge local, the output is this
step's, computed from the site's tokens, its keys and the method's kept indices
(merged_reference, merged_emission). The method's own token rows are then unused: in the
graph RemoveUnusedNodesPass drops them (every target's pipeline runs it), as it drops
AdaptiveBudget's.

The grid comes from the site: the pixel input's patch grid (SiteTensors.pixel_values and
patch_size; the graph's TowerStructure.grid), else a square N. Refused in one line:
Qwen2-VL's merged tokens (spec.merge >= 2: a 2×2-merged, per-image grid), LLaVA-NeXT's
crops (the budget spans several grids), a non-square N without a known grid, and methods
that do not declare it (Method.local_merge; each says why in no_local_merge_why: visionzip's
contextual tokens take every pruned token already).

Parity: merged tokens are values, compared with the fp32/fp16 tolerances; the trace's
row_margins say, per merged token, how close any of its merges came to going to another
kept neighbour, so a lower precision that merges a near-tie differently is reported, not
failed (as visionzip's contextual tokens).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import NORM_EPS, SITE_BLOCK as BLOCK
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, pruned_mask

LOCAL = "local"
DEFAULT_WIDTH = 3
# Below every cosine (>= -1): the similarity of a kept token outside the window. A finite value, since an
# infinity breaks int8 calibration on the quantised targets (as dart and divprune avoid it).
OUTSIDE = -3.0

# Measured under rknn-toolkit2 2.5.0's hybrid int8 (targets.rk3588), which quantises the merge: its fp16 mode holds.
INT8_LOSS = "--merge local's merged tokens lose their values in int8 (cosine 0.928 on the tiny LLaVA, against 0.99)"

GENERIC = {
    "merge": (str, "'local': each pruned token merges into the most similar kept token (key cosine) of its "
                   "W x W patch neighbourhood (--width), not into the summary (methods that take it: `vlmprune "
                   "methods`)"),
    "width": (int, "--merge local: the neighbourhood side W, odd and >= 3 (default 3)"),
}


def parse(method, params: dict) -> dict:
    """Check --merge / --width for `method` (a Method); params gains width when merging."""
    merge, width = params.get("merge"), params.get("width")
    if merge is None:
        if width is not None:
            raise InputError("--width sets the neighbourhood of --merge local; give --merge local with it")
        return params
    if merge != LOCAL:
        raise InputError(f"--merge must be 'local', got {merge!r}")
    if not method.local_merge:
        raise InputError(f"method {method.name} does not take --merge local "
                         f"({method.no_local_merge_why or 'it has no post-selection merge step'})")
    width = DEFAULT_WIDTH if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 3 or width % 2 == 0:
        raise InputError(f"--width must be an odd integer >= 3 (a W x W window centred on the patch), got {width!r}")
    params["width"] = width
    return params


def check(params: dict, spec) -> None:
    """Refuse a site whose tokens have no single patch grid to take neighbourhoods on."""
    if params.get("merge") != LOCAL:
        return
    if spec.frames > 1:
        raise InputError(f"--merge local needs one patch grid, and a clip's tokens are {spec.frames} frames' grids "
                         "(compile --video-frames)")
    if spec.merge is not None and spec.merge >= 2:
        raise InputError("--merge local needs one patch grid, and this tower's merged tokens (Qwen2-VL's 2x2 "
                         "merges, a grid per image) have none")
    if not spec.has_pixels and math.isqrt(spec.num_patches) ** 2 != spec.num_patches:
        raise InputError(f"--merge local needs the patch grid, and this graph shows none (no patch-embedding Conv) "
                         f"for its {spec.num_patches} tokens, not a square")


def describe(params: dict) -> str:
    """What --merge local adds to a method's one-line description (the manifest's and the CLI's)."""
    width = params["width"]
    return (f"; merged (--merge local, {width}x{width}): each pruned token into its most similar kept neighbour, "
            "those with none into 1 summary token")


def merged_reference(method, params: dict, inputs, result):
    """The method's TorchResult with its tokens replaced by local_merge's over its kept indices (module docstring)."""
    tokens, margins = local_merge(params, inputs, result.kept, method.needs(params).site == BLOCK)
    return dataclasses.replace(result, tokens=tokens, trace={**result.trace, "row_margins": margins})


def merged_emission(b, method, params: dict, inputs, emitted: tuple) -> tuple:
    """The method's (tokens, kept, ...) with the tokens replaced by emit_local_merge's over its kept indices."""
    _tokens, kept, *rest = emitted
    return (emit_local_merge(b, params, inputs, kept, method.needs(params).site == BLOCK), kept, *rest)


def refuse_crops() -> None:
    raise InputError("--merge local is not taken with LLaVA-NeXT's crops: one budget spans several patch grids")


def grid_for(n: int, grid: tuple[int, int] | None) -> tuple[int, int]:
    """The site's (rows, columns): the known grid where it holds n patches, else a square n."""
    if grid is not None and grid[0] * grid[1] == n:
        return int(grid[0]), int(grid[1])
    side = math.isqrt(n)
    if side * side != n:
        raise InputError(f"--merge local needs the patch grid of these {n} tokens, which is not known")
    return side, side


def coordinates(grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every patch in raster order, float32 (exact small integers)."""
    rows, cols = np.divmod(np.arange(grid[0] * grid[1]), grid[1])
    return rows.astype(np.float32), cols.astype(np.float32)


# ---------------------------------------------------------------------------- reference


def reference_grid(inputs, n: int) -> tuple[int, int]:
    if inputs.pixel_values is not None and inputs.patch_size:
        h, w = inputs.pixel_values.shape[-2:]
        return grid_for(n, (h // inputs.patch_size, w // inputs.patch_size))
    return grid_for(n, None)


def reference_keys(inputs, site_is_block: bool) -> torch.Tensor:
    """[B, N, d] L2-normalised keys of the patch tokens (module docstring)."""
    if site_is_block:
        keys = inputs.k.mean(dim=1)[:, inputs.prefix:]
    else:
        keys = inputs.hidden[:, inputs.prefix:]
    return keys / keys.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def local_merge(params: dict, inputs, kept: torch.Tensor, site_is_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, p+K+1, D], row_margins [B, p+K+1]) for the kept indices [B, K] (ascending), in plain torch."""
    prefix = inputs.prefix
    patches = inputs.hidden[:, prefix:]
    b, n, _ = patches.shape
    k = kept.shape[-1]
    rows, cols = (torch.from_numpy(c).to(patches.dtype) for c in coordinates(reference_grid(inputs, n)))
    half = (params["width"] - 1) // 2
    near = ((rows[None, :, None] - rows[kept][:, None, :]).abs() <= half) & \
           ((cols[None, :, None] - cols[kept][:, None, :]).abs() <= half)  # [B, N, K]
    pruned = pruned_mask(kept, n, patches.dtype)  # [B, N]
    valid = near & (pruned[:, :, None] > 0)
    keys = reference_keys(inputs, site_is_block).to(patches.dtype)
    similarity = torch.where(valid, keys @ gather_rows(keys, kept).transpose(1, 2),
                             torch.full((), OUTSIDE, dtype=patches.dtype))
    has = valid.any(dim=-1)  # [B, N]
    assign = torch.nn.functional.one_hot(similarity.argmax(dim=-1), k).to(patches.dtype) * has[..., None]
    counts = assign.sum(dim=1).unsqueeze(-1)  # [B, K, 1]
    merged = (gather_rows(patches, kept) + assign.transpose(1, 2) @ patches) / (1 + counts)
    orphans = pruned * (~has).to(patches.dtype)
    n_orphans = orphans.sum(dim=-1, keepdim=True)
    weights = torch.where(n_orphans > 0, orphans / n_orphans.clamp_min(1), pruned / (n - k))
    summary = weights.unsqueeze(1) @ patches
    tokens = torch.cat([inputs.hidden[:, :prefix], merged, summary], dim=1)
    inf = torch.full((b, prefix), float("inf"), dtype=patches.dtype)
    margins = torch.cat([inf, merge_margins(similarity, valid), torch.full((b, 1), float("inf"),
                                                                           dtype=patches.dtype)], dim=1)
    return tokens, margins


def merge_margins(similarity: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per kept token [B, K]: the smallest relative gap between the best and second-best kept neighbour of any
    token that chose it or had it as runner-up (inf where no token had two candidates)."""
    b, _, k = similarity.shape
    if k == 1:
        return torch.full((b, 1), float("inf"), dtype=similarity.dtype)
    top = torch.topk(similarity, 2, dim=-1)
    two = valid.sum(dim=-1) >= 2
    gap = (top.values[..., 0] - top.values[..., 1]) / top.values[..., 0].abs().clamp_min(NORM_EPS)
    gap = torch.where(two, gap, torch.full_like(gap, float("inf")))
    rows = torch.full((b, k), float("inf"), dtype=similarity.dtype)
    for rank in range(2):  # two ranks, not the batch
        rows = rows.scatter_reduce(1, top.indices[..., rank], gap, reduce="amin")
    return rows


# ---------------------------------------------------------------------------- emission


def emit_keys(b, inputs, site_is_block: bool) -> ir.Value:
    """[B, N, d] L2-normalised keys in the graph (module docstring)."""
    with b.role(SCORE):
        if site_is_block:
            block = inputs.block
            mean = b.reduce("ReduceMean", block.k, [1], 0, "merge_keys_mean")
            if block.k_transposed:
                mean = b.op("Transpose", [mean], "merge_keys_t", perm=[0, 2, 1])
            keys = b.slice(mean, inputs.prefix, INT64_MAX, 1, "merge_keys_patches")
        else:
            keys = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "merge_keys_patches")
        source = inputs.block.k if site_is_block else inputs.hidden
        if (source.dtype or ir.DataType.FLOAT) != ir.DataType.FLOAT:  # the assignment is decided in float32
            keys = b.op("Cast", [keys], "merge_keys_f", to=ir.DataType.FLOAT)
        return b.l2_normalize(keys, "merge_keys_n")


def emit_local_merge(b, params: dict, inputs, kept: ir.Value, site_is_block: bool) -> ir.Value:
    """tokens [B, p+K+1, D] from hidden [B, p+N, D] and kept [B, K] (ascending), in standard ops."""
    n, k, prefix = inputs.num_patches, params["keep"], inputs.prefix
    grid = grid_for(n, getattr(inputs.structure, "grid", None))
    dtype = inputs.hidden.dtype or ir.DataType.FLOAT
    np_dtype = dtype.numpy()
    keys = emit_keys(b, inputs, site_is_block)
    half = float((params["width"] - 1) // 2)
    with b.role(SELECT):  # the assignment is discrete: it stays with the selection's precision
        near = None
        for axis, coord in zip(("row", "col"), coordinates(grid)):
            mine = b.const(f"merge_{axis}s", coord.reshape(1, n, 1))
            theirs = b.unsqueeze(b.op("Gather", [b.const(f"merge_{axis}s_flat", coord), kept],
                                      f"merge_kept_{axis}s", axis=0), [1], f"merge_kept_{axis}s3")  # [B, 1, K]
            close = b.op("LessOrEqual", [b.op("Abs", [b.op("Sub", [mine, theirs], f"merge_d{axis}")],
                                              f"merge_abs_d{axis}"), b.scalar(f"merge_half_{axis}", half)],
                         f"merge_near_{axis}")
            near = close if near is None else b.op("And", [near, close], "merge_near")
        hit = b.op("Equal", [b.unsqueeze(kept, [1], "merge_kept_row"),
                             b.const("merge_positions", np.arange(n, dtype=np.int64).reshape(1, n, 1))],
                   "merge_hit")  # [B, N, K]: patch i is kept as the k-th
        is_kept = b.reduce("ReduceMax", b.op("Cast", [hit], "merge_hit_f", to=ir.DataType.FLOAT), [-1], 0,
                           "merge_is_kept")  # [B, N]
        pruned = b.op("Sub", [b.scalar("merge_one_f", 1.0), is_kept], "merge_pruned")  # [B, N] float32
        is_pruned = b.op("Greater", [b.unsqueeze(pruned, [-1], "merge_pruned3"), b.scalar("merge_zero", 0.0)],
                         "merge_is_pruned")
        valid = b.op("And", [near, is_pruned], "merge_valid")  # [B, N, K]
        kept_keys = b.op("Transpose", [b.gather_rows(keys, kept, "merge_kept_keys")], "merge_kept_keys_t",
                         perm=[0, 2, 1])
        cosine = b.op("MatMul", [keys, kept_keys], "merge_cosine")
        similarity = b.op("Where", [valid, cosine, b.scalar("merge_outside", OUTSIDE)],
                          "merge_similarity")
        assign = b.op("ArgMax", [similarity], "merge_assign", axis=-1, keepdims=0, select_last_index=0)
        has = b.op("Cast", [b.reduce("ReduceMax", b.op("Cast", [valid], "merge_valid_f", to=ir.DataType.FLOAT),
                                     [-1], 0, "merge_has_f")], "merge_has", to=dtype)  # [B, N]
    with b.role(TOKENS):
        patches = b.slice(inputs.hidden, prefix, INT64_MAX, 1, "merge_patches")
        ids = b.const("merge_ids", np.arange(k, dtype=np.int64)[None, None])
        onehot = b.op("Mul", [b.op("Cast", [b.op("Equal", [b.unsqueeze(assign, [-1], "merge_assign3"), ids],
                                                 "merge_eq")], "merge_onehot_raw", to=dtype),
                              b.unsqueeze(has, [-1], "merge_has3")], "merge_onehot")  # [B, N, K]
        onehot_t = b.op("Transpose", [onehot], "merge_onehot_t", perm=[0, 2, 1])  # [B, K, N]
        counts = b.reduce("ReduceSum", onehot_t, [-1], 1, "merge_counts")  # [B, K, 1]
        one = b.const("merge_one", np.array(1.0, dtype=np_dtype))
        summed = b.op("Add", [b.gather_rows(patches, kept, "merge_gather_kept"),
                              b.op("MatMul", [onehot_t, patches], "merge_sum")], "merge_total")
        merged = b.op("Div", [summed, b.op("Add", [counts, one], "merge_sizes")], "merged")
        pruned_t = b.op("Cast", [pruned], "merge_pruned_t", to=dtype)
        orphans = b.op("Mul", [pruned_t, b.op("Sub", [one, has], "merge_alone")], "merge_orphans")
        n_orphans = b.reduce("ReduceSum", orphans, [-1], 1, "merge_n_orphans")  # [B, 1]
        weights = b.op("Where", [b.op("Greater", [n_orphans, b.const("merge_zero_t", np.array(0, dtype=np_dtype))],
                                      "merge_any_orphan"),
                                 b.op("Div", [orphans, b.op("Max", [n_orphans, one], "merge_n_orphans1")],
                                      "merge_orphan_w"),
                                 b.op("Mul", [pruned_t, b.const("merge_inv_pruned",
                                                                np.array(1.0 / (n - k), dtype=np_dtype))],
                                      "merge_pruned_w")], "merge_summary_w")
        summary = b.op("MatMul", [b.unsqueeze(weights, [1], "merge_summary_w3"), patches], "merge_summary")
        cls = [b.slice(inputs.hidden, 0, prefix, 1, "merge_prefix")] if prefix else []
        return b.op("Concat", [*cls, merged, summary], "merge_tokens", axis=1)
