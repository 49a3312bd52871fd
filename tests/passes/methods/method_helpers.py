"""A method's emission on its own: a graph whose input is the site's tokens, run by ONNX Runtime; and the
inserted tower graph checked against the torch pipeline with the same pruner."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.contract import NUM_TOKENS
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.compiler.parity.reference import MethodPruner, padded_outputs
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.prune import KEPT_INDICES, prune_record
from vlmprune.targets.runtime import ort_session, run_session


def features_model(name: str, n: int, d: int, keep: int, has_cls: bool = False, formulation: str | None = None,
                   **options) -> tuple:
    """(method, params, model): tokens [batch, (1)+N, D] -> (tokens, kept_indices), the method's nodes only."""
    method = get_method(name)
    params = method.parse(keep, options)
    hidden = ir.Value(name="hidden", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", n + has_cls, d]))
    graph = ir.Graph([hidden], [], nodes=[], name=name, opset_imports={"": 18})
    b = Builder(graph, 18, f"vlmprune/{name}")
    tokens, kept = method.emit(b, params, GraphInputs(hidden, has_cls, n), formulation or method.formulations[0])
    return method, params, finish(graph, b, tokens, kept)


def finish(graph: ir.Graph, b: Builder, tokens: ir.Value, kept: ir.Value, *extra: ir.Value) -> ir.Model:
    """The emitted nodes in `graph`, its outputs (tokens, kept_indices, *extra), shapes inferred: a runnable model."""
    graph.extend(b.nodes)
    tokens.name, kept.name = "tokens", "kept_indices"
    graph.outputs.extend([tokens, kept, *extra])
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    return model


def session(model: ir.Model, libs=()):
    """An ONNX Runtime session of `model`, after the full ONNX checker."""
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return ort_session(proto.SerializeToString(), libs)


def run(model: ir.Model, x: np.ndarray, libs=()) -> dict[str, np.ndarray]:
    return run_session(session(model, libs), x)


def reference(method, params, x: np.ndarray, has_cls: bool = False):
    with torch.inference_mode():
        return method.reference(params, SiteTensors(torch.from_numpy(x), has_cls))


def tokens(seed: int, b: int, n: int, d: int) -> np.ndarray:
    """Seeded tokens with structure: clusters of similar rows, as projector outputs have."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((8, d))
    x = centres[rng.integers(0, 8, size=(b, n))] + 0.5 * rng.standard_normal((b, n, d))
    return x.astype(np.float32)


def assert_matches_pipeline(model: ir.Model, method, params: dict, source, x: np.ndarray,
                            slots: int) -> dict[str, np.ndarray]:
    """The inserted tower graph run by ORT equals the torch pipeline with the same pruner at the recorded layer:
    kept indices and token counts exactly, features to fp32 rounding (padded to `slots` rows). Returns ORT's outputs."""
    out = run_session(ort_session(ir.to_proto(model).SerializeToString()), x)
    with torch.inference_mode():
        pipeline = source.pipeline.with_pruner(MethodPruner(method, params, "block", prune_record(model).layer))
        feats, kept = pipeline(torch.from_numpy(x))
    expected = padded_outputs(feats.numpy(), slots, pipeline.last_trace["num_tokens"])
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    np.testing.assert_array_equal(out[NUM_TOKENS], expected[NUM_TOKENS])
    np.testing.assert_allclose(out["image_features"], expected["image_features"], rtol=1e-4, atol=1e-5)
    return out
