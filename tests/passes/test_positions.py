"""KeptPositionsPass on a tiny graph built in code: one Gather of the position table, exact, checked, idempotent."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.builder import ROLE, SELECT
from vlmprune.passes.positions import KEPT_POSITIONS, POSITIONS_META, KeptPositionsPass, with_positions
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass
from vlmprune.passes.support import TargetPipeline
from vlmprune.targets.runtime import ort_session, run_session

TOKENS, KEEP = 9, 4
TABLE = np.stack([np.zeros(TOKENS, np.int64), np.arange(TOKENS) // 3, np.arange(TOKENS) % 3], axis=1)


def _pruned_graph(tmp_path) -> ir.Model:
    """scores [B, T] -> TopK -> kept_indices [B, K] (the tail of a pruned graph)."""
    text = f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[batch, {TOKENS}] scores) => (int64[batch, {KEEP}] {KEPT_INDICES}) {{
        k = Constant <value = int64[1] {{{KEEP}}}> ()
        values, {KEPT_INDICES} = TopK <axis = -1> (scores, k)
    }}
    """
    return ir.from_proto(onnx.parser.parse_model(text))


def test_adds_one_exact_gather(tmp_path):
    model = _pruned_graph(tmp_path)
    result = KeptPositionsPass(TABLE, "thw")(model)
    assert result.modified
    assert [n.op_type for n in model.graph] == ["Constant", "TopK", "Gather", "Cast"]
    gather, cast = list(model.graph)[-2:]
    assert gather.inputs[1] is model.graph.outputs[0] and cast.inputs[0] is gather.outputs[0]
    assert gather.metadata_props[ROLE] == cast.metadata_props[ROLE] == SELECT
    out = model.graph.outputs[1]
    assert out.name == KEPT_POSITIONS and list(out.shape) == ["batch", KEEP, 3] and out.dtype == ir.DataType.INT64
    assert json.loads(model.metadata_props[POSITIONS_META]) == {"layout": "thw", "tokens": TOKENS}
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    scores = np.random.default_rng(0).standard_normal((3, TOKENS)).astype(np.float32)
    got = run_session(ort_session(path), scores)
    np.testing.assert_array_equal(got[KEPT_POSITIONS], TABLE[got[KEPT_INDICES]])
    assert not KeptPositionsPass(TABLE, "thw")(model).modified  # a second run changes nothing


def test_refuses_a_graph_without_kept_indices():
    model = ir.from_proto(onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 3] x) => (float[2, 3] y) { y = Relu(x) }
    """))
    with pytest.raises(StructureError, match="kept_indices"):
        KeptPositionsPass(TABLE, "thw")(model)
    with pytest.raises(ValueError, match="integer"):
        KeptPositionsPass(TABLE.astype(np.float32), "thw")


def test_with_positions_runs_right_after_the_insertion():
    method = get_method("dart")
    insert = InsertPruningPass(method, method.parse(KEEP, {}))
    pipeline = with_positions(TargetPipeline("t", insert, RemoveUnusedNodesPass()), TABLE, "thw")
    assert pipeline.names == ["InsertPruningPass", "KeptPositionsPass", "RemoveUnusedNodesPass"]
    dense = TargetPipeline("t", RemoveUnusedNodesPass())
    assert with_positions(dense, TABLE, "thw") is dense  # nothing pruned, no positions
