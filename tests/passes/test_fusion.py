"""FusionPass with the cls method's rule: the selection subgraph becomes one vlmprune.TokenPrune node, or the
pass fails saying why (a target adds the pass only where the rule must fire)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.fusion import FUSED_META, FusionPass
from vlmprune.passes.methods.base import FusedOp
from vlmprune.passes.methods.cls import TOKEN_PRUNE, ClsMethod, selection_model
from vlmprune.targets.runtime import ort_session

DOMAIN, OP_TYPE = "vlmprune", TOKEN_PRUNE

B, N, D, K = 3, 64, 16, 20


def _run(model: ir.Model, feeds: dict, libs=()) -> list[np.ndarray]:
    return ort_session(ir.to_proto(model).SerializeToString(), libs).run(None, feeds)


def fusion(debug: bool = False) -> FusionPass:
    return FusionPass(ClsMethod().fusion_rules({TOKEN_PRUNE: FusedOp(TOKEN_PRUNE)}), {DOMAIN: 1}, debug=debug)


def _feeds(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    scores = rng.random((B, N), dtype=np.float32).round(2)  # rounding makes real ties
    return {"hidden": rng.standard_normal((B, N + 1, D)).astype(dtype), "scores": scores}


def test_fuses_to_one_node_with_same_numbers(ort_library):
    reference = _run(selection_model(B, N, D, K), _feeds())
    model = selection_model(B, N, D, K)
    result = fusion()(model)
    assert result.modified and '"count": 1' in model.metadata_props[FUSED_META]
    assert not fusion()(model).modified  # a second run finds it fused already
    assert [(n.domain, n.op_type) for n in model.graph] == [(DOMAIN, OP_TYPE)]
    node = next(iter(model.graph))
    assert node.attributes["keep"].value == K and node.attributes["has_cls"].value == 1
    onnx.checker.check_model(ir.to_proto(model), full_check=False)
    fused = _run(model, _feeds(), (ort_library,))
    np.testing.assert_array_equal(fused[1], reference[1])  # same kept indices, ties included
    np.testing.assert_allclose(fused[0], reference[0], rtol=1e-5, atol=1e-6)


def test_fp16_hidden_states(ort_library):
    feeds = _feeds(1, np.float16)
    reference = _run(selection_model(B, N, D, K, np.float16), feeds)
    model = selection_model(B, N, D, K, np.float16)
    fusion()(model)
    fused = _run(model, feeds, (ort_library,))
    np.testing.assert_array_equal(fused[1], reference[1])
    np.testing.assert_allclose(fused[0].astype(np.float32), reference[0].astype(np.float32), rtol=2e-3, atol=2e-3)


def test_refuses_when_an_intermediate_has_another_consumer():
    model = selection_model(B, N, D, K)
    mask = next(n for n in model.graph if n.op_type == "ScatterElements").outputs[0]
    model.graph.outputs.append(mask)  # someone else reads the mask: fusing would drop it
    with pytest.raises(StructureError, match="did not match"):
        fusion()(model)
    assert OP_TYPE not in [n.op_type for n in model.graph]


def test_refuses_wrong_semantics_and_says_why():
    model = selection_model(B, N, D, K)
    second = [n for n in model.graph if n.op_type == "TopK"][1]
    second.attributes["largest"] = ir.AttrInt64("largest", 1)  # indices no longer in raster order
    with pytest.raises(StructureError) as brief:
        fusion()(model)
    assert "did not match" in str(brief.value) and "--debug" in str(brief.value)
    with pytest.raises(StructureError) as full:
        fusion(debug=True)(model)
    assert "ascending" in str(full.value)  # the tracer's report names the failed check


@pytest.mark.parametrize("n", [576, 1024])
def test_real_sizes_batch_gt_1(ort_library, n):
    rng = np.random.default_rng(n)
    feeds = {"hidden": rng.standard_normal((2, n + 1, 64)).astype(np.float32),
             "scores": rng.random((2, n), dtype=np.float32)}
    reference = _run(selection_model("batch", n, 64, 192), feeds)
    model = selection_model("batch", n, 64, 192)
    fusion()(model)
    fused = _run(model, feeds, (ort_library,))
    np.testing.assert_array_equal(fused[1], reference[1])
    np.testing.assert_allclose(fused[0], reference[0], rtol=1e-5, atol=1e-6)
