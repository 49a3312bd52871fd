"""tome: the schedule, the reference against the official algorithm, the tie rule, the inserted graph, refusals."""

from __future__ import annotations

import math
import types
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import run_block
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods.base import SiteSpec, SiteTensors
from vlmprune.passes.methods.builder import Builder, role_of
from vlmprune.passes.methods.tome import ToMeMethod, _emit_merge, _merge, _Tokens, schedule
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass, prune_record
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.targets.runtime import ort_session, run_session

METHOD = ToMeMethod()


@pytest.mark.parametrize("n,keep,blocks,options", [(576, 192, 24, {}), (576, 64, 24, {}), (64, 16, 3, {}),
                                                   (64, 16, 2, {}), (576, 64, 24, {"blocks": "1-4"}),
                                                   (576, 100, 12, {"blocks": "5-"})])
def test_schedule_sums_to_the_merges_within_the_cap(n, keep, blocks, options):
    r = schedule(METHOD.parse(keep, options), n, 1, blocks)
    assert len(r) == blocks and sum(r) == n - keep
    t = n + 1
    for merged in r:
        assert merged <= (t - 1) // 2
        t -= merged


def test_schedule_is_even_with_the_earliest_blocks_one_more_and_limited_to_its_range():
    assert schedule(METHOD.parse(192, {}), 576, 1, 24) == [16] * 24  # the official constant r
    assert schedule(METHOD.parse(64, {}), 576, 1, 24) == [22] * 8 + [21] * 16
    r = schedule(METHOD.parse(500, {"blocks": "2-4"}), 576, 1, 6)
    assert r == [0, 26, 25, 25, 0, 0]
    assert schedule(METHOD.parse(16, {}), 64, 1, 2) == [32, 16]  # the cap binds in block 2: block 1 takes more


def test_refusals():
    with pytest.raises(InputError, match="fewest it reaches is 8 "):
        schedule(METHOD.parse(7, {}), 64, 1, 3)
    with pytest.raises(InputError, match="1 <= keep < 64"):
        METHOD.check(METHOD.parse(64, {}), SiteSpec(64, True, 3, 3))
    with pytest.raises(InputError, match="out of range"):
        METHOD.check(METHOD.parse(40, {"blocks": "2-5"}), SiteSpec(64, True, 3, 3))
    with pytest.raises(InputError, match="--layer does not apply"):
        METHOD.check(METHOD.parse(40, {}), SiteSpec(64, True, 2, 3))
    with pytest.raises(InputError, match="takes A-B"):
        METHOD.parse(40, {"blocks": "x"})
    with pytest.raises(InputError, match="does not take --merge local"):
        METHOD.parse(40, {"merge": "local"})
    METHOD.check(METHOD.parse(40, {}), SiteSpec(64, False, 3, 3))  # no [CLS]: class_token False


# ---------------------------------------------------------------------------- the official algorithm


