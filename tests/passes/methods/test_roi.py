"""ROI forced keep (passes.methods.roi): the forced set in the graph against numpy and torch, the lift, refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler import roi as host
from vlmprune.compiler.contract import ROI_BOXES, ROI_COUNT, ROI_MASK
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods import get_method, roi
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.cls import emit_selection
from vlmprune.passes.methods.selection import select_topk
from vlmprune.targets.runtime import ort_session

PATCH, GRID = 14, (6, 5)  # a non-square grid: rows and columns must not be swapped
N = GRID[0] * GRID[1]
STANDARD = {"Unsqueeze", "MaxPool", "Reshape", "Greater", "Cast", "Slice", "Sub", "Min", "Less", "Mul", "ReduceMax",
            "Not", "Add", "TopK", "GatherND", "ConstantOfShape", "Shape", "ScatterElements", "MatMul", "Concat"}


def _run(graph: ir.Graph, feed: dict) -> dict[str, np.ndarray]:
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.op_type for n in proto.graph.node} <= STANDARD
    session = ort_session(proto.SerializeToString())
    return {o.name: v for o, v in zip(session.get_outputs(), session.run(None, feed))}


def _forced_graph(kind: str, slots: int = 3, height: int | None = None, width: int | None = None):
    height, width = height or GRID[0] * PATCH, width or GRID[1] * PATCH
    graph = ir.Graph([], [], nodes=[], name="roi", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/roi")
    if kind == roi.MASK:
        mask = ir.Value(name=ROI_MASK, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", height, width]))
        graph.inputs.append(mask)
        forced = roi.emit_mask_forced(b, mask, PATCH, GRID)
    else:
        boxes = ir.Value(name=ROI_BOXES, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", slots, 4]))
        count = ir.Value(name=ROI_COUNT, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch"]))
        graph.inputs.extend([boxes, count])
        forced = roi.emit_box_forced(b, boxes, count, PATCH, GRID)
    graph.extend(b.nodes)
    forced.name = "forced"
    graph.outputs.append(forced)
    layout = {"kind": kind, "patch": PATCH, "grid": list(GRID), "height": height, "width": width}
    return graph, layout


def _random_boxes(seed: int, batch: int, slots: int):
    rng = np.random.default_rng(seed)
    lo = rng.uniform(-10, GRID[1] * PATCH, (batch, slots, 2))
    boxes = np.concatenate([lo, lo + rng.uniform(0, 40, (batch, slots, 2))], axis=-1).astype(np.float32)
    boxes[..., [1, 3]] *= GRID[0] / GRID[1]  # y spans the taller grid
    return {ROI_BOXES: boxes, ROI_COUNT: rng.integers(0, slots + 2, batch).astype(np.int64)}  # count may exceed M


def test_box_forced_set_matches_numpy_and_torch_at_a_fixed_seed():
    graph, layout = _forced_graph(roi.BOXES, slots=3)
    feed = _random_boxes(0, 7, 3)
    got = _run(graph, feed)["forced"]
    expected = host.forced_numpy(layout, feed)
    assert got.shape == (7, N) and expected.any() and not expected.all()
    np.testing.assert_array_equal(got.astype(bool), expected)
    np.testing.assert_array_equal(roi.forced_reference(layout, feed).numpy(), expected)


def test_box_centres_on_edges_count_and_padding():
    graph, layout = _forced_graph(roi.BOXES, slots=2)
    # image 0: a box whose edges pass exactly through the centres of patches (1, 1) and (2, 2); padding ignored
    # image 1: count 0 (every slot padding, each the whole image); image 2: a box between centres (none)
    boxes = np.array([[[21, 21, 35, 35], [0, 0, 70, 84]],
                      [[0, 0, 70, 84], [0, 0, 70, 84]],
                      [[22, 22, 34, 34], [0, 0, 0, 0]]], np.float32)
    feed = {ROI_BOXES: boxes, ROI_COUNT: np.array([1, 0, 1], np.int64)}
    got = _run(graph, feed)["forced"].astype(bool)
    assert np.flatnonzero(got[0]).tolist() == [1 * GRID[1] + 1, 1 * GRID[1] + 2, 2 * GRID[1] + 1, 2 * GRID[1] + 2]
    assert not got[1].any() and not got[2].any()
    np.testing.assert_array_equal(got, host.forced_numpy(layout, feed))


def test_mask_forced_set_any_pixel_and_the_remainder_ignored():
    # 3 pixels past the grid on each side: in no patch, as the patch Conv drops them
    graph, layout = _forced_graph(roi.MASK, height=GRID[0] * PATCH + 3, width=GRID[1] * PATCH + 3)
    rng = np.random.default_rng(1)
    mask = (rng.random((4, layout["height"], layout["width"])) > 0.9985).astype(np.float32)
    mask[3] = 0
    mask[3, -2:, :] = 1.0  # only the remainder rows: nothing forced
    mask[3, 0, 0] = 0.25  # one pixel, any positive value: patch 0
    got = _run(graph, {ROI_MASK: mask})["forced"].astype(bool)
    expected = host.forced_numpy(layout, {ROI_MASK: mask})
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(roi.forced_reference(layout, {ROI_MASK: mask}).numpy(), expected)
    assert np.flatnonzero(got[3]).tolist() == [0] and expected[:3].any()


def _selection_graph(keep: int, bound: float):
    hidden = ir.Value(name="hidden", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", N + 1, 8]))
    scores = ir.Value(name="scores", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", N]))
    forced = ir.Value(name="forced", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", N]))
    graph = ir.Graph([hidden, scores, forced], [], nodes=[], name="lift", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/cls")
    tokens, kept = emit_selection(b, hidden, roi.emit_force_scores(b, scores, forced, bound), keep, N)
    graph.extend(b.nodes)
    tokens.name, kept.name = "tokens", "kept"
    graph.outputs.extend([tokens, kept])
    return graph


@pytest.mark.parametrize("forced_count", [5, 12])  # fewer than K, and more than K
def test_forced_patches_are_kept_inside_k(forced_count):
    keep, bound = 8, 1.2
    rng = np.random.default_rng(2)
    scores = rng.uniform(0, bound, (3, N)).astype(np.float32)
    forced = np.zeros((3, N), np.float32)
    for i in range(3):  # the lowest-scored patches: never kept without the lift
        forced[i, np.argsort(scores[i])[:forced_count]] = 1.0
    hidden = rng.standard_normal((3, N + 1, 8)).astype(np.float32)
    kept = _run(_selection_graph(keep, bound), {"hidden": hidden, "scores": scores, "forced": forced})["kept"]
    ref = select_topk(roi.force_scores(torch.from_numpy(scores), torch.from_numpy(forced > 0), bound), keep)
    np.testing.assert_array_equal(kept, ref.numpy())
    plain = select_topk(torch.from_numpy(scores), keep).numpy()
    assert not host.forced_check(forced > 0, plain)["passed"]  # the check fails without the lift
    verdict = host.forced_check(forced > 0, kept)
    assert verdict["passed"] and verdict["forced"] == [forced_count] * 3
    if forced_count > keep:  # the K forced patches with the best scores
        best = np.sort(np.argsort(np.where(forced > 0, scores, -1), axis=1)[:, ::-1][:, :keep], axis=1)
        np.testing.assert_array_equal(kept, best)


def test_forced_check_reports_a_missing_patch():
    forced = np.zeros((2, N), bool)
    forced[:, [3, 4]] = True
    verdict = host.forced_check(forced, np.array([[0, 3, 4], [0, 1, 3]]))
    assert not verdict["passed"] and verdict["missing"] == [0, 1] and verdict["rows_wrong"] == 1


def test_cls_takes_roi_and_describes_it():
    method = get_method("cls")
    params = method.parse(16, {"roi": "boxes"})
    assert params["roi_max"] == roi.DEFAULT_MAX_BOXES and method.roi_bound(params) == 1.0
    assert "forced keep" in method.describe(params)
    assert "roi_max" not in method.parse(16, {"roi": "mask"})


@pytest.mark.parametrize("name, options, match", [
    ("divprune", {}, "greedy or budgeted"),
    ("dart", {}, "greedy or budgeted"),
    ("holov", {}, "greedy or budgeted"),
    ("random", {}, "baseline"),
    ("grid", {}, "baseline"),
    ("cls", {"budget": "adaptive"}, "--budget adaptive"),
    ("cls", {"score": "attention"}, "2x2-merged"),
    ("cls", {"roi": "box"}, "--roi must be one of"),
    ("cls", {"roi_max": 3}, "give --roi boxes"),
    ("cls", {"roi": "mask", "roi_max": 3}, "applies to --roi boxes"),
    ("cls", {"roi": "boxes", "roi_max": 0}, "--roi-max must be"),
])
def test_refusals_in_one_line(name, options, match):
    opts = {"roi": "boxes", **options} if "roi" not in options and "roi_max" not in options else options
    with pytest.raises(InputError, match=match) as info:
        get_method(name).parse(16, opts)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec, params, match", [
    (SiteSpec(64, True, merge=2), {}, "merged tokens"),
    (SiteSpec(64, True, has_pixels=False), {}, "no patch-embedding Conv"),
    (SiteSpec(64, True), {"crops": {"budget": "global"}}, "crops"),
])
def test_sites_without_one_patch_grid_are_refused(spec, params, match):
    with pytest.raises(InputError, match=match):
        roi.check({"roi": "mask", **params}, spec)
