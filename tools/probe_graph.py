"""A small pruning graph for toolchain checks: the selection formulations side by side.

Standard ONNX ops, opset 17, batch 1: LayerNorm -> MatMul -> residual -> LayerNorm, the
[CLS] attention row (q . k^T -> Softmax), score normalisation, TopK(K) -> ascending sort ->
selection of the kept patches -> summary of the pruned ones -> Concat. Outputs: tokens
[1, K+2, D] and kept_idx [1, K]. The selection, the pruned-token mask and the index sort
each come in the forms a toolchain may treat differently (SELECTIONS, MASKS, SORTS), so a
toolchain's placement and parity can be compared per form in seconds, without a tower.

Written by hand, not taken from passes/methods/cls.py: the method emits one form (GatherND,
ScatterElements) on a real tower's block, and these forms are the alternatives weighed
against it. No library module uses it, so it lives here beside tools/rknn_env_report.py;
tests/targets/test_rknn_toolchain.py and test_qnn_toolchain.py import it too. The metrics
below compare a toolchain's outputs with ONNX Runtime's on the same graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

from vlmprune.compiler.contract import ROLE

N, D, K = 576, 64, 192
SELECTIONS = ("gather", "gather_elements", "gathernd", "onehot", "onehot_equal")
MASKS = ("scatter_elements", "scatter_nd", "onehot_sum")
SORTS = ("int", "cast")  # TopK straight on int64 indices, or Cast to float then TopK


# --- probe graph ----------------------------------------------------------------------------

class _Graph:
    """Collects nodes and initializers; node names are unique (rknn and QNN report by name).

    Nodes created under role("score" | "select" | "tokens") carry it in their metadata_props, as
    vlmprune's insertion marks the nodes it emits (passes.methods.builder): the toolchain layers
    find the selection by role, here as in a compiled tower.
    """

    def __init__(self):
        self.nodes, self.inits = [], []
        self.current_role = None

    def role(self, name):
        self.current_role = name
        return self

    def const(self, name, value):
        if all(i.name != name for i in self.inits):
            self.inits.append(onh.from_array(np.asarray(value), name))
        return name

    def op(self, op_type, inputs, outputs, **attrs):
        node = oh.make_node(op_type, inputs, outputs, name=f"{op_type}_{len(self.nodes)}", **attrs)
        if self.current_role:
            node.metadata_props.add(key=ROLE, value=self.current_role)
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else outputs


def build_probe_model(select: str = "gather", mask: str = "scatter_elements", sort: str = "int",
                      n: int = N, d: int = D, k: int = K, seed: int = 0) -> onnx.ModelProto:
    """The [CLS]-attention pruning subgraph in the chosen forms, behind one small transformer block.

    wk is wq plus noise, so the [CLS] query attends to patches that resemble it (as trained
    heads do); probe_input's salient patches then stand out in the scores.
    """
    if mask == "onehot_sum" and not select.startswith("onehot"):
        raise ValueError("mask 'onehot_sum' needs a one-hot selection")
    rng = np.random.default_rng(seed)
    g = _Graph()
    weight = lambda: (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    for name, value in {"ln1_g": np.ones(d), "ln1_b": np.zeros(d), "ln2_g": np.ones(d), "ln2_b": np.zeros(d)}.items():
        g.const(name, value.astype(np.float32))
    g.const("w1", weight())
    wq = weight()
    g.const("wq", wq)
    g.const("wk", (wq + 0.3 * weight()).astype(np.float32))
    for name, value in {"i0": [0], "i1": [1], "iend": [n + 1], "K": [k]}.items():
        g.const(name, np.array(value, np.int64))

    h0 = g.op("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["h0"], axis=-1, epsilon=1e-5)
    hidden = g.op("Add", ["x", g.op("MatMul", [h0, "w1"], ["m"])], ["hidden"])
    g.role("score")
    h1 = g.op("LayerNormalization", [hidden, "ln2_g", "ln2_b"], ["h1"], axis=-1, epsilon=1e-5)
    q = g.op("MatMul", [g.op("Slice", [h1, "i0", "i1", "i1"], ["cls_h"]), "wq"], ["q"])
    kt = g.op("Transpose", [g.op("MatMul", [h1, "wk"], ["k"])], ["kt"], perm=[0, 2, 1])
    logits = g.op("Mul", [g.op("MatMul", [q, kt], ["logits"]), g.const("scale", np.float32(d ** -0.5))], ["logits_s"])
    attn = g.op("Softmax", [logits], ["attn"], axis=-1)
    row = g.op("Reshape", [attn, g.const("row_shape", np.array([1, n + 1], np.int64))], ["attn_row"])
    a = g.op("Slice", [row, "i1", "iend", "i1"], ["a_patch"])
    a_max = g.op("Add", [g.op("ReduceMax", [a], ["a_max"], axes=[1], keepdims=1), g.const("eps", np.float32(1e-6))],
                 ["a_max_e"])
    score = g.op("Div", [a, a_max], ["score"])
    g.role("select")
    _, top_i = g.op("TopK", [score, "K"], ["top_v", "top_i"], axis=-1, largest=1, sorted=1)
    if sort == "cast":
        sorted_f, _ = g.op("TopK", [g.op("Cast", [top_i], ["idx_f"], to=TensorProto.FLOAT), "K"],
                           ["idx_sorted_f", "idx_sorted_i"], axis=-1, largest=0, sorted=1)
        kept_idx = g.op("Cast", [sorted_f], ["kept_idx"], to=TensorProto.INT64)
    else:
        kept_idx, _ = g.op("TopK", [top_i, "K"], ["kept_idx", "kept_idx_i"], axis=-1, largest=0, sorted=1)

    g.role("tokens")
    patches = g.op("Slice", [hidden, "i1", "iend", "i1"], ["patches"])
    cls_tok = g.op("Slice", [hidden, "i0", "i1", "i1"], ["cls_tok"])
    kept, onehot = _select(g, select, kept_idx, patches, n, d, k)
    g.const("ones", np.ones((1, n), np.float32))
    if mask == "scatter_elements":
        keep_mask = g.op("ScatterElements", ["ones", kept_idx, g.const("zeros", np.zeros((1, k), np.float32))],
                         ["mask"], axis=1)
    elif mask == "scatter_nd":  # B=1: indices (0, idx)
        nd_idx = g.op("Concat", [g.const("batch0", np.zeros((1, k, 1), np.int64)),
                                 g.op("Unsqueeze", [kept_idx, g.const("ineg1", np.array([-1], np.int64))], ["idx_col"])], ["nd_idx"], axis=-1)
        keep_mask = g.op("ScatterND", ["ones", nd_idx, g.const("zeros", np.zeros((1, k), np.float32))], ["mask"])
    else:
        keep_mask = g.op("Sub", ["ones", g.op("ReduceSum", [onehot, "i1"], ["onehot_sum"], keepdims=0)], ["mask"])
    weights = g.op("Mul", [keep_mask, g.const("inv_pruned", np.float32(1.0 / (n - k)))], ["mask_w"])
    summary = g.op("MatMul", [g.op("Unsqueeze", [weights, "i1"], ["mask_w3"]), patches], ["summary"])
    g.op("Concat", [cls_tok, kept, summary], ["tokens"], axis=1)

    graph = oh.make_graph(g.nodes, f"probe_{select}_{mask}_{sort}",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, n + 1, d])],
                          [oh.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, k + 2, d]),
                           oh.make_tensor_value_info("kept_idx", TensorProto.INT64, [1, k])],
                          initializer=g.inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _select(g: _Graph, select: str, kept_idx: str, patches: str, n: int, d: int, k: int):
    """Kept patches [1, K, D] by index (Gather family) or by a one-hot [1, K, N] MatMul."""
    if select == "gather":  # B=1 only
        flat = g.op("Reshape", [kept_idx, g.const("k_shape", np.array([k], np.int64))], ["idx_flat"])
        return g.op("Gather", [patches, flat], ["kept"], axis=1), None
    column = g.op("Unsqueeze", [kept_idx, g.const("ineg1", np.array([-1], np.int64))], ["idx3"])
    if select == "gathernd":
        return g.op("GatherND", [patches, column], ["kept"], batch_dims=1), None
    if select == "gather_elements":
        wide = g.op("Expand", [column, g.const("kd_shape", np.array([1, k, d], np.int64))], ["idx_wide"])
        return g.op("GatherElements", [patches, wide], ["kept"], axis=1), None
    if select == "onehot":
        onehot = g.op("OneHot", [kept_idx, g.const("depth", np.array(n, np.int64)),
                                 g.const("onehot_values", np.array([0, 1], np.float32))], ["onehot"], axis=-1)
    elif select == "onehot_equal":
        positions = g.const("positions", np.arange(n, dtype=np.int64).reshape(1, 1, n))
        onehot = g.op("Cast", [g.op("Equal", [column, positions], ["eq"])], ["onehot"], to=TensorProto.FLOAT)
    else:
        raise ValueError(f"unknown selection {select!r}")
    return g.op("MatMul", [onehot, patches], ["kept"]), onehot


def probe_input(seed: int, salient: float = 2.0, n: int = N, d: int = D, k: int = K) -> np.ndarray:
    """Gaussian tokens; `salient` adds one shared direction to [CLS] and K random patches.

    salient=2 gives a clear score margin at the K-th boundary (what a trained tower's [CLS]
    attention tends to show); salient=0 is plain noise, full of near-ties at the boundary.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n + 1, d)).astype(np.float32)
    direction = rng.standard_normal(d).astype(np.float32)
    chosen = rng.choice(n, k, replace=False)
    x[0, 0] += salient * direction
    x[0, 1 + chosen] += salient * direction
    return x


