"""LLaVA-OneVision (llava_onevision) video: --video-frames F.

The tiny checkpoint (tiny_models.tiny_llava_onevision) at 56 px: 4x4 SigLIP patches per frame, pooled bilinearly to
2x2 = 4 rows per frame after the projector (at 70 px: 5x5 to ceil(5/2)² = 9). The dense clip path equals
transformers' get_video_features less its last row, image_newline; evs, dycoke and divprune prune the rows with
parity on ort, their kept rows those of the restated algorithms on the dense rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny_models import tiny_llava_onevision
from vlmprune.compiler.frontend import family_for, load_source
from vlmprune.compiler.frontend.images import preprocess
from vlmprune.compiler.frontend.video import clip_made_here
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, FRAMES, PER_FRAME = 56, 4, 4


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    return tiny_llava_onevision(tmp_path_factory.mktemp("tiny_llava_onevision"), seed=3)


def video_source(path, frames: int = FRAMES):
    source = load_source(str(path))
    family_for(source).fix(source, {"video_frames": frames}, prune=False, batch=None, cls=None)
    return source


@pytest.mark.parametrize("size,per_frame", [(SIZE, PER_FRAME), (70, 9)])  # 70 px: an odd 5x5 grid, ceil(5/2)²
def test_clip_path_is_hf_get_video_features_less_its_newline(tmp_path, size, per_frame):
    from transformers import LlavaOnevisionForConditionalGeneration

    path = tiny_llava_onevision(tmp_path / "m", seed=3, image_size=size)
    source = video_source(path)
    assert source.family == "llava_onevision" and source.num_patches == FRAMES * per_frame
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").eval()
    clip = torch.randn(FRAMES, 3, size, size, generator=torch.Generator().manual_seed(1))
    config = hf.config
    with torch.inference_mode():
        got = source.pipeline(clip)
        expected = hf.model.get_video_features(
            pixel_values_videos=clip[None], vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output
    assert expected.shape == (1, FRAMES * per_frame + 1, 48) and got.shape == (1, FRAMES * per_frame, 48)
    torch.testing.assert_close(got, expected[:, :-1], rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(expected[0, -1], hf.model.image_newline.detach())  # once, after the clip's rows


def official_kept(method: str, dense: np.ndarray, keep: int) -> list[int]:
    from method_references import divprune_official
    from video_references import dycoke_official, vllm_mask

    x = dense.astype(np.float64)
    if method == "evs":
        return np.flatnonzero(vllm_mask(dense, FRAMES, keep)).tolist()
    if method == "divprune":
        return sorted(divprune_official(x, keep))
    frames = dycoke_official(torch.from_numpy(x), PER_FRAME)
    return [j * PER_FRAME + i for j, ids in enumerate(frames) for i in sorted(ids)]


@pytest.mark.parametrize("method,keep", [("evs", 8), ("dycoke", 1), ("divprune", 6)])
def test_methods_prune_the_pooled_rows_as_their_references_do(ov_dir, tmp_path, method, keep):
    from vlmprune.compiler import api

    result = compile_model(str(ov_dir), tmp_path / method, CompileOptions(
        method=method, keep=keep, target="ort", family_options={"video_frames": FRAMES}))
    assert result.report.passed, result.manifest["parity"]
    for stage in json.loads((result.bundle / "parity.json").read_text())["stages"][1:]:
        assert stage["indices"]["agreement"] == 1.0, stage["indices"]
    k = result.manifest.method.keep
    assert k == (4 + 1 + 4 + 1 if method == "dycoke" else keep)  # dycoke: frames 1 and 3 keep int(0.3·4)
    source = video_source(ov_dir)
    clip = np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(FRAMES, SIZE)])
    out = api.run(result.bundle, inputs=clip).outputs
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(clip))[0].numpy()
    expected = official_kept(method, dense, k)
    assert out["kept_indices"][0].tolist() == expected
    np.testing.assert_allclose(out["image_features"][0], dense[expected], rtol=1e-4, atol=1e-4 * np.abs(dense).max())
    readme = (result.bundle / "README.md").read_text()
    assert "Append the checkpoint's `model.image_newline`" in readme
    assert f"then image_newline (the checkpoint's model.image_newline, [D]), once: offset + {FRAMES * PER_FRAME}" \
        in readme
    llm = result.manifest.llm  # the placeholder: F·M rows and the newline; the text after both
    assert (llm["dense_image_tokens"], llm["text_resumes_at"]) == (FRAMES * PER_FRAME + 1, FRAMES * PER_FRAME + 1)
    assert llm["after_rows"] == {"row": "image_newline", "weight": "model.image_newline", "count": 1}


REFUSED = [
    (["-m", "evs", "-k", "8"], "LLaVA-OneVision images (anyres_max crops"),
    (["-m", "evs", "-k", "8", "--video-frames", "1"], "--video-frames must be at least 2"),
    (["-m", "evs", "-k", "8", "--video-frames", "4", "--batch", "2"], "--batch does not apply to video"),
    (["-m", "evs-encoder", "-k", "8", "-l", "1", "--video-frames", "4"], "acts inside a video tower that runs each "
                                                                         "frame alone"),
    (["-m", "cls", "-k", "8", "-l", "1", "--video-frames", "4"], "a video bundle hands its methods the clip's tokens"),
    (["-m", "evs", "-k", "8", "--video-frames", "4", "--grid", "1x1"], "--grid applies to"),
    (["-m", "random", "-k", "8", "--video-frames", "4"], "use --site features"),
]


@pytest.mark.parametrize("args,needle", REFUSED, ids=[" ".join(a[:2] + a[4:]) for a, _ in REFUSED])
def test_what_it_cannot_do_is_one_line(ov_dir, tmp_path, args, needle):
    from cli_helpers import one_line_error, run_cli

    one_line_error(run_cli("compile", ov_dir, *args, "-o", tmp_path / "b"), needle)


def test_cli_summary_names_the_clip(ov_dir, tmp_path):
    from cli_helpers import run_cli

    ran = run_cli("compile", ov_dir, "-m", "evs", "--video-pruning-rate", "0.5", "--video-frames", FRAMES,
                  "-o", tmp_path / "b")
    assert ran.exit_code == 0, ran.output
    assert (f"image {SIZE}x{SIZE}: 4x4 = 16 patches, pooled 2x2 into 2x2 per frame: a clip of {FRAMES} frames, "
            f"{FRAMES * PER_FRAME} tokens") in ran.output
    from cli_helpers import one_line_error
    from vlmprune.compiler.frontend.video import write_frames

    folder = write_frames(clip_made_here(FRAMES, SIZE), tmp_path / "frames")
    shown = run_cli("run", tmp_path / "b", "--video", folder)  # the bundle runs on a clip
    assert shown.exit_code == 0 and "kept_indices: shape [1, 8]" in shown.output, shown.output
    # the tiny vocabulary (128) cannot take a prompt as UTF-8 bytes: one line
    one_line_error(run_cli("generate", tmp_path / "b", "--video", folder, "--prompt", "what moves?"),
                   "its vocabulary (128) is too small to take the prompt as UTF-8 bytes")


@pytest.mark.parametrize("target", ["orin", "xavier"])
def test_tensorrt_targets_host_parity(ov_dir, tmp_path, target):
    """xavier's opset-17 graph takes the bilinear pooling as Resize-13 (passes.tensorrt.DowngradeOpsetPass)."""
    result = compile_model(str(ov_dir), tmp_path / target, CompileOptions(
        method="evs", keep=8, target=target, family_options={"video_frames": FRAMES}))
    assert result.report.passed, result.manifest["parity"]


