"""tools/train_easyvqa.py and tools/easyvqa_jsonl.py on a reduced run: a tiny random DINOv2 tower, 64 questions.

The same code path as the full training (features once per image, answer-only loss, the saved
model's own generate, atomic publish), in seconds.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import easyvqa_jsonl  # noqa: E402
import train_easyvqa  # noqa: E402

TINY_LM = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tower")
    Dinov2Model(Dinov2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             image_size=112, patch_size=14)).save_pretrained(path)  # [CLS] + 64 patches
    return path


def _train(out: Path, tower: Path, **kw) -> dict:
    return train_easyvqa.train_easyvqa(out, tower, train_n=64, epochs=1, test_n=16, lm=TINY_LM,
                                       log=lambda line: None, **kw)


@pytest.fixture(scope="module")
def trained(tower, tmp_path_factory):
    out = tmp_path_factory.mktemp("easyvqa") / "model"
    return out, _train(out, tower)


def test_the_checkpoint_loads_and_generates_a_vocabulary_word(trained):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    out, record = trained
    assert set(record) >= {"dense_accuracy", "majority_accuracy", "majority_answer"}
    assert json.loads((out / "training.json").read_text()) == record
    model = LlavaForConditionalGeneration.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    sample = easyvqa_jsonl.records("test")[0]
    answer = train_easyvqa.answers(model, processor, [sample])[0]
    words = answer.split()
    assert words and all(w in processor.tokenizer.get_vocab() for w in words)


def test_same_seed_same_weights_and_a_finished_one_is_reused(trained, tower, tmp_path):
    out, record = trained
    again = _train(tmp_path / "again", tower)
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (out, tmp_path / "again")]
    assert digest[0] == digest[1] and again["dense_accuracy"] == record["dense_accuracy"]
    assert _train(out, tower) == record  # reused, not retrained (no --force)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_it_compiles_as_llava_dinov2_with_parity(trained, tmp_path):
    from vlmprune.compiler import api

    result = api.compile(str(trained[0]), tmp_path / "bundle", target="ort", keep=16)
    assert result.report.passed
    assert result.manifest.model.family == "llava_dinov2"


def test_jsonl_has_every_question_with_its_image(tmp_path, capsys):
    out = tmp_path / "test.jsonl"
    assert easyvqa_jsonl.main(["--split", "test", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    import easy_vqa

    assert len(rows) == len(easy_vqa.get_test_questions()[0])
    assert rows[123]["id"] == "test-000123" and all(Path(r["image"]).is_absolute() for r in rows)
    assert all(Path(p).is_file() for p in {r["image"] for r in rows})
    assert set(rows[0]) == {"id", "image", "question", "answers"} and len(rows[0]["answers"]) == 1
    capsys.readouterr()
    assert easyvqa_jsonl.main(["--split", "test", "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {out} exists; pass --force to overwrite it\n"


def test_refusals(tmp_path, capsys):
    code = train_easyvqa.main(["-o", str(tmp_path / "m"), "--tower", str(tmp_path / "none")])
    assert code == 2 and not (tmp_path / "m").exists()
    assert capsys.readouterr().err == (f"error: {tmp_path / 'none'}: not a Dinov2Model directory (no config.json); "
                                       "make one with tools/dinov2_from_onnx.py\n")
    (tmp_path / "mine").mkdir()
    assert train_easyvqa.main(["-o", str(tmp_path / "mine"), "--tower", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'mine'} exists but is not a finished easyvqa model; "
                                       "pass --force to replace it\n")


def test_weights_do_not_depend_on_the_thread_count(trained, tower, tmp_path):
    """The same seed gives the same weights whatever the thread count (the fixture trained on 2)."""
    out, record = trained
    one = _train(tmp_path / "one", tower, threads=1)
    assert one["weights_sha256"] == record["weights_sha256"]
    assert record["weights_sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert one["environment"]["threads"] == 1 and record["environment"]["threads"] == 2
    assert record["environment"]["cpu_capability"] and record["environment"]["torch"]


def test_inspection_scenes_train_with_per_type_accuracy(tower, tmp_path, monkeypatch):
    """The inspection dataset's path: the generator's splits, per-type dense accuracy beside each type's majority."""
    import inspection_vqa

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    data = train_easyvqa.Dataset(
        "inspection", lambda: (train_easyvqa._inspection_split("train", 0, 12), train_easyvqa._inspection_split("test", 0, 6)),
        "m", "t", train=24, epochs=1, test=12, pack=True, lm={**TINY_LM, "num_hidden_layers": 2})
    record = train_easyvqa.train_easyvqa(tmp_path / "model", tower, log=lambda line: None, dataset=data)
    assert record["dataset"] == "inspection" and record["test_questions"] == 12 and record["train_images"] == 12
    assert record["packed"] and record["language_model"]["num_hidden_layers"] == 2  # the dataset's override
    types = record["per_type"]
    assert set(types) <= set(inspection_vqa.TYPES) and sum(t["questions"] for t in types.values()) == 12
    for row in types.values():
        assert 0 <= row["dense_accuracy"] <= 1 and row["majority_answer"] in sum(inspection_vqa.ANSWERS.values(), ())
    assert (tmp_path / "cache" / "datasets" / "inspection-test-s0-n6" / "questions.jsonl").is_file()


