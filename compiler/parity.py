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

from vlmprune.compiler.reference import FEATURES, KEPT, Reference
from vlmprune.passes.methods.base import GREEDY
from vlmprune.passes.methods.selection import boundary_ties, tie_band


@dataclasses.dataclass(frozen=True)
class Tolerance:
    cosine_min: float
    max_abs: float | None = None
    index_agreement_min: float = 1.0
    tie_rel_tol: float = 1e-5  # scores (or greedy margins) this close count as tied


DEFAULT_TOLERANCES = {
    "fp32": Tolerance(0.99999, 1e-4, 1.0, 1e-5),
    "fp16": Tolerance(0.999, None, 1.0, 1e-3),
    "int16": Tolerance(0.99, None, 0.99, 1e-2),
    "int8": Tolerance(0.99, None, 0.99, 1e-2),
}


def tolerance_for(precision: str, overrides: dict | None = None) -> Tolerance:
    base = DEFAULT_TOLERANCES[precision]
    return dataclasses.replace(base, **(overrides or {}))


def _agreement(ref: np.ndarray, cand: np.ndarray) -> list[float]:
    keep = ref.shape[1]
    return [len(np.intersect1d(r, c)) / keep for r, c in zip(ref, cand)]


def compare_indices(ref: np.ndarray, cand: np.ndarray, ref_scores: np.ndarray | None, tol: Tolerance,
                    boundary: int | None = None) -> dict:
    """Kept-index agreement per image for a score-based selection, and whether mismatches sit in boundary ties.

    boundary: where the ranked selection's cut is (default: all K kept indices were ranked).
    """
    keep = boundary or ref.shape[1]
    per_image = _agreement(ref, cand)
    ties, tie_resolved = None, []
    if ref_scores is not None:
        scores = np.asarray(ref_scores, dtype=np.float64)
        ties = boundary_ties(torch.from_numpy(scores), keep, tol.tie_rel_tol).tolist()
        tie_resolved = [i for i, (r, c) in enumerate(zip(ref, cand))
                        if per_image[i] < 1.0 and mismatch_in_band(r, c, scores[i], keep, tol.tie_rel_tol)]
    return _verdict({"agreement": float(np.mean(per_image)), "per_image": per_image, "boundary_ties": ties,
                     "tie_resolved_images": tie_resolved}, tol)


def mismatch_in_band(ref: np.ndarray, cand: np.ndarray, scores: np.ndarray, keep: int, rel: float) -> bool:
    """True when every index kept by only one side scores within the tie band of the K-th boundary."""
    ordered = np.sort(scores)[::-1]
    cut = 0.5 * (ordered[keep - 1] + ordered[keep])
    differing = np.setxor1d(ref, cand)
    return bool(np.all(np.abs(scores[differing] - cut) <= tie_band(scores, rel)))


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
                   row_margins: np.ndarray | None = None) -> dict:
    """max-abs, mean-abs and the minimum cosine over tokens.

    Images resolved differently by a tie are left out, and so are reference rows that
    are NaN (rows the reference cannot define, see compiler.reference) and merged rows
    whose merge decision lies in the tie band (row_margins, e.g. visionzip's contextual
    tokens): counted in the result, not hidden.
    """
    if ref.shape != cand.shape:
        return {"passed": False, "error": f"shape {list(cand.shape)} != reference {list(ref.shape)}"}
    keep = [i for i in range(ref.shape[0]) if i not in set(skip_images)]
    if not keep:
        return {"passed": True, "note": "every image was resolved differently by a boundary tie"}
    r = ref[keep].astype(np.float64).reshape(-1, ref.shape[-1])
    c = cand[keep].astype(np.float64).reshape(-1, ref.shape[-1])
    defined = ~np.isnan(r).any(axis=1)
    tied = np.zeros_like(defined)
    if row_margins is not None and row_margins.shape[1] == ref.shape[1] + 1:  # [CLS] dropped after the site
        row_margins = row_margins[:, 1:]
    if row_margins is not None and row_margins.shape == ref.shape[:2]:
        tied = (np.asarray(row_margins)[keep].reshape(-1) <= tol.tie_rel_tol) & defined
    r, c = r[defined & ~tied], c[defined & ~tied]
    if not len(r):
        return {"passed": False, "error": "the reference defines no row to compare"}
    diff = np.abs(r - c)
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(c, axis=1)
    cosine = np.where(norms > 0, (r * c).sum(axis=1) / np.maximum(norms, 1e-30), 1.0)
    result = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "cosine_min": float(cosine.min()),
              "images_compared": keep}
    if not defined.all():
        result["rows_not_compared"] = int((~defined).sum())
    if tied.any():
        result["rows_in_tie_band"] = int(tied.sum())
    ok = result["cosine_min"] >= tol.cosine_min and (tol.max_abs is None or result["max_abs"] <= tol.max_abs)
    result["passed"] = bool(ok)
    return result


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


