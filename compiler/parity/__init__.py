"""Stage-wise parity against the reference (docs/design.md, "Parity").

Results are data: per-output error statistics, kept-index agreement with what explains
a mismatch, per-output tolerances with defaults by precision, serialised to
parity.json. A stage that cannot run is recorded as failed with its reason;
`vlmprune check` exits non-zero when any stage fails.

Kept indices are compared by the method's selection kind:
- score-based selections (cls, visionzip's dominant tokens): agreement |ref ∩ cand| / K,
  the near-ties at the K-th boundary, and whether every differing index lies in that
  tie band (then a lower precision resolved a tie differently: reported, and passed);
- greedy selections (divprune, dart): agreement, the first step whose reference pick the
  candidate lacks, and the margin between the best two candidates at that step; a
  divergence at a step whose margin is inside the tie band is a tie resolved differently.
Images resolved differently by a tie are left out of the value comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from vlmprune.compiler.parity.reference import FEATURES, KEPT, NUM_TOKENS, Reference
from vlmprune.compiler.frontend import roi_input as roi
from vlmprune.compiler.frontend.prompt_input import parity_text_feed
from vlmprune.passes.methods.base import GREEDY
from vlmprune.passes.methods.selection import TIE_SHARE_MAX, boundary_ties, tie_band


def parity_feeds(pixel_values: np.ndarray, inputs) -> dict[str, np.ndarray]:
    """What parity feeds a graph beside the pixels, [B, ...] each, for the inputs among `inputs` (a manifest's or a
    graph's: name and shape): a prompt-aware graph's text_embeds, an --roi graph's ROI, the fixed-seed ones
    (compiler.prompt, compiler.roi). The stages' runners get them explicitly (compiler.pipeline.in_chunks)."""
    return {**parity_text_feed(pixel_values, inputs), **roi.parity_roi_feed(pixel_values, inputs)}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    cosine_min: float
    max_abs: float | None = None
    index_agreement_min: float = 1.0
    tie_rel_tol: float = 1e-5  # scores (or greedy margins) this close count as tied
    rtol: float | None = None  # when set: every element within max_abs (or 0) + rtol·|reference| (numpy's allclose)
    # max_abs grows by scale_rel · max|reference| over the output (docs/design.md, "Parity"): an absolute floor plus a
    # term relative to the output's scale, since fp32 rounding of features in the hundreds alone exceeds a fixed 1e-4.
    scale_rel: float | None = None
    tie_share_max: float = TIE_SHARE_MAX  # a tie band holds at most this share of K (selection.tie_band)

    def max_abs_bound(self, scale: float) -> float | None:
        """The max-abs bound of an output whose largest reference magnitude is `scale` (None: not checked)."""
        if self.max_abs is None:
            return None
        return self.max_abs + (self.scale_rel or 0.0) * scale


DEFAULT_TOLERANCES = {
    "fp32": Tolerance(0.99999, 1e-4, 1.0, 1e-5, scale_rel=1e-5),
    "fp16": Tolerance(0.999, None, 1.0, 1e-3),
    "int16": Tolerance(0.99, None, 0.99, 1e-2),
    "int8": Tolerance(0.99, None, 0.99, 1e-2),
    # ort --precision int8 (targets.ort_quant): int8 features, but the kept indices come from the fp32 score path,
    # so they are held to fp32's agreement and tie band; min token cosine 0.98 (measured 0.98+ on DINOv2-S).
    "int8-fp32-score": Tolerance(0.98, None, 1.0, 1e-5),
    # openvino --precision bf16 (INFERENCE_PRECISION_HINT bf16): 8 bits of mantissa (a relative step of 2^-8) through
    # the score path too, so scores this close count as tied and a swap at the K-th boundary is reported, features
    # compared on the tokens both sides kept (token_rows).
    "bf16": Tolerance(0.99, None, 0.99, 1e-2),
    # openvino --precision int8-bf16: int8 features (int8-fp32-score's cosine), the kept set from a bf16 score path
    # (bf16's agreement and tie band)
    "int8-bf16": Tolerance(0.98, None, 0.99, 1e-2),
}


def tolerance_for(precision: str, overrides: dict | None = None) -> Tolerance:
    base = DEFAULT_TOLERANCES[precision]
    return dataclasses.replace(base, **(overrides or {}))


def figure_text(value: float, digits: int = 7, at_least: float | None = None, at_most: float | None = None) -> str:
    """value to `digits` significant digits, or as many more as the text needs to pass or fail the bound as the
    value does: a cosine of 0.99999997 held to at least 1 must not read "1", nor a max-abs of 1.00004e-4 held to
    at most 1e-4 read "0.0001"."""
    def holds(x: float) -> bool:
        return (at_least is None or x >= at_least) and (at_most is None or x <= at_most)

    text = f"{value:.{digits}g}"
    if np.isfinite(value):
        while holds(float(text)) != holds(value):  # ends by 17 digits, which are exact
            digits += 1
            text = f"{value:.{digits}g}"
    return text


def summary_bounds(tol: Tolerance, features: dict | None = None) -> dict[str, dict]:
    """figure_text's bound for each figure of stage_summary() (none where a figure is reported, not checked).

    features: the stage's image_features comparison, which holds its own tolerance where check overrode it."""
    features = features or {}
    if features.get("tolerance"):
        tol = Tolerance(**features["tolerance"])
    bound = features.get("max_abs_bound", tol.max_abs)
    return {"cosine_min": {"at_least": tol.cosine_min}, "index_agreement": {"at_least": tol.index_agreement_min},
            "max_abs": {"at_most": bound} if tol.rtol is None else {}}


def _agreement(ref: np.ndarray, cand: np.ndarray) -> list[float]:
    keep = ref.shape[1]
    return [len(np.intersect1d(r, c)) / keep for r, c in zip(ref, cand)]


def compare_indices(ref: np.ndarray, cand: np.ndarray, ref_scores: np.ndarray | None, tol: Tolerance,
                    boundary: int | None = None, earlier: list[tuple[np.ndarray, int]] = ()) -> dict:
    """Kept-index agreement per image for a score-based selection, and whether mismatches sit in boundary ties.

    boundary: where the ranked selection's cut is (default: all K kept indices were ranked).
    earlier: a --schedule's earlier steps, (scores [B, N] in original patch coordinates, K_s) each: an index kept
    by one side only may also sit in the tie band of an earlier step's cut (a tie there, resolved differently,
    which the later steps carry on); their boundary ties are reported per step.
    """
    keep = boundary or ref.shape[1]
    per_image = _agreement(ref, cand)
    ties, tie_resolved = None, []
    if ref_scores is not None:
        scores = np.asarray(ref_scores, dtype=np.float64)
        ties = boundary_ties(torch.from_numpy(scores), keep, tol.tie_rel_tol, tol.tie_share_max).tolist()
        cuts = [(scores, keep), *((np.asarray(s, dtype=np.float64), k) for s, k in earlier)]
        tie_resolved = [i for i, (r, c) in enumerate(zip(ref, cand)) if per_image[i] < 1.0
                        and in_some_band(r, c, [(s[i], k) for s, k in cuts], tol.tie_rel_tol, tol.tie_share_max)]
    result = {"agreement": float(np.mean(per_image)), "per_image": per_image, "boundary_ties": ties,
              "tie_resolved_images": tie_resolved}
    if earlier:
        result["step_boundary_ties"] = [boundary_ties(torch.from_numpy(np.asarray(s, dtype=np.float64)), k,
                                                      tol.tie_rel_tol, tol.tie_share_max).tolist()
                                        for s, k in earlier]
    return _verdict(result, tol)


def compare_local_cuts(ref: np.ndarray, cand: np.ndarray, cuts: list, tol: Tolerance) -> dict:
    """Kept-index agreement for a selection made of several independent TopKs, each over its own span of positions
    (DyCoke: one per pruned frame), and whether every mismatch sits in the tie band of its own span's cut.

    cuts: (start, scores [B, n], K) each: the span is positions start .. start + n - 1, the cut keeps its K best
    scores (higher is kept). An index kept by one side only must lie in some span and score within that span's
    tie band (selection.tie_band: a still frame's cosines sit within a few ulps of 1, all of them ties)."""
    per_image = _agreement(ref, cand)
    spans = [(int(start), np.asarray(scores, dtype=np.float64), int(k)) for start, scores, k in cuts]
    ties = sum((boundary_ties(torch.from_numpy(s), k, tol.tie_rel_tol, tol.tie_share_max) for _, s, k in spans),
               torch.zeros(len(ref), dtype=torch.long)).tolist()  # per image, over its spans

    def explained(r: np.ndarray, c: np.ndarray, i: int) -> bool:
        """Every index kept by one side only lies in a span, within that span's cut's tie band."""
        differing = np.setxor1d(r, c)
        for start, s, k in spans:
            here = (differing >= start) & (differing < start + s.shape[1])
            if here.any() and not mismatch_in_band(differing[here] - start, np.array([], dtype=differing.dtype),
                                                   s[i], k, tol.tie_rel_tol, tol.tie_share_max):
                return False
            differing = differing[~here]
        return differing.size == 0

    tie_resolved = [i for i, (r, c) in enumerate(zip(ref, cand)) if per_image[i] < 1.0 and explained(r, c, i)]
    return _verdict({"agreement": float(np.mean(per_image)), "per_image": per_image, "boundary_ties": ties,
                     "tie_resolved_images": tie_resolved}, tol)


def in_some_band(ref: np.ndarray, cand: np.ndarray, cuts: list[tuple[np.ndarray, int]], rel: float,
                 max_share: float = TIE_SHARE_MAX) -> bool:
    """True when every index kept by only one side lies in the (narrowed) tie band of one of the cuts (scores, K):
    the band of each cut holds at most max_share of its K (selection.tie_band)."""
    differing = np.setxor1d(ref, cand)
    near = np.zeros(len(differing), dtype=bool)
    for scores, keep in cuts:
        ordered = np.sort(scores)[::-1]
        cut = 0.5 * (ordered[keep - 1] + ordered[keep])
        near |= np.abs(scores[differing] - cut) <= tie_band(scores, rel, keep, max_share)
    return bool(near.all())


def mismatch_in_band(ref: np.ndarray, cand: np.ndarray, scores: np.ndarray, keep: int, rel: float,
                     max_share: float = TIE_SHARE_MAX) -> bool:
    """True when every index kept by only one side scores within the (narrowed) tie band of the K-th boundary."""
    ordered = np.sort(scores)[::-1]
    cut = 0.5 * (ordered[keep - 1] + ordered[keep])
    differing = np.setxor1d(ref, cand)
    return bool(np.all(np.abs(scores[differing] - cut) <= tie_band(scores, rel, keep, max_share)))


def compare_greedy(ref: np.ndarray, cand: np.ndarray, steps: list | None, tol: Tolerance) -> dict:
    """Agreement of a greedy selection, the first step each image diverged at and the margin there.

    steps: the reference's picks in order, [(picks [B, n], margin [B]), ...]; a margin is
    the distance between the step's last pick and the best candidate left out, relative
    to the largest candidate value of that step, so a divergence at a step with a margin
    inside the tie band is a tie resolved differently.
    """
    per_image = _agreement(ref, cand)
    first_step, margins, tie_resolved = [], [], []
    for i, c in enumerate(cand):
        step = margin = None
        if per_image[i] < 1.0 and steps:
            have = set(np.asarray(c).tolist())
            for s, (picks, gap) in enumerate(steps):
                if not set(np.asarray(picks[i]).reshape(-1).tolist()) <= have:
                    step, margin = s, float(gap[i])
                    break
            if margin is not None and margin <= tol.tie_rel_tol:
                tie_resolved.append(i)
        first_step.append(step)
        margins.append(margin)
    return _verdict({"agreement": float(np.mean(per_image)), "per_image": per_image,
                     "first_divergent_step": first_step, "margin_at_divergence": margins,
                     "tie_resolved_images": tie_resolved}, tol)


def _verdict(result: dict, tol: Tolerance) -> dict:
    unexplained = [a for i, a in enumerate(result["per_image"]) if i not in result["tie_resolved_images"]]
    result["passed"] = bool((min(unexplained) if unexplained else 1.0) >= tol.index_agreement_min)
    return result


def compare_tokens(ref: np.ndarray, cand: np.ndarray, tol: Tolerance, skip_images: list[int] = (),
                   row_margins: np.ndarray | None = None, common_rows: dict | None = None) -> dict:
    """max-abs, mean-abs and the minimum cosine over tokens.

    Images resolved differently by a tie are compared on the rows of the tokens both sides kept
    (common_rows: {image: (reference rows, candidate rows)}, see token_rows), or left out where
    that is not known; reference rows that are NaN (rows the reference cannot define, see
    compiler.parity.reference) and merged rows whose merge decision lies in the tie band
    (row_margins, e.g. visionzip's contextual tokens) are left out too: all counted in the
    result, not hidden. A comparison of no row at all fails: it showed nothing.
    """
    if ref.shape != cand.shape:
        return {"passed": False, "error": f"shape {list(cand.shape)} != reference {list(ref.shape)}"}
    common_rows = {i: rows for i, rows in (common_rows or {}).items() if i in set(skip_images) and len(rows[0])}
    keep = [i for i in range(ref.shape[0]) if i not in set(skip_images)]
    if row_margins is not None and row_margins.shape[1] == ref.shape[1] + 1:  # [CLS] dropped after the site
        row_margins = row_margins[:, 1:]
    if row_margins is None or row_margins.shape != ref.shape[:2]:
        row_margins = np.full(ref.shape[:2], np.inf)
    picks = [(i, np.arange(ref.shape[1]), np.arange(ref.shape[1])) for i in keep]
    picks += [(i, np.asarray(rr), np.asarray(cr)) for i, (rr, cr) in sorted(common_rows.items())]
    if not picks:
        return {"passed": False, "error": "no image compared: every image's kept set differs from the reference's "
                                          "(by a boundary tie), and which rows both kept is not known"}
    r = np.concatenate([ref[i, rr] for i, rr, _ in picks]).astype(np.float64).reshape(-1, ref.shape[-1])
    c = np.concatenate([cand[i, cr] for i, _, cr in picks]).astype(np.float64).reshape(-1, ref.shape[-1])
    margins = np.concatenate([np.asarray(row_margins)[i, rr] for i, rr, _ in picks]).reshape(-1)
    defined = ~np.isnan(r).any(axis=1)
    tied = (margins <= tol.tie_rel_tol) & defined
    finite = ref[np.isfinite(ref)]
    scale = float(np.abs(finite).max()) if finite.size else 0.0  # the output's largest magnitude
    r, c = r[defined & ~tied], c[defined & ~tied]
    if not len(r):
        return {"passed": False, "error": "the reference defines no row to compare"}
    diff = np.abs(r - c)
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(c, axis=1)
    cosine = np.where(norms > 0, (r * c).sum(axis=1) / np.maximum(norms, 1e-30), 1.0)
    result = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "cosine_min": float(cosine.min()),
              "images_compared": keep, "rows_compared": int(len(r))}
    if common_rows:  # what was compared of the images a tie resolved differently
        result["images_compared_on_common_tokens"] = {str(i): int(len(rr)) for i, (rr, _) in
                                                      sorted(common_rows.items())}
    left_out = sorted(set(skip_images) - set(common_rows))
    if left_out:
        result["images_not_compared"] = left_out
    if not defined.all():
        result["rows_not_compared"] = int((~defined).sum())
    if tied.any():
        result["rows_in_tie_band"] = int(tied.sum())
    if tol.rtol is None:
        bound = tol.max_abs_bound(scale)
        if bound is not None:
            result["max_abs_bound"], result["reference_max_abs"] = bound, scale
        ok = result["cosine_min"] >= tol.cosine_min and (bound is None or result["max_abs"] <= bound)
    else:  # --rtol given: the elementwise allclose test replaces the max-abs one
        bound = (tol.max_abs or 0.0) + tol.rtol * np.abs(r)
        result["max_rel"] = float((diff / np.maximum(np.abs(r), 1e-30)).max())
        result["allclose_violations"] = int((diff > bound).sum())
        ok = result["cosine_min"] >= tol.cosine_min and result["allclose_violations"] == 0
    result["passed"] = bool(ok)
    return result


