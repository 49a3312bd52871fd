"""Family `internvl`: InternVL3's tower, pixel shuffle and projector, pruned after the connector, against transformers.

A tiny InternVL3 built offline from a config (tiny_models.tiny_internvl: 3 vision blocks 32 wide, 112 px at
patch 14: [CLS] + 8x8 patches shuffled 2x2 into 4x4 = 16 tokens; a Qwen2 LLM). What is checked against
Hugging Face itself:
- the dense pipeline's rows are get_image_features' (tower, [CLS] dropped, pixel shuffle, projector);
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator), each gated on its
  toolchain as the other families' tests are;
- block-site and attention-scored methods are refused in one line; `vlmprune methods` lists InternVL3;
- the internvl3-1b-448 preset has InternVL3-1B's tower shapes;
- the LLM side: generate's dense splice gives HF's own forward's logits, a pruned bundle's rows spliced by
  generate give the logits of HF's forward given its own tower's rows of the same kept tokens (1-D original
  positions), `--with-llm` on ort passes its llm stage, and `generate` runs through the bundle's LLM graphs.
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import one_line_error, run_cli
from internvl_fixtures import IMAGE, SIZE, TOKENS, WIDTH, hf_model, hf_rows, internvl_dir, llm_dir  # noqa: F401
from merged_checks import (OTHER_METHODS, QNN_RK3588_CASES, TENSORRT_CASES, assert_close, cat_image, check_dense_splice,
                           check_eval, check_methods_listing, check_openvino, check_other_method, check_pruned_splice,
                           check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt)
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model


def test_dense_path_is_hf_image_features(internvl_dir, hf_model):
    source = load_source(str(internvl_dir))
    assert source.family == "internvl" and source.has_cls and source.num_patches == TOKENS
    assert source.spatial_merge == 2 and source.num_blocks == 3 and source.image_size == SIZE
    assert source.details["token_counts"]["merged_grid_thw"] == [1, 4, 4]
    assert source.mean == (0.485, 0.456, 0.406)
    for batch in (1, 3):
        x = torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, TOKENS, WIDTH)
        assert_close(got, hf_rows(hf_model, x))


def test_the_check_has_teeth(internvl_dir, hf_model):
    """Without the layer scales, or with the shuffle's groups taken in another order, it is not InternVL."""
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    expected = hf_rows(hf_model, x)
    source = load_source(str(internvl_dir))
    connector = source.pipeline.projector
    with torch.inference_mode():
        h = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(8))
        transposed = h.reshape(2, 8, 8, 32).transpose(1, 2).reshape(2, 64, 32)
        assert (connector(h) - connector(transposed)).abs().max() > 1e-3
        for layer in source.pipeline.vision_model.encoder.layer:
            layer.lambda_1.fill_(1.0)
        wrong = source.pipeline(x)
    assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


@pytest.fixture(scope="module")
def divprune_bundle(internvl_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("internvl_bundles") / "divprune"
    return compile_model(str(internvl_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, internvl_dir, hf_model):
    check_rows_on_ort(divprune_bundle, internvl_dir, lambda pixel: hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="internvl", readme="InternVL tokens")


@pytest.mark.parametrize(*OTHER_METHODS)
def test_other_methods_on_ort(internvl_dir, tmp_path, method, options):
    check_other_method(internvl_dir, tmp_path / "b", method, options, keep=6, width=WIDTH)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(internvl_dir, tmp_path, target, method, batch, options):
    check_tensorrt(internvl_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(internvl_dir, tmp_path):
    check_openvino(internvl_dir, tmp_path / "b")


@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, internvl_dir, tmp_path, target, method):
    """The whole InternVL graph, pixel shuffle too, on the HTP emulator (int16) and the RKNN simulator (fp16)."""
    check_qnn_or_rk3588(request, internvl_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "pixel-shuffles each 2x2 group"),
    (["--method", "visionzip"], "pixel-shuffles each 2x2 group"),
    (["--method", "tome"], "pixel-shuffles each 2x2 group"),
    (["--method", "random"], "pixel-shuffles each 2x2 group"),
    (["--method", "cls", "--score", "attention"], "not over the merged tokens"),
    (["--method", "holov"], "not over the merged tokens"),
    (["--image-size", "224"], "has a fixed image size"),
])
def test_refusals_are_one_line(internvl_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", internvl_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)


def test_methods_lists_internvl_from_its_declarations():
    check_methods_listing("InternVL3")


def test_preset_has_internvl3_1b_tower_shapes():
    source = load_source("internvl3-1b-448")
    pipe = source.pipeline
    assert source.family == "internvl" and source.image_size == 448 and source.patch_size == 14
    assert source.num_patches == 256 and source.num_blocks == 24 and source.has_cls
    assert source.details["token_counts"] == {"image_size": 448, "patch_grid": [32, 32], "patches": 1024,
                                              "spatial_merge": 2, "merged_grid_thw": [1, 16, 16], "tokens": 256}
    tower = pipe.vision_model
    assert tower.config.hidden_size == 1024 and tower.embeddings.position_embeddings.shape == (1, 1025, 1024)
    assert pipe.projector.projector.linear_1.weight.shape == (896, 4096)
    params = sum(p.numel() for p in tower.parameters())
    assert 300e6 < params < 310e6  # InternViT-300M
    with torch.inference_mode():
        out = pipe(torch.zeros(1, 3, 448, 448))
    assert out.shape == (1, 256, 896) and torch.isfinite(out).all()


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def llm_bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("internvl_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8, with_llm=True))


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    check_dense_splice(llm_dir, cat, "what is in the image?", TOKENS, WIDTH)


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions, give the logits of HF's own
    forward given its own tower's rows of those 8 tokens at those positions; other positions give others."""
    check_pruned_splice(llm_bundle, llm_dir, cat, "what is in the image?", TOKENS, IMAGE, hf_rows)


def test_with_llm_on_ort_and_generate_cli(llm_bundle, llm_dir, cat):
    manifest = llm_bundle.manifest
    assert manifest["llm"]["positions"]["kind"] == "indices" and manifest["llm"]["dense_image_tokens"] == TOKENS
    graphs = manifest["llm_graphs"]
    assert graphs["parity"]["passed"] and graphs["parity"]["tokens_identical"]
    assert {"llm/prefill.onnx", "llm/decode.onnx"} <= set(manifest["files"])
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", cat,
                     "--prompt", "what is in the image?", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "the bundle's LLM graphs" in result.output


def test_eval_reference_and_bundle(llm_bundle, llm_dir, tmp_path):
    """eval's harness holds (its dense splice is HF's forward), and the bundle's rows give its reference's figures."""
    check_eval(llm_bundle, llm_dir, tmp_path, ["what is in the image?", "describe it."], TOKENS)


def test_edgellm_refuses_internvl_in_one_line(llm_dir, tmp_path):
    one_line_error(run_cli("compile", llm_dir, "-o", tmp_path / "b", "--target", "orin", "--method", "divprune",
                           "--keep", "6", "--with-llm"), "is model type 'internvl'")
