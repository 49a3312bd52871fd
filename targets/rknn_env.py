"""rknn-toolkit2 2.5.0 in a virtual environment of its own, driven through a subprocess.

Why a separate environment: rknn-toolkit2 2.5.0 pins numpy<=1.26.4, onnx<=1.18 and
protobuf<=4.25.4, which clash with this project's environment (numpy 2, onnx 1.2x).

What goes into it, and why no torch download: the toolkit imports torch at module level
(`rknn.api.rknn_utils`, and `gdq_quant` decorates with `torch.no_grad()`), but the ONNX
-> .rknn -> simulator path never calls it; torch only serves `load_pytorch` and the GDQ
quantizer. Its metadata asks for torch<=2.4, whose x86 wheel on PyPI is the multi-GB CUDA
build. So the toolkit is installed with --no-deps, next to only what its ONNX path imports,
and the torch of this environment (the CPU build the project installs anyway) is linked
into the venv's site-packages. torch 2.x imports fine against numpy 1.26.

Creation happens in place (venvs hard-code their own path), under an exclusive file lock,
and a marker file written last says the venv is complete; a folder without the marker is a
crashed build and is rebuilt.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RKNN_TOOLKIT_VERSION = "2.5.0"
TOOLKIT_REQUIREMENT = f"rknn-toolkit2=={RKNN_TOOLKIT_VERSION}"
# What the toolkit's ONNX path imports, pinned where the toolkit caps versions.
# onnxruntime 1.26.0 is the newest release that accepts protobuf 4.25 (the toolkit uses it
# to fold constants); opencv's headless build provides cv2 without GUI libraries;
# typing-extensions is the one torch import needs that onnxruntime does not bring.
RUNTIME_REQUIREMENTS = (
    "numpy==1.26.4",
    "onnx==1.18.0",
    "protobuf==4.25.4",
    "onnxruntime==1.26.0",
    "opencv-python-headless>=4.5.5.64,<4.12",
    "scipy>=1.9.3",
    "psutil>=5.9.0",
    "ruamel.yaml>=0.17.21",
    "tqdm>=4.64.1",
    "fast-histogram>=0.11",
    "typing-extensions>=4.10",
)
MARKER = ".vlmprune-ready.json"
WORKER = Path(__file__).with_name("rknn_worker.py")
PYTHON_ENV = "VLMPRUNE_RKNN_PYTHON"  # use an rknn environment you manage yourself


class RknnError(RuntimeError):
    """The rknn environment or worker failed; the message is one line with the log path."""


def cache_dir() -> Path:
    return Path(os.environ.get("VLMPRUNE_CACHE") or Path.home() / ".cache" / "vlmprune")


def venv_dir() -> Path:
    return cache_dir() / f"rknn-venv-{RKNN_TOOLKIT_VERSION}"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _platform_problem() -> str | None:
    """rknn-toolkit2 2.5.0 ships Linux wheels for x86_64 and aarch64, CPython 3.8 to 3.12."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"rknn-toolkit2 has no wheel for {sys.platform}/{platform.machine()}"
    if not (3, 8) <= sys.version_info[:2] <= (3, 12):
        return f"rknn-toolkit2 {RKNN_TOOLKIT_VERSION} has no wheel for Python {sys.version_info.major}.{sys.version_info.minor}"
    return None


def available() -> tuple[bool, str]:
    """Whether an rknn environment is ready now; never installs anything."""
    custom = os.environ.get(PYTHON_ENV)
    if custom:
        ok = Path(custom).is_file()
        return ok, f"{PYTHON_ENV}={custom}" + ("" if ok else " does not exist")
    problem = _platform_problem()
    if problem:
        return False, problem
    venv = venv_dir()
    if not (venv / MARKER).is_file() or not _venv_python(venv).is_file():
        return False, f"rknn venv not created yet at {venv} (rknn_env.rknn_python() creates it)"
    return True, f"rknn venv at {venv}"


def creatable() -> tuple[bool, str]:
    """Whether an rknn environment is ready or can be created here on first use; installs nothing."""
    ok, reason = available()
    if ok or os.environ.get(PYTHON_ENV):
        return ok, reason
    problem = _platform_problem()
    if problem:
        return False, problem
    return True, f"rknn venv is created on first use at {venv_dir()} (~45 s, ~600 MB; torch linked, not downloaded)"


