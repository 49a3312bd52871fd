"""ONNX Runtime sessions for parity and `vlmprune run`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def ort_session(model: str | Path | bytes, custom_op_libraries: tuple[Path, ...] = (), providers=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # Two cores here and in CI: leave one to the rest of the process.
    options.intra_op_num_threads = int(os.environ.get("VLMPRUNE_ORT_THREADS", "0"))
    for lib in custom_op_libraries:
        options.register_custom_ops_library(str(lib))
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])


def run_session(session, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
    name = session.get_inputs()[0].name
    outputs = session.run(None, {name: pixel_values})
    return {meta.name: value for meta, value in zip(session.get_outputs(), outputs)}
