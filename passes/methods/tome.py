"""`tome`: Token Merging (ToMe, Bolya et al., ICLR 2023; facebookresearch/ToMe), training-free, in the graph.

Unlike the other methods ToMe does not act on block L's output alone: in every block of a range it
merges r tokens between the attention and the MLP, and from then on the attention of every later
block sees each token's size. Per block l, as the official timm patch does:

1. x = x + attn(norm1(x)), the attention logits + log(size) of each key token (proportional
   attention) once a merge has happened (size: how many patches a token stands for);
2. metric = the block's keys averaged over heads, L2-normalised; split by alternation into
   A = tokens 0, 2, 4, ... and B = tokens 1, 3, 5, ...; scores = A·Bᵀ; protected rows (and
   columns) score below every cosine: the [CLS] row as the official class_token=True;
3. per A token its best B partner (max, argmax); A ranked by that best score, descending;
   the first r are merged (src), the others stay (unm; with [CLS] ascending, as the official);
4. each src token is added into its partner: x and size merged as sums of x·size and size, then
   x = sum / size (the size-weighted mean); tokens = [unm, B] (the official order);
5. x = x + mlp(norm2(x)).

Schedule: `--keep K` is the final patch count, so N - K merges in all, spread over the blocks of
`--blocks A-B` (default every block the tower runs: the official constant r per block, parse_r
with no inflection) as evenly as possible: r = (N - K) // m per block, the first (N - K) % m
blocks of the range one more (front-loaded, where tokens are most numerous). Each block may
merge at most (t - p) // 2 of its t tokens (p protected), the official cap; where that cap
would bind in a later block, the earlier blocks take the fewest extra merges that keep the
rest within it (the official code would merge fewer there and miss K). A K beyond every
block merging at its cap is refused in one line naming the fewest reachable. r per block is
fixed at compile time, so every block's token count is a static constant (the exporter's baked
counts are rewritten block by block: passes.retarget).

Choices where the official code leaves it open or differs from the project's contract:
- ties: the ranking of A is a stable descending sort (equal best scores: the lower A index is
  merged first), the partner the first maximal B index (torch's max, ONNX ArgMax with
  select_last_index=0); the graph's TopK (largest, sorted) ranks equal values by the lower index,
  as the ONNX specification requires, so the reference and the graph break ties alike. The
  official argsort is not stable: on exact ties it may pick differently.
- output order: the official code leaves [unm, B]; here each token carries the patch index of
  the token it started as (a token that absorbs others keeps its own), and after block L the
  tokens are sorted by it: kept_indices [B, K] ascending and the tokens in raster order. Blocks
  after the last merge are permutation-equivariant, so this changes no value.
- protected tokens: [CLS] as the official class_token=True; DINOv2's register tokens too (the
  official code has none): their A rows and B columns score below every cosine, and they count
  in the per-block cap's p. A tower without [CLS] merges every token (class_token=False).
- the protected score is -3 (below every cosine), not -inf: the same ranking, and finite for
  targets that calibrate int8 ranges; metric rows are divided by max(||k||, 1e-12).
- [CLS] after the tower follows the model's select strategy (LLaVA's default drops it), as every
  method here.

Targets (tests/compiler/test_tome.py; the README's method x target table):
- ort: both graphs pass parity (rewritten and fused); the blocks that merge or take the size
  bias stay in standard ops (MultiHeadAttention's fusion matches only the plain form).
- orin, xavier: the same standard-op graph (TopK, GatherElements, GatherND, one-hot MatMul; the final
  integer sort as float, its bound proven from the constant positions); ORT parity passes, no engine built.
- rk3588: refused (float32_only): every op converts (84 of 366 on its CPU), but in fp16 the merges flip
  and cascade (demo, K = 192: kept-index agreement 0.80, cosine -0.50; hybrid int8 0.78).
- qnn: refused (float32_only): all ops on HTP, but under 16-bit QDQ the same (agreement 0.80, cosine -0.51).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import FEATURE_LAYER, NORM_EPS, TOKENS_META
from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.passes.methods.base import BLOCK, BY_SCORE, GraphInputs, Method, Needs, SiteTensors, TorchResult
from vlmprune.passes.methods.builder import SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows

# Below every cosine (>= -1): the score of a protected A row or B column (the official -inf, finite).
PROTECTED = -3.0


def block_range(params: dict, num_blocks: int) -> tuple[int, int]:
    """(first, last) 1-based blocks that merge: --blocks A-B (A-: to the site), default 1..num_blocks."""
    given = params.get("blocks")
    first, last = (1, num_blocks) if given is None else (given[0], num_blocks if given[1] is None else given[1])
    if not 1 <= first <= last <= num_blocks:
        raise InputError(f"--blocks {first}-{last} of method tome is out of range: the tower runs {num_blocks} "
                         f"blocks (1..{num_blocks})")
    return first, last


def _most(tokens: int, prefix: int, blocks: int) -> int:
    """The most merges `blocks` blocks can make from `tokens` tokens, each at its cap (t - p) // 2."""
    merges = 0
    for _ in range(blocks):
        r = (tokens - prefix) // 2
        merges, tokens = merges + r, tokens - r
    return merges


