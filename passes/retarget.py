"""Rewrite the token count an exporter baked into the graph downstream of the pruning point.

Exporters bake the token count into Reshape targets ([-1, 577, H, dh]), Expand and
Slice bounds, and sometimes share one constant between blocks before and after the
pruning point. After InsertPruningPass at block L, every later block runs on fewer
tokens, so each such constant downstream of the new tokens (found through the
`vlmprune.tokens` metadata the insertion recorded, never by names) is replaced by a
fresh copy with the new count, given to that consumer only. Shape vectors built at run
time as Concat(batch, 577, H, dh) get a fresh Concat of retargeted pieces.

A method that runs the later blocks on a layout of its own (Method.later_blocks: a clip's frames
flattened into one sequence) marks a batch change on its tokens ("F,1", BATCH_META): a retargeted
shape constant that leads with the old batch leads with the new one ([F, 577, H, dh] -> [1, T, H, dh]);
and where it gives the tail the dense layout back (RESTORED_META), the reach of the sites upstream
ends: the tail's constants hold the dense counts already.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.passes.graph.dataflow import const_array, consumers_downstream, fresh_initializer
from vlmprune.passes.methods.base import BLOCK
from vlmprune.passes.outputs import token_output
from vlmprune.compiler.contract import BATCH_META, RESTORED_META
from vlmprune.passes.prune import TOKENS_META, prune_record
from vlmprune.passes.graph.structure import static_dim

# Inputs that carry shapes or token positions, by op type: a constant there that
# equals the old token count is the token count.
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Slice": (1, 2), "Tile": (1,), "Range": (1,)}


class RetargetTokenCountPass(ir.passes.InPlacePass):
    """Give every downstream shape constant that holds the old token count its own copy with the new one.

    modified is true only when a constant was rewritten: a second run finds nothing left.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        rewritten = 0
        sites = [v for node in graph for v in node.outputs if TOKENS_META in v.metadata_props]
        restored = [v for node in graph for v in node.outputs if RESTORED_META in v.metadata_props]
        tail = {**consumers_downstream(*restored), **{v.producer(): None for v in restored}} if restored else {}
        for value in sites:
            old, new = (int(x) for x in value.metadata_props[TOKENS_META].split(","))
            batch = value.metadata_props.get(BATCH_META)
            batch = tuple(int(x) for x in batch.split(",")) if batch else None
            if old != new:
                for node in list(consumers_downstream(value)):
                    if node not in tail:
                        rewritten += self._retarget_node(graph, node, old, new, batch)
        if sites:  # the insertion left the shapes downstream unknown: infer them with the new counts
            ShapeInferencePass()(model)
        return ir.passes.PassResult(model, modified=rewritten > 0)

    def ensures(self, model: ir.Model) -> None:
        """The token count agrees from the pruning point down to the output: the graph's token output holds the
        record's tokens_out, or that less the [CLS]/register prefix a tower drops after the site. A count left
        unknown or old (a baked count this pass did not find) is a vlmprune bug, caught here and not on a device."""
        record = prune_record(model)
        if record is None or record.site != BLOCK:
            return
        out = token_output(model.graph)
        count, want = static_dim(out, 1), record.tokens_out
        if TOKENS_META in out.metadata_props:  # the method set the output's count itself (Method.later_blocks)
            want = int(out.metadata_props[TOKENS_META].split(",")[1])
        if count not in (want, want - record.prefix):
            raise ir.passes.PostconditionError(f"the token output {out.name} holds {count} tokens after block "
                                               f"{record.layer}, the insertion {want}")

    def _retarget_node(self, graph: ir.Graph, node: ir.Node, old: int, new: int, batch=None) -> int:
        count = 0
        for idx in _SHAPE_INPUTS.get(node.op_type, ()):
            if idx < len(node.inputs) and node.inputs[idx] is not None:
                fixed = self._retarget_value(graph, node.inputs[idx], node, old, new, batch)
                if fixed is not node.inputs[idx]:
                    node.replace_input_with(idx, fixed)
                    count += 1
        return count

    def _retarget_value(self, graph: ir.Graph, value: ir.Value, consumer: ir.Node, old: int, new: int,
                        batch: tuple[int, int] | None = None) -> ir.Value:
        """value with `old` replaced by `new`: a fresh constant, or a fresh Concat of retargeted pieces.

        Nothing existing is modified (the value may be shared with blocks before the pruning
        point): the consumer gets its own copy.
        """
        values = const_array(value)
        if values is not None:
            if values.dtype.kind != "i" or values.ndim > 1 or old not in values.reshape(-1):
                return value
            fixed = np.where(values == old, new, values).astype(values.dtype)
            if batch is not None and consumer.op_type in ("Reshape", "Expand") and fixed.size > 2 \
                    and fixed[0] == batch[0]:
                fixed[0] = batch[1]  # the later blocks' batch: the method's own layout (BATCH_META)
            return fresh_initializer(graph, f"{value.name}_retok{new}", fixed)
        producer = value.producer()
        if producer is None or producer.op_type != "Concat":
            return value
        pieces = [self._retarget_value(graph, v, consumer, old, new) for v in producer.inputs]  # batch: Shape-read
        if all(p is v for p, v in zip(pieces, producer.inputs)):
            return value
        concat = ir.node("Concat", pieces, attributes={"axis": producer.attributes.get_int("axis", 0)},
                         name=f"{producer.name}_retok{new}")
        concat.outputs[0].name = f"{value.name}_retok{new}_{consumer.name}"
        concat.outputs[0].type = value.type
        graph.insert_before(consumer, concat)
        return concat.outputs[0]
