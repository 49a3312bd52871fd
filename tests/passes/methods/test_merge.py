"""--merge local: the reference against a per-token numpy loop, the inserted graph against the reference, refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.merge import local_merge
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass, prune_record
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.targets.runtime import ort_session, run_session

CLS = get_method("cls")


def loop_merge(hidden: np.ndarray, keys: np.ndarray, kept: list[int], grid: tuple[int, int], width: int):
    """One image, token by token: the module docstring's definition, written as plainly as possible."""
    patches, n = hidden[1:], len(hidden) - 1
    keys = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    half = (width - 1) // 2
    members = {k: [] for k in kept}
    orphans = []
    for i in range(n):
        if i in kept:
            continue
        ri, ci = divmod(i, grid[1])
        near = [k for k in kept if abs(k // grid[1] - ri) <= half and abs(k % grid[1] - ci) <= half]
        if not near:
            orphans.append(i)
            continue
        best = max(near, key=lambda k: (keys[i] @ keys[k], -k))  # highest cosine; ties to the lower index
        members[best].append(i)
    merged = [np.mean([patches[k]] + [patches[j] for j in members[k]], axis=0) for k in kept]
    pruned = [i for i in range(n) if i not in kept]
    summary = patches[orphans].mean(axis=0) if orphans else patches[pruned].mean(axis=0)
    return np.concatenate([hidden[:1], np.stack(merged), summary[None]]), len(orphans)


@pytest.mark.parametrize("width", [3, 5])
def test_reference_is_the_definition(width):
    g = torch.Generator().manual_seed(width)
    b, h, grid, dh, d = 3, 2, (6, 5), 8, 7
    n = grid[0] * grid[1]
    hidden = torch.randn(b, 1 + n, d, generator=g, dtype=torch.float64)
    q, k = (torch.randn(b, h, 1 + n, dh, generator=g, dtype=torch.float64) for _ in range(2))
    pixels = torch.zeros(b, 3, grid[0] * 4, grid[1] * 4, dtype=torch.float64)  # the grid: 6 x 5 patches of 4 px
    params = CLS.parse(4, {"merge": "local", "width": width})
    inputs = SiteTensors(hidden, True, q, k, 0.35, pixels, 4)
    result = CLS.reference(params, inputs)
    assert result.tokens.shape == (b, 1 + 4 + 1, d)
    orphan_counts = []
    for i in range(b):
        kept = result.kept[i].tolist()
        expected, orphans = loop_merge(hidden[i].numpy(), k[i].mean(dim=0)[1:].numpy(), kept, grid, width)
        np.testing.assert_allclose(result.tokens[i].numpy(), expected, rtol=1e-12, atol=1e-12)
        orphan_counts.append(orphans)
    plain = CLS.reference(CLS.parse(4, {}), inputs)
    assert torch.equal(plain.kept, result.kept)  # merging changes the tokens, never the selection
    if width == 3:
        assert any(orphan_counts)  # 4 of 30 patches kept: some pruned ones have no kept neighbour in 3 x 3
    assert result.trace["row_margins"].shape == (b, 1 + 4 + 1)


def test_no_orphans_gives_the_plain_summary():
    """Every patch within reach of a kept one: the summary falls back to the mean of all pruned tokens."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 1 + 9, 4, generator=g, dtype=torch.float64)
    tensors = SiteTensors(hidden, True, k=torch.randn(1, 1, 10, 3, generator=g, dtype=torch.float64))
    params = CLS.parse(1, {"merge": "local"})  # 3 x 3 grid, the centre kept: every other patch is its neighbour
    tokens, _ = local_merge(params, tensors, torch.tensor([[4]]), site_is_block=True)
    np.testing.assert_allclose(tokens[0, 1].numpy(), hidden[0, 1:].mean(dim=0).numpy(), rtol=1e-12)
    pruned = hidden[0, 1:][[0, 1, 2, 3, 5, 6, 7, 8]]
    np.testing.assert_allclose(tokens[0, 2].numpy(), pruned.mean(dim=0).numpy(), rtol=1e-12)


@pytest.mark.parametrize("layer,batch", [(1, 1), (2, 3)])
def test_inserted_graph_matches_reference(tiny_dense_path, tiny_source, layer, batch):
    params = CLS.parse(12, {"merge": "local", "width": 3})
    model = ir.load(tiny_dense_path)
    InsertPruningPass(CLS, params, layer)(model)
    RetargetTokenCountPass()(model)
    record = prune_record(model)
    assert record.tokens_out == 1 + 12 + 1 and record.params["width"] == 3
    ops = [n.op_type for n in model.graph if (n.name or "").startswith("vlmprune/")]
    assert "ArgMax" in ops and "GatherND" in ops and "LessOrEqual" in ops
    x = np.random.default_rng(batch).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = run_session(ort_session(ir.to_proto(model).SerializeToString()), x)
    with torch.inference_mode():
        feats, kept = tiny_source.pipeline.with_pruner(MethodPruner(CLS, params, "block", layer))(torch.from_numpy(x))
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    np.testing.assert_allclose(out["image_features"], feats.numpy(), rtol=1e-4, atol=1e-5)
    # and it is not the plain summary: merged tokens differ from copies
    with torch.inference_mode():
        plain, _ = tiny_source.pipeline.with_pruner(MethodPruner(CLS, CLS.parse(12, {}), "block", layer))(
            torch.from_numpy(x))
    assert not np.allclose(out["image_features"], plain.numpy(), atol=1e-3)


def test_compile_on_ort_with_parity(tiny_llava_dir, tmp_path):
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        target="ort", method="cls", keep=16, method_options={"merge": "local", "width": 5}))
    assert result.report.passed, result.manifest["parity"]
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["method"]["params"]["merge"] == "local" and manifest["method"]["params"]["width"] == 5
    assert manifest["target"]["fused"] is False  # no TokenPrune summary to fuse: the merge stays in standard ops


def test_refusals():
    with pytest.raises(InputError, match="--merge must be 'local'"):
        CLS.parse(8, {"merge": "global"})
    with pytest.raises(InputError, match="odd integer >= 3"):
        CLS.parse(8, {"merge": "local", "width": 4})
    with pytest.raises(InputError, match="give --merge local with it"):
        CLS.parse(8, {"width": 3})
    with pytest.raises(InputError, match="method visionzip does not take --merge local"):
        get_method("visionzip").parse(8, {"merge": "local"})
    params = CLS.parse(8, {"merge": "local"})
    with pytest.raises(InputError, match="merged tokens"):
        CLS.check(CLS.parse(8, {"merge": "local", "score": "attention"}), SiteSpec(64, has_cls=False, merge=2))
    with pytest.raises(InputError, match="not a square"):
        CLS.check(params, SiteSpec(60, has_cls=True, has_pixels=False))
    CLS.check(params, SiteSpec(64, has_cls=True, has_pixels=False))  # a square N: its grid


@pytest.mark.parametrize("target", ["orin", "xavier"])
def test_compile_on_tensorrt_targets(tiny_llava_dir, tmp_path, target):
    """The merge in standard layers, kept in fp32 there with the selection (its SELECT / TOKENS roles)."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        target=target, method="cls", keep=16, method_options={"merge": "local"}))
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["target"]["fused"] is False


@pytest.mark.parametrize("target", ["rk3588", "qnn"])
def test_compile_on_quantised_targets(tiny_llava_dir, tmp_path, target, request):
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    request.getfixturevalue("rknn_ready" if target == "rk3588" else "qnn_ready")
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        target=target, method="cls", keep=16, method_options={"merge": "local"}))
    assert result.report.passed, result.manifest["parity"]