# --- metrics ----------------------------------------------------------------------------------

def reference_run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    """ONNX Runtime CPU, with the score and hidden states exposed for the metrics below."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend([onnx.ValueInfoProto(name="score"), onnx.ValueInfoProto(name="hidden")])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"x": x})))


def kept_agreement(ref_idx: np.ndarray, idx: np.ndarray) -> float:
    """|kept ∩ kept_ref| / K."""
    ref, got = set(np.asarray(ref_idx).reshape(-1).tolist()), set(np.asarray(idx).astype(np.int64).reshape(-1).tolist())
    return len(ref & got) / len(ref)


def near_ties(score: np.ndarray, k: int, rtol: float = 0.01) -> int:
    """Scores within rtol of the K-th largest: the ranks a lower precision may resolve differently."""
    s = np.asarray(score).reshape(-1)
    kth = np.sort(s)[::-1][k - 1]
    return int((np.abs(s - kth) <= rtol * abs(kth)).sum())


def token_cosines(ref: dict[str, np.ndarray], tokens: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per-token cosine between the device's tokens and the reference built from the device's indices.

    Comparing against the reference computed with the device's own kept set keeps one
    swapped boundary index from misaligning every later token. Order: [CLS], kept, summary.
    """
    hidden = ref["hidden"][0].astype(np.float64)
    idx = np.asarray(idx).astype(np.int64).reshape(-1)
    patches = hidden[1:]
    pruned = np.setdiff1d(np.arange(len(patches)), idx)
    expected = np.concatenate([hidden[:1], patches[idx], patches[pruned].mean(0, keepdims=True)])
    got = np.asarray(tokens, np.float64).reshape(expected.shape)
    return (expected * got).sum(-1) / (np.linalg.norm(expected, axis=-1) * np.linalg.norm(got, axis=-1) + 1e-12)
