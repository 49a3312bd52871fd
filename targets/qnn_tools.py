"""QNN HTP tooling: QDQ quantization, EPContext binaries, HTP-emulator runs and op placement.

onnxruntime-qnn 2.x is a plugin execution provider: the wheel ships the module
`onnxruntime_qnn` (the EP library plus the QNN backends, libQnnHtp.so being the HTP emulator
on x86_64) and depends on the stock `onnxruntime` (>= 1.24.2). It does not replace the
`onnxruntime` module as the 1.x wheels did, so both live in this environment; the EP is
registered once per process with `onnxruntime.register_execution_provider_library`.

Placement comes from ONNX Runtime itself: the session option
`session.record_ep_graph_assignment_info` makes `InferenceSession.get_provider_graph_assignment_info()`
list, per execution provider, the nodes it was given.
"""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

EP_NAME = "QNNExecutionProvider"
DEFAULT_SOC_MODEL = "57"  # SM8550 (HTP v73); any soc_model the SDK knows works in the emulator
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
WEIGHT_INPUTS = {"MatMul": (0, 1), "Gemm": (1,), "Conv": (1,)}


class QnnError(RuntimeError):
    """The QNN toolchain is missing or refused the model."""


def available() -> tuple[bool, str]:
    """onnxruntime-qnn importable and its EP registered with an HTP device; installs nothing."""
    if importlib.util.find_spec("onnxruntime_qnn") is None:
        return False, "onnxruntime-qnn is not installed (pip install 'onnxruntime-qnn==2.7.0')"
    try:
        devices = _ep_devices()
    except Exception as exc:  # a broken install must read as 'unavailable', with the reason
        return False, f"onnxruntime-qnn present but its EP did not register: {exc}"
    if not devices:
        return False, "onnxruntime-qnn registered no QNNExecutionProvider device"
    import onnxruntime_qnn

    return True, f"onnxruntime-qnn {onnxruntime_qnn.__version__} (QNN {_qnn_sdk_version()})"


def _qnn_sdk_version() -> str:
    from onnxruntime_qnn import build_and_package_info

    return getattr(build_and_package_info, "qnn_version", "unknown")


@functools.cache
def _ep_devices() -> tuple:
    """Register the plugin EP once per process and return its devices."""
    import onnxruntime as ort
    import onnxruntime_qnn

    if not any(d.ep_name == EP_NAME for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
    return tuple(d for d in ort.get_ep_devices() if d.ep_name == EP_NAME)


def _htp_options(soc_model: str, **extra: str) -> dict:
    import onnxruntime_qnn

    return {"backend_path": onnxruntime_qnn.get_qnn_htp_path(), "soc_model": str(soc_model), **extra}


def htp_session(model_path, soc_model: str = DEFAULT_SOC_MODEL, *, cpu_fallback: bool = False,
                config: dict | None = None, provider_options: dict | None = None):
    """An InferenceSession on the QNN HTP backend (the emulator on x86_64).

    With cpu_fallback False, a node HTP cannot take fails session creation instead of
    silently running on the CPU EP.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if cpu_fallback else "1")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, str(value))
    options.add_provider_for_devices(list(_ep_devices()), _htp_options(soc_model, **(provider_options or {})))
    try:
        return ort.InferenceSession(str(model_path), sess_options=options)
    except Exception as exc:
        raise QnnError(f"QNN HTP session for {Path(model_path).name}: {_first_line(exc)}") from exc


def run_qnn(model_path, inputs: dict[str, np.ndarray], soc_model: str = DEFAULT_SOC_MODEL) -> dict[str, np.ndarray]:
    """Run on the HTP emulator with CPU fallback disabled; outputs by name."""
    session = htp_session(model_path, soc_model)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs)))


def placement(model_path, soc_model: str = DEFAULT_SOC_MODEL, *, include_qdq: bool = False) -> list[dict]:
    """Which provider runs each node, as ONNX Runtime assigned them (CPU fallback allowed).

    Q/DQ nodes at the graph boundary go to the CPU EP by design (QNN EP option
    offload_graph_io_quantization defaults to 1); include_qdq=False leaves them out.
    """
    session = htp_session(model_path, soc_model, cpu_fallback=True)
    rows = []
    for subgraph in session.get_provider_graph_assignment_info():
        for node in subgraph.get_nodes():
            if include_qdq or node.op_type not in QDQ_OPS:
                rows.append({"op": node.name, "type": node.op_type, "provider": subgraph.ep_name})
    return rows


def make_epcontext(qdq_path, out_dir, soc_model: str = DEFAULT_SOC_MODEL) -> tuple[Path, list[Path]]:
    """Compile the QDQ model into an EPContext model plus its QNN context binary (not embedded).

    Creating the session writes both files; the binary is named in the EPContext node's
    ep_cache_context attribute and must stay next to the model.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx_path = out_dir / f"{Path(qdq_path).stem}_ctx.onnx"
    ctx_path.unlink(missing_ok=True)
    config = {"ep.context_enable": "1", "ep.context_file_path": str(ctx_path), "ep.context_embed_mode": "0"}
    session = htp_session(qdq_path, soc_model, config=config)
    del session
    if not ctx_path.is_file():
        raise QnnError(f"QNN EP wrote no EPContext model at {ctx_path}")
    bins = [out_dir / _attr(node, "ep_cache_context") for node in onnx.load(ctx_path).graph.node
            if node.op_type == "EPContext"]
    missing = [b.name for b in bins if not b.is_file()]
    if missing or not bins:
        raise QnnError(f"EPContext model {ctx_path.name} names missing binaries: {missing or 'none'}")
    return ctx_path, bins


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a).decode()
    raise QnnError(f"{node.op_type} node {node.name!r} has no {name} attribute")


