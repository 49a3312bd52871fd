"""InsertPruningPass (with the cls method) and RetargetTokenCountPass on a tiny exported CLIP tower."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods import get_method
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass, prune_record
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.passes.graph.structure import find_tower_structure
from vlmprune.targets.runtime import ort_session, run_session

CLS = get_method("cls")


def insertion(keep, layer=None, lam=0.0):
    return InsertPruningPass(CLS, CLS.parse(keep, {"lambda": lam}), layer)


def reference_pipeline(pipeline, keep, layer, lam=0.0):
    return pipeline.with_pruner(MethodPruner(CLS, CLS.parse(keep, {"lambda": lam}), "block", layer))

INSERTED_OPS = [
    "Slice", "MatMul", "Softmax", "ReduceMean", "Slice", "ReduceMax", "Max", "Div",  # [CLS]-row score (scaling is on Q and K)
    "TopK", "TopK",  # select, then indices back to raster order
    "Slice", "Unsqueeze", "GatherND",  # gather kept patches
    "Shape", "ConstantOfShape", "Shape", "ConstantOfShape", "ScatterElements", "Mul", "Unsqueeze", "MatMul",  # summary
    "Slice", "Concat",
]


def _prune(path, keep, layer, lam=0.0):
    model = ir.load(path)
    result = insertion(keep, layer, lam)(model)
    retarget = RetargetTokenCountPass()(result.model)
    return result, retarget


def test_structure_finds_every_block(tiny_dense_path, tiny_source):
    structure = find_tower_structure(ir.load(tiny_dense_path).graph)
    assert len(structure.blocks) == tiny_source.num_blocks == 3  # a bare tower's feature layer is its last
    assert structure.patch_size == 14 and structure.grid == (8, 8)
    assert [b.index for b in structure.blocks] == [1, 2, 3]
    assert all(b.softmax is not None and b.k_transposed for b in structure.blocks)
    assert all(b.q.producer().op_type == "Mul" for b in structure.blocks)  # scaling sits on Q and K (SDPA export)
    assert structure.blocks[0].scale == 1.0  # nothing between Q·Kᵀ and the Softmax


def test_inserted_ops_roles_record_and_checker(tiny_dense_path):
    result, retarget = _prune(tiny_dense_path, keep=16, layer=1)
    assert result.modified
    inserted = [n for n in result.model.graph if n.name and n.name.startswith("vlmprune/cls_L1/")]
    assert [n.op_type for n in inserted] == INSERTED_OPS
    roles = [n.metadata_props["vlmprune.role"] for n in inserted]
    assert roles == ["score"] * 8 + ["select"] * 2 + ["tokens"] * 13
    record = prune_record(result.model)
    assert (record.method, record.layer, record.tokens_in, record.tokens_out) == ("cls", 1, 65, 18)
    assert retarget.modified  # the exporter baked 65 tokens into later Reshapes
    assert not RetargetTokenCountPass()(result.model).modified  # nothing left on a second run
    assert not insertion(16, 1)(result.model).modified  # the same pruning, already in place
    with pytest.raises(StructureError, match="already pruned"):
        insertion(12, 1)(result.model)
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output][-1] == KEPT_INDICES
    assert {p.key for p in proto.metadata_props} == {"vlmprune.prune"}  # the record survives serialisation


def test_no_stale_token_count_downstream(tiny_dense_path):
    result, _ = _prune(tiny_dense_path, keep=16, layer=1)
    graph = result.model.graph
    site = next(n for n in graph if n.op_type == "Concat" and n.name.endswith("/tokens"))
    from vlmprune.passes.graph.dataflow import consumers_downstream

    for node in consumers_downstream(site.outputs[0]):
        for value in node.inputs:
            tensor = ir.convenience.get_const_tensor(value) if value is not None else None
            if tensor is not None and tensor.dtype == ir.DataType.INT64 and tensor.size <= 8:
                assert 65 not in tensor.numpy().reshape(-1).tolist(), node


@pytest.mark.parametrize("layer,lam,batch", [(1, 0.0, 1), (2, 0.5, 3)])
def test_numbers_match_reference_pruner(tiny_dense_path, tiny_source, layer, lam, batch):
    keep = 20
    result, _ = _prune(tiny_dense_path, keep, layer, lam)
    session = ort_session(ir.to_proto(result.model).SerializeToString())
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 3, 112, 112)).astype(np.float32))
    out = run_session(session, x.numpy())
    with torch.no_grad():
        feats, kept = reference_pipeline(tiny_source.pipeline, keep, layer, lam)(x)
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert np.all(np.diff(out[KEPT_INDICES], axis=1) > 0)  # raster order
    assert out["image_features"].shape == (batch, keep + 1, 32)  # select strategy drops [CLS]
    np.testing.assert_allclose(out["image_features"], feats.numpy(), atol=1e-5, rtol=1e-4)


def test_tie_rule_on_identical_tokens(tiny_source, tmp_path):
    """Constant image and no position embedding: every patch token is equal, so the graph's scores tie exactly
    (ONNX Runtime computes every patch's row alike) and its TopK keeps the lowest indices. PyTorch's CPU kernels
    need not: on some CPUs the last patch's score comes out an ulp higher (its GEMM tail), so the reference is held
    to the same rule where its own scores tie, and its selection to the rule on exactly tied scores."""
    from vlmprune.passes.methods.selection import select_topk

    from vlmprune.compiler.frontend import export_onnx

    pipe = tiny_source.pipeline.with_pruner(None)
    saved = pipe.vision_model.embeddings.position_embedding.weight.detach().clone()
    try:
        with torch.no_grad():
            pipe.vision_model.embeddings.position_embedding.weight.zero_()
        path = tmp_path / "tie.onnx"
        ir.save(export_onnx(pipe, 112, None, 18), path)
        x = torch.full((2, 3, 112, 112), 0.25)
        with torch.no_grad():
            _, kept_ref = reference_pipeline(pipe, 10, 1)(x)
        result, _ = _prune(path, 10, 1)
        out = run_session(ort_session(ir.to_proto(result.model).SerializeToString()), x.numpy())
    finally:
        with torch.no_grad():
            pipe.vision_model.embeddings.position_embedding.weight.copy_(saved)
    expected = np.tile(np.arange(10), (2, 1))
    np.testing.assert_array_equal(out[KEPT_INDICES], expected)
    np.testing.assert_array_equal(select_topk(torch.ones(2, 64), 10).numpy(), expected)
    ref = kept_ref.numpy()  # the lowest indices but for those patches whose score came out above the tie
    assert all(set(range(10 - len(set(r) - set(range(10))))) <= set(r) for r in ref), ref


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
        insertion(2)(model)


@pytest.mark.parametrize("keep,layer,error,message", [(64, 1, InputError, "keep must satisfy"),
                                                      (8, 4, StructureError, "out of range")])
def test_negative_bad_config(tiny_dense_path, keep, layer, error, message):
    with pytest.raises(error, match=message):
        insertion(keep, layer)(ir.load(tiny_dense_path))


def test_negative_keep_zero_is_refused_by_the_method():
    with pytest.raises(InputError, match="--keep must be an integer >= 1"):
        CLS.parse(0, {})


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
    result, _ = _prune(path, 20, 2, 0.5)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 112, 112)).astype(np.float32))
    out = run_session(ort_session(ir.to_proto(result.model).SerializeToString()), x.numpy())
    with torch.no_grad():
        feats, kept = reference_pipeline(tiny_source.pipeline, 20, 2, 0.5)(x)
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    np.testing.assert_allclose(out["image_features"], feats.numpy(), atol=1e-5, rtol=1e-4)


def test_insertion_ensures_the_kept_output_and_the_token_count(tiny_dense_path):
    """The post-conditions hold on the pruned tower and fail, as a bug (PostconditionError), on broken copies."""
    result, _ = _prune(tiny_dense_path, keep=16, layer=1)
    model, check = result.model, insertion(16, 1)
    check.ensures(model)
    tokens = next(v for n in model.graph for v in n.outputs if "vlmprune.tokens" in v.metadata_props)
    tokens.shape = ir.Shape([tokens.shape[0], 65, tokens.shape[2]])  # the count before pruning
    with pytest.raises(ir.passes.PostconditionError, match=r"holds 65 tokens, the record 18"):
        check.ensures(model)
    model.graph.outputs.remove(model.graph.outputs[-1])  # kept_indices
    with pytest.raises(ir.passes.PostconditionError, match=r"^no graph output kept_indices \[B, 16\] int64"):
        check.ensures(model)


def test_retarget_ensures_the_count_reaches_the_output(tiny_dense_path):
    _, retarget = _prune(tiny_dense_path, keep=16, layer=1)
    model = retarget.model
    RetargetTokenCountPass().ensures(model)
    out = model.graph.outputs[0]
    assert out.shape[1] == 17  # 16 kept + the summary token; the tower drops [CLS] after the site
    out.shape = ir.Shape([out.shape[0], 65, out.shape[2]])  # what a baked count the pass missed leaves
    with pytest.raises(ir.passes.PostconditionError,
                       match=r"^the token output .* holds 65 tokens after block 1, the insertion 18$"):
        RetargetTokenCountPass().ensures(model)
