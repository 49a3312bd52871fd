"""ONNX Runtime sessions for parity and `vlmprune run`, and what every target's runner feeds beside the pixels.

A runner is called as run(pixels, feeds): feeds holds the graph's other inputs by name, built by the caller that
knows them (parity's fixed-seed prompt rows and ROI, the prompt `run --prompt`, `generate` and `eval` embed, the
region `run --roi-box/--roi-mask` gives), as Polygraphy's runners take a feed dict from its data loaders.
optional_feed checks them against the graph's inputs: a missing prompt is refused, a missing ROI is no region.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_INPUTS, ROI_MASK, TEXT
from vlmprune.compiler.errors import InputError


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


Feeds = Mapping[str, np.ndarray]  # a graph's inputs beside the pixels, by name, as the caller built them


def text_rows(given: np.ndarray | None, batch: int, dim: int) -> np.ndarray:
    """What text_embeds gets for a batch from the caller's rows ([B, T, D], or [T, D] for every image): a copy,
    float32, checked against the batch and the graph's width. None: the caller gave none, which a prompt-aware graph
    refuses in one line rather than guess a prompt."""
    if given is None:
        raise InputError(f"this bundle takes the prompt as its {TEXT} input (a prompt-aware method), and this "
                         "caller gives none (vlmprune run --prompt, generate and eval give it)")
    given = np.asarray(given, dtype=np.float32)
    if given.ndim == 2:
        given = np.broadcast_to(given, (batch, *given.shape))
    if given.ndim != 3 or given.shape[0] != batch or given.shape[2] != dim:
        raise InputError(f"{TEXT} must be [{batch}, T, {dim}] for this batch, got {list(given.shape)}")
    return np.array(given, dtype=np.float32)  # a copy: writable, never the caller's array


def no_roi(batch: int, shapes: dict[str, list]) -> dict[str, np.ndarray]:
    """No region: an empty mask, or no valid box."""
    if ROI_MASK in shapes:
        return {ROI_MASK: np.zeros((batch, *shapes[ROI_MASK][1:]), np.float32)}
    return {ROI_BOXES: np.zeros((batch, *shapes[ROI_BOXES][1:]), np.float32), ROI_COUNT: np.zeros(batch, np.int64)}


def roi_arrays(given: Feeds, batch: int, shapes: dict[str, list]) -> dict[str, np.ndarray]:
    """What a graph's ROI inputs (name -> shape, as its session lists them) get for a batch from the caller's ROI
    arrays (a leading axis of 1 broadcasts over the batch); none given: no region (no_roi)."""
    if not given:
        return no_roi(batch, shapes)
    if set(given) != set(shapes):
        raise InputError(f"this bundle's ROI inputs are {', '.join(sorted(shapes))}; given {', '.join(sorted(given))}")
    out = {}
    for name, value in given.items():
        value = np.asarray(value)
        if value.shape[:1] == (1,) and batch != 1:
            value = np.repeat(value, batch, axis=0)
        out[name] = np.array(value, dtype=np.int64 if name == ROI_COUNT else np.float32)
        want = [batch, *shapes[name][1:]]
        if list(out[name].shape) != want:  # the dimensions after the batch are static (M, H, W)
            raise InputError(f"{name} must be {want} for this batch, got {list(out[name].shape)}")
    return out


def optional_feed(inputs, pixel_values: np.ndarray, feeds: Feeds | None = None) -> dict[str, np.ndarray]:
    """The arrays of a graph's inputs after the pixels (session input metadata or ir.Values: name and shape), from
    the caller's feeds: a prompt-aware graph's text_embeds (text_rows), an --roi graph's ROI inputs (roi_arrays).
    Feeds for inputs the graph does not have are left out (the dense export beside a pruned graph has none)."""
    shapes = {meta.name: list(meta.shape) for meta in inputs}
    feeds = feeds or {}
    batch = len(pixel_values)
    feed = {}
    if TEXT in shapes:
        feed[TEXT] = text_rows(feeds.get(TEXT), batch, shapes[TEXT][-1])
    roi = {name: shape for name, shape in shapes.items() if name in ROI_INPUTS}
    if roi:
        feed.update(roi_arrays({name: feeds[name] for name in ROI_INPUTS if name in feeds}, batch, roi))
    return feed


def run_session(session, pixel_values: np.ndarray, feeds: Feeds | None = None) -> dict[str, np.ndarray]:
    """Run on the pixels; the inputs after them get the caller's feeds (optional_feed), as Polygraphy's runners take
    a feed dict: the prompt's rows, the ROI."""
    inputs = session.get_inputs()
    feed = {inputs[0].name: pixel_values, **optional_feed(inputs[1:], pixel_values, feeds)}
    outputs = session.run(None, feed)
    return {meta.name: value for meta, value in zip(session.get_outputs(), outputs)}
