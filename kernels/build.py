"""Build the vlmprune kernels: the ONNX Runtime custom-op library and CUDA objects.

The library is compiled on first use into a cache folder keyed by the sources and
the compiler, so an installed package needs no build step of its own:

    python -m vlmprune.kernels.build            # build (or reuse) and print the .so path
    python -m vlmprune.kernels.build --force    # rebuild
    python -m vlmprune.kernels.build --cuda sm_87 --out /tmp/k   # CUDA object

The ONNX Runtime C/C++ API headers are not part of the onnxruntime wheel; they are
taken from the npm package below (its iOS xcframework carries them) and cached.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = PACKAGE_DIR / "include"
CPU_DIR = PACKAGE_DIR / "cpu"
CUDA_DIR = PACKAGE_DIR / "cuda"
ORT_DIR = PACKAGE_DIR / "ort"
TRT_COMMON_DIR = PACKAGE_DIR / "trt" / "common"  # plugin_names.h: the plugin contract the ORT twin registers

ORT_NPM_PACKAGE = "com.github.asus4.onnxruntime"
ORT_NPM_VERSION = "0.4.9"  # ONNX Runtime C API version 29 headers; fine for onnxruntime >= 1.20 at run time
ORT_HEADER_PROBE = "onnxruntime_cxx_api.h"

LIBRARY_NAME = "libvlmprune_ort_ops.so"
CUDA_LIBRARY_SOURCE = "token_prune.cu"  # the kernels; other .cu files in cuda/ are test harnesses
CUDA_HARNESS_SOURCE = "check_main.cu"
CUDA_BASELINE_SOURCE = "token_prune_v1.cu"  # the previous kernels (*_v1): the harness's baseline only

# Exported symbols of the custom-op library: everything else stays local so the
# inlined ONNX Runtime C++ wrappers cannot clash with another library's copy.
EXPORTS_MAP = "{ global: RegisterCustomOps; vlmp_*; local: *; };\n"


class KernelBuildError(RuntimeError):
    """A kernel build step failed; the message says which tool and why, on one line."""


class ToolNotFoundError(KernelBuildError):
    """A required tool (g++, npm, nvcc) is not installed: callers may skip rather than fail."""


def cache_dir() -> Path:
    """Root of the build cache: $VLMPRUNE_CACHE, else ~/.cache/vlmprune."""
    root = os.environ.get("VLMPRUNE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "vlmprune"


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise KernelBuildError(f"{what}: cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        # Keep the exception to one line; the full compiler output goes to stderr.
        sys.stderr.write(proc.stdout + proc.stderr)
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln.lower()), proc.stderr.strip()[:300])
        raise KernelBuildError(f"{what} failed (exit {proc.returncode}): {first.strip()}")
    return proc.stdout


def _which(env_var: str, default: str, hint: str, extra: tuple[str, ...] = ()) -> str:
    name = os.environ.get(env_var, default)
    found = shutil.which(name)
    for candidate in extra:
        if found is None and Path(candidate).is_file():
            found = candidate
    if found is None:
        raise ToolNotFoundError(f"{name} not found on PATH ({hint}; or set {env_var})")
    return found


def publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a finished build into place; a concurrent builder that won keeps its copy."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------- ONNX Runtime headers


def ort_headers_dir() -> Path:
    """A folder holding onnxruntime_c_api.h / onnxruntime_cxx_api.h.

    $VLMPRUNE_ORT_INCLUDE wins when set (e.g. an onnxruntime dev package); otherwise
    the npm package is installed once into the cache and only its headers are kept.
    """
    override = os.environ.get("VLMPRUNE_ORT_INCLUDE")
    if override:
        path = Path(override).expanduser()
        if not (path / ORT_HEADER_PROBE).is_file():
            raise KernelBuildError(f"VLMPRUNE_ORT_INCLUDE={path} has no {ORT_HEADER_PROBE}")
        return path
    final = cache_dir() / "ort-headers" / ORT_NPM_VERSION
    if (final / ORT_HEADER_PROBE).is_file():
        return final
    npm = _which("NPM", "npm", "Node.js npm is needed once to fetch the ONNX Runtime headers")
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".npm-", dir=final.parent))
    try:
        _run(
            [npm, "install", "--prefix", str(work), "--no-save", "--no-package-lock", "--ignore-scripts",
             "--no-audit", "--no-fund", f"{ORT_NPM_PACKAGE}@{ORT_NPM_VERSION}"],
            f"npm install {ORT_NPM_PACKAGE}@{ORT_NPM_VERSION}",
        )
        headers = _find_headers(work / "node_modules" / ORT_NPM_PACKAGE)
        staged = work / "include"
        staged.mkdir()
        for header in headers.glob("*.h"):
            shutil.copy2(header, staged / header.name)
        staged_final = publish_dir(staged, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # drops the ~150 MB of iOS binaries
    return staged_final


def _find_headers(package_root: Path) -> Path:
    candidates = sorted(p.parent for p in package_root.rglob(ORT_HEADER_PROBE) if p.parent.name == "Headers")
    if not candidates:
        raise KernelBuildError(f"{ORT_NPM_PACKAGE}@{ORT_NPM_VERSION} has no Headers/{ORT_HEADER_PROBE}")
    return candidates[0]


# ------------------------------------------------------------ custom-op library


def _cpu_flags() -> list[str]:
    # x86-64-v2 (SSE4.2) runs on every x86-64 server of the last decade; never -march=native,
    # the library is shipped in bundles and run on other machines.
    machine = platform.machine().lower()
    arch = ["-march=x86-64-v2"] if machine in ("x86_64", "amd64") else []
    return ["-std=c++17", "-O3", *arch, "-fopenmp-simd", "-fPIC", "-Wall", "-Wextra"]


def library_sources() -> list[Path]:
    return sorted(CPU_DIR.glob("*.cc")) + sorted(ORT_DIR.glob("*.cc"))


def _source_hash(files: list[Path], extra: list[str]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    for item in extra:
        digest.update(item.encode())
    return digest.hexdigest()[:16]


def build_ort_library(force: bool = False) -> Path:
    """Path of the compiled custom-op library, building it when the sources changed."""
    cxx = _which("CXX", "g++", "a C++17 compiler is needed to build the ONNX Runtime custom-op library")
    version = _run([cxx, "--version"], f"{cxx} --version").splitlines()[0]
    flags = _cpu_flags()
    headers = (sorted(INCLUDE_DIR.rglob("*.h")) + sorted(CPU_DIR.glob("*.h")) + sorted(ORT_DIR.glob("*.h"))
               + [TRT_COMMON_DIR / "plugin_names.h"])
    sources = library_sources()
    ort_source = os.environ.get("VLMPRUNE_ORT_INCLUDE") or ORT_NPM_VERSION
    key = _source_hash(sources + headers, [version, " ".join(flags), ort_source, EXPORTS_MAP])
    final = cache_dir() / "kernels" / f"ort-{key}"
    if (final / LIBRARY_NAME).is_file() and not force:
        return final / LIBRARY_NAME

    ort_include = ort_headers_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        (tmp / "exports.map").write_text(EXPORTS_MAP)
        cmd = [cxx, *flags, f"-I{INCLUDE_DIR}", f"-I{CPU_DIR}", f"-I{TRT_COMMON_DIR.parent}", f"-I{ort_include}", *map(str, sources),
               "-shared", f"-Wl,--version-script={tmp / 'exports.map'}", "-o", str(tmp / LIBRARY_NAME)]
        _run(cmd, f"building {LIBRARY_NAME}")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        if force and final.exists():
            shutil.rmtree(final)
        return publish_dir(tmp, final) / LIBRARY_NAME
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------- CUDA


def find_nvcc() -> str:
    return _which("NVCC", "nvcc", "the CUDA toolkit is needed to compile the CUDA kernels",
                  extra=("/usr/local/cuda/bin/nvcc",))


def _sm(arch: str) -> str:
    """'sm_87', '87', '8.7' or 'compute_87' -> 'sm_87'; 'native' passes through."""
    text = arch.strip().lower()
    if text == "native":
        return text
    digits = text.removeprefix("sm_").removeprefix("compute_").replace(".", "")
    if not digits.isdigit():
        raise KernelBuildError(f"unrecognised CUDA architecture {arch!r} (expected e.g. sm_87)")
    return f"sm_{digits}"


def _nvcc_flags(arch: str, std: str = "c++17") -> list[str]:
    # Nothing newer than CUDA 11.4 offers: the Xavier toolchain compiles the same file (as C++14).
    return [f"-std={std}", "-O3", f"-arch={_sm(arch)}", "-Xcompiler", "-fPIC", f"-I{INCLUDE_DIR}"]


def nvcc_compile(arch: str, out_dir: str | os.PathLike, std: str = "c++17") -> Path:
    """Compile the CUDA kernels (cuda/token_prune.cu) into an object for one GPU architecture."""
    sm = _sm(arch)
    nvcc = find_nvcc()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    obj = out / f"token_prune_{sm}.o"
    _run([nvcc, *_nvcc_flags(sm, std), "-c", str(CUDA_DIR / CUDA_LIBRARY_SOURCE), "-o", str(obj)],
         f"nvcc {CUDA_LIBRARY_SOURCE} for {sm}")
    return obj


def nvcc_build_harness(arch: str, out_dir: str | os.PathLike) -> Path:
    """Build cuda/check_main.cu (CUDA vs CPU and vs the v1 kernels, and timing) into an executable."""
    sm = _sm(arch)
    nvcc = find_nvcc()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    exe = out / f"vlmp_check_{sm}"
    host = ",".join(f for f in _cpu_flags() if f.startswith(("-O", "-march", "-fopenmp")))
    cmd = [nvcc, *_nvcc_flags(sm), f"-I{CPU_DIR}", "-Xcompiler", host,
           str(CUDA_DIR / CUDA_HARNESS_SOURCE), str(CUDA_DIR / CUDA_LIBRARY_SOURCE), str(CUDA_DIR / CUDA_BASELINE_SOURCE),
           *map(str, sorted(CPU_DIR.glob("*.cc"))), "-o", str(exe)]
    _run(cmd, f"nvcc {CUDA_HARNESS_SOURCE} for {sm}")
    return exe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmprune.kernels.build", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild the custom-op library")
    parser.add_argument("--cuda", metavar="ARCH", help="compile the CUDA kernels for ARCH (e.g. sm_87) instead")
    parser.add_argument("--out", default=".", help="output folder of --cuda (default: .)")
    args = parser.parse_args(argv)
    try:
        path = nvcc_compile(args.cuda, args.out) if args.cuda else build_ort_library(force=args.force)
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
