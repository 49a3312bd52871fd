"""dycoke: DyCoke's TTM (its official dycole_ttm, restated per clip) against the batched reference on random clips,
the official index quirk, ties, the graph (standard ops, static shapes) against the reference, and the refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from method_helpers import finish, run
from video_references import dycoke_official
from vlmprune.compiler import parity
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.dycoke import DyCokeMethod, schedule, total_kept

METHOD = DyCokeMethod()


def dycoke_model(frames: int, per_frame: int, d: int, prefix: int = 0, **options):
    params = METHOD.parse(192, options)
    n = frames * per_frame
    spec = SiteSpec(n, bool(prefix), prefix=prefix, frames=frames)
    params = METHOD.at_site(params, spec)
    METHOD.check(params, spec)
    hidden = ir.Value(name="hidden", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", prefix + n, d]))
    graph = ir.Graph([hidden], [], nodes=[], name="dycoke", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/dycoke")
    tokens, kept = METHOD.emit(b, params, GraphInputs(hidden, bool(prefix), n, prefix=prefix, frames=frames), "standard")
    return params, finish(graph, b, tokens, kept)


def reference(params, x, frames, prefix=0):
    with torch.inference_mode():
        return METHOD.reference(params, SiteTensors(torch.from_numpy(x), bool(prefix), prefix=prefix, frames=frames))


def official_kept(clip: np.ndarray, frames: int, ratio: float) -> list[int]:
    """The official kept tokens as clip indices, each frame's ascending (the order this method returns them in)."""
    per = clip.shape[0] // frames
    return [j * per + i for j, ids in enumerate(dycoke_official(torch.from_numpy(clip), per, ratio)) for i in sorted(ids)]


def clips(seed: int, b: int, frames: int, per: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, 1, per, d)) + np.cumsum(rng.standard_normal((b, frames, per, d)) * 0.3, axis=1)
    return x.reshape(b, frames * per, d).astype(np.float32)


def test_schedule_follows_the_official_indices():
    # odd frames by the previous pair's similarity (the first by the last pair's); frame i + 2 for i < T - 4
    assert schedule(8) == {1: ("pair", 3), 2: ("frame", 0), 3: ("pair", 0), 5: ("pair", 1), 7: ("pair", 2)}
    assert schedule(4) == {1: ("pair", 1), 3: ("pair", 0)}
    assert [j for j, (kind, _) in schedule(16).items() if kind == "frame"] == [2, 6, 10]  # not 14: the bound
    assert total_kept(16, 8, 0.7) == 16 * 3 + 4 * 5


@pytest.mark.parametrize("frames", [4, 8, 16])
@pytest.mark.parametrize("ratio", [0.7, 0.5])
def test_reference_is_the_official_ttm(frames, ratio):
    x = clips(frames, 2, frames, 16, 12)
    params = METHOD.at_site(METHOD.parse(192, {"merging_ratio": ratio}), SiteSpec(frames * 16, False, frames=frames))
    got = reference(params, x, frames)
    for clip, kept in zip(x, got.kept.numpy()):
        assert kept.tolist() == official_kept(clip, frames, ratio)
    assert got.tokens.shape == (2, params["keep"], 12)


def test_ties_go_to_the_lower_index():
    """One-hot rows (cosines exactly 0 or 1): a still clip but for position 5 of frame 1, which changes."""
    frame = np.eye(16, dtype=np.float32)
    moved = frame.copy()
    moved[5] = frame[6]
    x = np.concatenate([frame, moved, frame, frame])[None]
    params, model = dycoke_model(4, 16, 16)
    out = run(model, x)
    ref = reference(params, x, 4)
    # k = int(0.3·16) = 4. Frame 1 by the last pair's (3 vs 2: all equal) similarity; frame 3 by pair 0's (5 moved).
    expected = list(range(16)) + [16, 17, 18, 19] + list(range(32, 48)) + [48, 49, 50, 53]
    assert ref.kept[0].tolist() == out["kept_indices"][0].tolist() == expected  # torch.topk promises no tie order


