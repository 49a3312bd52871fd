"""ROI forced keep (`--roi mask|boxes`): patches inside a region of interest are always kept, counted inside K.

A detector's boxes, a segmentation mask or OCR regions name the parts of an image that must
reach the LLM whatever the pruning score says. The bundle takes them as optional inputs
beside the pixels (compiler.roi feeds them), and the graph turns them into the forced set
F [B, N] (1 where patch i is forced) in standard ops with static shapes:

- `--roi mask`: input `roi_mask` [B, H, W] float32 at the pixel input's resolution (H, W its
  own; a PNG's uint8 is converted on the host, so every target takes one float input). A
  patch is forced where ANY of its pixels is set (> 0): MaxPool with kernel = stride = the
  patch size, as the patch embedding tiles the image (pixels past the last whole patch are in
  no patch, as the Conv drops them). "Any" rather than "majority": a region is marked because
  it must be seen, and thin content (a text line a few pixels high, an object edge) covers
  less than half of the patches it runs through; majority would drop exactly those.
- `--roi boxes`: inputs `roi_boxes` [B, M, 4] float32, (x0, y0, x1, y1) in pixels of the
  tower's input, and `roi_count` [B] int64, how many leading boxes are valid (the rest are
  padding: M is static, `--roi-max`, default 4). Patch (r, c) is forced where its centre
  ((c + 0.5)·p, (r + 0.5)·p) lies in a valid box, edges included. A box that holds no patch
  centre (smaller than a patch, between centres) forces nothing.

Counted inside K, for score-based methods (Method.selection BY_SCORE) that declare the bound
of their scores (Method.roi_bound: cls's normalised A + λ·V is at most 1 + λ): F·(bound + 1)
is added to the scores before the TopK, so every forced patch ranks above every unforced one
and the selection, the summary token and kept_indices are the method's own. If more than K
patches are forced, the K forced patches with the best scores are kept (the method's own
order among them, ties to the lower index). Parity's reference does the same on the same
feed, and parity checks, per image, that every forced patch is kept (or, with more than K
forced, that every kept patch is forced): compiler.parity.forced_check.

Refused in one line: greedy and budgeted selections (divprune, dart, cdpruner, holov: no
per-patch score to lift; their picks depend on each other), baselines (random, grid: the
same patches for every image by definition), methods without a declared bound, --budget
adaptive (K is decided from the scores the boost would change), merged grids (Qwen2-VL's
2x2-merged tokens, LLaVA-NeXT's crops: no single patch grid of the pixel input), and a graph
whose pixel input and patch grid are not found.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_MASK
from vlmprune.compiler.errors import InputError, StructureError

MASK, BOXES = "mask", "boxes"
KINDS = (MASK, BOXES)
DEFAULT_MAX_BOXES = 4
GENERIC = {
    "roi": (str, "mask or boxes: ROI forced keep, patches in the region always kept, counted inside K (inputs "
                 "roi_mask [B, H, W], or roi_boxes [B, M, 4] + roi_count [B]; score-based methods: cls)"),
    "roi_max": (int, f"--roi boxes: M, the box slots of roi_boxes (default {DEFAULT_MAX_BOXES})"),
}


def parse(method, params: dict) -> dict:
    """Check --roi / --roi-max for `method`; params gains roi_max with --roi boxes. One line for what it refuses."""
    kind, slots = params.get("roi"), params.get("roi_max")
    if kind is None:
        if slots is not None:
            raise InputError("--roi-max sets the box slots of --roi boxes; give --roi boxes with it")
        return params
    if kind not in KINDS:
        raise InputError(f"--roi must be one of {', '.join(KINDS)}, got {kind!r}")
    why = refusal(method, params)
    if why:
        raise InputError(f"method {method.name} cannot take --roi: {why}")
    if kind == MASK:
        if slots is not None:
            raise InputError("--roi-max applies to --roi boxes (a mask has no box slots)")
        return params
    slots = DEFAULT_MAX_BOXES if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 256:
        raise InputError(f"--roi-max must be an integer in 1..256, got {slots!r}")
    params["roi_max"] = slots
    return params


def refusal(method, params: dict) -> str | None:
    """Why `method` with these parameters cannot keep forced patches inside K, or None."""
    if method.baseline:
        return "it is a baseline that keeps the same patches for every image"
    if method.selection != "score":
        return ("its selection is greedy or budgeted (each pick depends on the others), with no per-patch score "
                "that forced patches could be lifted above")
    if params.get("budget") == "adaptive":
        return "--budget adaptive decides K from the scores that forcing would change"
    if params.get("score") == "attention":
        return "--score attention ranks Qwen2-VL's 2x2-merged tokens, which have no single patch grid"
    if not method.roi_keep:
        return "it declares no bound of its scores to lift forced patches above (Method.roi_keep, roi_bound)"
    return None


def check(params: dict, spec) -> None:
    """Refuse a site without one patch grid of the pixel input."""
    if params.get("roi") is None:
        return
    if "crops" in params:
        raise InputError("--roi needs one patch grid per image, and LLaVA-NeXT's crops are several")
    if spec.frames > 1:
        raise InputError(f"--roi needs one patch grid, and a clip's tokens are {spec.frames} frames' grids "
                         "(compile --video-frames)")
    if spec.merge is not None and spec.merge >= 2:
        raise InputError("--roi needs one patch grid, and this tower's merged tokens (Qwen2-VL's 2x2 merges) have none")
    if not spec.has_pixels:
        raise InputError("--roi maps regions onto the patch grid of the pixel input, which this graph does not show "
                         "(no patch-embedding Conv found)")


def describe(params: dict) -> str:
    """What --roi adds to the method's one-line description."""
    kind = params.get("roi")
    if kind is None:
        return ""
    what = f"roi_boxes (M = {params['roi_max']})" if kind == BOXES else "roi_mask"
    return f"; forced keep: patches in {what} always kept, inside K"


