"""`cdpruner`: CDPruner's conditional DPP selection, in the model-agnostic form OpenVINO GenAI runs.

CDPruner (Theia-4869/CDPruner) keeps the K visual tokens that maximise the determinant of
a kernel that weighs diversity by relevance to the prompt. OpenVINO GenAI ships it as a
runtime stage that needs no CLIP text tower; vlmprune follows that form:

1. Similarity S = cosine between the tower features at the feature layer (the output of
   the last block the tower runs, the feature layer's hidden states, its [CLS] / register
   prefix dropped): [B, N, N].
2. Relevance: the negative mean cosine between each projector output row and the rows of
   the prompt's text embeddings (`text_embeds` [B, T, D_llm], the prompt's rows of the
   LLM's embedding table), min-max normalised per image: (r - min) / (max - min + 1e-6).
   The sign is the official code's.
3. r -> exp(theta / (2 (1 - theta)) · r), theta = 0.5 (option --theta, in [0, 1); the
   official code skips the exponential at theta = 1, which we do not offer).
4. Kernel L = r_i S_ij r_j, then the fast greedy DPP MAP (Chen et al.): d2 = diag(L); per
   step the token j of largest d2, e = (L[j] - sum_t c_t[j] c_t) / sqrt(d2[j] + 1e-5),
   d2 -= e², j leaves the candidates. K steps, kept indices ascending. Output: the K
   projector output rows; no summary.

Without a prompt (T = 0 rows): the mean over no text rows is taken as 0, so relevance is
0 everywhere, exp(0) = 1, and L = S: the unconditioned DPP, diversity alone (the paper's
ablation without the condition). That is what the graph does for text_embeds [B, 0, D],
and what `vlmprune run` feeds when no --prompt is given. A constant relevance is the only
neutral choice: an "empty prompt" has no rows whose embeddings could be averaged.

Choices where the official code is batch-1 only or silent:
- text embeddings are per image ([B, T, D]: one prompt per image, as a batch of requests);
  the official code takes one [M, D] for the sample;
- rows are normalised by max(||x||, 1e-12): the official division by ||x|| makes a zero row
  (a padding embedding) NaN;
- the square root takes max(d2[j], 0) + 1e-5: beyond the kernel's numerical rank rounding
  leaves d2 slightly negative and the official sqrt would turn every later pick into NaN;
- a picked token is never a candidate again (a finite sentinel in the graph, -inf in torch);
- ties go to the lower index (argmax's first occurrence, torch and ONNX alike);
- diag(L) is r_i² exactly (S_ii = 1 by definition), not the rounded cosine of a row with
  itself: with a uniform relevance (no prompt) every diagonal entry ties, and the official
  code's first pick is then decided by rounding noise; here it is the lowest index;
- with a [CLS] token in the projector output (select strategy `full`), [CLS] passes through
  and only patch tokens are selected (S and relevance then read the patch rows only).

Formulations, as for divprune (the greedy loop is sequential): "loop", one ONNX Loop over
the K steps (control flow), and "unrolled", the same body repeated; a target that takes no
control flow gets "unrolled". Greedy DPP is precision-sensitive (each step subtracts the
squares of the previous ones): parity reports every step's margin, so the step where fp32
and the fp64 reference part ways is named with how close its two best candidates were.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import FEATURE_LAYER, NORM_EPS, SITE_FEATURES
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import (GREEDY, Formulation, GraphInputs, Method, Needs, SiteTensors,
                                           TorchResult, finite_option)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS, add_loop, loop_body
from vlmprune.passes.methods.relevance import emit_relevance as emit_prompt_relevance
from vlmprune.passes.methods.relevance import relevance as prompt_relevance
from vlmprune.passes.methods.selection import gather_rows, relative_margin, split_prefix

DPP_EPS = 1e-5  # under the greedy step's square root (OpenVINO GenAI's)
THETA = 0.5
# d2 of a live candidate lies in [-eps, max r²] (r <= e^(alpha)); a picked one gets -SENTINEL added:
# finite, so quantizers and fp16 toolchains calibrate it (an infinity breaks rknn-toolkit2's int8 calibration).
SENTINEL = 1e4


def alpha_of(theta: float) -> float:
    return theta / (2.0 * (1.0 - theta))


def similarity(features: torch.Tensor) -> torch.Tensor:
    """Cosine between rows: [B, N, Dv] -> [B, N, N]."""
    unit = features / features.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return unit @ unit.transpose(1, 2)


def relevance(tokens: torch.Tensor, text: torch.Tensor | None, theta: float) -> torch.Tensor:
    """exp(alpha · minmax(-mean_t cos(x_i, text_t))): [B, N]; all ones without text rows.

    The min-max relevance is passes.methods.relevance's (--prompt-weight's, CDPruner's definition): one copy."""
    b, n, _ = tokens.shape
    if text is None or text.shape[1] == 0:
        return torch.ones(b, n, dtype=tokens.dtype, device=tokens.device)
    return torch.exp(alpha_of(theta) * prompt_relevance(tokens, text))


