"""FeatureOutputPass: the output contract holds after it, and its post-condition fails on a graph that breaks it."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from vlmprune.passes.outputs import FEATURES, FeatureOutputPass


def _tower(outputs: str = "float[1, 5, 4] hidden, float[1, 4] pooled"):
    return ir.from_onnx_text(f"""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[1, 5, 4] x) => ({outputs}) {{
            hidden = Relu(x)
            pooled = ReduceMean<keepdims: int = 0>(hidden)
        }}
    """)


def test_contract_holds_after_the_pass():
    model = FeatureOutputPass(drop_cls=True, num_patches=4)(_tower()).model
    assert [(v.name, list(v.shape)) for v in model.graph.outputs] == [(FEATURES, [1, 4, 4])]


def test_ensures_fails_on_graphs_that_break_the_contract():
    with pytest.raises(ir.passes.PostconditionError, match=f"the outputs are not one {FEATURES}"):
        FeatureOutputPass(drop_cls=False, num_patches=4).ensures(_tower())  # two outputs, neither named
    kept_cls = _tower("float[1, 5, 4] hidden")
    kept_cls.graph.outputs[0].name = FEATURES
    with pytest.raises(ir.passes.PostconditionError,
                       match=f"^{FEATURES} holds 5 tokens with \\[CLS\\] dropped, the patch grid 4$"):
        FeatureOutputPass(drop_cls=True, num_patches=4).ensures(kept_cls)
    FeatureOutputPass(drop_cls=False, num_patches=4).ensures(kept_cls)  # [CLS] kept, as asked