def layout(params: dict, structure) -> dict:
    """What the bundle's ROI inputs are (the manifest and the record hold it; compiler.roi reads it)."""
    pixel = structure.pixel_input
    height, width = (pixel.shape[2], pixel.shape[3]) if pixel.shape is not None and len(pixel.shape) == 4 else (0, 0)
    if not isinstance(height, int) or not isinstance(width, int) or not height or not width:
        raise StructureError("--roi needs the pixel input's static height and width")
    kind = params["roi"]
    found = {"kind": kind, "height": height, "width": width, "patch": structure.patch_size,
             "grid": list(structure.grid), "inputs": [ROI_MASK] if kind == MASK else [ROI_BOXES, ROI_COUNT]}
    if kind == BOXES:
        found["max_boxes"] = params["roi_max"]
    return found


def centres(grid, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of every patch centre in raster order, [N] float32 each, in pixels of the tower's input."""
    rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    return ((cols.reshape(-1) + 0.5) * patch).astype(np.float32), ((rows.reshape(-1) + 0.5) * patch).astype(np.float32)


# ---------------------------------------------------------------------------- graph


def add_inputs(graph: ir.Graph, b, params: dict, structure, batch) -> tuple[ir.Value, dict] | None:
    """With --roi: the new graph inputs and the nodes computing F [B, N] float (0/1); (F, layout), else None."""
    if params.get("roi") is None:
        return None
    if structure is None or structure.pixel_input is None or structure.grid is None:
        raise StructureError("--roi needs the pixel input and patch grid, which this graph does not show")
    found = layout(params, structure)
    if found["kind"] == MASK:
        mask = ir.Value(name=ROI_MASK, type=ir.TensorType(ir.DataType.FLOAT),
                        shape=ir.Shape([batch, found["height"], found["width"]]))
        graph.inputs.append(mask)
        return emit_mask_forced(b, mask, found["patch"], found["grid"]), found
    boxes = ir.Value(name=ROI_BOXES, type=ir.TensorType(ir.DataType.FLOAT),
                     shape=ir.Shape([batch, found["max_boxes"], 4]))
    count = ir.Value(name=ROI_COUNT, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch]))
    graph.inputs.extend([boxes, count])
    return emit_box_forced(b, boxes, count, found["patch"], found["grid"]), found


def emit_mask_forced(b, mask: ir.Value, patch: int, grid) -> ir.Value:
    """roi_mask [B, H, W] -> F [B, N] float: 1 where any pixel of the patch is > 0 (MaxPool over each patch)."""
    n = grid[0] * grid[1]
    x = b.unsqueeze(mask, [1], "roi_mask4")  # [B, 1, H, W]
    pooled = b.op("MaxPool", [x], "roi_mask_pool", kernel_shape=[patch, patch], strides=[patch, patch])
    flat = b.op("Reshape", [pooled, b.ints("roi_mask_flat_shape", [-1, n])], "roi_mask_flat")  # [B, N]
    return b.op("Cast", [b.op("Greater", [flat, b.scalar("roi_zero", 0.0)], "roi_mask_set")], "roi_forced",
                to=ir.DataType.FLOAT)


