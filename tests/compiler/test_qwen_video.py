"""Qwen2-VL / Qwen2.5-VL video (--video-frames F): the dense clip path equals transformers' get_video_features, the
tokens' (t, h, w) equal get_rope_index's for a video, EVS compiles with parity on ort over the clip made here and
keeps vLLM's tokens there, and what a video bundle cannot take is refused in one line.

The tiny checkpoints of test_qwen2_vl (tiny_models.tiny_qwen) at 112 px: 4x4 merged tokens per temporal patch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import tiny_qwen
from video_references import vllm_mask
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.images import preprocess
from vlmprune.compiler.frontend.qwen2_vl import set_video, video_patches
from vlmprune.compiler.frontend.video import clip_made_here, load_clip, read_frames, sample_indices, write_frames
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.passes.methods.evs import EvsMethod, retained_tokens
from vlmprune.targets.runtime import ort_session, run_session

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# A vocabulary of 320 (UTF-8 bytes fit: generate's prompt without a tokenizer), its special tokens above the bytes.
VOCAB, IMAGE, VIDEO, START, END = 320, 300, 301, 302, 303
PROMPT = "what moves?"
SIZE, FRAMES = 112, 8


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return {family: tiny_qwen(tmp_path_factory.mktemp(f"video_{family}"), family, seed, ids, vocab_size=VOCAB,
                              initializer_range=0.3)
            for seed, family in enumerate(FAMILIES, start=30)}


@pytest.fixture(scope="module")
def hf_models(qwen_dirs):
    from transformers import AutoModelForImageTextToText

    return {family: AutoModelForImageTextToText.from_pretrained(path).eval() for family, path in qwen_dirs.items()}


def video_source(path, frames: int = FRAMES):
    source = load_source(str(path), image_size=SIZE)
    set_video(source, frames)
    return source


def processor_patches(clip: torch.Tensor, patch: int = 14, merge: int = 2, temporal: int = 2) -> torch.Tensor:
    """[F, C, S, S] -> [T·N, C·2·P·P]: the patches transformers' Qwen2VLVideoProcessor.patchify makes of one clip
    (restated: that module imports torchvision, absent here): frames in pairs, merge windows contiguous, each patch
    flattened (C, T, P, P)."""
    f, c, s, _ = clip.shape
    g = s // patch
    x = clip.reshape(f // temporal, temporal, c, g // merge, merge, patch, g // merge, merge, patch)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(f // temporal * g * g, c * temporal * patch * patch)


def hf_video_features(model, patches: torch.Tensor, frames: int) -> torch.Tensor:
    g = SIZE // 14
    with torch.inference_mode():
        out = model.model.get_video_features(pixel_values_videos=patches,
                                             video_grid_thw=torch.tensor([[frames // 2, g, g]])).pooler_output
    return out[0]


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
def test_clip_path_is_hf_get_video_features(qwen_dirs, hf_models, family):
    source = video_source(qwen_dirs[family])
    clip = torch.randn(FRAMES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = source.pipeline(clip)
    assert got.shape == (1, FRAMES // 2 * 16, 48) and source.num_patches == FRAMES // 2 * 16
    assert_close(got[0], hf_video_features(hf_models[family], processor_patches(clip), FRAMES))
    torch.testing.assert_close(video_patches(clip, 14, 2, 2), processor_patches(clip), rtol=0, atol=0)
    # pairs of equal frames: the image processor's own patches of each pair's frame, as a video of 4 patches
    from transformers import Qwen2VLImageProcessorPil

    still_pairs = clip[::2].repeat_interleave(2, dim=0)
    processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False)
    patches = processor(images=list(clip[::2].numpy()), return_tensors="pt",
                        input_data_format="channels_first")["pixel_values"]
    with torch.inference_mode():
        got = source.pipeline(still_pairs)
    assert_close(got[0], hf_video_features(hf_models[family], patches, FRAMES))


def test_frames_in_the_wrong_order_are_not_the_clip(qwen_dirs, hf_models):
    source = video_source(qwen_dirs["qwen2_5_vl"])
    clip = torch.randn(FRAMES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    expected = hf_video_features(hf_models["qwen2_5_vl"], processor_patches(clip), FRAMES)
    swapped = clip[[1, 0, 3, 2, 5, 4, 7, 6]]  # each pair's two frames swapped: the temporal kernel sees it
    with torch.inference_mode():
        wrong = source.pipeline(swapped)[0]
    assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_video_positions_are_hf_rope_index(qwen_dirs, hf_models, family):
    source = video_source(qwen_dirs[family])
    tokens, offset, g = source.num_patches, 4, SIZE // 14
    input_ids = torch.tensor([[5] * (offset - 1) + [START] + [VIDEO] * tokens + [END, 6, 7]])
    types = 2 * (input_ids == VIDEO).int()
    position_ids, _ = hf_models[family].model.get_rope_index(input_ids, types,
                                                             video_grid_thw=torch.tensor([[FRAMES // 2, g, g]]))
    np.testing.assert_array_equal(source.position_table + offset, position_ids[:, 0, offset:offset + tokens].T.numpy())
    if family == "qwen2_5_vl":  # time interval tokens_per_second (4 by default) per temporal patch
        assert source.position_table[16, 0] == hf_models[family].config.vision_config.tokens_per_second


def test_evs_on_real_embeddings_is_vllms(qwen_dirs):
    """The tiny tower's features of the clip made here (a still photograph, a moving square, a scene cut)."""
    source = video_source(qwen_dirs["qwen2_5_vl"], 16)
    clip = np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(16, SIZE)])
    with torch.inference_mode():
        features = source.pipeline(torch.from_numpy(clip))
    method = EvsMethod()
    for q in (0.5, 0.75):
        keep = retained_tokens(16, 8, q)
        got = method.reference({"keep": keep}, source_tensors(features, 8)).kept[0].numpy()
        assert got.tolist() == np.flatnonzero(vllm_mask(features[0].numpy(), 8, keep)).tolist()
        assert set(range(16)) <= set(got.tolist())
        cut = set(range(4 * 16, 5 * 16))  # the scene cut: temporal patch 4 (frames 8 and 9) differs everywhere
        assert cut <= set(got.tolist()) if q == 0.5 else len(cut & set(got.tolist())) >= 12


