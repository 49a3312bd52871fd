"""Legalize the pruned tower for rknn-toolkit2 2.5.0 (RK3588 NPU).

What the toolkit needs, and why each pass is here (measured with 2.5.0's simulator on
the demo tower; parity figures in targets/rk3588.py):

- ONNX opset <= 19: the toolkit's ONNX frontend reads opsets 12 to 19. Down-converting
  is not offered: opset 20+ exports hold Gelu (20) and Attention (23), which have no
  previous version; the target's support check (rknn_model_support) refuses them in one line.
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

from vlmprune.passes.graph.dataflow import is_default_domain, opset
from vlmprune.passes.legalize import FoldCastLikePass, GatherNDToGatherPass, OneHotSelectionPass, StaticBatchPass

RKNN_MAX_OPSET = 19
TARGET = "rk3588 (rknn-toolkit2 2.5.0)"


def rknn_support(node: ir.Node) -> tuple[bool, str]:
    """rknn-toolkit2 converts standard ONNX ops only (what its NPU lacks runs on its CPU)."""
    if is_default_domain(node):
        return True, ""
    return False, f"{TARGET} runs standard ONNX ops only"


def rknn_model_support(model: ir.Model) -> list[str]:
    """What rknn-toolkit2 2.5.0 needs of the whole graph: opset <= 19, static shapes, batch 1."""
    reasons = []
    version = opset(model)
    if version > RKNN_MAX_OPSET:
        reasons.append(f"it reads ONNX opset <= {RKNN_MAX_OPSET}, and this graph is opset {version}: compile with "
                       f"--opset {RKNN_MAX_OPSET} or lower (the default, 18, works)")
    for value in [*model.graph.inputs, *model.graph.outputs]:
        shape = value.shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            reasons.append(f"it needs static shapes: {value.name!r} is {None if shape is None else list(shape)}")
        elif len(shape) and shape[0] != 1:
            reasons.append(f"it runs batch 1, but {value.name!r} has batch {shape[0]}")
    return reasons


def rknn_legalization(selection: str = "onehot") -> list[ir.passes.PassBase]:
    """The passes from the decomposed graph to the one rknn-toolkit2 converts, in order."""
    if selection not in ("gather", "onehot"):
        raise ValueError(f"selection must be 'gather' or 'onehot', not {selection!r}")
    select = [GatherNDToGatherPass()] if selection == "gather" else [OneHotSelectionPass()]
    return [StaticBatchPass(1, TARGET), FoldCastLikePass(), *select, RemoveUnusedNodesPass(), TopologicalSortPass()]