def emit_box_forced(b, boxes: ir.Value, count: ir.Value, patch: int, grid) -> ir.Value:
    """roi_boxes [B, M, 4], roi_count [B] -> F [B, N] float: 1 where the patch centre lies in a valid box.

    inside = min(cx - x0, x1 - cx, cy - y0, y1 - cy) >= 0 per (box, patch); invalid slots get -1
    there, so that one ReduceMax over the boxes and one comparison decide (rank <= 3 throughout)."""
    slots = boxes.shape[1] if boxes.shape is not None else None
    cx, cy = centres(grid, patch)
    px = b.const("roi_cx", cx.reshape(1, 1, -1))  # [1, 1, N]
    py = b.const("roi_cy", cy.reshape(1, 1, -1))
    edge = [b.slice(boxes, i, i + 1, 2, f"roi_{name}") for i, name in enumerate(("x0", "y0", "x1", "y1"))]  # [B, M, 1]
    gaps = [b.op("Sub", [px, edge[0]], "roi_gap_x0"), b.op("Sub", [edge[2], px], "roi_gap_x1"),
            b.op("Sub", [py, edge[1]], "roi_gap_y0"), b.op("Sub", [edge[3], py], "roi_gap_y1")]
    inside = b.op("Min", gaps, "roi_inside")  # [B, M, N]
    slot_ids = b.ints("roi_slots", np.arange(slots).reshape(1, -1))  # [1, M]
    valid = b.op("Cast", [b.op("Less", [slot_ids, b.unsqueeze(count, [1], "roi_count2")], "roi_valid_b")],
                 "roi_valid", to=ir.DataType.FLOAT)  # [B, M]
    valid = b.unsqueeze(valid, [2], "roi_valid3")  # [B, M, 1]
    one = b.scalar("roi_one", 1.0)
    # valid: the gap itself; padding: -1 (outside), whatever its box holds
    gated = b.op("Sub", [b.op("Mul", [inside, valid], "roi_gap_valid"), b.op("Sub", [one, valid], "roi_invalid")],
                 "roi_gated")
    best = b.reduce("ReduceMax", gated, [1], 0, "roi_best")  # [B, N]
    return b.op("Cast", [b.op("Not", [b.op("Less", [best, b.scalar("roi_zero", 0.0)], "roi_outside")],
                              "roi_in")], "roi_forced", to=ir.DataType.FLOAT)


def emit_force_scores(b, scores: ir.Value, forced: ir.Value | None, bound: float, dtype=None) -> ir.Value:
    """scores + F·(bound + 1): forced patches rank first (module docstring); scores unchanged without --roi."""
    if forced is None:
        return scores
    elem = dtype or ir.DataType.FLOAT
    f = forced if elem == ir.DataType.FLOAT else b.op("Cast", [forced], "roi_forced_cast", to=elem)
    lift = b.op("Mul", [f, b.scalar("roi_lift", bound + 1.0, elem.numpy())], "roi_lift_scores")
    return b.op("Add", [scores, lift], "roi_scores")


# ---------------------------------------------------------------------------- reference


def forced_reference(found: dict, feed: dict[str, np.ndarray]) -> torch.Tensor:
    """F [B, N] bool in torch, from the ROI inputs' values (the parity reference's; batched, no host sync)."""
    patch, (gh, gw) = found["patch"], found["grid"]
    if found["kind"] == MASK:
        mask = torch.as_tensor(np.asarray(feed[ROI_MASK], dtype=np.float32))[:, :gh * patch, :gw * patch]
        tiles = mask.reshape(mask.shape[0], gh, patch, gw, patch).amax(dim=(2, 4))
        return (tiles > 0).reshape(mask.shape[0], gh * gw)
    boxes = torch.as_tensor(np.asarray(feed[ROI_BOXES], dtype=np.float32))  # [B, M, 4]
    count = torch.as_tensor(np.asarray(feed[ROI_COUNT], dtype=np.int64))  # [B]
    cx, cy = (torch.from_numpy(c) for c in centres((gh, gw), patch))
    x0, y0, x1, y1 = (boxes[..., i:i + 1] for i in range(4))
    inside = (cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)  # [B, M, N]
    valid = torch.arange(boxes.shape[1]).unsqueeze(0) < count.unsqueeze(1)  # [B, M]
    return (inside & valid.unsqueeze(-1)).any(dim=1)


def force_scores(scores: torch.Tensor, forced: torch.Tensor | None, bound: float) -> torch.Tensor:
    """The reference of emit_force_scores."""
    if forced is None:
        return scores
    return scores + forced.to(scores.dtype) * (bound + 1.0)
