"""passes.attention_fusion: each block's exported attention -> com.microsoft.MultiHeadAttention, same numbers;
a block whose Q/K a pruning score reads stays in standard ops; another softmax axis or scale is not matched."""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmprune.compiler.contract import FUSED_META
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.attention_fusion import attention_rules, count_fused
from tower_graphs import export, fuse, run

BLOCKS = 3  # the tiny towers' depth (tests/conftest.py)


def _fuse(model: ir.Model, required: bool = False, debug: bool = False) -> ir.Model:
    return fuse(model, attention_rules(), required, debug)


@pytest.mark.parametrize("family", ["clip", "siglip", "vit", "dinov2"])
def test_every_block_fused_same_numbers(request, family):
    dense = export(request.getfixturevalue(f"tiny_{family}_dir"))
    x = np.random.default_rng(0).standard_normal((2, 3, 112, 112)).astype(np.float32)
    reference = run(dense, x)
    fused = _fuse(ir.from_proto(ir.serde.serialize_model(dense)))
    ops = collections.Counter(n.op_type for n in fused.graph)
    assert count_fused(fused) == BLOCKS and ops["Softmax"] == 0
    onnx.checker.check_model(ir.serde.serialize_model(fused))
    for got, want in zip(run(fused, x), reference):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_block_the_score_reads_stays_unfused(tiny_clip_dir):
    """cls after block 1 reads block 1's q and Kᵀ: that block keeps its Softmax, the others fuse, same kept set."""
    from vlmprune.compiler.contract import KEPT
    from vlmprune.compiler.pipeline import CompileOptions
    from vlmprune.passes.methods import get_method
    from vlmprune.targets.base import PruneConfig
    from vlmprune.targets.ort import OrtTarget

    method = get_method("cls")
    params = method.parse(16, {})
    options = CompileOptions(method="cls", keep=16, layer=1)
    decomposed = OrtTarget().pipeline(PruneConfig(method, params, 1), options)(export(tiny_clip_dir)).model
    x = np.random.default_rng(1).standard_normal((1, 3, 112, 112)).astype(np.float32)
    reference = dict(zip([v.name for v in decomposed.graph.outputs], run(decomposed, x)))
    fused = _fuse(ir.from_proto(ir.serde.serialize_model(decomposed)))
    assert count_fused(fused) == BLOCKS - 1
    score_softmax = [n for n in fused.graph if n.op_type == "Softmax"]
    assert len(score_softmax) == 2  # block 1's own and the [CLS] score's, which read the same q and Kᵀ
    got = dict(zip([v.name for v in fused.graph.outputs], run(fused, x)))
    np.testing.assert_array_equal(got[KEPT], reference[KEPT])
    for name, want in reference.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=2e-5)


def _change(model: ir.Model, change: str) -> None:
    """Block 1's attention with another Softmax axis, or its q scale read from a graph input (not a constant)."""
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    if change == "axis":
        softmax.attributes["axis"] = ir.AttrInt64("axis", 2)
        return
    scale = ir.Value(name="runtime_scale", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    model.graph.inputs.append(scale)
    softmax.inputs[0].producer().inputs[0].producer().replace_input_with(1, scale)  # Mul(q, scale)


@pytest.mark.parametrize("change, reason", [("axis", "the Softmax is not over the keys"),
                                            ("scale", "a scale is not a constant scalar")])
def test_other_axis_or_scale_not_matched(tiny_clip_dir, change, reason):
    model = export(tiny_clip_dir)
    _change(model, change)
    _fuse(model)
    assert count_fused(model) == BLOCKS - 1  # the changed block stays, the others fuse
    model.metadata_props.pop(FUSED_META)
    with pytest.raises(StructureError) as full:  # the changed block alone: not matched, and check says why
        _fuse(model, required=True, debug=True)
    assert reason in str(full.value)
    assert count_fused(model) == BLOCKS - 1
