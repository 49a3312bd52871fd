"""Give a pruned graph the kept tokens' LLM positions: the output `kept_positions` [B, K, P] (int64).

Why: an LLM with multi-axis rotary positions (Qwen2-VL's mRoPE: (t, h, w) per image token)
must place each kept token where it sat before pruning, as TensorRT Edge-LLM does; the
patch index in `kept_indices` alone does not say that without the model's grid. The
positions of every token at the site are a constant of the static grid (the frontend's
Source.position_table), so the output is one Gather of that table by `kept_indices`, then a
Cast to int64: standard ONNX, the same on every target, and exact. The table is int32 because
QNN HTP gathers no int64 data (measured: its EP leaves such a Gather to the CPU, which the
qnn target disables); positions fit int32 by far.

The pass runs right after InsertPruningPass (with_positions puts it there in a target's
pipeline), records the layout in the model's metadata (`vlmprune.positions`), and gives
the inserted node the `select` role of the index chain. A second run changes nothing.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import KEPT_POSITIONS, POSITIONS_META
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import fresh_initializer
from vlmprune.passes.methods.builder import ROLE, SELECT
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass
from vlmprune.passes.support import TargetPipeline


def _output(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.outputs if v.name == name), None)


class KeptPositionsPass(ir.passes.InPlacePass):
    """Add `kept_positions` = int64(table[kept_indices]): table [T, P], the position of each of the site's T tokens.

    layout names the P columns (e.g. "thw"); it is recorded with T in the model's metadata.
    """

    def __init__(self, table: np.ndarray, layout: str):
        super().__init__()
        table = np.asarray(table)
        if table.ndim != 2 or table.shape[1] != len(layout) or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"positions table must be integer [T, {len(layout)}], got {table.dtype} {table.shape}")
        if table.size and np.abs(table).max() > np.iinfo(np.int32).max:
            raise ValueError("positions table values exceed int32")
        self.table, self.layout = table.astype(np.int32), layout

    def requires(self, model: ir.Model) -> None:
        kept = _output(model.graph, KEPT_INDICES)
        if kept is None or kept.producer() is None:
            raise StructureError(f"kept positions need the pruned graph's {KEPT_INDICES} output; the graph has none")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if _output(graph, KEPT_POSITIONS) is not None:
            return ir.passes.PassResult(model, modified=False)
        kept = _output(graph, KEPT_INDICES)
        table = fresh_initializer(graph, "vlmprune/positions_table", self.table)
        gather = ir.node("Gather", [table, kept], attributes={"axis": 0}, name="vlmprune/kept_positions_gather")
        cast = ir.node("Cast", [gather.outputs[0]], attributes={"to": ir.DataType.INT64},
                       name="vlmprune/kept_positions")
        for node in (gather, cast):
            node.metadata_props[ROLE] = SELECT
        graph.insert_after(kept.producer(), [gather, cast])
        gather.outputs[0].name = "vlmprune/kept_positions_int32"
        out = cast.outputs[0]
        out.name = KEPT_POSITIONS
        out.type = ir.TensorType(ir.DataType.INT64)
        out.shape = ir.Shape([*(kept.shape if kept.shape is not None else [None, None]), self.table.shape[1]])
        graph.outputs.append(out)
        model.metadata_props[POSITIONS_META] = json.dumps({"layout": self.layout, "tokens": len(self.table)})
        return ir.passes.PassResult(model, modified=True)


def with_positions(pipeline: TargetPipeline, table: np.ndarray, layout: str) -> TargetPipeline:
    """The target's pipeline with KeptPositionsPass right after its InsertPruningPass (so that its
    legalization and support check see the new output); unchanged when the pipeline inserts nothing."""
    passes = list(pipeline.passes)
    at = next((i for i, p in enumerate(passes) if isinstance(p, InsertPruningPass)), None)
    if at is None:
        return pipeline
    passes.insert(at + 1, KeptPositionsPass(table, layout))
    return TargetPipeline(pipeline.target, *passes)