def index_reachable(timeout: float = 60) -> tuple[bool, str]:
    """Whether pip's package index (as this machine configures it) serves rknn-toolkit2 2.5.0; installs nothing.

    Creating the venv downloads ~600 MB; on a machine without the registry that fails
    after minutes of retries, so callers that may skip (the tests) ask this first.
    """
    cmd = [sys.executable, "-m", "pip", "index", "versions", "rknn-toolkit2", "--timeout", "10", "--retries", "1",
           "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"pip index versions rknn-toolkit2 did not answer ({type(exc).__name__})"
    if RKNN_TOOLKIT_VERSION in proc.stdout:
        return True, "the package index serves rknn-toolkit2 " + RKNN_TOOLKIT_VERSION
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no answer"]
    return False, f"the package index does not serve rknn-toolkit2 {RKNN_TOOLKIT_VERSION} here ({tail[0]})"


def venv_info() -> dict:
    """The marker's record: toolkit version, install seconds, size, torch source."""
    marker = venv_dir() / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else {}


def rknn_python() -> Path:
    """The rknn environment's interpreter, creating the venv first if it is missing."""
    custom = os.environ.get(PYTHON_ENV)
    if custom:
        return Path(custom)
    problem = _platform_problem()
    if problem:
        raise RknnError(problem)
    venv = venv_dir()
    if not (venv / MARKER).is_file():
        create_venv(venv)
    return _venv_python(venv)


def create_venv(venv: Path) -> dict:
    """Build the venv in place under a lock; another process waits and reuses the result."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / MARKER).is_file():
            return json.loads((venv / MARKER).read_text())
        if venv.exists():
            shutil.rmtree(venv)  # left by a build that did not finish
        t0 = time.perf_counter()
        try:
            _run([sys.executable, "-m", "venv", str(venv)], "create venv")
            pip = [str(_venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
            _run([*pip, "--no-deps", TOOLKIT_REQUIREMENT], "install rknn-toolkit2")
            _run([*pip, *RUNTIME_REQUIREMENTS], "install rknn runtime requirements")
            torch_source = _link_host_torch(venv)
            _run([str(_venv_python(venv)), "-c", "from rknn.api import RKNN"], "import rknn.api")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        info = {
            "rknn_toolkit2": RKNN_TOOLKIT_VERSION,
            "install_seconds": round(time.perf_counter() - t0, 1),
            "size_bytes": _tree_size(venv),
            "requirements": [TOOLKIT_REQUIREMENT, *RUNTIME_REQUIREMENTS],
            "torch": torch_source,
            "python": sys.version.split()[0],
        }
        tmp = venv / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, venv / MARKER)
        return info


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _link_host_torch(venv: Path) -> str:
    """Symlink this environment's torch distribution (torch, torchgen, functorch, dist-info)."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        raise RknnError("rknn-toolkit2 imports torch at module level: install the CPU torch wheel "
                        "in this environment first (it is linked into the rknn venv, not downloaded)") from None
    tops = sorted({f.parts[0] for f in dist.files or () if f.parts[0] != ".."})
    site = _site_packages(venv)
    for top in tops:
        target = Path(dist.locate_file(top))
        if target.is_dir() and not (site / top).exists():
            (site / top).symlink_to(target, target_is_directory=True)
    return f"torch {dist.version} linked from {Path(dist.locate_file('torch'))}"


def _tree_size(path: Path) -> int:
    """Bytes under path, not following symlinks (the linked torch is not the venv's)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise RknnError(f"rknn venv: {what} failed (exit {proc.returncode}): {tail[0]}")


def _clean_env() -> dict:
    """Keep this environment's packages out of the venv's interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run_worker(request: dict, timeout: float = 1800) -> dict:
    """Run rknn_worker.py in the rknn venv with `request` (see its docstring); return its response.

    Arrays travel as .npy paths. Raises RknnError with one line (stage, message, log path)
    when the worker fails.
    """
    python = rknn_python()
    absolute = lambda paths: [str(Path(p).resolve()) for p in paths]  # the worker runs in out_dir
    request = {**request, "onnx": str(Path(request["onnx"]).resolve())}
    if request.get("run_inputs"):
        request["run_inputs"] = absolute(request["run_inputs"])
    if request.get("run_samples"):
        request["run_samples"] = [absolute(sample) for sample in request["run_samples"]]
    if request.get("dataset"):
        request["dataset"] = [absolute(sample) for sample in request["dataset"]]
    if not request.get("out_dir"):  # the caller owns out_dir; only a folder made here is this call's to make
        request["out_dir"] = tempfile.mkdtemp(prefix="vlmprune-rknn-")
    out_dir = Path(request["out_dir"]).resolve()
    request["out_dir"] = str(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    req_path, resp_path = out_dir / "request.json", out_dir / "response.json"
    req_path.write_text(json.dumps(request, indent=1))
    resp_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run([str(python), str(WORKER), str(req_path), str(resp_path)], cwd=out_dir,
                              capture_output=True, text=True, timeout=timeout, env=_clean_env())
    except subprocess.TimeoutExpired:
        raise RknnError(f"rknn worker timed out after {timeout:.0f} s (log: {out_dir / 'rknn_build.log'})") from None
    if not resp_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RknnError(f"rknn worker died (exit {proc.returncode}): {tail[0]}")
    response = json.loads(resp_path.read_text())
    if not response.get("ok"):
        raise RknnError(f"rknn worker failed: {response.get('error')} (log: {response.get('log')})")
    return response
