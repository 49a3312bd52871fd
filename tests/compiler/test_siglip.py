"""SigLIP towers end to end: --score probe (cls, visionzip) through the attention-pooling head, LLaVA models
whose vision tower is SigLIP, and the refusals (no head, LLaVA's `default` strategy on SigLIP, Idefics3).

Tiny offline checkpoints saved by transformers: a SiglipVisionModel with its head, and a
LlavaForConditionalGeneration on a SigLIP tower (select strategy `full`, as LLaVA-OneVision's).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from tiny_models import edited_copy
from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

KEEP = 16


def _siglip_config(use_head: bool = True):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=112, patch_size=14, vision_use_head=use_head)


def _sharpen(head) -> None:
    """A probe that prefers some patches (a trained head does; a random one is near uniform: ties)."""
    with torch.no_grad():
        head.probe.mul_(4.0)


@pytest.fixture(scope="module")
def siglip_head_dir(tmp_path_factory):
    from transformers import SiglipVisionModel

    torch.manual_seed(11)
    model = SiglipVisionModel(_siglip_config()).eval()
    _sharpen(model.head)
    path = tmp_path_factory.mktemp("siglip_head")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llava_siglip_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(12)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=128)
    config = LlavaConfig(vision_config=_siglip_config(), text_config=text, vision_feature_layer=-1,
                         vision_feature_select_strategy="full", image_token_index=100)
    model = LlavaForConditionalGeneration(config).eval()
    _sharpen(model.model.vision_tower.head)
    path = tmp_path_factory.mktemp("llava_siglip")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _compile(model, out, method, **kwargs):
    return compile_model(str(model), out, CompileOptions(method=method, keep=KEEP, **kwargs))


def test_cls_probe_on_a_siglip_tower(siglip_head_dir, tmp_path):
    result = _compile(siglip_head_dir, tmp_path / "b", "cls", batch=3, method_options={"score": "probe"})
    assert result.report.passed, result.manifest["parity"]
    method = result.manifest["method"]
    assert method["has_cls"] is False and method["params"]["score"] == "probe"
    assert method["summary"].startswith("probe attention (pooling head): top 16 + 1 summary")
    # TokenPrune copies one [CLS] token: its fusion declines a tower without one, the standard ops run.
    assert [s.stage for s in result.report.stages] == ["export", "rewritten", "fused"]
    assert result.manifest["target"]["fused"] is False
    features = next(o for o in result.manifest["outputs"] if o["name"] == "image_features")
    assert features["shape"] == [3, KEEP + 1, 32]
    assert result.report.stages[-1].indices["per_image"] == [1.0, 1.0, 1.0]  # kept-index agreement per image


def test_llava_on_siglip_dense_is_get_image_features(llava_siglip_dir):
    from transformers import LlavaForConditionalGeneration

    source = load_source(str(llava_siglip_dir))
    assert source.family == "llava" and source.has_cls is False and source.pipeline.tower.head is not None
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        llava = LlavaForConditionalGeneration.from_pretrained(llava_siglip_dir, attn_implementation="sdpa").eval()
        expected = llava.model.get_image_features(pixel_values=x)
        expected = getattr(expected, "pooler_output", expected)
        got = source.pipeline(x)
    torch.testing.assert_close(got.reshape(-1, got.shape[-1]), torch.cat(list(expected)).reshape(-1, got.shape[-1]),
                               rtol=0, atol=0)


# divprune and dart on a bare SigLIP tower: tests/compiler/test_methods.py.
@pytest.mark.parametrize("method,target,options", [("visionzip", "orin", {"score": "probe", "contextual": 4}),
                                                   ("divprune", "ort", {})])
def test_llava_on_siglip(llava_siglip_dir, tmp_path, method, target, options):
    result = _compile(llava_siglip_dir, tmp_path / "b", method, target=target, method_options=options)
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["model"]["family"] == "llava" and result.manifest["method"]["has_cls"] is False
    features = next(o for o in result.manifest["outputs"] if o["name"] == "image_features")
    assert features["shape"][1:] == [KEEP, 48]  # projector output width


def test_probe_refused_without_a_head(tiny_clip_dir, llava_siglip_dir, tmp_path):
    with pytest.raises(InputError, match="cls with --score probe needs an attention-pooling head"):
        _compile(tiny_clip_dir, tmp_path / "b", "cls", method_options={"score": "probe"})
    assert not (tmp_path / "b").exists()
    # A LLaVA checkpoint whose config keeps SigLIP's default vision_use_head=True but whose weights lack the head.
    copy = tmp_path / "headless"
    shutil.copytree(llava_siglip_dir, copy)
    from safetensors.torch import load_file, save_file

    weights = next(copy.glob("*.safetensors"))
    save_file({k: v for k, v in load_file(weights).items() if ".head." not in k}, weights, metadata={"format": "pt"})
    assert load_source(str(copy)).pipeline.tower.head is None
    result = CliRunner().invoke(main, ["compile", str(copy), "--method", "visionzip", "--score", "probe",
                                       "--keep", "16", "-q", "-o", str(tmp_path / "c")])
    assert result.exit_code == 2 and "needs an attention-pooling head" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_refused_configurations(llava_siglip_dir, tmp_path):
    copy = edited_copy(llava_siglip_dir, tmp_path / "default",
                       lambda config: config.update(vision_feature_select_strategy="default"))
    with pytest.raises(InputError, match="'default' on a SigLIP tower drops its first patch token"):
        load_source(str(copy))
    idefics = tmp_path / "idefics3"
    idefics.mkdir()
    (idefics / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    shutil.copy(next(llava_siglip_dir.glob("*.safetensors")), idefics / "model.safetensors")
    with pytest.raises(InputError, match="idefics3.*pixel-shuffles"):
        load_source(str(idefics))


def test_methods_command_says_which_families_each_serves():
    result = CliRunner().invoke(main, ["methods"])
    assert result.exit_code == 0, result.output
    assert result.output.count("SigLIP towers with their attention-pooling head, with --score probe") == 2
    assert "serves:   every family (no [CLS] needed" in result.output
    assert "--score: what ranks the patches" in result.output
