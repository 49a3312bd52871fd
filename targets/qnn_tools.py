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

import contextlib
import ctypes
import functools
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from vlmprune.compiler.contract import ROLE  # how the insertion marks the selection's nodes

EP_NAME = "QNNExecutionProvider"
# QNN SDK soc_model ids (QnnTypes.h QNN_SOC_MODEL_*), with the HTP architecture each runs.
# The emulator (libQnnHtp.so on x86_64) accepts all of them; an EPContext binary is compiled
# for the one named, so the bundle is built for the device's SoC.
SOCS = {
    "SM8350": ("30", "v68", "Snapdragon 888"),
    "SM8450": ("36", "v69", "Snapdragon 8 Gen 1"),
    "SM8475": ("42", "v69", "Snapdragon 8+ Gen 1"),
    "SM8550": ("43", "v73", "Snapdragon 8 Gen 2"),
    "SM8635": ("68", "v73", "Snapdragon 8s Gen 3"),
    "SM8650": ("57", "v75", "Snapdragon 8 Gen 3"),
    "SM8750": ("69", "v79", "Snapdragon 8 Elite"),
    "SM8850": ("87", "v81", "Snapdragon 8 Elite Gen 5"),
    "SC8280X": ("37", "v68", "Snapdragon 8cx Gen 3 (Windows on Arm)"),
    "SC8380XP": ("60", "v73", "Snapdragon X Elite / X Plus (Windows on Arm)"),
    "SA8295": ("39", "v68", "SA8295P (automotive)"),
}
DEFAULT_SOC = "SM8650"  # Snapdragon 8 Gen 3 (HTP v75): the most common current flagship HTP
DEFAULT_SOC_MODEL = SOCS[DEFAULT_SOC][0]
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

    return True, f"onnxruntime-qnn {onnxruntime_qnn.__version__} (QNN {qnn_sdk_version()})"


def resolve_soc(soc: str | int | None) -> tuple[str, str]:
    """(SoC name, soc_model id) from a name (SM8650, case-insensitive) or a soc_model id (57)."""
    if soc is None:
        return DEFAULT_SOC, DEFAULT_SOC_MODEL
    key = str(soc).strip().upper()
    if key in SOCS:
        return key, SOCS[key][0]
    for name, (model, _arch, _product) in SOCS.items():
        if key == model:
            return name, model
    raise QnnError(f"unknown --soc {soc!r}; accepted: {', '.join(SOCS)} (or their soc_model ids)")


def qnn_sdk_version() -> str:
    """The QNN SDK onnxruntime-qnn was built with (the target's toolchain line in the manifest)."""
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
    options.log_severity_level = 3  # the EP warns about Windows-only features on every session
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if cpu_fallback else "1")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, str(value))
    options.add_provider_for_devices(list(_ep_devices()), _htp_options(soc_model, **(provider_options or {})))
    try:
        with _without_libnative_banner():
            return ort.InferenceSession(str(model_path), sess_options=options)
    except Exception as exc:
        raise QnnError(f"QNN HTP session for {Path(model_path).name}: {_first_line(exc)}") from exc


_BANNER_SHOWN = False
BANNER = " # LIBNATIVE:"


