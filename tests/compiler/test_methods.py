"""Every method compiles, end to end, for every target that runs it, with parity; the seams' refusals.

Tiny offline Hugging Face models: a LLaVA with a CLIP tower (64 patches) and a bare SigLIP
tower (no [CLS]). The same matrix on `demo` and `clip-l-336` is a manual run (see the note of
the issue that brought the methods); here each cell takes seconds.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vlmprune.compiler.bundle import load_manifest
from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, compile_model

METHODS = {"cls": {"lambda": 0.2}, "visionzip": {"contextual": 4}, "divprune": {}, "dart": {"pivots": 3},
           "random": {"seed": 3}, "grid": {"site": "features"}, "prumerge+": {}, "holov": {}, "cdpruner": {}}
KEEP = 16


def _compile(model, out, method, target="ort", **kwargs):
    return compile_model(str(model), out, CompileOptions(target=target, method=method, keep=KEEP,
                                                         method_options=METHODS[method], **kwargs))


def _assert_parity(result, batch_images: int):
    assert result.report.passed, result.manifest["parity"]
    for stage in result.report.stages:
        if stage.indices:
            assert len(stage.indices["per_image"]) == batch_images
    manifest = result.manifest
    assert manifest["method"]["params"]["keep"] == KEEP
    variable = ["num_tokens"] if manifest["method"]["name"] == "prumerge+" else []  # K per image
    assert [o["name"] for o in manifest["outputs"]] == ["image_features", "kept_indices", *variable]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("batch", [1, 3])
def test_every_method_on_ort(tiny_llava_dir, tmp_path, method, batch):
    result = _compile(tiny_llava_dir, tmp_path / "b", method, batch=batch)
    _assert_parity(result, 2 if batch == 1 else 3)
    stages = [s.stage for s in result.report.stages]
    assert stages == ["export", "rewritten", "fused"]  # one name for model.onnx, fused into a custom op or not
    assert result.manifest["target"]["fused"] is (method in ("cls", "divprune"))
    record = json.loads((tmp_path / "b" / "parity.json").read_text())
    assert record["inputs"]["chunk"] == batch


# --merge local (passes.methods.merge), every method that takes it: its output gains the summary of the orphans.
MERGING = ["cls", "divprune", "dart", "random", "grid", "holov"]
LOCAL = {"merge": "local", "width": 3}


def _compile_merged(model, out, method, target="ort", **kwargs):
    return compile_model(str(model), out, CompileOptions(target=target, method=method, keep=KEEP,
                                                         method_options={**METHODS[method], **LOCAL}, **kwargs))


def _assert_merged_manifest(result, method):
    fields = result.manifest["method"]
    assert fields["params"]["merge"] == "local" and fields["params"]["width"] == 3
    assert fields["tokens_out"] == fields["prefix"] + KEEP + 1  # K merged tokens + the summary
    assert "merged (--merge local, 3x3)" in fields["summary"]
    features = next(o for o in result.manifest["outputs"] if o["name"] == "image_features")
    assert features["shape"][1] == KEEP + 1  # the tiny LLaVA drops [CLS] (select strategy default)


@pytest.mark.parametrize("method", MERGING)
@pytest.mark.parametrize("batch", [1, 3])
def test_every_method_with_local_merge_on_ort(tiny_llava_dir, tmp_path, method, batch):
    result = _compile_merged(tiny_llava_dir, tmp_path / "b", method, batch=batch)
    _assert_parity(result, 2 if batch == 1 else 3)
    _assert_merged_manifest(result, method)
    assert result.manifest["target"]["fused"] is (method == "divprune")  # its greedy loop; no TokenPrune summary


@pytest.mark.parametrize("method", MERGING)
def test_every_method_with_local_merge_on_orin(tiny_llava_dir, tmp_path, method):
    result = _compile_merged(tiny_llava_dir, tmp_path / "b", method, target="orin")
    _assert_parity(result, 2)
    _assert_merged_manifest(result, method)
    assert result.manifest["target"]["fused"] is False and result.manifest["target"]["fp32_layers"]


def test_local_merge_refused_for_visionzip(tiny_llava_dir, tmp_path):
    with pytest.raises(InputError, match="method visionzip does not take --merge local \\(its contextual tokens"):
        compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
            target="ort", method="visionzip", keep=KEEP, method_options={**METHODS["visionzip"], **LOCAL}))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("method", ["divprune", "dart"])
def test_methods_without_cls_on_a_siglip_tower(tiny_siglip_dir, tmp_path, method):
    result = _compile(tiny_siglip_dir, tmp_path / "b", method)
    _assert_parity(result, 2)
    assert result.manifest["method"]["has_cls"] is False


@pytest.mark.parametrize("method", ["cls", "visionzip", "holov"])
def test_methods_that_need_cls_are_refused_on_siglip(tiny_siglip_dir, tmp_path, method):
    with pytest.raises(InputError, match=f"method {method} needs a \\[CLS\\] token"):
        _compile(tiny_siglip_dir, tmp_path / "b", method)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("target", ["orin", "xavier"])
@pytest.mark.parametrize("method", ["visionzip", "divprune", "dart", "holov"])
def test_tensorrt_targets(tiny_llava_dir, tmp_path, target, method):
    result = _compile(tiny_llava_dir, tmp_path / "b", method, target=target)
    _assert_parity(result, 2)
    fields = result.manifest["target"]
    assert fields["fused"] is False and fields["fp32_layers"]  # the selection stays fp32 in the engine
    if method == "divprune":
        assert result.manifest["method"]["formulation"] == "unrolled"


@pytest.mark.parametrize("method", ["visionzip", "dart", "divprune", "holov"])
def test_qnn(qnn_ready, tiny_llava_dir, tmp_path, method):
    result = _compile(tiny_llava_dir, tmp_path / "b", method, target="qnn")
    _assert_parity(result, 2)
    assert result.manifest["target"]["placement_summary"]["qdq"]["cpu_ops"] == {}  # all on HTP


@pytest.mark.parametrize("method", ["visionzip", "divprune", "dart", "holov"])
def test_rk3588(rknn_ready, tiny_llava_dir, tmp_path, method):
    result = _compile(tiny_llava_dir, tmp_path / "b", method, target="rk3588")
    _assert_parity(result, 2)
    assert set(result.manifest["target"]["artifacts"]) == {"fp16"}  # hybrid int8 does not serve these (measured)


@pytest.mark.parametrize("method", ["random", "grid"])
def test_rk3588_refuses_the_constant_baselines(tiny_llava_dir, tmp_path, method):
    with pytest.raises(InputError, match="cannot run method .*kept_indices output is a graph constant"):
        _compile(tiny_llava_dir, tmp_path / "b", method, target="rk3588")


@pytest.mark.parametrize("target,method,needle", [("orin", "divprune", "selection reads the projector output"),
                                                  ("rk3588", "dart", "selection reads the projector output"),
                                                  ("rk3588", "visionzip", "contextual merge loses its values")])
def test_int8_refused_where_measured_to_fail(tmp_path, target, method, needle):
    with pytest.raises(InputError, match=needle):
        compile_model("demo", tmp_path / "b", CompileOptions(target=target, method=method,
                                                             target_options={"precision": "int8"}))


def test_qnn_refuses_a_static_batch_above_one(tmp_path):
    with pytest.raises(InputError, match="qnn compiles batch 1"):
        compile_model("demo", tmp_path / "b", CompileOptions(target="qnn", batch=3))


def test_cli_method_options_and_refusals(tiny_llava_dir, tmp_path):
    run = lambda *a: CliRunner().invoke(main, [str(x) for x in a])  # noqa: E731
    result = run("compile", tiny_llava_dir, "--method", "visionzip", "--keep", 16, "--contextual", 4, "-o",
                 tmp_path / "b", "-q")
    assert result.exit_code == 0, result.output
    manifest = load_manifest(tmp_path / "b")
    assert manifest["method"]["params"] == {"keep": 16, "contextual": 4, "dominant": 12}
    assert manifest["compile_options"]["method_options"] == {"contextual": 4}
    for args, needle in [(["--method", "divprune", "--lambda", "0.3"], "--lambda is not an option of method divprune"),
                         (["--method", "divprune", "--layer", "1"], "--layer does not apply"),
                         (["--method", "nope"], "unknown method 'nope'"),
                         (["--method", "coarse-heatmap"], "needs that trained heat-map network, and no such weights"),
                         (["--method", "query-compressor"], "in place of selection) needs its trained query tokens"),
                         (["--method", "cls", "--pivots", "2"], "--pivots is not an option of method cls"),
                         (["--target", "ort", "--soc", "SM8650"], "target ort has no --soc")]:
        result = run("compile", tiny_llava_dir, "-o", tmp_path / "c", *args)
        assert result.exit_code == 2 and needle in result.output, (args, result.output)


def test_methods_command_lists_needs_and_targets():
    result = CliRunner().invoke(main, ["methods"])
    assert result.exit_code == 0, result.output
    text = result.output
    for name in METHODS:
        assert f"{name}: " in text
    assert "needs:    block L's hidden states, block L's Q and K, a [CLS] token" in text
    assert "needs:    the projector output (the tower's end)" in text
    assert "--contextual" in text and "--pivots" in text and "--lambda" in text
    assert "--text-pivots: " in text and "--roi-max: " in text and "_pivots" not in text  # the flags as typed
    assert "not available (trained weights that do not exist here):\n  coarse-heatmap: the coarse stage of a two-stage pruner" in text
    assert "ort (loop, fused into DivPruneSelect)" in text and "orin (unrolled)" in text
    assert "rk3588 (standard ops)" in text
    # TokenPrune copies the one [CLS] token it ranks by: --score probe and attention stay in standard ops.
    cls_fused = "fused into TokenPrune with --score cls; standard ops with --score probe or attention"
    targets = text.split("cls: ", 1)[1].split("\n  targets:  ", 1)[1].splitlines()[0]
    assert targets == (f"ort ({cls_fused}), orin ({cls_fused}), xavier ({cls_fused}), rk3588 (standard ops), "
                       "qnn (standard ops), openvino (standard ops)")