def dpp_greedy(kernel: torch.Tensor, diagonal: torch.Tensor,
               keep: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Fast greedy DPP MAP: the picks in order [B, K] and per step (pick [B, 1], margin over the runner-up [B]).

    diagonal: diag(L) [B, N], given as r² (see the module docstring) rather than read from the rounded kernel."""
    b, n, _ = kernel.shape
    d2 = diagonal.clone()
    rows = kernel.new_zeros(b, keep, n)  # the orthogonalised rows c_t of the picks so far
    picked = torch.zeros(b, n, dtype=torch.bool, device=kernel.device)
    picks, steps = [], []
    for i in range(keep):
        candidates = d2.masked_fill(picked, float("-inf"))
        pick = candidates.argmax(dim=-1, keepdim=True)
        steps.append((pick, relative_margin(candidates, 1)))
        picks.append(pick)
        row = torch.gather(kernel, 1, pick.unsqueeze(-1).expand(b, 1, n)).squeeze(1)
        at_pick = torch.gather(rows, 2, pick.unsqueeze(1).expand(b, keep, 1))  # c_t[j], [B, K, 1]
        e = (row - (at_pick * rows).sum(dim=1)) / (torch.gather(d2, 1, pick).clamp_min(0.0) + DPP_EPS).sqrt()
        rows[:, i] = e
        d2 = d2 - e * e
        picked.scatter_(1, pick, True)
    return torch.cat(picks, dim=1), steps


class CDPrunerMethod(Method):
    name = "cdpruner"
    summary = ("CDPruner: conditional DPP over the feature layer's similarity, weighted by relevance to the prompt "
               "(text_embeds), on the projector output")
    selection = GREEDY
    options = {"theta": (float, "cdpruner: relevance weight theta in [0, 1) (default 0.5): "
                                "r -> exp(theta/(2(1-theta)) r)")}
    formulations = (Formulation("loop", control_flow=True), Formulation("unrolled"))
    official = "https://github.com/Theia-4869/CDPruner (as OpenVINO GenAI runs it: model-agnostic, LLM embeddings)"

    def defaults(self, keep: int) -> dict:
        return {"theta": THETA}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        params["theta"] = finite_option(self.name, "theta", params["theta"], 0.0)
        if params["theta"] >= 1.0:
            raise InputError(f"--theta of method cdpruner must be < 1 (exp(theta/(2(1-theta)) r) is infinite at 1), "
                             f"got {params['theta']:g}")
        return params

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES, tower_features=True, text=True)

    def serves(self) -> tuple:
        """Not Qwen2-VL's merged tokens nor LLaVA-NeXT's crops (check refuses both): the families whose feature layer
        is one to one with the projector output."""
        return ((FEATURE_LAYER, ""),)

    def check(self, params: dict, spec) -> None:
        super().check(params, spec)
        if "crops" in params:
            raise InputError("method cdpruner does not run on LLaVA-NeXT's crops yet (one DPP over all crops' "
                             "tokens is not written); use divprune or dart there")
        if spec.merge not in (None, 1):
            raise InputError("method cdpruner needs the feature layer's tokens one to one with the projector "
                             f"output's, and this tower merges {spec.merge}x{spec.merge} patches into each (Qwen2-VL)")

    def describe(self, params: dict) -> str:
        return (f"CDPruner: {params['keep']} tokens by conditional DPP (theta {params['theta']:g}) on the projector "
                "output")

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        cls, x = split_prefix(inputs.hidden, inputs.prefix)
        features = getattr(inputs, "features", None)
        if features is None:
            raise InputError("method cdpruner needs the tower features at the feature layer (the last block's output), "
                             "which this source does not give")
        features = features[:, features.shape[1] - x.shape[1]:]  # its [CLS] / register prefix dropped
        text = getattr(inputs, "text", None)
        r = relevance(x, None if text is None else text.to(x.dtype), params["theta"])
        kernel = r.unsqueeze(2) * similarity(features.to(x.dtype)) * r.unsqueeze(1)
        picks, steps = dpp_greedy(kernel, r * r, params["keep"])
        kept = picks.sort(dim=-1).values
        return TorchResult(torch.cat([*cls, gather_rows(x, kept)], dim=1), kept, {"steps": steps})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep, n = params["keep"], inputs.num_patches
        if inputs.features is None or inputs.text is None:
            raise InputError("method cdpruner needs the tower's last block (its features at the feature layer) and the "
                             "text_embeds input; this graph's tower structure was not found")
        with b.role(TOKENS):
            cls = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []
            x = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else inputs.hidden
        with b.role(SCORE):
            feats = b.slice(inputs.features, -n, INT64_MAX, 1, "features")  # prefix dropped
            unit_f = b.l2_normalize(feats, "unit_features", NORM_EPS)
            sim = b.op("MatMul", [unit_f, b.op("Transpose", [unit_f], "unit_features_t", perm=[0, 2, 1])],
                       "similarity")  # [B, N, N]
            r = emit_relevance(b, x, inputs.text, params["theta"])  # [B, N]
            kernel = b.op("Mul", [b.op("Mul", [sim, b.unsqueeze(r, [2], "r_col")], "kernel_rows"),
                                  b.unsqueeze(r, [1], "r_row")], "kernel")
        with b.role(SELECT):
            picks = emit_dpp(b, kernel, b.op("Mul", [r, r], "d2"), keep, n, formulation)
            kept = b.sort_ascending(picks, keep, "kept")
        with b.role(TOKENS):
            gathered = b.gather_rows(x, kept, "gather_kept")
            tokens = b.op("Concat", [*cls, gathered], "tokens", axis=1) if cls else gathered
        return tokens, kept


# ---------------------------------------------------------------------------- graph


def emit_relevance(b, x: ir.Value, text: ir.Value, theta: float) -> ir.Value:
    """exp(alpha · minmax(-mean_t cos)) [B, N], the min-max from passes.methods.relevance; T = 0 gives relevance 1."""
    normed = emit_prompt_relevance(b, x, text)
    return b.op("Exp", [b.op("Mul", [normed, b.scalar("alpha", alpha_of(theta))], "relevance_scaled")], "relevance")


def _step(b, w, kernel, d2, mask, rows, row_index, keep: int, n: int, name: str):
    """One greedy DPP step: (pick [B, 1], d2, mask, rows [B, K, N] with row `row_index` = e)."""
    pick = w.op("ArgMax", [w.op("Add", [d2, mask], f"{name}_candidates")], f"{name}_pick", axis=-1, keepdims=1,
                select_last_index=0)  # [B, 1]
    col = w.op("Unsqueeze", [pick, b.ints(f"{name}_col_axes", [-1])], f"{name}_col")  # [B, 1, 1]
    row = w.op("GatherElements", [kernel, w.op("Expand", [col, b.ints(f"{name}_row_shape", [1, 1, n])],
                                                f"{name}_row_index")], f"{name}_row", axis=1)  # L[j]: [B, 1, N]
    at = w.op("Unsqueeze", [pick, b.ints(f"{name}_at_axes", [1])], f"{name}_at")  # [B, 1, 1]
    at_index = w.op("Expand", [at, b.ints(f"{name}_at_shape", [1, keep, 1])], f"{name}_at_index")
    at_pick = w.op("GatherElements", [rows, at_index], f"{name}_c_at_pick", axis=2)  # c_t[j]: [B, K, 1]
    proj = w.op("MatMul", [w.op("Transpose", [at_pick], f"{name}_c_at_pick_t", perm=[0, 2, 1]), rows],
                f"{name}_projection")  # [B, 1, N]
    d2_pick = w.op("GatherElements", [d2, pick], f"{name}_d2_pick", axis=1)  # [B, 1]
    den = w.op("Sqrt", [w.op("Add", [w.op("Max", [d2_pick, b.scalar(f"{name}_zero", 0.0)], f"{name}_d2_floor"),
                                     b.scalar(f"{name}_eps", DPP_EPS)], f"{name}_d2_eps")], f"{name}_den")
    e = w.op("Div", [w.op("Sub", [row, proj], f"{name}_residual"),
                     w.op("Unsqueeze", [den, b.ints(f"{name}_den_axes", [-1])], f"{name}_den3")], f"{name}_e")
    where = w.op("Expand", [row_index, b.ints(f"{name}_write_shape", [1, 1, n])], f"{name}_write_at")
    where = w.op("Expand", [where, w.op("Shape", [e], f"{name}_e_shape")], f"{name}_write_index")
    rows = w.op("ScatterElements", [rows, where, e], f"{name}_rows", axis=1)
    d2 = w.op("Sub", [d2, w.op("Squeeze", [w.op("Mul", [e, e], f"{name}_e2"), b.ints(f"{name}_e2_axes", [1])],
                                f"{name}_e2_row")], f"{name}_d2")
    fill = w.op("Expand", [b.scalar(f"{name}_sentinel", -SENTINEL), w.op("Shape", [pick], f"{name}_pick_shape")],
                f"{name}_fill")
    mask = w.op("ScatterElements", [mask, pick, fill], f"{name}_mask", axis=1)
    return pick, d2, mask, rows


def emit_dpp(b, kernel: ir.Value, d2: ir.Value, keep: int, n: int, formulation: str) -> ir.Value:
    """The K picks in pick order [B, K] int64, from the kernel [B, N, N] and its diagonal d2 = r² [B, N]."""
    mask = b.op("ConstantOfShape", [b.op("Shape", [d2], "d2_shape")], "mask0",
                value=ir.tensor(np.zeros([1], np.float32)))
    batch = b.op("Slice", [b.op("Shape", [kernel], "kernel_shape"), b.ints("batch_start", [0]),
                           b.ints("batch_end", [1])], "batch")
    rows_shape = b.op("Concat", [batch, b.ints("rows_dims", [keep, n])], "rows_shape", axis=0)
    rows = b.op("ConstantOfShape", [rows_shape], "rows0", value=ir.tensor(np.zeros([1], np.float32)))
    if formulation == "unrolled":
        picks = []
        for i in range(keep):
            pick, d2, mask, rows = _step(b, b, kernel, d2, mask, rows, b.ints(f"step{i}_index", [[[i]]]), keep, n,
                                         f"step{i}")
            picks.append(pick)
        return b.op("Concat", picks, "picks", axis=1) if keep > 1 else picks[0]
    w, iteration, cond_in, (d2_in, mask_in, rows_in) = loop_body(
        b, "cdpruner_step", {"d2_in": ["batch", n], "mask_in": ["batch", n], "rows_in": ["batch", keep, n]})
    index = w.op("Reshape", [iteration, b.ints("step_index_shape", [1, 1, 1])], "step_index")
    pick, d2_out, mask_out, rows_out = _step(b, w, kernel, d2_in, mask_in, rows_in, index, keep, n, "step")
    cond_out, pick_out = w.op("Identity", [cond_in], "cond_out"), w.op("Identity", [pick], "pick_out")
    loop = add_loop(b, w, [cond_out, d2_out, mask_out, rows_out, pick_out], keep, [d2, mask, rows], "dpp_loop")
    scanned = loop.outputs[3]  # [K, B, 1]
    return b.op("Squeeze", [b.op("Transpose", [scanned], "picks_t", perm=[1, 0, 2]), b.ints("picks_axes", [2])],
                "picks")
