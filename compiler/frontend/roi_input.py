"""Parity's ROI inputs: the fixed-seed `roi_mask`, or `roi_boxes` + `roi_count`, an --roi graph gets in parity.

vlmprune.compiler.roi's seam (its docstring has the whole story): every target's runner takes the inputs beside
the pixels as explicit feeds (targets.runtime.run_session), and the caller builds them: parity the fixed-seed ROI
of parity_roi (parity_roi_feed), `run --roi-box/--roi-mask` the region its flags give; none is no region.
forced_numpy() and forced_check() are the forced set in numpy and parity's verdict on it. It lives in the
frontend, beside parity's images (frontend.images), because parity and the pipeline (the quantizing targets'
calibration samples) read it and imports run down the data flow; compiler.roi re-exports it.
"""

from __future__ import annotations

import zlib

import numpy as np

from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_INPUTS, ROI_MASK  # noqa: F401  (re-exported)

_SALT = 0x524F4921  # "ROI!": the parity ROI's seeds apart from compiler.prompt's text rows


def kind_of(names) -> str | None:
    """Which ROI inputs a graph's input names hold: "mask", "boxes" or None."""
    names = set(names)
    return "mask" if ROI_MASK in names else "boxes" if ROI_BOXES in names else None


# ---------------------------------------------------------------------------- parity's ROI


def _rectangle(rng, height: int, width: int) -> tuple[float, float, float, float]:
    """A random (x0, y0, x1, y1), each side 15 % to 35 % of the image's: a few patches, well inside K."""
    w, h = rng.uniform(0.15, 0.35) * width, rng.uniform(0.15, 0.35) * height
    x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
    return x0, y0, x0 + w, y0 + h


def parity_roi(pixel_values: np.ndarray, kind: str, max_boxes: int | None = None) -> dict[str, np.ndarray]:
    """The fixed-seed ROI for this batch (module docstring): {input name: array}, from the pixels' own shape.

    Needs nothing but the pixels and the ROI inputs' shapes, so that the runners (which see a session's inputs
    only) and the reference (which sees the record) derive the same arrays."""
    pixel = np.ascontiguousarray(pixel_values)
    batch, height, width = len(pixel), pixel.shape[-2], pixel.shape[-1]
    # host-side input generation (one generator per image, by its bytes), not the method: a loop is fine here
    rects = [_rectangle(np.random.default_rng([_SALT, zlib.crc32(image.tobytes())]), height, width)
             for image in pixel]
    if kind == "mask":
        mask = np.zeros((batch, height, width), np.float32)
        for i, (x0, y0, x1, y1) in enumerate(rects):
            mask[i, int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))] = 1.0
            mask[i, (int(y0) * 7 + 3) % height, (int(x1) * 5 + 1) % width] = 1.0  # one stray pixel: its patch too
        return {ROI_MASK: mask}
    boxes = np.zeros((batch, max_boxes, 4), np.float32)
    boxes[:, 1:] = [0.0, 0.0, width, height]  # padding slots: the whole image, which roi_count must make ignored
    boxes[:, 0] = np.asarray(rects, np.float32).reshape(batch, 4)
    return {ROI_BOXES: boxes, ROI_COUNT: np.ones(batch, np.int64)}


def parity_roi_feed(pixel_values: np.ndarray, inputs) -> dict[str, np.ndarray]:
    """parity_roi's arrays for the ROI inputs among inputs (a graph's or a manifest's: name and shape); {} where
    they have none."""
    shapes = {i.name: list(i.shape) for i in inputs if i.name in ROI_INPUTS}
    if not shapes:
        return {}
    return parity_roi(pixel_values, kind_of(shapes), shapes[ROI_BOXES][1] if ROI_BOXES in shapes else None)


# ---------------------------------------------------------------------------- the forced set, checked


def forced_numpy(layout: dict, feed: dict[str, np.ndarray]) -> np.ndarray:
    """F [B, N] bool in numpy, from the definition (passes.methods.roi's docstring)."""
    p, (gh, gw) = layout["patch"], layout["grid"]
    if layout["kind"] == "mask":
        mask = np.asarray(feed[ROI_MASK])
        tiles = mask[:, :gh * p, :gw * p].reshape(len(mask), gh, p, gw, p)
        return (tiles > 0).any(axis=(2, 4)).reshape(len(mask), gh * gw)
    boxes, count = np.asarray(feed[ROI_BOXES], np.float64), np.asarray(feed[ROI_COUNT])
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    cx, cy = (cols + 0.5) * p, (rows + 0.5) * p
    b = boxes[:, :, :, None]
    inside = (cx >= b[:, :, 0]) & (cx <= b[:, :, 2]) & (cy >= b[:, :, 1]) & (cy <= b[:, :, 3])  # [B, M, N]
    valid = np.arange(boxes.shape[1])[None, :] < count[:, None]
    return (inside & valid[:, :, None]).any(axis=1)


def forced_check(forced: np.ndarray, kept: np.ndarray) -> dict:
    """Parity's verdict: per image, every forced patch kept (with more forced than K: every kept patch forced)."""
    forced, kept = np.asarray(forced, bool), np.asarray(kept, np.int64)
    k = kept.shape[1]
    kept_mask = np.zeros_like(forced)
    np.put_along_axis(kept_mask, np.clip(kept, 0, forced.shape[1] - 1), kept >= 0, axis=1)
    counts = forced.sum(axis=1)
    missing = np.where(counts <= k, (forced & ~kept_mask).sum(axis=1), (kept_mask & ~forced).sum(axis=1))
    # "exact" rows, as compiler.report draws integer outputs: one row per image
    return {"passed": bool((missing == 0).all()), "exact": True, "rows_compared": int(len(forced)),
            "rows_wrong": int((missing > 0).sum()), "forced": counts.astype(int).tolist(), "keep": int(k),
            "missing": missing.astype(int).tolist()}
