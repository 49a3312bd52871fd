"""grid: the uniform-grid rule, the graph (one Gather of constant indices) against the reference, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from method_helpers import features_model, reference, run, tokens
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.contract import SITE_FEATURES
from vlmprune.passes.methods.base import BLOCK, SiteSpec
from vlmprune.passes.methods.grid import GridMethod, grid_indices


def test_every_other_row_and_column():
    assert grid_indices(256, 64).tolist() == [r * 16 + c for r in range(1, 16, 2) for c in range(1, 16, 2)]
    assert grid_indices(256, 16).tolist() == [r * 16 + c for r in (2, 6, 10, 14) for c in (2, 6, 10, 14)]


@pytest.mark.parametrize("n", [64, 256, 576, 50])
def test_exactly_k_ascending(n):
    for keep in range(1, n):
        kept = grid_indices(n, keep)
        assert len(kept) == keep and (np.diff(kept) > 0).all() and 0 <= kept[0] and kept[-1] < n, keep


@pytest.mark.parametrize("has_cls,batch", [(False, 1), (True, 3)])
def test_graph_matches_reference(has_cls, batch):
    method, params, model = features_model("grid", 64, 16, 16, has_cls)
    assert [n.op_type for n in model.graph].count("Gather") == 1
    assert not {"TopK", "ArgMax", "MatMul"} & {n.op_type for n in model.graph}  # nothing is scored
    x = tokens(batch, batch, 64 + has_cls, 16)
    out = run(model, x)
    ref = reference(method, params, x, has_cls)
    expected = [r * 8 + c for r in (1, 3, 5, 7) for c in (1, 3, 5, 7)]
    np.testing.assert_array_equal(ref.kept.numpy(), np.tile(expected, (batch, 1)))
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    np.testing.assert_array_equal(out["tokens"], ref.tokens.numpy())


def test_site_and_refusals():
    method = GridMethod()
    assert method.needs(method.parse(8, {})).site == BLOCK
    assert method.needs(method.parse(8, {"site": "features"})).site == SITE_FEATURES
    assert not method.reads_projector_output(method.parse(8, {"site": "features"}))  # a constant: int8 may serve it
    with pytest.raises(InputError, match=r"^--keep must satisfy 1 <= keep < 256 \(the tower has 256 patch tokens\), "
                                         r"got 300$"):
        method.check(method.parse(300, {}), SiteSpec(256, False))
    with pytest.raises(InputError, match=r"^--keep must be an integer >= 1, got -1$"):
        method.parse(-1, {})
    with pytest.raises(InputError, match=r"^--seed is not an option of method grid \(it takes --site, --merge, --width\)$"):
        method.parse(8, {"seed": 1})


def test_a_merging_tower_is_pruned_at_its_end_only():
    """Qwen2-VL's blocks hold 2x2 patches per output token: a block-site baseline would keep patches, not tokens."""
    method = GridMethod()
    with pytest.raises(InputError, match=r"merges 2x2 patches into one after its blocks: use --site features$"):
        method.check(method.parse(8, {}), SiteSpec(64, False, merge=2))
    method.check(method.parse(8, {"site": "features"}), SiteSpec(64, False, merge=2))