def run_stage(stage: str, runtime: str, precision: str, run: Callable[[np.ndarray], dict[str, np.ndarray]],
              pixel_values: np.ndarray, reference: Reference, overrides: dict | None = None) -> StageResult:
    """Run one stage's candidate on the parity inputs and compare every output the reference has."""
    tol = tolerance_for(precision, overrides)
    try:
        outputs = run(pixel_values)
    except Exception as exc:  # the candidate runtime failed: a failed stage, with its reason
        return StageResult(stage, runtime, precision, tol, False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = StageResult(stage, runtime, precision, tol, True)
    expected = reference.outputs
    skip: list[int] = []
    if KEPT in expected:
        if KEPT not in outputs:
            result.passed, result.error = False, f"candidate has no {KEPT} output"
            return result
        result.indices = _indices(reference, outputs[KEPT].astype(np.int64), tol)
        skip = result.indices["tie_resolved_images"]
        result.passed &= result.indices["passed"]
    for name, ref in expected.items():
        if name == KEPT:
            continue
        if name not in outputs:
            result.outputs[name] = {"passed": False, "error": "missing from the candidate"}
        else:
            margins = (reference.trace or {}).get("row_margins") if name == FEATURES else None
            result.outputs[name] = compare_tokens(ref, outputs[name], tol, skip, margins)
        result.passed &= result.outputs[name]["passed"]
    return result


def _indices(reference: Reference, cand: np.ndarray, tol: Tolerance) -> dict:
    ref = reference.outputs[KEPT]
    if ref.shape != cand.shape:
        return {"passed": False, "agreement": 0.0, "per_image": [], "tie_resolved_images": [],
                "error": f"shape {list(cand.shape)} != reference {list(ref.shape)}"}
    trace = reference.trace or {}
    if reference.method is not None and reference.method.selection == GREEDY:
        return compare_greedy(ref, cand, trace.get("steps"), tol)
    boundary = trace.get("boundary")
    if boundary is not None and boundary < ref.shape[1]:
        # Only the first `boundary` indices were ranked (visionzip's dominant tokens); the rest follow from them.
        head = compare_indices(ref[:, :boundary], cand[:, :boundary], trace.get("scores"), tol, boundary)
        whole = _agreement(ref, cand)
        head["agreement"], head["per_image"] = float(np.mean(whole)), whole
        return _verdict(head, tol)
    return compare_indices(ref, cand, trace.get("scores"), tol, boundary)


@dataclasses.dataclass
class ParityReport:
    inputs: dict
    stages: list[StageResult]

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)  # no stage checked is no pass

    def to_json(self) -> dict:
        return {"passed": self.passed, "inputs": self.inputs,
                "default_tolerances": {k: dataclasses.asdict(v) for k, v in DEFAULT_TOLERANCES.items()},
                "stages": [s.to_json() for s in self.stages]}

    def summary(self) -> dict:
        return {s.stage: stage_summary(s) for s in self.stages}


def stage_summary(s: StageResult) -> dict:
    out = {"passed": s.passed, "runtime": s.runtime, "precision": s.precision}
    feats = s.outputs.get(FEATURES, {})
    for key in ("cosine_min", "max_abs"):
        if key in feats:
            out[key] = feats[key]
    if s.indices:
        out["index_agreement"] = s.indices["agreement"]
        for key in ("boundary_ties", "first_divergent_step"):
            if key in s.indices:
                out[key] = s.indices[key]
        out["tie_resolved_images"] = s.indices["tie_resolved_images"]
    if s.error:
        out["error"] = s.error
    return out