@contextlib.contextmanager
def _without_libnative_banner():
    """The HTP library prints ` # LIBNATIVE: ...` (its thread-local-storage config; LIBNATIVE_CONFIG only changes
    the wording) on file descriptor 1 as the first session loads it, under -q too. File descriptor 1 goes to a
    temporary file for that first load; whatever else was written there is passed on to stderr."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        yield
        return
    _BANNER_SHOWN = True
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, AttributeError):  # C stdio's buffer
                ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            caught.seek(0)
            rest = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(BANNER)]
            if rest:
                sys.stderr.write("".join(rest))


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


def op_trace(model_path, inputs: dict[str, np.ndarray], soc_model: str = DEFAULT_SOC_MODEL) -> list[dict]:
    """The HTP ops one inference ran, in order, with their emulated cycles (QNN 'detailed' profiling).

    These are QNN's ops after its own lowering (fused, split, inserted reshapes); each name
    starts with the ONNX node it came from where there is one.
    """
    import csv

    with tempfile.TemporaryDirectory(prefix="vlmprune-qnn-trace-") as tmp:
        path = Path(tmp) / "trace.csv"
        session = htp_session(model_path, soc_model,
                              provider_options={"profiling_level": "detailed", "profiling_file_path": str(path)})
        session.run(None, inputs)
        del session  # the EP writes the file when the session ends
        if not path.is_file():
            raise QnnError("QNN profiling wrote no op trace")
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("Message") == "NODE"]
    trace = []
    for r in rows:
        name = r["Event Identifier"].removesuffix(" (cycles)").rsplit(":OpId_", 1)[0]
        trace.append({"op": name, "cycles": int(r["Time"])})
    return trace


def make_epcontext(qdq_path, out_dir, soc_model: str = DEFAULT_SOC_MODEL,
                   ctx_name: str | None = None) -> tuple[Path, list[Path]]:
    """Compile the QDQ model into an EPContext model plus its QNN context binary (not embedded).

    Creating the session writes both files; the binary is named in the EPContext node's
    ep_cache_context attribute and must stay next to the model.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx_path = out_dir / (ctx_name or f"{Path(qdq_path).stem}_ctx.onnx")
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
                 weight_type: str = "uint8", *, score_path: str = "fp16", score_weight_type: str | None = None,
                 act_matmul: str = "uint8", float_nodes: list[str] | None = None, headroom: float = 1.0) -> Path:
    """QDQ model for QNN HTP via onnxruntime.quantization's QNN helpers.

    Steps: legalize (static input shapes, named nodes, non-negative constant Gather
    indices), qnn_preprocess_model, get_qnn_qdq_config, quantize. The selection (the nodes
    vlmprune's insertion marked with the roles "score" and "select", or float_nodes):

    - score_path="fp16" (default): the selection stays float and runs on HTP in fp16 (mixed
      precision, still no CPU fallback).
      16-bit activations alone lose near-boundary ranks: Softmax probabilities over ~577
      keys share one per-tensor scale with the largest probability, and on v73 the EP
      converts input 1 of a uint16 x uint16 MatMul (q . k^T) to lower precision.
    - score_path="quantized": everything quantized; every Softmax feeding the selection gets
      its calibrated output range instead of the fixed [0, 1], and score_weight_type (e.g.
      "uint16") re-types the weights that feed it.

    A MatMul of two activations (attention's q . k^T and probs . v) with both inputs 16-bit
    is not an HTP kernel: the EP silently converts one side. act_matmul="uint8" (default)
    makes that explicit and calibrated: input 1 is converted to 8-bit for that MatMul only
    (a TensorQuantOverrides "convert"); "keep" leaves it to the EP (for comparison).
    Excluding such a MatMul from quantization does not keep it float: its neighbours'
    Q/DQ pairs still make it a quantized node unit; an attention's whole core among float_nodes
    (attention_cores: q . k^T, its Softmax, probs . v) does stay float, fp16 on HTP, for a family
    whose attention loses parity with one side read in 8 bits (QuantizationNeeds.float_attention).
    check_qdq verifies the result.

    headroom: every 16-bit activation range is its calibrated one times this (1: as calibrated), for
    a graph whose activations on other images pass the calibration set's extremes and clip; an 8-bit
    convert keeps the calibrated range.
    """
    from onnxruntime.quantization import quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    if not calib_inputs:
        raise ValueError("quantize_qdq needs at least one calibration sample")
    if score_path not in ("fp16", "quantized"):
        raise ValueError(f"score_path must be 'fp16' or 'quantized', not {score_path!r}")
    if act_matmul not in ("uint8", "keep"):
        raise ValueError(f"act_matmul must be 'uint8' or 'keep', not {act_matmul!r}")
    model = legalize_for_htp(onnx.load(str(onnx_path)))
    # onnxruntime 1.32's qnn_preprocess_model fails on model-level metadata_props (it merges them as a dict);
    # the QDQ model does not need vlmprune's record, which lives in model.onnx and the manifest.
    del model.metadata_props[:]
    # The quantizer logs advice (opset 21, pre-processing) as root-logger warnings.
    with tempfile.TemporaryDirectory(prefix="vlmprune-qdq-") as tmp, _quiet_root_logger():
        legal, pre = Path(tmp) / "legal.onnx", Path(tmp) / "pre.onnx"
        onnx.save(model, legal)
        source = pre if qnn_preprocess_model(legal, pre) else legal
        model = onnx.load(str(source))
        overrides, exclude = {}, []
        if score_path == "fp16":
            exclude = list(float_nodes) if float_nodes is not None else [n.name for n in role_nodes(model)]
        else:
            overrides = score_path_overrides(model, calib_inputs,
                                             _quant_type(score_weight_type) if score_weight_type else None)
        if act_type in EIGHT_BIT:
            # onnxruntime's QNN helpers fix a Softmax output's range to [0, 1]: 8-bit steps of 1/255, while attention
            # over hundreds of keys gives probabilities below that (demo: at most 0.0027 over 577 keys), so every
            # probability read 0 or 1/255 and the features lost cosine (0.26 after the first softmax). Their
            # calibrated range instead (16 bits resolve 1/65535, enough).
            for name, override in softmax_overrides(model, calib_inputs).items():
                overrides.setdefault(name, override)
        if act_type in ("uint16", "int16") and headroom != 1.0:
            for name, (lo, hi) in _calibrated_ranges(model, calib_inputs, set(exclude)).items():
                overrides.setdefault(name, [{"rmin": np.array(lo * headroom, np.float32),
                                             "rmax": np.array(hi * headroom, np.float32), CALIBRATED: (lo, hi)}])
        if act_type in ("uint16", "int16") and act_matmul != "keep":
            for node in activation_matmuls(model):
                if node.name not in exclude:
                    convert = overrides.setdefault(node.input[1], [{}])[0].setdefault(
                        "convert", {"quant_type": _quant_type("uint8"), "recv_nodes": set()})
                    convert["recv_nodes"].add(node.name)
        for entries in overrides.values():  # an 8-bit convert keeps the calibrated range: 8 bits have no steps to spare
            calibrated = entries[0].pop(CALIBRATED, None)
            if calibrated is not None and "convert" in entries[0]:
                entries[0]["convert"].update(rmin=np.array(calibrated[0], np.float32),
                                             rmax=np.array(calibrated[1], np.float32))
        config = get_qnn_qdq_config(str(source), _Reader(calib_inputs), activation_type=_quant_type(act_type),
                                    weight_type=_quant_type(weight_type), init_overrides=overrides or None,
                                    nodes_to_exclude=exclude or None)
        quantize(str(source), str(out_path), config)
    return Path(out_path)