# ---------------------------------------------------------------- generate and eval: the LLM answers about a clip

VOCAB, IMAGE_TOKEN, VIDEO_TOKEN, PROMPT, NEW = 320, 300, 301, "what moves?", 10


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A byte-sized vocabulary (generate's prompt without a tokenizer), the image and video tokens above the bytes."""
    return tiny_llava_onevision(tmp_path_factory.mktemp("ov_chat"), seed=5, image_token=IMAGE_TOKEN,
                                video_token=VIDEO_TOKEN, vocab_size=VOCAB, initializer_range=0.3)


@pytest.fixture(scope="module")
def chat_clip(tmp_path_factory):
    from vlmprune.compiler.frontend.video import write_frames

    return write_frames(clip_made_here(FRAMES, SIZE), tmp_path_factory.mktemp("ov_frames"))


def chat_bundle(chat_dir, out, method, keep, with_llm: bool = False):
    options = dict(method=method, keep=keep, with_llm=with_llm) if method else dict(prune=False)
    result = compile_model(str(chat_dir), out, CompileOptions(target="ort", family_options={"video_frames": FRAMES},
                                                              **options))
    assert result.report.passed, result.manifest["parity"]
    return result.bundle


def test_dense_bundle_generates_what_transformers_generates(chat_dir, chat_clip, tmp_path):
    """The dense bundle's F·M rows, model.image_newline after them, the prompt around: transformers' own generate on
    the same frames (pixel_values_videos), token for token; --dense (get_video_features) too."""
    from vlmprune.compiler import api
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.frontend.video import load_clip

    bundle = chat_bundle(chat_dir, tmp_path / "dense", None, None)
    result = api.generate(bundle, video=chat_clip, prompt=PROMPT, max_new_tokens=NEW)
    dense = FRAMES * PER_FRAME + 1
    assert result.kept is None and result.answer.image_tokens == dense
    vlm = gen.load_vlm(str(chat_dir), options={"video_frames": FRAMES})
    prompt = result.prompt
    assert prompt.text == f"<|im_start|>user <video>\n{PROMPT}<|im_end|><|im_start|>assistant\n"
    ids = torch.tensor([prompt.before + [VIDEO_TOKEN] * dense + prompt.after])
    assert IMAGE_TOKEN not in ids[0].tolist() and ids[0].tolist().count(VIDEO_TOKEN) == dense
    pixel, _ = load_clip(chat_clip, FRAMES, SIZE, vlm.source.mean, vlm.source.std)
    with torch.inference_mode():
        hf = vlm.model.generate(input_ids=ids, pixel_values_videos=torch.from_numpy(pixel)[None],
                                max_new_tokens=NEW, do_sample=False)
    hf_tokens = hf[0, ids.shape[1]:].tolist()
    assert result.answer.tokens == hf_tokens, (result.answer.tokens, hf_tokens)
    assert len(set(hf_tokens)) > 2  # an answer that varies, so the comparison means something
    assert result.answer.position_ids == list(range(ids.shape[1]))
    own = api.generate(bundle, video=chat_clip, prompt=PROMPT, max_new_tokens=NEW, dense=True)
    assert own.answer.tokens == hf_tokens and own.path == "dense"


@pytest.mark.parametrize("method,keep,with_llm", [("evs", 8, True), ("divprune", 6, False)])
def test_pruned_bundle_generates_what_the_reference_rows_give(chat_dir, chat_clip, tmp_path, method, keep, with_llm):
    """The kept rows at their dense index, the newline at F·M, the text after F·M + 1: the bundle's answer equals
    --reference (evs: compiled --with-llm, its own LLM graphs against transformers' LLM) and the answer to the
    PyTorch path's rows at the kept indices placed so, token for token."""
    from vlmprune.compiler import api
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.frontend.video import load_clip

    bundle = chat_bundle(chat_dir, tmp_path / method, method, keep, with_llm)
    result = api.generate(bundle, video=chat_clip, prompt=PROMPT, max_new_tokens=NEW)
    reference = api.generate(bundle, video=chat_clip, prompt=PROMPT, max_new_tokens=NEW, reference=True)
    assert result.llm.startswith("the bundle's LLM graphs" if with_llm else "transformers (the bundle holds no")
    assert reference.llm.startswith("transformers (--reference" if with_llm else "transformers (the bundle holds no")
    assert torch.allclose(reference.answer.first_logits, result.answer.first_logits, atol=1e-4)
    kept = result.kept
    assert result.path == "pruned" and len(kept) == keep and result.answer.image_tokens == keep + 1
    assert reference.answer.tokens == result.answer.tokens and reference.kept == kept
    offset, dense = len(result.prompt.before), FRAMES * PER_FRAME
    assert result.answer.position_ids == (list(range(offset)) + [offset + k for k in kept] + [offset + dense]
                                          + list(range(offset + dense + 1,
                                                       offset + dense + 1 + len(result.prompt.after))))
    vlm = gen.load_vlm(str(chat_dir), options={"video_frames": FRAMES})
    pixel, _ = load_clip(chat_clip, FRAMES, SIZE, vlm.source.mean, vlm.source.std)
    with torch.inference_mode():
        rows = vlm.source.pipeline(torch.from_numpy(pixel))[0]
    assert kept == official_kept(method, rows.numpy(), keep)
    newline = vlm.model.model.image_newline.detach()[None]
    positions = np.array([offset + k for k in kept] + [offset + dense])
    torch_answer = gen.answer(vlm, result.prompt, torch.cat([rows[kept], newline]), positions, offset + dense + 1,
                              NEW)
    assert torch_answer.tokens == result.answer.tokens, (torch_answer.tokens, result.answer.tokens)
    assert torch.allclose(torch_answer.first_logits, result.answer.first_logits, atol=1e-4)


def test_eval_video_prints_its_rows_and_generate_refuses_images(chat_dir, chat_clip, tmp_path):
    from cli_helpers import one_line_error, run_cli

    bundle = chat_bundle(chat_dir, tmp_path / "evs", "evs", 8)
    ran = run_cli("eval", bundle, "--video", chat_clip, "--prompt", PROMPT)
    assert ran.exit_code == 0, ran.output
    # the dense side: F·M + 1 video tokens (transformers' own forward, the harness check: the splice is it); the
    # bundle's: K kept rows and the newline
    assert f"dense: {FRAMES * PER_FRAME + 1} image tokens; harness check KL 0)" in ran.output, ran.output
    row = next(line.split() for line in ran.output.splitlines() if line.startswith("evs "))
    assert row[1:3] == ["8", "9"] and row[-3:] == ["bundle", "evs", "(ort)"], ran.output
    ran = run_cli("generate", bundle, "--video", chat_clip, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert ran.exit_code == 0, ran.output
    one_line_error(run_cli("generate", bundle, "--image", chat_clip / "frame_000.png", "--prompt", PROMPT),
                   "pass --video PATH")


# The chat template LLaVA-OneVision's released processors carry (transformers' own processor tests hold the same).
ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'text') %}{{ '\n' + content['text'] }}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_prompt_is_the_processors_for_a_video(tmp_path, chat_clip):
    """The prompt's ids are the chat template's text for a video with <video> expanded as transformers'
    LlavaOnevisionProcessor expands it for the same clip (replace_video_token: F·ceil(s/2)² + 1 video tokens),
    tokenized; the placeholder the video token, not the image token."""
    import types

    from tiny_models import byte_tokenizer
    from transformers import AutoTokenizer
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.frontend.video import load_clip

    video = 258  # the tokenizer's third special, <video>
    ckpt = tiny_llava_onevision(tmp_path / "ckpt", seed=5, image_token=IMAGE_TOKEN, video_token=video,
                                vocab_size=VOCAB)
    byte_tokenizer(ckpt, ("<|im_start|>", "<|im_end|>", "<video>"), IMAGE_TOKEN, ONEVISION_TEMPLATE)
    vlm = gen.load_vlm(str(ckpt), options={"video_frames": FRAMES})
    prompt = gen.build_prompt(vlm, PROMPT)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user <video>\n{PROMPT}<|im_end|><|im_start|>assistant\n" == prompt.text
    pixel, _ = load_clip(chat_clip, FRAMES, SIZE, vlm.source.mean, vlm.source.std)
    processor = types.SimpleNamespace(num_image_tokens=(SIZE // 14) ** 2, video_token="<video>")
    expanded = text.replace("<video>", LlavaOnevisionProcessor.replace_video_token(
        processor, {"pixel_values_videos": [torch.from_numpy(pixel)]}, 0))
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert prompt.before + [video] * (FRAMES * PER_FRAME + 1) + prompt.after == ids
    assert IMAGE_TOKEN not in ids and prompt.how == "the checkpoint's chat template"


def test_eval_dataset_of_clips_and_its_images_refused(chat_dir, tmp_path):
    """eval MODEL --dataset DIR --video-frames F compiles its clip bundles and answers through them (the newline after
    the kept rows: K + 1 image tokens, dense F·M + 1); the checkpoint's images stay refused in one line."""
    from cli_helpers import one_line_error, run_cli

    from vlmprune.compiler import api
    from vlmprune.compiler.quality.dataset import read_dataset, write_video_dataset

    write_video_dataset(tmp_path / "data", clips=1, frames=FRAMES + 2, size=SIZE)
    ran = run_cli("eval", chat_dir, "--dataset", tmp_path / "data", "--video-frames", FRAMES, "-m", "evs", "-k", 8,
                  "--max-new-tokens", 2, "--store", tmp_path / "store.sqlite", "--json", "--quiet")
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.output)
    assert report["video_frames"] == FRAMES and report["dense_image_tokens"] == FRAMES * PER_FRAME + 1
    evs = next(r for r in report["rows"] if r["method"] == "evs")
    for sample in read_dataset(tmp_path / "data"):
        cell = evs["answers"][sample.digest]
        assert cell["extra"]["image_tokens"] == 9 and len(cell["extra"]["kept"]) == 8
        answer = api.generate(evs["bundle"], video=sample.image, prompt=sample.question, max_new_tokens=2)
        assert cell["answer"] == " ".join(map(str, answer.answer.tokens)) and cell["extra"]["kept"] == answer.kept
    (tmp_path / "prompts.txt").write_text("what is it?\n")
    one_line_error(run_cli("eval", chat_dir, "--images", tmp_path / "data" / "clip0", "--prompts",
                           tmp_path / "prompts.txt", "-m", "divprune", "-k", 4), "LLaVA-OneVision images (anyres_max")
    one_line_error(run_cli("eval", chat_dir, "--dataset", tmp_path / "data", "-m", "evs", "-k", 8),
                   "its rows name videos: pass --video-frames F")
