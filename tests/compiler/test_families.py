"""Model families through their adapters: the dense path equals transformers' own features, every method
the family can serve compiles with parity, the others are refused in one line.

Tiny offline checkpoints of every family (CLIP and SigLIP towers, LLaVA, ViT, DINOv2 with and
without register tokens), saved by transformers as a user's would be.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import edited_copy
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

FAMILIES = {"tiny_clip_dir": ("clip", 1), "tiny_siglip_dir": ("clip", 0), "tiny_vit_dir": ("vit", 1),
            "tiny_dinov2_dir": ("dinov2", 1), "tiny_dinov2_registers_dir": ("dinov2", 5)}
NEED_CLS = ("cls", "visionzip")


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_dense_path_is_the_models_own_last_hidden_state(request, fixture):
    from transformers import AutoModel

    path = request.getfixturevalue(fixture)
    source = load_source(str(path))
    family, prefix = FAMILIES[fixture]
    assert source.family == family and source.pipeline.prefix == prefix
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()(pixel_values=x).last_hidden_state
        got = source.pipeline(x)
    # LLaVA's default select strategy: the features are the patch tokens ([CLS] and registers dropped).
    torch.testing.assert_close(got, expected[:, prefix:], rtol=0, atol=0)


@pytest.mark.parametrize("fixture", ["tiny_vit_dir", "tiny_dinov2_dir", "tiny_dinov2_registers_dir"])
@pytest.mark.parametrize("method", ["cls", "visionzip", "divprune", "dart"])
def test_every_method_on_vit_and_dinov2(request, tmp_path, fixture, method):
    path = request.getfixturevalue(fixture)
    options = {"visionzip": {"contextual": 4}}.get(method, {})
    result = compile_model(str(path), tmp_path / "b", CompileOptions(method=method, keep=16, method_options=options))
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["model"]["family"] == FAMILIES[fixture][0]
    registers = fixture == "tiny_dinov2_registers_dir"
    assert result.manifest["method"]["prefix"] == (0 if method in ("divprune", "dart") else 5 if registers else 1)
    stages = [s.stage for s in result.report.stages]
    fused = method == "divprune" or (method == "cls" and not registers)  # TokenPrune copies one [CLS] token
    assert stages[-1] == "fused" and result.manifest["target"]["fused"] is fused


def test_register_tokens_are_kept_and_not_counted(tiny_dinov2_registers_dir, tmp_path):
    result = compile_model(str(tiny_dinov2_registers_dir), tmp_path / "b",
                           CompileOptions(keep=16, layer=2, cls="keep"))
    assert result.report.passed
    features = next(o for o in result.manifest["outputs"] if o["name"] == "image_features")
    assert features["shape"][1] == 1 + 4 + 16 + 1  # [CLS], 4 registers, K kept, the summary
    assert result.manifest["method"]["kept_count"] == 16


@pytest.mark.parametrize("method", NEED_CLS)
def test_siglip_refuses_cls_methods(tiny_siglip_dir, tmp_path, method):
    with pytest.raises(InputError, match=f"method {method} needs a \\[CLS\\] token"):
        compile_model(str(tiny_siglip_dir), tmp_path / "b", CompileOptions(method=method, keep=16))


def test_vit_checkpoint_with_a_wrong_shape_is_one_line(tiny_vit_dir, tmp_path):
    copy = edited_copy(tiny_vit_dir, tmp_path / "vit", lambda config: config.update(intermediate_size=80))
    with pytest.raises(InputError, match="the checkpoint and config disagree"):
        load_source(str(copy))


def test_blocks_spelled_out_equal_each_familys_own_layer(tiny_vit_dir, tiny_dinov2_registers_dir, tiny_clip_dir):
    """VisionPipeline writes each block out (for torch.compile); it must be the layer's own forward, bit for bit."""
    from vlmprune.compiler.frontend.tower import run_block

    for path in (tiny_vit_dir, tiny_dinov2_registers_dir, tiny_clip_dir):
        tower = load_source(str(path)).pipeline.tower
        h = tower.embed(torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(1)))
        with torch.inference_mode():
            for layer in tower.blocks:
                mine, qk = run_block(tower.parts(layer), h, capture=True)
                theirs = layer(h, None)
                theirs = theirs[0] if isinstance(theirs, tuple) else theirs
                assert torch.equal(mine, theirs) and qk[0].shape == qk[1].shape
                h = mine
    assert np.isfinite(h.numpy()).all()
