"""random: a seeded constant draw, the graph (one Gather of constant indices) against the reference, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from method_helpers import features_model, reference, run, tokens
from method_references import random_draw
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.random_keep import RandomKeepMethod, random_indices


def test_seed_fixes_the_draw():
    first = random_indices(256, 64, 0)
    assert np.array_equal(first, random_indices(256, 64, 0))  # same seed, same selection
    assert not np.array_equal(first, random_indices(256, 64, 1))  # another seed, another selection
    assert len(set(first.tolist())) == 64 and (np.diff(first) > 0).all() and 0 <= first[0] and first[-1] < 256
    # Its rule, written plainly (method_references): the K smallest raw PCG64 draws.
    assert first.tolist() == random_draw(256, 64, 0)


@pytest.mark.parametrize("has_cls,batch,seed", [(False, 1, 0), (True, 3, 7)])
def test_graph_matches_reference(has_cls, batch, seed):
    method, params, model = features_model("random", 64, 16, 24, has_cls, seed=seed)
    ops = [n.op_type for n in model.graph]
    assert ops == (["Slice", "Gather", "Slice", "Concat"] if has_cls else ["Gather"]) + \
        ["Shape", "Slice", "Concat", "Expand"]
    x = tokens(seed, batch, 64 + has_cls, 16)
    out = run(model, x)  # the ONNX checker too
    ref = reference(method, params, x, has_cls)
    expected = random_indices(64, 24, seed)
    np.testing.assert_array_equal(ref.kept.numpy(), np.tile(expected, (batch, 1)))  # every row the same draw
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    np.testing.assert_array_equal(out["tokens"], ref.tokens.numpy())
    np.testing.assert_array_equal(out["tokens"][:, has_cls:], x[:, has_cls:][:, expected])


def test_refusals():
    method = RandomKeepMethod()
    with pytest.raises(InputError, match=r"^--keep must be an integer >= 1, got 0$"):
        method.parse(0, {})
    with pytest.raises(InputError, match=r"^--keep must satisfy 1 <= keep < 64 \(the tower has 64 patch tokens\), "
                                         r"got 65$"):
        method.check(method.parse(65, {}), SiteSpec(64, True))
    with pytest.raises(InputError, match=r"^--seed of method random must be an integer >= 0, got -1$"):
        method.parse(8, {"seed": -1})
    with pytest.raises(InputError, match=r"^--site of method random is block or features, got 'middle'$"):
        method.parse(8, {"site": "middle"})
    with pytest.raises(ValueError):
        random_indices(64, 64, 0)
