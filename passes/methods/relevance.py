"""`--prompt-weight W`: the prompt's relevance added to a score-based method's own score.

For a method that ranks the tokens of a FEATURES site (the projector output, the tokens the
LLM sees) by one score s [B, N], with W > 0:

    s' = s / max(s) + W · rel                       (per image; max floored at 1e-6)
    rel_i = minmax(-mean_t cos(x_i, e_t))           (CDPruner's relevance, its official sign)

x_i: the site's patch rows (its [CLS] / register prefix left out); e_t: the rows of the
bundle input `text_embeds` [B, T, D_llm] (compiler.prompt: the prompt's rows of the LLM's
embedding table); cosines with norms floored at 1e-12; minmax(r) = (r - min r) / (max r -
min r + 1e-6) per image, as cdpruner's (passes.methods.cdpruner) before its exponential.
The score is brought to the scale of the relevance first (s / max(s), the normalisation
cls applies to its attention and pixel terms; homogeneous, so a method whose later steps
are scale-free, HoloV's crop weights, keeps them), then the relevance is added: W = 1
weighs "looked at" and "asked about" alike. s' replaces s everywhere the method reads it:
its selection, its trace (parity's scores), --budget adaptive's entropy.

The sign is CDPruner's: the official code takes the negative mean similarity as relevance
(LLaVA's projector output and the LLM's word embeddings point apart where a token matches
the prompt); vlmprune keeps it as CDPruner defines it.

Without prompt rows (T = 0: `vlmprune run` without --prompt) the mean over no rows is 0, so
rel = 0 and s' = s / max(s): the method's own ranking, unconditioned. W = 0 (the default)
leaves the method and its graph exactly as without the flag (params drop it), so old
bundles and cache keys stay; W > 0 gives the graph the text_embeds input (Needs.text).

Where: the methods that declare Method.prompt_weight (their reference and emission call
weighted / emit_weighted on the score they rank); refused in one line elsewhere: at a BLOCK
site (block L's hidden states are the tower's width, with no counterpart of the prompt's
LLM-width rows; the features-site form of the method serves), for greedy selections
(divprune, dart, cdpruner: no score to add to; cdpruner is prompt-aware already) and for
the baselines.
"""

from __future__ import annotations

import functools
import math

import onnx_ir as ir
import torch

from vlmprune.compiler.contract import NORM_EPS, SCORE_EPS, SITE_BLOCK as BLOCK
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.selection import GREEDY

NAME = "prompt_weight"
RANGE_EPS = 1e-6  # min-max normalisation's floor (OpenVINO GenAI's cdpruner)

GENERIC = {
    NAME: (float, "W >= 0 (default 0): a score-based method at the projector output ranks by score/max(score) + "
                  "W · relevance to the prompt (CDPruner's: -mean cosine to text_embeds, min-max per image); the "
                  "bundle then takes text_embeds (methods that take it: `vlmprune methods`)"),
}


def weight(params: dict) -> float:
    """W, 0 without the option."""
    return float(params.get(NAME) or 0.0)


def refusal(method, params: dict) -> str:
    """Why `method` with `params` takes no --prompt-weight, or ""."""
    own = method.needs({k: v for k, v in params.items() if k != NAME})  # what it needs without the flag
    if method.baseline:
        return "a baseline ranks no score"
    declared = method.prompt_weight
    if not declared and method.selection == GREEDY:
        what = " (it is prompt-aware already: the prompt weighs its kernel)" if own.text else ""
        return f"its selection is greedy, with no score to add the relevance to{what}"
    if own.site == BLOCK:
        return ("it prunes after block L, whose hidden states are the tower's width and have no counterpart of the "
                "prompt's LLM-width text_embeds; use a score-based method at the projector output (the features "
                "site: holov, cls --score attention)")
    if not declared:
        return "it does not rank the projector output by one score"
    return ""


def parse(method, params: dict) -> dict:
    """Check --prompt-weight for `method`: dropped at 0 (the default), refused in one line where it cannot apply."""
    w = params.get(NAME)
    if w is None:
        return params
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
        raise InputError(f"--prompt-weight must be a finite number >= 0, got {w!r}")
    if w == 0:
        del params[NAME]  # the default: params (and cache keys) as without the flag
        return params
    params[NAME] = float(w)
    why = refusal(method, params)
    if why:
        raise InputError(f"method {method.name} does not take --prompt-weight: {why}")
    return params


