"""divprune: the official algorithm, the reference, both graph forms, the fused op, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from method_helpers import features_model, reference, run, tokens
from method_references import divprune_official as official
from vlmprune.compiler.errors import InputError
from vlmprune.passes.fusion import FusionPass
from vlmprune.passes.methods.base import FusedOp, SiteSpec
from vlmprune.passes.methods.divprune import DIVPRUNE_SELECT, DivPruneMethod, distances, greedy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_is_the_official_algorithm(seed):
    x = tokens(seed, 1, 64, 16)
    picks, steps = greedy(distances(torch.from_numpy(x).double()), 20)
    assert picks[0].tolist() == official(x[0].astype(np.float64), 20)
    assert len(steps) == 20 and all(float(m) > 0 for _, m in steps)


def test_picked_tokens_are_never_picked_again_even_when_all_tie():
    x = np.ones((1, 5, 3), np.float32)  # every distance 0: the official code would pick token 0 forever
    picks, _ = greedy(distances(torch.from_numpy(x)), 5)
    assert picks.tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("formulation", ["loop", "unrolled"])
@pytest.mark.parametrize("has_cls,batch", [(False, 1), (True, 3)])
def test_graph_matches_reference(formulation, has_cls, batch):
    method, params, model = features_model("divprune", 48, 16, 12, has_cls, formulation)
    ops = [n.op_type for n in model.graph]
    assert ("Loop" in ops) == (formulation == "loop")
    assert ops.count("ArgMax") == (1 if formulation == "loop" else 12)
    x = tokens(batch, batch, 48 + has_cls, 16)
    out = run(model, x)
    ref = reference(method, params, x, has_cls)
    np.testing.assert_array_equal(out["kept_indices"], ref.kept.numpy())
    assert np.all(np.diff(out["kept_indices"], axis=1) > 0)
    np.testing.assert_allclose(out["tokens"], ref.tokens.numpy(), rtol=1e-6, atol=1e-6)
    assert out["tokens"].shape == (batch, 12 + has_cls, 16)


def test_loop_fuses_into_one_op(ort_library):
    method, params, model = features_model("divprune", 576, 32, 192, formulation="loop")
    x = tokens(5, 2, 576, 32)
    decomposed = run(model, x)
    FusionPass(method.fusion_rules({DIVPRUNE_SELECT: FusedOp(DIVPRUNE_SELECT)}), {"vlmprune": 1})(model)
    ops = [n.op_type for n in model.graph]
    assert DIVPRUNE_SELECT in ops and "Loop" not in ops and "ArgMax" not in ops
    fused = run(model, x, (ort_library,))
    np.testing.assert_array_equal(fused["kept_indices"], decomposed["kept_indices"])
    np.testing.assert_array_equal(fused["tokens"], decomposed["tokens"])


def test_refusals():
    method = DivPruneMethod()
    with pytest.raises(InputError, match="--lambda is not an option of method divprune"):
        method.parse(8, {"lambda": 0.5})
    with pytest.raises(InputError, match="keep must satisfy 1 <= keep < 16"):
        method.check(method.parse(16, {}), SiteSpec(16, False))
    method.check(method.parse(8, {}), SiteSpec(16, False))  # no [CLS] needed
    with pytest.raises(InputError, match="no 'while' formulation"):
        method.check_formulation("while")


def test_a_foreign_option_lists_every_option_the_method_declares():
    """`-m divprune --pivots 3` said "(it takes none)" though divprune takes --merge and --width; dart's listed
    --text_pivots for --text-pivots."""
    from vlmprune.passes.methods import get_method

    with pytest.raises(InputError, match=r"^--pivots is not an option of method divprune \(it takes --merge, --width\)$"):
        get_method("divprune").parse(32, {"pivots": 3})
    with pytest.raises(InputError) as info:
        get_method("dart").parse(32, {"theta": 1.0})
    assert "(it takes --pivots, --text-pivots, --merge, --width)" in str(info.value)
    with pytest.raises(InputError) as info:
        get_method("cls").parse(32, {"pivots": 3})
    for flag in ("--lambda", "--score", "--merge", "--roi", "--budget", "--scorer"):
        assert flag in str(info.value)
