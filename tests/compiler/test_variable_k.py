"""Variable K per image in a static graph: `num_tokens`, zero padding rows, -1 kept slots, parity on valid rows.

Compiled end to end from the tiny LLaVA (tests/conftest.py), run by the bundle's own ONNX
Runtime session, and checked against the torch reference and against the invariants an LLM
runtime relies on (docs/design.md, "Variable K").
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from vlmprune.compiler.contract import DECOMPOSED, FEATURES, KEPT, NUM_TOKENS
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets.runtime import ort_session, run_session

K_MAX = 16


def _compile(model, out, method="prumerge+", batch=3, target="ort", **kwargs):
    return compile_model(str(model), out, CompileOptions(target=target, method=method, keep=K_MAX, batch=batch,
                                                         **kwargs))


def _run(bundle, pixel):
    return run_session(ort_session(bundle / DECOMPOSED), pixel)


def _assert_padded(out: dict):
    """prumerge+'s layout: image b's num_tokens[b] - 1 merged rows, its extra token, zeros; kept -1 after K_b."""
    feats, kept, rows = out[FEATURES], out[KEPT], out[NUM_TOKENS]
    assert rows.dtype == np.int64 and rows.shape == (feats.shape[0],)
    assert kept.shape == (feats.shape[0], K_MAX) and feats.shape[1] == K_MAX + 1
    for b, n in enumerate(rows):
        assert 2 <= n <= K_MAX + 1
        assert np.all(feats[b, n:] == 0) and np.all(np.abs(feats[b, :n]).sum(-1) > 0)
        k = n - 1  # the extra token has no kept index
        assert np.all(kept[b, k:] == -1) and np.all(np.diff(kept[b, :k]) > 0) and kept[b, 0] >= 0


@pytest.mark.parametrize("batch", [1, 3])
def test_prumerge_bundle_outputs_num_tokens_with_parity(tiny_llava_dir, tmp_path, batch):
    result = _compile(tiny_llava_dir, tmp_path / "b", batch=batch)
    assert result.report.passed, result.manifest["parity"]
    parity = json.loads((tmp_path / "b" / "parity.json").read_text())
    rewritten = next(s for s in parity["stages"] if s["stage"] == "rewritten")
    assert rewritten["outputs"][NUM_TOKENS]["passed"] and rewritten["outputs"]["padding"]["rows_wrong"] == 0
    assert rewritten["outputs"][FEATURES]["rows_not_compared"] == rewritten["outputs"]["padding"]["rows_compared"]
    outputs = {o["name"]: o for o in result.manifest["outputs"]}
    assert outputs[NUM_TOKENS]["dtype"] == "int64"
    pixel = np.random.default_rng(7).standard_normal((batch, 3, 112, 112)).astype(np.float32)
    out = _run(tmp_path / "b", pixel)
    _assert_padded(out)
    if batch == 1:  # `vlmprune check` re-runs that parity and draws it (num_tokens and padding as exact rows)
        from click.testing import CliRunner

        from vlmprune.compiler.cli import main

        checked = CliRunner().invoke(main, ["check", str(tmp_path / "b"), "--report", str(tmp_path / "r.html")])
        assert checked.exit_code == 0, checked.output
        assert "num_tokens" in (tmp_path / "r.html").read_text()
    # No Loop and no NonZero: every target takes the selection.
    ops = {n.op_type for n in ir.load(tmp_path / "b" / DECOMPOSED).graph}
    assert not ops & {"Loop", "NonZero", "If", "Scan"}


def test_each_image_is_pruned_alone(tiny_llava_dir, tmp_path):
    """The official IQR pools the batch; here an image's tokens do not depend on its batch neighbours."""
    _compile(tiny_llava_dir, tmp_path / "b", batch=3)
    pixel = np.random.default_rng(3).standard_normal((3, 3, 112, 112)).astype(np.float32)
    pixel[1] *= 0.2  # a very different neighbour
    together = _run(tmp_path / "b", pixel)
    for b in range(3):
        alone = _run(tmp_path / "b", np.repeat(pixel[b:b + 1], 3, axis=0))
        assert alone[NUM_TOKENS][0] == together[NUM_TOKENS][b]
        np.testing.assert_array_equal(alone[KEPT][0], together[KEPT][b])
        np.testing.assert_allclose(alone[FEATURES][0], together[FEATURES][b], rtol=1e-5, atol=1e-5)


STEEP = {"budget": "adaptive", "alpha": 50.0, "beta": 1.0, "gamma": -49.0}  # tests/passes/methods/test_budget.py