def official_block(layer, x, size, r, source, class_token=True):
    """One block as facebookresearch/ToMe's timm patch runs it, written out here for a HF CLIP layer: the
    attention with + log(size), bipartite soft matching on k.mean(heads) (official argsort, not ours: no ties
    here), merge_wavg, the MLP; `source` [B, t, N] as its trace_source tracks which patches a token holds."""
    attn = layer.self_attn
    b, t, d = x.shape
    heads = attn.num_heads
    h = layer.layer_norm1(x)
    q, k, v = (proj(h).view(b, t, heads, -1).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    logits = q @ k.transpose(-1, -2) * attn.scale
    if size is not None:
        logits = logits + size.log()[:, None, None, :, 0]
    x = x + attn.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
    metric = k.mean(1)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, bb = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ bb.transpose(-1, -2)
    if class_token:
        scores[..., 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    if class_token:
        unm_idx = unm_idx.sort(dim=1)[0]

    def merge(y):
        src, dst = y[..., ::2, :], y[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
        return torch.cat([unm, dst], dim=1)

    size = torch.ones_like(x[..., 0, None]) if size is None else size
    x, size, source = merge(x * size), merge(size), merge(source)
    x = x / size
    x = x + layer.mlp(layer.layer_norm2(x))
    return x, size, source


def test_reference_follows_the_official_algorithm(tiny_source):
    """Each output token of ours holds the values of the official token whose sources hold its patch index."""
    pipeline = tiny_source.pipeline
    layers = pipeline.tower.blocks[: pipeline.num_blocks]
    params = METHOD.parse(20, {})
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 112, 112)).astype(np.float32))
    with torch.inference_mode():
        h = pipeline.tower.embed(x)
        r = schedule(params, h.shape[1] - 1, 1, len(layers))
        size, source, y = None, torch.eye(h.shape[1]).expand(2, -1, -1), h
        for layer, merged in zip(layers, r):
            y, size, source = official_block(layer, y, size, merged, source)
        ours = METHOD.reference_blocks(params, [lambda z, layer=layer, **kw: run_block(pipeline.tower.parts(layer), z, **kw)
                                                for layer in layers], SiteTensors(h, True))
    assert ours.tokens.shape == y.shape == (2, 21, 32)
    assert torch.all(ours.kept.diff(dim=1) > 0)
    for i in range(2):
        holder = source[i].argmax(dim=0)  # patch (with [CLS] at 0) -> the official token holding it
        rows = holder[torch.cat([torch.zeros(1, dtype=torch.long), ours.kept[i] + 1])]
        assert sorted(rows.tolist()) == list(range(21))  # one official token per output token
        torch.testing.assert_close(ours.tokens[i], y[i, rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(size[i, rows, 0].sum(), torch.tensor(65.0))


# ---------------------------------------------------------------------------- ties, graph against reference


def _merge_graph(t: int, r: int, prefix: int, d: int, dh: int) -> ir.Model:
    """x [B, t, D] and keys [B, H, t, dh] -> one block's merge (tokens, size, index), the emission alone."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", t, d]))
    k = ir.Value(name="k", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 2, t, dh]))
    graph = ir.Graph([x, k], [], nodes=[], name="tome", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/tome")
    block = types.SimpleNamespace(k=k, k_transposed=False)
    outs = _emit_merge(b, block, x, None, None, t, r, prefix, ir.DataType.FLOAT)
    graph.extend(b.nodes)
    for value, name in zip(outs, ("tokens", "size", "index")):
        value.name = name
    graph.outputs.extend(outs)
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    return model


def _run(proto, x: torch.Tensor, k: torch.Tensor) -> dict[str, np.ndarray]:
    session = ort_session(proto.SerializeToString())
    values = session.run(None, {"x": x.numpy(), "k": k.numpy()})
    return {meta.name: value for meta, value in zip(session.get_outputs(), values)}


def test_ties_go_to_the_lower_index_in_reference_and_graph():
    """Every A token has the same best score: the first r A tokens (lowest indices) merge, in both."""
    t, r, d = 9, 2, 4
    k = torch.zeros(1, 2, t, 3)
    k[..., 0] = 1.0  # every key the same direction: every score 1, every node_max tied
    x = torch.arange(t * d, dtype=torch.float32).reshape(1, t, d)
    state = _Tokens(None, torch.arange(t)[None])
    tokens = _merge(state, r, 1, x, k)
    # A = 0, 2, 4, 6, 8 with [CLS] (0) protected: 2 and 4 merge, each into B token 1 (the first maximal index)
    assert state.index.tolist() == [[0, 6, 8, 1, 3, 5, 7]]
    assert state.size[0, :, 0].tolist() == [1, 1, 1, 3, 1, 1, 1]
    model = _merge_graph(t, r, 1, d, 3)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    out = _run(proto, x, k)
    np.testing.assert_array_equal(out["index"], state.index.numpy())
    np.testing.assert_allclose(out["tokens"], tokens.numpy(), rtol=1e-6)


def test_merge_emission_ops_and_numbers_at_a_fixed_seed():
    t, r, d, dh = 17, 5, 6, 4
    g = torch.Generator().manual_seed(0)
    x, k = torch.randn(3, t, d, generator=g), torch.randn(3, 2, t, dh, generator=g)
    model = _merge_graph(t, r, 1, d, dh)
    ops = Counter(n.op_type for n in model.graph)
    assert set(ops) == {"ReduceMean", "ReduceL2", "Max", "Div", "Gather", "Transpose", "MatMul", "Where",
                        "ReduceMax", "ArgMax", "TopK", "GatherElements", "Shape", "Slice", "Expand", "Concat",
                        "Unsqueeze", "Equal", "Cast", "GreaterOrEqual", "GatherND", "Add"}, ops
    assert "ScatterElements" not in ops  # the scatter-add is a one-hot MatMul: every target runs it
    assert {role_of(n) for n in model.graph} == {"score", "select", "tokens"}
    out = _run(ir.to_proto(model), x, k)
    state = _Tokens(None, torch.arange(t).expand(3, t))
    want = _merge(state, r, 1, x, k)
    np.testing.assert_array_equal(out["index"], state.index.numpy())
    np.testing.assert_allclose(out["tokens"], want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["size"], state.size.numpy())


@pytest.mark.parametrize("keep,options,batch", [(16, {}, 1), (40, {"blocks": "2-3"}, 3)])
def test_inserted_graph_matches_reference(tiny_dense_path, tiny_source, keep, options, batch):
    params = METHOD.parse(keep, options)
    model = ir.load(tiny_dense_path)
    assert InsertPruningPass(METHOD, params)(model).modified
    assert RetargetTokenCountPass()(model).modified
    record = prune_record(model)
    assert record.tokens_out == 1 + keep and record.layer == 3
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(batch).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = run_session(ort_session(proto.SerializeToString()), x)
    with torch.inference_mode():
        feats, kept = tiny_source.pipeline.with_pruner(MethodPruner(METHOD, params, "block", 3))(torch.from_numpy(x))
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert np.all(np.diff(out[KEPT_INDICES], axis=1) > 0)
    np.testing.assert_allclose(out["image_features"], feats.numpy(), rtol=1e-4, atol=1e-5)
    # proportional attention: one size bias per block after the first merge
    assert sum(n.op_type == "Log" for n in model.graph) == (2 if not options else 1)
