"""Legalize a graph for TensorRT's ONNX parser, per TensorRT release.

Why: a Jetson runs one TensorRT release (JetPack 6.1+: 10.3; JetPack 5.1: 8.5.2),
and its ONNX parser (onnx-tensorrt) accepts a fixed set of ops, types and opsets.
What it refuses only shows on the device, at `trtexec` time; so the supported-op
table of each release is data here, the passes rewrite what the table lacks into
what it has, and the target's support check (node_support) refuses, in one line, a graph that still
holds anything else.

Sources of the tables (onnx/onnx-tensorrt, docs/operators.md, "Operator Support
Matrix", the Supported and Supported Types columns):
- TensorRT 8.5: tag 8.5-GA. The parser casts INT64 down to INT32 (the note above the
  table), so INT64 is checked as INT32. Opsets up to 17.
- TensorRT 10.3: tag 10.1-GA (the newest table published in that repository's
  history) with the changes its docs/Changelog.md lists for 10.2 and 10.3 (no op
  added or removed; 10.3: Slice takes tensor axes, ScatterElements uses a new
  plugin). Opsets 9 to 20.
Restrictions enforced beyond op and type (same tables' Restrictions column, and the
parser sources of the same tags, builtin_op_importers.cpp / onnxOpImporters.cpp):
K of TopK a constant <= 3840 (also NvInfer.h ITopKLayer::setK of both releases);
axes of Squeeze / Unsqueeze constant (Slice too on 8.5, Reduce* / Pad on 10.x);
Squeeze without axes needs a static input shape; 8.5's TopK refuses INT32 input
(NvInfer.h 8.5 addTopK: "Int32 tensors are not valid input tensors").
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import const_ints, fresh_initializer, is_default_domain, opset
from vlmprune.passes.legalize import FoldCastLikePass

# --------------------------------------------------------------------- the tables


def _expand(groups: dict[str, str]) -> dict[str, frozenset[str]]:
    table: dict[str, frozenset[str]] = {}
    for types, ops in groups.items():
        for op in ops.split():
            table[op] = frozenset(types.split())
    return table


# onnx-tensorrt 8.5-GA docs/operators.md, supported rows grouped by their type list.
_TRT_8_5 = {
    "FP32 FP16": (
        "Acos Acosh ArgMax ArgMin Asin Asinh Atan Atanh BatchNormalization Ceil Celu Cos Cosh CumSum Dropout "
        "Einsum Erf Exp Floor GridSample GRU ImageScaler InstanceNormalization Log LogSoftmax LRN LSTM "
        "LpNormalization MatMul MeanVarianceNormalization NonMaxSuppression NonZero Pow QuantizeLinear "
        "RandomNormal RandomNormalLike RandomUniform RandomUniformLike Reciprocal ReduceL1 ReduceL2 "
        "ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare "
        "Resize ReverseSequence RNN RoiAlign Scan Sin Sinh Softmax Sqrt Tan TopK Upsample"
    ),
    "FP32 FP16 INT8": (
        "Clip Conv ConvTranspose Elu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool HardSwish HardSigmoid "
        "LeakyRelu LpPool MaxPool ParametricSoftplus PRelu Relu Round ScaledTanh Selu Sigmoid Softplus "
        "Softsign Tanh ThresholdedRelu"
    ),
    "FP32 FP16 INT32": (
        "Abs Add DepthToSpace Div Equal Greater GreaterOrEqual IsNaN Less LessOrEqual Max Mean Min Mod Mul "
        "Neg Range Shrink SpaceToDepth Sub Sum"
    ),
    "FP32 FP16 INT32 INT8 BOOL": (
        "Cast Concat Constant Identity Reshape Shape Size Slice Squeeze Transpose Trilu Unsqueeze"
    ),
    "FP32 FP16 INT32 BOOL": "Expand EyeLike Flatten If Loop OneHot Split Tile Where",
    "FP32 FP16 INT8 INT32": "AveragePool Pad Scatter ScatterElements ScatterND Sign",
    "FP32 FP16 INT8 INT32 BOOL": "Gather GatherElements GatherND",
    "BOOL": "And Not Or Xor",
    "FP32": "ConstantOfShape",
    "INT8": "DequantizeLinear",
}

# onnx-tensorrt 10.1-GA docs/operators.md (+ Changelog 10.2, 10.3: no op changes).
# The table's "INF64" typo in ConstantOfShape's row is read as INT64.
_TRT_10_3 = {
    "FP32 FP16 BF16": (
        "Acos Acosh Asin Asinh Atan Atanh AveragePool BatchNormalization Ceil Celu Clip Conv ConvTranspose "
        "Cos Cosh CumSum Dropout Einsum Elu Erf Exp Floor Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool "
        "GroupNormalization GRU HardSigmoid HardSwish Hardmax ImageScaler InstanceNormalization IsInf "
        "LayerNormalization LeakyRelu Log LogSoftmax LRN LSTM LpNormalization LpPool MatMul MaxPool "
        "MeanVarianceNormalization ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike "
        "RandomUniform RandomUniformLike Reciprocal Resize RNN Round ScaledTanh Scan Selu Sigmoid Sin Sinh "
        "Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Upsample"
    ),
    "FP32 FP16 BF16 INT32 INT64": (
        "Abs Add ArgMax ArgMin DepthToSpace Div Equal Greater GreaterOrEqual IsNaN Less LessOrEqual Max Min "
        "Mod Mul Neg Pad Range ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
        "ReduceProd ReduceSum ReduceSumSquare Relu Scatter ScatterElements ScatterND Shrink Sign SpaceToDepth "
        "Sub Sum TopK"
    ),
    "FP32 FP16 BF16 INT32 INT64 BOOL": (
        "Concat Constant ConstantOfShape Expand EyeLike Flatten Gather GatherElements GatherND Identity If "
        "Loop OneHot Reshape ReverseSequence Shape Size Slice Split Squeeze Tile Transpose Trilu Unsqueeze "
        "Where"
    ),
    "FP32 FP16": "DeformConv GridSample Mish NonMaxSuppression NonZero RoiAlign",
    "FP32 FP16 BF16 INT32 INT64 UINT8 BOOL": "Cast CastLike",
    "FP32 FP16 BF16 INT8 INT32 INT64": "Gelu",
    "FP32 FP16 BF16 FP8 INT32 INT64": "Mean",
    "INT8 FP8 INT4": "DequantizeLinear",
    "BOOL": "And Not Or Xor",
}

_REDUCE_OPS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
               "ReduceProd", "ReduceSum", "ReduceSumSquare")


@dataclasses.dataclass(frozen=True)
class TensorRTOps:
    """What one TensorRT release's ONNX parser accepts."""

    version: str
    opsets: tuple[int, int]  # inclusive range of default-domain opsets
    types: dict[str, frozenset[str]]  # op_type -> element types its main input may have
    constant_inputs: dict[str, tuple[int, ...]]  # op_type -> inputs that must be initializers
    int64_as_int32: bool  # the parser narrows INT64 to INT32 (TensorRT < 9)
    max_topk: int = 3840
    source: str = ""

    def supports_type(self, op_type: str, dtype: ir.DataType | None) -> bool:
        if dtype is None:
            return True  # unknown here; the parser decides
        name = _TYPE_NAMES.get(dtype)
        if name == "INT64" and self.int64_as_int32:
            name = "INT32"
        return name is not None and name in self.types.get(op_type, frozenset())