@pytest.mark.parametrize("batch", [1, 3])
def test_adaptive_budget_bundle(tiny_llava_dir, tmp_path, batch):
    result = _compile(tiny_llava_dir, tmp_path / "b", method="cls", batch=batch, method_options=dict(STEEP))
    assert result.report.passed, result.manifest["parity"]
    assert [o["name"] for o in result.manifest["outputs"]] == [FEATURES, KEPT, NUM_TOKENS]
    assert result.manifest["method"]["params"]["budget"] == "adaptive"
    assert result.manifest["target"]["fused"] is False  # TokenPrune's fixed K does not cover it
    out = _run(tmp_path / "b", np.random.default_rng(1).standard_normal((batch, 3, 112, 112)).astype(np.float32))
    feats, rows = out[FEATURES], out[NUM_TOKENS]
    assert feats.shape[1] == K_MAX + 1  # K_max + the summary
    for b, n in enumerate(rows):  # n - 1 kept rows, then the summary, then zeros
        assert np.all(feats[b, n:] == 0) and np.all(np.abs(feats[b, :n]).sum(-1) > 0)
        assert np.all(out[KEPT][b, n - 1:] == -1) and np.all(out[KEPT][b, :n - 1] >= 0)


def test_cli_budget_flags(tiny_llava_dir, tmp_path):
    from click.testing import CliRunner

    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.cli import main

    run = lambda *a: CliRunner().invoke(main, [str(x) for x in a])  # noqa: E731
    result = run("compile", tiny_llava_dir, "--keep", 16, "--budget", "adaptive", "--kmin", 4, "-o", tmp_path / "b",
                 "-q")
    assert result.exit_code == 0, result.output
    params = load_manifest(tmp_path / "b")["method"]["params"]
    assert params["budget"] == "adaptive" and params["kmin"] == 4 and params["gamma"] == -0.6
    for args, needle in [(["--method", "visionzip", "--budget", "adaptive"], "visionzip does not take --budget"),
                         (["--gamma", "0.1"], "--gamma sets --budget adaptive")]:
        result = run("compile", tiny_llava_dir, "-o", tmp_path / "c", *args)
        assert result.exit_code == 2 and needle in result.output, (args, result.output)


GENTLE = {"budget": "adaptive", "alpha": 4.0, "beta": 1.0, "gamma": -3.6}  # K per image, robust to fp16 scores
VARIABLE = [("prumerge+", {}), ("cls", GENTLE)]


def _assert_target(result):
    assert result.report.passed, result.manifest["parity"]
    assert [o["name"] for o in result.manifest["outputs"]] == [FEATURES, KEPT, NUM_TOKENS]
    for stage in result.report.stages[1:]:
        assert stage.outputs[NUM_TOKENS]["passed"] and stage.outputs["padding"]["rows_wrong"] == 0, stage.stage


@pytest.mark.parametrize("target", ["orin", "xavier"])
@pytest.mark.parametrize("method,options", VARIABLE)
def test_tensorrt_targets(tiny_llava_dir, tmp_path, target, method, options):
    result = _compile(tiny_llava_dir, tmp_path / "b", method=method, batch=None, target=target,
                      method_options=dict(options))
    _assert_target(result)
    assert result.manifest["target"]["fused"] is False


@pytest.mark.parametrize("method,options", VARIABLE)
def test_qnn(qnn_ready, tiny_llava_dir, tmp_path, method, options):
    result = _compile(tiny_llava_dir, tmp_path / "b", method=method, batch=None, target="qnn",
                      method_options=dict(options))
    _assert_target(result)
    assert result.manifest["target"]["placement_summary"]["qdq"]["cpu_ops"] == {}  # all on HTP


@pytest.mark.parametrize("method,options", VARIABLE)
def test_rk3588(rknn_ready, tiny_llava_dir, tmp_path, method, options):
    result = _compile(tiny_llava_dir, tmp_path / "b", method=method, batch=None, target="rk3588",
                      method_options=dict(options))
    _assert_target(result)
    assert set(result.manifest["target"]["artifacts"]) == {"fp16"}  # hybrid int8 loses the values (int8_loss)


