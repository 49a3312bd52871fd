#!/usr/bin/env python
"""Latency of the vision tower, dense vs pruned, PyTorch (eager, torch.compile) vs ONNX Runtime, side by side in one run.

    python tools/bench_tower.py [--model clip-l-336] [--keep 192] [--layer 2] [--repeats 5] [--no-compile] [--op-profile]
        [--method cls|visionzip|divprune|dart] [--score cls|probe] [--ort-only] [--no-openvino] [--no-bf16]
        [--no-peers]

--model is any preset (`clip-l-336`, `siglip-so400m-384`, `qwen2.5-vl-3b-448`, `qwen3-vl-2b-512`,
`internvl3-1b-448`, `smolvlm-256m-512`, `gemma3-4b-896` where present, `demo`)
or a Hugging Face directory. --method defaults to one the model serves: cls for towers with a
[CLS] token whose features are not merged after the tower (InternVL's and Gemma 3's are: divprune), cls --score
probe for towers with an attention-pooling head (SigLIP), else divprune. A method that prunes the
projector output (divprune, dart) has one pruned row: the tower runs dense and the saving is the
LLM's. --ort-only times the ONNX Runtime rows only (the torch eager output is still computed once,
as the reference they are checked against).

After the latency table, every ONNX Runtime row gets its FLOP-limit ratio: the measured
speedup over the dense ORT row divided by the speedup the FLOPs allow, FLOPs(dense) /
FLOPs(pruned), both counted from the ONNX graphs that were timed (2 x the multiply-adds of
every MatMul, Gemm and Conv, from ONNX shape inference at batch 1; elementwise ops, softmax
and normalisations are not counted). 1.0 means the pruned graph is as fast as its arithmetic
allows; below 1, the selection's overhead or the smaller matrices' lower efficiency cost time.

The lower-precision PyTorch peers (tools/torch_peers.py), as rows of their own for the dense
and the main pruned configuration, pruned by the same reference pruner: torchao's int8 dynamic
quantization under torch.compile, and bf16 autocast under torch.compile (the fastest PyTorch
path on a CPU with AVX-512 bf16 or AMX). Their agreement column gives the kept-set agreement
(intersection over K) and the minimum per-token cosine against fp32 eager, as
tools/bench_int8.py reports for the int8 bundle. --no-bf16 leaves out the bf16 rows, --no-peers
the int8 ones.

Batch 1 on this machine's CPU, one process. Each peer runs as its users would run it at its
fastest: PyTorch with SDPA attention, torch.inference_mode, contiguous fp32 weights and one
intra-op thread per physical core; torch.compile (inductor, CPU, weights frozen) as rows of
its own; ONNX Runtime through the product's session (targets.runtime.ort_session) with as
many intra-op threads, on the graph a user deploys on ort: model.onnx, the ort target's fusion
applied (each block's attention as com.microsoft.MultiHeadAttention, the method's fused ops,
run with the vlmprune op library); the "onnxruntime unfused" rows time model.decomposed.onnx
(standard ops) beside it. FLOPs are counted on the decomposed graphs (a fused op's are not
visible to shape inference) and hold for both.

The pruned torch rows compute the product's reference pruner (the method's reference, e.g.
cls after block L from that block's own Q and K): eager runs VisionPipeline.with_pruner itself,
and torch.compile compiles that same module (its block L is written without forward hooks
so that dynamo can trace it); both are checked against eager in the run, as ONNX Runtime is.

OpenVINO rows (targets.openvino; left out with --no-openvino or where openvino is not installed): the
same decomposed graphs converted with ov.convert_model and compiled on CPU as `vlmprune compile
--target openvino` compiles them, at f32 (INFERENCE_PRECISION_HINT f32), bf16 (the hint bf16) and int8
(NNCF PTQ outside the score path, calibrated on the built-in photographs: targets.openvino.quantize),
with as many inference threads. The "torch.compile bf16 autocast" rows run the torch.compile modules
under torch.autocast("cpu", torch.bfloat16) (--no-bf16 leaves them out). Rows below fp32 are held to
the eager fp32 reference by kept-index agreement and the minimum cosine over the rows of the tokens both
sides kept (a swap at the K-th boundary moves the rows after it), not by max |d|.
Whether the CPU has AMX (amx_tile) or only avx512_bf16 decides what bf16 is worth: the first line says.

Why the rows are interleaved: on a small machine a neighbour (a test suite) that starts
half-way through a run slows every op, the many small ones of a pruned tower most, so
rows timed one after another can even rank pruned below dense. Every round therefore runs
each row once, starting one row later each round, and the run reports how much CPU other
processes took meanwhile. Warm-up runs (and torch.compile's compilation) are not timed.
Prints medians, spread and ratios; the last line is the headline ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

import ort_profile
import torch_peers
from machine_load import CpuMeter, busy_line, physical_cores
from vlmprune.compiler.contract import FEATURES, KEPT, PIXELS, WEIGHTS
from vlmprune.compiler.frontend import export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.frontend.tower import BLOCK
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import Method, SiteSpec
from vlmprune.targets.base import PruneConfig
from vlmprune.targets.ort import OrtTarget
from vlmprune.targets.runtime import ort_session, run_session

SETTLE_S = 0.2  # pause before each timed run, for the previous row's spinning threads to park


@contextlib.contextmanager
def _stderr_to_devnull():
    """The profiler's C++ side logs its start and stop on fd 2; keep the table readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _torch_attention(fn, blocks: int) -> str:
    """Which attention kernels one run of fn executed, read from the profiler (not from the config)."""
    from torch.profiler import ProfilerActivity, profile

    with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = Counter(e.name for e in prof.events())
    sdpa = {name: n for name, n in counts.items() if name.startswith("aten::_scaled_dot_product")}
    if sdpa:
        return ", ".join(f"SDPA {name.removeprefix('aten::_scaled_dot_product_')} x{n}" for name, n in sdpa.items())
    softmax = sum(n for name, n in counts.items() if "softmax" in name.lower())
    return f"eager (matmul + softmax x{softmax})" if softmax >= blocks else "unknown"


