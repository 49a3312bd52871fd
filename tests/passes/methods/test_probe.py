"""The probe score (--score probe for cls and visionzip): the reference is SigLIP's own head attention, the
graph equals the reference, and towers without an attention-pooling head are refused.

A tiny SiglipVisionModel with its head (vision_use_head=True), built in memory at a fixed seed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import export_onnx
from vlmprune.compiler.frontend.clip import build_tower, pooling_head, tower_parts
from vlmprune.compiler.frontend.tower import VisionPipeline
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.probe import emit_probe_attention, probe_attention
from vlmprune.passes.prune import KEPT_INDICES, prune_record
from vlmprune.targets.base import PruneConfig
from vlmprune.targets.ort import OrtTarget
from vlmprune.targets.runtime import ort_session, run_session
from vlmprune.targets.tensorrt import OrinTarget

from method_helpers import run


def _siglip(use_head: bool = True, seed: int = 3):
    from transformers import SiglipVisionConfig

    torch.manual_seed(seed)
    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                image_size=112, patch_size=14, vision_use_head=use_head)
    tower = build_tower(config)
    with torch.no_grad():  # a probe that prefers some patches, as a trained head does
        if use_head:
            tower.head.probe.mul_(4.0)
    return tower


@pytest.fixture(scope="module")
def tower():
    return _siglip()


@pytest.fixture(scope="module")
def pipeline(tower):
    return VisionPipeline(tower_parts(tower, final_norm=True), None, 3, True, False, 14, final_norm=True).eval()


@pytest.fixture(scope="module")
def dense_path(pipeline, tmp_path_factory):
    path = tmp_path_factory.mktemp("siglip_onnx") / "tower.onnx"
    ir.save(export_onnx(pipeline, 112, None, 18), path)
    return path


def _pixels(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 112, 112)).astype(np.float32)


def test_reference_is_the_heads_own_attention(tower):
    """At the last block, the probe score is what SigLIP's head computes: its attention weights, mean over heads."""
    captured = {}

    def keep_weights(_module, _inputs, out):  # returns None: the head's output is left alone
        captured["weights"] = out[1]

    hook = tower.head.attention.register_forward_hook(keep_weights)
    x = torch.from_numpy(_pixels(2))
    try:
        with torch.inference_mode():
            out = tower(pixel_values=x, output_hidden_states=True)
    finally:
        hook.remove()
    head = pooling_head(tower)
    with torch.inference_mode():
        score = probe_attention(out.hidden_states[-1], head)  # the last block's output, before post_layernorm
    expected = captured["weights"][:, 0]  # nn.MultiheadAttention averages its weights over heads
    assert score.shape == (2, 64) and torch.allclose(score.sum(-1), torch.ones(2))
    torch.testing.assert_close(score, expected, rtol=1e-5, atol=1e-7)
    assert score.max() > 1.5 * score.min()  # not uniform: the ranking means something


def test_no_head_no_probe():
    assert pooling_head(_siglip(use_head=False)) is None
    cls = get_method("cls")
    params = cls.parse(8, {"score": "probe"})
    with pytest.raises(InputError, match="needs an attention-pooling head"):
        cls.check(params, SiteSpec(64, has_cls=False, head=False))
    cls.check(params, SiteSpec(64, has_cls=False, head=True))
    with pytest.raises(InputError, match="--score of method visionzip is one of cls, probe"):
        get_method("visionzip").parse(8, {"score": "pool"})
    assert "score" not in cls.parse(8, {})  # the default keeps every earlier bundle's parameters


@pytest.mark.parametrize("batch", [1, 3])
def test_emitted_score_equals_reference(tower, batch):
    head = pooling_head(tower)
    hidden = ir.Value(name="hidden", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 64, 32]))
    graph = ir.Graph([hidden], [], nodes=[], name="probe", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/probe")
    score = emit_probe_attention(b, hidden, head)
    graph.extend(b.nodes)
    score.name = "score"
    graph.outputs.append(score)
    x = np.random.default_rng(batch).standard_normal((batch, 64, 32)).astype(np.float32)
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    got = run(model, x)["score"]
    with torch.inference_mode():
        expected = probe_attention(torch.from_numpy(x), head).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-8)


CLS, CLS_LAMBDA, VISIONZIP = ("cls", {"score": "probe"}), ("cls", {"score": "probe", "lambda": 0.3}), \
    ("visionzip", {"score": "probe", "contextual": 4})
# (target, method, layer, batch): each method at batch 1 and 3, on ort and on a TensorRT target's legal graph.
CASES = [("ort", CLS, 1, 3), ("ort", CLS, 3, 1), ("ort", VISIONZIP, 1, 3), ("ort", VISIONZIP, 3, 1),
         ("ort", CLS_LAMBDA, 2, 3), ("orin", CLS, 3, 3), ("orin", VISIONZIP, 2, 1)]
TARGETS = {"ort": OrtTarget, "orin": OrinTarget}


@pytest.mark.parametrize("target,case,layer,batch", CASES)
def test_target_graph_matches_reference(dense_path, pipeline, target, case, layer, batch):
    """The target's decomposed graph (insert, retarget, legalize) against the torch reference, ONNX Runtime."""
    (name, options), target = case, TARGETS[target]()
    method = get_method(name)
    params = method.parse(20, options)
    config = PruneConfig(method, params, layer, head=pipeline.tower.head)
    model = target.pipeline(config, CompileOptions(target=target.name, method=name, keep=20, layer=layer,
                                                   method_options=options))(ir.load(dense_path)).model
    # TokenPrune copies a [CLS]: the method's fused op declined (ort still fuses the blocks' attention)
    assert config.method.fusion_rules(target.spellings, prune_record(model)) == []
    x = _pixels(batch, seed=layer)
    out = run_session(ort_session(ir.to_proto(model).SerializeToString()), x)
    with torch.inference_mode():
        feats, kept = pipeline.with_pruner(MethodPruner(method, params, "block", layer))(torch.from_numpy(x))
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert out["image_features"].shape == (batch, 20 + (name == "cls"), 32)  # no [CLS]; cls adds its summary
    np.testing.assert_allclose(out["image_features"], feats.numpy(), rtol=1e-4, atol=1e-5)


def test_graph_without_head_is_refused(dense_path):
    method = get_method("visionzip")
    config = PruneConfig(method, method.parse(20, {"score": "probe"}), 2)  # an .onnx source: no head known
    with pytest.raises(InputError, match="needs an attention-pooling head"):
        OrtTarget().pipeline(config, CompileOptions(method="visionzip", keep=20))(ir.load(dense_path))


def test_inputs_carry_the_head(tower):
    head = pooling_head(tower)
    inputs = GraphInputs(ir.Value(name="h"), False, 64, head=head)
    assert inputs.head is head and inputs.prefix == 0 and head.heads == 4 and head.k_weight.shape == (32, 32)
