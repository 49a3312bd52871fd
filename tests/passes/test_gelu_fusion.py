"""passes.gelu_fusion: the exported tanh GELU -> com.microsoft.FastGelu, same numbers; another coefficient or
the erf GELU is not matched, and check says why."""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmprune.compiler.contract import FUSED_META
from vlmprune.compiler.errors import StructureError
from tower_graphs import export, fuse, run
from vlmprune.passes.gelu_fusion import count_fused, gelu_rules

BLOCKS = 3  # the tiny towers' depth (tests/conftest.py)


def _fuse(model: ir.Model, required: bool = False, debug: bool = False) -> ir.Model:
    return fuse(model, gelu_rules(), required, debug)


def test_siglip_gelu_fused_same_numbers(tiny_siglip_dir):
    dense = export(tiny_siglip_dir)
    x = np.random.default_rng(0).standard_normal((2, 3, 112, 112)).astype(np.float32)
    reference = run(dense, x)
    fused = _fuse(ir.from_proto(ir.serde.serialize_model(dense)))
    ops = collections.Counter(n.op_type for n in fused.graph)
    assert count_fused(fused) == BLOCKS and ops["Tanh"] == 0 and ops["Pow"] == 0
    onnx.checker.check_model(ir.serde.serialize_model(fused))
    for got, want in zip(run(fused, x), reference):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_erf_gelu_not_matched(tiny_clip_dir, tiny_vit_dir):
    """CLIP (quick_gelu) and ViT (exact erf GELU) have no tanh GELU: nothing fuses."""
    for folder in (tiny_clip_dir, tiny_vit_dir):
        model = _fuse(export(folder))
        assert count_fused(model) == 0


def test_other_coefficient_not_matched(tiny_siglip_dir):
    model = export(tiny_siglip_dir)
    pow_node = next(n for n in model.graph if n.op_type == "Pow")
    scale = next(u for u, _ in pow_node.outputs[0].uses())  # Mul(x³, 0.044715)
    index = next(i for i, v in enumerate(scale.inputs) if v is not pow_node.outputs[0])
    other = ir.Value(name="other_coefficient", const_value=ir.tensor(np.array(0.05, np.float32)))
    model.graph.initializers.add(other)
    scale.replace_input_with(index, other)
    _fuse(model)
    assert count_fused(model) == BLOCKS - 1
    model.metadata_props.pop(FUSED_META)
    with pytest.raises(StructureError) as full:  # that block alone: not matched, and check says why
        _fuse(model, required=True, debug=True)
    assert "the coefficient is 0.05" in str(full.value)


def test_ort_target_fuses_siglip_gelu(tiny_siglip_dir):
    """The ort target's own rules carry it: a dense bundle's fusion turns every block's GELU into FastGelu."""
    from vlmprune.compiler.pipeline import CompileOptions
    from vlmprune.targets.ort import OrtTarget

    fusion = OrtTarget().fusion(None, CompileOptions())
    model = export(tiny_siglip_dir)
    fusion(model)
    assert count_fused(model) == BLOCKS
    assert all(OrtTarget().supports(n)[0] for n in model.graph)