# --- quantization -------------------------------------------------------------------------

def quantize_qdq(onnx_path, out_path, calib_inputs: list[dict[str, np.ndarray]], act_type: str = "uint16",
                 weight_type: str = "uint8", *, score_path: str = "fp16", score_weight_type: str | None = None) -> Path:
    """QDQ model for QNN HTP via onnxruntime.quantization's QNN helpers.

    Steps: legalize (static input shapes, named nodes, non-negative constant Gather
    indices), qnn_preprocess_model, get_qnn_qdq_config, quantize. The TopK score path:

    - score_path="fp16" (default): the nodes that feed only TopK's scores (the attention-row
      recompute) stay float and run on HTP in fp16 (mixed precision, still no CPU fallback).
      16-bit activations alone lose near-boundary ranks: Softmax probabilities over ~577
      keys share one per-tensor scale with the largest probability, and on v73 the EP
      converts input 1 of a uint16 x uint16 MatMul (q . k^T) to lower precision.
    - score_path="quantized": everything quantized; every Softmax feeding TopK gets its
      calibrated output range instead of the fixed [0, 1], and score_weight_type (e.g.
      "uint16") re-types the weights that feed the scores.
    """
    from onnxruntime.quantization import quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    if not calib_inputs:
        raise ValueError("quantize_qdq needs at least one calibration sample")
    if score_path not in ("fp16", "quantized"):
        raise ValueError(f"score_path must be 'fp16' or 'quantized', not {score_path!r}")
    model = legalize_for_htp(onnx.load(str(onnx_path)))
    with tempfile.TemporaryDirectory(prefix="vlmprune-qdq-") as tmp:
        legal, pre = Path(tmp) / "legal.onnx", Path(tmp) / "pre.onnx"
        onnx.save(model, legal)
        source = pre if qnn_preprocess_model(legal, pre) else legal
        model = onnx.load(str(source))
        overrides, exclude = {}, None
        if score_path == "fp16":
            exclude = [n.name for n in score_only_nodes(model)]
        else:
            overrides = score_path_overrides(model, calib_inputs,
                                             _quant_type(score_weight_type) if score_weight_type else None)
        config = get_qnn_qdq_config(str(source), _Reader(calib_inputs), activation_type=_quant_type(act_type),
                                    weight_type=_quant_type(weight_type), init_overrides=overrides or None,
                                    nodes_to_exclude=exclude or None)
        quantize(str(source), str(out_path), config)
    return Path(out_path)


def _quant_type(name: str):
    from onnxruntime.quantization import QuantType

    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8, "uint16": QuantType.QUInt16, "int16": QuantType.QInt16}
    if name not in types:
        raise ValueError(f"quantization type must be one of {sorted(types)}, not {name!r}")
    return types[name]


class _Reader:
    """CalibrationDataReader over a list of input dicts (duck-typed: get_next/rewind)."""

    def __init__(self, samples: list[dict]):
        self.samples = samples
        self._it = iter(samples)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self.samples)


