#!/usr/bin/env python3
"""Check and time the vlmprune CUDA kernels on this machine's NVIDIA GPU.

Builds kernels/cuda/check_main.cu (CUDA kernels + CPU kernels) with nvcc for the
local GPU and runs it: every CUDA result is compared with the CPU kernels on the
same inputs (B in {1, 8}, N in {576, 1024}, D = 1024, fp32 and fp16, tied scores,
plus edge shapes; DivPrune's greedy picks on 1 - cosine, random, tied and +-inf
distances for N from 1 to 4096, which must match exactly), then gather + summary is
timed against a device-to-device cudaMemcpy of the same traffic, and DivPrune against
one single-threaded CPU call. Every new kernel is also checked against the previous one
(kernels/cuda/token_prune_v1.cu, compiled into the harness only): bit for bit for TopK,
gather + summary and DivPrune, within the CPU tolerance for the [CLS] scorer (whose
summation order changed; it must give the same bits on a second run). The timings print
the v1 figures beside the new ones. With PyTorch + CUDA present, an eager composite
(torch.gather + masked mean) is timed at B=8, N=1024, D=1024 in fp16 and bf16.

    python tools/gpu_kernel_check.py [--arch sm_90] [--reps 200] [--json out.json] [--sanitize [TOOLS]]

--sanitize: afterwards run the correctness cases (no timings) under compute-sanitizer's
memcheck, racecheck (shared-memory hazards) and synccheck, or only the comma-separated
TOOLS (to split a long session's runs); any reported error fails the run.

Exit status: 0 all checks pass, 1 a correctness check failed, 2 build/run error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_build_module():
    """vlmprune.kernels.build, from the installed package or straight from this checkout."""
    try:
        from vlmprune.kernels import build

        return build
    except ImportError:
        spec = importlib.util.spec_from_file_location("vlmprune_kernels_build", REPO / "kernels" / "build.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def local_arch() -> str:
    """sm_XY of GPU 0 from nvidia-smi; 'native' lets nvcc decide when that fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        major, minor = out.splitlines()[0].strip().split(".")
        return f"sm_{major}{minor}"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return "native"


SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else next to nvcc, else CUDA's default prefix."""
    import shutil

    found = shutil.which("compute-sanitizer")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).parent / "compute-sanitizer"] if nvcc else []
    candidates.append(Path("/usr/local/cuda/bin/compute-sanitizer"))
    return next((str(c) for c in candidates if c.is_file()), None)


def run_sanitizers(exe: Path, tools: tuple[str, ...] = SANITIZER_TOOLS) -> dict[str, dict]:
    """Each tool over the correctness cases (--no-timing); {tool: {ok, errors, tail}}."""
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return {tool: {"ok": False, "errors": None, "tail": "compute-sanitizer not found"} for tool in tools}
    results = {}
    for tool in tools:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "3"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "all"]
        cmd += [str(exe), "--no-timing"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        except subprocess.TimeoutExpired:
            results[tool] = {"ok": False, "errors": None, "tail": "timed out after 3600 s"}
            continue
        summary = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if "ERROR SUMMARY" in ln]
        # rc 1: a correctness check failed (the plain run reports it); 3: the tool found errors.
        ok = proc.returncode in (0, 1) and all(" 0 error" in ln for ln in summary)
        results[tool] = {"ok": ok, "errors": summary[-1].strip() if summary else None,
                         "tail": "" if ok else (proc.stderr[-2000:] or proc.stdout[-2000:])}
    return results


def run_harness(exe: Path, reps: int, quick: bool) -> tuple[int, dict]:
    cmd = [str(exe), "--reps", str(reps)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"{exe.name} exited with {proc.returncode}")
    return proc.returncode, json.loads(proc.stdout)


# ----------------------------------------------------------------- PyTorch


