"""Loading Hugging Face directories, .onnx towers and presets; parity on each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_models import edited_copy
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model


def test_llava_dir_honours_feature_layer_and_strategy(tiny_llava_dir):
    source = load_source(str(tiny_llava_dir))
    assert source.kind == "hf" and source.has_cls
    assert source.num_blocks == 2  # vision_feature_layer -2 of 3 layers
    assert source.pipeline.drop_cls and source.pipeline.projector is not None
    full = load_source(str(tiny_llava_dir), feature_layer=-1)
    assert full.num_blocks == 3


def test_llava_dir_weights_really_loaded(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    ours = load_source(str(tiny_llava_dir)).pipeline
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=x, vision_feature_layer=-2, vision_feature_select_strategy="default")
        expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
        expected = torch.stack(list(expected)) if isinstance(expected, (list, tuple)) else expected
        got = ours(x)
    torch.testing.assert_close(got, expected.reshape(got.shape), atol=1e-5, rtol=1e-4)


def test_full_select_strategy_keeps_cls(tiny_llava_dir, tmp_path):
    copy = edited_copy(tiny_llava_dir, tmp_path / "llava_full",
                       lambda cfg: cfg.update(vision_feature_select_strategy="full"))
    result = compile_model(str(copy), tmp_path / "b", CompileOptions(keep=10, layer=2))
    assert result.report.passed
    features = next(o for o in result.manifest["outputs"] if o["name"] == "image_features")
    assert features["shape"][1] == 1 + 10 + 1


def test_clip_dir_with_projector(tiny_clip_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    copy = tmp_path / "clip_proj"
    shutil.copytree(tiny_clip_dir, copy)
    g = torch.Generator().manual_seed(0)
    save_file({"model.mm_projector.0.weight": torch.randn(40, 32, generator=g), "model.mm_projector.0.bias": torch.zeros(40),
               "model.mm_projector.2.weight": torch.randn(40, 40, generator=g), "model.mm_projector.2.bias": torch.zeros(40)},
              str(copy / "mm_projector.safetensors"))
    source = load_source(str(copy))
    assert source.pipeline.projector.linear_2.out_features == 40
    result = compile_model(str(copy), tmp_path / "b", CompileOptions(keep=12, batch=1))
    assert result.report.passed
    assert result.manifest["inputs"][0]["shape"][0] == 1


def test_onnx_tower_source(tiny_dense_path, tmp_path):
    result = compile_model(str(tiny_dense_path), tmp_path / "b", CompileOptions(keep=20, layer=2, method_options={"lambda": 0.2}))
    stages = {s.stage: s for s in result.report.stages}
    assert set(stages) == {"rewritten", "fused"}  # no torch model: the selection is checked
    assert stages["rewritten"].passed and stages["rewritten"].indices["agreement"] == 1.0


def test_onnx_tower_dense_is_checked_against_the_original(tiny_dense_path, tmp_path):
    result = compile_model(str(tiny_dense_path), tmp_path / "b", CompileOptions(prune=False))
    stages = {s.stage: s for s in result.report.stages}
    assert set(stages) == {"rewritten", "fused"} and result.report.passed
    assert stages["fused"].outputs["image_features"]["max_abs"] == 0.0


def test_no_prune_baseline(tiny_llava_dir, tmp_path):
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(prune=False))
    assert result.report.passed
    assert result.manifest["method"]["name"] == "none"
    assert [o["name"] for o in result.manifest["outputs"]] == ["image_features"]


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_source(str(tmp_path))


def test_refuses_pickle_only_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(InputError, match="never unpickles"):
        load_source(str(tmp_path))


@pytest.mark.parametrize("batch,layer", [(1, 2), (3, None)])
def test_demo_parity_inside_and_end(batch, layer, tmp_path):
    result = compile_model("demo", tmp_path / "b", CompileOptions(keep=192, layer=layer, batch=batch))
    assert result.report.passed, result.manifest["parity"]
    for stage in result.report.stages:
        if stage.indices:
            assert stage.indices["agreement"] == 1.0
        feats = stage.outputs["image_features"]
        assert feats["cosine_min"] >= 0.99999 and feats["max_abs"] <= 1e-4
    assert result.manifest["method"]["layer"] == (layer or 5)
    assert np.all(np.array(result.manifest["inputs"][0]["shape"]) == [batch, 3, 336, 336])


def test_one_feature_layer_is_taken_and_a_list_is_refused_in_one_line():
    """The projector reads one block's hidden states; concatenated layers have no single block to prune after."""
    from types import SimpleNamespace

    from vlmprune.compiler.errors import InputError
    from vlmprune.compiler.frontend.source import feature_layer_of

    config = SimpleNamespace(vision_feature_layer=-2)
    assert feature_layer_of(config, None) == -2 and feature_layer_of(config, -1) == -1
    with pytest.raises(InputError, match=r"multi-layer vision_feature_layer \[-2, -5\] is not supported; pass "
                                         r"--feature-layer"):
        feature_layer_of(SimpleNamespace(vision_feature_layer=[-2, -5]), None)


