"""`cls`: the project's reference method, [CLS] attention (+ pixel variance), with a summary token.

After block L, score every patch by the recomputed [CLS] attention row of that block
(passes.methods.attention), optionally plus λ times its normalised pixel variance:

    S_i = A_i / max(A) + λ · V_i / max(V)          (maxima per image, floored at 1e-6)

keep the K best (ties to the lower index), in ascending order, and append one summary
token, the unweighted mean of the N - K pruned tokens:

    [B, 1+N, D] -> [CLS] + K kept + summary = [B, 1+K+1, D]

Choices where the official code leaves it open: none (this is vlmprune's own method;
the semantics above are the contract). Needs a [CLS] token and block L's Q and K;
λ > 0 needs the pixel input and patch grid. `--score probe` replaces A by the probe score
of SigLIP's attention-pooling head (passes.methods.probe), for towers without [CLS]: the
output is then the K kept tokens + the summary (no [CLS] to copy). `--score attention`
(passes.methods.received) ranks Qwen2-VL / Qwen2.5-VL's merged tokens, at the features site,
by the attention they receive at the last full-attention block (no [CLS], --lambda 0).

Fusion: select + gather + summary become one `TokenPrune` node (kernels/cpu, kernels/cuda)
that reads each token once; the scorer stays in standard ops, measured faster there on
CPU (tools/bench_fused_op.py). `--scorer int8` (base.GENERIC_OPTIONS) is the exception: the
scorer is emitted in one fixed form (emit_kernel_scores, fp32 in model.decomposed.onnx) that
ClsScoreFusion turns into `ClsAttentionScore` with int8=1, the decision in INT8 (a cheap decision layer beside a float tower).
`--merge local` (passes.methods.merge, applied by the base class) replaces the kept rows and the
summary: no TokenPrune then.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from vlmprune.compiler.contract import CROPS, SITE_FEATURES, PruneRecord
from vlmprune.compiler.errors import InputError
from vlmprune.passes.graph.dataflow import const_array
import vlmprune.passes.methods.attention as attention
import vlmprune.passes.methods.probe as probe
import vlmprune.passes.methods.received as received
import vlmprune.passes.methods.relevance as relevance
import vlmprune.passes.methods.roi as roi
from vlmprune.passes.methods.base import (BLOCK, BY_SCORE, CLS_SCORE, CROPS_SCORED, FusedOp, GraphInputs,
                                          Method, Needs, SiteTensors, TorchResult, finite_option,
                                          int8_scorer)
from vlmprune.passes.methods.builder import INT64_MAX, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, pruned_mask, select_topk

TOKEN_PRUNE = "TokenPrune"


class ClsMethod(Method):
    name = "cls"
    summary = "[CLS] attention of block L (+ λ · pixel variance), top K in raster order, + 1 summary token"
    selection = BY_SCORE
    options = {"lambda": (float, "cls: weight of the pixel-variance term (default 0: pure [CLS] attention)"),
               "score": (str, f"cls: {received.SCORE_HELP}")}
    choices = {"score": (*probe.SCORES, received.ATTENTION)}
    local_merge = True  # --merge local: merge's step replaces the kept rows + summary (base.Method)
    prompt_weight = True  # --prompt-weight at the features site (--score attention; passes.methods.relevance)
    roi_keep = True  # --roi: forced patches lifted above every score before the TopK (passes.methods.roi)
    crop_form = CROPS_SCORED  # anyres crops: K split by each crop's [CLS]-attention mass (passes.methods.crops)

    def defaults(self, keep: int) -> dict:
        return {"lambda": 0.0}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        params["lambda"] = finite_option(self.name, "lambda", params["lambda"], minimum=0.0)
        if "score" in params:  # absent: [CLS] attention (and the params of every bundle before --score)
            params["score"] = received.parse_score(self.name, params["score"])
            if params["score"] == received.ATTENTION:  # --score attention (received.py)
                received.check_lambda(self.name, params["lambda"])
        return params

    def needs(self, params: dict) -> Needs:
        if params.get("score") == received.ATTENTION:  # --score attention: the merged tokens (received.py)
            return Needs(site=SITE_FEATURES)
        by_cls = params.get("score", "cls") == "cls"
        return Needs(site=BLOCK, cls=by_cls, attention=by_cls, pixels=params["lambda"] > 0, head=not by_cls)

    def check(self, params: dict, spec) -> None:
        if params.get("score") == received.ATTENTION and spec.frames > 1:
            raise InputError(f"method {self.name} --score attention ranks by the attention each token receives in one "
                             "image's full-attention block, and a video's temporal patches attend each within itself "
                             "(video: evs, divprune, dart)")
        if self.needs(params).cls and not spec.has_cls and spec.merge is not None and spec.merge >= 2:
            raise InputError(f"method {self.name} needs a [CLS] token, and this tower's merged tokens have none: "
                             "use --score attention (the attention each merged token receives), or divprune or dart")
        if self.needs(params).cls and not spec.has_cls and spec.head:
            raise InputError(f"method {self.name} needs a [CLS] token, and this tower has none: use --score probe (rank "
                             "by its attention-pooling head's probe), or a method for towers without one "
                             "(`vlmprune methods`)")
        super().check(params, spec)
        self.check_prefix_for_scorer(params, spec)
        if params.get("score") == received.ATTENTION and spec.merge is not None and spec.merge < 2:
            raise InputError(f"method {self.name} with --score attention needs a tower whose merged tokens are the "
                             "features (Qwen2-VL / Qwen2.5-VL), and this one has none")

    def check_prefix_for_scorer(self, params: dict, spec) -> None:
        check_scorer_prefix(params, spec)

    def check_onnx_source(self, params: dict) -> None:
        if params.get("score") == received.ATTENTION:
            raise InputError(f"method {self.name} with --score attention needs a Qwen2-VL / Qwen2.5-VL directory: the "
                             "score block's Q and K come from its torch tower, which an .onnx tower does not have "
                             "(divprune and dart serve .onnx towers)")

    def serves(self) -> tuple:
        return (*super().serves(), (CROPS, " under one budget"), probe.PROBE_SERVES, received.SERVES)

    def output_tokens(self, params: dict) -> int:
        return params["keep"] + 1

    def roi_bound(self, params: dict) -> float:
        return 1.0 + params["lambda"] + relevance.weight(params)  # A/max(A) <= 1, λ·V/max(V) <= λ, W·rel < W

    def scores_by_cls_kernel(self, params: dict) -> bool:
        return params.get("score", "cls") == "cls"  # λ's pixel term is added after the kernel's A

    def describe(self, params: dict) -> str:
        lam = params["lambda"]
        score = {"probe": "probe attention (pooling head)",
                 received.ATTENTION: "attention received at the last full-attention block"}.get(
            params.get("score"), "[CLS] attention")
        int8 = " (INT8 scorer)" if int8_scorer(params) else ""
        pixel = f" + {lam:g} · pixel variance" if lam else ""
        return f"{score}{int8}{pixel}: top {params['keep']} + 1 summary{roi.describe(params)}"

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        keep = params["keep"]
        if params.get("score") == "probe":
            attn = probe.probe_attention(inputs.hidden, inputs.head, inputs.prefix)
        elif params.get("score") == received.ATTENTION:
            if inputs.q is None:
                raise InputError("cls --score attention needs the score block's Q and K, which only the "
                                 "qwen2_vl family's pipeline hands over (Qwen2-VL / Qwen2.5-VL directories)")
            attn = received.received_attention(inputs.q, inputs.k, inputs.scale, inputs.hidden.shape[1])
        else:
            attn = attention.cls_attention(inputs.q, inputs.k, inputs.scale, inputs.prefix)
        scores = _pixel_term(params, inputs, attention.normalise(attn))
        scores = relevance.weighted(params, inputs, scores)  # --prompt-weight (features site only)
        forced = getattr(inputs, "forced", None)  # --roi: PromptSiteTensors.forced (plain SiteTensors have none)
        scores = roi.force_scores(scores, forced, self.roi_bound(params))
        kept = select_topk(scores, keep)
        trace = {"scores": scores, "boundary": keep}
        if forced is not None:
            trace["forced"] = forced
        return TorchResult(gather_summary(inputs.hidden, kept, inputs.prefix), kept, trace)

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep = params["keep"]
        if params.get("score") == "probe":
            attn = probe.emit_probe_attention(b, inputs.hidden, inputs.head, inputs.prefix)
        elif params.get("score") == received.ATTENTION:
            attn = received.emit_received_attention(b, b.graph, inputs.structure, inputs.hidden)
        elif int8_scorer(params):  # the form ClsScoreFusion turns into the INT8 kernel
            attn = emit_kernel_scores(b, inputs.block, inputs.prefix)
        else:
            attn = attention.emit_cls_attention(b, inputs.block, inputs.prefix)
        scores = _emit_pixel_term(b, params, inputs, attention.emit_normalise(b, attn, "attn_norm"))
        scores = relevance.emit_weighted(b, params, inputs, scores)  # --prompt-weight (features site only)
        scores = roi.emit_force_scores(b, scores, inputs.forced, self.roi_bound(params))  # --roi: forced first
        return emit_selection(b, inputs.hidden, scores, keep, inputs.num_patches, inputs.prefix)

    def crop_scores(self, params: dict, inputs: SiteTensors) -> torch.Tensor:
        """Each crop's [CLS] attention (+ λ · pixel variance): the score the crops' budget split weighs."""
        return _pixel_term(params, inputs, attention.normalise(attention.cls_attention(inputs.q, inputs.k, inputs.scale,
                                                                                       inputs.prefix)))

    def emit_crop_scores(self, b, params: dict, inputs: GraphInputs) -> ir.Value:
        attn = attention.emit_cls_attention(b, inputs.block, inputs.prefix)
        return _emit_pixel_term(b, params, inputs, attention.emit_normalise(b, attn, "attn_norm"))

    def fusion_rules(self, spellings: dict[str, FusedOp], record: PruneRecord | None = None) -> list:
        params = record.params if record is not None else {}
        if record is not None and record.prefix != 1:
            return []  # the kernels copy (and skip) one [CLS] token: register tokens stay in standard ops
        rules = []
        scorer = spellings.get(CLS_SCORE)
        if scorer is not None and int8_scorer(params):
            rules += [ClsScoreFusion.rule(scorer, transposed, axes_input) for transposed in (True, False)
                      for axes_input in (True, False)]
        spelling = spellings.get(TOKEN_PRUNE)
        if spelling is not None and not params.get("merge"):  # a local merge is no TokenPrune summary
            rules += [TokenPruneFusion.rule(spelling), TokenPruneFusion.rule(spelling, sort_via_float=True)]
        return rules


def _pixel_term(params: dict, inputs: SiteTensors, scores: torch.Tensor) -> torch.Tensor:
    """scores + λ · the normalised pixel variance (λ = 0: scores as they are)."""
    lam = params["lambda"]
    if not lam:
        return scores
    return scores + lam * attention.normalise(attention.patch_variance(inputs.pixel_values, inputs.patch_size))


def _emit_pixel_term(b, params: dict, inputs: GraphInputs, scores: ir.Value) -> ir.Value:
    """_pixel_term in the graph."""
    lam = params["lambda"]
    if not lam > 0:
        return scores
    variance = attention.emit_patch_variance(b, inputs.structure, inputs.num_patches)
    weighted = b.op("Mul", [attention.emit_normalise(b, variance, "var_norm"), b.scalar("lambda", lam)],
                    "var_weighted")
    return b.op("Add", [scores, weighted], "scores")


def check_scorer_prefix(params: dict, spec) -> None:
    """The INT8 kernel skips exactly one [CLS] key: register tokens (DINOv2's) would leave the decision fp32."""
    if int8_scorer(params) and spec.prefix != 1:
        raise InputError(f"--scorer int8 runs the ClsAttentionScore kernel, which reads one [CLS] token, and "
                         f"this tower has {spec.prefix} leading tokens ([CLS] and registers)")


def gather_summary(hidden: torch.Tensor, kept: torch.Tensor, prefix: int = 1) -> torch.Tensor:
    """prefix ([CLS]) + kept tokens + the unweighted mean of the pruned ones: [B, p+N, D] -> [B, p+K+1, D]."""
    patches = hidden[:, prefix:]
    n, k = patches.shape[1], kept.shape[-1]
    summary = (pruned_mask(kept, n, patches.dtype) / (n - k)).unsqueeze(1) @ patches
    return torch.cat([hidden[:, :prefix], gather_rows(patches, kept), summary], dim=1)


def emit_selection(b, hidden: ir.Value, scores: ir.Value, keep: int, n: int,
                   prefix: int = 1) -> tuple[ir.Value, ir.Value]:
    """TopK -> indices in raster order -> GatherND + summary mean -> Concat, in standard ops.

    hidden [B, p+N, D], scores [B, N] -> (tokens [B, p+K+1, D], kept [B, K] int64), p = prefix.
    With p = 1 ([CLS]) this is the subgraph TokenPruneFusion recognises.
    """
    with b.role(SELECT):
        k = b.ints("k", [keep])
        _, top = b.op("TopK", [scores, k], "topk", num_outputs=2, axis=-1, largest=1, sorted=1)
        # TopK on the indices themselves, smallest first: the kept set in raster order.
        kept, _ = b.op("TopK", [top, k], "sort_kept", num_outputs=2, axis=-1, largest=0, sorted=1)
    with b.role(TOKENS):
        patches = b.slice(hidden, prefix, INT64_MAX, 1, "patches")  # [B, N, D]
        gathered = b.op("GatherND", [patches, b.unsqueeze(kept, [-1], "kept_nd")], "gather_kept", batch_dims=1)
        np_dtype = (hidden.dtype or ir.DataType.FLOAT).numpy()
        ones = b.op("ConstantOfShape", [b.op("Shape", [scores], "scores_shape")], "ones",
                    value=ir.tensor(np.ones([1], dtype=np_dtype)))
        zeros = b.op("ConstantOfShape", [b.op("Shape", [kept], "kept_shape")], "zeros",
                     value=ir.tensor(np.zeros([1], dtype=np_dtype)))
        mask = b.op("ScatterElements", [ones, kept, zeros], "pruned_mask", axis=1)
        weights = b.op("Mul", [mask, b.const("inv_pruned", np.array(1.0 / (n - keep), dtype=np_dtype))], "summary_w")
        summary = b.op("MatMul", [b.unsqueeze(weights, [1], "summary_w3"), patches], "summary")  # [B, 1, D]
        # No empty slice for a tower without a prefix: zero-sized tensors are not every runtime's business.
        cls = [b.slice(hidden, 0, prefix, 1, "cls")] if prefix else []
        tokens = b.op("Concat", [*cls, gathered, summary], "tokens", axis=1)
    return tokens, kept


# ---------------------------------------------------------------------------- fusion


def _is(value: ir.Value, expected) -> bool:
    array = const_array(value)
    return array is not None and array.reshape(-1).tolist() == list(expected)


def _attr(value: ir.Value, name: str, default=None):
    attr = value.producer().attributes.get(name)
    return default if attr is None else attr.value


class TokenPruneFusion(RewriteRuleClassBase):
    """[CLS] ++ GatherND(X, sort(TopK(S, K))) ++ mean(X[pruned]) -> TokenPrune(X, S).

    Matches by structure only, checks every constant that fixes the semantics (K, the
    tie rule, raster order, the summary weight 1/(N-K)), and the rewriter refuses to
    fuse when an intermediate has consumers outside the subgraph. The sort of the kept
    indices is recognised in both forms the passes emit: TopK over the int64 indices, or
    Cast(float) -> TopK -> Cast(int64) (passes.tensorrt.SortIndicesAsFloatPass).
    """

    def __init__(self, spelling: FusedOp, sort_via_float: bool = False):
        super().__init__(name="TokenPruneFusion" + ("(float sort)" if sort_via_float else ""))
        self.spelling = spelling
        self.sort_via_float = sort_via_float

    def pattern(self, op, hidden, scores, k, unsq_kept, unsq_w, inv_pruned, p_start, p_end, p_axis,
                c_start, c_end, c_axis):
        _, top = op.TopK(scores, k, _outputs=["top_values", "top"])
        if self.sort_via_float:
            top_float = op.Cast(top, _outputs=["top_float"])
            sorted_kept, _ = op.TopK(top_float, k, _outputs=["sorted_kept", "sorted_positions"])
            kept = op.Cast(sorted_kept, _outputs=["kept"])
        else:
            kept, _ = op.TopK(top, k, _outputs=["kept", "kept_values"])
        patches = op.Slice(hidden, p_start, p_end, p_axis, _outputs=["patches"])
        gathered = op.GatherND(patches, op.Unsqueeze(kept, unsq_kept), _outputs=["gathered"])
        ones = op.ConstantOfShape(op.Shape(scores), _outputs=["ones"])
        zeros = op.ConstantOfShape(op.Shape(kept), _outputs=["zeros"])
        mask = op.ScatterElements(ones, kept, zeros, _outputs=["mask"])
        summary = op.MatMul(op.Unsqueeze(op.Mul(mask, inv_pruned), unsq_w), patches)
        cls = op.Slice(hidden, c_start, c_end, c_axis)
        tokens = op.Concat(cls, gathered, summary, _outputs=["tokens"])
        return tokens, kept

    def check(self, context, hidden, scores, k, unsq_kept, unsq_w, inv_pruned, p_start, p_end, p_axis,
              c_start, c_end, c_axis, top, kept, gathered, ones, zeros, mask, tokens, sorted_kept=None,
              top_float=None, **_) -> MatchResult:
        result = MatchResult()
        keep = const_array(k)
        if keep is None or keep.size != 1:
            return result.fail("K is not a constant")
        keep = int(keep.reshape(-1)[0])
        if (_attr(top, "largest", 1), _attr(top, "sorted", 1), _attr(top, "axis", -1)) != (1, 1, -1):
            return result.fail("first TopK is not largest/sorted over the last axis")
        sort = kept if sorted_kept is None else sorted_kept
        if (_attr(sort, "largest", 1), _attr(sort, "sorted", 1)) != (0, 1):
            return result.fail("second TopK does not sort the indices ascending")
        if sorted_kept is not None:
            n_sorted = scores.shape[-1] if scores.shape is not None else None
            if _attr(top_float, "to") != ir.DataType.FLOAT or _attr(kept, "to") != ir.DataType.INT64:
                return result.fail("the float sort is not Cast(float) -> TopK -> Cast(int64)")
            if not isinstance(n_sorted, int) or n_sorted >= 1 << 24:
                return result.fail("the float sort is exact only for a static N < 2^24")
        if _attr(gathered, "batch_dims", 0) != 1 or not _is(unsq_kept, [-1]) and not _is(unsq_kept, [2]):
            return result.fail("GatherND is not a per-image gather of the kept rows")
        if _attr(mask, "axis", 0) not in (1, -1):
            return result.fail("ScatterElements does not scatter along the patch axis")
        for value, fill in ((ones, 1.0), (zeros, 0.0)):
            attr = value.producer().attributes.get("value")
            if attr is None or attr.value.numpy().reshape(-1).tolist() != [fill]:
                return result.fail(f"mask constant is not {fill}")
        if not (_is(p_start, [1]) and _is(p_axis, [1]) and const_array(p_end) is not None
                and int(const_array(p_end).reshape(-1)[0]) >= np.iinfo(np.int32).max):
            return result.fail("patches are not hidden[:, 1:]")
        if not (_is(c_start, [0]) and _is(c_end, [1]) and _is(c_axis, [1])):
            return result.fail("[CLS] is not hidden[:, 0:1]")
        if not _is(unsq_w, [1]) or _attr(tokens, "axis", None) not in (1, -2):
            return result.fail("summary or Concat axis differs")
        n = scores.shape[-1] if scores.shape is not None else None
        inv = const_array(inv_pruned)
        if not isinstance(n, int) or inv is None or inv.size != 1:
            return result.fail("patch count is not static")
        # The weight is stored in the hidden states' type: fp16 holds 1/(N-K) to its own precision only.
        rtol = float(np.finfo(inv.dtype).eps) if inv.dtype.kind == "f" else 1e-6
        if not np.isclose(float(inv.reshape(-1)[0]), 1.0 / (n - keep), rtol=rtol):
            return result.fail(f"summary weight {float(inv.reshape(-1)[0])} is not 1/(N-K) = 1/{n - keep}")
        return result

    def rewrite(self, op, hidden, scores, k, **_):
        keep = int(const_array(k).reshape(-1)[0])
        make = getattr(op, self.spelling.op_type)
        return make(hidden, scores, keep=keep, has_cls=1, **dict(self.spelling.attributes),
                    _domain=self.spelling.domain, _outputs=2)


def emit_kernel_scores(b, block, prefix: int = 1) -> ir.Value:
    """A [B, N] as attention.emit_cls_attention, in the one form ClsScoreFusion matches: the block's scaling as
    one Mul by its scale (the product of its scaling ops, which the kernel takes as an attribute)."""
    q_cls = b.slice(block.q, 0, 1, 2, "q_cls")  # [B, H, 1, dh]
    kt = block.k if block.k_transposed else b.op("Transpose", [block.k], "k_t", perm=[0, 1, 3, 2])
    logits = b.op("MatMul", [q_cls, kt], "cls_logits")  # [B, H, 1, T]
    dtype = (block.q.dtype or ir.DataType.FLOAT).numpy()
    logits = b.op("Mul", [logits, b.const("cls_scale", np.array(block.scale, dtype=dtype))], "cls_scaled")
    probs = b.op("Softmax", [logits], "cls_probs", axis=-1)
    attn = b.reduce("ReduceMean", probs, [1, 2], 0, "cls_attn")  # [B, T]
    return b.slice(attn, prefix, INT64_MAX, 1, "patch_attn")  # [B, N]


class ClsScoreFusion(RewriteRuleClassBase):
    """mean_h softmax(scale · q[:, :, :1] · Kᵀ)[:, 1:] -> ClsAttentionScore(q, K; int8=1): --scorer int8.

    Matches emit_kernel_scores' form only (the one the method emits with --scorer int8), K given
    transposed ([B, H, dh, T], a decomposed attention's MatMul operand) or through the emitted
    Transpose (the Attention op's [B, H, T, dh]); the kernel reads row 0 of q itself. The fused
    node carries int8=1: the decision in INT8 (keys centred, q and keys Hadamard-rotated, per-key
    int8 keys, the query in two int8 limbs, int32 dot products, fp32 softmax;
    kernels/include/vlmprune/kernels.h) while the tower stays as it is. The target's spelling names the
    op: ClsAttentionScore on ort, the VlmpClsScore plugin on orin / xavier.
    """

    def __init__(self, spelling: FusedOp, k_transposed: bool = True, axes_input: bool = True):
        super().__init__(name="ClsScoreFusion" + ("" if k_transposed else "(k rows)") +
                         ("" if axes_input else "(axes attribute)"))
        self.spelling, self.k_transposed, self.axes_input = spelling, k_transposed, axes_input

    def pattern(self, op, q, k, q_start, q_end, q_axis, scale, a_start, a_end, a_axis, axes=None):
        q_cls = op.Slice(q, q_start, q_end, q_axis)
        kt = k if self.k_transposed else op.Transpose(k, _outputs=["kt"])
        probs = op.Softmax(op.Mul(op.MatMul(q_cls, kt), scale), _outputs=["probs"])
        # ReduceMean's axes: an input from opset 18, an attribute before (Builder.reduce)
        attn = op.ReduceMean(probs, axes, _outputs=["attn"]) if self.axes_input else \
            op.ReduceMean(probs, _outputs=["attn"])
        return op.Slice(attn, a_start, a_end, a_axis)

    def check(self, context, q, k, q_start, q_end, q_axis, scale, a_start, a_end, a_axis, probs, attn,
              axes=None, kt=None, **_) -> MatchResult:
        result = MatchResult()
        if not (_is(q_start, [0]) and _is(q_end, [1]) and _is(q_axis, [2])):
            return result.fail("the query is not q[:, :, 0:1]")
        if kt is not None and _attr(kt, "perm") != [0, 1, 3, 2]:
            return result.fail("the Transpose does not swap K's last two axes")
        if const_array(scale) is None or const_array(scale).size != 1:
            return result.fail("the scale is not a constant scalar")
        if _attr(probs, "axis", -1) not in (-1, 3):
            return result.fail("the Softmax is not over the keys")
        mean_axes = (const_array(axes).reshape(-1).tolist() if const_array(axes) is not None else []) \
            if self.axes_input else list(_attr(attn, "axes", []) or [])
        if sorted(mean_axes) != [1, 2] or _attr(attn, "keepdims", 1) != 0:
            return result.fail("the mean is not over the heads (axes 1, 2, keepdims 0)")
        if not (_is(a_start, [1]) and _is(a_axis, [1]) and const_array(a_end) is not None
                and int(const_array(a_end).reshape(-1)[0]) >= np.iinfo(np.int32).max):
            return result.fail("the patch scores are not attn[:, 1:]")
        for value, rank in ((q, 4), (k, 4)):
            if value.shape is None or len(value.shape) != rank:
                return result.fail("q and K are not rank 4")
        return result

    def rewrite(self, op, q, k, scale, **_):
        make = getattr(op, self.spelling.op_type)
        return make(q, k, scale=float(const_array(scale).reshape(-1)[0]), has_cls=1, int8=1,
                    k_transposed=int(self.k_transposed), **dict(self.spelling.attributes), _domain=self.spelling.domain)


def selection_model(batch: int | str, n: int, d: int, keep: int, dtype=np.float32, opset: int = 18) -> ir.Model:
    """Just the selection subgraph, as the method emits it: (hidden [B, 1+N, D], scores [B, N]) -> (tokens, kept).

    For the fusion tests and tools/bench_fused_op.py.
    """
    from onnx_ir.passes.common import ShapeInferencePass

    from vlmprune.compiler.contract import KEPT
    from vlmprune.passes.methods.builder import Builder

    elem = ir.DataType.from_numpy(np.dtype(dtype))
    hidden = ir.Value(name="hidden", type=ir.TensorType(elem), shape=ir.Shape([batch, n + 1, d]))
    scores = ir.Value(name="scores", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch, n]))
    graph = ir.Graph([hidden, scores], [], nodes=[], name="selection", opset_imports={"": opset})
    b = Builder(graph, opset, "vlmprune/select")
    tokens, kept = emit_selection(b, hidden, scores, keep, n)
    graph.extend(b.nodes)
    tokens.name, kept.name = "tokens", KEPT
    graph.outputs.extend([tokens, kept])
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    return model