def schedule(params: dict, num_patches: int, prefix: int, num_blocks: int) -> list[int]:
    """r per block 1..num_blocks, summing to num_patches - keep (module docstring); one line where the cap forbids
    it."""
    keep = params["keep"]
    if not 1 <= keep < num_patches:
        raise InputError(f"--keep must satisfy 1 <= keep < {num_patches} (the tower has {num_patches} patch "
                         f"tokens), got {keep}")
    first, last = block_range(params, num_blocks)
    tokens, left = num_patches + prefix, num_patches - keep
    most = _most(tokens, prefix, last - first + 1)
    if left > most:
        raise InputError(f"--keep {keep} is out of ToMe's reach over blocks {first}-{last}: each block merges at "
                         f"most half of its unprotected tokens, so the fewest it reaches is {num_patches - most} "
                         "(raise --keep or widen --blocks)")
    r = [0] * num_blocks
    for block in range(first, last + 1):
        after = last - block  # blocks left after this one
        share = -(-left // (after + 1))  # the even share, the earliest blocks one more
        # Where a later cap binds, this block takes more: the fewest that leaves the rest within their caps.
        while left - share > _most(tokens - share, prefix, after):
            share += 1
        assert share <= (tokens - prefix) // 2, (block, share, tokens)  # left <= _most(...) guarantees it
        r[block - 1] = share
        tokens, left = tokens - share, left - share
    return r


def parse_blocks(value) -> list:
    """--blocks 'A-B' or 'A-' (from A to the site's block) -> [A, B or None]."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        first, last = value
    else:
        text = str(value).strip()
        head, sep, tail = text.partition("-")
        try:
            first, last = int(head), (int(tail) if tail else None) if sep else int(head)
        except ValueError:
            raise InputError(f"--blocks of method tome takes A-B (blocks from 1) or A-, got {value!r}") from None
    if isinstance(first, bool) or not isinstance(first, int) or first < 1 or \
            last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < first):
        raise InputError(f"--blocks of method tome takes A-B with 1 <= A <= B, got {value!r}")
    return [first, last]


def protected_mask(tokens: int, prefix: int) -> np.ndarray:
    """[1, ta, tb] bool: the scores of protected tokens (A rows 2i < p, B columns 2j + 1 < p)."""
    rows = np.arange(0, tokens, 2) < prefix
    cols = np.arange(1, tokens, 2) < prefix
    return (rows[:, None] | cols[None, :])[None]


# ---------------------------------------------------------------------------- reference


@dataclasses.dataclass
class _Tokens:
    """What the merge carries between blocks: each token's size [B, t, 1] (None: all ones) and patch index [B, t]."""

    size: torch.Tensor | None
    index: torch.Tensor


def _merge(state: _Tokens, r: int, prefix: int, h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One block's bipartite soft matching and size-weighted merge of r tokens (module docstring, steps 2-4)."""
    t = h.shape[1]
    metric = k.mean(dim=1)
    metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    scores = metric[:, ::2] @ metric[:, 1::2].transpose(1, 2)
    if prefix:
        scores = scores.masked_fill(torch.from_numpy(protected_mask(t, prefix)), PROTECTED)
    best, partner = scores.max(dim=-1)  # the first maximal index
    edges = torch.sort(best, dim=-1, descending=True, stable=True).indices
    unm, src = edges[:, r:], edges[:, :r]
    if prefix:
        unm = unm.sort(dim=-1).values
    dst = partner.gather(1, src)
    size = torch.ones_like(h[..., :1]) if state.size is None else state.size
    merged = []
    for values in (h * size, size):  # sums of x·size and of size
        a, b = values[:, ::2], values[:, 1::2]
        b = b.scatter_reduce(1, dst[..., None].expand(-1, -1, values.shape[-1]), gather_rows(a, src), reduce="sum")
        merged.append(torch.cat([gather_rows(a, unm), b], dim=1))
    state.size = merged[1]
    state.index = torch.cat([state.index[:, ::2].gather(1, unm), state.index[:, 1::2]], dim=1)
    return merged[0] / merged[1]


def reference_blocks(params: dict, blocks: list, inputs: SiteTensors) -> TorchResult:
    """ToMe over the blocks (each a compiler.frontend.tower.BlockRunner) from the embeddings, in plain torch."""
    h, prefix = inputs.hidden, inputs.prefix
    b, t, _ = h.shape
    r = schedule(params, t - prefix, prefix, len(blocks))
    state = _Tokens(None, torch.arange(t).expand(b, t))
    for run, merged in zip(blocks, r):
        bias = None if state.size is None else state.size.log().transpose(1, 2)[:, None].to(h.dtype)
        h, _ = run(h, bias=bias, between=functools.partial(_merge, state, merged, prefix) if merged else None)
    order = torch.sort(state.index, dim=-1, stable=True)
    return TorchResult(gather_rows(h, order.indices), order.values[:, prefix:] - prefix, {})


# ---------------------------------------------------------------------------- emission


def _positions(b, name: str, start: int, stop: int, step: int = 1) -> ir.Value:
    return b.const(name, np.arange(start, stop, step, dtype=np.int64))


def _halves(b, x: ir.Value, t: int, name: str) -> tuple[ir.Value, ir.Value]:
    """x [B, t, ...] -> (tokens 0, 2, 4, ...; tokens 1, 3, 5, ...)."""
    return (b.op("Gather", [x, _positions(b, f"{name}_even_ids", 0, t, 2)], f"{name}_even", axis=1),
            b.op("Gather", [x, _positions(b, f"{name}_odd_ids", 1, t, 2)], f"{name}_odd", axis=1))


def _emit_merge(b, block, x: ir.Value, size: ir.Value | None, index: ir.Value | None, t: int, r: int, prefix: int,
                dtype: ir.DataType) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One block's merge in standard ops: (x [B, t - r, D], size [B, t - r, 1], index [B, t - r] int64).

    No Slice and no constant equal to a token count downstream of a merge: RetargetTokenCountPass rewrites those."""
    ta, tb = (t + 1) // 2, t // 2
    with b.role(SCORE):
        metric = b.reduce("ReduceMean", block.k, [1], 0, "keys_mean")
        if block.k_transposed:
            metric = b.op("Transpose", [metric], "keys_mean_t", perm=[0, 2, 1])
        if (block.k.dtype or ir.DataType.FLOAT) != ir.DataType.FLOAT:  # matched in float32
            metric = b.op("Cast", [metric], "keys_f", to=ir.DataType.FLOAT)
        metric_a, metric_b = _halves(b, b.l2_normalize(metric, "metric"), t, "metric")
        scores = b.op("MatMul", [metric_a, b.op("Transpose", [metric_b], "metric_b_t", perm=[0, 2, 1])], "scores")
        if prefix:
            scores = b.op("Where", [b.const("protected", protected_mask(t, prefix)),
                                    b.scalar("protected_score", PROTECTED), scores], "scores_protected")
    with b.role(SELECT):
        best = b.reduce("ReduceMax", scores, [-1], 0, "best")
        partner = b.op("ArgMax", [scores], "partner", axis=-1, keepdims=0, select_last_index=0)
        _, edges = b.op("TopK", [best, b.ints("edges_k", [ta])], "edges", num_outputs=2, axis=-1, largest=1,
                        sorted=1)
        src = b.op("Gather", [edges, _positions(b, "src_ids", 0, r)], "src", axis=1)
        unm = b.op("Gather", [edges, _positions(b, "unm_ids", r, ta)], "unm", axis=1)
        if prefix:  # the official class_token order: the unmerged A tokens ascending, [CLS] first
            unm = b.sort_ascending(unm, ta - r, "unm_sorted")
        dst = b.op("GatherElements", [partner, src], "dst", axis=1)
        if index is None:  # each token's patch index: its position (the shape of x, no baked count)
            shape = b.op("Slice", [b.op("Shape", [x], "x_shape"), b.ints("bt_start", [0]), b.ints("bt_end", [2])],
                         "bt")
            index = b.op("Expand", [b.const("positions", np.arange(t, dtype=np.int64)[None]), shape], "index0")
        index_a, index_b = _halves(b, index, t, "index")
        new_index = b.op("Concat", [b.op("GatherElements", [index_a, unm], "index_unm", axis=1), index_b],
                         "index", axis=1)
        onehot = b.op("Cast", [b.op("Equal", [b.unsqueeze(dst, [1], "dst_row"),
                                              b.const("b_ids", np.arange(tb, dtype=np.int64)[None, :, None])],
                                    "dst_eq")], "dst_onehot", to=dtype)  # [B, tb, r]
    with b.role(TOKENS):
        if size is None:  # all ones: x·size = x, and the sizes are counted
            size = b.op("Cast", [b.unsqueeze(b.op("GreaterOrEqual", [index, b.ints("zero_i", 0)], "ones_b"), [-1],
                                             "ones_b3")], "size0", to=dtype)
            weighted = x
        else:
            weighted = b.op("Mul", [x, size], "weighted")
        merged = []
        for name, values in (("x", weighted), ("size", size)):
            a, other = _halves(b, values, t, name)
            kept = b.gather_rows(a, unm, f"{name}_unm")
            into = b.op("Add", [other, b.op("MatMul", [onehot, b.gather_rows(a, src, f"{name}_src")],
                                            f"{name}_sum")], f"{name}_dst")
            merged.append(b.op("Concat", [kept, into], f"{name}_merged", axis=1))
        new_x = b.op("Div", merged, "x_wavg")
    return new_x, merged[1], new_index


def _emit_size_bias(b, logits: ir.Value, size: ir.Value) -> ir.Value:
    """logits [B, H, t, t] + log(size) of each key token ([B, 1, 1, t]): proportional attention."""
    with b.role(TOKENS):
        bias = b.unsqueeze(b.op("Transpose", [b.op("Log", [size], "log_size")], "log_size_t", perm=[0, 2, 1]),
                           [1], "size_bias")
        return b.op("Add", [logits, bias], "proportional")


# ---------------------------------------------------------------------------- the method


class ToMeMethod(Method):
    name = "tome"
    summary = ("ToMe: bipartite soft matching on the keys merges r tokens per block (size-weighted means, "
               "proportional attention), r spread over the blocks to reach K")
    selection = BY_SCORE
    in_blocks = True
    options = {"blocks": (str, "tome: merge in blocks A-B only (from 1; A-: to the last; default every block, the "
                               "official schedule); N-K merges spread evenly, the earliest blocks one more")}
    official = "https://github.com/facebookresearch/ToMe"
    # Measured on demo (K = 192, 5 blocks): every block's merge decides on activations the reduced precision has
    # moved, and one flipped merge changes every later block's tokens.
    float32_only = ("its merge decisions in every block flip below float32 and cascade (demo, K = 192: kept-index "
                    "agreement 0.80 and cosine -0.50 under rknn fp16, 0.80 and -0.51 under QNN's 16-bit QDQ)")

    def parse(self, keep, options):
        params = super().parse(keep, options)
        if params.get("blocks") is not None:
            params["blocks"] = parse_blocks(params["blocks"])
        return params

    def needs(self, params: dict) -> Needs:
        return Needs(site=BLOCK, attention=True)

    def serves(self) -> tuple:
        # One patch grid through plain ViT blocks (no 2x2 merger, no crops); an .onnx tower is refused in
        # check_onnx_source (its reference needs the blocks in torch), which this vocabulary does not say.
        return ((FEATURE_LAYER, ""),)

    def copied_rows(self, params: dict) -> int:
        return 0  # every output token may be a merge

    def check_onnx_source(self, params: dict) -> None:
        raise InputError("method tome runs inside the tower's blocks, and its reference needs them in torch: an "
                         ".onnx source has none (use a Hugging Face directory or a preset)")

    def check(self, params: dict, spec) -> None:
        super().check(params, spec)
        if spec.merge is not None and spec.merge >= 2:
            raise InputError("method tome merges inside ViT blocks, and this tower's tokens are merged 2x2 after "
                             "windowed rotary blocks (Qwen2-VL), which it does not cover")
        if spec.layer is not None and spec.num_blocks is not None and spec.layer != spec.num_blocks:
            raise InputError(f"method tome merges inside the blocks up to the tower's last ({spec.num_blocks}): "
                             "--layer does not apply to it (--blocks A-B limits where it merges)")
        schedule(params, spec.num_patches, spec.prefix, spec.layer or spec.num_blocks or 1)

    def describe(self, params: dict) -> str:
        blocks = params.get("blocks")
        where = "every block" if blocks is None else f"blocks {blocks[0]}-{'' if blocks[1] is None else blocks[1]}"
        return (f"ToMe: bipartite soft matching merges tokens in {where} (r spread evenly), size-weighted, "
                f"proportional attention; {params['keep']} tokens in raster order")

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        raise InputError("method tome runs inside the blocks: its reference needs the tower's blocks "
                         "(reference_blocks), which this model's pipeline does not hand over")

    def reference_blocks(self, params: dict, blocks: list, inputs: SiteTensors) -> TorchResult:
        return reference_blocks(params, blocks, inputs)

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        prefix, n = inputs.prefix, inputs.num_patches
        blocks = inputs.structure.blocks[: inputs.block.index]
        for block in blocks:
            if block.softmax is None or block.middle is None:
                raise StructureError(f"method tome adds log(size) to the attention logits, and block {block.index} "
                                     "is the ONNX Attention op, which hides them (export at opset < 23)")
        dtype = inputs.hidden.dtype or ir.DataType.FLOAT
        batch = inputs.hidden.shape[0] if inputs.hidden.shape is not None else None
        t, size, index = n + prefix, None, None
        for block, r in zip(blocks, schedule(params, n, prefix, len(blocks))):
            if size is not None:
                logits = block.softmax.inputs[0]
                with b.after(logits.producer()):
                    b.reroute(logits, _emit_size_bias(b, logits, size))
            if not r:
                continue
            middle = block.middle
            with b.after(middle.producer()):
                x, size, index = _emit_merge(b, block, middle, size, index, t, r, prefix, dtype)
            x.type = middle.type
            x.shape = ir.Shape([batch, t - r, middle.shape[2] if middle.shape is not None else None])
            x.metadata_props[TOKENS_META] = f"{t},{t - r}"
            b.reroute(middle, x)
            t -= r
        with b.role(SELECT):
            ordered, order = b.op("TopK", [index, b.ints("final_k", [t])], "final_order", num_outputs=2, axis=-1,
                                  largest=0, sorted=1)
            kept = ordered if not prefix else b.op(
                "Sub", [b.op("Gather", [ordered, _positions(b, "patch_ids", prefix, t)], "kept_rows", axis=1),
                        b.ints("prefix", prefix)], "kept")
        with b.role(TOKENS):
            tokens = b.gather_rows(inputs.hidden, order, "raster")
        return tokens, kept