def test_majority_ties_go_to_the_first_answer_in_sorted_order():
    assert train_easyvqa.majority(["no", "yes", "yes", "no"]) == "no"
    assert train_easyvqa.majority(["b", "a", "b"]) == "b"


def test_packing_puts_an_images_questions_in_one_chat_and_labels_only_the_answers(tower):
    """pack=True: one sequence per image; its first turn is exactly the unpacked sample (what eval asks), and the
    labelled spans are each answer and its eos, nothing of the prompts."""
    from transformers import Dinov2Config

    rows = [{"image": "a.png", "question": "how many parts are there?", "answers": ["2"]},
            {"image": "a.png", "question": "is there a red cross?", "answers": ["yes"]},
            {"image": "b.png", "question": "what does the label say?", "answers": ["ok"]}]
    tok = train_easyvqa.build_tokenizer([r["question"] for r in rows] + [r["answers"][0] for r in rows])
    processor = train_easyvqa.build_processor(tok, Dinov2Config.from_pretrained(tower))
    plain = train_easyvqa.encode(processor, rows, 64)
    packed = train_easyvqa.encode(processor, rows, 64, pack=True)
    assert len(plain) == 3 and len(packed) == 2
    (seq, spans), (first, (span,)) = packed[0], plain[0]
    assert seq[:len(first)] == first and spans[0] == span  # the first turn is the unpacked sample
    assert packed[1] == plain[2]  # an image with one question is not changed
    words = [tok.convert_ids_to_tokens(seq[a:b]) for a, b in spans]
    assert words == [["2", "</s>"], ["yes", "</s>"]]
    follow = tok.convert_ids_to_tokens(seq[spans[0][1]:spans[1][0]])
    assert follow[:2] == ["user", ":"] and follow[-2:] == ["assistant", ":"] and "<image>" not in follow


def test_features_are_cached_per_chunk_and_reused(tower, tmp_path, monkeypatch):
    """A longer image list computes only the chunks it has not seen; a cached chunk equals a fresh computation."""
    import inspection_vqa

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    folder = inspection_vqa.cached_split("test", 0, 6)
    paths = sorted(str(p) for p in (folder / "images").glob("*.png"))
    tok = train_easyvqa.build_tokenizer(["a"])
    model = train_easyvqa.build_model(tower, tok, TINY_LM)
    processor = train_easyvqa.build_processor(tok, model.config.vision_config)
    said: list[str] = []
    first = train_easyvqa.cached_features(model, processor, tower, paths[:4], log=said.append, chunk=2)
    again = train_easyvqa.cached_features(model, processor, tower, paths, log=said.append, chunk=2)
    assert [("cached" in line) for line in said] == [False, False, True, True, False]
    assert len(list((tmp_path / "cache" / "features").glob("*.pt"))) == 3
    assert all((first[p] == again[p]).all() for p in paths[:4])
