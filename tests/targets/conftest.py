"""The rk3588 toolchain for every test that needs it, created once or skipped with the reason."""

from __future__ import annotations

import os

import pytest

from vlmprune.targets import rknn_env


@pytest.fixture(scope="session")
def rknn_ready():
    """rknn-toolkit2 2.5.0's venv: reused if ready, else created (~45 s, ~600 MB from the package index).

    Skips, saying why, when the platform has no toolkit wheel, when VLMPRUNE_RKNN_CREATE=0,
    or when the package index cannot be reached (an offline machine).
    """
    ok, reason = rknn_env.available()
    if ok:
        return rknn_env.rknn_python()
    ok, reason = rknn_env.creatable()
    if not ok:
        pytest.skip(f"rk3588 toolchain unavailable: {reason}")
    if os.environ.get("VLMPRUNE_RKNN_CREATE", "1") == "0":
        pytest.skip("rknn venv not created and VLMPRUNE_RKNN_CREATE=0")
    reachable, why = rknn_env.index_reachable()
    if not reachable:
        pytest.skip(f"rknn venv not created and cannot be: {why}")
    try:
        return rknn_env.rknn_python()
    except rknn_env.RknnError as exc:
        pytest.skip(f"rknn venv could not be created: {exc}")