_TYPE_NAMES = {
    ir.DataType.FLOAT: "FP32", ir.DataType.DOUBLE: "FP32",  # both parsers narrow DOUBLE to FLOAT
    ir.DataType.FLOAT16: "FP16", ir.DataType.BFLOAT16: "BF16", ir.DataType.INT32: "INT32",
    ir.DataType.INT64: "INT64", ir.DataType.INT8: "INT8", ir.DataType.UINT8: "UINT8", ir.DataType.BOOL: "BOOL",
    ir.DataType.FLOAT8E4M3FN: "FP8", ir.DataType.INT4: "INT4",
}

TENSORRT_OPS: dict[str, TensorRTOps] = {
    "8.5": TensorRTOps(
        "8.5", (7, 17), _expand(_TRT_8_5),
        {"TopK": (1,), "Slice": (3,), "Squeeze": (1,), "Unsqueeze": (1,)},
        int64_as_int32=True, source="onnx/onnx-tensorrt@8.5-GA docs/operators.md",
    ),
    "10.3": TensorRTOps(
        "10.3", (9, 20), _expand(_TRT_10_3),
        {"TopK": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "Pad": (3,), **{op: (1,) for op in _REDUCE_OPS}},
        int64_as_int32=False,
        source="onnx/onnx-tensorrt@10.1-GA docs/operators.md + docs/Changelog.md (10.2, 10.3)",
    ),
}