def legalize_for_htp(model: onnx.ModelProto) -> onnx.ModelProto:
    """What QNN HTP needs before quantization: static input shapes, Gather indices >= 0,
    and a name on every node.

    Runtime (non-constant) Gather indices cannot be checked here; the pruning subgraph's
    come from TopK and are non-negative by construction.
    """
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    for value in graph.input:
        if value.name in inits:
            continue
        dims = value.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise QnnError(f"QNN HTP needs static shapes: input {value.name!r} has a dynamic dimension")
    names = {n.name for n in graph.node if n.name}
    for i, node in enumerate(graph.node):
        if not node.name:  # quantizer exclusions and placement rows go by node name
            node.name = _unique(f"{node.op_type}_{i}", names)
    shapes = _static_shapes(model)
    for node in graph.node:
        if node.op_type == "Gather" and node.input[1] in inits:
            _make_indices_positive(node, inits[node.input[1]], shapes)
    return model


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = v.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            out[v.name] = [d.dim_value for d in dims]
    for init in model.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def _make_indices_positive(node: onnx.NodeProto, init: onnx.TensorProto, shapes: dict) -> None:
    indices = numpy_helper.to_array(init)
    if not (indices < 0).any():
        return
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    data_shape = shapes.get(node.input[0])
    if data_shape is None:
        raise QnnError(f"Gather {node.name!r} has negative indices on an axis of unknown size")
    size = data_shape[axis]
    init.CopyFrom(numpy_helper.from_array(np.where(indices < 0, indices + size, indices).astype(indices.dtype), init.name))


def _producers(nodes: list[onnx.NodeProto]) -> dict:
    return {o: n for n in nodes for o in n.output}


def _ancestors(tensors, producer, skip=None) -> dict[int, onnx.NodeProto]:
    """Nodes reachable backwards from tensors; skip(node, i) cuts input edge i of node.

    Keyed by id(): callers hold one list of the graph's nodes, so identities are stable.
    """
    seen, stack = {}, [producer[t] for t in tensors if t in producer]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(producer[name] for i, name in enumerate(node.input)
                     if name in producer and not (skip and skip(node, i)))
    return seen


def _score_topks(nodes: list[onnx.NodeProto], producer) -> list[onnx.NodeProto]:
    """TopKs over scores; a TopK downstream of another TopK only sorts indices."""
    topks = [n for n in nodes if n.op_type == "TopK"]
    ids = {id(t) for t in topks}
    return [t for t in topks if not (_ancestors([t.input[0]], producer).keys() & ids)]


def score_path_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node that feeds a TopK's scores (in a tower: all blocks up to the pruning layer)."""
    nodes = list(model.graph.node)
    producer = _producers(nodes)
    return list(_ancestors([t.input[0] for t in _score_topks(nodes, producer)], producer).values())


def score_only_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes whose results reach the graph outputs only through TopK's scores."""
    nodes = list(model.graph.node)
    producer = _producers(nodes)
    topks = _score_topks(nodes, producer)
    score = _ancestors([t.input[0] for t in topks], producer)
    topk_ids = {id(t) for t in topks}
    rest = _ancestors([o.name for o in model.graph.output], producer,
                      skip=lambda node, i: id(node) in topk_ids and i == 0)
    return [n for key, n in score.items() if key not in rest]


def score_path_overrides(model: onnx.ModelProto, calib_inputs: list[dict], score_weight_qtype=None) -> dict:
    """TensorQuantOverrides for the score path: calibrated Softmax ranges, score weight type."""
    nodes = score_path_nodes(model)
    inits = {i.name for i in model.graph.initializer}
    overrides: dict[str, list[dict]] = {}
    softmax_outputs = [n.output[0] for n in nodes if n.op_type == "Softmax"]
    for name, rmax in _calibrated_max(model, softmax_outputs, calib_inputs).items():
        overrides[name] = [{"rmin": np.array(0.0, np.float32), "rmax": np.array(rmax, np.float32)}]
    for node in nodes if score_weight_qtype is not None else ():
        for i in WEIGHT_INPUTS.get(node.op_type, ()):
            if i < len(node.input) and node.input[i] in inits:
                overrides[node.input[i]] = [{"quant_type": score_weight_qtype}]
    return overrides


def _calibrated_max(model: onnx.ModelProto, tensors: list[str], calib_inputs: list[dict]) -> dict[str, float]:
    if not tensors:
        return {}
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    maxima = dict.fromkeys(tensors, 0.0)
    for sample in calib_inputs:
        for name, value in zip(tensors, session.run(tensors, sample)):
            maxima[name] = max(maxima[name], float(np.max(value)))
    return maxima


def _unique(name: str, taken: set[str]) -> str:
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
