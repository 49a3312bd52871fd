"""Legalize the pruned tower for rknn-toolkit2 2.5.0 (RK3588 NPU).

What the toolkit needs, and why each pass is here (measured with 2.5.0's simulator on
the demo tower; parity figures in targets/rk3588.py):

- ONNX opset <= 19: the toolkit's ONNX frontend reads opsets 12 to 19. Down-converting
  is not offered: opset 20+ exports hold Gelu (20) and Attention (23), which have no
  previous version; RknnSupportCheckPass refuses them in one line.
- static shapes, batch 1: .rknn models are compiled for one shape; the op table limits
  Softmax, Slice and Tile to batch 1 (passes.legalize.StaticBatchPass).
- CastLike: not in the op table; 2.5.0 keeps each one as a CPU layer
  (passes.legalize.FoldCastLikePass).
- the selection: GatherND is not in the op table (2.5.0 runs it on the CPU). Of the two
  standard-op forms, Gather (passes.legalize.GatherNDToGatherPass) and a one-hot MatMul
  (passes.legalize.OneHotSelectionPass), the one-hot form is the default here, chosen by
  measurement (demo tower, pruning after block 2 and after the last block, fp16 and hybrid
  int8, 2.5.0 simulator): the Gather lands on the CPU between two NPU layers, a CPU island
  (an NPU -> CPU -> NPU round trip) of its own, and the mask's ScatterElements is one more
  CPU layer in the TopK island; the one-hot form leaves one CPU layer (Equal, in the TopK
  island) and runs its
  Cast, MatMul, ReduceSum and Sub on the NPU: CPU layers 10 -> 9 and CPU islands 6 -> 5
  (after block 2; 8 -> 7 and 4 -> 3 after the last block), kept-index agreement identical,
  cosine identical in fp16 and within 1.5e-4 in int8. Its cost, a K x N x D MatMul, is
  0.8% of the tower's estimated NPU cycles on the demo.
- Softmax axis: 2.5.0 puts Softmax on the NPU on any axis (ranks 2 to 4 measured; the
  toolkit inserts its own Transposes), so no rewrite is needed beyond batch 1.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.legalize import FoldCastLikePass, GatherNDToGatherPass, OneHotSelectionPass, StaticBatchPass

RKNN_MAX_OPSET = 19
TARGET = "rk3588 (rknn-toolkit2 2.5.0)"


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


class RknnSupportCheckPass(ir.passes.InPlacePass):
    """Refuse, in one line, a graph rknn-toolkit2 2.5.0 cannot load: opset > 19, dynamic
    shapes, a batch other than 1, or a custom-domain node. Changes nothing.
    """

    def requires(self, model: ir.Model) -> None:
        opset = _opset(model)
        if opset > RKNN_MAX_OPSET:
            raise StructureError(f"{TARGET} reads ONNX opset <= {RKNN_MAX_OPSET}, and this graph is opset {opset}: "
                                 f"compile with --opset {RKNN_MAX_OPSET} or lower (the default, 18, works)")
        for value in [*model.graph.inputs, *model.graph.outputs]:
            shape = value.shape
            if shape is None or not all(isinstance(d, int) for d in shape):
                raise StructureError(f"{TARGET} needs static shapes: {value.name!r} is "
                                     f"{None if shape is None else list(shape)}")
            if len(shape) and shape[0] != 1:
                raise StructureError(f"{TARGET} runs batch 1, but {value.name!r} has batch {shape[0]}")
        custom = sorted({f"{n.domain}.{n.op_type}" for n in model.graph if n.domain not in ("", "ai.onnx")})
        if custom:
            raise StructureError(f"{TARGET} runs standard ONNX ops only; the graph holds {', '.join(custom)}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=False)


def rknn_legalization(selection: str = "onehot") -> list[ir.passes.PassBase]:
    """The passes from the decomposed graph to the one rknn-toolkit2 converts, in order."""
    if selection not in ("gather", "onehot"):
        raise ValueError(f"selection must be 'gather' or 'onehot', not {selection!r}")
    select = [GatherNDToGatherPass()] if selection == "gather" else [OneHotSelectionPass()]
    return [StaticBatchPass(1, TARGET), FoldCastLikePass(), *select, RemoveUnusedNodesPass(),
            TopologicalSortPass(), RknnSupportCheckPass()]
