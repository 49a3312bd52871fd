"""InsertTokenPrunePass and RetargetTokenCountPass on a tiny exported CLIP tower."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.errors import StructureError
from vlmprune.compiler.frontend import PruneSpec
from vlmprune.compiler.runtime import ort_session, run_session
from vlmprune.passes.structure import find_tower_structure
from vlmprune.passes.token_prune import KEPT_INDICES, InsertTokenPrunePass, PruneConfig, RetargetTokenCountPass

INSERTED_OPS = [
    "Slice", "MatMul", "Softmax", "ReduceMean", "Slice", "ReduceMax", "Max", "Div",  # [CLS]-row score (scaling is on Q and K)
    "TopK", "TopK",  # select, then indices back to raster order
    "Slice", "Unsqueeze", "GatherND",  # gather kept patches
    "Shape", "ConstantOfShape", "Shape", "ConstantOfShape", "ScatterElements", "Mul", "Unsqueeze", "MatMul",  # summary
    "Slice", "Concat",
]


def _prune(path, keep, layer, lam=0.0):
    model = ir.load(path)
    insert = InsertTokenPrunePass(PruneConfig(keep, layer, lam))
    result = insert(model)
    retarget = RetargetTokenCountPass()
    retarget(result.model)
    return result, insert, retarget


def test_structure_finds_every_block(tiny_dense_path, tiny_source):
    structure = find_tower_structure(ir.load(tiny_dense_path).graph)
    assert len(structure.blocks) == tiny_source.num_blocks == 3  # a bare tower's feature layer is its last
    assert structure.patch_size == 14 and structure.grid == (8, 8)
    assert [b.index for b in structure.blocks] == [1, 2, 3]
    assert all(b.softmax is not None and b.k_transposed for b in structure.blocks)
    assert all(b.q.producer().op_type == "Mul" for b in structure.blocks)  # scaling sits on Q and K (SDPA export)
    assert structure.blocks[0].scale == 1.0  # nothing between Q·Kᵀ and the Softmax


def test_inserted_ops_and_checker(tiny_dense_path):
    result, insert, retarget = _prune(tiny_dense_path, keep=16, layer=1)
    assert result.modified
    new_ops = [n.op_type for n in result.model.graph if n.name and n.name.startswith("vlmprune/prune_L1/")]
    assert new_ops == INSERTED_OPS
    assert insert.site.tokens_in == 65 and insert.site.tokens_out == 18
    assert retarget.rewritten > 0  # the exporter baked 65 tokens into later Reshapes
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output][-1] == KEPT_INDICES


def test_no_stale_token_count_downstream(tiny_dense_path):
    result, _, _ = _prune(tiny_dense_path, keep=16, layer=1)
    graph = result.model.graph
    site = next(n for n in graph if n.op_type == "Concat" and n.name.endswith("/tokens"))
    from vlmprune.passes.dataflow import consumers_downstream

    for node in consumers_downstream(site.outputs[0]):
        for value in node.inputs:
            tensor = ir.convenience.get_const_tensor(value) if value is not None else None
            if tensor is not None and tensor.dtype == ir.DataType.INT64 and tensor.size <= 8:
                assert 65 not in tensor.numpy().reshape(-1).tolist(), node


@pytest.mark.parametrize("layer,lam,batch", [(1, 0.0, 1), (2, 0.5, 3)])
def test_numbers_match_reference_pruner(tiny_dense_path, tiny_source, layer, lam, batch):
    keep = 20
    result, _, _ = _prune(tiny_dense_path, keep, layer, lam)
    session = ort_session(ir.to_proto(result.model).SerializeToString())
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 3, 112, 112)).astype(np.float32))
    out = run_session(session, x.numpy())
    with torch.no_grad():
        feats, kept = tiny_source.pipeline.with_prune(PruneSpec(keep, layer, lam))(x)
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert np.all(np.diff(out[KEPT_INDICES], axis=1) > 0)  # raster order
    assert out["image_features"].shape == (batch, keep + 1, 32)  # select strategy drops [CLS]
    np.testing.assert_allclose(out["image_features"], feats.numpy(), atol=1e-5, rtol=1e-4)


def test_tie_rule_on_identical_tokens(tiny_source, tmp_path):
    """Constant image and no position embedding: every patch token is equal, so scores tie exactly."""
    from vlmprune.compiler.frontend import export_onnx

    pipe = tiny_source.pipeline.with_prune(None)
    saved = pipe.vision_model.embeddings.position_embedding.weight.detach().clone()
    try:
        with torch.no_grad():
            pipe.vision_model.embeddings.position_embedding.weight.zero_()
        path = tmp_path / "tie.onnx"
        ir.save(export_onnx(pipe, 112, None, 18), path)
        x = torch.full((2, 3, 112, 112), 0.25)
        with torch.no_grad():
            _, kept_ref = pipe.with_prune(PruneSpec(10, 1, 0.0))(x)
        result, _, _ = _prune(path, 10, 1)
        out = run_session(ort_session(ir.to_proto(result.model).SerializeToString()), x.numpy())
    finally:
        with torch.no_grad():
            pipe.vision_model.embeddings.position_embedding.weight.copy_(saved)
    expected = np.tile(np.arange(10), (2, 1))
    np.testing.assert_array_equal(kept_ref.numpy(), expected)
    np.testing.assert_array_equal(out[KEPT_INDICES], expected)


def test_negative_no_attention_graph():
    model = ir.from_onnx_text(
        """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[1, 5, 4] x) => (float[1, 5, 4] y) {
            y = Relu(x)
        }
        """
    )
    with pytest.raises(StructureError, match="no attention block found"):
        InsertTokenPrunePass(PruneConfig(2))(model)


@pytest.mark.parametrize("keep,layer,message", [(64, 1, "keep must satisfy"), (0, 1, "keep must satisfy"),
                                                (8, 4, "out of range")])
def test_negative_bad_config(tiny_dense_path, keep, layer, message):
    with pytest.raises(StructureError, match=message):
        InsertTokenPrunePass(PruneConfig(keep, layer))(ir.load(tiny_dense_path))


def test_retarget_is_noop_without_pruning(tiny_dense_path):
    assert not RetargetTokenCountPass()(ir.load(tiny_dense_path)).modified


def test_onnx_attention_op_blocks(tiny_source, tmp_path):
    """Opset 23 exports ONNX's Attention op: the pass reads Q, K and its scale attribute."""
    from vlmprune.compiler.frontend import export_onnx

    path = tmp_path / "attn23.onnx"
    ir.save(export_onnx(tiny_source.pipeline, 112, None, 23), path)
    structure = find_tower_structure(ir.load(path).graph)
    assert [b.attention.op_type for b in structure.blocks] == ["Attention"] * 3
    assert not structure.blocks[0].k_transposed and structure.blocks[0].scale == pytest.approx(16 ** -0.5)
    result, _, _ = _prune(path, 20, 2, 0.5)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 112, 112)).astype(np.float32))
    out = run_session(ort_session(ir.to_proto(result.model).SerializeToString()), x.numpy())
    with torch.no_grad():
        feats, kept = tiny_source.pipeline.with_prune(PruneSpec(20, 2, 0.5))(x)
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    np.testing.assert_allclose(out["image_features"], feats.numpy(), atol=1e-5, rtol=1e-4)
