"""`vlmprune eval` over clips: `eval BUNDLE --video PATH --prompt TEXT` against dense, and `eval --dataset` of
videos on compiled video bundles (compiler.evaluate, compiler.accuracy), on a tiny seeded Qwen2.5-VL at 112 px.

Tiny random models answer gibberish, so what is checked is the machinery: a clip's pruned answer is the one
`vlmprune generate --video` gives for the same bundle, clip and prompt; the dense side is the model's own video
path (its harness KL, the model's own forward on pixel_values_videos, is 0 up to rounding); each dataset cell is
the bundle's answer for its clip and question, the dense row the same clip unpruned; bad input is one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import one_line_error, run_cli
from tiny_models import tiny_qwen
from vlmprune.compiler import api
from vlmprune.compiler.cli import render
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.video import seeded_clip, write_frames
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.compiler.quality.dataset import read_dataset, write_video_dataset

VOCAB, IMAGE, VIDEO, START, END = 320, 300, 301, 302, 303  # UTF-8 bytes fit below the special tokens
SIZE, FRAMES = 112, 8
PROMPTS = ("what moves?", "which color?")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return tiny_qwen(tmp_path_factory.mktemp("eval_video_qwen"), "qwen2_5_vl", 31, ids, vocab_size=VOCAB,
                     initializer_range=0.3)


@pytest.fixture(scope="module")
def evs_bundle(qwen_dir, tmp_path_factory):
    return compile_model(str(qwen_dir), tmp_path_factory.mktemp("eval_video_bundles") / "evs", CompileOptions(
        method="evs", keep=16, method_options={"video_pruning_rate": 0.5}, target="ort",
        family_options={"image_size": SIZE, "video_frames": FRAMES}, cache=False)).bundle


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_video_clips")
    return [write_frames(seeded_clip(seed, FRAMES + 2, SIZE)[0], root / f"clip{seed}") for seed in (0, 1)]


def test_eval_bundle_on_clips_is_generates_answer_against_the_models_own_video_path(evs_bundle, clips):
    result = api.eval(evs_bundle, video=clips, prompt=PROMPTS, max_new_tokens=3)
    data = result.data
    assert data["video_frames"] == FRAMES and data["images"] == [c.name for c in clips]
    assert data["dense_image_tokens"] == 64  # 4 temporal patches of 4x4 merged tokens
    assert data["harness_kl_max"] < 1e-6  # the dense splice is the model's own forward on pixel_values_videos
    row, = data["results"]
    assert row["method"] == "evs" and row["keep"] == 32 and row["image_tokens"] == 32
    assert len(row["samples"]) == len(clips) * len(PROMPTS)
    for sample in row["samples"]:
        clip = next(c for c in clips if c.name == sample["image"])
        answer = api.generate(evs_bundle, video=clip, prompt=sample["prompt"], max_new_tokens=3)
        assert sample["pruned_tokens"] == answer.answer.tokens
        dense = api.generate(evs_bundle, video=clip, prompt=sample["prompt"], max_new_tokens=3, dense=True)
        assert sample["dense_tokens"] == dense.answer.tokens
        assert sample["exact"] == (answer.answer.tokens == dense.answer.tokens)
    assert any(s["kl"] > 0 for s in row["samples"])  # half the clip's tokens dropped moves the distribution
    assert "2 clips of 8 frames x 2 prompts" in "\n".join(render.eval_lines(result))


def test_eval_video_bad_input_is_one_line(evs_bundle, clips, qwen_dir, tmp_path):
    one_line_error(run_cli("eval", evs_bundle, "--video", tmp_path / "nowhere", "--prompt", "hi"),
                   "no such file or folder")
    one_line_error(run_cli("eval", qwen_dir, "--video", clips[0], "--prompt", "hi"), "pass the bundle")
    one_line_error(run_cli("eval", evs_bundle, "--video", clips[0], "--prompt", "hi", "-m", "evs", "-k", "8"),
                   "compile --video-frames F -m METHOD")
    one_line_error(run_cli("eval", evs_bundle, "--video", clips[0], "--prompt", " "), "is empty")
    one_line_error(run_cli("eval", evs_bundle, "--video", clips[0], "--images", clips[0], "--prompt", "hi"),
                   "give one of them")
    short = write_frames(seeded_clip(3, 4, SIZE)[0], tmp_path / "short")
    one_line_error(run_cli("eval", evs_bundle, "--video", short, "--prompt", "hi"), "this bundle takes 8")
    folder = tmp_path / "images"
    folder.mkdir()
    from PIL import Image

    Image.fromarray(seeded_clip(0, 2, SIZE)[0][0]).save(folder / "a.png")
    one_line_error(run_cli("eval", evs_bundle, "--images", folder, "--prompt", "hi"), "pass --video PATH")


def test_cli_eval_bundle_video_prompt_json(evs_bundle, clips):
    result = run_cli("eval", evs_bundle, "--video", clips[0], "--prompt", PROMPTS[0], "--max-new-tokens", 2, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["videos"] == [str(clips[0])] and data["results"][0]["from"].startswith("bundle evs")


# ------------------------------------------------------------------------------------------- eval --dataset, video


def test_video_dataset_maker_reads_back_with_its_answers(tmp_path):
    path = write_video_dataset(tmp_path / "data", clips=3, frames=FRAMES, size=64, file_clips=1)
    samples = read_dataset(tmp_path / "data")  # a folder: its questions.jsonl
    assert len(samples) == 6 and all(s.video for s in samples)
    assert samples[-1].image.endswith("clip2.gif") and [s.type for s in samples[:2]] == ["color", "direction"]
    for i in range(3):
        _, facts = seeded_clip(i, FRAMES, 64)
        assert samples[2 * i].answers == (facts["color"],) and samples[2 * i + 1].answers == (facts["direction"],)
    assert len({s.digest for s in samples}) == 6
    again = read_dataset(write_video_dataset(tmp_path / "again", clips=3, frames=FRAMES, size=64, file_clips=1))
    assert [s.digest for s in again] == [s.digest for s in samples]  # the same clips and questions, moved
    frames = sorted((tmp_path / "again" / "clip0").iterdir())
    frames[1].write_bytes(frames[0].read_bytes())  # one frame changed: a new clip, new cells
    assert read_dataset(tmp_path / "again")[0].digest != samples[0].digest


def test_a_dataset_is_all_images_or_all_videos(tmp_path):
    path = write_video_dataset(tmp_path, clips=1, frames=4, size=32)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "still.png")
    with path.open("a") as f:
        f.write(json.dumps({"image": "still.png", "question": "q", "answers": ["a"]}) + "\n")
    with pytest.raises(InputError, match="all images or all videos"):
        read_dataset(path)
    path.write_text(json.dumps({"video": "clip0", "image": "still.png", "question": "q", "answers": ["a"]}) + "\n")
    with pytest.raises(InputError, match="both an image and a video"):
        read_dataset(path)
    with pytest.raises(InputError, match="without questions.jsonl"):
        read_dataset(tmp_path / "clip0")


@pytest.fixture(scope="module")
def video_sweep(qwen_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_video_dataset")
    write_video_dataset(root / "data", clips=2, frames=FRAMES + 2, size=SIZE, file_clips=1)
    store = root / "store.sqlite"
    result = run_cli("eval", qwen_dir, "--dataset", root / "data", "--video-frames", FRAMES, "--image-size", SIZE,
                     "-m", "evs", "-k", 16, "--max-new-tokens", 2, "--store", store, "--json", "--quiet")
    return root, store, result


def test_eval_dataset_of_videos_end_to_end(video_sweep, qwen_dir):
    root, store, result = video_sweep
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["video_frames"] == FRAMES and report["samples"] == 4
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"dense", "evs", "random", "grid"}
    assert rows["dense"]["answers"][report["sample_digests"][0]]["extra"]["image_tokens"] == 64
    assert report["dense_image_tokens"] == 64
    samples = read_dataset(root / "data")
    evs = rows["evs"]
    assert evs["keep"] == 16 and set(evs["by_type"]) == {"color", "direction"}
    for sample in samples:  # each cell is the bundle's answer for that clip and question
        cell = evs["answers"][sample.digest]
        assert cell["extra"]["image_tokens"] == 16 and len(cell["extra"]["kept"]) == 16
        answer = api.generate(evs["bundle"], video=sample.image, prompt=sample.question, max_new_tokens=2)
        assert cell["answer"] == " ".join(map(str, answer.answer.tokens)) and cell["extra"]["kept"] == answer.kept
        assert cell["correct"] == (cell["answer"] in sample.answers)
    again = run_cli("eval", qwen_dir, "--dataset", root / "data", "--video-frames", FRAMES, "--image-size", SIZE,
                    "-m", "evs", "-k", 16, "--max-new-tokens", 2, "--store", store, "--json", "--quiet")
    assert again.exit_code == 0 and json.loads(again.output)["computed"] == 0  # every cell reused


def test_eval_dataset_of_videos_bad_input_is_one_line(video_sweep, qwen_dir, tmp_path):
    root, store, _ = video_sweep
    lines = (root / "data" / "questions.jsonl").read_text().splitlines()
    bad = tmp_path / "bad"
    bad.mkdir()
    row = json.loads(lines[0])
    row["video"] = "no_such_clip"
    (bad / "questions.jsonl").write_text(json.dumps(row) + "\n")
    args = ("--video-frames", FRAMES, "--image-size", SIZE, "-m", "evs", "-k", 16, "--store", store)
    one_line_error(run_cli("eval", qwen_dir, "--dataset", bad, *args), "line 1: video")
    one_line_error(run_cli("eval", qwen_dir, "--dataset", root / "data", "-m", "evs", "-k", 16, "--store", store),
                   "pass --video-frames F")
    one_line_error(run_cli("eval", qwen_dir, "--dataset", root / "data", *args, "--video", root / "data" / "clip0"),
                   "drop --video")
    row = json.loads(lines[0])
    row["video"] = str(root / "data" / "clip0")
    (bad / "questions.jsonl").write_text(json.dumps({**row, "question": ""}) + "\n")
    one_line_error(run_cli("eval", qwen_dir, "--dataset", bad, *args), "question must be a non-empty string")