def with_prompt(needs):
    """Wrap a Method.needs so that W > 0 adds the prompt (Needs.text): passes.prune then adds text_embeds, parity
    feeds it, the targets that take no prompt input refuse it (base.Method.__init_subclass__ applies this)."""
    @functools.wraps(needs)
    def wrapped(self, params):
        found = needs(self, params)
        if weight(params) > 0 and not found.text:
            import dataclasses

            found = dataclasses.replace(found, text=True)
        return found
    return wrapped


# ---------------------------------------------------------------------------- reference


def relevance(tokens: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """minmax(-mean_t cos(x_i, e_t)) per image: [B, N, D], [B, T, D] -> [B, N] in [0, 1); 0 without rows (T = 0)."""
    unit = tokens / tokens.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    unit_t = text / text.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    r = -(unit @ unit_t.transpose(1, 2)).sum(dim=-1) / max(text.shape[1], 1)
    low, high = r.amin(dim=-1, keepdim=True), r.amax(dim=-1, keepdim=True)
    return (r - low) / (high - low + RANGE_EPS)


def weighted(params: dict, inputs, scores: torch.Tensor) -> torch.Tensor:
    """s / max(s) + W · rel [B, N] (the module docstring); scores unchanged at W = 0."""
    w = weight(params)
    if w == 0:
        return scores
    text = getattr(inputs, "text", None)
    if text is None:
        raise InputError("--prompt-weight needs the prompt's text_embeds, which this source's reference does not give")
    patches = inputs.hidden[:, inputs.prefix:]
    norm = scores / scores.amax(dim=-1, keepdim=True).clamp_min(SCORE_EPS)
    return norm + w * relevance(patches, text.to(patches.dtype)).to(scores.dtype)


# ---------------------------------------------------------------------------- graph


def emit_relevance(b, tokens: ir.Value, text: ir.Value) -> ir.Value:
    """relevance() in standard ops: [B, N]. The mean is a sum over max(T, 1), so T = 0 gives 0."""
    unit = b.l2_normalize(tokens, "prompt_unit_tokens", NORM_EPS)
    unit_t = b.l2_normalize(text, "prompt_unit_text", NORM_EPS)
    cosine = b.op("MatMul", [unit, b.op("Transpose", [unit_t], "prompt_unit_text_t", perm=[0, 2, 1])],
                  "prompt_cosine")  # [B, N, T]
    total = b.reduce("ReduceSum", cosine, [-1], 0, "prompt_cosine_sum")  # [B, N]
    rows = b.op("Cast", [b.op("Gather", [b.op("Shape", [text], "prompt_text_shape"), b.ints("prompt_rows_at", 1)],
                              "prompt_text_rows")], "prompt_text_rows_f", to=ir.DataType.FLOAT)
    count = b.op("Max", [rows, b.scalar("prompt_one_row", 1.0)], "prompt_text_count")
    r = b.op("Neg", [b.op("Div", [total, count], "prompt_cosine_mean")], "prompt_relevance_raw")
    low = b.reduce("ReduceMin", r, [-1], 1, "prompt_relevance_min")
    high = b.reduce("ReduceMax", r, [-1], 1, "prompt_relevance_max")
    span = b.op("Add", [b.op("Sub", [high, low], "prompt_relevance_span"), b.scalar("prompt_range_eps", RANGE_EPS)],
                "prompt_relevance_den")
    return b.op("Div", [b.op("Sub", [r, low], "prompt_relevance_shift"), span], "prompt_relevance")


def emit_weighted(b, params: dict, inputs, scores: ir.Value) -> ir.Value:
    """weighted() in the graph: the score the method's selection then reads; scores itself at W = 0."""
    w = weight(params)
    if w == 0:
        return scores
    if inputs.text is None:
        raise InputError("--prompt-weight needs the text_embeds graph input, which the insertion did not add")
    from vlmprune.passes.methods.builder import INT64_MAX

    patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "prompt_patches") if inputs.prefix else inputs.hidden
    top = b.reduce("ReduceMax", scores, [-1], 1, "prompt_score_max")
    norm = b.op("Div", [scores, b.op("Max", [top, b.scalar("prompt_score_eps", SCORE_EPS)], "prompt_score_den")],
                "prompt_score_norm")
    rel = emit_relevance(b, patches, inputs.text)
    return b.op("Add", [norm, b.op("Mul", [rel, b.scalar("prompt_weight", w)], "prompt_weighted")],
                "prompt_scores")
