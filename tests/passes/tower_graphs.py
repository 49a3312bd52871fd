"""Shared by the fusion tests: a tiny tower exported as compile exports it, and one ONNX Runtime run of a graph."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort


def export(model_dir) -> ir.Model:
    from vlmprune.compiler.frontend import export_onnx, load_source

    source = load_source(str(model_dir))
    return export_onnx(source.pipeline, source.image_size, None, 18)  # a dynamic batch, as compile exports


def run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 3
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


def fuse(model: ir.Model, rules: list, required: bool = False, debug: bool = False) -> ir.Model:
    """Apply a target's own com.microsoft rules as the ort target does (optional), or as rules that must fire."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from vlmprune.passes.fusion import FusionPass

    FusionPass(rules if required else [], {"com.microsoft": 1}, debug=debug,
               optional=[] if required else rules)(model)
    RemoveUnusedNodesPass()(model)
    return model
