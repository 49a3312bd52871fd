"""ONNX Runtime sessions for parity and `vlmprune run`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_MASK, TEXT


def ort_session(model: str | Path | bytes, custom_op_libraries: tuple[Path, ...] = (), providers=None, options=None):
    """The product's ONNX Runtime session; `options` (a SessionOptions, e.g. with profiling on) gets its settings."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    options.log_severity_level = 3
    # Two cores here and in CI: leave one to the rest of the process.
    options.intra_op_num_threads = int(os.environ.get("VLMPRUNE_ORT_THREADS", "0"))
    for lib in custom_op_libraries:
        options.register_custom_ops_library(str(lib))
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])


def _text(pixel_values: np.ndarray, metas: dict) -> dict[str, np.ndarray]:
    from vlmprune.compiler.frontend.prompt_input import text_feed

    return {TEXT: text_feed(pixel_values, metas[TEXT].shape[-1])}


def _roi(pixel_values: np.ndarray, metas: dict) -> dict[str, np.ndarray]:
    from vlmprune.compiler.frontend.roi_input import roi_feed

    return roi_feed(pixel_values, {name: list(meta.shape) for name, meta in metas.items()})


# The optional inputs beside the pixels: which input names one feeder fills, from compiler's feeding() blocks.
OPTIONAL_INPUTS = (((TEXT,), _text), ((ROI_MASK, ROI_BOXES, ROI_COUNT), _roi))


def optional_feed(inputs, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of a graph's inputs after the pixels (session input metadata or ir.Values: name and shape)."""
    extra = {meta.name: meta for meta in inputs}
    feed = {}
    for names, feeder in OPTIONAL_INPUTS:
        metas = {name: extra[name] for name in names if name in extra}
        if metas:
            feed.update(feeder(pixel_values, metas))
    return feed


def run_session(session, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
    """Run on the pixels; the optional inputs get their feeders' arrays (OPTIONAL_INPUTS): a prompt-aware graph's
    text_embeds compiler.frontend.prompt_input.text_feed's rows, an --roi graph's ROI inputs compiler.frontend.roi_input.roi_feed's."""
    inputs = session.get_inputs()
    feed = {inputs[0].name: pixel_values, **optional_feed(inputs[1:], pixel_values)}
    outputs = session.run(None, feed)
    return {meta.name: value for meta, value in zip(session.get_outputs(), outputs)}