@pytest.mark.parametrize("method,options", [("prumerge+", {}), ("cls", STEEP)])
def test_generate_drops_the_padding_rows(tmp_path, method, options):
    """generate (and eval, through the same bundle_tokens) hands the LLM each image's valid rows only, at their
    original positions; the manifest's llm section and the bundle README say how a runtime does the same."""
    from PIL import Image
    from skimage import data
    from test_generate import PROMPT, tiny_vlm

    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.frontend.images import load_image_file

    model = tiny_vlm(tmp_path / "model")
    image = tmp_path / "cat.png"
    Image.fromarray(data.chelsea()).save(image)
    bundle = compile_model(str(model), tmp_path / "b", CompileOptions(method=method, keep=K_MAX,
                                                                      method_options=dict(options))).bundle
    manifest = load_manifest(bundle)
    pre = manifest["preprocess"]
    pixel, _, _ = load_image_file(str(image), pre["size"], pre["mean"], pre["std"])
    raw = _run(bundle, pixel)
    rows = int(raw[NUM_TOKENS][0])
    extra = manifest["llm"]["rows"]["extra"]
    assert extra == 1  # cls's summary token; prumerge+'s extra token (the pruned, attention-weighted)
    assert manifest["llm"]["num_tokens"]["output"] == NUM_TOKENS and manifest["llm"]["image_tokens"] == K_MAX + extra
    assert "K varies per image" in (bundle / "README.md").read_text()
    result = gen.generate(bundle, None, image, PROMPT, max_new_tokens=3)
    kept = raw[KEPT][0, : rows - extra].tolist()
    assert result.kept == kept and result.answer.image_tokens == rows < K_MAX + extra
    offset = len(result.prompt.before)
    expected = (list(range(offset)) + [offset + k for k in kept] + [offset + 64 + e for e in range(extra)]
                + [offset + 64 + extra + i for i in range(len(result.prompt.after))])
    assert result.answer.position_ids == expected
    tokens = gen.bundle_tokens(bundle, manifest, pixel)
    # the runner's model.onnx runs the fused MultiHeadAttention: the decomposed graph's values up to rounding
    np.testing.assert_allclose(tokens.features.numpy(), raw[FEATURES][0, :rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,options", VARIABLE)
def test_an_onnx_source(tiny_dense_path, tmp_path, method, options):
    """An .onnx tower: the reference runs on the graph's own tensors (compiler.parity.reference.onnx_reference)."""
    result = compile_model(str(tiny_dense_path), tmp_path / "b", CompileOptions(method=method, keep=K_MAX,
                                                                                method_options=dict(options)))
    assert result.report.passed, result.manifest["parity"]
    stage = result.report.stages[0]
    assert stage.outputs[NUM_TOKENS]["passed"] and stage.outputs[FEATURES]["passed"]


def test_eval_reference_and_bundle_agree_on_the_valid_rows(tmp_path):
    """eval's method reference and a compiled prumerge+ bundle feed the LLM the same rows, padding dropped, so
    their figures agree; the answers' token counts are each image's own."""
    from skimage import data
    from test_generate import PROMPT, tiny_vlm

    from cli_helpers import eval_inputs
    from vlmprune.compiler.evaluate import evaluate

    images, prompts = eval_inputs(tmp_path, {"astronaut.png": data.astronaut(), "coffee.jpg": data.coffee()},
                                  [PROMPT])
    model = tiny_vlm(tmp_path / "model", seed=3)
    bundle = compile_model(str(model), tmp_path / "b", CompileOptions(method="prumerge+", keep=K_MAX)).bundle
    report = evaluate(str(model), images, prompts, ["prumerge+"], [K_MAX], max_new_tokens=2, bundles=[bundle])
    reference, compiled = report["results"]
    for a, b in zip(reference["samples"], compiled["samples"]):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6) and a["pruned_tokens"] == b["pruned_tokens"]


def test_a_kept_cls_token_counts_in_num_tokens(tiny_llava_dir, tmp_path):
    """--cls keep: row 0 is [CLS], num_tokens counts it and the extra token, kept_indices stay the patches' (two
    fewer valid entries than rows)."""
    result = _compile(tiny_llava_dir, tmp_path / "b", batch=3, cls="keep")
    assert result.report.passed, result.manifest["parity"]
    out = _run(tmp_path / "b", np.random.default_rng(2).standard_normal((3, 3, 112, 112)).astype(np.float32))
    assert out[FEATURES].shape[1] == 1 + K_MAX + 1
    for b, n in enumerate(out[NUM_TOKENS]):
        assert np.all(out[FEATURES][b, n:] == 0) and (out[KEPT][b] >= 0).sum() == n - 2


def test_pictures_trace_merges_into_the_kept_patches_only(tiny_llava_dir, tmp_path):
    """`run --show` traces prumerge+'s merges from the reference: targets are each image's kept patches, never the
    padded slots (-1), whose rows hold the extra token or zeros."""
    from vlmprune.compiler import pictures
    from vlmprune.compiler.bundle import load_manifest

    _compile(tiny_llava_dir, tmp_path / "b", batch=3)
    manifest = load_manifest(tmp_path / "b")
    pixel = np.random.default_rng(5).standard_normal((3, 3, 112, 112)).astype(np.float32)
    merges, kept, note = pictures.reference_merges(manifest, pixel)
    assert note is None and (kept < 0).any()  # some image has padded slots
    for b, per_image in enumerate(merges):
        assert set(per_image) == set(kept[b][kept[b] >= 0].tolist())
        assert all(len(joined) > 0 for joined in per_image.values())  # each merged its 32 nearest
