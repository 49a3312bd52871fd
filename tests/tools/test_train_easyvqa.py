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
    assert train_easyvqa.main(["-o", str(tmp_path / "z"), "--tower", str(tmp_path), "--lm-layers", "0"]) == 2
    assert capsys.readouterr().err == "error: --lm-layers must be at least 1, got 0\n" and not (tmp_path / "z").exists()
    assert train_easyvqa.main(["-o", str(tmp_path / "z"), "--tower", str(tmp_path), "--batch", "0"]) == 2
    assert capsys.readouterr().err == "error: --batch must be at least 1, got 0\n" and not (tmp_path / "z").exists()
    assert train_easyvqa.main(["-o", str(tmp_path / "z"), "--tower", str(tmp_path), "--lr", "2"]) == 2
    assert capsys.readouterr().err == "error: --lr must be in (0, 1), got 2.0\n" and not (tmp_path / "z").exists()
    assert train_easyvqa.main(["-o", str(tmp_path / "z"), "--tower", str(tmp_path), "--more", "-1"]) == 2
    assert capsys.readouterr().err == "error: --more must be at least 0, got -1\n" and not (tmp_path / "z").exists()


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
        "inspection", lambda _n: (train_easyvqa._inspection_split("train", 0, 12), train_easyvqa._inspection_split("test", 0, 6)),
        "m", "t", train=24, epochs=1, test=12, pack=True, lm={**TINY_LM, "num_hidden_layers": 2},
        more=3, extra=train_easyvqa._inspection_more)
    record = train_easyvqa.train_easyvqa(tmp_path / "model", tower, log=lambda line: None, dataset=data)
    assert record["dataset"] == "inspection" and record["test_questions"] == 12 and record["train_images"] == 12
    assert record["train_questions"] == 24 + 12 * 3  # the split's two a image, and three more read from each scene
    assert record["packed"] and record["language_model"]["num_hidden_layers"] == 2  # the dataset's override
    assert (record["batch"], record["lr"]) == (data.batch, data.lr)  # the dataset's own, recorded
    types = record["per_type"]
    assert set(types) <= set(inspection_vqa.TYPES) and sum(t["questions"] for t in types.values()) == 12
    for row in types.values():
        assert 0 <= row["dense_accuracy"] <= 1 and row["majority_answer"] in sum(inspection_vqa.ANSWERS.values(), ())
    assert (tmp_path / "cache" / "datasets" / "inspection-test-s0-n6" / "questions.jsonl").is_file()