# The fused node's contract with the TensorRT plugin (kernels/trt/plugin_names.json).
PLUGIN_CONTRACT = json.loads(
    (Path(__file__).resolve().parents[1] / "kernels" / "trt" / "plugin_names.json").read_text())
PLUGIN_DOMAIN = "trt.plugins"  # the parser ignores domains; ONNX tools need one declared
# The scorer plugin (VlmpClsScore: ClsAttentionScore's attributes; --scorer int8 on orin / xavier).
SCORER_CONTRACT = PLUGIN_CONTRACT["scorer"]


def tensorrt_ops(version: str) -> TensorRTOps:
    major_minor = ".".join(version.split(".")[:2])
    if major_minor not in TENSORRT_OPS:
        raise KeyError(f"no ONNX op table for TensorRT {version}; known: {', '.join(TENSORRT_OPS)}")
    return TENSORRT_OPS[major_minor]


# ----------------------------------------------------------------------- helpers


def _node(op_type: str, inputs, name: str, num_outputs: int = 1, types=(), **attrs) -> ir.Node:
    """A node with named outputs; types: (dtype, shape) per output, so later checks see every type."""
    node = ir.node(op_type, inputs, attributes=attrs or None, num_outputs=num_outputs, name=name)
    for i, out in enumerate(node.outputs):
        out.name = name + (f":{i}" if num_outputs > 1 else "")
        if i < len(types):
            dtype, shape = types[i]
            out.type = ir.TensorType(dtype) if dtype is not None else None
            out.shape = ir.Shape(shape) if shape is not None else None
    return node


def _replace(node: ir.Node, new_nodes: list[ir.Node], outputs: list[ir.Value]) -> None:
    """Put new_nodes where node is and give its consumers (and graph outputs) the new outputs."""
    graph = node.graph
    graph.insert_before(node, new_nodes)
    for old, new in zip(node.outputs, outputs):
        new.name, old.name = old.name, f"{old.name}.replaced"
        new.type, new.shape = old.type, old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(node, safe=True)


# ------------------------------------------------------------------- legalization


# Resize-18's attributes that Resize-13 lacks -> whether a value set differs from the default (a resize that sets
# none of them is Resize-13's: a bilinear pooling, LLaVA-OneVision's apply_pooling, exports as Resize-18).
_RESIZE_18 = {
    "antialias": lambda a: a is not None and a.as_int() != 0,
    "axes": lambda a: a is not None,
    "keep_aspect_ratio_policy": lambda a: a is not None and a.as_string() != "stretch",
}


