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

The venv is built as every isolated toolchain's is (vlmprune.targets.venvs: in place,
under a lock, a marker written last).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from vlmprune.targets.venvs import IsolatedEnv, clean_env, link_host_torch, venv_python

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
WORKER = Path(__file__).with_name("rknn_worker.py")
PYTHON_ENV = "VLMPRUNE_RKNN_PYTHON"  # use an rknn environment you manage yourself


class RknnError(RuntimeError):
    """The rknn environment or worker failed; the message is one line with the log path."""


def _platform_problem() -> str | None:
    """rknn-toolkit2 2.5.0 ships Linux wheels for x86_64 and aarch64, CPython 3.8 to 3.12."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"rknn-toolkit2 has no wheel for {sys.platform}/{platform.machine()}"
    if not (3, 8) <= sys.version_info[:2] <= (3, 12):
        return f"rknn-toolkit2 {RKNN_TOOLKIT_VERSION} has no wheel for Python {sys.version_info.major}.{sys.version_info.minor}"
    return None


ENV = IsolatedEnv("rknn venv", f"rknn-venv-{RKNN_TOOLKIT_VERSION}", "rknn-toolkit2", RKNN_TOOLKIT_VERSION, PYTHON_ENV,
                  RknnError, _platform_problem, "rknn_env.rknn_python()",
                  cost=("630 MB", "30 s"))  # measured: 628 MB, 27 s (2 cores, a fast index)
venv_dir, available, index_reachable, venv_info = ENV.venv_dir, ENV.available, ENV.index_reachable, ENV.info


def creatable() -> tuple[bool, str]:
    """Whether an rknn environment is ready or can be created here on first use; installs nothing."""
    ok, reason = available()
    if ok or os.environ.get(PYTHON_ENV):
        return ok, reason
    problem = _platform_problem()
    if problem:
        return False, problem
    return True, f"rknn venv is created on first use at {venv_dir()} (~45 s, ~600 MB; torch linked, not downloaded)"


def rknn_python() -> Path:
    """The rknn environment's interpreter, creating the venv first if it is missing."""
    return ENV.python(create_venv)


def create_venv(venv: Path, log=None) -> dict:
    """Build the venv (the toolkit without its deps, its ONNX path's requirements, the host's torch linked)."""
    def install(venv: Path) -> dict:
        ENV.run([sys.executable, "-m", "venv", str(venv)], "create venv")
        pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        ENV.run([*pip, "--no-deps", TOOLKIT_REQUIREMENT], "install rknn-toolkit2")
        ENV.run([*pip, *RUNTIME_REQUIREMENTS], "install rknn runtime requirements")
        torch_source = link_host_torch(venv, RknnError("rknn-toolkit2 imports torch at module level: install "
                                                         "the CPU torch wheel in this environment first (it is "
                                                         "linked into the rknn venv, not downloaded)"))
        ENV.run([str(venv_python(venv)), "-c", "from rknn.api import RKNN"], "import rknn.api")
        return {"rknn_toolkit2": RKNN_TOOLKIT_VERSION, "requirements": [TOOLKIT_REQUIREMENT, *RUNTIME_REQUIREMENTS],
                "torch": torch_source}

    return ENV.build(venv, install, log)


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
                              capture_output=True, text=True, timeout=timeout, env=clean_env())
    except subprocess.TimeoutExpired:
        raise RknnError(f"rknn worker timed out after {timeout:.0f} s (log: {out_dir / 'rknn_build.log'})") from None
    if not resp_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RknnError(f"rknn worker died (exit {proc.returncode}): {tail[0]}")
    response = json.loads(resp_path.read_text())
    if not response.get("ok"):
        raise RknnError(f"rknn worker failed: {response.get('error')} (log: {response.get('log')})")
    return response
