"""The ROI inputs of `--roi mask|boxes` bundles: who feeds `roi_mask`, or `roi_boxes` + `roi_count`.

The graph side (the forced set F [B, N], the lift of forced patches' scores above every other,
the refusals) is passes.methods.roi; the record and the manifest's inputs say which ROI
inputs a bundle has and its layout (kind, the pixel input's H and W, the patch size and
grid, M). The seam is compiler.prompt's: every target's runner takes the ROI inputs as explicit feeds,
run(pixels, {name: array}) (targets.runtime.run_session), from the caller that knows them:

- parity (compile, `vlmprune check`): parity_roi_feed, a fixed-seed ROI per image seeded by the
  image's own bytes (CRC-32, salted apart from compiler.prompt's rows), so that it does not
  depend on how the batch is chunked, and from the pixels' shape alone, so that a runner (which
  sees a session's inputs) and the reference (which sees the record) derive the same arrays:
  for boxes, one box of 15 % to 35 % of each side (a few patches, inside K) and, in every
  padding slot, a box over the whole image that roi_count must make the graph ignore; for a
  mask, that rectangle of set pixels plus one stray pixel (forcing its patch too). The QNN
  target's calibration samples carry the same (targets.qnn);
- `vlmprune run --roi-box x0,y0,x1,y1` (repeatable; pixels of the tower's input, as the
  model saw the image: `run --show` draws that) or `--roi-mask FILE.png` (the tower input's
  H x W, any non-zero pixel set): the same ROI for every image of the batch;
- no ROI feeds (`run` without either flag, `compare`, `generate`, `eval`, the benchmark): no
  region (roi_count 0, an empty mask: targets.runtime.no_roi), i.e. the method's own selection.
  Unlike a prompt, "nothing forced" is a well-defined input, so there is nothing to refuse;
  parity feeds its ROI explicitly, and a stage that was fed no region fails its forced-patch check.

forced_numpy() is the forced set in numpy, independent of the graph's and the torch
reference's arithmetic: tests and `run --show` (the hatched patches) read it, and
forced_check() is parity's verdict on a candidate's kept indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_MASK
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.roi_input import (ROI_INPUTS, forced_check, forced_numpy, kind_of,  # noqa: F401
                                                  parity_roi, parity_roi_feed)  # re-exported
from vlmprune.targets.runtime import no_roi  # noqa: F401  (re-exported)

# ---------------------------------------------------------------------------- run's flags


def boxes_from_flags(texts, layout: dict) -> dict[str, np.ndarray]:
    """`--roi-box x0,y0,x1,y1` (repeatable) -> {roi_boxes [1, M, 4], roi_count [1]}: pixels of the tower's input."""
    slots = layout["max_boxes"]
    if len(texts) > slots:
        raise InputError(f"this bundle takes at most {slots} boxes (--roi-max {slots} at compile time), "
                         f"got {len(texts)} --roi-box")
    boxes = np.zeros((1, slots, 4), np.float32)
    for i, text in enumerate(texts):
        try:
            values = [float(v) for v in str(text).split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or not np.all(np.isfinite(values)):
            raise InputError(f"--roi-box must be four numbers x0,y0,x1,y1, got {text!r}")
        x0, y0, x1, y1 = values
        if not (x0 < x1 and y0 < y1):
            raise InputError(f"--roi-box {text}: needs x0 < x1 and y0 < y1")
        if x1 <= 0 or y1 <= 0 or x0 >= layout["width"] or y0 >= layout["height"]:
            raise InputError(f"--roi-box {text} lies outside the tower's {layout['width']}x{layout['height']} input")
        # Past the input: clipping it would force other patches than the user drew, silently.
        if x0 < 0 or y0 < 0 or x1 > layout["width"] or y1 > layout["height"]:
            raise InputError(f"--roi-box {text} reaches past the tower's {layout['width']}x{layout['height']} input "
                             f"(pixels of the input as the model sees it: x 0..{layout['width']}, "
                             f"y 0..{layout['height']})")
        boxes[0, i] = values
    return {ROI_BOXES: boxes, ROI_COUNT: np.array([len(texts)], np.int64)}


def mask_from_file(path, layout: dict) -> dict[str, np.ndarray]:
    """`--roi-mask FILE.png` -> {roi_mask [1, H, W]}: any non-zero pixel (of any channel) is set."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(Path(path)) as image:
            mask = np.asarray(image.convert("L" if image.mode not in ("L", "1") else image.mode))
    except (OSError, UnidentifiedImageError) as exc:
        raise InputError(f"--roi-mask {path}: not an image ({exc})") from None
    if mask.shape != (layout["height"], layout["width"]):
        raise InputError(f"--roi-mask {path} is {mask.shape[1]}x{mask.shape[0]}; it must be the tower input's "
                         f"{layout['width']}x{layout['height']}")
    return {ROI_MASK: (mask > 0).astype(np.float32)[None]}


def run_roi(layout: dict | None, boxes=(), mask=None) -> dict | None:
    """What `run` feeds: the flags' ROI, {} without them (no region), None for a bundle without ROI inputs."""
    if layout is None:
        if boxes or mask is not None:
            raise InputError("--roi-box and --roi-mask apply to bundles compiled with --roi; this one has no ROI input")
        return None
    if layout["kind"] == "mask":
        if boxes:
            raise InputError("this bundle takes a mask (--roi mask): give --roi-mask, not --roi-box")
        return {} if mask is None else mask_from_file(mask, layout)
    if mask is not None:
        raise InputError("this bundle takes boxes (--roi boxes): give --roi-box, not --roi-mask")
    return boxes_from_flags(boxes, layout) if boxes else {}


def forced_for_run(layout: dict | None, given: dict | None, batch: int) -> np.ndarray | None:
    """F [B, N] of what `run` fed (run_roi's answer), for `run --show`'s hatching; None where nothing is forced."""
    if layout is None or not given:
        return None
    feed = {name: np.repeat(np.asarray(v), batch, axis=0) if np.shape(v)[0] == 1 else np.asarray(v)
            for name, v in given.items()}
    return forced_numpy(layout, feed)


