"""The bundle's output contract for towers exported elsewhere: one `image_features` output, [CLS] as asked.

Why: a Hugging Face source is exported by vlmprune itself, with outputs named
`image_features` (and `kept_indices`) and [CLS] dropped or kept by the model's select
strategy. An .onnx tower exported elsewhere has its own names (`last_hidden_state`,
`pooler_output`, ...), keeps [CLS], and its exporter's dimension names. Every bundle
must look the same to the code that consumes it, so the tower's token output is
renamed, [CLS] is sliced off unless the user keeps it, other outputs are dropped, and
the batch dimension is called `batch` on every input and output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.dataflow import fresh_initializer

FEATURES = "image_features"
BATCH_DIM = "batch"
_INT64_MAX = np.iinfo(np.int64).max


def token_output(graph: ir.Graph) -> ir.Value:
    """The tower's token output: the first rank-3 graph output [B, T, D]."""
    for value in graph.outputs:
        if value.shape is not None and len(value.shape) == 3:
            return value
    names = ", ".join(f"{v.name} {None if v.shape is None else list(v.shape)}" for v in graph.outputs)
    raise StructureError(f"the tower has no token output [B, T, D] (outputs: {names})")


class FeatureOutputPass(ir.passes.InPlacePass):
    """Keep only the token output, drop [CLS] from it if asked, and name it `image_features`.

    num_patches is the patch grid's size; the token count tells whether the tower has a
    [CLS] token (T = N + 1) or not (T = N). has_cls is recorded on the output's meta.
    """

    def __init__(self, drop_cls: bool, num_patches: int | None):
        super().__init__()
        self.drop_cls = drop_cls
        self.num_patches = num_patches

    def requires(self, model: ir.Model) -> None:
        out = token_output(model.graph)
        tokens = out.shape[1]
        if self.drop_cls and not isinstance(tokens, int):
            raise StructureError(f"output {out.name} has no static token count: {list(out.shape)}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        out = token_output(graph)
        modified = len(graph.outputs) != 1 or out.name != FEATURES
        tokens = out.shape[1]
        has_cls = isinstance(tokens, int) and self.num_patches is not None and tokens == self.num_patches + 1
        graph.outputs.clear()
        if self.drop_cls and has_cls:
            producer = out.producer()
            starts = fresh_initializer(graph, "vlmprune/drop_cls_starts", np.array([1], np.int64))
            ends = fresh_initializer(graph, "vlmprune/drop_cls_ends", np.array([_INT64_MAX], np.int64))
            axes = fresh_initializer(graph, "vlmprune/drop_cls_axes", np.array([1], np.int64))
            node = ir.node("Slice", [out, starts, ends, axes], name="vlmprune/drop_cls")
            if producer is not None:
                graph.insert_after(producer, node)
            else:
                graph.append(node)
            new = node.outputs[0]
            new.type, new.shape = out.type, ir.Shape([out.shape[0], tokens - 1, out.shape[2]])
            out = new
            modified = True
        if out.name != FEATURES:
            if FEATURES in {v.name for v in graph.inputs}:
                raise StructureError(f"the tower has an input named {FEATURES}")
            for node in graph:  # a value of that name elsewhere in the graph keeps it unique
                for value in node.outputs:
                    if value.name == FEATURES and value is not out:
                        value.name = f"{FEATURES}.inner"
            out.name = FEATURES
        out.meta["vlmprune.has_cls"] = has_cls and not self.drop_cls
        graph.outputs.append(out)
        return ir.passes.PassResult(model, modified=modified)


class BatchDimNamePass(ir.passes.InPlacePass):
    """Name a dynamic leading dimension `batch` on every graph input and output.

    Shape inference invents names (`unk__29`, `s0`) for what is one batch dimension;
    a consumer reading the manifest should see one name for it everywhere.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for value in [*model.graph.inputs, *model.graph.outputs]:
            shape = value.shape
            if shape is None or len(shape) == 0 or isinstance(shape[0], int):
                continue
            if str(shape[0]) != BATCH_DIM:
                value.shape = ir.Shape([BATCH_DIM, *shape[1:]])
                modified = True
        return ir.passes.PassResult(model, modified=modified)