class DowngradeOpsetPass(ir.passes.InPlacePass):
    """Rewrite a graph to an older default-domain opset (TensorRT 8.5 parses up to 17).

    Why not keep opset 18 and hope: the 8.5 parser reads the axes of Reduce* from
    the attribute only, so opset-18 axes inputs are silently ignored (it reduces
    over every axis). Each node whose schema differs between the two opsets is
    converted (Reduce*: axes input -> attribute; Split: num_outputs -> split sizes;
    Cast/CastLike-19: the saturate attribute, which only float8 reads, dropped once the
    types are known and none is float8; Gelu-20: its erf or tanh formula in elementwise
    ops; Resize-18: its new attributes dropped where they hold their defaults), accepted when only
    its type constraints changed, or refused with its name.
    """

    def __init__(self, target: int):
        super().__init__()
        self.target = target

    def requires(self, model: ir.Model) -> None:
        source = opset(model)
        problems = Counter()
        for node in model.graph.all_nodes():
            if is_default_domain(node) and source > self.target:
                why = self._obstacle(node, source)
                if why:
                    problems[why] += 1
        if problems:
            listed = "; ".join(f"{why} ({n} node{'s' * (n > 1)})" for why, n in problems.items())
            raise StructureError(f"cannot rewrite opset {source} to {self.target}: {listed}")

    def _obstacle(self, node: ir.Node, source: int) -> str | None:
        try:
            new = onnx.defs.get_schema(node.op_type, source)
            old = onnx.defs.get_schema(node.op_type, self.target)
        except onnx.defs.SchemaError:
            if node.op_type == "Gelu" and node.inputs[0] is not None and node.inputs[0].dtype is not None:
                return None  # decomposed (_gelu)
            return f"{node.op_type} does not exist at opset {self.target}"
        if new.since_version == old.since_version or _same_signature(new, old):
            return None
        if node.op_type in ("Cast", "CastLike") and new.since_version >= 19 and old.since_version < 19:
            types = [v.dtype for v in [*node.inputs, *node.outputs] if v is not None]
            if len(types) < len(node.inputs) + 1 or any(t is None for t in types):
                return f"{node.op_type}-{new.since_version} of a type not known here"
            if any(t.name.startswith(("FLOAT8", "FLOAT4", "INT4", "UINT4", "INT2", "UINT2")) for t in types):
                return f"{node.op_type}-{new.since_version} of a type opset {self.target} lacks"
            return None
        if node.op_type in _REDUCE_OPS and new.since_version >= 18:
            dtype = node.inputs[0].dtype if node.inputs[0] is not None else None
            if old.since_version < 18 and dtype == ir.DataType.BOOL:
                return f"{node.op_type} of bool"
            axes = node.inputs[1] if len(node.inputs) > 1 else None
            if axes is not None and const_ints(axes) is None:
                return f"{node.op_type} with runtime axes"
            if axes is None and node.attributes.get_int("noop_with_empty_axes", 0):
                return f"{node.op_type} with noop_with_empty_axes"
            return None
        if node.op_type == "Split" and new.since_version == 18:
            if len(node.inputs) > 1 and node.inputs[1] is not None:
                return None
            return None if _split_sizes(node) is not None else "Split by num_outputs of a dimension not known here"
        if node.op_type == "Resize" and new.since_version == 18 and old.since_version == 13:
            set_ = [name for name in _RESIZE_18 if _RESIZE_18[name](node.attributes.get(name))]
            return f"Resize-18 with {', '.join(set_)} (no Resize-13 form)" if set_ else None
        return f"{node.op_type}-{new.since_version} has no opset-{self.target} form here"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        source = opset(model)
        if source <= self.target:
            return ir.passes.PassResult(model, modified=False)
        for node in list(model.graph.all_nodes()):
            if not is_default_domain(node):
                continue
            new = onnx.defs.get_schema(node.op_type, source)
            try:
                old = onnx.defs.get_schema(node.op_type, self.target)
            except onnx.defs.SchemaError:  # no older op at all: requires() let through only what decomposes
                self._gelu(node)
                continue
            if new.since_version == old.since_version or _same_signature(new, old):
                continue
            if node.op_type in _REDUCE_OPS:
                if old.since_version < 18:
                    self._reduce(node)
            elif node.op_type == "Split":
                self._split(node)
            elif node.op_type in ("Cast", "CastLike"):
                node.attributes.pop("saturate", None)
            elif node.op_type == "Resize":  # requires() let through only Resize-18's new attributes at their defaults
                for name in _RESIZE_18:
                    node.attributes.pop(name, None)
        model.opset_imports[""] = self.target
        model.opset_imports.pop("ai.onnx", None)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _reduce(node: ir.Node) -> None:
        axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        attrs = {"keepdims": node.attributes.get_int("keepdims", 1)}
        if axes:
            attrs["axes"] = axes
        replacement = _node(node.op_type, [node.inputs[0]], node.name or node.op_type, **attrs)
        _replace(node, [replacement], list(replacement.outputs))

    @staticmethod
    def _gelu(node: ir.Node) -> None:
        """Gelu-20 -> 0.5·x·(1 + erf(x/√2)), or its tanh form for approximate="tanh" (the op's own definition)."""
        x, graph, name = node.inputs[0], node.graph, node.name or f"{node.outputs[0].name}_gelu"
        dtype = x.dtype.numpy()

        def const(label, value):
            return fresh_initializer(graph, f"{name}_const_{label}", np.asarray(value, dtype=dtype))

        typed = [(x.dtype, None)]
        if node.attributes.get_string("approximate", "none") == "tanh":
            cube = _node("Mul", [x, x], f"{name}_sq", types=typed)
            cube3 = _node("Mul", [cube.outputs[0], x], f"{name}_cube", types=typed)
            scaled = _node("Mul", [cube3.outputs[0], const("c", 0.044715)], f"{name}_c", types=typed)
            inner = _node("Add", [x, scaled.outputs[0]], f"{name}_inner", types=typed)
            arg = _node("Mul", [inner.outputs[0], const("root", np.sqrt(2.0 / np.pi))], f"{name}_arg", types=typed)
            curve = _node("Tanh", [arg.outputs[0]], f"{name}_tanh", types=typed)
            nodes = [cube, cube3, scaled, inner, arg, curve]
        else:
            arg = _node("Mul", [x, const("rsqrt2", 1.0 / np.sqrt(2.0))], f"{name}_arg", types=typed)
            curve = _node("Erf", [arg.outputs[0]], f"{name}_erf", types=typed)
            nodes = [arg, curve]
        plus = _node("Add", [curve.outputs[0], const("one", 1.0)], f"{name}_plus", types=typed)
        half = _node("Mul", [x, const("half", 0.5)], f"{name}_half", types=typed)
        out = _node("Mul", [half.outputs[0], plus.outputs[0]], f"{name}_out", types=typed)
        _replace(node, [*nodes, plus, half, out], list(out.outputs))

    @staticmethod
    def _split(node: ir.Node) -> None:
        inputs = list(node.inputs)
        if len(inputs) < 2 or inputs[1] is None:
            sizes = _split_sizes(node)
            inputs = [inputs[0], fresh_initializer(node.graph, f"{node.name}_split", np.asarray(sizes, dtype=np.int64))]
        replacement = _node("Split", inputs, node.name or "Split", num_outputs=len(node.outputs),
                            axis=node.attributes.get_int("axis", 0))
        _replace(node, [replacement], list(replacement.outputs))