@pytest.mark.parametrize("dtype,cosine", [(np.float32, 0.99999), (np.float16, 0.999)])
def test_emission_at_a_features_site_matches_reference(dtype, cosine):
    """The tokens as their own keys (no block there); in fp16 the merged values hold fp16's tolerance."""
    from onnx_ir.passes.common import ShapeInferencePass

    from method_helpers import run, tokens
    from vlmprune.compiler.parity import DEFAULT_TOLERANCES, compare_tokens
    from vlmprune.passes.methods.base import GraphInputs
    from vlmprune.passes.methods.builder import Builder
    from vlmprune.passes.methods.merge import emit_local_merge

    n, d, keep, batch = 36, 16, 6, 3
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    hidden = ir.Value(name="hidden", type=ir.TensorType(elem), shape=ir.Shape(["batch", n, d]))
    kept = ir.Value(name="kept", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", keep]))
    graph = ir.Graph([hidden, kept], [], nodes=[], name="merge", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/merge")
    params = CLS.parse(keep, {"merge": "local", "width": 3})
    out = emit_local_merge(b, params, GraphInputs(hidden, False, n), kept, site_is_block=False)
    graph.extend(b.nodes)
    out.name = "tokens"
    graph.outputs.append(out)
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    x = tokens(5, batch, n, d)
    rng = np.random.default_rng(1)
    idx = np.sort(np.stack([rng.choice(n, keep, replace=False) for _ in range(batch)]), axis=1).astype(np.int64)
    from vlmprune.targets.runtime import ort_session as session

    proto = ir.to_proto(model)
    got = session(proto.SerializeToString()).run(None, {"hidden": x.astype(dtype), "kept": idx})[0]
    with torch.inference_mode():
        ref, margins = local_merge(params, SiteTensors(torch.from_numpy(x).double(), False), torch.from_numpy(idx),
                                   site_is_block=False)
    assert got.shape == (batch, keep + 1, d) and got.dtype == dtype
    tol = DEFAULT_TOLERANCES["fp32" if dtype == np.float32 else "fp16"]
    result = compare_tokens(ref.numpy(), got, tol, row_margins=margins.numpy())
    assert result["passed"] and result["cosine_min"] >= cosine, result


@pytest.mark.parametrize("options,message", [({"merge": "local"}, "--merge local is not taken with LLaVA-NeXT's crops"),
                                             ({"scorer": "int8"}, "--scorer int8 is not available for anyres crops")])
def test_refused_on_anyres_crops(options, message):
    from vlmprune.passes.methods.crops import CropBudget

    budget = CropBudget(CLS)
    params = {**budget.parse(30, options), "crops": {"count": 5, "side": 4, "budget": "proportional"}}
    with pytest.raises(InputError, match=message):
        budget.check(params, SiteSpec(16, has_cls=True, layer=3, num_blocks=3))


# ---------------------------------------------------------------------------- every method that declares it

# (method, options, site): the generic path (base.Method.__init_subclass__) over each method's own selection.
DECLARING = [("cls", {"lambda": 0.2}, "block"), ("divprune", {}, "features"), ("dart", {"pivots": 3}, "features"),
             ("random", {"seed": 3}, "block"), ("random", {"seed": 3, "site": "features"}, "features"),
             ("grid", {}, "block"), ("grid", {"site": "features"}, "features"), ("holov", {}, "features")]
# The merge's own nodes (those it names merge_*) on prefix-free tokens at a FEATURES site; a prefix adds its Slice, a
# BLOCK site its keys' ReduceMean over heads and (this export's K being [B, H, dh, T]) a Transpose.
MERGE_OPS = ["Abs"] * 2 + ["Add"] * 2 + ["And"] * 2 + ["ArgMax"] + ["Cast"] * 5 + ["Concat"] + ["Div"] * 2 + \
    ["Equal"] * 2 + ["Gather"] * 2 + ["GatherND"] * 2 + ["Greater"] * 2 + ["LessOrEqual"] * 2 + ["MatMul"] * 3 + \
    ["Max"] * 2 + ["Mul"] * 3 + ["ReduceL2"] + ["ReduceMax"] * 2 + ["ReduceSum"] * 2 + ["Slice"] * 2 + ["Sub"] * 4 + \
    ["Transpose"] * 2 + ["Unsqueeze"] * 9 + ["Where"] * 2


def merge_ops(model: ir.Model) -> list[str]:
    return sorted(n.op_type for n in model.graph if "/merge_" in (n.name or ""))


@pytest.mark.parametrize("name,options,site", DECLARING, ids=[f"{m}-{s}" for m, o, s in DECLARING])
def test_every_declaring_method_merges_as_its_reference(tiny_dense_path, tiny_source, name, options, site):
    """Graph (ORT, batch 3, fixed seed) against the plain-torch reference, the op list, the ONNX checker; and the
    merge changes the tokens only: the kept set is the method's own, the count K + 1 whether or not it had a summary."""
    import onnx
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    method = get_method(name)
    params = method.parse(12, {**options, "merge": "local", "width": 3})
    plain_params = method.parse(12, options)
    assert method.output_tokens(params) == 13 and method.copied_rows(params) == 0
    assert method.describe(params) == method.describe(plain_params) + "; merged (--merge local, 3x3): each pruned " \
        "token into its most similar kept neighbour, those with none into 1 summary token"
    layer = 2 if site == "block" else None
    model = ir.load(tiny_dense_path)
    InsertPruningPass(method, params, layer)(model)
    if site == "block":
        RetargetTokenCountPass()(model)
    RemoveUnusedNodesPass()(model)  # the method's own token rows: unused under the merge
    record = prune_record(model)
    assert record.site == site and record.tokens_out == record.prefix + 13
    expected = MERGE_OPS + ["Slice"] * record.prefix + (["ReduceMean", "Transpose"] if site == "block" else [])
    assert merge_ops(model) == sorted(expected)
    assert not [n for n in model.graph if (n.name or "").endswith("/gather_kept")]  # the unmerged rows are gone
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(7).standard_normal((3, 3, 112, 112)).astype(np.float32)
    out = run_session(ort_session(proto.SerializeToString()), x)
    with torch.inference_mode():
        feats, kept = tiny_source.pipeline.with_pruner(MethodPruner(method, params, site, layer))(torch.from_numpy(x))
        plain, plain_kept = tiny_source.pipeline.with_pruner(MethodPruner(method, plain_params, site, layer))(
            torch.from_numpy(x))
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    np.testing.assert_array_equal(kept.numpy(), plain_kept.numpy())  # merging never moves the selection
    # K + 1 rows: a method without a summary token of its own gains the merge's (Method.output_tokens)
    assert out["image_features"].shape[1] == feats.shape[1] == plain.shape[1] + (name not in ("cls", "holov"))
    np.testing.assert_allclose(out["image_features"], feats.numpy(), rtol=1e-4, atol=1e-5)


def test_features_site_keys_are_the_tokens():
    """At the projector output the merge's keys are the tokens themselves: divprune's merged output is the
    definition (loop_merge) over divprune's own kept set with keys = the tokens, batched."""
    from method_helpers import tokens as seeded_tokens

    method = get_method("divprune")
    params = method.parse(5, {"merge": "local"})
    x = torch.from_numpy(seeded_tokens(4, 3, 36, 8)).double()
    result = method.reference(params, SiteTensors(x, False))
    plain = method.reference(method.parse(5, {}), SiteTensors(x, False))
    assert torch.equal(result.kept, plain.kept) and result.tokens.shape == (3, 5 + 1, 8)
    assert len(result.trace["steps"]) == 5 and result.trace["row_margins"].shape == (3, 5 + 1)  # its trace + merge's
    for i in range(3):
        padded = np.concatenate([np.zeros((1, 8)), x[i].numpy()])  # loop_merge reads a [CLS] row first
        expected, _ = loop_merge(padded, x[i].numpy(), result.kept[i].tolist(), (6, 6), 3)
        np.testing.assert_allclose(result.tokens[i].numpy(), expected[1:], rtol=1e-12, atol=1e-12)


def test_merge_applies_once_through_super():
    """A subclass whose override calls super() merges once (only the outermost wrapper applies it)."""
    from vlmprune.passes.methods.divprune import DivPruneMethod

    class Wrapped(DivPruneMethod):
        def reference(self, params, inputs):
            return super().reference(params, inputs)

        def describe(self, params):
            return super().describe(params)

    method = Wrapped()
    params = method.parse(5, {"merge": "local"})
    x = torch.randn(2, 36, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = method.reference(params, SiteTensors(x, False))
    assert result.tokens.shape == (2, 5 + 1, 8)
    torch.testing.assert_close(result.tokens, get_method("divprune").reference(params, SiteTensors(x, False)).tokens)
    assert method.describe(params).count("--merge local") == 1


def test_refused_where_not_declared_or_no_grid():
    from vlmprune.passes.methods.divprune import DivPruneMethod

    class Undeclared(DivPruneMethod):
        local_merge = False

    with pytest.raises(InputError, match="method divprune does not take --merge local \\(it has no post-selection"):
        Undeclared().parse(8, {"merge": "local"})
    with pytest.raises(InputError, match="visionzip does not take --merge local \\(its contextual tokens take every "
                                         "pruned token already"):
        get_method("visionzip").parse(8, {"merge": "local", "contextual": 0})
    grid = get_method("grid")
    with pytest.raises(InputError, match="merged tokens \\(Qwen2-VL's 2x2"):
        grid.check(grid.parse(8, {"merge": "local", "site": "features"}), SiteSpec(64, has_cls=False, merge=2))
    with pytest.raises(InputError, match="not a square"):
        get_method("dart").check(get_method("dart").parse(8, {"merge": "local"}),
                                 SiteSpec(60, has_cls=False, has_pixels=False))
