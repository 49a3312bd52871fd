"""rknn-toolkit2 2.5.0 end to end on the probe graph (tools/probe_graph.py): .rknn build, simulator, placement.

The rknn venv is created by the tests when missing (~45 s and ~600 MB, fresh, on a 2-core
machine); set VLMPRUNE_RKNN_CREATE=0 to skip instead of creating it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from vlmprune.targets import rknn_env, rknn_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # the probe graph is a developer module
from probe_graph import (SORTS, build_probe_model, kept_agreement, probe_input, reference_run,  # noqa: E402
                         token_cosines)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("rknn_probe")
    model = build_probe_model()
    onnx.save(model, root / "probe.onnx")
    x = probe_input(1)
    np.save(root / "x.npy", x)
    dataset = []
    for seed in range(100, 116):
        np.save(root / f"calib{seed}.npy", probe_input(seed))
        dataset.append([str(root / f"calib{seed}.npy")])
    return {"root": root, "model": model, "x": x, "ref": reference_run(model, x), "dataset": dataset}


def _build(probe, mode, **extra):
    request = {"onnx": str(probe["root"] / "probe.onnx"), "out_dir": str(probe["root"] / mode), "mode": mode,
               "target_platform": "rk3588", "run_inputs": [str(probe["root"] / "x.npy")], **extra}
    if mode != "fp16":
        request["dataset"] = probe["dataset"]
        request["kept_outputs"] = ["kept_idx"]
    response = rknn_env.run_worker(request)
    tokens, idx = (np.load(o["path"]) for o in response["outputs"])
    return response, tokens, idx


def test_fp16_simulator_matches_onnxruntime(rknn_ready, probe):
    response, tokens, idx = _build(probe, "fp16")
    assert os.path.getsize(response["rknn"]) > 0
    assert kept_agreement(probe["ref"]["kept_idx"], idx) == 1.0
    assert token_cosines(probe["ref"], tokens, idx).min() >= 0.999
    devices = {row["type"]: row["device"] for row in response["placement"]}
    assert devices["TopK"] == "CPU" and devices["Gather"] == "CPU"
    assert "NPU" in devices.values()


def test_hybrid_keeps_score_path_in_float16(rknn_ready, probe):
    response, tokens, idx = _build(probe, "hybrid")
    assert any(name.startswith("score") for name in response["float16_tensors"])
    score_topk = next(n.name for n in probe["model"].graph.node if n.op_type == "TopK")
    topk = [row for row in response["placement"] if row["source"] == score_topk]
    assert topk and topk[0]["dtype"] == "FLOAT16", topk  # TopK reads float scores, not int8
    assert kept_agreement(probe["ref"]["kept_idx"], idx) >= 0.99
    cos = token_cosines(probe["ref"], tokens, idx)
    assert cos[:-1].min() >= 0.99
    # The summary (mean of 384 near-zero-mean tokens, norm ~0.05) shares the int8 scale of
    # the concatenated output (range ~±6): it keeps its direction only roughly.
    assert cos[-1] >= 0.9


def test_worker_failure_is_one_line(rknn_ready, tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    with pytest.raises(rknn_env.RknnError) as info:
        rknn_env.run_worker({"onnx": str(tmp_path / "broken.onnx"), "out_dir": str(tmp_path / "out")})
    assert "\n" not in str(info.value) and "log:" in str(info.value)


# --- pure-Python parts of the worker (no toolkit needed) --------------------------------------

def test_available_never_installs(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(rknn_env.PYTHON_ENV, raising=False)
    ok, reason = rknn_env.available()
    assert not ok and reason
    assert not (tmp_path / "cache").exists()


SAMPLE_LOG = """\
D RKNN: [01:15:21.233] ID   OpType             DataType Target InputShape        OutputShape   Cycles(DDR/NPU/Total)    RW(KB)       FullName
D RKNN: [01:15:21.233] ----------------------------------------------------------------------------------
D RKNN: [01:15:21.233] 0    InputOperator      FLOAT16  CPU    \\                 (1,577,64)    0/0/0        0            InputOperator:x
D RKNN: [01:15:21.233] 4    Conv               FLOAT16  NPU    (1,64,1,577),(64,64,1,1) (1,64,1,577) 6592/4736/6592 80     Conv:MatMul_1#2
D RKNN: [01:15:21.233] 22   TopK               FLOAT16  CPU    (1,1,1,576),(1)   (1,1,1,192)   0/0/0        9            TopK:TopK_16
D RKNN: [01:15:21.233] 26   Reshape            INT64    CPU    (1,1,1,192),(2)   (1,192)       0/0/0        1            Reshape:kept_idx-rs
D RKNN: [01:15:21.233] 37   OutputOperator     FLOAT16  CPU    (1,194,64)        \\             0/0/0        24           OutputOperator:tokens
D RKNN: [01:15:21.233] ----------------------------------------------------------------------------------
"""


def test_parse_placement_reads_the_op_table():
    rows = rknn_worker.parse_placement(SAMPLE_LOG, {"MatMul_1", "TopK_16"})
    assert [(r["type"], r["device"], r["source"]) for r in rows] == [
        ("Conv", "NPU", "MatMul_1"), ("TopK", "CPU", "TopK_16"), ("Reshape", "CPU", None)]


@pytest.mark.parametrize("sort", SORTS)
def test_float_tensors_cover_scores_and_index_chain(sort):
    graph = build_probe_model(sort=sort).graph
    everything = set(rknn_worker.float_tensors(graph, ["kept_idx"], "ancestors"))
    score_only = set(rknn_worker.float_tensors(graph, ["kept_idx"], "score"))
    assert {"score", "attn", "hidden", "top_v"} <= everything
    assert {"score", "attn", "top_v"} <= score_only and "hidden" not in score_only
    if sort == "cast":  # the float copy of the indices must not be int8-quantized
        assert {"idx_f", "idx_sorted_f"} <= score_only


def test_set_custom_layers_keeps_quantize_parameters_verbatim():
    cfg = "custom_quantize_layers: {}\nquantize_parameters:\n    x:\n        min:\n        -   -4.932224273681641\n"
    out = rknn_worker.set_custom_layers(cfg, ["score-rs", "attn-rs"])
    assert out.startswith("custom_quantize_layers:\n    score-rs: float16\n    attn-rs: float16\nquantize_parameters:")
    assert out.endswith(cfg.split("\n", 1)[1])