# --atol / --rtol / --cosine of `vlmprune check`, and the Tolerance field each one sets.
OVERRIDE_FIELDS = {"atol": "max_abs", "rtol": "rtol", "cosine": "cosine_min"}


def parse_overrides(given: dict[str, tuple[str, ...]], value_outputs: list[str], index_outputs: list[str] = ()) -> dict:
    """{"atol": ("1e-3", "image_features:1e-4"), ...} -> {output: {field: value}} (Polygraphy's spelling:
    a bare value applies to every value output, OUTPUT:VALUE to that output only; later ones win)."""
    from vlmprune.compiler.errors import InputError

    out: dict[str, dict] = {}
    for flag, specs in given.items():
        field = OVERRIDE_FIELDS[flag]
        for spec in specs or ():
            name, _, text = spec.rpartition(":")
            try:
                value = float(text)
            except ValueError:
                raise InputError(f"--{flag} {spec}: not a number (use VALUE or OUTPUT:VALUE)") from None
            if not np.isfinite(value) or value < 0 or (flag == "cosine" and value > 1):
                raise InputError(f"--{flag} {spec}: must be finite and " + ("in [0, 1]" if flag == "cosine" else ">= 0"))
            if name and name in index_outputs:
                raise InputError(f"--{flag} {spec}: {name} is compared by kept-index agreement, not by values")
            if name and name not in value_outputs:
                raise InputError(f"--{flag} {spec}: the bundle has no output {name!r} "
                                 f"(its value outputs: {', '.join(value_outputs)})")
            for target in ([name] if name else value_outputs):
                out.setdefault(target, {})[field] = value
                if flag == "atol":  # the bound given is the whole bound: no term relative to the output's scale
                    out[target]["scale_rel"] = None
    return out