def _ort_attention(path: Path, x: np.ndarray, libs: tuple = ()) -> str:
    """The ops ONNX Runtime executed for attention in one profiled run of the same graph with the same options."""
    ops = ort_profile.profile(lambda o: ort_session(path, libs, options=o), {PIXELS: x}, runs=1)["counts"]
    fused = {op: n for op, n in ops.items() if "Attention" in op}
    if fused:
        return ", ".join(f"ORT {op} x{n}" for op, n in sorted(fused.items()))
    return (f"ORT CPU, no fused attention op: MatMul x{ops.get('MatMul', 0)}, FusedMatMul x{ops.get('FusedMatMul', 0)}, "
            f"Softmax x{ops.get('Softmax', 0)}")


def _method_for(source, name: str | None, score: str | None) -> tuple[Method, dict]:
    """(method, its options): the one asked for, else one the model serves (cls, cls --score probe, divprune)."""
    head = source.head
    if name is None:
        merged = source.spatial_merge > 1  # tokens merged after the tower (InternVL's [CLS] tower too): its features
        name = "divprune" if merged else "cls" if source.has_cls or head is not None else "divprune"
        if not source.has_cls and head is not None and score is None:
            score = "probe"
    options = {"score": score} if score is not None else {}
    return get_method(name), options


def _pruner(method: Method, params: dict, layer: int | None) -> MethodPruner:
    """The product's reference pruner: the method at its site (after block `layer`, or on the projector output)."""
    site = method.needs(params).site
    return MethodPruner(method, params, site, layer if site == BLOCK else None)


def _pruned_onnx(dense_path: Path, folder: Path, method: Method, params: dict, options: dict, layer: int | None,
                 head, name: str) -> Path:
    """model.decomposed.onnx as `vlmprune compile` emits it for ort (before fusion: _fused_onnx makes model.onnx)."""
    config = PruneConfig(method, params, layer, head=head)
    compile_options = CompileOptions(method=method.name, keep=params["keep"], layer=layer, method_options=options)
    model = OrtTarget().pipeline(config, compile_options)(ir.load(dense_path)).model
    path = folder / name
    ir.save(model, path)
    return path


