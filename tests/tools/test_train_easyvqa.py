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
    """Issue 32: the same seed gives the same weights whatever the thread count (the fixture trained on 2)."""
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
        "m", "t", train=24, epochs=1, test=12)
    record = train_easyvqa.train_easyvqa(tmp_path / "model", tower, lm=TINY_LM, log=lambda line: None, dataset=data)
    assert record["dataset"] == "inspection" and record["test_questions"] == 12 and record["train_images"] == 12
    types = record["per_type"]
    assert set(types) <= set(inspection_vqa.TYPES) and sum(t["questions"] for t in types.values()) == 12
    for row in types.values():
        assert 0 <= row["dense_accuracy"] <= 1 and row["majority_answer"] in sum(inspection_vqa.ANSWERS.values(), ())
    assert (tmp_path / "cache" / "datasets" / "inspection-test-s0-n6" / "questions.jsonl").is_file()


def test_majority_ties_go_to_the_first_answer_in_sorted_order():
    assert train_easyvqa.majority(["no", "yes", "yes", "no"]) == "no"
    assert train_easyvqa.majority(["b", "a", "b"]) == "b"