@dataclasses.dataclass
class StageResult:
    stage: str
    runtime: str
    precision: str
    tolerance: Tolerance
    passed: bool
    outputs: dict = dataclasses.field(default_factory=dict)
    indices: dict | None = None
    error: str | None = None

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["tolerance"] = dataclasses.asdict(self.tolerance)
        return data

    @classmethod
    def from_json(cls, data: dict) -> StageResult:
        """The inverse of to_json (compiler.pipeline.cache keeps the export stage's result this way)."""
        return cls(**{**data, "tolerance": Tolerance(**data["tolerance"])})


def run_stage(stage: str, runtime: str, precision: str, run: Callable[[np.ndarray], dict[str, np.ndarray]],
              pixel_values: np.ndarray, reference: Reference, overrides: dict | None = None,
              output_overrides: dict[str, dict] | None = None) -> StageResult:
    """Run one stage's candidate on the parity inputs and compare every output the reference has.

    run: the candidate, a callable of the pixels with the inputs beside them bound (parity_feeds: the fixed-seed
    prompt rows and ROI, compiler.pipeline.in_chunks). overrides: Tolerance fields for the whole stage;
    output_overrides: per output name (parse_overrides), recorded beside that output's figures.
    """
    tol = tolerance_for(precision, overrides)
    try:
        outputs = run(pixel_values)
    except Exception as exc:  # the candidate runtime failed: a failed stage, with its reason
        return StageResult(stage, runtime, precision, tol, False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = StageResult(stage, runtime, precision, tol, True)
    expected = reference.outputs
    k_ties: list[int] = []
    if NUM_TOKENS in expected:  # K varies per image: valid rows by value, the count exactly, padding zero
        expected, k_ties = padding_checked(result, expected, outputs, reference.trace or {}, tol)
    skip: list[int] = []
    if KEPT in expected:
        if KEPT not in outputs:
            result.passed, result.error = False, f"candidate has no {KEPT} output"
            return result
        result.indices = _indices(reference, outputs[KEPT].astype(np.int64), tol, k_ties)
        result.indices["kept"] = outputs[KEPT].astype(np.int64).tolist()  # what the report draws
        skip = result.indices["tie_resolved_images"]
        result.passed &= result.indices["passed"]
        forced = (reference.trace or {}).get("forced")
        if forced is not None:  # --roi: every forced patch kept, whatever the scores (compiler.roi.forced_check)
            result.outputs["roi_forced"] = roi.forced_check(forced, outputs[KEPT])
            result.passed &= result.outputs["roi_forced"]["passed"]
    for name, ref in expected.items():
        if name == KEPT:
            continue
        if name not in outputs:
            result.outputs[name] = {"passed": False, "error": "missing from the candidate"}
        else:
            if np.issubdtype(np.asarray(ref).dtype, np.integer):  # positions: exact, where the kept index agrees
                result.outputs[name] = compare_exact(ref, outputs[name], expected.get(KEPT), outputs.get(KEPT))
                result.passed &= result.outputs[name]["passed"]
                continue
            margins = (reference.trace or {}).get("row_margins") if name == FEATURES else None
            own = (output_overrides or {}).get(name)
            out_tol = dataclasses.replace(tol, **own) if own else tol
            if name == FEATURES and result.indices and "per_image" in result.indices and NUM_TOKENS not in expected:
                # every image whose kept set differs (a tie or not): its rows by position are other tokens' rows,
                # so it is compared on the tokens both sides kept
                differ = sorted(set(skip) | {i for i, a in enumerate(result.indices["per_image"]) if a < 1.0})
                common = token_rows(reference, outputs[KEPT], np.shape(ref)[1], differ)
                result.outputs[name] = compare_tokens(ref, outputs[name], out_tol, differ, margins, common)
            else:
                result.outputs[name] = compare_tokens(ref, outputs[name], out_tol, skip, margins)
            if own:
                result.outputs[name]["tolerance"] = dataclasses.asdict(out_tol)
        result.passed &= result.outputs[name]["passed"]
    return result


def token_rows(reference: Reference, cand_kept: np.ndarray, rows: int, images: list[int]) -> dict:
    """{image: (reference rows, candidate rows)} of image_features for the patches both sides kept, and the
    prefix rows ([CLS]) both have, for images whose kept sets differ: the output is [prefix] + the method's
    copied rows in kept order + its other rows (Method.output_tokens, copied_rows); merged and summary rows
    depend on the whole set and are not among them. Empty where the method is not known (an .onnx source's
    graph reference without one) or the layout does not fit (anyres crops)."""
    method, params, ref_kept = reference.method, reference.params, reference.outputs.get(KEPT)
    if method is None or params is None or ref_kept is None or np.shape(cand_kept) != np.shape(ref_kept):
        return {}
    try:
        lead, copied = rows - method.output_tokens(params), method.copied_rows(params)
    except (KeyError, TypeError):
        return {}
    if lead < 0 or lead + copied > rows or copied > np.shape(ref_kept)[1]:
        return {}
    out = {}
    for i in images:
        r, c = np.asarray(ref_kept[i][:copied]), np.asarray(cand_kept[i][:copied])
        both = method.comparable_rows(params, r, c)
        ref_rows = list(range(lead)) + [lead + int(np.flatnonzero(r == p)[0]) for p in both]
        cand_rows = list(range(lead)) + [lead + int(np.flatnonzero(c == p)[0]) for p in both]
        out[i] = (ref_rows, cand_rows)
    return out


def padding_checked(result: StageResult, expected: dict, outputs: dict, trace: dict | None = None,
                    tol: Tolerance | None = None) -> tuple[dict, list[int]]:
    """Variable K (docs/design.md, "Variable K"): num_tokens must be exact and the candidate's rows after each image's
    num_tokens exactly zero (recorded in result); returns the expected outputs with those rows NaN in the reference's
    image_features, so that the value comparison covers each image's valid rows only, and the images whose count
    differs by a K decision tie (k_decision_ties).

    A K decision tie: `--budget adaptive` rounds ρ·N (the trace's budget_rows) to K; where the reference's ρ·N lies
    within the precision's tie band of a half-integer, a lower precision may round it to the other side. That image's
    count may then differ by one: reported, passed, and left out of the value and index comparison, as an image
    whose kept set a boundary tie resolved differently is."""
    ref_rows = np.asarray(expected[NUM_TOKENS]).astype(np.int64)
    cand_rows, k_ties = ref_rows, []
    if NUM_TOKENS not in outputs:
        result.outputs[NUM_TOKENS] = {"passed": False, "error": "missing from the candidate"}
    else:
        cand_rows = np.asarray(outputs[NUM_TOKENS]).astype(np.int64).reshape(ref_rows.shape)
        k_ties = k_decision_ties(ref_rows, cand_rows, trace or {}, tol)
        differ = cand_rows != ref_rows
        wrong = int(differ.sum()) - len(k_ties)  # "exact" rows: as compiler.report draws integer outputs
        result.outputs[NUM_TOKENS] = {"passed": wrong == 0, "exact": True, "rows_compared": int(ref_rows.size),
                                      "rows_wrong": wrong, "reference": ref_rows.tolist(),
                                      "candidate": cand_rows.tolist()}
        if k_ties:
            result.outputs[NUM_TOKENS]["k_decision_ties"] = k_ties
    result.passed &= result.outputs[NUM_TOKENS]["passed"]
    expected = {k: v for k, v in expected.items() if k != NUM_TOKENS}
    if FEATURES in expected and FEATURES in outputs and np.shape(outputs[FEATURES]) == np.shape(expected[FEATURES]):
        feats = np.asarray(expected[FEATURES]).astype(np.float64)
        rows = np.where(np.isin(np.arange(len(ref_rows)), k_ties), cand_rows, ref_rows)  # a tie: the candidate's
        padding = np.arange(feats.shape[1])[None, :] >= rows[:, None]
        nonzero = int((np.asarray(outputs[FEATURES])[padding] != 0).any(axis=-1).sum())
        result.outputs["padding"] = {"passed": nonzero == 0, "exact": True, "rows_compared": int(padding.sum()),
                                     "rows_wrong": nonzero}  # padding rows that are not all zero
        result.passed &= nonzero == 0
        feats[padding] = np.nan  # not compared by value: checked zero above
        expected[FEATURES] = feats
    return expected, k_ties


def k_decision_ties(ref_rows: np.ndarray, cand_rows: np.ndarray, trace: dict, tol: Tolerance | None) -> list[int]:
    """Images whose count differs by one where the reference's ρ·N sits within the tie band of the half-integer
    that rounding cuts at (padding_checked); none without the trace's budget_rows."""
    if tol is None or "budget_rows" not in trace:
        return []
    rho_n = np.asarray(trace["budget_rows"], dtype=np.float64).reshape(-1)
    k_ref = np.asarray(trace["keep"]).reshape(-1)
    kmin, kmax = trace.get("budget_range", (1, np.inf))
    ties = []
    for i, (r, c) in enumerate(zip(ref_rows.reshape(-1).tolist(), cand_rows.reshape(-1).tolist())):
        if abs(r - c) != 1:
            continue
        k_cand = int(k_ref[i]) + (c - r)  # the rows past K (prefix, summary) are the same on both sides
        if not kmin <= k_cand <= kmax:
            continue
        cut = min(int(k_ref[i]), k_cand) + 0.5  # where round() moves from the one K to the other
        if abs(rho_n[i] - cut) <= tol.tie_rel_tol * max(abs(rho_n[i]), 1.0):
            ties.append(i)
    return ties


def compare_exact(ref: np.ndarray, cand: np.ndarray, ref_kept: np.ndarray | None = None,
                  cand_kept: np.ndarray | None = None) -> dict:
    """An integer output (kept tokens' positions) must be exact: no tolerance turns a wrong position right.

    Positions belong to kept tokens, so rows are compared where both sides kept the same
    patch at the same place (a boundary tie a lower precision resolves differently is
    judged by the index comparison, not here); rows compared and rows that differ are reported.
    """
    ref, cand = np.asarray(ref).astype(np.int64), np.asarray(cand).astype(np.int64)
    if ref.shape != cand.shape:
        return {"passed": False, "error": f"shape {list(cand.shape)}, expected {list(ref.shape)}"}
    rows = np.ones(ref.shape[:2], dtype=bool)
    if ref_kept is not None and cand_kept is not None and np.shape(ref_kept) == ref.shape[:2]:
        rows = np.asarray(ref_kept).astype(np.int64) == np.asarray(cand_kept).astype(np.int64)
    wrong = int((ref != cand).reshape(*ref.shape[:2], -1).any(-1)[rows].sum())
    return {"passed": wrong == 0, "exact": True, "rows_compared": int(rows.sum()), "rows_wrong": wrong}


def _indices(reference: Reference, cand: np.ndarray, tol: Tolerance, k_ties: list[int] = ()) -> dict:
    ref = reference.outputs[KEPT]
    if ref.shape != cand.shape:
        return {"passed": False, "agreement": 0.0, "per_image": [], "tie_resolved_images": [],
                "error": f"shape {list(cand.shape)} != reference {list(ref.shape)}"}
    trace = reference.trace or {}
    if NUM_TOKENS in reference.outputs:  # padded with -1: agreement over each image's valid indices
        valid = lambda row: np.asarray(row)[np.asarray(row) >= 0]  # noqa: E731
        per_image = [len(np.intersect1d(valid(r), valid(c))) / max(len(valid(r)), len(valid(c)), 1)
                     for r, c in zip(ref, cand)]
        # A ranked cut at each image's own K (--budget adaptive: the trace's keep) has the fixed-K tie band there.
        scores, counts = trace.get("scores"), trace.get("keep")
        tied = list(k_ties)
        if scores is not None and counts is not None:
            scores, counts = np.asarray(scores, dtype=np.float64), np.asarray(counts).reshape(-1)
            tied += [i for i, (r, c) in enumerate(zip(ref, cand)) if i not in tied and per_image[i] < 1.0
                     and len(valid(r)) == len(valid(c)) == counts[i] < scores.shape[1]
                     and mismatch_in_band(valid(r), valid(c), scores[i], int(counts[i]), tol.tie_rel_tol,
                                          tol.tie_share_max)]
        return _verdict({"agreement": float(np.mean(per_image)), "per_image": per_image, "boundary_ties": None,
                         "tie_resolved_images": sorted(tied)}, tol)
    if reference.method is not None and reference.method.selection == GREEDY:
        return compare_greedy(ref, cand, trace.get("steps"), tol)
    if "local_cuts" in trace:  # independent TopKs over spans of positions (DyCoke's pruned frames)
        return compare_local_cuts(ref, cand, trace["local_cuts"], tol)
    boundary = trace.get("boundary")
    earlier = list(zip(trace["step_scores"], trace["step_boundaries"])) if "step_scores" in trace else []  # --schedule
    if boundary is not None and boundary < ref.shape[1]:
        # Only the first `boundary` indices were ranked (visionzip's dominant tokens); the rest follow from them.
        head = compare_indices(ref[:, :boundary], cand[:, :boundary], trace.get("scores"), tol, boundary, earlier)
        whole = _agreement(ref, cand)
        head["agreement"], head["per_image"] = float(np.mean(whole)), whole
        return _verdict(head, tol)
    return compare_indices(ref, cand, trace.get("scores"), tol, boundary, earlier)


@dataclasses.dataclass
class ParityReport:
    """Every stage's figures against the reference, as data (to_json, summary), as Polygraphy's comparison results
    are: what a person reads of it is rendered above the parity package (compiler/cli/render.py's check_lines,
    compiler/report.py's HTML page and JUnit file)."""

    inputs: dict
    stages: list[StageResult]
    reference: dict | None = None  # reference_summary(): what the report draws stages against

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)  # no stage checked is no pass

    def to_json(self) -> dict:
        data = {"passed": self.passed, "inputs": self.inputs,
                "default_tolerances": {k: dataclasses.asdict(v) for k, v in DEFAULT_TOLERANCES.items()},
                "stages": [s.to_json() for s in self.stages]}
        if self.reference is not None:
            data["reference"] = self.reference
        return data

    def summary(self) -> dict:
        return {s.stage: stage_summary(s) for s in self.stages}