def _fused_onnx(decomposed: Path, folder: Path, config: PruneConfig | None, options: CompileOptions,
                name: str) -> tuple[Path, tuple]:
    """model.onnx as `vlmprune compile --target ort` writes it from `decomposed`, and the op libraries it needs."""
    from vlmprune.passes.prune import prune_record
    from vlmprune.targets.ort import fused_ops, library

    model = ir.load(decomposed)
    fusion = OrtTarget().fusion(config, options, prune_record(model))
    if fusion is not None:
        fusion(model)
    path = folder / name
    ir.save(model, path)
    return path, ((library(),) if fused_ops(model) else ())


def graph_flops(path: Path) -> float | None:
    """2 x the multiply-adds of every MatMul, Gemm and Conv of the graph at path, from ONNX shape inference.

    None when a shape stays unknown (a dynamic dimension): the count would be a guess.
    """
    import onnx

    proto = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False), data_prop=True)
    shapes = {init.name: list(init.dims) for init in proto.graph.initializer}
    for info in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]:
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    total = 0
    for node in proto.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        out, a, b = shapes.get(node.output[0]), shapes.get(node.input[0]), shapes.get(node.input[1])
        if out is None or a is None or b is None or None in out or None in a or None in b:
            return None
        if node.op_type == "Conv":
            inner = int(np.prod(b[1:]))  # Cin/groups * kh * kw per output value
        elif node.op_type == "Gemm" and any(att.name == "transA" and att.i for att in node.attribute):
            inner = a[0]
        else:
            inner = a[-1]
        total += 2 * int(np.prod(out)) * inner
    return float(total)


