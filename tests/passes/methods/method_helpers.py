"""A method's emission on its own: a graph whose input is the site's tokens, run by ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs
from vlmprune.passes.methods.builder import Builder
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
    graph.extend(b.nodes)
    tokens.name, kept.name = "tokens", "kept_indices"
    graph.outputs.extend([tokens, kept])
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    return method, params, model


def run(model: ir.Model, x: np.ndarray, libs=()) -> dict[str, np.ndarray]:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return run_session(ort_session(proto.SerializeToString(), libs), x)


def reference(method, params, x: np.ndarray, has_cls: bool = False):
    with torch.inference_mode():
        return method.reference(params, SiteTensors(torch.from_numpy(x), has_cls))


def tokens(seed: int, b: int, n: int, d: int) -> np.ndarray:
    """Seeded tokens with structure: clusters of similar rows, as projector outputs have."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((8, d))
    x = centres[rng.integers(0, 8, size=(b, n))] + 0.5 * rng.standard_normal((b, n, d))
    return x.astype(np.float32)