def test_exported_graphs_carry_no_stack_trace_of_the_build_machine():
    """The exporter writes each node's Python stack (install paths, line numbers) into its metadata; torch_onnx drops
    it, so a bundle's bytes do not depend on where vlmprune is installed. The raw export shows what is dropped."""
    import vlmprune.compiler.frontend.export as export

    class Traced(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x @ x.transpose(-1, -2))

    raw = torch.onnx.export(Traced().eval(), (torch.zeros(1, 4, 4),), dynamo=True, optimize=False).model
    assert any(export.STACK_TRACE in n.metadata_props for n in raw.graph.all_nodes())  # what there is to drop
    model = export.torch_onnx("t", Traced(), (torch.zeros(1, 4, 4),), input_names=["x"], output_names=["y"])
    metadata = [dict(n.metadata_props) for n in model.graph.all_nodes()]
    assert metadata and not any(export.STACK_TRACE in m for m in metadata)
    here = str(Path(__file__).resolve().parents[2])
    assert not any(here in value for m in metadata for value in m.values())


def test_exports_share_one_torchlib_registry_and_give_the_same_graph(monkeypatch):
    """torch_onnx builds the exporter's ATen-to-ONNX table once per opset instead of once per export (a quarter of a
    tiny tower's export); each export still gets its own table, the graph is the one a freshly built table gives,
    and outside the block torch builds its table as before."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _registration

    import vlmprune.compiler.frontend.export as export

    class Traced(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ x.transpose(-1, -2)), (4,))

    def graph(model):
        return ir.serde.serialize_model(model).SerializeToString()

    args = (torch.zeros(1, 4, 4),)
    export._registry_for.cache_clear()
    original = vars(_registration.ONNXRegistry)["from_torchlib"]
    built = []
    monkeypatch.setattr(export, "_registry_for", export.functools.lru_cache(maxsize=4)(
        lambda build, *a, **k: built.append(a or k) or build(*a, **k)))
    first = export.torch_onnx("t", Traced(), args, input_names=["x"], output_names=["y"])
    second = export.torch_onnx("t", Traced(), args, input_names=["x"], output_names=["y"])
    assert len(built) == 1  # the second export reused the first's table
    assert vars(_registration.ONNXRegistry)["from_torchlib"] is original  # restored after each export
    tables = [_registration.ONNXRegistry.from_torchlib(), _registration.ONNXRegistry.from_torchlib()]
    assert tables[0] is not tables[1] and tables[0].functions is not tables[1].functions
    with export.one_torchlib_registry():
        shared = [_registration.ONNXRegistry.from_torchlib(), _registration.ONNXRegistry.from_torchlib()]
    assert shared[0].functions is not shared[1].functions  # a copy each: one export's registrations stay its own
    assert shared[0].functions.keys() == tables[0].functions.keys()
    export._registry_for.cache_clear()
    before = len(built)
    fresh = export.torch_onnx("t", Traced(), args, input_names=["x"], output_names=["y"])
    assert len(built) == before + 1  # built anew
    assert graph(first) == graph(second) == graph(fresh)
    assert [n.op_type for n in first.graph] == ["Transpose", "MatMul", "Gelu", "LayerNormalization"]


def test_release_weights_collects_only_where_the_freed_weights_are_worth_it(tiny_clip_dir, monkeypatch):
    """A full garbage collection costs a fraction of a second in a process holding many objects, whatever the
    tower's size: a tiny tower's release skips it, a tower over COLLECT_FROM_BYTES still has it."""
    import gc

    from vlmprune.compiler.frontend import load_source
    from vlmprune.compiler.frontend import source as source_module

    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    load_source(str(tiny_clip_dir)).release_weights()
    assert collected == []
    monkeypatch.setattr(source_module, "COLLECT_FROM_BYTES", 1)
    load_source(str(tiny_clip_dir)).release_weights()
    assert collected == [()]
