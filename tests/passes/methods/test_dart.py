"""dart: pivot counts, the algorithm as Edge-LLM runs it, the graph at batch 1 and 3, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from method_helpers import features_model, reference, run, tokens
from method_references import dart_straightforward as straightforward
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.dart import DartMethod, pivot_counts


def test_pivot_counts():
    assert pivot_counts(192, 4) == [47, 47, 47, 47]
    assert pivot_counts(10, 4) == [2, 2, 1, 1]
    assert pivot_counts(7, 3) == [2, 1, 1]
    assert pivot_counts(4, 4) == []  # the pivots alone fill K


@pytest.mark.parametrize("keep,pivots", [(20, 4), (9, 3), (5, 5)])
def test_reference_is_the_algorithm(keep, pivots):
    x = tokens(keep, 1, 40, 12)
    method = DartMethod()
    ref = reference(method, method.parse(keep, {"pivots": pivots}), x.astype(np.float64))
    assert ref.kept[0].tolist() == straightforward(x[0].astype(np.float64), keep, pivots)


@pytest.mark.parametrize("has_cls,batch,pivots", [(False, 1, 4), (True, 3, 4), (False, 3, 8)])
def test_graph_matches_reference(has_cls, batch, pivots):
    method, params, model = features_model("dart", 64, 16, 24, has_cls, pivots=pivots)
    ops = [n.op_type for n in model.graph]
    assert ops.count("TopK") == 1 + len(pivot_counts(24, pivots)) + 1  # pivots, one per pivot step, the sort
    assert "Loop" not in ops
    x = tokens(batch + pivots, batch, 64 + has_cls, 16)
    out = run(model, x)
    ref = reference(method, params, x, has_cls)
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    np.testing.assert_allclose(out["tokens"], ref.tokens.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pivots", [0, 25, True, 2.5])
def test_bad_pivots(pivots):
    with pytest.raises(InputError, match="--pivots of method dart"):
        DartMethod().parse(24, {"pivots": pivots})