def test_descriptions_and_further_questions_are_asked_for_and_recorded(tower, tmp_path, monkeypatch):
    """--describe packs one description of each training image beside its questions (its words in the vocabulary,
    the test questions unchanged); --more sets the further questions per image; both are recorded, and a dataset
    without them refuses the flags in one line."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    data = train_easyvqa.Dataset(
        "inspection", lambda _n: (train_easyvqa._inspection_split("train", 0, 6), train_easyvqa._inspection_split("test", 0, 3)),
        "m", "t", train=12, epochs=1, test=6, pack=True, lm=TINY_LM, more=3, extra=train_easyvqa._inspection_more,
        describe=train_easyvqa._inspection_describe)
    plain = train_easyvqa.train_easyvqa(tmp_path / "plain", tower, log=lambda line: None, dataset=data, more=0)
    assert plain["train_questions"] == 12 and plain["further_questions"] == 0 and plain["described"] is False
    got = train_easyvqa.train_easyvqa(tmp_path / "described", tower, log=lambda line: None, dataset=data, more=1,
                                      describe=True)
    assert got["train_questions"] == 12 + 6 * 1 + 6 and got["further_questions"] == 1 and got["described"] is True
    assert got["test_questions"] == plain["test_questions"] == 6
    assert got["weights_sha256"] != plain["weights_sha256"]
    vocab = AutoTokenizer.from_pretrained(tmp_path / "described").get_vocab()
    assert {"describe", "parts", "topleft", ","} <= set(vocab)
    with pytest.raises(ValueError, match="easyvqa has no descriptions"):
        train_easyvqa.train_easyvqa(tmp_path / "e", tower, dataset="easyvqa", describe=True)
    assert train_easyvqa.main(["-o", str(tmp_path / "z"), "--tower", str(tower), "--more", "2"]) == 2
    assert not (tmp_path / "z").exists() and not (tmp_path / "e").exists()


def test_grounded_training_adds_the_per_patch_loss_and_saves_a_plain_llava(tower, tmp_path, monkeypatch):
    """--ground: the patch words reach the vocabulary, the loss is the answers' plus the per-patch one (other
    weights than without it), recorded; the checkpoint has LLaVA's keys only; a dataset without targets refuses.
    Grounding is the inspection dataset's default (as here): ground=None keeps it, ground=False (--no-ground) drops it."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    data = train_easyvqa.Dataset(
        "inspection", lambda _n: (train_easyvqa._inspection_split("train", 0, 6), train_easyvqa._inspection_split("test", 0, 3)),
        "m", "t", train=12, epochs=1, test=6, pack=True, lm=TINY_LM, more=1, extra=train_easyvqa._inspection_more,
        ground=train_easyvqa._inspection_ground, grounded=True)
    assert train_easyvqa.DATASETS["inspection"].grounded and train_easyvqa.DATASETS["inspection"].described
    plain = train_easyvqa.train_easyvqa(tmp_path / "plain", tower, log=lambda line: None, dataset=data, ground=False)
    got = train_easyvqa.train_easyvqa(tmp_path / "grounded", tower, log=lambda line: None, dataset=data)
    assert got["grounded"] is True and plain["grounded"] is False
    assert got["weights_sha256"] != plain["weights_sha256"] and got["train_questions"] == plain["train_questions"]
    vocab = AutoTokenizer.from_pretrained(tmp_path / "grounded").get_vocab()
    rows = data.splits(12)[0]
    words = {w for ws in train_easyvqa._inspection_ground(rows, 8).values() for w in ws if w}  # the tiny tower's 8x8
    assert words and words | {train_easyvqa.BACKGROUND_WORD} <= set(vocab)
    keys = LlavaForConditionalGeneration.from_pretrained(tmp_path / "grounded").state_dict().keys()
    assert keys == LlavaForConditionalGeneration.from_pretrained(tmp_path / "plain").state_dict().keys()
    with pytest.raises(ValueError, match="easyvqa has no per-patch targets"):
        train_easyvqa.train_easyvqa(tmp_path / "e", tower, dataset="easyvqa", ground=True)


def test_the_grounded_loss_is_the_answers_plus_parts_and_background_each_averaged():
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=20))
    ids = torch.randint(0, 20, (2, 9))
    labels = torch.full((2, 9), -100)
    labels[:, 6:] = ids[:, 6:]
    out = model(input_ids=ids, labels=labels)
    at = torch.zeros(2, 9, dtype=torch.bool)
    at[:, 1:5] = True
    targets = torch.tensor([[3, -8, 4, -8], [5, 5, -8, -8]])  # -8: the background's word 7
    rows = out.logits[at].reshape(-1, 20)
    flat = targets.reshape(-1)
    want = (out.loss + F.cross_entropy(rows[flat >= 0], flat[flat >= 0])
            + F.cross_entropy(rows[flat < 0], torch.full(((flat < 0).sum(),), 7)))
    got = train_easyvqa._grounded_loss(out.logits, labels, targets, at)
    assert torch.allclose(got, want, atol=1e-6)
    no_patches = train_easyvqa._grounded_loss(out.logits, labels, torch.tensor([[3, 3, 3, 3], [3, 3, 3, 3]]), at)
    assert not torch.allclose(no_patches, got)


def test_inspection_training_split_grows_with_the_questions_asked_for(tmp_path, monkeypatch):
    """--train above the default split's two questions a image makes a larger split (N/2 images), not a silent
    cap at the default's; at or below it the default split (and its cached features) is used."""
    import inspection_vqa

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(inspection_vqa.DEFAULT_COUNT, "train", 4)
    monkeypatch.setitem(inspection_vqa.DEFAULT_COUNT, "test", 2)
    assert train_easyvqa._inspection_images(8) == 4 and train_easyvqa._inspection_images(3) == 4
    train, test = train_easyvqa.DATASETS["inspection"].splits(11)
    assert len({r["image"] for r in train}) == 6 and len(train) == 12 and len({r["image"] for r in test}) == 2
    small, _ = train_easyvqa.DATASETS["inspection"].splits(8)
    assert [r["id"] for r in small] == [r["id"] for r in train[:8]]  # the larger split starts with the default's


