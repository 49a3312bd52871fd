"""`vlmprune eval` on a tiny random LLaVA: the figures recomputed by hand, the CLI's table and JSON, bad input.

The figures of a random model carry no meaning; what is tested is that they are the
quantities the report says they are (KL(dense || pruned) of the first answer token, greedy
agreement), computed on the positions `generate` uses.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_generate import PROMPT, tiny_vlm

from cli_helpers import eval_inputs, one_line_error as _one_line_error, run_cli as _run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from skimage import data

    root = tmp_path_factory.mktemp("eval")
    images, prompts = eval_inputs(root, {"astronaut.png": data.astronaut(), "coffee.jpg": data.coffee()},
                                  [PROMPT, "", "describe the picture"])
    (images / "notes.txt").write_text("not an image")
    return {"model": tiny_vlm(root / "model", seed=3), "images": images, "prompts": prompts, "root": root}


@pytest.fixture(scope="module")
def report(inputs):
    from vlmprune.compiler.evaluate import evaluate

    return evaluate(str(inputs["model"]), inputs["images"], inputs["prompts"], ["divprune"], [8, 63],
                    max_new_tokens=3)


def test_report_figures_are_what_they_say(report, inputs):
    from vlmprune.compiler.frontend.images import load_image_file
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import kl_divergence
    from vlmprune.compiler.parity.reference import MethodPruner
    from vlmprune.passes.methods import get_method

    assert report["images"] == ["astronaut.png", "coffee.jpg"] and len(report["prompts"]) == 2
    assert report["harness_kl_max"] < 1e-9  # the splice reproduces transformers' own forward
    rows = {(r["method"], r["keep"]): r for r in report["results"]}
    assert set(rows) == {("divprune", 8), ("divprune", 63)} and rows["divprune", 8]["image_tokens"] == 8
    for r in rows.values():
        assert len(r["samples"]) == 4 and 0 <= r["kl_mean"] <= r["kl_max"]
        assert all(0 <= r[k] <= 1 for k in ("first_token_agreement", "exact_match", "prefix_agreement"))
    # Keeping 8 of 64 tokens moves the answer more than keeping 63.
    assert rows["divprune", 8]["kl_mean"] > rows["divprune", 63]["kl_mean"] > 0

    # One sample by hand: divprune's reference, its rows at their original positions, a plain forward.
    vlm = gen.load_vlm(str(inputs["model"]))
    source = vlm.source
    pixel, _, _ = load_image_file(str(inputs["images"] / "coffee.jpg"), source.image_size, source.mean, source.std)
    method = get_method("divprune")
    pipeline = source.pipeline.with_pruner(MethodPruner(method, method.parse(8, {}), "features", None))
    prompt = gen.build_prompt(vlm, PROMPT)
    embed = vlm.model.get_input_embeddings()
    with torch.inference_mode():
        features, kept = pipeline(torch.from_numpy(pixel))
        dense = gen.dense_features(vlm, pixel)
        before, after = embed(torch.tensor([prompt.before])), embed(torch.tensor([prompt.after]))
        o, n = len(prompt.before), len(prompt.after)
        pruned_pos = list(range(o)) + [o + int(k) for k in kept[0]] + [o + 64 + i for i in range(n)]
        dense_pos = list(range(o + 64 + n))
        logits = [vlm.model(inputs_embeds=torch.cat([before, rows[None], after], 1),
                            position_ids=torch.tensor([pos])).logits[0, -1]
                  for rows, pos in ((dense, dense_pos), (features[0], pruned_pos))]
    p, q = (torch.log_softmax(x.double(), -1) for x in logits)
    by_hand = float((p.exp() * (p - q)).sum())
    sample = next(s for s in rows["divprune", 8]["samples"] if s["image"] == "coffee.jpg" and s["prompt"] == PROMPT)
    assert sample["kl"] == pytest.approx(by_hand, rel=1e-5)
    assert sample["first_token_agrees"] == (int(logits[0].argmax()) == int(logits[1].argmax()))
    assert sample["dense_tokens"][0] == int(logits[0].argmax())
    assert kl_divergence(logits[0], logits[0]) == 0.0


def test_a_bundle_evaluates_as_its_reference(inputs, tmp_path):
    """A compiled bundle's row: its own graph under ONNX Runtime, the same figures as the method's reference."""
    from vlmprune.compiler.evaluate import evaluate, table
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    bundle = compile_model(str(inputs["model"]), tmp_path / "cls8", CompileOptions(keep=8)).bundle
    report = evaluate(str(inputs["model"]), inputs["images"], inputs["prompts"], ["cls"], [8], max_new_tokens=2,
                      bundles=[bundle])
    reference, compiled = report["results"]
    assert reference["from"] == "reference" and compiled["from"] == "bundle cls8 (ort)"
    assert compiled["image_tokens"] == reference["image_tokens"] == 9
    for a, b in zip(reference["samples"], compiled["samples"]):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6) and a["pruned_tokens"] == b["pruned_tokens"]
    assert table(report)[2].endswith("bundle cls8 (ort)")
    other = tiny_vlm(tmp_path / "other", seed=4)
    _one_line_error(_run("eval", other, "--images", inputs["images"], "--prompts", inputs["prompts"],
                         "--bundle", bundle), "not compiled from")


def test_eval_cli_table_json_and_report(inputs, tmp_path):
    args = ["eval", inputs["model"], "--images", inputs["images"], "--prompts", inputs["prompts"],
            "-m", "cls,dart", "--keep", "8", "--max-new-tokens", 2]
    result = _run(*args, "--json", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(r["method"], r["keep"], r["image_tokens"]) for r in data["results"]] == [("cls", 8, 9), ("dart", 8, 8)]
    assert json.loads((tmp_path / "r.json").read_text()) == data
    result = _run(*args, "-q")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["method", "K", "tokens", "KL"] and lines[1].split()[:3] == ["cls", "8", "9"]
    assert "2 images x 2 prompts" in lines[-2]
    # FastV's --image-start for these prompts: <s> USER: come before the image in the default template
    assert data["image_start"] == [2, 2]
    assert lines[-1] == "(the image starts at prompt token 2: FastV's --image-start for these prompts)"


def test_eval_bad_input(inputs, tmp_path):
    model, images, prompts = inputs["model"], inputs["images"], inputs["prompts"]
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(_run("eval", model, "--images", empty, "--prompts", prompts), "no images there")
    _one_line_error(_run("eval", model, "--images", images, "--prompts", tmp_path / "none.txt"), "no such file")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    _one_line_error(_run("eval", model, "--images", images, "--prompts", blank), "no prompts in it")
    _one_line_error(_run("eval", model, "--images", images, "--prompts", prompts, "-m", "nope"),
                    "unknown method 'nope'; choose one of: ")
    _one_line_error(_run("eval", model, "--images", images, "--prompts", prompts, "--keep", "64"),
                    "keep must satisfy 1 <= keep < 64")
    _one_line_error(_run("eval", model, "--images", images, "--prompts", prompts, "--keep", "x"), "not an integer")
    siglip = tiny_vlm(tmp_path / "siglip", tokenizer=False, tower="siglip")
    _one_line_error(_run("eval", siglip, "--images", images, "--prompts", prompts, "-m", "cls", "--keep", 8),
                    "needs a [CLS] token")


def test_eval_report_is_checked_first_and_written_as_its_suffix_says(inputs, tmp_path):
    images, prompts = inputs["images"], inputs["prompts"]
    existing = tmp_path / "e.json"
    existing.write_text("mine")
    # MODEL does not exist: a refusal that came after the evaluation would be about MODEL instead.
    for report, line in ((existing, f"error: --report {existing} already exists (use --force to replace it)"),
                         (tmp_path / "e.txt",
                          f"error: --report {tmp_path / 'e.txt'}: the file name must end in .json or .html or .htm")):
        result = _run("eval", tmp_path / "no-model", "--images", images, "--prompts", prompts, "--report", report)
        assert result.exit_code == 2 and result.stderr.splitlines() == [line], result.output
    assert existing.read_text() == "mine"
    _one_line_error(_run("eval", tmp_path / "no-model", "--images", images, "--prompts", prompts,
                         "--report", tmp_path / "made" / "e.json"), "no-model")
    assert not (tmp_path / "made").exists()  # a failed eval makes no folder for its report

    args = ["eval", inputs["model"], "--images", images, "--prompts", prompts, "-m", "cls", "-k", 8,
            "--max-new-tokens", 1, "-q"]
    page = tmp_path / "new" / "e.html"  # a missing parent is made
    result = _run(*args, "--report", page)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"report written to {page}"]
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<title>vlmprune eval: " in text
    assert "<tr><td>cls</td><td>8</td><td>9</td>" in text  # the table's row: method, K, image tokens
    assert "<script" not in text and "http" not in text  # self-contained
    result = _run(*args, "--json", "--report", existing, "--force")
    assert result.exit_code == 0, result.output
    assert json.loads(existing.read_text()) == json.loads(result.stdout)