def _round_robin(fns: dict, repeats: int) -> dict[str, list[float]]:
    """ms per run of every fn; each round runs all of them once, starting one later each round.

    A pause precedes every run: ONNX Runtime's pool threads spin after a run (torch's OpenMP
    threads too) and, on a small machine, would take the next row's cores (measured: a torch
    run right after an ORT run of the demo tower takes twice as long).
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _agreement(ref, other) -> str:
    """max |Δ| of the features and whether the kept indices are identical, against the eager reference."""
    ref_h, ref_k = (ref, None) if isinstance(ref, torch.Tensor) else ref
    h, k = (other, None) if isinstance(other, (torch.Tensor, np.ndarray)) else other
    h = torch.as_tensor(np.asarray(h))
    diff = (h - ref_h).abs().max().item()
    if ref_k is None:
        return f"max|d|={diff:.1e}"
    same = bool((torch.as_tensor(np.asarray(k)) == ref_k).all())
    return f"max|d|={diff:.1e}, kept {'identical' if same else 'DIFFER'}"


def _low_precision_agreement(ref, other) -> str:
    """Kept-index agreement with the fp32 eager reference, and the minimum cosine over the rows of the tokens both
    sides kept (the rows before the kept tokens, then each common token's row on each side: a swap at the K-th
    boundary moves the rows after it), for rows below fp32 where a boundary swap is expected, not a failure."""
    ref_h, ref_k = (ref, None) if isinstance(ref, torch.Tensor) else ref
    h, k = (other, None) if isinstance(other, (torch.Tensor, np.ndarray)) else other
    a = np.asarray(torch.as_tensor(np.asarray(h, dtype=np.float32)), dtype=np.float64)[0]
    b = np.asarray(ref_h.float(), dtype=np.float64)[0]
    ref_rows = cand_rows = np.arange(len(b))
    text = ""
    if ref_k is not None:
        rk, ck = np.asarray(ref_k)[0], np.asarray(k)[0]
        lead = len(b) - len(rk) - 1 if len(b) > len(rk) else 0  # [CLS] before the kept rows, summary after
        both = np.intersect1d(rk, ck)  # the tokens both sides kept, each at its own row on each side
        ref_rows = np.r_[np.arange(lead), lead + np.searchsorted(rk, both)] if np.all(np.diff(rk) > 0) else \
            np.r_[np.arange(lead), [lead + int(np.flatnonzero(rk == p)[0]) for p in both]]
        cand_rows = np.r_[np.arange(lead), [lead + int(np.flatnonzero(ck == p)[0]) for p in both]]
        text = f"kept agreement {len(both) / len(rk):.3f}, "
    a, b = a[cand_rows.astype(int)], b[ref_rows.astype(int)]
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return text + f"min cos {cos.min():.4f} over {len(cos)} rows (the tokens both kept)"


def _cpu_flags() -> str:
    """What the CPU offers for bf16 and int8 (AMX or not), from /proc/cpuinfo."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "CPU flags unknown"
    wanted = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni")
    return "CPU: " + ", ".join(f"{f} {'yes' if f in flags else 'NO'}" for f in wanted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="clip-l-336", help="a preset (see the docstring) or a Hugging Face directory")
    parser.add_argument("--method", default=None, help="default: one the model serves (see the docstring)")
    parser.add_argument("--score", default=None, choices=["cls", "probe"], help="cls/visionzip: what ranks the patches")
    parser.add_argument("--keep", type=int, default=192)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the fp32 torch.compile rows (minutes to compile; --no-bf16 skips the bf16 ones)")
    parser.add_argument("--ort-only", action="store_true", help="time the ONNX Runtime rows only (implies --no-compile)")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the int8 (torchao) and bf16 (autocast) torch.compile rows (minutes to compile)")
    parser.add_argument("--op-profile", action="store_true",
                        help="after the timed runs, profile the ONNX Runtime rows per op (tools/ort_profile.py, untimed)")
    parser.add_argument("--no-openvino", action="store_true", help="leave out the OpenVINO rows")
    parser.add_argument("--no-end", action="store_true",
                        help="leave out the rows pruned at the tower's end (memory: a large tower on a small machine)")
    parser.add_argument("--no-unfused", action="store_true", help="leave out the onnxruntime unfused rows")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the torch.compile bf16 autocast rows")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled run that names each row's attention ops (one run per row saved)")
    args = parser.parse_args()

    cores = physical_cores()
    torch.set_num_threads(cores)
    os.environ.setdefault("VLMPRUNE_ORT_THREADS", str(cores))  # ort_session's intra-op threads
    torch.manual_seed(0)
    source = load_source(args.model)
    pipeline = source.pipeline
    if pipeline is None:
        raise SystemExit(f"{args.model}: an .onnx source has no torch pipeline to compare with; use a preset or a directory")
    method, options = _method_for(source, args.method, args.score)
    params = method.parse(args.keep, options)
    at_block = method.needs(params).site == BLOCK
    head = source.head
    params_list = list(pipeline.parameters())
    if not all(p.is_contiguous() and p.dtype == torch.float32 for p in params_list):
        raise SystemExit("the tower's weights are not contiguous fp32")
    attn_impl = getattr(pipeline.vision_model.config, "_attn_implementation", "?")
    x_np, _ = parity_inputs(1, source.image_size, source.mean, source.std)
    x_np = np.ascontiguousarray(x_np)
    x = torch.from_numpy(x_np)
    end = source.num_blocks
    main_row = f"pruned L{args.layer}" if at_block else "pruned (features)"
    pruned = {"dense": None, main_row: _pruner(method, params, args.layer)}
    if at_block and not args.no_end:
        pruned[f"pruned L{end} (end)"] = _pruner(method, params, end)
    method.check(params, SiteSpec(source.num_patches, bool(source.has_cls), args.layer if at_block else None, end,
                                  prefix=pipeline.prefix if at_block else 0, head=head is not None))

    fns, labels, outputs, checks, flops = {}, {}, {}, {}, {}
    torch_rows = not args.ort_only
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dense = export_onnx(pipeline, source.image_size, 1, 18)
        ir.external_data.unload_from_model(dense, folder, WEIGHTS, size_threshold_bytes=1024)
        ir.save(dense, folder / "dense.onnx")
        del dense
        paths = {"dense": folder / "dense.onnx",
                 main_row: _pruned_onnx(folder / "dense.onnx", folder, method, params, options,
                                        args.layer if at_block else None, head, "l.onnx")}
        if at_block and not args.no_end:
            paths[f"pruned L{end} (end)"] = _pruned_onnx(folder / "dense.onnx", folder, method, params, options, None,
                                                         head, "e.onnx")
        flops = {name: graph_flops(path) for name, path in paths.items()}
        fused = {}  # name -> (model.onnx path, op libraries)
        for name, path in paths.items():
            config, compile_options = None, CompileOptions()
            if name != "dense":
                layer = (args.layer if name == main_row else None) if at_block else None
                config = PruneConfig(method, params, layer, head=head)
                compile_options = CompileOptions(method=method.name, keep=params["keep"], layer=layer,
                                                 method_options=options)
            fused[name] = _fused_onnx(path, folder, config, compile_options, f"fused_{path.name}")

        torch._inductor.config.freezing = True  # the documented CPU inference setting: weights folded, prepacked
        with torch.inference_mode():
            for name, prune in pruned.items():
                eager = pipeline.with_pruner(prune)
                outputs[name] = eager(x)  # warm-up, and the reference of every other row
                if torch_rows:
                    fns[f"torch eager, {name}"] = lambda m=eager: m(x)
                    labels[f"torch eager, {name}"] = (f"attn_implementation={attn_impl}: " + (
                        "not profiled" if args.no_profile else _torch_attention(lambda m=eager: m(x), end)))
            if torch_rows and not args.no_compile:
                for name, prune in pruned.items():
                    row = f"torch.compile, {name}"
                    compiled = torch.compile(pipeline.with_pruner(prune), backend="inductor")
                    start = time.perf_counter()
                    checks[row] = _agreement(outputs[name], compiled(x))  # warm-up, compiles
                    labels[row] = "inductor, freezing: " + _torch_attention(lambda m=compiled: m(x), end)
                    labels[row] += f" (compiled in {time.perf_counter() - start:.0f} s)"
                    fns[row] = lambda m=compiled: m(x)
            # The lower-precision peers: bf16 autocast (with or without --no-compile's fp32 rows) and
            # torchao's int8 dynamic quantization (--no-peers leaves that one out).
            want_int8 = torch_rows and not args.no_peers
            missing = torch_peers.torchao_available() if want_int8 else None
            if missing:
                print(f"int8 peer left out: {missing}")
            for name in [n for n in pruned if n != f"pruned L{end} (end)"] if torch_rows else []:
                builders = {}
                if not args.no_bf16:
                    builders[f"torch.compile bf16 autocast, {name}"] = torch_peers.compiled_bf16
                if want_int8 and not missing:
                    builders[f"torchao int8 dyn + compile, {name}"] = torch_peers.compiled_int8
                for row, build in builders.items():
                    start = time.perf_counter()
                    peer = build(pipeline, pruned[name])
                    checks[row] = torch_peers.describe(outputs[name], peer(x))  # warm-up, compiles
                    labels[row] = "inductor, freezing: " + _torch_attention(lambda m=peer: m(x), end)
                    labels[row] += f" (compiled in {time.perf_counter() - start:.0f} s)"
                    fns[row] = lambda m=peer: m(x)
        graphs = [(f"onnxruntime, {name}", name, *fused[name]) for name in paths]
        if not args.no_unfused:
            graphs += [(f"onnxruntime unfused, {name}", name, path, ()) for name, path in paths.items()]
        for row, name, path, libs in graphs:
            session = ort_session(path, libs)
            result = run_session(session, x_np)  # warm-up
            out = result[FEATURES] if name == "dense" else (result[FEATURES], result[KEPT])
            checks[row] = _agreement(outputs[name], out)
            labels[row] = "not profiled (--no-profile)" if args.no_profile else _ort_attention(path, x_np, libs)
            ort_threads = session.get_session_options().intra_op_num_threads
            fns[row] = lambda s=session: run_session(s, x_np)
        openvino_rows = not args.no_openvino and _openvino_available()
        if openvino_rows:
            _add_openvino_rows(paths, folder, source, x_np, outputs, fns, labels, checks)

        meter = CpuMeter()
        with torch.inference_mode():
            times = _round_robin(fns, args.repeats)
        load = meter.report()
        op_profiles = {}
        if args.op_profile:
            for row, name, path, libs in graphs:
                op_profiles[row] = ort_profile.profile(lambda o, p=path, ls=libs: ort_session(p, ls, options=o),
                                                       {PIXELS: x_np}, runs=max(3, args.repeats // 2))

    rows = {row: statistics.median(t) for row, t in times.items()}
    ort_dense = rows["onnxruntime, dense"]
    base = rows.get("torch eager, dense", ort_dense)
    base_name = "torch dense" if torch_rows else "ORT dense"
    n_patches = source.num_patches
    what = "" if method.name == "cls" and not options else f", {method.describe(params)}"
    print(f"{args.model}, batch 1, keep {args.keep} of {n_patches}{what}, {torch.get_num_threads()} torch threads, "
          f"{ort_threads} ORT intra-op threads ({cores} physical cores), median of {args.repeats}, rows interleaved")
    print(_cpu_flags())
    print(f"{'configuration':<42} {'ms':>9} {'min-max ms':>15} {'vs ' + base_name:>15}  attention")
    for row, ms in rows.items():
        spread = f"{min(times[row]):.0f}-{max(times[row]):.0f}"
        print(f"{row:<42} {ms:>9.1f} {spread:>15} {base / ms:>14.2f}x  {labels[row]}")
    print("agreement with torch eager (fp32): " + "; ".join(f"{row}: {c}" for row, c in checks.items()))
    if busy_line(load):
        print(busy_line(load))
    if any("DIFFER" in c for c in checks.values()):
        print("a peer kept different tokens than the eager reference: its row does not compute the same thing")
    print("FLOP-limit ratio (ORT speedup over ORT dense / FLOPs(dense) / FLOPs(pruned); FLOPs = 2 x MatMul, Gemm, "
          "Conv multiply-adds of the timed graphs):")
    for name in paths:
        if name == "dense":
            print(f"  dense: {flops['dense'] / 1e9:.1f} GFLOP" if flops["dense"] else "  dense: FLOPs unknown")
            continue
        speedup = ort_dense / rows[f"onnxruntime, {name}"]
        if flops["dense"] and flops[name]:
            allowed = flops["dense"] / flops[name]
            print(f"  {name}: {flops[name] / 1e9:.1f} GFLOP, FLOPs allow {allowed:.2f}x, measured {speedup:.2f}x, "
                  f"FLOP-limit ratio {speedup / allowed:.2f}")
        else:
            print(f"  {name}: measured {speedup:.2f}x, FLOPs unknown (a dynamic shape)")
    if op_profiles:
        print("ONNX Runtime profile (separate, untimed runs; counted ops are those the FLOP count counts):")
        print("\n".join(ort_profile.table(op_profiles)))
    key = f"pruned_L{args.layer}" if at_block else "pruned_features"
    ort_l = rows[f"onnxruntime, {main_row}"]
    print(f"ort_{key}_vs_ort_dense: {ort_dense / ort_l:.2f}")
    if not args.no_unfused:
        print(f"ort_fused_{key}_vs_ort_unfused_{key}: {rows[f'onnxruntime unfused, {main_row}'] / ort_l:.2f}")
    if torch_rows:
        eager_l = rows[f"torch eager, {main_row}"]
        print(f"torch_eager_{key}_vs_torch_eager_dense: {base / eager_l:.2f}")
        print(f"ort_dense_vs_torch_dense: {base / ort_dense:.2f}")
        if not args.no_compile:
            compile_l = rows[f"torch.compile, {main_row}"]
            print(f"torch_compile_dense_vs_torch_eager_dense: {base / rows['torch.compile, dense']:.2f}")
            print(f"torch_compile_{key}_vs_torch_eager_{key}: {eager_l / compile_l:.2f}")
            print(f"ort_{key}_vs_torch_compile_{key}: {compile_l / ort_l:.2f}")
            print(f"ort_{key}_vs_best_torch_{key}: {min(eager_l, compile_l) / ort_l:.2f}")
        for peer, short in (("torchao int8 dyn + compile", "torchao_int8_compile"),
                            ("torch.compile bf16 autocast", "torch_bf16_compile")):
            if f"{peer}, {main_row}" in rows:
                print(f"ort_{key}_vs_{short}_{key}: {rows[f'{peer}, {main_row}'] / ort_l:.2f}")
        print(f"ort_{key}_vs_torch_{key}: {eager_l / ort_l:.2f}")
        print(f"ort_{key}_vs_torch_dense: {base / ort_l:.2f}")
    if openvino_rows:
        for precision in OPENVINO_PRECISIONS:
            print(f"openvino_{precision}_dense_vs_ort_dense: {ort_dense / rows[f'openvino {precision}, dense']:.2f}")
            print(f"openvino_{precision}_{key}_vs_ort_{key}: {ort_l / rows[f'openvino {precision}, {main_row}']:.2f}")
        torch_l = {row: ms for row, ms in rows.items() if row.startswith("torch") and row.endswith(main_row)}
        if torch_l:
            best = min(torch_l, key=torch_l.get)
            fastest = min(OPENVINO_PRECISIONS, key=lambda p: rows[f"openvino {p}, {main_row}"])
            print(f"fastest torch {main_row}: {best} ({torch_l[best]:.1f} ms); fastest openvino: {fastest}")
            print(f"openvino_{fastest}_{key}_vs_best_torch_{key}: "
                  f"{torch_l[best] / rows[f'openvino {fastest}, {main_row}']:.2f}")
    return 1 if any("DIFFER" in c for c in checks.values()) else 0


OPENVINO_PRECISIONS = ("f32", "bf16", "int8", "int8-bf16")


def _openvino_available() -> bool:
    from vlmprune.targets.openvino import OpenVinoTarget

    ok, why = OpenVinoTarget().available()
    if not ok:
        print(f"no OpenVINO rows: {why}", file=sys.stderr)
    return ok


def _add_openvino_rows(paths: dict, folder: Path, source, x_np: np.ndarray, outputs: dict, fns: dict, labels: dict,
                       checks: dict) -> None:
    """OpenVINO f32 / bf16 / int8 rows of every graph, compiled as the openvino target compiles its bundles."""
    from vlmprune.compiler.frontend import images
    from vlmprune.targets.openvino import PRECISIONS, compile_ir, openvino, quantize, run_compiled
    from vlmprune.targets.ort_quant import calibration_pixels

    ov = openvino()
    pixels, _ = calibration_pixels(None, source.image_size, source.mean, source.std, images)
    for name, path in paths.items():
        ir_path = folder / f"ov_{path.stem}.xml"
        ov.save_model(ov.convert_model(str(path)), str(ir_path), compress_to_fp16=False)
        int8_path = folder / f"ov_{path.stem}.int8.xml"
        start = time.perf_counter()
        quantize(path, int8_path, pixels)
        quantized_in = time.perf_counter() - start
        for precision in OPENVINO_PRECISIONS:
            row = f"openvino {precision}, {name}"
            compiled = compile_ir(int8_path if PRECISIONS[precision].quantized else ir_path, "CPU",
                                  PRECISIONS[precision].hint)
            result = run_compiled(compiled, x_np)  # warm-up
            out = result[FEATURES] if name == "dense" else (result[FEATURES], result[KEPT])
            checks[row] = (_agreement if precision == "f32" else _low_precision_agreement)(outputs[name], out)
            threads = compiled.get_property("INFERENCE_NUM_THREADS")
            labels[row] = (f"OpenVINO {ov.get_version().split('-')[0]} CPU, {PRECISIONS[precision].what}, "
                           f"{threads} threads" + (f" (NNCF PTQ in {quantized_in:.0f} s)"
                                                   if PRECISIONS[precision].quantized else ""))
            fns[row] = lambda c=compiled: run_compiled(c, x_np)


def _main() -> int:
    """main, with the product's one-line errors (a --keep the model cannot take, a missing toolchain) as one line."""
    from vlmprune.compiler.errors import VlmpruneError

    try:
        return main()
    except VlmpruneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main())