def source_tensors(features: torch.Tensor, frames: int):
    from vlmprune.compiler.frontend.tower import SiteTensors

    return SiteTensors(features, False, prefix=0, frames=frames)


@pytest.fixture(scope="module")
def evs_bundle(qwen_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("video_bundles") / "evs"
    return compile_model(str(qwen_dirs["qwen2_5_vl"]), out, CompileOptions(
        method="evs", keep=192, method_options={"video_pruning_rate": 0.5}, target="ort", opset=18,
        family_options={"image_size": SIZE, "video_frames": FRAMES}, cache=False))


def test_evs_bundle_passes_parity_and_keeps_vllms_tokens(evs_bundle, qwen_dirs):
    assert evs_bundle.report.passed
    manifest = evs_bundle.manifest
    assert manifest.method.keep == retained_tokens(16, 4, 0.5) == 32
    source = video_source(qwen_dirs["qwen2_5_vl"])
    clip = np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(FRAMES, SIZE)])
    out = run_session(ort_session(str(evs_bundle.bundle / "model.onnx")), clip)
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(clip))[0].numpy()
    kept = out["kept_indices"][0]
    assert kept.tolist() == np.flatnonzero(vllm_mask(dense, 4, 32)).tolist()
    np.testing.assert_allclose(out["image_features"][0], dense[kept], rtol=1e-4, atol=1e-4 * np.abs(dense).max())
    np.testing.assert_array_equal(out["kept_positions"][0], source.position_table[kept])


