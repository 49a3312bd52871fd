"""evs: vLLM's retention mask (vllm/multimodal/evs.py) restated per clip, the batched reference against it on random
clips, ties and identical frames, the graph (standard ops, static shapes) against the reference, and the refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from method_helpers import finish, run
from video_references import vllm_count, vllm_mask
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import GraphInputs, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.evs import EvsMethod, dissimilarity, retained_tokens

METHOD = EvsMethod()


def evs_model(frames: int, per_frame: int, d: int, keep: int, prefix: int = 0, **options):
    """(params, model): tokens [batch, prefix + T·HW, D] -> (tokens, kept_indices), EVS's nodes only."""
    params = METHOD.parse(keep, options)
    n = frames * per_frame
    params = METHOD.at_site(params, SiteSpec(n, bool(prefix), frames=frames))
    METHOD.check(params, SiteSpec(n, bool(prefix), prefix=prefix, frames=frames))
    hidden = ir.Value(name="hidden", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", prefix + n, d]))
    graph = ir.Graph([hidden], [], nodes=[], name="evs", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/evs")
    tokens, kept = METHOD.emit(b, params, GraphInputs(hidden, bool(prefix), n, prefix=prefix, frames=frames),
                               "standard")
    return params, finish(graph, b, tokens, kept)


def reference(params: dict, x: np.ndarray, frames: int, prefix: int = 0):
    with torch.inference_mode():
        return METHOD.reference(params, SiteTensors(torch.from_numpy(x), bool(prefix), prefix=prefix, frames=frames))


def clips(seed: int, b: int, frames: int, per_frame: int, d: int, still: float = 0.8) -> np.ndarray:
    """Seeded clips whose positions mostly stay (a still background with noise) and partly change."""
    rng = np.random.default_rng(seed)
    first = rng.standard_normal((b, 1, per_frame, d))
    drift = rng.standard_normal((b, frames, per_frame, d)) * np.where(rng.random((b, frames, per_frame, 1)) < still,
                                                                        0.05, 1.0)
    return (first + np.cumsum(drift, axis=1)).reshape(b, frames * per_frame, d).astype(np.float32)


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1 / 3])
@pytest.mark.parametrize("per_frame,frames", [(16, 4), (64, 8), (256, 32), (25, 3)])
def test_count_is_vllms(q, per_frame, frames):
    assert retained_tokens(per_frame, frames, q) == vllm_count(per_frame, frames, q)
    params = METHOD.at_site(METHOD.parse(7, {"video_pruning_rate": q}), SiteSpec(per_frame * frames, False,
                                                                                 frames=frames))
    assert params["keep"] == vllm_count(per_frame, frames, q)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("q", [0.5, 0.75])
def test_reference_is_vllms_mask_on_random_clips(seed, q):
    frames, per_frame = 8, 16
    x = clips(seed, 3, frames, per_frame, 24)
    keep = retained_tokens(per_frame, frames, q)
    got = reference({"keep": keep}, x, frames)
    for clip, kept in zip(x, got.kept.numpy()):
        assert np.flatnonzero(vllm_mask(clip, frames, keep)).tolist() == kept.tolist()
    assert (got.kept[:, :per_frame] == torch.arange(per_frame)).all()  # the first frame, always
    np.testing.assert_array_equal(got.tokens.numpy(), np.take_along_axis(x, got.kept.numpy()[..., None], 1))


def test_dissimilarity_is_one_minus_torch_cosine():
    x = torch.from_numpy(clips(3, 2, 4, 9, 8)).double()
    want = 1 - torch.nn.functional.cosine_similarity(x.reshape(2, 4, 9, 8)[:, 1:], x.reshape(2, 4, 9, 8)[:, :-1],
                                                     dim=-1)
    got = dissimilarity(x, 4).reshape(2, 4, 9)
    assert (got[:, 0] == 255).all()
    torch.testing.assert_close(got[:, 1:], want, rtol=0, atol=1e-12)


def ties_clip() -> np.ndarray:
    """One-hot rows (cosines exactly 0 or 1): frame 1 repeats frame 0 but for positions 2 and 5; frame 2 changes
    positions 1, 2, 5 and 7. Dissimilarities are exactly 0 or 1, so the cut falls inside a group of equal scores."""
    eye = np.eye(8, dtype=np.float32)
    f0 = eye.copy()
    f1 = f0.copy()
    f1[[2, 5]] = eye[[3, 6]]
    f2 = f1.copy()
    f2[[1, 2, 5, 7]] = eye[[0, 0, 0, 0]]
    return np.concatenate([f0, f1, f2])[None]