def torch_composite(reps: int) -> list[dict] | None:
    """Eager PyTorch at B=8, N=1024, D=1024, K=256: gather + masked mean, and with TopK + sort."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    b, n, d, k = 8, 1024, 1024, 256
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        nbytes = b * (n + 1) * d * torch.finfo(dtype).bits // 8
        copies = max(2, 4 * l2 // nbytes + 1)  # rotate inputs so each rep reads from DRAM, not L2
        hiddens = [torch.randn(b, n + 1, d, device="cuda", dtype=dtype) for _ in range(copies)]
        scores = torch.rand(b, n, device="cuda")

        def select(s):
            return torch.topk(s, k, dim=1).indices.sort(dim=1).values

        idx = select(scores)

        def gather_summary(h, kept):
            patches = h[:, 1:]
            gathered = torch.gather(patches, 1, kept[..., None].expand(-1, -1, d))
            pruned = torch.ones(b, n, dtype=torch.bool, device=h.device).scatter_(1, kept, False)
            summary = (patches * pruned[..., None]).sum(dim=1, keepdim=True) / (n - k)
            return torch.cat([h[:, :1], gathered, summary], dim=1)

        rows.append({
            "dtype": str(dtype).replace("torch.", ""),
            "gather_summary_ms": _cuda_time(lambda r: gather_summary(hiddens[r % copies], idx), reps),
            "select_gather_summary_ms": _cuda_time(lambda r: gather_summary(hiddens[r % copies], select(scores)), reps),
        })
    return rows


def _cuda_time(fn, reps: int) -> float:
    import torch

    for r in range(5):
        fn(r)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(reps):
        fn(r)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


# ------------------------------------------------------------------ report


def print_report(result: dict, torch_rows: list[dict] | None) -> None:
    checks = result["checks"]
    failed = [c for c in checks if not c["pass"]]
    print(f"GPU: {result['device']} (sm_{result['sm']}, L2 {result['l2_bytes'] >> 20} MiB)")
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} checks pass (CUDA vs CPU kernels)")
    for c in failed:
        detail = {key: v for key, v in c.items() if key not in ("name", "pass")}
        print(f"  FAIL {c['name']}  {detail}")

    print("\ngather + summary vs cudaMemcpy D2D of the same bytes (read + written)")
    head = (f"{'dtype':5} {'B':>2} {'N':>5} {'D':>5} {'K':>4} {'ms':>9} {'GB/s':>8} {'memcpy GB/s':>12} {'of memcpy':>10} "
            f"{'topk ms':>9} {'topk v1':>9} {'topk CPU1':>9}")
    print(head)
    print("-" * len(head))
    for t in result["timings"]:
        if t["op"] != "gather_summary":
            continue
        print(f"{t['dtype']:5} {t['B']:>2} {t['N']:>5} {t['D']:>5} {t['K']:>4} {t['ms']:>9.4f} {t['gbps']:>8.0f} "
              f"{t['memcpy_gbps']:>12.0f} {t['vs_memcpy']:>9.0%} {t['select_topk_ms']:>9.4f} "
              f"{t.get('select_topk_v1_ms', float('nan')):>9.4f} {t.get('select_topk_cpu_1thread_ms', float('nan')):>9.4f}")

    print("\n[CLS] scorer (H=16, T=1025, dh=64): new vs v1; goal >= 50% of the copy's GB/s at B=8")
    for t in result["timings"]:
        if t["op"] == "cls_scores":
            layout = "k[dh,T]" if t["k_transposed"] else "k[T,dh]"
            line = (f"  B={t['B']:<2} {t['dtype']} {layout:8} {'int8' if t['int8'] else 'float':5} {t['ms']:.4f} ms  "
                    f"({t['k_gbps']:.0f} GB/s of K")
            if "ms_v1" in t:
                line += (f", {t['k_gbps'] / t['copy_gbps']:.0%} of a copy's {t['copy_gbps']:.0f})  "
                         f"v1 {t['ms_v1']:.4f} ms ({t['k_gbps_v1']:.0f} GB/s), {t['ms_v1'] / t['ms']:.1f}x")
            else:
                line += ")"
            print(line)

    divprune = [t for t in result["timings"] if t["op"] == "divprune_select"]
    if divprune:
        print("\nDivPrune greedy selection (dist [B, N, N] -> K picks; one block per image)")
        for t in divprune:
            v1 = f", v1 {t['ms_v1']:.4f} ms" if "ms_v1" in t else ""
            print(f"  B={t['B']:<2} N={t['N']:<5} K={t['K']:<5} {t['ms']:.4f} ms  "
                  f"(CPU, 1 thread: {t['cpu_1thread_ms']:.3f} ms{v1})")

    if torch_rows is None:
        print("\nPyTorch with CUDA not available: eager composite not timed")
        return
    ours = {t["dtype"]: t for t in result["timings"]
            if t["op"] == "gather_summary" and (t["B"], t["N"], t["D"]) == (8, 1024, 1024)}
    mine = ours.get("fp16")
    print("\neager PyTorch composite, B=8 N=1024 D=1024 K=256 (ours: fp16 kernels; bf16 moves the same bytes)")
    for row in torch_rows:
        line = f"  torch {row['dtype']:8} gather+masked mean {row['gather_summary_ms']:.4f} ms, " \
               f"with topk+sort {row['select_gather_summary_ms']:.4f} ms"
        if mine:
            ours_full = mine["ms"] + mine["select_topk_ms"]
            line += f"  | vlmprune {mine['ms']:.4f} ms ({row['gather_summary_ms'] / mine['ms']:.1f}x), " \
                    f"with topk {ours_full:.4f} ms ({row['select_gather_summary_ms'] / ours_full:.1f}x)"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help="GPU architecture for nvcc (default: the local GPU's)")
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions per measurement")
    parser.add_argument("--quick", action="store_true", help="few timing repetitions")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument("--build-dir", type=Path, help="keep the harness here (default: a temporary folder)")
    parser.add_argument("--sanitize", nargs="?", const=",".join(SANITIZER_TOOLS), metavar="TOOLS",
                        help="also run the correctness cases under compute-sanitizer: memcheck, racecheck and "
                             "synccheck, or the comma-separated TOOLS given")
    args = parser.parse_args(argv)
    sanitize = tuple(t.strip() for t in args.sanitize.split(",") if t.strip()) if args.sanitize else ()
    unknown = set(sanitize) - set(SANITIZER_TOOLS)
    if unknown:
        parser.error(f"unknown sanitizer tool(s) {', '.join(sorted(unknown))}; choose from {', '.join(SANITIZER_TOOLS)}")

    build = load_build_module()
    arch = args.arch or local_arch()
    with tempfile.TemporaryDirectory(prefix="vlmp-gpu-check-") as tmp:
        out_dir = args.build_dir or Path(tmp)
        try:
            exe = build.nvcc_build_harness(arch, out_dir)
            rc, result = run_harness(exe, args.reps, args.quick)
            sanitizers = run_sanitizers(exe, sanitize) if sanitize else None
        except (build.KernelBuildError, RuntimeError, json.JSONDecodeError, subprocess.TimeoutExpired) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        torch_rows = torch_composite(20 if args.quick else args.reps)
    except Exception as exc:  # the kernels' verdict must not depend on the optional comparison
        print(f"PyTorch comparison failed: {exc}", file=sys.stderr)
        torch_rows = None
    print_report(result, torch_rows)
    sanitizers_ok = True
    if sanitizers is not None:
        print("\ncompute-sanitizer over the correctness cases")
        for tool, r in sanitizers.items():
            sanitizers_ok = sanitizers_ok and r["ok"]
            print(f"  {tool:9} {'clean' if r['ok'] else 'FAIL'}  {r['errors'] or ''}")
            if r["tail"]:
                print("    " + r["tail"].replace("\n", "\n    "))
    if args.json:
        args.json.write_text(json.dumps({"arch": arch, **result, "torch": torch_rows, "sanitizers": sanitizers},
                                        indent=1))
    return 1 if rc != 0 or result["failures"] or not sanitizers_ok else 0


if __name__ == "__main__":
    sys.exit(main())