def reference_summary(reference: Reference) -> dict | None:
    """The reference's kept indices and, for score-based selections, the scores it ranked (for the report)."""
    if KEPT not in reference.outputs:
        return None
    trace = reference.trace or {}
    greedy = reference.method is not None and reference.method.selection == GREEDY
    scores = trace.get("scores")
    return {"kept": np.asarray(reference.outputs[KEPT]).astype(np.int64).tolist(),
            "selection": GREEDY if greedy else "score", "boundary": trace.get("boundary"),
            "scores": None if greedy or scores is None else np.round(np.asarray(scores, np.float64), 8).tolist()}


def stage_summary(s: StageResult) -> dict:
    out = {"passed": s.passed, "runtime": s.runtime, "precision": s.precision}
    feats = s.outputs.get(FEATURES, {})
    for key in ("cosine_min", "max_abs"):
        if key in feats:
            out[key] = feats[key]
    if "max_abs_bound" in feats:
        out["max_abs_bound"] = feats["max_abs_bound"]
    if "rows_compared" in feats:
        out["rows_compared"] = feats["rows_compared"]
    if feats.get("images_compared_on_common_tokens"):
        out["images_on_common_tokens"] = sorted(int(i) for i in feats["images_compared_on_common_tokens"])
    if s.indices:
        out["index_agreement"] = s.indices["agreement"]
        for key in ("boundary_ties", "first_divergent_step"):
            if key in s.indices:
                out[key] = s.indices[key]
        out["tie_resolved_images"] = s.indices["tie_resolved_images"]
    if s.error:
        out["error"] = s.error
    return out
