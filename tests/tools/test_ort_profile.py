"""tools/ort_profile.py: ONNX Runtime's profiler read back per op, MatMul FLOPs from the recorded shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, checker, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ort_profile
from vlmprune.targets.runtime import ort_session

M, K, N = 96, 64, 48


def _weights() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)


def _graph() -> bytes:
    """x [M, K] @ w [K, N] -> Relu -> Softmax: one counted op and two uncounted ones."""
    w = _weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["r"]),
         helper.make_node("Softmax", ["r"], ["out"], axis=-1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [M, N])],
        [helper.make_tensor("w", TensorProto.FLOAT, [K, N], w.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    checker.check_model(model)
    return model.SerializeToString()


def test_profile_reads_ops_flops_and_outputs():
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    graph = _graph()
    got = ort_profile.profile(lambda options: ort_session(graph, options=options), {"x": x}, runs=3)
    assert {"MatMul", "Softmax"} <= set(got["ops"])  # Relu may be fused into the MatMul by ORT; Softmax is not
    assert got["counted_ms"] == got["ops"]["MatMul"]
    assert got["uncounted_ms"] == sum(ms for op, ms in got["ops"].items() if op != "MatMul")
    (bucket, cell), = got["matmul"].items()
    assert bucket == "M 17-128"
    assert cell["gflop"] == 2 * M * K * N / 1e9
    assert got["run_ms"] >= got["kernel_ms"] > 0
    assert 2 <= got["nodes"] <= 3
    assert got["counts"]["MatMul"] == 1 and got["counts"]["Softmax"] == 1
    assert sum(got["counts"].values()) == got["nodes"]
    ref = np.maximum(x @ _weights(), 0)
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    np.testing.assert_allclose(got["outputs"]["out"], ref / ref.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_merge_sums_and_table_names_rows():
    a = {"run_ms": 10.0, "kernel_ms": 8.0, "counted_ms": 6.0, "uncounted_ms": 2.0, "outside_kernels_ms": 2.0, "nodes": 3,
         "ops": {"MatMul": 6.0, "Softmax": 2.0}, "counts": {"MatMul": 2, "Softmax": 1},
         "matmul": {"M=1": {"ms": 6.0, "gflop": 0.6}}}
    b = {"run_ms": 5.0, "kernel_ms": 4.0, "counted_ms": 3.0, "uncounted_ms": 1.0, "outside_kernels_ms": 1.0, "nodes": 2,
         "ops": {"MatMul": 3.0, "Where": 1.0}, "counts": {"MatMul": 1, "Where": 1},
         "matmul": {"M=1": {"ms": 3.0, "gflop": 0.3}}}
    merged = ort_profile.merge(a, b)
    assert merged["run_ms"] == 15.0 and merged["ops"] == {"MatMul": 9.0, "Softmax": 2.0, "Where": 1.0}
    assert merged["counts"] == {"MatMul": 3, "Softmax": 1, "Where": 1}
    assert merged["matmul"]["M=1"]["gflops_per_s"] == pytest.approx(100.0)
    lines = ort_profile.table({"row a": merged})
    assert any(line.startswith("| row a | 5 | 15.0 | 9.0 | 3.0 (20%) | 3.0 | Softmax 2.0, Where 1.0") for line in lines)


def test_bucket_edges():
    assert [ort_profile._bucket(m) for m in (1, 2, 16, 17, 577, 5000)] == [
        "M=1", "M 2-16", "M 2-16", "M 17-128", "M 513-2048", "M>2048"]


@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm_flops_with_and_without_trans_a(trans_a):
    # Gemm's profiler event records shapes, not attributes: with transA=1, A is [K, M] and K must
    # still come out as the reduced axis.
    a_shape = [K, M] if trans_a else [M, K]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "w"], ["y"], transA=trans_a)], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
        [helper.make_tensor("w", TensorProto.FLOAT, [K, N], _weights().ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    checker.check_model(model)
    a = np.random.default_rng(2).standard_normal(a_shape).astype(np.float32)
    got = ort_profile.profile(lambda options: ort_session(model.SerializeToString(), options=options), {"a": a}, runs=1)
    (cell,) = got["matmul"].values()
    assert cell["gflop"] == 2 * M * K * N / 1e9
    np.testing.assert_allclose(got["outputs"]["y"], (a.T if trans_a else a) @ _weights(), rtol=1e-5, atol=1e-5)


def test_an_int8_graph_s_fused_integer_matmul_is_counted():
    """The int8 bundle's form (QDQ on the MatMul's inputs, its output left in float) runs as ONNX Runtime's fused
    MatMulIntegerToFloat, the op an int8 bundle's time is mostly in: it is booked as counted work, not beside the
    norms and activations."""
    w = _weights()
    scale = float(np.abs(w).max() / 127)
    q = lambda name, dtype, value: helper.make_tensor(name, dtype, [], [value])  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
         helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
         helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
         helper.make_node("MatMul", ["xd", "wd"], ["y"]), helper.make_node("Softmax", ["y"], ["out"], axis=-1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [M, N])],
        [q("xs", TensorProto.FLOAT, 0.05), q("xz", TensorProto.UINT8, 128), q("ws", TensorProto.FLOAT, scale),
         q("wz", TensorProto.INT8, 0),
         helper.make_tensor("wq", TensorProto.INT8, [K, N], np.clip(np.round(w / scale), -127, 127).astype(np.int8).ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    checker.check_model(model)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    got = ort_profile.profile(lambda options: ort_session(model.SerializeToString(), options=options), {"x": x}, runs=2)
    assert "MatMulIntegerToFloat" in got["ops"]
    assert got["counted_ms"] >= got["ops"]["MatMulIntegerToFloat"] > 0
    assert got["uncounted_ms"] == pytest.approx(sum(ms for op, ms in got["ops"].items() if op not in ort_profile.COUNTED))
