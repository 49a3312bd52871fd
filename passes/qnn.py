"""Legalize the pruned tower for Qualcomm HTP through ONNX Runtime's QNN EP.

What HTP needs before quantization, and why each pass is here (onnxruntime-qnn 2.7.0,
QNN 2.x HTP emulator, CPU fallback disabled, see targets/qnn.py):

- static shapes: a QNN context binary is compiled for one shape
  (passes.legalize.StaticBatchPass; the batch is --batch, or 1 when it is dynamic).
- GatherND with batch_dims=1 does not validate on HTP (QNN error 3110, left to the CPU
  EP): rewritten to Gather / GatherElements, which run on HTP
  (passes.legalize.GatherNDToGatherPass).
- constant Gather indices must be >= 0 (PositiveGatherIndicesPass).
- CastLike: folded like for every target (passes.legalize.FoldCastLikePass).
- every node named: quantizer exclusions and placement rows go by node name (NameFixPass).

The one legalization that only exists after quantization, no MatMul of two 16-bit
activations, is applied and checked by targets.qnn_tools (quantize_qdq, check_qdq).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass, RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import fresh_initializer, is_default_domain
from vlmprune.passes.legalize import FoldCastLikePass, GatherNDToGatherPass, OneHotSelectionPass, StaticBatchPass

TARGET = "qnn (QNN HTP)"


class PositiveGatherIndicesPass(ir.passes.InPlacePass):
    """Constant negative Gather indices -> the same positions counted from the front.

    Why: QNN HTP's Gather reads indices as unsigned positions; ONNX allows -1 for "last".
    Runtime indices cannot be checked here (the pruning subgraph's come from TopK and are
    non-negative by construction).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewritten = 0
        for node in model.graph:
            if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
                continue
            data, idx = node.inputs
            tensor = ir.convenience.get_const_tensor(idx)
            if tensor is None:
                continue
            indices = tensor.numpy()
            if not (indices < 0).any():
                continue
            axis = node.attributes.get_int("axis", 0)
            size = None if data.shape is None else data.shape[axis]
            if not isinstance(size, int):
                raise StructureError(f"Gather {node.name!r} has negative indices on an axis of unknown size")
            fixed = np.where(indices < 0, indices + size, indices).astype(indices.dtype)
            if idx.is_initializer() and len(idx.uses()) == 1:
                idx.const_value = ir.tensor(fixed, name=idx.name)
            else:  # shared with other consumers: this Gather gets its own copy
                node.replace_input_with(1, fresh_initializer(model.graph, f"{idx.name or node.name}_positive", fixed))
            rewritten += 1
        return ir.passes.PassResult(model, modified=rewritten > 0)


def htp_support(node: ir.Node) -> tuple[bool, str]:
    """What HTP cannot compile: custom-domain nodes, GatherND with batch_dims (QNN error 3110)."""
    if not is_default_domain(node):
        return False, f"{TARGET} runs standard ONNX ops only"
    if node.op_type == "GatherND" and node.attributes.get_int("batch_dims", 0):
        return False, "GatherND with batch_dims has no HTP kernel (GatherNDToGatherPass rewrites it)"
    if node.op_type == "Loop":
        return False, "HTP compiles no control flow (a Loop): use a formulation without it"
    return True, ""


def htp_model_support(model: ir.Model) -> list[str]:
    """A QNN context binary is compiled for one shape: every input and output static."""
    return [f"it needs static shapes: {v.name!r} is {None if v.shape is None else list(v.shape)}"
            for v in [*model.graph.inputs, *model.graph.outputs]
            if v.shape is None or not all(isinstance(d, int) for d in v.shape)]


def htp_legalization(batch: int = 1, selection: str = "gather") -> list[ir.passes.PassBase]:
    """The passes from the decomposed graph to the float graph that is quantized for HTP."""
    if selection not in ("gather", "onehot"):
        raise ValueError(f"selection must be 'gather' or 'onehot', not {selection!r}")
    select = GatherNDToGatherPass() if selection == "gather" else OneHotSelectionPass()
    return [StaticBatchPass(batch, TARGET), FoldCastLikePass(), select, PositiveGatherIndicesPass(),
            RemoveUnusedNodesPass(), TopologicalSortPass(), NameFixPass()]