@pytest.mark.parametrize("keep", [8, 9, 10, 11, 13, 20])
def test_ties_go_to_the_earlier_frame_then_the_lower_position(keep):
    x = ties_clip()
    params, model = evs_model(3, 8, 8, keep)
    out = run(model, x)
    ref = reference(params, x, 3)
    want = np.flatnonzero(vllm_mask(x[0], 3, keep))
    assert ref.kept[0].tolist() == want.tolist() == out["kept_indices"][0].tolist()
    # score 255: frame 0; score 1 (changed), in index order; score 0 (repeated), in index order
    order = [*range(8), 10, 13, 17, 18, 21, 23, 8, 9, 11, 12, 14, 15, 16, 19, 20, 22]
    assert want.tolist() == sorted(order[:keep])


def test_identical_frames_are_pruned_first_and_a_scene_cut_kept():
    rng = np.random.default_rng(5)
    still = rng.standard_normal((1, 16, 12)).astype(np.float32)
    cut = rng.standard_normal((1, 16, 12)).astype(np.float32)
    x = np.concatenate([still, still, still, cut], axis=1)  # frames 0-2 identical, then a scene cut
    params, model = evs_model(4, 16, 12, 32)
    out = run(model, x)
    ref = reference(params, x, 4)
    expected = list(range(16)) + list(range(48, 64))
    assert ref.kept[0].tolist() == out["kept_indices"][0].tolist() == expected
    assert np.flatnonzero(vllm_mask(x[0], 4, 32)).tolist() == expected
    np.testing.assert_allclose(out["tokens"], ref.tokens.numpy(), rtol=0, atol=0)


def test_a_clip_of_one_still_frame_keeps_the_first_frame():
    x = np.repeat(clips(7, 2, 1, 16, 8), 6, axis=1)
    params, model = evs_model(6, 16, 8, 192, video_pruning_rate=0.9)
    assert params["keep"] == 16  # max(HW, int(96 * 0.1) = 9)
    out = run(model, x)
    assert (out["kept_indices"] == np.arange(16)).all()


@pytest.mark.parametrize("prefix,batch", [(0, 1), (0, 3), (1, 2)])
def test_graph_matches_reference(prefix, batch):
    frames, per_frame, d = 8, 16, 24
    params, model = evs_model(frames, per_frame, d, 192, prefix, video_pruning_rate=0.75)
    assert params["keep"] == 32
    ops = {n.op_type for n in model.graph}
    assert ops <= {"Reshape", "ReduceL2", "Max", "Div", "Slice", "Mul", "ReduceSum", "Sub", "Shape", "Concat",
                   "Expand", "TopK", "Unsqueeze", "GatherND"}, ops
    assert [v.shape[1] for v in model.graph.outputs] == [prefix + 32, 32]  # static counts
    x = clips(batch + 10, batch, frames, per_frame, d)
    if prefix:
        x = np.concatenate([np.ones((batch, 1, d), np.float32), x], axis=1)
    out = run(model, x)  # run() holds the model to the full ONNX checker first
    ref = reference(params, x, frames, prefix)
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    assert np.all(np.diff(out["kept_indices"], axis=1) > 0)
    np.testing.assert_allclose(out["tokens"], ref.tokens.numpy(), rtol=0, atol=0)  # copies of input rows
    for clip, kept in zip(x[:, prefix:], out["kept_indices"]):
        assert np.flatnonzero(vllm_mask(clip, frames, 32)).tolist() == kept.tolist()


def test_refusals():
    with pytest.raises(InputError, match="at least 2 frames"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(64, False))
    with pytest.raises(InputError, match=r"16 <= keep < 64"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(64, False, frames=4))
    with pytest.raises(InputError, match=r"16 <= keep < 64"):
        METHOD.check(METHOD.parse(64, {}), SiteSpec(64, False, frames=4))
    with pytest.raises(InputError, match="whole frames"):
        METHOD.check(METHOD.parse(20, {}), SiteSpec(50, False, frames=4))
    with pytest.raises(InputError, match="must be < 1"):
        METHOD.parse(8, {"video_pruning_rate": 1.0})
    with pytest.raises(InputError, match=">= 0"):
        METHOD.parse(8, {"video_pruning_rate": -0.5})
    with pytest.raises(InputError, match="merge"):
        METHOD.parse(8, {"merge": "local"})
    METHOD.check(METHOD.parse(16, {}), SiteSpec(64, False, frames=4))  # the first frame alone is a valid K


def test_registered():
    assert isinstance(get_method("evs"), EvsMethod)
