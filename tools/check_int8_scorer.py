"""--scorer int8 on the pretrained DINOv2-S/14: kept-index agreement of the INT8 decision with fp32, on real photos.

    python tools/check_int8_scorer.py [--model DIR] [--layers 2,4,6,8,10,12] [--keep 16,32,64] [--json OUT]

For each block L and K, `cls --scorer int8` is inserted after block L of the dense export of the
tower (tools/dinov2_from_onnx.py's directory, default under $VLMPRUNE_CACHE or ~/.cache/vlmprune),
fused for ort as the compiler does (ClsAttentionScore with int8=1, then TokenPrune), and run by
ONNX Runtime with the bundled custom-op library; the same graph before fusion (model.decomposed.onnx:
the fp32 scorer in standard ops) gives the fp32 kept set. Agreement is |fp32 ∩ int8| / K per photo.
Photos: every colour or grey photograph of skimage.data that is on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "moon", "page", "hubble_deep_field",
          "immunohistochemistry", "motorcycle_left", "motorcycle_right", "retina", "eagle", "cat", "lily", "skin",
          "grass", "gravel", "brick", "rough_wall", "text", "clock", "horse")


def photos(size: int, mean, std) -> tuple[np.ndarray, list[str]]:
    from skimage import data

    from vlmprune.compiler.frontend.images import preprocess

    images, names = [], []
    for name in PHOTOS:
        try:
            raw = getattr(data, name)()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 (not shipped, no network to fetch it; under pytest, skimage skips)
            continue
        if raw.dtype == bool:
            continue
        raw = raw.astype(np.uint8) if raw.dtype == np.uint8 else (255 * (raw / max(raw.max(), 1))).astype(np.uint8)
        raw = np.stack([raw] * 3, -1) if raw.ndim == 2 else raw
        images.append(preprocess(raw, size, mean, std))
        names.append(name)
    return np.stack(images), names


def measure(model_dir: str, layers: list[int], keeps: list[int]) -> dict:
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from vlmprune.compiler.frontend import export_onnx, load_source
    from vlmprune.compiler.parity import DEFAULT_TOLERANCES, mismatch_in_band
    from vlmprune.passes.fusion import FusionPass
    from vlmprune.passes.methods import get_method
    from vlmprune.passes.prune import InsertPruningPass, prune_record
    from vlmprune.passes.retarget import RetargetTokenCountPass
    from vlmprune.targets.ort import ORT_OPS, library
    from vlmprune.targets.runtime import ort_session, run_session

    source = load_source(model_dir)
    pixel, names = photos(source.image_size, source.mean, source.std)
    dense = ir.to_proto(export_onnx(source.pipeline, source.image_size, None, 18)).SerializeToString()
    lib = (str(library()),)
    method = get_method("cls")
    INT8_TIE = DEFAULT_TOLERANCES["int8"].tie_rel_tol  # noqa: N806
    rows = []
    for layer in layers:
        for keep in keeps:
            params = method.parse(keep, {"scorer": "int8"})
            model = ir.from_proto(__import__("onnx").load_from_string(dense))
            InsertPruningPass(method, params, layer)(model)
            RetargetTokenCountPass()(model)
            topk = next(n for n in model.graph if n.op_type == "TopK" and (n.name or "").startswith("vlmprune/"))
            scores = topk.inputs[0]
            model.graph.outputs.append(scores)
            out = run_session(ort_session(ir.to_proto(model).SerializeToString()), pixel)
            model.graph.outputs.pop()
            fp32, fp32_scores = out["kept_indices"], out[scores.name]
            FusionPass(method.fusion_rules(ORT_OPS, prune_record(model)), {"vlmprune": 1})(model)
            RemoveUnusedNodesPass()(model)
            ops = sorted(n.op_type for n in model.graph if n.domain == "vlmprune")
            assert ops == ["ClsAttentionScore", "TokenPrune"], ops
            int8 = run_session(ort_session(ir.to_proto(model).SerializeToString(), lib), pixel)["kept_indices"]
            per = [len(np.intersect1d(a, b)) / keep for a, b in zip(fp32, int8)]
            # A swap is a boundary tie when both indices score within the int8 tie band (parity's 1e-2 of the
            # image's top score) of the K-th boundary: what the bundle's parity reports as tie-resolved.
            tied = [i for i, p in enumerate(per) if p < 1.0 and
                    mismatch_in_band(fp32[i], int8[i], fp32_scores[i].astype(np.float64), keep, INT8_TIE)]
            rows.append({"layer": layer, "keep": keep, "agreement": float(np.mean(per)), "min": float(np.min(per)),
                         "images_identical": int(sum(p == 1.0 for p in per)), "images_tie_resolved": len(tied),
                         "agreement_outside_ties": float(np.mean([1.0 if i in tied else p
                                                                  for i, p in enumerate(per)]))})
            print(f"L{layer:>2} K={keep:>3}: agreement {np.mean(per):.4f} (min {np.min(per):.4f}, "
                  f"{rows[-1]['images_identical']}/{len(per)} photos identical, {len(tied)} differ by a boundary "
                  f"tie; outside ties {rows[-1]['agreement_outside_ties']:.4f})", flush=True)
    return {"model": model_dir, "photos": names, "patches": source.num_patches, "rows": rows,
            "overall": float(np.mean([r["agreement"] for r in rows])),
            "overall_outside_ties": float(np.mean([r["agreement_outside_ties"] for r in rows]))}


def main(argv=None) -> int:
    from vlmprune.kernels.build import cache_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(cache_dir()) / "models" / "dinov2-s14-imgfocus"))
    p.add_argument("--layers", default="2,4,6,8,10,12")
    p.add_argument("--keep", default="16,32,64")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if not Path(a.model, "config.json").exists():
        print(f"error: no converted DINOv2 at {a.model} (python tools/dinov2_from_onnx.py)", file=sys.stderr)
        return 2
    report = measure(a.model, [int(x) for x in a.layers.split(",")], [int(x) for x in a.keep.split(",")])
    print(f"{len(report['photos'])} photos ({', '.join(report['photos'])}); mean agreement {report['overall']:.4f}, "
          f"{report['overall_outside_ties']:.4f} outside boundary ties")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
