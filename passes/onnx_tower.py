"""The output contract of an .onnx tower: one named pass pipeline, asked for by the onnx family.

An .onnx tower comes from another exporter: it is given the bundle's output contract
(passes.outputs: one `image_features` output, [CLS] dropped or kept, a named batch dim)
before any pruning pass reads it. One exported with static shapes has its run-time shape
computations folded for that shape, and under a dynamic batch those that read static dims
only (passes.shapes). The pipeline lives here, above the frontend, because its passes do; the
onnx family (compiler.frontend.onnx_tower) is handed it by the pipeline and runs it.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

from vlmprune.passes.legalize import StaticBatchPass
from vlmprune.passes.outputs import BatchDimNamePass, DropZeroAddPass, FeatureOutputPass
from vlmprune.passes.shapes import FoldStaticDimsPass
from vlmprune.passes.graph.structure import find_tower_structure


class OnnxTowerContractPass(ir.passes.InPlacePass):
    """Normalise an .onnx tower to the bundle's contract; `patch_size` is the patch Conv's kernel afterwards."""

    def __init__(self, drop_cls: bool):
        super().__init__()
        self.drop_cls = drop_cls
        self.patch_size: int | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        static = [v.shape[0] for v in model.graph.inputs
                  if v.shape is not None and all(isinstance(d, int) for d in v.shape)]
        every_static = static and len(static) == len(model.graph.inputs)
        shapes = [StaticBatchPass(static[0], "the .onnx tower")] if every_static else []
        # What the exporter left unannotated, for the rewrites below; sizes computed from static dims.
        ir.passes.Sequential(*shapes, ShapeInferencePass(), FoldStaticDimsPass(), DropZeroAddPass())(model)
        structure = find_tower_structure(model.graph)
        self.patch_size = structure.patch_size  # which the frontend cannot read without the passes' finder
        ir.passes.Sequential(FeatureOutputPass(drop_cls=self.drop_cls, num_patches=structure.num_patches),
                             RemoveUnusedNodesPass(),  # what fed only the dropped outputs (SigLIP's pooling head)
                             BatchDimNamePass())(model)
        return ir.passes.PassResult(model, modified=True)
