"""`eval --dataset --ray` on a real local Ray cluster (127.0.0.1, 2 CPUs): the same cells as in-process, and a
worker process killed mid-sweep loses no cell.

The cluster runs in its own process, started as a single-machine cluster so that it
listens on the loopback address only, without token authentication (a test cluster); the
sweep joins it by address, as a user joins theirs.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_accuracy import write_dataset
from test_generate import tiny_vlm
from vlmprune.compiler.accuracy import evaluate_dataset
from vlmprune.compiler.errors import InputError

# Not imported here: Ray reads the single-machine switch when it is first imported, which the fixture sets first.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="Ray is the [ray] extra (in the test extra); not installed here")

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
CLUSTER = """
import sys, ray
info = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
print(info.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the test closes stdin
"""


@pytest.fixture(scope="module")
def cluster():
    assert "ray" not in sys.modules, "Ray was imported before the loopback switch was set"
    saved = {k: os.environ.get(k) for k in LOOPBACK}
    os.environ.update(LOOPBACK)  # this process joins as a driver of a loopback cluster
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **LOOPBACK})
    address = proc.stdout.readline().strip()
    try:
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    model = tiny_vlm(root / "model")
    data = write_dataset(root, images=4)
    local = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=root / "local.sqlite",
                             max_new_tokens=3)
    return root, model, data, local


def _holders() -> list[int]:
    """The pids of this machine's Ray actor processes running a sweep's worker (their process title)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::Holder"):
                out.append(int(entry.name))
    return out


def test_the_cluster_gives_the_in_process_cells(cluster, setup):
    from vlmprune.compiler.quality.executors import RayExecutor

    root, model, data, local = setup
    remote = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=root / "ray.sqlite",
                              max_new_tokens=3, executor=RayExecutor(cluster, workers=2))
    assert remote["executor"] == "ray" and remote["computed"] == local["computed"] == 4 * 8
    assert [(r["method"], r["keep"], r["where"], r["answers"]) for r in remote["rows"]] == \
        [(r["method"], r["keep"], r["where"], r["answers"]) for r in local["rows"]]


@pytest.mark.slow
def test_a_worker_killed_mid_sweep_loses_no_cell(cluster, setup):
    from vlmprune.compiler.quality.executors import RayExecutor

    root, model, data, local = setup
    killed = []

    def kill_one(key, results):  # after the first stored chunk: SIGKILL a worker process, as a lost node would
        if not killed:
            pids = _holders()
            assert pids, "no Ray worker process found"
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    remote = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=root / "killed.sqlite",
                              max_new_tokens=3, executor=RayExecutor(cluster, workers=2), on_chunk=kill_one)
    assert killed and remote["computed"] == 4 * 8
    assert [r["answers"] for r in remote["rows"]] == [r["answers"] for r in local["rows"]]


def test_an_unknown_ray_option_is_one_line():
    from vlmprune.compiler.quality.executors import RayExecutor

    with pytest.raises(InputError, match=r"^--ray-workers must be an integer >= 1, got 0$"):
        RayExecutor("auto", workers=0)