def test_frames_of_a_folder_and_a_file(tmp_path):
    clip = clip_made_here(12, 56)
    folder = write_frames(clip, tmp_path / "frames")
    frames, described = read_frames(folder, 4)
    assert sample_indices(12, 4) == [0, 4, 7, 11] and "12 frames, sampled to 4" in described
    np.testing.assert_array_equal(np.stack(frames), clip[[0, 4, 7, 11]])
    import imageio.v3 as iio

    iio.imwrite(tmp_path / "clip.gif", clip, loop=0)
    pixels, _ = load_clip(tmp_path / "clip.gif", 4, 56, (0.5,) * 3, (0.5,) * 3)
    assert pixels.shape == (4, 3, 56, 56)
    with pytest.raises(InputError, match="12 frames, and this bundle takes 16"):
        read_frames(folder, 16)
    with pytest.raises(InputError, match="no such file or folder"):
        read_frames(tmp_path / "missing", 4)


def test_refusals(qwen_dirs, tmp_path):
    path = str(qwen_dirs["qwen2_5_vl"])

    def compile_(name, **kw):
        family = {"image_size": SIZE, **kw.pop("family", {})}
        return compile_model(path, tmp_path / name, CompileOptions(target="ort", family_options=family, **kw))

    with pytest.raises(InputError, match="multiple of the temporal patch"):
        compile_("odd", method="evs", keep=20, family={"video_frames": 3})
    with pytest.raises(InputError, match="one clip per call"):
        compile_("batch", method="evs", keep=20, batch=2, family={"video_frames": 4})
    with pytest.raises(InputError, match="at least 2 frames"):
        compile_("image", method="evs", keep=8)
    with pytest.raises(InputError, match="attend each within itself"):
        compile_("attention", method="cls", keep=20, method_options={"score": "attention"},
                 family={"video_frames": 4})
    with pytest.raises(InputError, match=r"16 <= keep < 32"):
        compile_("keep", method="evs", keep=8, family={"video_frames": 4})
    with pytest.raises(InputError, match="runs each frame alone"):  # Qwen's temporal patches mix two frames
        compile_("encoder", method="evs-encoder", keep=20, layer=1, family={"video_frames": 4})


def test_run_video_draws_the_kept_tokens_frame_by_frame(evs_bundle, tmp_path):
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    folder = write_frames(clip_made_here(16, 64), tmp_path / "frames")
    show = tmp_path / "kept.png"
    result = CliRunner().invoke(main, ["run", str(evs_bundle.bundle), "--video", str(folder), "--show", str(show)])
    assert result.exit_code == 0, result.output
    assert "16 frames, sampled to 8" in result.output and "kept_indices: shape [1, 32]" in result.output
    from PIL import Image

    assert Image.open(show).width > 4 * 112  # the four temporal patches side by side
    image = tmp_path / "frame.png"
    Image.fromarray(clip_made_here(2, 64)[0]).save(image)
    refused = CliRunner().invoke(main, ["run", str(evs_bundle.bundle), "--image", str(image)])
    assert refused.exit_code != 0 and "pass --video PATH" in refused.output and "Traceback" not in refused.output
    both = CliRunner().invoke(main, ["run", str(evs_bundle.bundle), "--image", str(image), "--video", str(folder)])
    assert both.exit_code != 0 and "either as --image" in both.output


def clip_pixels(source, frames: int = FRAMES) -> np.ndarray:
    return np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(frames, SIZE)])


