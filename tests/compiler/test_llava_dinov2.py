"""LLaVA on a DINOv2 tower (llava_dinov2): the family the quality issue needs, added as one module.

A tiny LlavaForConditionalGeneration whose vision_config is DINOv2 (3 blocks, 112 px, [CLS] + 64
patches) saved offline. Its dense pipeline equals transformers' get_image_features; it compiles with
cls (keeping [CLS]) and divprune on ORT with parity; a LLaVA on CLIP still loads as `llava`.
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import one_line_error, run_cli
from tiny_models import edited_copy, tiny_llava_dinov2
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.dinov2 import IMAGENET_MEAN, IMAGENET_STD
from vlmprune.compiler.pipeline import CompileOptions, compile_model


@pytest.fixture(scope="module")
def llava_dinov2_dir(tmp_path_factory):
    return tiny_llava_dinov2(tmp_path_factory.mktemp("llava_dinov2"), seed=3)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_dense_path_is_hf_get_image_features(llava_dinov2_dir, tmp_path, strategy):
    from transformers import LlavaForConditionalGeneration

    path = edited_copy(llava_dinov2_dir, tmp_path / "m", lambda c: c.update(vision_feature_select_strategy=strategy))
    source = load_source(str(path))
    assert source.family == "llava_dinov2" and source.has_cls and source.num_patches == 64
    assert (source.image_size, tuple(source.mean), tuple(source.std)) == (112, IMAGENET_MEAN, IMAGENET_STD)
    hf = LlavaForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").eval()
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = hf.get_image_features(pixel_values=x, vision_feature_layer=-2, vision_feature_select_strategy=strategy)
        expected = torch.stack(list(out.pooler_output))
        got = source.pipeline(x)
    assert got.shape == (2, 64 + (strategy == "full"), 48)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_clip_llava_still_loads_as_llava(tiny_llava_dir):
    assert load_source(str(tiny_llava_dir)).family == "llava"


@pytest.mark.parametrize("method, cls", [("cls", "keep"), ("divprune", None)])
def test_compiles_with_parity_on_ort(llava_dinov2_dir, tmp_path, method, cls):
    result = compile_model(str(llava_dinov2_dir), tmp_path / "b", CompileOptions(method=method, keep=16, cls=cls))
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["model"]["family"] == "llava_dinov2"
    assert result.manifest["method"]["prefix"] == (1 if method == "cls" else 0)


def test_refusals(llava_dinov2_dir, tmp_path):
    one_line_error(run_cli("compile", llava_dinov2_dir, "-o", tmp_path / "g", "--grid", "2x2"),
                   "--grid applies to anyres models (llava_next), not to this llava model")
    bad = edited_copy(llava_dinov2_dir, tmp_path / "bad", lambda c: c.update(vision_feature_select_strategy="cls"))
    one_line_error(run_cli("compile", bad, "-o", tmp_path / "s"),
                   "cannot be read as a transformers config "
                   "(Validation error for field 'vision_feature_select_strategy':)")
    assert not (tmp_path / "g").exists() and not (tmp_path / "s").exists()


def test_with_llm_exports_its_language_model(llava_dinov2_dir, tmp_path):
    result = compile_model(str(llava_dinov2_dir), tmp_path / "b", CompileOptions(keep=16, with_llm=True))
    assert result.report.passed, result.manifest["parity"]
    graphs = result.manifest["llm_graphs"]
    assert graphs["exporter_id"] == "torch" and graphs["parity"]["passed"] and graphs["parity"]["tokens_identical"]
    assert result.manifest["llm"]["positions"]["kind"] == "indices"
    assert (tmp_path / "b" / "llm" / "prefill.onnx").is_file()