def test_majority_ties_go_to_the_first_answer_in_sorted_order():
    assert train_easyvqa.majority(["no", "yes", "yes", "no"]) == "no"
    assert train_easyvqa.majority(["b", "a", "b"]) == "b"


def test_a_packed_question_sees_the_image_and_itself_only(tower):
    """pack=True: one sequence per image, its questions as segments after the image. Each segment's logits equal
    those of the question run alone (what eval asks): the block mask hides the other questions and the positions
    restart after the image. Without the mask the second question's logits change, so the check can fail."""
    import torch
    from transformers import Dinov2Config

    rows = [{"image": "a.png", "question": "how many parts are there?", "answers": ["2"]},
            {"image": "a.png", "question": "is there a red cross?", "answers": ["yes"]},
            {"image": "b.png", "question": "what does the label say?", "answers": ["ok"]}]
    tok = train_easyvqa.build_tokenizer([r["question"] for r in rows] + [r["answers"][0] for r in rows])
    processor = train_easyvqa.build_processor(tok, Dinov2Config.from_pretrained(tower))
    plain = train_easyvqa.encode(processor, rows, 64)
    packed = train_easyvqa.encode(processor, rows, 64, pack=True)
    assert len(plain) == 3 and len(packed) == 2
    assert packed[1].ids == plain[2].ids and packed[1].spans == plain[2].spans  # one question: the same sequence
    seq = packed[0]
    assert [tok.convert_ids_to_tokens(seq.ids[a:b]) for a, b in seq.spans] == [["2", "</s>"], ["yes", "</s>"]]
    assert seq.ids[:len(plain[0].ids)] == plain[0].ids and "<image>" not in tok.convert_ids_to_tokens(
        seq.ids[seq.segments[1][0]:])

    torch.manual_seed(0)
    model = train_easyvqa.build_model(tower, tok, TINY_LM).eval()
    feats = torch.randn(64, 32)
    image_id = tok.convert_tokens_to_ids(train_easyvqa.IMAGE)

    def logits(ids: list[int], **kw) -> torch.Tensor:
        t = torch.tensor([ids])
        embeds = model.get_input_embeddings()(t).masked_scatter((t == image_id)[..., None],
                                                                model.model.multi_modal_projector(feats))
        with torch.no_grad():
            return model(inputs_embeds=embeds, **kw).logits[0]

    width = len(seq.ids) + 3  # with padding, as a batch has it
    padded = seq.ids + [tok.pad_token_id] * 3
    masked = logits(padded, attention_mask=train_easyvqa.block_mask(seq, width)[None, None],
                    position_ids=train_easyvqa.positions(seq, width)[None])
    unmasked = logits(seq.ids)
    prefix = seq.segments[0][0]
    for (start, end), alone in zip(seq.segments, (plain[0], plain[1])):
        want = logits(alone.ids)[prefix:]
        torch.testing.assert_close(masked[start:end], want, atol=1e-5, rtol=1e-5)
    second = seq.segments[1]
    assert not torch.allclose(unmasked[second[0]:second[1]], logits(plain[1].ids)[prefix:], atol=1e-3)


def test_further_questions_come_from_the_scene_and_leave_the_split_unchanged():
    """more_questions: answers read from the scene (the same ones question() gives), never the split's own two,
    presence yes and no alternating; deterministic; the image and its two questions are write_split's."""
    import inspection_vqa

    pixels, asked = inspection_vqa.scene(0, "train", 3)
    more = inspection_vqa.more_questions(0, "train", 3, 6)
    assert more == inspection_vqa.more_questions(0, "train", 3, 6)
    assert len(more) == 6 and not {q["question"] for q in more} & {q["question"] for q in asked}
    assert len({q["question"] for q in more}) == 6 and {q["type"] for q in more} <= set(inspection_vqa.TYPES)
    for q in more:
        assert q["answers"][0] in inspection_vqa.ANSWERS[q["type"]]
    again, _ = inspection_vqa.scene(0, "train", 3)
    assert (again == pixels).all()
    presence = [q["answers"][0] for i in range(40) for q in inspection_vqa.more_questions(0, "train", i, 6)
                if q["type"] == "presence"]
    assert abs(presence.count("yes") - presence.count("no")) <= len(presence) // 4


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