def test_dense_clip_splice_is_the_hf_forward(evs_bundle):
    """generate's dense video path (HF's get_video_features spliced at our (t, h, w)) = the model's own forward on
    pixel_values_videos and video_grid_thw."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.evaluate import hf_first_logits

    vlm = gen.load_vlm(str(evs_bundle.manifest.model.source), bundle=load_manifest(evs_bundle.bundle))
    assert vlm.source.frames == 4
    pixel = clip_pixels(vlm.source)
    prompt = gen.build_prompt(vlm, PROMPT)
    image = gen.dense_image(vlm, pixel)
    assert image.rows.shape == (64, 48)
    positions, text_start = image.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, image.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, 64)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    o = len(prompt.before)
    assert positions[0, 16] == o + 4 and text_start == o + 4  # t: 4 per temporal patch; the text after max(h, w)
    flat = positions.copy()
    flat[0] = o  # every temporal patch at t = 0: not the model's video positions
    wrong = gen.answer(vlm, prompt, image.rows, flat, text_start, 1)
    assert (wrong.first_logits - hf).abs().max() > 1e-3


def test_generate_answers_through_the_pruned_clip_at_hf_positions(evs_bundle, tmp_path):
    from vlmprune.compiler import api
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest

    manifest = load_manifest(evs_bundle.bundle)
    vlm = gen.load_vlm(str(manifest.model.source), bundle=manifest)
    pixel = clip_pixels(vlm.source)
    prompt = gen.build_prompt(vlm, PROMPT)
    tokens = gen.bundle_tokens(evs_bundle.bundle, manifest, pixel, vlm)
    o = len(prompt.before)
    positions, text_start = gen.bundle_positions(tokens, o)
    kept = np.asarray(tokens.kept)
    ids = gen.hf_forward_ids(vlm, prompt, 64)
    rope, _ = vlm.model.model.get_rope_index(ids["input_ids"], ids["mm_token_type_ids"],
                                             video_grid_thw=torch.tensor([[4, 8, 8]]))
    rope = rope[:, 0].numpy()
    np.testing.assert_array_equal(positions, rope[:, o + kept])  # the kept tokens at HF's dense video positions
    assert text_start == rope[0, o + 64]  # the text where HF's dense clip resumes it
    folder = write_frames(clip_made_here(FRAMES, SIZE), tmp_path / "frames")
    result = api.generate(evs_bundle.bundle, video=folder, prompt=PROMPT, max_new_tokens=3)
    assert result.path == "pruned" and result.kept == kept.tolist() and len(result.answer.tokens) >= 1
    with pytest.raises(InputError, match="pass --video PATH"):
        image = tmp_path / "frame.png"
        from PIL import Image

        Image.fromarray(clip_made_here(2, 64)[0]).save(image)
        api.generate(evs_bundle.bundle, image=image, prompt=PROMPT)


def test_dycoke_bundle_passes_parity_and_keeps_the_official_tokens(qwen_dirs, tmp_path):
    from video_references import dycoke_official

    result = compile_model(str(qwen_dirs["qwen2_vl"]), tmp_path / "dycoke", CompileOptions(
        method="dycoke", target="ort", family_options={"image_size": SIZE, "video_frames": FRAMES}, cache=False))
    assert result.report.passed and result.manifest.method.keep == 16 + 4 + 16 + 4  # 4 patches: 1 and 3 pruned
    source = video_source(qwen_dirs["qwen2_vl"])
    clip = clip_pixels(source)
    out = run_session(ort_session(str(result.bundle / "model.onnx")), clip)
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(clip))[0]
    official = dycoke_official(dense, 16)
    assert out["kept_indices"][0].tolist() == [j * 16 + i for j, ids in enumerate(official) for i in sorted(ids)]


def test_cli_summary_names_the_temporal_patches(qwen_dirs, tmp_path):
    """The counts line of a Qwen clip (two frames in one temporal patch), beside LLaVA-NeXT-Video's per-frame one."""
    from cli_helpers import run_cli

    ran = run_cli("compile", qwen_dirs["qwen2_vl"], "-m", "evs", "-k", 16, "--image-size", SIZE, "--video-frames", 4,
                  "-o", tmp_path / "b")
    assert ran.exit_code == 0, ran.output
    assert (f"image {SIZE}x{SIZE}: 8x8 = 64 patches, merged 2x2 into 4x4 per temporal patch: a clip of 4 frames, "
            "2 temporal patches, 32 tokens") in ran.output
