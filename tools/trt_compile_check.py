#!/usr/bin/env python3
"""Compile-check the TensorRT plugin wrappers (kernels/trt) against TensorRT headers.

No TensorRT library is needed, only its public headers (NvInfer*.h), which this tool
never downloads: point --trt-include at a folder holding them, e.g. the include/ of
a TensorRT release (v10.3.0 for --api v3, 8.5.2 for --api v2).

    python tools/trt_compile_check.py --api v3 --trt-include /tmp/trt-10.3/include
    python tools/trt_compile_check.py --api v2 --trt-include /tmp/trt-8.5/include

Steps, each reported with its command and the compiler's output (warnings included):
  compile   every wrapper .cpp of the API into an object (C++17 for v3, C++14 for v2,
            -Wall -Wextra -Wpedantic -Wshadow; TensorRT/CUDA headers as system headers),
            and for v3 also the optional static-registration variant;
  nvcc      the wrapper's own .cu files (v2: the int64 -> int32 index cast);
  symbols   link the objects into a throwaway shared library and check what it
            exports (v3: exactly getCreators and setLoggerFinder, what TensorRT 10's
            IPluginRegistry::loadLibrary looks up) and what it needs from outside
            (only the two kernel entry points, the CUDA runtime and, for v2,
            libnvinfer's getPluginRegistry/getLogger);
  host      build kernels/trt/host_check/host_check_<api>.cpp with the wrappers and
            host stubs of the kernels, and run it: the plugin is driven through its
            TensorRT interfaces (creator, shapes, formats, profiles, serialisation,
            enqueue wiring) without a GPU or TensorRT.

Exit status 0 when every step that ran passed. --json PATH writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"
TRT_DIR = KERNELS / "trt"

# Per API: the C++ standard of its toolchain (JetPack 6: gcc 11 / CUDA 12.6; JetPack
# 5.1: gcc 9 / CUDA 11.4), the TensorRT majors it is written for, and the default SM.
# sm_72 (Xavier) cannot be targeted by CUDA 13's nvcc, so v2 falls back to the oldest
# SM such an nvcc still accepts; the device build uses 72 (v2/CMakeLists.txt).
APIS = {
    "v3": {"std": "c++17", "majors": range(10, 100), "arch": "87"},
    "v2": {"std": "c++14", "majors": range(8, 9), "arch": "75"},
}
# Loader entry points the v3 library must export, and nothing else.
V3_EXPORTS = {"getCreators", "setLoggerFinder"}
# What the wrappers may take from outside besides the C/C++ runtime: the three kernel
# entry points (thin wrappers: nothing else of kernels.h), the CUDA runtime and, for
# v2 only, libnvinfer's registry and logger. v3 needs nothing of libnvinfer.
KERNEL_ENTRY_POINTS = {"vlmp_select_topk_cuda", "vlmp_gather_summary_cuda", "vlmp_cls_scores_cuda"}
NVINFER_SYMBOLS = {"v2": {"getPluginRegistry", "getLogger"}, "v3": set()}
CUDA_RUNTIME_PREFIXES = ("cuda", "__cuda")


@dataclass
class Step:
    name: str
    ok: bool | None  # None: skipped
    commands: list[str] = field(default_factory=list)
    output: str = ""
    detail: str = ""


@dataclass
class Report:
    api: str
    trt_include: str
    trt_version: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok is not False for s in self.steps)


def _run(cmd: list[str], cwd: Path | None = None) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _show(cmd: list[str]) -> str:
    return " ".join(cmd)


def trt_version(include: Path) -> tuple[int, int, int]:
    text = (include / "NvInferVersion.h").read_text(encoding="utf-8", errors="replace")
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+NV_TENSORRT_{name}\s+(\d+)", text)
        if match is None:
            raise SystemExit(f"{include}/NvInferVersion.h has no NV_TENSORRT_{name}")
        parts.append(int(match.group(1)))
    return parts[0], parts[1], parts[2]


def default_cuda_include(nvcc: str | None) -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for root in candidates:
        if root and (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return Path(root) / "include"
    return None


class Checker:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.api = args.api
        self.spec = APIS[args.api]
        self.trt_include = Path(args.trt_include).resolve()
        self.cuda_include = Path(args.cuda_include).resolve()
        self.cxx = args.cxx
        self.nvcc = args.nvcc
        self.arch = args.cuda_arch or self.spec["arch"]
        self.work = work
        self.api_dir = TRT_DIR / args.api

    def _includes(self) -> list[str]:
        return [
            "-isystem", str(self.trt_include),
            "-isystem", str(self.cuda_include),
            "-I", str(KERNELS / "include"),
            "-I", str(TRT_DIR),
        ]  # fmt: skip

    def _cxx_flags(self) -> list[str]:
        return [f"-std={self.spec['std']}", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", *self._includes()]

    def wrapper_sources(self) -> list[Path]:
        return sorted(self.api_dir.glob("*.cpp"))

    def cuda_sources(self) -> list[Path]:
        return sorted(self.api_dir.glob("*.cu"))

    def compile(self) -> tuple[Step, list[Path]]:
        step = Step("compile", True)
        objects: list[Path] = []
        outputs: list[str] = []
        variants: list[tuple[Path, list[str], bool]] = [(src, [], True) for src in self.wrapper_sources()]
        if self.api == "v3":
            # The opt-in static registration (CMake VLMP_TRT_STATIC_REGISTRATION) is checked too.
            variants.append((self.api_dir / "entry_points.cpp", ["-DVLMP_TRT_STATIC_REGISTRATION=1"], False))
        for src, extra, keep in variants:
            obj = self.work / f"{src.stem}.o"
            # Visibility flags as in the CMake build, so the symbol check sees the same exports.
            cmd = [self.cxx, *self._cxx_flags(), *extra, "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
            cmd += ["-c", str(src), "-o", str(obj)] if keep else ["-fsyntax-only", str(src)]
            rc, out = _run(cmd)
            step.commands.append(_show(cmd))
            outputs.append(f"$ {_show(cmd)}\n{out or '(no output)'}")
            if rc != 0:
                step.ok = False
            elif keep:
                objects.append(obj)
        step.output = "\n".join(outputs)
        return step, objects

    def nvcc_compile(self) -> tuple[Step, list[Path]]:
        sources = self.cuda_sources()
        if not sources:
            return Step("nvcc", None, detail=f"no .cu files in kernels/trt/{self.api}"), []
        if self.nvcc is None:
            return Step("nvcc", None, detail="nvcc not found (set --nvcc)"), []
        step = Step("nvcc", True, detail=f"sm_{self.arch}")
        objects: list[Path] = []
        outputs: list[str] = []
        for src in sources:
            obj = self.work / f"{src.stem}.cu.o"
            cmd = [
                self.nvcc, f"-std={self.spec['std']}", f"-arch=sm_{self.arch}",
                "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall,-Wextra",
                "-I", str(KERNELS / "include"), "-I", str(TRT_DIR),
                "-c", str(src), "-o", str(obj),
            ]  # fmt: skip
            rc, out = _run(cmd)
            step.commands.append(_show(cmd))
            outputs.append(f"$ {_show(cmd)}\n{out or '(no output)'}")
            if rc != 0:
                step.ok = False
            else:
                objects.append(obj)
        step.output = "\n".join(outputs)
        return step, objects

    def symbols(self, objects: list[Path]) -> Step:
        nm = shutil.which("nm")
        if nm is None:
            return Step("symbols", None, detail="nm not found")
        lib = self.work / "libvlmprune_trt_check.so"
        link = [self.cxx, "-shared", "-o", str(lib), *map(str, objects)]
        rc, out = _run(link)
        step = Step("symbols", rc == 0, commands=[_show(link)], output=f"$ {_show(link)}\n{out or '(no output)'}")
        if rc != 0:
            return step
        defined_cmd = [nm, "-D", "--defined-only", str(lib)]
        undefined_cmd = [nm, "-D", "--undefined-only", str(lib)]
        step.commands += [_show(defined_cmd), _show(undefined_cmd)]
        _, defined_out = _run(defined_cmd)
        _, undefined_out = _run(undefined_cmd)
        exported = {
            fields[-1] for fields in map(str.split, defined_out.splitlines())
            if len(fields) >= 3 and not fields[-1].startswith("_")  # _init, _fini, ... come from the toolchain
        }  # fmt: skip
        # The throwaway library is linked against the C/C++ runtime only, so what it
        # still lacks carries no symbol version: that is what it needs from elsewhere.
        needed = {
            fields[-1] for fields in map(str.split, undefined_out.splitlines())
            if len(fields) == 2 and fields[0] == "U" and "@" not in fields[1]
        }  # fmt: skip
        kernel_calls = {sym for sym in needed if sym.startswith("vlmp_")}
        foreign = {
            sym for sym in needed - kernel_calls - NVINFER_SYMBOLS[self.api]
            if not sym.startswith(CUDA_RUNTIME_PREFIXES)
        }  # fmt: skip
        step.output += (
            f"\n$ {_show(defined_cmd)}  # exported, C symbols: {sorted(exported) or 'none'}"
            f"\n$ {_show(undefined_cmd)}  # unresolved: {sorted(needed)}"
        )
        problems = []
        if self.api == "v3" and exported != V3_EXPORTS:
            problems.append(f"exports {sorted(exported)}, expected exactly {sorted(V3_EXPORTS)}")
        if self.api == "v2" and exported:
            problems.append(f"exports {sorted(exported)}; the v2 library registers statically and exports nothing")
        if kernel_calls != KERNEL_ENTRY_POINTS:
            problems.append(f"calls kernel entry points {sorted(kernel_calls)}, expected {sorted(KERNEL_ENTRY_POINTS)}")
        if foreign:
            problems.append(f"needs unexpected symbols {sorted(foreign)}")
        step.ok = not problems
        step.detail = "; ".join(problems) or (
            f"exports {sorted(exported) or 'nothing'}; needs kernels {sorted(kernel_calls)}"
            + (f" and libnvinfer {sorted(needed & NVINFER_SYMBOLS[self.api])}" if self.api == "v2" else "")
        )
        return step

    def host(self) -> Step:
        harness = TRT_DIR / "host_check" / f"host_check_{self.api}.cpp"
        exe = self.work / f"host_check_{self.api}"
        sources = [harness, TRT_DIR / "host_check" / "host_kernel_stubs.cpp", *self.wrapper_sources()]
        build = [self.cxx, *self._cxx_flags(), *map(str, sources), "-o", str(exe)]
        rc, out = _run(build)
        step = Step("host", rc == 0, commands=[_show(build)], output=f"$ {_show(build)}\n{out or '(no output)'}")
        if rc != 0:
            return step
        rc, out = _run([str(exe)])
        step.commands.append(str(exe))
        step.output += f"\n$ {exe}\n{out}"
        step.ok = rc == 0
        step.detail = out.splitlines()[-1] if out else f"exit {rc}"
        return step


def run_checks(args: argparse.Namespace) -> Report:
    include = Path(args.trt_include)
    if not (include / "NvInferRuntime.h").is_file() or not (include / "NvInferVersion.h").is_file():
        raise SystemExit(f"{include} does not hold the TensorRT headers (NvInferRuntime.h, NvInferVersion.h)")
    major, minor, patch = trt_version(include)
    if major not in APIS[args.api]["majors"]:
        wanted = "10.x or newer" if args.api == "v3" else "8.x"
        raise SystemExit(f"{include} is TensorRT {major}.{minor}.{patch}; --api {args.api} needs TensorRT {wanted}")
    report = Report(args.api, str(include.resolve()), f"{major}.{minor}.{patch}")
    with tempfile.TemporaryDirectory(prefix=f"vlmprune-trt-{args.api}-") as tmp:
        checker = Checker(args, Path(tmp))
        compile_step, objects = checker.compile()
        report.steps.append(compile_step)
        nvcc_step, cu_objects = checker.nvcc_compile()
        report.steps.append(nvcc_step)
        if compile_step.ok and nvcc_step.ok is not False:
            report.steps.append(checker.symbols(objects + cu_objects))
        if not args.no_host_check and compile_step.ok:
            report.steps.append(checker.host())
    return report


def print_report(report: Report) -> None:
    print(f"TensorRT {report.trt_version} headers: {report.trt_include} (--api {report.api})")
    for step in report.steps:
        verdict = {True: "ok", False: "FAILED", None: "skipped"}[step.ok]
        print(f"\n== {step.name}: {verdict}" + (f" ({step.detail})" if step.detail else ""))
        if step.output:
            print(step.output)
    print(f"\n{'PASS' if report.ok else 'FAIL'}: kernels/trt/{report.api} against TensorRT {report.trt_version}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trt-include", required=True, help="folder holding NvInfer.h (never fetched by this tool)")
    parser.add_argument("--api", required=True, choices=sorted(APIS), help="v3: TensorRT 10 IPluginV3; v2: 8.5")
    parser.add_argument("--cuda-include", help="folder holding cuda_runtime_api.h (default: from CUDA_HOME or nvcc)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="C++ compiler (default: $CXX or g++)")
    parser.add_argument("--nvcc", default=None, help="nvcc for the wrapper's .cu files (default: nvcc on PATH)")
    parser.add_argument("--cuda-arch", default=None, help="SM for nvcc (default: v3 87, v2 75; see APIS)")
    parser.add_argument("--no-host-check", action="store_true", help="skip building and running the host check")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)

    if shutil.which(args.cxx) is None:
        raise SystemExit(f"C++ compiler {args.cxx!r} not found")
    args.nvcc = args.nvcc or shutil.which("nvcc")
    if args.cuda_include is None:
        found = default_cuda_include(args.nvcc)
        if found is None:
            raise SystemExit("CUDA headers (cuda_runtime_api.h) not found; pass --cuda-include")
        args.cuda_include = str(found)

    report = run_checks(args)
    print_report(report)
    if args.json:
        payload = asdict(report) | {"ok": report.ok}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
