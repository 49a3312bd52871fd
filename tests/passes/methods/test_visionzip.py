"""visionzip: target positions, the official merge, the inserted graph on a tiny CLIP tower, refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.compiler.parity.reference import MethodPruner
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.visionzip import VisionZipMethod, contextual_default, target_positions
from vlmprune.passes.prune import KEPT_INDICES, InsertPruningPass, prune_record
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.targets.runtime import ort_session, run_session

METHOD = VisionZipMethod()


def test_defaults_and_positions():
    assert [contextual_default(k) for k in (64, 128, 192)] == [10, 20, 30]
    assert METHOD.parse(192, {})["dominant"] == 162
    targets, others = target_positions(10, 3)
    assert targets.tolist() == [0, 3, 6] and others.tolist() == [1, 2, 4, 5, 7, 8, 9]
    assert target_positions(4, 8)[0].tolist() == [0, 1, 2, 3]  # step max(1, R // K_c)


def official_merge(hidden: np.ndarray, keys: np.ndarray, dominant: list[int], contextual: int) -> np.ndarray:
    """The official contextual tokens for one image (dvlab-research/VisionZip, batch 1), in numpy."""
    remaining = [i for i in range(len(hidden)) if i not in dominant]
    metric = keys[remaining] / np.linalg.norm(keys[remaining], axis=-1, keepdims=True)
    step = max(1, len(remaining) // contextual)
    target_idx = np.arange(0, len(remaining), step)[:contextual]
    merge_idx = np.setdiff1d(np.arange(len(remaining)), target_idx)
    similarity = metric[merge_idx] @ metric[target_idx].T
    assign = np.zeros((len(merge_idx), contextual))
    assign[np.arange(len(merge_idx)), similarity.argmax(axis=1)] = 1
    counts = np.maximum(assign.sum(0), 1)[:, None]
    hidden_rem = hidden[remaining]
    return hidden_rem[target_idx] + assign.T @ hidden_rem[merge_idx] / counts


def test_reference_merge_is_the_official_one():
    g = torch.Generator().manual_seed(0)
    b, h, n, dh, d = 1, 2, 24, 8, 6
    hidden = torch.randn(b, 1 + n, d, generator=g, dtype=torch.float64)
    q, k = (torch.randn(b, h, 1 + n, dh, generator=g, dtype=torch.float64) for _ in range(2))
    params = METHOD.parse(8, {"contextual": 3})
    result = METHOD.reference(params, SiteTensors(hidden, True, q, k, 0.35))
    dominant = result.kept[0, :5].tolist()
    keys = k.mean(dim=1)[0, 1:].numpy()
    expected = official_merge(hidden[0, 1:].numpy(), keys, dominant, 3)
    np.testing.assert_allclose(result.tokens[0, 6:].numpy(), expected, rtol=1e-12)
    assert result.tokens.shape == (1, 1 + 8, d) and result.trace["boundary"] == 5


@pytest.mark.parametrize("layer,batch", [(1, 1), (3, 3)])
def test_inserted_graph_matches_reference(tiny_dense_path, tiny_source, layer, batch):
    params = METHOD.parse(20, {"contextual": 4})
    model = ir.load(tiny_dense_path)
    InsertPruningPass(METHOD, params, layer)(model)
    RetargetTokenCountPass()(model)
    assert prune_record(model).tokens_out == 1 + 20
    x = np.random.default_rng(batch).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = run_session(ort_session(ir.to_proto(model).SerializeToString()), x)
    with torch.inference_mode():
        feats, kept = tiny_source.pipeline.with_pruner(MethodPruner(METHOD, params, "block", layer))(torch.from_numpy(x))
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert np.all(np.diff(out[KEPT_INDICES][:, :16], axis=1) > 0)  # dominant tokens in raster order
    np.testing.assert_allclose(out["image_features"], feats.numpy(), rtol=1e-4, atol=1e-5)


def test_refusals():
    with pytest.raises(InputError, match="0 <= contextual < keep"):
        METHOD.parse(8, {"contextual": 8})
    with pytest.raises(InputError, match="needs a \\[CLS\\] token"):
        METHOD.check(METHOD.parse(8, {}), SiteSpec(64, has_cls=False))