@pytest.mark.parametrize("frames,prefix,batch", [(8, 0, 1), (8, 0, 3), (16, 1, 2)])
def test_graph_matches_reference(frames, prefix, batch):
    params, model = dycoke_model(frames, 16, 24, prefix)
    ops = {n.op_type for n in model.graph}
    assert ops <= {"Reshape", "ReduceL2", "Max", "Div", "Slice", "Mul", "ReduceSum", "Gather", "Shape", "Concat",
                   "Expand", "TopK", "Add", "Unsqueeze", "GatherND"}, ops
    assert [v.shape[1] for v in model.graph.outputs] == [prefix + params["keep"], params["keep"]]
    x = clips(batch, batch, frames, 16, 24)
    if prefix:
        x = np.concatenate([np.ones((batch, 1, 24), np.float32), x], axis=1)
    out = run(model, x)
    ref = reference(params, x, frames, prefix)
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    np.testing.assert_allclose(out["tokens"], ref.tokens.numpy(), rtol=0, atol=0)
    for clip, kept in zip(x[:, prefix:], out["kept_indices"]):
        assert kept.tolist() == official_kept(clip, frames, 0.7)


def tied_clip(frames: int = 8, per: int = 16, d: int = 24) -> np.ndarray:
    """A still scene with three moving positions (0-2) and two that drift by the same angle (5, and 9 holding 5's
    coordinates permuted): every pruned frame keeps k = int(0.3·16) = 4, the three moving ones and one of 5 and 9,
    whose cosines are equal but for rounding (the sums run in another order)."""
    rng = np.random.default_rng(5)
    perm = rng.permutation(d)
    base = rng.standard_normal((per, d)).astype(np.float32)
    drift = rng.standard_normal(d).astype(np.float32)
    out = []
    for t in range(frames):
        frame = base.copy()
        frame[:3] = rng.standard_normal((3, d))
        frame[5] = base[5] + 0.3 * t * drift
        frame[9] = frame[5][perm]
        out.append(frame)
    return np.stack(out).reshape(1, frames * per, d)


def test_a_tie_inside_a_frame_is_judged_by_that_frame_s_cut():
    """Parity judges each pruned frame's TopK by its own cut: DyCoke has no clip-wide score, and a compile of the
    clip made here on a CLIP tower failed parity on one such tie (two positions of a still background) before each
    frame's cut was in the reference's trace."""
    params, model = dycoke_model(8, 16, 24)
    x = tied_clip()
    ref = reference(params, x, 8)
    cuts = ref.trace["local_cuts"]
    assert [start for start, _, _ in cuts] == [16 * j for j in schedule(8)]
    fp32 = parity.tolerance_for("fp32")
    kept = ref.kept.numpy()
    assert parity.compare_local_cuts(kept, run(model, x)["kept_indices"], cuts, fp32)["passed"]
    frame = 16 * next(iter(schedule(8)))
    assert {frame, frame + 1, frame + 2} <= set(kept[0].tolist())
    other = {frame + 5: frame + 9, frame + 9: frame + 5}
    swapped = np.sort(np.array([[other.get(i, i) for i in kept[0]]]))  # the tie resolved the other way
    assert (swapped != kept).any()
    tied = parity.compare_local_cuts(kept, swapped, cuts, fp32)
    assert tied["passed"] and tied["tie_resolved_images"] == [0] and tied["boundary_ties"][0] >= 2
    moved = np.sort(np.array([[frame + 3 if i == frame else i for i in kept[0]]]))  # a moving position dropped
    assert not parity.compare_local_cuts(kept, moved, cuts, fp32)["passed"]


def test_refusals():
    with pytest.raises(InputError, match="even number of frames, at least 4"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(64, False, frames=2))
    with pytest.raises(InputError, match="even number of frames"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(80, False, frames=5))
    with pytest.raises(InputError, match="must be < 1"):
        METHOD.parse(8, {"merging_ratio": 1.0})
    with pytest.raises(InputError, match="keeps no token"):
        METHOD.check(METHOD.parse(8, {"merging_ratio": 0.99}), SiteSpec(64, False, frames=4))
    assert isinstance(get_method("dycoke"), DyCokeMethod)
