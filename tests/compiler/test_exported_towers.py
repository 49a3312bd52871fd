"""Towers exported elsewhere: Hugging Face CLIP, SigLIP, ViT and DINOv2 (with and without registers) through
torch.onnx's two exporters, eager and SDPA attention, opsets 14 to 23 (LayerNorm decomposed below 17),
static or dynamic batch, inline or external weights. Each compiles, pruned inside the tower and at its end,
with parity against the original graph; what cannot be exported at all is skipped saying so.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import onnx
import pytest
import torch

from vlmprune.compiler.bundle import load_manifest
from vlmprune.compiler.pipeline import CompileOptions, compile_model

FAMILIES = ["tiny_clip_dir", "tiny_siglip_dir", "tiny_vit_dir", "tiny_dinov2_dir", "tiny_dinov2_registers_dir"]
# (exporter, attention, opset, dynamic batch, external data)
EXPORTS = [("torchscript", "eager", 14, False, False), ("torchscript", "sdpa", 17, False, True),
           ("dynamo", "sdpa", 18, True, False), ("dynamo", "eager", 23, False, True)]


def _export(path, tmp_path, exporter, attention, opset, dynamic, external):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, attn_implementation=attention).eval()
    out = tmp_path / "tower.onnx"
    kwargs = {"dynamo": exporter == "dynamo", "opset_version": opset, "input_names": ["pixel_values"]}
    if dynamic:
        kwargs["dynamic_shapes"] = {"pixel_values": {0: torch.export.Dim("batch", min=1, max=8)}}
    example = torch.zeros(2 if dynamic else 1, 3, 112, 112)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (example,), str(out), **kwargs)
    except Exception as exc:  # the exporter's own limits, not vlmprune's
        pytest.skip(f"torch.onnx ({exporter}, opset {opset}) cannot export this tower: {str(exc).splitlines()[0][:120]}")
    proto = onnx.load(str(out))
    onnx.save(proto, str(out), save_as_external_data=external, location="tower.weights" if external else None)
    return out, proto


@pytest.mark.parametrize("exporter,attention,opset,dynamic,external", EXPORTS,
                         ids=[f"{e}-{a}-op{o}{'-dyn' if d else ''}{'-ext' if x else ''}" for e, a, o, d, x in EXPORTS])
@pytest.mark.parametrize("fixture", FAMILIES)
def test_exported_tower_compiles_with_parity(request, tmp_path, fixture, exporter, attention, opset, dynamic, external):
    path = request.getfixturevalue(fixture)
    onnx_path, proto = _export(path, tmp_path, exporter, attention, opset, dynamic, external)
    ops = {n.op_type for n in proto.graph.node}
    assert ("LayerNormalization" in ops) == (opset >= 17)  # below 17 the exporter decomposes it
    method = "divprune" if fixture == "tiny_siglip_dir" else "cls"  # SigLIP has no [CLS]
    for layer, where in ((None, "end"), (2, "inside")):
        if method == "divprune" and layer is not None:
            continue  # divprune prunes the projector output only
        out = tmp_path / f"b_{where}"
        result = compile_model(str(onnx_path), out, CompileOptions(method=method, keep=16, layer=layer))
        assert result.report.passed, (where, result.manifest["parity"])
        manifest = load_manifest(out)
        assert [o["name"] for o in manifest["outputs"]] == ["image_features", "kept_indices"]
        assert manifest["inputs"][0]["shape"][0] == ("batch" if dynamic else 1)
        rewritten = next(s for s in result.report.stages if s.stage == "rewritten")
        if layer is None:  # at the tower's end the original graph's rows are a value reference
            assert "image_features" in rewritten.outputs and rewritten.outputs["image_features"]["passed"]
        assert rewritten.indices["agreement"] == 1.0


def test_a_graph_without_attention_says_what_was_looked_for(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["pixel_values"], ["y"])], "g",
                              [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3, 112, 112])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 112, 112])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    from vlmprune.compiler.errors import StructureError

    with pytest.raises(StructureError, match="looked for Softmax\\(MatMul\\(Q, Kᵀ\\)\\)"):
        compile_model(str(path), tmp_path / "b", CompileOptions(keep=8))
