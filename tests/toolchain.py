"""What a missing build tool means to a test: on a developer's machine an environment gap (the test skips and names
the tool), under CI a failure.

CI runs the README's test command on a machine that has what the README asks for: g++ and npm build the ONNX
Runtime custom-op library on the first compile. Were a missing g++ a skip there too, every fused-op test could be
skipped and the run still pass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import pytest


def under_ci(environ: Mapping[str, str] | None = None) -> bool:
    """CI=true, as GitHub Actions, GitLab CI and most other CI systems set it."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() in ("true", "1", "yes")


def missing_tool(reason: str, environ: Mapping[str, str] | None = None) -> NoReturn:
    """Skip the test, or under CI fail it: a tool the README installs must be there."""
    if under_ci(environ):
        pytest.fail(f"{reason}: under CI (CI=true) the README's toolchain must be installed, so this fails "
                    "instead of skipping", pytrace=False)
    pytest.skip(reason)


def ort_library() -> Path:
    """The ONNX Runtime custom-op library, built once into the cache (kernels/build.py keys it on its sources)."""
    from vlmprune.kernels import build

    try:
        return build.build_ort_library()
    except build.ToolNotFoundError as exc:
        missing_tool(str(exc))
