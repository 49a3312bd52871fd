"""Folding the run-time shape arithmetic of a graph whose dims are static but for the batch.

torch.onnx's TorchScript exporter computes sizes at run time from Shape ops: DINOv2's
position embeddings are interpolated to `Shape(pixels)[2] / patch` (Gather, Div, Cast,
Concat, then Resize's sizes), and every attention block reshapes to `Shape(x)[1]` tokens.
With a static H and W those sizes are constants, but onnxscript's folder folds a Shape
only when every dim it holds is static, and a Gather of a shape only with 1-D indices: a
dynamic batch leaves them all, and the token count of the output unknown.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import const_array, fresh_initializer, opset


class FoldStaticDimsPass(ir.passes.InPlacePass):
    """Gather/Slice of a Shape that reads only static dims -> a constant; then fold what follows, to a fixed point.

    Each round folds the reads (here), the arithmetic they feed (onnxscript's
    fold_constants) and infers shapes again: a Resize whose sizes folded gets a static
    output, so the next round folds the Shape reads of the blocks after it.
    Dims that are read dynamic (the batch) stay computed at run time.
    """

    def requires(self, model: ir.Model) -> None:
        if opset(model) < 10:
            raise StructureError(f"opset {opset(model)}: reading Slice's starts and ends as inputs needs opset 10 or later")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.optimizer import fold_constants

        total = 0
        while folded := _fold_shape_reads(model.graph):
            total += folded
            fold_constants(model, onnx_shape_inference=True, should_fold=_shape_arithmetic)
            ShapeInferencePass()(model)  # with data propagation: sizes now partly constant give static dims
        if total:
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=total > 0)

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if _static_read(n) is not None]
        if left:
            raise ir.passes.PostconditionError(f"static shape reads left unfolded: {left[:3]}")  # a bug, not input


def _shape_arithmetic(node: ir.Node) -> bool | None:
    """Fold scalars and vectors only (what sizes are computed with): weights stay for the runtime to compute with."""
    small = all(v is None or (v.shape is not None and len(v.shape) <= 1) for v in node.inputs)
    return None if small else False


def _fold_shape_reads(graph: ir.Graph) -> int:
    """Replace each Gather/Slice of a Shape whose read dims are all static by an initializer; how many."""
    count = 0
    for node in list(graph):
        dims = _static_read(node)
        if dims is None:
            continue
        value = fresh_initializer(graph, f"{node.name or 'shape_read'}/static", dims)
        node.outputs[0].replace_all_uses_with(value)
        graph.remove(node, safe=True)
        count += 1
    return count


def _static_read(node: ir.Node) -> np.ndarray | None:
    """The int64 dims a Gather (axis 0) or Slice of a Shape reads, where all of them are static; else None.

    A read that is itself a graph output is left: its value is the graph's signature.
    """
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Gather", "Slice") or not node.inputs:
        return None
    if node.outputs[0].is_graph_output():
        return None
    data = node.inputs[0]
    shape_node = data.producer() if data is not None else None
    if shape_node is None or shape_node.op_type != "Shape" or shape_node.inputs[0] is None:
        return None
    shape = shape_node.inputs[0].shape
    if shape is None:
        return None
    start, end = (shape_node.attributes.get_int(k, d) for k, d in (("start", 0), ("end", len(shape))))
    dims = np.array(list(shape)[slice(start, end)], dtype=object)
    args = [const_array(v) for v in node.inputs[1:]]
    if any(a is None for a, v in zip(args, node.inputs[1:]) if v is not None):
        return None
    if node.op_type == "Gather":
        if node.attributes.get_int("axis", 0) != 0 or len(args) != 1:
            return None
        index = args[0].astype(np.int64)
        if np.any(index < -len(dims)) or np.any(index >= len(dims)):
            return None
        read = dims[index]
    else:
        read = _slice(dims, *args)
        if read is None:
            return None
    read = np.asarray(read, dtype=object)
    if not all(isinstance(d, int) for d in read.ravel()):
        return None
    return np.array(read.tolist(), dtype=np.int64)


def _slice(dims: np.ndarray, starts, ends, axes=None, steps=None) -> np.ndarray | None:
    """Slice (opset 10+) of the 1-D dims, with its inputs' values."""
    if axes is not None and list(axes.ravel()) not in ([0], [-1]):
        return None
    start, end = int(starts.ravel()[0]), int(ends.ravel()[0])
    step = 1 if steps is None else int(steps.ravel()[0])
    return dims[slice(start, end, step)]