@contextlib.contextmanager
def _quiet_root_logger():
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def activation_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """MatMuls whose two inputs are both computed (no weight): attention's q . k^T, probs . v."""
    constant = {i.name for i in model.graph.initializer}
    constant |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n for n in model.graph.node
            if n.op_type == "MatMul" and n.input[0] not in constant and n.input[1] not in constant]


def attention_cores(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Each attention's core, by structure: an activation MatMul (q . k^T) whose one consumer is a Softmax whose one
    consumer is an activation MatMul (probs . v); the three nodes each."""
    matmuls = {n.output[0]: n for n in activation_matmuls(model)}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    cores = []
    for logits, qk in matmuls.items():
        after = consumers.get(logits, [])
        if len(after) != 1 or after[0].op_type != "Softmax":
            continue
        then = consumers.get(after[0].output[0], [])
        if len(then) == 1 and then[0].output[0] in matmuls and then[0].input[0] == after[0].output[0]:
            cores += [qk, after[0], then[0]]
    return cores


def check_qdq(model: onnx.ModelProto) -> None:
    """Raise QnnError if a MatMul reads two 16-bit activations (not an HTP kernel)."""
    inits = {i.name: i for i in model.graph.initializer}
    producer = _producers(list(model.graph.node))

    def sixteen_bit(tensor: str) -> bool:
        dq = producer.get(tensor)
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in inits or len(dq.input) < 3:
            return False
        zero_point = inits.get(dq.input[2])
        return zero_point is not None and zero_point.data_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)

    consumers: dict[str, list[str]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n.op_type)
    # A MatMul is quantized when its output is re-quantized; an excluded one reads DQ outputs
    # but runs in float (fp16 on HTP).
    quantized = lambda n: consumers.get(n.output[0], []) == ["QuantizeLinear"]
    bad = [n.name for n in model.graph.node
           if n.op_type == "MatMul" and quantized(n) and all(sixteen_bit(i) for i in n.input[:2])]
    if bad:
        raise QnnError(f"{len(bad)} MatMul(s) read two 16-bit activations, which HTP cannot run as such: {bad[:3]}")


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
    and a name on every node (quantizer exclusions and placement rows go by node name).

    The rewrites are passes.qnn's (the adapter runs them on the whole tower); here they are
    applied to a ModelProto for callers that quantize an ONNX file directly. Runtime
    (non-constant) Gather indices cannot be checked; the pruning subgraph's come from TopK
    and are non-negative by construction.
    """
    import onnx_ir as ir
    from onnx_ir.passes.common import NameFixPass, ShapeInferencePass

    from vlmprune.passes.qnn import PositiveGatherIndicesPass

    inits = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        if value.name in inits:
            continue
        dims = value.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise QnnError(f"QNN HTP needs static shapes: input {value.name!r} has a dynamic dimension")
    legal = ir.serde.deserialize_model(model)
    for p in (ShapeInferencePass(), PositiveGatherIndicesPass(), NameFixPass()):
        p(legal)
    return ir.serde.serialize_model(legal)


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


def role_nodes(model: onnx.ModelProto, roles: tuple[str, ...] = ("score", "select")) -> list[onnx.NodeProto]:
    """The nodes vlmprune's insertion marked with one of roles (node metadata_props `vlmprune.role`)."""
    def role(node):
        return next((p.value for p in node.metadata_props if p.key == ROLE), None)
    return [n for n in model.graph.node if role(n) in roles]


def feeding_selection_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The selection and every node upstream of it (in a tower: all blocks up to the pruning layer)."""
    nodes = list(model.graph.node)
    producer = _producers(nodes)
    chosen = role_nodes(model)
    upstream = _ancestors([i for n in chosen for i in n.input], producer)
    ids = {id(n) for n in chosen} | set(upstream)
    return [n for n in nodes if id(n) in ids]


EIGHT_BIT = ("uint8", "int8")


def softmax_overrides(model: onnx.ModelProto, calib_inputs: list[dict],
                      nodes: list[onnx.NodeProto] | None = None) -> dict:
    """TensorQuantOverrides giving each Softmax output (of nodes, default all) its calibrated range [0, max]."""
    outputs = [n.output[0] for n in (model.graph.node if nodes is None else nodes) if n.op_type == "Softmax"]
    return {name: [{"rmin": np.array(0.0, np.float32), "rmax": np.array(rmax, np.float32)}]
            for name, rmax in _calibrated_max(model, outputs, calib_inputs).items()}


def score_path_overrides(model: onnx.ModelProto, calib_inputs: list[dict], score_weight_qtype=None) -> dict:
    """TensorQuantOverrides for what feeds the selection: calibrated Softmax ranges, its weight type."""
    nodes = feeding_selection_nodes(model)
    inits = {i.name for i in model.graph.initializer}
    overrides = softmax_overrides(model, calib_inputs, nodes)
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


FIXED_RANGE_OPS = {"Softmax", "Tanh", "Sigmoid"}


CALIBRATED = "calibrated"  # a headroom override's own record of the range it widened (not an onnxruntime key)


def _calibrated_ranges(model: onnx.ModelProto, calib_inputs: list[dict], skip: set[str]) -> dict[str, tuple]:
    """(min, max) over calib_inputs, zero included (a quantized range holds zero exactly), of every float tensor a
    node outside skip computes and of the graph's inputs; fixed-range outputs (Softmax, Tanh, Sigmoid) left out.

    One sample at a time, every intermediate of it held at once: the same peak memory as onnxruntime's own MinMax
    calibration, which the quantizer runs next; only the time doubles, and only for a family declaring a headroom."""
    import onnxruntime as ort

    tensors = [o for n in model.graph.node if n.name not in skip and n.op_type not in FIXED_RANGE_OPS | {"Constant"}
               for o in n.output if o]
    tensors += [i.name for i in model.graph.input]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors if t not in have)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = set(tensors)
    ranges: dict[str, tuple] = {}
    for sample in calib_inputs:
        for name, value in zip(names, session.run(names, sample)):
            if name in wanted and np.issubdtype(value.dtype, np.floating) and value.size:
                lo, hi = float(value.min()), float(value.max())
                old = ranges.get(name, (0.0, 0.0))
                ranges[name] = (min(lo, old[0]), max(hi, old[1]))
    return ranges


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
