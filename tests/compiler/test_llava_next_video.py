"""LLaVA-NeXT-Video (llava_next_video, the llava_next family) video: --video-frames F.

The tiny checkpoint (tiny_models.tiny_llava_next_video) at 56 px: 4x4 patches per frame, pooled 2x2 into 2x2 = 4
tokens per frame by the resampler; 2 of its 3 CLIP blocks run (feature layer -2). The dense clip path equals
transformers' get_video_features for the same frames; evs prunes the pooled rows with parity on ort.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import tiny_llava_next_video
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import family_for, load_source
from vlmprune.compiler.frontend.images import preprocess
from vlmprune.compiler.frontend.video import clip_made_here
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, FRAMES, PER_FRAME = 56, 6, 4


@pytest.fixture(scope="module")
def lnv_dir(tmp_path_factory):
    return tiny_llava_next_video(tmp_path_factory.mktemp("tiny_llava_next_video"), seed=21)


@pytest.fixture(scope="module")
def hf_model(lnv_dir):
    from transformers import LlavaNextVideoForConditionalGeneration

    return LlavaNextVideoForConditionalGeneration.from_pretrained(lnv_dir, attn_implementation="sdpa").eval()


def video_source(path, frames: int = FRAMES):
    source = load_source(str(path))
    family_for(source).fix(source, {"video_frames": frames}, prune=False, batch=None, cls=None)
    return source


def hf_video_features(model, clip: torch.Tensor) -> torch.Tensor:
    config = model.config
    with torch.inference_mode():
        return model.model.get_video_features(
            pixel_values_videos=clip[None], vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output


def test_clip_path_is_hf_get_video_features(lnv_dir, hf_model):
    source = video_source(lnv_dir)
    assert source.family == "llava_next" and source.frames == FRAMES and source.num_patches == FRAMES * PER_FRAME
    clip = torch.randn(FRAMES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = source.pipeline(clip)
    expected = hf_video_features(hf_model, clip)
    assert got.shape == expected.shape == (1, FRAMES * PER_FRAME, 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    reversed_ = hf_video_features(hf_model, clip.flip(0))  # the frames' order is the rows' order
    assert (reversed_ - got).abs().max() > 1e-3


def test_refusals(lnv_dir, tmp_path):
    source = load_source(str(lnv_dir))
    family = family_for(source)
    with pytest.raises(InputError, match="at least 2"):
        family.fix(source, {"video_frames": 1}, prune=True, batch=None, cls=None)
    with pytest.raises(InputError, match="one clip per call"):
        family.fix(load_source(str(lnv_dir)), {"video_frames": 4}, prune=True, batch=2, cls=None)
    with pytest.raises(InputError, match="not to a clip"):
        family.fix(load_source(str(lnv_dir)), {"video_frames": 4, "grid": "1x1"}, prune=True, batch=None, cls=None)
    with pytest.raises(InputError, match="rk3588 cannot run this video bundle"):
        compile_model(str(lnv_dir), tmp_path / "rk", CompileOptions(
            method="evs", keep=12, target="rk3588", family_options={"video_frames": 4}))


def test_evs_bundle_passes_parity_on_the_pooled_rows(lnv_dir, tmp_path):
    from vlmprune.passes.methods.evs import retained_tokens
    from vlmprune.targets.runtime import ort_session, run_session

    result = compile_model(str(lnv_dir), tmp_path / "evs", CompileOptions(
        method="evs", keep=8, method_options={"video_pruning_rate": 0.5}, target="ort",
        family_options={"video_frames": FRAMES}, cache=False))
    assert result.report.passed and result.manifest.method.keep == retained_tokens(PER_FRAME, FRAMES, 0.5) == 12
    assert result.manifest.llm["positions"]["kind"] == "indices"
    source = video_source(lnv_dir)
    clip = np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(FRAMES, SIZE)])
    out = run_session(ort_session(str(result.bundle / "model.onnx")), clip)
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(clip))[0].numpy()
    kept = out["kept_indices"][0]
    assert set(range(PER_FRAME)) <= set(kept.tolist())  # the first frame always
    np.testing.assert_allclose(out["image_features"][0], dense[kept], rtol=1e-4, atol=1e-4 * np.abs(dense).max())
