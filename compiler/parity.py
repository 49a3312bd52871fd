"""Stage-wise parity against the PyTorch reference (shared/DESIGN.md, "Parity contract").

Results are data: per-output error statistics, kept-index agreement with the
near-ties at the K-th boundary, per-output tolerances with defaults by precision,
serialised to parity.json. A stage that cannot run is recorded as failed with its
reason; `vlmprune check` exits non-zero when any stage fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from vlmprune.compiler.reference import boundary_ties

FEATURES = "image_features"
KEPT = "kept_indices"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    cosine_min: float
    max_abs: float | None = None
    index_agreement_min: float = 1.0
    tie_rel_tol: float = 1e-5  # scores this close to the K-th boundary count as tied


DEFAULT_TOLERANCES = {
    "fp32": Tolerance(0.99999, 1e-4, 1.0, 1e-5),
    "fp16": Tolerance(0.999, None, 1.0, 1e-3),
    "int16": Tolerance(0.99, None, 0.99, 1e-2),
    "int8": Tolerance(0.99, None, 0.99, 1e-2),
}


def tolerance_for(precision: str, overrides: dict | None = None) -> Tolerance:
    base = DEFAULT_TOLERANCES[precision]
    return dataclasses.replace(base, **(overrides or {}))


def compare_indices(ref: np.ndarray, cand: np.ndarray, ref_scores: np.ndarray | None, tol: Tolerance) -> dict:
    """Kept-index agreement |ref ∩ cand| / K per image, and whether mismatches sit in boundary ties."""
    keep = ref.shape[1]
    per_image = [len(np.intersect1d(r, c)) / keep for r, c in zip(ref, cand)]
    ties = None
    tie_resolved = []
    if ref_scores is not None:
        scores = torch.from_numpy(np.asarray(ref_scores, dtype=np.float64))
        ties = boundary_ties(scores, keep, tol.tie_rel_tol).tolist()
        for i, (r, c) in enumerate(zip(ref, cand)):
            if per_image[i] < 1.0 and _mismatch_in_band(r, c, scores[i].numpy(), keep, tol.tie_rel_tol):
                tie_resolved.append(i)
    agreement = float(np.mean(per_image))
    unexplained = [a for i, a in enumerate(per_image) if i not in tie_resolved]
    passed = (min(unexplained) if unexplained else 1.0) >= tol.index_agreement_min
    return {"agreement": agreement, "per_image": per_image, "boundary_ties": ties,
            "tie_resolved_images": tie_resolved, "passed": bool(passed)}


def _mismatch_in_band(ref: np.ndarray, cand: np.ndarray, scores: np.ndarray, keep: int, rel: float) -> bool:
    """True when every index kept by only one side scores within the tie band of the boundary."""
    ordered = np.sort(scores)[::-1]
    cut = 0.5 * (ordered[keep - 1] + ordered[keep])
    band = rel * max(np.abs(scores).max(), 1e-6)
    differing = np.setxor1d(ref, cand)
    return bool(np.all(np.abs(scores[differing] - cut) <= band))


def compare_tokens(ref: np.ndarray, cand: np.ndarray, tol: Tolerance, skip_images: list[int] = ()) -> dict:
    """max-abs, mean-abs and the minimum cosine over tokens.

    Images resolved differently by a boundary tie are left out, and so are reference
    rows that are NaN: rows the reference cannot define (e.g. the summary token of an
    .onnx source whose output follows the pruning point through a LayerNorm).
    """
    if ref.shape != cand.shape:
        return {"passed": False, "error": f"shape {list(cand.shape)} != reference {list(ref.shape)}"}
    keep = [i for i in range(ref.shape[0]) if i not in set(skip_images)]
    if not keep:
        return {"passed": True, "note": "every image was resolved differently by a boundary tie"}
    r = ref[keep].astype(np.float64).reshape(-1, ref.shape[-1])
    c = cand[keep].astype(np.float64).reshape(-1, ref.shape[-1])
    defined = ~np.isnan(r).any(axis=1)
    r, c = r[defined], c[defined]
    if not len(r):
        return {"passed": False, "error": "the reference defines no row to compare"}
    diff = np.abs(r - c)
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(c, axis=1)
    cosine = np.where(norms > 0, (r * c).sum(axis=1) / np.maximum(norms, 1e-30), 1.0)
    result = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "cosine_min": float(cosine.min()),
              "images_compared": keep}
    if not defined.all():
        result["rows_not_compared"] = int((~defined).sum())
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
              pixel_values: np.ndarray, reference: dict[str, np.ndarray], ref_scores: np.ndarray | None = None,
              overrides: dict | None = None) -> StageResult:
    """Run one stage's candidate on the parity inputs and compare every output the reference has."""
    tol = tolerance_for(precision, overrides)
    try:
        outputs = run(pixel_values)
    except Exception as exc:  # the candidate runtime failed: a failed stage, with its reason
        return StageResult(stage, runtime, precision, tol, False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = StageResult(stage, runtime, precision, tol, True)
    skip: list[int] = []
    if KEPT in reference:
        if KEPT not in outputs:
            result.passed, result.error = False, f"candidate has no {KEPT} output"
            return result
        result.indices = compare_indices(reference[KEPT], outputs[KEPT], ref_scores, tol)
        skip = result.indices["tie_resolved_images"]
        result.passed &= result.indices["passed"]
    for name, ref in reference.items():
        if name == KEPT:
            continue
        if name not in outputs:
            result.outputs[name] = {"passed": False, "error": "missing from the candidate"}
        else:
            result.outputs[name] = compare_tokens(ref, outputs[name], tol, skip)
        result.passed &= result.outputs[name]["passed"]
    return result


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
        out["boundary_ties"] = s.indices["boundary_ties"]
        out["tie_resolved_images"] = s.indices["tie_resolved_images"]
    if s.error:
        out["error"] = s.error
    return out
