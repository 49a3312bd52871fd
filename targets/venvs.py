"""Toolchains in virtual environments of their own, driven through a subprocess.

Why: some toolchains pin versions that clash with this project's environment
(rknn-toolkit2 2.5.0: numpy 1.26 and onnx 1.18; TensorRT Edge-LLM's exporter 0.11.0:
transformers 5.14.1 and onnx 1.19). Each gets a venv under the cache folder, built once.

How a venv is built, for every such toolchain alike: in place (venvs hard-code their own
path), under an exclusive file lock (a second process waits, then reuses the result), and a
marker file written last says the venv is complete; a folder without the marker is a crashed
build and is rebuilt. A user who manages the environment themselves points an environment
variable at its interpreter, and nothing is created.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from vlmprune.kernels.build import cache_dir  # the one cache root ($VLMPRUNE_CACHE, else ~/.cache/vlmprune)

MARKER = ".vlmprune-ready.json"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def clean_env() -> dict:
    """Keep this environment's packages out of the venv's interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def tree_size(path: Path) -> int:
    """Bytes under path, not following symlinks (a linked host package is not the venv's)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def link_host_torch(venv: Path, missing: Exception) -> str:
    """Symlink this environment's torch distribution (torch, torchgen, functorch, dist-info) into venv.

    Why: a toolchain that needs torch gets the CPU build this project installs; pip in the
    venv then sees torch installed and does not fetch PyPI's default (multi-GB CUDA) wheel.
    missing: raised when this environment has no torch.
    """
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    tops = sorted({f.parts[0] for f in dist.files or () if f.parts[0] != ".."})
    site = site_packages(venv)
    for top in tops:
        target = Path(dist.locate_file(top))
        if target.is_dir() and not (site / top).exists():
            (site / top).symlink_to(target, target_is_directory=True)
    return f"torch {dist.version} linked from {Path(dist.locate_file('torch'))}"


@dataclasses.dataclass(frozen=True)
class IsolatedEnv:
    """One toolchain's venv: where it lives, how it is named in messages, what its failures raise."""

    label: str  # in messages: "rknn venv", "Edge-LLM venv"
    folder: str  # under cache_dir(): "rknn-venv-2.5.0"
    package: str  # the pip name the index is asked for
    version: str
    python_env: str  # the variable naming an interpreter the user manages
    error: type[Exception]
    platform_problem: Callable[[], str | None]
    creator: str  # what creates it, for the "not created yet" line
    cost: tuple[str, str] = ("", "")  # (size, time) its creation took when measured here, said before it starts

    def venv_dir(self) -> Path:
        return cache_dir() / self.folder

    def custom_python(self) -> Path | None:
        custom = os.environ.get(self.python_env)
        return Path(custom) if custom else None

    def available(self) -> tuple[bool, str]:
        """Whether the environment is ready now; never installs anything."""
        custom = self.custom_python()
        if custom is not None:
            ok = custom.is_file()
            return ok, f"{self.python_env}={custom}" + ("" if ok else " does not exist")
        problem = self.platform_problem()
        if problem:
            return False, problem
        venv = self.venv_dir()
        if not (venv / MARKER).is_file() or not venv_python(venv).is_file():
            return False, f"{self.label} not created yet at {venv} ({self.creator} creates it)"
        return True, f"{self.label} at {venv}"

    def python(self, create: Callable[[Path], dict], refuse: str | None = None) -> Path:
        """The environment's interpreter: the user's, or the venv's, created first (by create) if missing.

        refuse: a reason not to create it here (e.g. an environment variable saying so).
        """
        custom = self.custom_python()
        if custom is not None:
            return custom
        problem = self.platform_problem()
        if problem:
            raise self.error(problem)
        venv = self.venv_dir()
        if not (venv / MARKER).is_file():
            if refuse:
                raise self.error(f"{self.label} not created at {venv}: {refuse}")
            create(venv)
        return venv_python(venv)

    def index_reachable(self, timeout: float = 60) -> tuple[bool, str]:
        """Whether pip's package index (as this machine configures it) serves the toolchain; installs nothing.

        Creating a venv downloads hundreds of MB; on a machine without the registry that fails
        after minutes of retries, so callers that may skip (the tests) ask this first.
        """
        cmd = [sys.executable, "-m", "pip", "index", "versions", self.package, "--timeout", "10", "--retries", "1",
               "--disable-pip-version-check"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"pip index versions {self.package} did not answer ({type(exc).__name__})"
        if self.version in proc.stdout:
            return True, f"the package index serves {self.package} {self.version}"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no answer"]
        return False, f"the package index does not serve {self.package} {self.version} here ({tail[0]})"

    def info(self) -> dict:
        """The marker's record (what was installed, how long it took, its size)."""
        marker = self.venv_dir() / MARKER
        return json.loads(marker.read_text()) if marker.is_file() else {}

    def creating_line(self, venv: Path) -> str:
        """Said before a creation: what is made, where, how big and how long (it downloads, and prints nothing)."""
        size, seconds = self.cost
        guess = f": ~{size} from the package index, ~{seconds}" if size else ""
        return f"creating the {self.label} at {venv} (once{guess})..."

    def ready_line(self, venv: Path, info: dict) -> str:
        """Said after a creation: what it took."""
        return (f"{self.label} ready at {venv} ({info['size_bytes'] / 1e6:.0f} MB, "
                f"{info['install_seconds']:.0f} s)")

    def build(self, venv: Path, install: Callable[[Path], dict], log: Callable[[str], None] | None = None) -> dict:
        """Run install(venv) in place under the lock unless the marker says it is done; the marker gets its record.

        log: where the lines before and after a creation go (default: stderr, where the CLI's progress goes); an
        environment already complete is reused without a word."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        venv.parent.mkdir(parents=True, exist_ok=True)
        with open(venv.parent / f"{venv.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (venv / MARKER).is_file():
                return json.loads((venv / MARKER).read_text())
            if venv.exists():
                shutil.rmtree(venv)  # left by a build that did not finish
            log(self.creating_line(venv))
            t0 = time.perf_counter()
            try:
                record = install(venv)
            except BaseException:
                shutil.rmtree(venv, ignore_errors=True)
                raise
            info = {**record, "install_seconds": round(time.perf_counter() - t0, 1), "size_bytes": tree_size(venv),
                    "python": sys.version.split()[0]}
            tmp = venv / f"{MARKER}.tmp"
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, venv / MARKER)
            log(self.ready_line(venv, info))
            return info

    def run(self, cmd: list[str], what: str) -> str:
        """A build step; its failure is one line (the step, the exit code, the last line it printed)."""
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            raise self.error(f"{self.label}: {what} failed (exit {proc.returncode}): {tail[0]}")
        return proc.stdout