def _same_signature(a, b) -> bool:
    """Same inputs, outputs and attribute names: only the allowed types (or docs) changed."""
    def sig(s):
        return ([(p.name, p.option) for p in s.inputs], [(p.name, p.option) for p in s.outputs], sorted(s.attributes))
    return sig(a) == sig(b)


def _split_sizes(node: ir.Node) -> list[int] | None:
    """Opset-18 Split by num_outputs: ceil-sized chunks, the last one smaller."""
    shape = node.inputs[0].shape
    axis = node.attributes.get_int("axis", 0)
    count = node.attributes.get_int("num_outputs", len(node.outputs))
    dim = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    if not isinstance(dim, int):
        return None
    chunk = -(-dim // count)
    return [min(chunk, dim - i * chunk) for i in range(count)]


class DecomposeLayerNormalizationPass(ir.passes.InPlacePass):
    """LayerNormalization -> ReduceMean / Sub / Mul / ReduceMean / Add / Sqrt / Div / Mul / Add.

    TensorRT 8.5's parser has no LayerNormalization (8.6 added it); TensorRT
    recognises this decomposition and fuses it again where it can. Computed in the
    input's type; the exporters' stash_type=1 (fp32 statistics) is what an fp32
    graph computes anyway, and fp16 placement is the engine builder's choice.
    """

    def requires(self, model: ir.Model) -> None:
        for node in model.graph.all_nodes():
            if node.op_type == "LayerNormalization" and is_default_domain(node):
                if node.inputs[0].shape is None:
                    raise StructureError(f"LayerNormalization {node.name!r}: input rank unknown, cannot decompose")
                if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
                    raise StructureError(f"LayerNormalization {node.name!r}: Mean/InvStdDev outputs are used")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        version, decomposed = opset(model), 0
        for node in list(model.graph.all_nodes()):
            if node.op_type != "LayerNormalization" or not is_default_domain(node):
                continue
            x, scale = node.inputs[0], node.inputs[1]
            bias = node.inputs[2] if len(node.inputs) > 2 else None
            rank = len(x.shape)
            axis = node.attributes.get_int("axis", -1) % rank
            axes = list(range(axis, rank))
            eps = node.attributes.get_float("epsilon", 1e-5)
            name, graph = node.name or "LayerNormalization", node.graph
            np_dtype = (x.dtype or ir.DataType.FLOAT).numpy()
            nodes: list[ir.Node] = []
            stats_shape = [d if i < axis else 1 for i, d in enumerate(x.shape)]

            def add(op_type, inputs, suffix, **attrs):
                shape = stats_shape if suffix in ("mean", "var", "var_eps", "std") else list(x.shape)
                n = _node(op_type, inputs, f"{name}/{suffix}", types=[(x.dtype, shape)], **attrs)
                nodes.append(n)
                return n.outputs[0]

            def mean(v, suffix):
                if version >= 18:
                    return add("ReduceMean", [v, fresh_initializer(graph, f"{name}/axes", np.asarray(axes, np.int64))],
                               suffix, keepdims=1)
                return add("ReduceMean", [v], suffix, axes=axes, keepdims=1)

            centered = add("Sub", [x, mean(x, "mean")], "centered")
            var = mean(add("Mul", [centered, centered], "squared"), "var")
            std = add("Sqrt", [add("Add", [var, fresh_initializer(graph, f"{name}/eps", np.asarray(eps, np_dtype))],
                                   "var_eps")], "std")
            y = add("Mul", [add("Div", [centered, std], "normed"), scale], "scaled")
            if bias is not None:
                y = add("Add", [y, bias], "shifted")
            _replace(node, nodes, [y])
            decomposed += 1
        return ir.passes.PassResult(model, modified=bool(decomposed))


class SqueezeAxesPass(ir.passes.InPlacePass):
    """Give every Squeeze without axes its axes as a constant.

    The parsers squeeze "all dims of size 1" only on a fully static input and
    refuse otherwise; the exporter's Squeeze of a [1] shape slice is static here.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        version = opset(model)
        for node in list(model.graph.all_nodes()):
            if node.op_type != "Squeeze" or not is_default_domain(node):
                continue
            if (len(node.inputs) > 1 and node.inputs[1] is not None) or node.attributes.get("axes") is not None:
                continue
            shape = node.inputs[0].shape
            if shape is None or not all(isinstance(d, int) for d in shape):
                continue  # left for the support check to report
            axes = [i for i, d in enumerate(shape) if d == 1]
            if version >= 13:
                node.resize_inputs(2)
                node.replace_input_with(1, fresh_initializer(node.graph, f"{node.name}_axes", np.asarray(axes, np.int64)))
            else:
                node.attributes["axes"] = ir.AttrInt64s("axes", axes)
            count += 1
        return ir.passes.PassResult(model, modified=bool(count))


class SortIndicesAsFloatPass(ir.passes.InPlacePass):
    """TopK over integer indices -> Cast(float) -> TopK -> Cast(int64), for parsers without integer TopK.

    The pruning subgraph sorts the kept indices by a second TopK over the first's
    indices; TensorRT 8.5 sorts only FP32/FP16. The indices are < N, so float32
    holds them exactly when N < 2^24, which requires() proves from the static N of
    the TopK that produced them.
    """

    EXACT = 1 << 24

    def __init__(self, ops: TensorRTOps):
        super().__init__()
        self.ops = ops

    def _targets(self, model: ir.Model) -> list[ir.Node]:
        integers = (ir.DataType.INT64, ir.DataType.INT32)
        return [n for n in model.graph.all_nodes()
                if n.op_type == "TopK" and is_default_domain(n) and n.inputs[0].dtype in integers
                and not self.ops.supports_type("TopK", n.inputs[0].dtype)]

    def requires(self, model: ir.Model) -> None:
        for node in self._targets(model):
            if _index_bound(node.inputs[0]) is None:
                raise StructureError(f"TopK {node.name!r} sorts integers whose range is not known to fit "
                                     f"float32 exactly; TensorRT {self.ops.version} sorts only FP32/FP16")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewritten = 0
        for node in self._targets(model):
            name, dtype = node.name or "TopK", node.inputs[0].dtype
            values, indices = node.outputs
            as_float = _node("Cast", [node.inputs[0]], f"{name}/to_float", to=ir.DataType.FLOAT,
                             types=[(ir.DataType.FLOAT, node.inputs[0].shape)])
            topk = _node("TopK", [as_float.outputs[0], node.inputs[1]], f"{name}/float", num_outputs=2,
                         types=[(ir.DataType.FLOAT, values.shape), (ir.DataType.INT64, indices.shape)],
                         **{k: v.value for k, v in node.attributes.items()})
            back = _node("Cast", [topk.outputs[0]], f"{name}/to_int", to=dtype, types=[(dtype, values.shape)])
            _replace(node, [as_float, topk, back], [back.outputs[0], topk.outputs[1]])
            rewritten += 1
        return ir.passes.PassResult(model, modified=bool(rewritten))


def _index_bound(value: ir.Value) -> int | None:
    """An exclusive upper bound of value's entries, where the graph proves one below 2^24, else None.

    Indices come out of TopK (over a static axis) or ArgMax, or are constant positions (token
    merging's, broadcast by Expand), and reach the sort through Concat, Gather, Slice and
    shape-only ops; the bound is the largest of what feeds them.
    """
    constant = ir.convenience.get_const_tensor(value)
    if constant is not None:
        entries = constant.numpy()
        bound = int(entries.max()) + 1 if entries.size and entries.min() >= 0 else None
        return bound if bound is not None and bound < SortIndicesAsFloatPass.EXACT else None
    producer = value.producer()
    if producer is None:
        return None
    op = producer.op_type
    if op in ("TopK", "ArgMax", "ArgMin"):
        if op == "TopK" and value is not producer.outputs[1]:
            return None
        shape = producer.inputs[0].shape
        axis = producer.attributes.get_int("axis", -1 if op == "TopK" else 0)
        if shape is None or not -len(shape) <= axis < len(shape):
            return None
        n = shape[axis]
        return n if isinstance(n, int) and n < SortIndicesAsFloatPass.EXACT else None
    if op == "Concat":
        bounds = [_index_bound(v) for v in producer.inputs]
        return None if any(b is None for b in bounds) else max(bounds)
    if op in ("Gather", "GatherElements", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Identity",
              "Expand"):
        return _index_bound(producer.inputs[0])
    return None


def legalization_passes(ops: TensorRTOps, model_opset: int | None = None) -> list[ir.passes.PassBase]:
    """The passes a graph needs for ops's parser, in order (chosen by the table, not by version checks)."""
    # Every type and shape that can be known, first: CastLike, Split and Squeeze are rewritten from them.
    passes: list[ir.passes.PassBase] = [ShapeInferencePass()]
    if model_opset is None or model_opset > ops.opsets[1]:
        passes.append(DowngradeOpsetPass(ops.opsets[1]))
    if "LayerNormalization" not in ops.types:
        passes.append(DecomposeLayerNormalizationPass())
    if "CastLike" not in ops.types:
        passes.append(FoldCastLikePass())
    passes.append(SqueezeAxesPass())
    if not ops.supports_type("TopK", ir.DataType.INT64):
        passes.append(SortIndicesAsFloatPass(ops))
    return passes


# -------------------------------------------------------------------------- check


def _typed_value(node: ir.Node) -> ir.Value | None:
    """The value whose element type the table's Supported Types column is about."""
    if node.op_type == "ConstantOfShape":
        return node.outputs[0]
    if node.op_type == "Where":
        return node.inputs[1]
    return node.inputs[0] if node.inputs else None


def is_plugin_node(node: ir.Node) -> bool:
    """A node that the parser maps to one of the plugins (op_type, plugin_version, plugin_namespace):
    VlmpTokenPrune, or VlmpClsScore (--scorer int8, SCORER_CONTRACT)."""
    attrs = node.attributes
    return any(node.op_type == c["name"]
               and attrs.get_string("plugin_version", "1") == c["version"]
               and attrs.get_string("plugin_namespace", "") == c["namespace"]
               for c in (PLUGIN_CONTRACT, SCORER_CONTRACT))


def node_support(node: ir.Node, ops: TensorRTOps) -> tuple[bool, str]:
    """Whether ops's parser takes node, and why not: the table's op, type and constant-input columns."""
    if not is_default_domain(node):
        return (True, "") if is_plugin_node(node) else (False, "custom op without a TensorRT plugin")
    op = node.op_type
    if op not in ops.types:
        return False, f"not in TensorRT {ops.version}'s ONNX parser table"
    typed = _typed_value(node)
    if typed is not None and not ops.supports_type(op, typed.dtype):
        return False, f"{typed.dtype.name} input (supports {', '.join(sorted(ops.types[op]))})"
    for idx in ops.constant_inputs.get(op, ()):
        if idx < len(node.inputs) and node.inputs[idx] is not None and const_ints(node.inputs[idx]) is None:
            return False, f"input {idx} must be an initializer"
    if op == "TopK":
        k = const_ints(node.inputs[1])
        if k is not None and k[0] > ops.max_topk:
            return False, f"K={k[0]} > {ops.max_topk}"
        if node.attributes.get_int("sorted", 1) != 1:
            return False, "sorted=0"
    if op == "Squeeze" and len(node.inputs) < 2 and node.attributes.get("axes") is None:
        shape = node.inputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            return False, "no axes on a dynamic shape"
    return True, ""


def model_support(model: ir.Model, ops: TensorRTOps) -> list[str]:
    """Model-level reasons ops's parser would refuse model (the opset)."""
    version = opset(model)
    if not ops.opsets[0] <= version <= ops.opsets[1]:
        return [f"opset {version} (TensorRT {ops.version} parses {ops.opsets[0]}..{ops.opsets[1]})"]
    return []


def unsupported(model: ir.Model, ops: TensorRTOps) -> list[str]:
    """Every reason ops's parser would refuse model, one string each (empty: it parses)."""
    from vlmprune.passes.support import unsupported as reasons

    return reasons(model, lambda node: node_support(node, ops), lambda m: model_support(m, ops))
