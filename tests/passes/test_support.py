"""The support check and the target pipeline: one line naming every reason, the failing pass and what ran before."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.passes.methods import get_method
from vlmprune.passes.prune import InsertPruningPass
from vlmprune.passes.support import SupportCheckPass, TargetPipeline, unsupported


def _graph():
    return ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "custom" : 1]>
        g (float[2, 4] x) => (float[2, 4] z) {
            y = Relu(x)
            w = custom.Magic(y)
            z = custom.Magic(w)
        }
    """)


def _no_custom(node):
    return (node.domain == "", "" if node.domain == "" else "not in this runtime")


def test_unsupported_counts_each_op_with_its_reason():
    assert unsupported(_graph(), _no_custom, lambda m: ["opset 18 is too new"]) == [
        "opset 18 is too new", "custom.Magic: not in this runtime (2 nodes)"]


def test_support_check_changes_nothing_or_refuses_in_one_line():
    with pytest.raises(StructureError) as info:
        SupportCheckPass("toy", _no_custom)(_graph())
    assert str(info.value) == "toy cannot run this graph: custom.Magic: not in this runtime (2 nodes)"
    assert not SupportCheckPass("toy", lambda node: (True, ""))(_graph()).modified


def test_pipeline_names_the_failing_pass_and_those_before_it():
    method = get_method("cls")
    pipeline = TargetPipeline("toy", RemoveUnusedNodesPass(), TopologicalSortPass(),
                              InsertPruningPass(method, method.parse(2, {})))
    assert pipeline.names == ["RemoveUnusedNodesPass", "TopologicalSortPass", "InsertPruningPass"]
    with pytest.raises(StructureError) as info:
        pipeline(_graph())
    message = str(info.value)
    assert "no attention block found" in message
    assert message.endswith("[toy: InsertPruningPass, after RemoveUnusedNodesPass, TopologicalSortPass]")


def test_a_user_error_inside_requires_keeps_its_type():
    class Refuses(ir.passes.InPlacePass):
        def requires(self, model):
            raise InputError("no such option")

        def call(self, model):
            return ir.passes.PassResult(model, False)

    with pytest.raises(InputError, match=r"no such option \[toy: Refuses, after none\]"):
        TargetPipeline("toy", Refuses())(_graph())
