"""Target-neutral legalization: static batch, CastLike, and the selection's GatherND.

rknn-toolkit2 and QNN HTP both compile a graph with static shapes and a fixed op set,
and both reject or demote (to their CPU) ops that ONNX Runtime takes for granted. The
passes here rewrite what the pruned tower holds into forms both accept; the target
modules (passes.rknn, passes.qnn) list them in the order each target needs. The selection
has two standard-op forms, an index Gather (GatherNDToGatherPass) and a one-hot MatMul
(OneHotSelectionPass); each target picks one by measurement (see its module).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import (LiftConstantsToInitializersPass, RemoveUnusedNodesPass, ShapeInferencePass,
                                  TopologicalSortPass)

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import fresh_initializer


def _node(op_type: str, inputs, name: str, **attrs) -> ir.Node:
    node = ir.node(op_type, inputs, attributes=attrs or None, name=name)
    node.outputs[0].name = name
    return node


def _static(value: ir.Value) -> list[int] | None:
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return list(value.shape)


class StaticBatchPass(ir.passes.InPlacePass):
    """Fix every graph input's batch dimension to `batch`, then fold what became constant.

    Why: rknn-toolkit2 (.rknn) and QNN HTP (context binaries) compile static shapes, and
    RKNN runs batch 1. A dynamic-batch export carries Shape -> ... -> Reshape chains for
    the batch size; with the batch fixed they fold to constants, so the target graph
    holds no shape arithmetic (a graph that is static already is folded too). A graph exported with another static batch cannot be
    re-batched (the exporter baked it into constants) and is refused in one line.
    """

    def __init__(self, batch: int = 1, target: str = "this target"):
        super().__init__()
        self.batch, self.target = batch, target

    def requires(self, model: ir.Model) -> None:
        for value in model.graph.inputs:
            if value.shape is None or len(value.shape) == 0:
                raise StructureError(f"{self.target} needs static shapes: input {value.name!r} has no shape")
            first = value.shape[0]
            if isinstance(first, int) and first != self.batch:
                raise StructureError(
                    f"{self.target} runs batch {self.batch}, but the graph was exported with batch {first}: "
                    f"compile with --batch {self.batch} (or without --batch)")
            if not all(isinstance(d, int) for d in value.shape[1:]):
                raise StructureError(f"{self.target} needs static shapes: input {value.name!r} is {list(value.shape)}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.optimizer import fold_constants

        graph = model.graph
        dynamic = [v for v in graph.inputs if not isinstance(v.shape[0], int)]
        if not dynamic and not any(n.op_type in ("Shape", "Size") for n in graph):
            return ir.passes.PassResult(model, modified=False)
        for value in dynamic:
            value.shape = ir.Shape([self.batch, *value.shape[1:]])
        # Symbolic shapes downstream are stale now. Folding infers node by node, in order,
        # so each Shape sees the static shape its producer just got (a whole-graph
        # inference first would leave the exporter's computed Reshape targets symbolic).
        for node in graph:
            for out in node.outputs:
                out.shape = None
        fold_constants(model, onnx_shape_inference=True)
        LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        RemoveUnusedNodesPass()(model)
        ShapeInferencePass()(model)
        still = [v.name for v in graph.outputs if _static(v) is None]
        if still:
            raise StructureError(f"{self.target}: outputs {still} keep dynamic shapes after fixing the batch to {self.batch}")
        return ir.passes.PassResult(model, modified=True)


class FoldCastLikePass(ir.passes.InPlacePass):
    """CastLike(x, like) -> x when x already has like's element type, else Cast(x, to=that type).

    Why: the exporter casts scalar constants (the attention scale, quick_gelu's 1.702) with
    CastLike. ONNX Runtime folds them at load time, but rknn-toolkit2 2.5.0 has no CastLike
    on the NPU and keeps each one as a CPU layer (one NPU -> CPU -> NPU round trip per
    block, measured on the demo tower); opset 15's CastLike is also absent from its op table.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folded = 0
        for node in list(graph):
            if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx"):
                continue
            x, like = node.inputs[0], node.inputs[1]
            if like is None or like.dtype is None or x is None or x.dtype is None:
                continue  # unknown types: leave it to the runtime
            out = node.outputs[0]
            if x.dtype == like.dtype:
                replacement = x
            else:
                cast = _node("Cast", [x], f"{node.name or out.name}_cast", to=like.dtype)
                cast.outputs[0].type, cast.outputs[0].shape = out.type, out.shape
                graph.insert_before(node, cast)
                replacement = cast.outputs[0]
            _replace_all_uses(graph, out, replacement)
            graph.remove(node, safe=True)
            folded += 1
        return ir.passes.PassResult(model, modified=folded > 0)


def _replace_all_uses(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    if old.is_graph_output():
        # A graph output keeps its name: route it through an Identity rather than renaming `new`.
        name = old.name
        ident = _node("Identity", [new], f"{name}_identity")
        ident.outputs[0].type, ident.outputs[0].shape = old.type, old.shape
        graph.append(ident)
        graph.outputs[graph.outputs.index(old)] = ident.outputs[0]
        old.name = f"{name}_replaced"
        ident.outputs[0].name = name
    old.replace_all_uses_with(new)


class GatherNDToGatherPass(ir.passes.InPlacePass):
    """GatherND(data [B, N, D], idx [B, K, 1], batch_dims=1) -> Gather or GatherElements.

    Why: the selection picks K tokens per image with a batched GatherND. QNN HTP has no
    GatherND with batch_dims=1 (onnxruntime-qnn 2.7.0 leaves it to the CPU EP), and
    rknn-toolkit2's op table lists GatherND as unsupported (2.5.0 runs it on its CPU). Both
    take Gather and GatherElements. With a static batch of 1 the rewrite is
    Gather(data, idx reshaped to [K], axis=1); otherwise GatherElements(data,
    Expand(idx, [1, 1, D]), axis=1), which broadcasts the index over D for any batch.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        rewritten = 0
        for node in list(graph):
            if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx"):
                continue
            if node.attributes.get_int("batch_dims", 0) != 1:
                continue
            data, idx = node.inputs
            if data.shape is None or len(data.shape) != 3 or idx.shape is None or len(idx.shape) != 3 or idx.shape[2] != 1:
                continue  # not the token selection's form
            depth = data.shape[2]
            if not isinstance(depth, int):
                raise StructureError(f"GatherND {node.name!r}: the token width must be static to rewrite it")
            out = node.outputs[0]
            keep = idx.shape[1]
            if data.shape[0] == 1 and isinstance(keep, int):
                flat = _node("Reshape", [idx, fresh_initializer(graph, f"{node.name}_flat_shape", np.array([keep], np.int64))],
                             f"{node.name}_flat")
                new = _node("Gather", [data, flat.outputs[0]], f"{node.name}_gather", axis=1)
                inserted = [flat, new]
            else:
                wide = _node("Expand", [idx, fresh_initializer(graph, f"{node.name}_wide_shape", np.array([1, 1, depth], np.int64))],
                             f"{node.name}_wide")
                new = _node("GatherElements", [data, wide.outputs[0]], f"{node.name}_gather", axis=1)
                inserted = [wide, new]
            new.outputs[0].type, new.outputs[0].shape = out.type, out.shape
            graph.insert_before(node, inserted)
            _replace_all_uses(graph, out, new.outputs[0])
            graph.remove(node, safe=True)
            rewritten += 1
        if rewritten:
            ShapeInferencePass()(model)
        return ir.passes.PassResult(model, modified=rewritten > 0)


class OneHotSelectionPass(ir.passes.InPlacePass):
    """Select the kept tokens with a one-hot MatMul instead of an index gather.

    GatherND(patches [B, N, D], Unsqueeze(kept, -1), batch_dims=1) becomes
    MatMul(onehot [B, K, N], patches), onehot = Cast(Equal(kept[..., None], arange(N))),
    and a pruned-token mask ScatterElements(ones, kept, zeros, axis=1) over the same
    indices becomes 1 - ReduceSum(onehot, axis=1). Why: on an accelerator that runs index
    ops on its CPU (RKNN), this keeps the gather and the mask on the accelerator as a
    MatMul and a reduction, one CPU round trip fewer. Equal + Cast rather than OneHot:
    OneHot is not in rknn-toolkit2's op table. Numerically exact (0/1 weights).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        rewritten = 0
        for node in list(graph):
            if node.op_type != "GatherND" or node.attributes.get_int("batch_dims", 0) != 1:
                continue
            patches, column = node.inputs
            unsq = column.producer()
            n = patches.shape[1] if patches.shape is not None and len(patches.shape) == 3 else None
            if unsq is None or unsq.op_type != "Unsqueeze" or not isinstance(n, int):
                continue
            kept = unsq.inputs[0]
            dtype = patches.dtype or ir.DataType.FLOAT
            positions = fresh_initializer(graph, f"{node.name}_positions", np.arange(n, dtype=np.int64).reshape(1, 1, n))
            equal = _node("Equal", [column, positions], f"{node.name}_equal")
            onehot = _node("Cast", [equal.outputs[0]], f"{node.name}_onehot", to=dtype)
            select = _node("MatMul", [onehot.outputs[0], patches], f"{node.name}_matmul")
            graph.insert_before(node, [equal, onehot, select])
            _replace_all_uses(graph, node.outputs[0], select.outputs[0])
            graph.remove(node, safe=True)
            for use in list(kept.uses()):
                mask = use.node
                if mask.op_type == "ScatterElements" and use.idx == 1 and _is_fill(mask.inputs[0], 1.0) \
                        and _is_fill(mask.inputs[2], 0.0) and mask.attributes.get_int("axis", 0) in (1, -1):
                    self._replace_mask(graph, mask, onehot.outputs[0], dtype)
            rewritten += 1
        if rewritten:
            RemoveUnusedNodesPass()(model)
            TopologicalSortPass()(model)
            ShapeInferencePass()(model)
        return ir.passes.PassResult(model, modified=rewritten > 0)

    @staticmethod
    def _replace_mask(graph: ir.Graph, mask: ir.Node, onehot: ir.Value, dtype: ir.DataType) -> None:
        name = mask.name or "mask"
        axes = fresh_initializer(graph, f"{name}_axes", np.array([1], np.int64))
        hits = _node("ReduceSum", [onehot, axes], f"{name}_hits", keepdims=0)
        one = fresh_initializer(graph, f"{name}_one", np.array(1, dtype=dtype.numpy()))
        new = _node("Sub", [one, hits.outputs[0]], f"{name}_onehot")
        graph.insert_before(mask, [hits, new])
        _replace_all_uses(graph, mask.outputs[0], new.outputs[0])
        graph.remove(mask, safe=True)


def _is_fill(value: ir.Value, fill: float) -> bool:
    """A constant tensor whose every element is `fill`."""
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        producer = value.producer()
        if producer is None or producer.op_type != "ConstantOfShape":
            return False
        attr = producer.attributes.get("value")
        tensor = attr.as_tensor() if attr is not None else None
        if tensor is None:
            return fill == 0.0
    array = tensor.numpy()
    return bool(array.size) and bool(np.all(array == fill))
