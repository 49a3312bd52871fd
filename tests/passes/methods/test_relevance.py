"""--prompt-weight (passes.methods.relevance): the formula written plainly, holov's graph and reference against it at
batch 1 and 3, the compile with parity on the tiny LLaVA, and the refusals.

The oracle computes s' = s / max(s) + W · minmax(-mean_t cos(x_i, e_t)) in float64 numpy for one image and hands a'
to test_holov's official HoloV arithmetic (which takes the attention as an input): it shares no code with the module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_holov import DH, cls_row, holov_graph, inputs, official, run
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods import get_method, relevance
from vlmprune.passes.methods.base import PromptSiteTensors
from vlmprune.passes.methods.holov import default_partitions


def plain(score: np.ndarray, x: np.ndarray, text: np.ndarray, w: float) -> np.ndarray:
    """s' for one image: score [N], x [N, D], text [T, D], in float64."""
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    r = np.zeros(len(x))
    if len(text):
        unit_t = text / np.maximum(np.linalg.norm(text, axis=1, keepdims=True), 1e-12)
        r = -np.mean(unit @ unit_t.T, axis=1)
    rel = (r - r.min()) / (r.max() - r.min() + 1e-6)
    return score / max(score.max(), 1e-6) + w * rel


@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_weighted_equals_the_plain_formula(tokens):
    rng = np.random.default_rng(tokens)
    b, n, d = 3, 20, 12
    x, text = rng.standard_normal((b, 1 + n, d)), rng.standard_normal((b, tokens, d))
    score = rng.random((b, n))
    site = PromptSiteTensors(torch.from_numpy(x), True, text=torch.from_numpy(text))
    got = relevance.weighted({"prompt_weight": 0.7}, site, torch.from_numpy(score)).numpy()
    for i in range(b):
        np.testing.assert_allclose(got[i], plain(score[i], x[i, 1:], text[i], 0.7), rtol=1e-12, atol=1e-12)
    if tokens == 0:  # no prompt rows: the method's own ranking, normalised
        np.testing.assert_allclose(got, score / score.max(-1, keepdims=True), rtol=1e-12)
    np.testing.assert_array_equal(relevance.weighted({}, site, torch.from_numpy(score)).numpy(), score)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("weight", [0.5, 4.0])
def test_holov_graph_and_reference_equal_the_plain_formula(batch, weight):
    n, d, keep = 40, 16, 10
    x, q, k = inputs(batch + 11, batch, n, d)
    text = np.random.default_rng(batch).standard_normal((batch, 6, d)).astype(np.float32)
    method, params, model = holov_graph(n, d, keep, text=True, prompt_weight=weight)
    assert method.needs(params).text and not method.needs(method.parse(keep, {})).text
    tokens, kept, _ = run(model, x, q, k, text_embeds=text)
    with torch.inference_mode():
        ref = method.reference(params, PromptSiteTensors(torch.from_numpy(x), False, torch.from_numpy(q),
                                                         torch.from_numpy(k), DH ** -0.5, text=torch.from_numpy(text)))
        plain_ref = method.reference(method.parse(keep, {}), PromptSiteTensors(
            torch.from_numpy(x), False, torch.from_numpy(q), torch.from_numpy(k), DH ** -0.5))
    a = cls_row(q, k, DH ** -0.5)
    for i in range(batch):
        weighted = plain(a[i], x[i].astype(np.float64), text[i].astype(np.float64), weight)
        want, context, _, _ = official(x[i].astype(np.float64), weighted, default_partitions(n, keep), keep)
        assert ref.kept[i].tolist() == want and kept[i].tolist() == want
        np.testing.assert_allclose(tokens[i, keep], context, atol=1e-5)
    np.testing.assert_allclose(tokens, ref.tokens.numpy(), atol=1e-6)
    if weight == 4.0:  # the prompt moves the selection
        assert ref.kept.tolist() != plain_ref.kept.tolist()
    # No prompt rows: the ranking of a / max(a), HoloV's own (its crop weights are scale-free).
    empty = np.zeros((batch, 0, d), np.float32)
    _, kept0, _ = run(model, x, q, k, text_embeds=empty)
    np.testing.assert_array_equal(kept0, plain_ref.kept.numpy())


@pytest.mark.parametrize("name,options,needle", [
    ("cls", {}, "method cls does not take --prompt-weight: it prunes after block L, whose hidden states are the "
                "tower's width"),
    ("visionzip", {}, "method visionzip does not take --prompt-weight: it prunes after block L"),
    ("prumerge+", {}, "method prumerge\\+ does not take --prompt-weight: it prunes after block L"),
    ("divprune", {}, "method divprune does not take --prompt-weight: its selection is greedy"),
    ("dart", {}, "method dart does not take --prompt-weight: its selection is greedy"),
    ("cdpruner", {}, "its selection is greedy, with no score to add the relevance to \\(it is prompt-aware already"),
    ("random", {"site": "features"}, "method random does not take --prompt-weight: a baseline ranks no score"),
    ("holov", {"prompt_weight": -1.0}, "--prompt-weight must be a finite number >= 0, got -1"),
    ("holov", {"prompt_weight": float("nan")}, "--prompt-weight must be a finite number >= 0, got nan"),
])
def test_refusals_are_one_line(name, options, needle):
    with pytest.raises(InputError, match=needle):
        get_method(name).parse(16, {"prompt_weight": 1.0, **options})


def test_weight_zero_is_the_method_without_the_flag():
    method = get_method("holov")
    assert method.parse(16, {"prompt_weight": 0.0}) == method.parse(16, {})
    assert get_method("divprune").parse(16, {"prompt_weight": 0}) == get_method("divprune").parse(16, {})


@pytest.mark.parametrize("batch", [1, 3])
def test_holov_compiles_with_text_embeds_and_parity_on_ort(compiled, tiny_llava_dir, batch):
    result = compiled(tiny_llava_dir, method="holov", keep=16, method_options={"prompt_weight": 2.0}, batch=batch)
    assert result.report.passed, result.manifest["parity"]
    assert [i["name"] for i in result.manifest["inputs"]] == ["pixel_values", "text_embeds"]
    assert result.manifest["method"]["params"]["prompt_weight"] == 2.0
    checked = {s.stage: s.indices for s in result.report.stages if s.indices}
    assert set(checked) == {"rewritten", "fused"} and all(i["agreement"] == 1.0 for i in checked.values())
    plain_result = compiled(tiny_llava_dir, method="holov", keep=16, batch=batch)
    assert [i["name"] for i in plain_result.manifest["inputs"]] == ["pixel_values"]
    plain_kept = next(s.indices["kept"] for s in plain_result.report.stages if s.indices)
    assert checked["fused"]["kept"] != plain_kept  # parity's fixed-seed prompt moves the selection
