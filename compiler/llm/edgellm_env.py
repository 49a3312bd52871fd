"""NVIDIA TensorRT Edge-LLM's exporter (tensorrt-edgellm[export] 0.11.0) in a virtual environment of its own.

Why a separate environment: the exporter pins transformers==5.14.1, onnx==1.19.0,
onnxscript==0.7.1, onnx-graphsurgeon==0.6.1 and numpy==2.2.6, which clash with this
project's environment (transformers 5.2x, onnx 1.2x). Its torch pin (2.13.0) is the torch
this project installs, so this environment's CPU torch is linked into the venv (as for
rknn-toolkit2) and pip takes it as installed instead of downloading PyPI's CUDA build;
everything else the exporter pins is installed into the venv. Why a link and not
--system-site-packages: that would see the base interpreter's packages, not those of the
virtual environment vlmprune itself may run in.

It is driven through its console script (`tensorrt-edgellm-export`) by subprocess, as
rk3588's toolkit is, and built as every isolated toolchain's venv is (vlmprune.targets.venvs:
in place, under a lock, a marker written last).

Environment variables:
    VLMPRUNE_CACHE            root of the cache (default ~/.cache/vlmprune), as for rknn
    VLMPRUNE_EDGELLM_PYTHON   use an interpreter you manage yourself (its environment must
                              have tensorrt-edgellm[export] 0.11.0; nothing is created)
    VLMPRUNE_EDGELLM_CREATE=0 never create the venv (tests skip instead)
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from vlmprune.targets.venvs import IsolatedEnv, link_host_torch, venv_python

EDGELLM_VERSION = "0.11.0"
REQUIREMENT = f"tensorrt-edgellm[export]=={EDGELLM_VERSION}"
# What 0.11.0's metadata pins exactly (recorded in the marker; pip resolves them from REQUIREMENT).
PINS = ("torch==2.13.0", "transformers==5.14.1", "onnx==1.19.0", "onnxscript==0.7.1",
        "onnx-graphsurgeon==0.6.1", "numpy==2.2.6")
EXPORT_SCRIPT = "tensorrt-edgellm-export"
PYTHON_ENV = "VLMPRUNE_EDGELLM_PYTHON"
CREATE_ENV = "VLMPRUNE_EDGELLM_CREATE"
# Measured: building the venv took 65 s and left 0.99 GB on disk on a 2-core machine (torch linked, pip's
# cache cold). The README says the same figures; tests/compiler/test_llm_edgellm.py holds the two together.
CREATE_COST = ("65 s", "1 GB")


class EdgeLlmError(RuntimeError):
    """The Edge-LLM environment or exporter failed; the message is one line (with the log path when there is one)."""


def _platform_problem() -> str | None:
    if sys.platform != "linux":
        return f"tensorrt-edgellm's exporter is set up here on Linux only, not {sys.platform}"
    if sys.version_info[:2] < (3, 10):
        return f"tensorrt-edgellm {EDGELLM_VERSION} needs Python >= 3.10"
    return None


ENV = IsolatedEnv("Edge-LLM venv", f"edgellm-venv-{EDGELLM_VERSION}", "tensorrt-edgellm", EDGELLM_VERSION,
                  PYTHON_ENV, EdgeLlmError, _platform_problem, "edgellm_env.edgellm_python()",
                  cost=(CREATE_COST[1], CREATE_COST[0]))
venv_dir, available, index_reachable, venv_info = ENV.venv_dir, ENV.available, ENV.index_reachable, ENV.info


def _host_torch_problem() -> str | None:
    """The venv reuses this environment's torch; another version would make pip download one (GBs)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "torch is not installed here (the Edge-LLM venv reuses the host's CPU torch 2.13.0)"
    if version.split("+")[0] != "2.13.0":
        return f"the host's torch is {version}; tensorrt-edgellm {EDGELLM_VERSION} pins torch==2.13.0"
    return None


def creatable() -> tuple[bool, str]:
    """Whether the environment is ready or can be created here on first use; installs nothing."""
    ok, reason = available()
    if ok or os.environ.get(PYTHON_ENV):
        return ok, reason
    problem = _platform_problem() or _host_torch_problem()
    if problem:
        return False, problem
    if os.environ.get(CREATE_ENV, "1") == "0":
        return False, f"Edge-LLM venv not created and {CREATE_ENV}=0"
    return True, f"Edge-LLM venv is created on first use at {venv_dir()} (~{CREATE_COST[0]}, ~{CREATE_COST[1]}; torch linked, not downloaded)"


def edgellm_python() -> Path:
    """The exporter environment's interpreter, creating the venv first if it is missing."""
    return ENV.python(create_venv, f"{CREATE_ENV}=0" if os.environ.get(CREATE_ENV, "1") == "0" else None)


def export_command() -> list[str]:
    """argv prefix that runs `tensorrt-edgellm-export` in the environment (creating it first if needed)."""
    python = edgellm_python()
    script = python.parent / EXPORT_SCRIPT
    if script.is_file():
        return [str(script)]
    # A custom interpreter whose scripts live elsewhere: the console script's own entry point.
    return [str(python), "-c", "import sys; from tensorrt_edgellm.scripts.export import main; "
                               "sys.argv[0] = 'tensorrt-edgellm-export'; sys.exit(main())"]


def create_venv(venv: Path, log=None) -> dict:
    """Build the venv: this environment's torch linked in, the exporter and its pins installed."""
    problem = _host_torch_problem()
    if problem:
        raise EdgeLlmError(problem)

    def install(venv: Path) -> dict:
        ENV.run([sys.executable, "-m", "venv", str(venv)], "create venv")
        torch_source = link_host_torch(venv, EdgeLlmError("torch is not installed here (the Edge-LLM venv links "
                                                          "this environment's CPU torch 2.13.0)"))
        python = str(venv_python(venv))
        ENV.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", REQUIREMENT],
                f"pip install {REQUIREMENT}")
        probe = ("import importlib.metadata as m, torch, tensorrt_edgellm.scripts.export; "
                 "print(torch.__file__); print(m.version('transformers'))")
        out = ENV.run([python, "-c", probe], "import tensorrt_edgellm").strip().splitlines()
        if not (venv / "bin" / EXPORT_SCRIPT).is_file():
            raise EdgeLlmError(f"Edge-LLM venv: pip install {REQUIREMENT} did not install {EXPORT_SCRIPT}")
        return {"tensorrt_edgellm": EDGELLM_VERSION, "requirement": REQUIREMENT, "pins": list(PINS),
                "torch": f"{torch_source} (imported from {Path(out[0]).parent})",
                "transformers": out[1] if len(out) > 1 else None}

    return ENV.build(venv, install, log)
