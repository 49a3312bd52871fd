"""--budget adaptive: K per image from the score's entropy, against a numpy rendering of the formula, the inserted
graph on a tiny CLIP tower (padding, the summary after each image's rows, num_tokens), refusals."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx_ir.passes.common import RemoveUnusedNodesPass

from method_helpers import assert_matches_pipeline
from vlmprune.compiler.contract import NUM_TOKENS
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import SiteTensors
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.budget import AdaptiveBudget, adaptive_keep, wrap
from vlmprune.passes.outputs import ZeroPaddingPass
from vlmprune.passes.prune import InsertPruningPass
from vlmprune.passes.retarget import RetargetTokenCountPass

CLS = get_method("cls")
# Steep constants: the tiny towers' [CLS] attention is nearly flat (H close to ln 64), so the default ones give every
# image K_max; these spread K over the images.
STEEP = {"budget": "adaptive", "alpha": 50.0, "beta": 1.0, "gamma": -49.0}


def numpy_keep(scores: np.ndarray, alpha: float, beta: float, gamma: float, kmin: int, kmax: int) -> list[int]:
    out = []
    for s in scores:
        p = np.maximum(s, 0) / np.maximum(s, 0).sum()
        h = -sum(x * np.log(x) for x in p if x > 0)
        rho = alpha / (1 + np.exp(-beta * h)) + gamma
        out.append(int(min(max(np.round(rho * len(s)), kmin), kmax)))
    return out


def test_keep_is_the_formula():
    rng = np.random.default_rng(0)
    scores = np.stack([rng.random(64) ** e for e in (1, 4, 16, 64)])  # flatter to peakier
    params = {"alpha": 1.0, "beta": 0.5, "gamma": -0.6, "kmin": 2, "keep": 40}
    got = adaptive_keep(torch.from_numpy(scores), params).tolist()
    assert got == numpy_keep(scores, 1.0, 0.5, -0.6, 2, 40)
    assert got == sorted(got, reverse=True) and got[0] > got[-1]  # a peaked score keeps fewer
    assert CLS.parse(16, {"budget": "adaptive"})["gamma"] == -0.6  # the documented defaults


def test_reference_per_image():
    g = torch.Generator().manual_seed(0)
    b, h, n, dh, d = 3, 2, 48, 8, 6
    hidden = torch.randn(b, 1 + n, d, generator=g, dtype=torch.float64)
    q, k = (torch.randn(b, h, 1 + n, dh, generator=g, dtype=torch.float64) for _ in range(2))
    k[0] *= 4.0  # a peaked image
    params = CLS.parse(20, {"budget": "adaptive", "alpha": 1.0, "beta": 2.0, "gamma": -0.7})
    result = wrap(CLS, params).reference(params, SiteTensors(hidden, True, q, k, 0.5))
    scores = CLS.reference(CLS.parse(20, {}), SiteTensors(hidden, True, q, k, 0.5)).trace["scores"].numpy()
    counts = numpy_keep(scores, 1.0, 2.0, -0.7, 1, 20)
    assert len(set(counts)) > 1
    for i, kb in enumerate(counts):
        best = sorted(np.argsort(-scores[i], kind="stable")[:kb].tolist())
        assert result.kept[i, :kb].tolist() == best and (result.kept[i, kb:] == -1).all()
        rows = result.tokens[i, 1:]
        np.testing.assert_array_equal(rows[:kb].numpy(), hidden[i, 1:][best].numpy())
        pruned = [j for j in range(n) if j not in best]
        np.testing.assert_allclose(rows[kb].numpy(), hidden[i, 1:][pruned].mean(0).numpy(), rtol=1e-12)
        assert (rows[kb + 1:] == 0).all() and result.trace["num_tokens"][i] == kb + 1


@pytest.mark.parametrize("batch", [1, 3])
def test_inserted_graph_matches_reference(tiny_dense_path, tiny_source, batch):
    params = CLS.parse(16, dict(STEEP))
    method = wrap(CLS, params)
    model = ir.load(tiny_dense_path)
    for p in (InsertPruningPass(method, params), RetargetTokenCountPass(), ZeroPaddingPass(), RemoveUnusedNodesPass()):
        p(model)
    ops = [n.op_type for n in model.graph]
    assert not {"Loop", "NonZero", "If", "Scan"} & set(ops) and ops.count("TopK") == 2  # the method's own is gone
    x = np.random.default_rng(batch + 4).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = assert_matches_pipeline(model, method, params, tiny_source, x, 17)
    for b, rows in enumerate(out[NUM_TOKENS]):
        assert np.all(out["image_features"][b, rows:] == 0) and np.abs(out["image_features"][b, :rows]).min() >= 0


def test_refusals():
    with pytest.raises(InputError, match="method visionzip does not take --budget adaptive: its output merges"):
        wrap(get_method("visionzip"), get_method("visionzip").parse(16, {"budget": "adaptive"}))
    with pytest.raises(InputError, match="method divprune does not take --budget adaptive: it ranks no score"):
        get_method("divprune").parse(16, {"budget": "adaptive"})
    with pytest.raises(InputError, match="prumerge\\+ does not take --budget adaptive: it sets its own K"):
        get_method("prumerge+").parse(16, {"budget": "adaptive"})
    with pytest.raises(InputError, match="--alpha sets --budget adaptive"):
        CLS.parse(16, {"alpha": 2.0})
    with pytest.raises(InputError, match="--budget must be fixed or adaptive"):
        CLS.parse(16, {"budget": "auto"})
    with pytest.raises(InputError, match="--kmin \\(20\\) must be <= --keep \\(16\\)"):
        CLS.parse(16, {"budget": "adaptive", "kmin": 20})
    assert "budget" not in CLS.parse(16, {"budget": "fixed"}) and not isinstance(wrap(CLS, CLS.parse(16, {})),
                                                                                AdaptiveBudget)


def test_probe_score_on_siglip(tiny_siglip_dir, tmp_path):
    """A tower without [CLS]: the budget cuts the probe score cls ranks by, end to end with parity."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    result = compile_model(str(tiny_siglip_dir), tmp_path / "b", CompileOptions(
        method="cls", keep=16, batch=3, method_options={**STEEP, "score": "probe"}))
    assert result.report.passed, result.manifest["parity"]
    assert result.report.stages[1].outputs[NUM_TOKENS]["passed"]
