"""`dart`: DART's duplication-aware selection on the projector output, as TensorRT Edge-LLM runs it.

On the tokens the LLM sees (the tower's end, after the projector):

1. Pivots: the P tokens (default 4, option --pivots) with the largest L1 norm, in
   descending L1 order. Retained = the pivots; pool = every other token.
2. For each pivot in turn: remaining = K - |retained|; stop if none is left; move the
   ceil(remaining / pivots left) pool tokens least similar to the pivot (lowest cosine,
   denominator max(||p|| · ||c||, 1e-8)) from the pool to retained.
3. Output: the K retained tokens, ascending. No summary. Needs no [CLS]. `--merge local`
   (passes.methods.merge, applied by the base class): the K merged with their pruned
   neighbours, + 1 summary of those with none, the tokens their own keys.

The per-pivot counts depend on K and P only, so every step is a TopK with a constant K
in the graph: no loop, on any target.

Text pivots (--text-pivots P_t, default 0; TensorRT Edge-LLM's --dartPivotTextTokens, the
official code's pivot_text_token): the P_t rows of the prompt's text_embeds (compiler.prompt)
with the largest L1 norm, in descending L1 order, are pivots after the P image pivots. They
take their share of the tokens like any pivot (the counts run over P + P_t pivots, retained
starting at the P image pivots) but are never kept themselves (they are not image tokens).
The official code measures the L1 norms on the LLM's keys at its layer K; on embeddings, as
Edge-LLM runs DART, they are the rows' own. A prompt shorter than P_t rows is refused.

Choices where the reference implementations are batch-1 only or silent:
- ties go to the lower index, in the pivot TopK and in each lowest-cosine TopK;
- with a [CLS] token in the features (select strategy `full`), [CLS] passes through and
  only patch tokens are selected;
- P must not exceed K (the pivots are always kept).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import COSINE_EPS, SITE_FEATURES
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import (CROPS_EACH, GREEDY, GraphInputs, Method, Needs, SiteTensors,
                                           TorchResult, positive_int)
from vlmprune.passes.methods.builder import INT64_MAX, SCORE, SELECT, TOKENS
from vlmprune.passes.methods.selection import gather_rows, relative_margin, split_prefix, topk_lower_index

# Retained tokens are excluded with a finite sentinel in the graph (cosines lie in [-1, 1]): quantizers
# and fp16 toolchains calibrate every tensor, and an infinity breaks rknn-toolkit2's int8 calibration.
SENTINEL = 1e4


def pivot_counts(keep: int, pivots: int, text_pivots: int = 0) -> list[int]:
    """Tokens each pivot (image pivots, then text pivots) moves to retained, in pivot order (zeros dropped)."""
    counts, retained, total = [], pivots, pivots + text_pivots
    for j in range(total):
        remaining = keep - retained
        if remaining <= 0:
            break
        take = math.ceil(remaining / (total - j))
        counts.append(take)
        retained += take
    return counts


class DartMethod(Method):
    name = "dart"
    summary = "DART: P pivots by L1 norm, then per pivot the least similar tokens (TensorRT Edge-LLM's variant)"
    selection = GREEDY
    options = {"pivots": (int, "dart: pivot tokens P, chosen by the largest L1 norm (default 4)"),
               "text_pivots": (int, "dart: text pivots P_t, the prompt's text_embeds rows of largest L1 norm "
                                    "(default 0; Edge-LLM's --dartPivotTextTokens)")}
    official = "https://github.com/ZichenWen1/DART (as TensorRT Edge-LLM runs it on embeddings)"
    local_merge = True  # --merge local: its output is the kept rows (base.Method.__init_subclass__)
    crop_form = CROPS_EACH  # anyres crops: run on each crop with an equal share of K (passes.methods.crops)

    def defaults(self, keep: int) -> dict:
        return {"pivots": 4, "text_pivots": 0}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        pivots = params["pivots"]
        if isinstance(pivots, bool) or not isinstance(pivots, int) or not 1 <= pivots <= keep:
            raise InputError(f"--pivots of method dart must be an integer with 1 <= pivots <= keep ({keep}), "
                             f"got {pivots!r}")
        positive_int(self.name, "text-pivots", params["text_pivots"], 0)
        return params

    def needs(self, params: dict) -> Needs:
        return Needs(site=SITE_FEATURES, text=params.get("text_pivots", 0) > 0)

    def min_text_rows(self, params: dict) -> int:
        return params.get("text_pivots", 0)

    def describe(self, params: dict) -> str:
        text = f" + {params['text_pivots']} text pivots" if params.get("text_pivots") else ""
        return f"DART: {params['pivots']} pivots by L1 norm{text}, {params['keep']} tokens least similar to them"

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        keep, p, pt = params["keep"], params["pivots"], params.get("text_pivots", 0)
        cls, x = split_prefix(inputs.hidden, inputs.prefix)
        l1 = x.abs().sum(dim=-1)
        pivots = topk_lower_index(l1, p)
        steps = [(pivots, relative_margin(l1, p))]
        norms = x.norm(dim=-1)
        vectors, vector_norms = gather_rows(x, pivots), torch.gather(norms, 1, pivots)  # [B, P (+ P_t), D], [B, ..]
        if pt:
            text = getattr(inputs, "text", None)
            if text is None or text.shape[1] < pt:
                raise InputError(f"dart --text-pivots {pt} needs a prompt of at least {pt} text_embeds rows, got "
                                 f"{0 if text is None else text.shape[1]}")
            text = text.to(x.dtype)
            rows = gather_rows(text, topk_lower_index(text.abs().sum(dim=-1), pt))
            vectors, vector_norms = torch.cat([vectors, rows], dim=1), torch.cat([vector_norms, rows.norm(dim=-1)], 1)
        excluded = torch.zeros_like(l1).scatter(1, pivots, float("inf"))
        retained = [pivots]
        for j, take in enumerate(pivot_counts(keep, p, pt)):
            vector = vectors[:, j: j + 1]  # [B, 1, D]
            dots = (x @ vector.transpose(1, 2)).squeeze(-1)
            cosine = dots / (norms * vector_norms[:, j: j + 1]).clamp_min(COSINE_EPS)
            candidates = cosine + excluded
            picks = topk_lower_index(candidates, take, largest=False)
            steps.append((picks, relative_margin(candidates, take, largest=False)))
            excluded = excluded.scatter(1, picks, float("inf"))
            retained.append(picks)
        kept = torch.cat(retained, dim=1).sort(dim=-1).values
        return TorchResult(torch.cat([*cls, gather_rows(x, kept)], dim=1), kept, {"steps": steps})

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        keep, p, pt = params["keep"], params["pivots"], params.get("text_pivots", 0)
        with b.role(TOKENS):
            cls = [b.slice(inputs.hidden, 0, inputs.prefix, 1, "cls")] if inputs.prefix else []
            x = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else inputs.hidden
        with b.role(SCORE):
            l1 = b.reduce("ReduceSum", b.op("Abs", [x], "abs"), [-1], 0, "l1")  # [B, N]
            norms = b.reduce("ReduceL2", x, [-1], 0, "norms")
        with b.role(SELECT):
            _, pivots = b.op("TopK", [l1, b.ints("k_pivots", [p])], "pivots", num_outputs=2, axis=-1, largest=1,
                             sorted=1)
            zeros = b.op("ConstantOfShape", [b.op("Shape", [l1], "l1_shape")], "zeros",
                         value=ir.tensor(np.zeros([1], np.float32)))
            excluded = self._exclude(b, zeros, pivots, "excluded0")
        retained = [pivots]
        if pt:  # the prompt's pivots: its rows of largest L1 norm (module docstring)
            if inputs.text is None:
                raise InputError("dart --text-pivots needs the text_embeds input, which this graph was not given")
            with b.role(SELECT):
                text_l1 = b.reduce("ReduceSum", b.op("Abs", [inputs.text], "text_abs"), [-1], 0, "text_l1")
                _, text_pivots = b.op("TopK", [text_l1, b.ints("k_text_pivots", [pt])], "text_pivots", num_outputs=2,
                                      axis=-1, largest=1, sorted=1)
        for j, take in enumerate(pivot_counts(keep, p, pt)):
            with b.role(SCORE):
                if j < p:
                    pivot = b.slice(pivots, j, j + 1, 1, f"pivot{j}")  # [B, 1]
                    xp = b.gather_rows(x, pivot, f"pivot{j}_token")  # [B, 1, D]
                    norm_p = b.op("GatherElements", [norms, pivot], f"pivot{j}_norm", axis=1)
                else:
                    pivot = b.slice(text_pivots, j - p, j - p + 1, 1, f"pivot{j}")
                    xp = b.gather_rows(inputs.text, pivot, f"pivot{j}_token")
                    norm_p = b.reduce("ReduceL2", xp, [-1], 0, f"pivot{j}_norm")  # [B, 1]
                dots = b.squeeze(b.op("MatMul", [x, b.op("Transpose", [xp], f"pivot{j}_t", perm=[0, 2, 1])],
                                      f"pivot{j}_dots"), [2], f"pivot{j}_dot")
                den = b.op("Max", [b.op("Mul", [norms, norm_p], f"pivot{j}_norms"), b.scalar(f"pivot{j}_eps",
                                                                                           COSINE_EPS)],
                           f"pivot{j}_den")
                cosine = b.op("Div", [dots, den], f"pivot{j}_cosine")
            with b.role(SELECT):
                candidates = b.op("Add", [cosine, excluded], f"pivot{j}_candidates")
                _, picks = b.op("TopK", [candidates, b.ints(f"k{j}", [take])], f"pivot{j}_picks", num_outputs=2,
                                axis=-1, largest=0, sorted=1)
                excluded = self._exclude(b, excluded, picks, f"excluded{j + 1}")
                retained.append(picks)
        with b.role(SELECT):
            joined = b.op("Concat", retained, "retained", axis=1) if len(retained) > 1 else pivots
            kept = b.sort_ascending(joined, keep, "kept")
        with b.role(TOKENS):
            gathered = b.gather_rows(x, kept, "gather_kept")
            tokens = b.op("Concat", [*cls, gathered], "tokens", axis=1) if cls else gathered
        return tokens, kept

    @staticmethod
    def _exclude(b, excluded: ir.Value, picks: ir.Value, name: str) -> ir.Value:
        """+SENTINEL at picks: a retained token is never a candidate again."""
        fill = b.op("Expand", [b.scalar(f"{name}_sentinel", SENTINEL), b.op("Shape", [picks], f"{name}_shape")],
                    f"{name}_fill")
        return b.op("ScatterElements", [excluded, picks, fill], name, axis=1)