def test_lr_and_batch_override_the_datasets_and_are_recorded(trained, tower, tmp_path):
    """--lr and --batch reach the optimiser (other weights than the dataset's defaults give) and training.json."""
    _, record = trained
    assert (record["lr"], record["batch"]) == (2e-3, 32)  # easy-vqa's own
    other = _train(tmp_path / "other", tower, lr=5e-3, batch=8)
    assert (other["lr"], other["batch"]) == (5e-3, 8)
    assert other["weights_sha256"] != record["weights_sha256"]


def test_question_first_puts_the_question_before_the_image_in_training_and_in_vlmprune_s_prompt(tower, tmp_path):
    """--question-first: the saved chat template writes the question before the image; training encodes it so (one
    sequence per question, unpacked) and vlmprune's own prompt, which follows the checkpoint's template, does too."""
    from transformers import AutoProcessor

    from vlmprune.compiler import generate as gen

    out = tmp_path / "qf"
    record = _train(out, tower, question_first=True)
    assert record["question_first"] and not record["packed"]
    processor = AutoProcessor.from_pretrained(out)
    text = train_easyvqa.prompt_text(processor, "what shape is it?")
    assert text.index("what shape is it?") < text.index("<image>")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    question_id = processor.tokenizer.convert_tokens_to_ids("shape")
    [seq] = train_easyvqa.encode(processor, [{"question": "what shape is it?", "answers": ["circle"],
                                              "image": "x.png"}], 4)
    assert seq.ids.index(question_id) < seq.ids.index(image_id) and seq.ids.count(image_id) == 4
    prompt = gen.build_prompt(gen.load_vlm(str(out)), "what shape is it?")
    assert "the checkpoint's chat template" in prompt.how and question_id in prompt.before
    assert question_id not in prompt.after
    with pytest.raises(ValueError, match="do not share the prompt up to the image"):
        train_easyvqa.encode(processor, [{"question": q, "answers": ["a"], "image": "x.png"}
                                         for q in ("what shape is it?", "what color is it?")], 4, pack=True)


def test_folded_standardization_is_the_same_projector_on_raw_features():
    """A Linear trained on standardised channels, folded, maps raw features as the unfolded one maps standardised
    ones; feature_moments are the channels' own mean and (population) standard deviation."""
    import torch

    gen = torch.Generator().manual_seed(0)
    features = {f"img{k}": torch.randn(16, 6, generator=gen) * torch.tensor([1, 2, 5, 0.5, 30, 1]) + 7
                for k in range(3)}
    mean, std = train_easyvqa.feature_moments(features)
    everything = torch.cat([features[k] for k in sorted(features)])
    assert torch.allclose(mean, everything.mean(0), atol=1e-5)
    assert torch.allclose(std, everything.std(0, unbiased=False), rtol=1e-5)
    linear = torch.nn.Linear(6, 4)
    x = everything
    want = linear((x - mean) / std)
    train_easyvqa.fold_standardization(linear, mean, std)
    assert torch.allclose(linear(x), want, atol=1e-5)
    assert not torch.allclose(linear((x - mean) / std), want, atol=1e-3)  # the fold did change the weights


def test_standardized_training_saves_a_plain_llava_and_records_it(trained, tower, tmp_path):
    """--standardize-features trains other weights than the default, records it, and the saved checkpoint (no
    extra module: LLaVA's own projector keys) generates words of its vocabulary."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    out, record = trained
    assert record["standardized_features"] is False
    std = _train(tmp_path / "std", tower, standardize=True)
    assert std["standardized_features"] is True and std["weights_sha256"] != record["weights_sha256"]
    model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "std").eval()
    base = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert model.state_dict().keys() == base.state_dict().keys()
    sample = easyvqa_jsonl.records("test")[0]
    processor = AutoProcessor.from_pretrained(tmp_path / "std")
    words = train_easyvqa.answers(model, processor, [sample])[0].split()
    assert words and all(w in processor.tokenizer.get_vocab() for w in words)
