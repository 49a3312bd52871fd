"""`vlmprune eval --dataset` on a tiny random LLaVA with a real tokenizer: bundles compiled once, answered, stored.

Tiny random models answer gibberish, so what is checked is the machinery: each cell's answer
is the one `vlmprune generate` gives for the same bundle, image and question; the scores and
intervals follow from the answers; an interrupted sweep resumes with only the missing
cells; a changed model keys new cells; bad input is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import one_line_error, run_cli
from test_generate import tiny_vlm
from vlmprune.compiler import api
from vlmprune.compiler.cli import render
from vlmprune.compiler.accuracy import evaluate_dataset, parse_method_spec, plans_for
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.quality import stats

QUESTIONS = ("what is in the image ?", "describe the picture ?")


def write_dataset(root: Path, images: int = 3, answers=("cat",)) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = []
    for i in range(images):
        Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(root / f"img{i}.png")
        lines += [json.dumps({"image": f"img{i}.png", "question": q, "answers": list(answers)}) for q in QUESTIONS]
    path = root / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("accuracy")
    model = tiny_vlm(root / "model")
    data = write_dataset(root)
    store = root / "store.sqlite"
    report = evaluate_dataset(str(model), data, ["cls", "divprune"], [8, 16], ["1", "end"], store=store,
                              max_new_tokens=3)
    return model, data, store, report


def test_plans_dense_methods_and_baselines():
    """Dense first; block methods at each layer; divprune only at the end (once); the baselines beside them."""
    plans = [(p.label, p.keep, p.layer, p.method_options) for p in plans_for(["cls", "divprune"], [8], [2, "end"])]
    assert plans == [("dense", None, None, {}), ("cls", 8, 2, {}), ("cls", 8, "end", {}), ("divprune", 8, "end", {}),
                     ("random", 8, 2, {"site": "block"}), ("random", 8, "end", {"site": "features"}),
                     ("grid", 8, 2, {"site": "block"}), ("grid", 8, "end", {"site": "features"})]


def test_a_method_that_merges_in_the_blocks_is_one_row_at_its_block_range():
    """tome spans the blocks: its place is its --blocks range, run once whatever --layer lists, and it has no
    random keep at that place to be paired with."""
    plans = plans_for(["tome", "tome:blocks=1-4"], [8], [2, "end"])
    rows = [(p.label, p.layer, p.where) for p in plans if p.method == "tome"]
    assert rows == [("tome", "blocks", "in every block"), ("tome blocks=1-4", "blocks", "in blocks 1-4")]
    assert {(p.layer, p.where) for p in plans if p.method == "random"} == {(2, "after block 2"), ("end", "tower end")}


def test_rows_are_paired_with_the_baseline_the_methods_declare(monkeypatch):
    """The row every other one is compared with is the method that declares itself paired (Method.paired), asked of
    the registry: random keep's, one method at most; with no such method nothing is paired."""
    from vlmprune.compiler.accuracy import paired_baseline, random_partners
    from vlmprune.passes.methods import METHODS

    assert [name for name, method in METHODS.items() if method.paired] == ["random"] == [paired_baseline()]
    plans = plans_for(["cls", "random:seed=3"], [8], [2])
    labels = [p.label for p in plans]
    assert {labels[i]: labels[j] for i, j in random_partners(plans).items()} == {
        "cls": "random", "random seed=3": "random", "grid": "random"}
    monkeypatch.setattr(METHODS["random"], "paired", False)
    assert paired_baseline() is None and random_partners(plans) == {}


def test_a_row_spread_over_blocks_is_paired_with_random_keep_after_the_earliest_block():
    """ToMe's block range and a progressive schedule have no random keep at their place: each is compared with random
    keep at its K after the lowest block the sweep prunes it at; a row at one place keeps its own partner, and with
    random keep only at the tower's end a spread row has none."""
    from vlmprune.compiler.accuracy import random_partners

    plans = plans_for(["tome:blocks=1-4", "cls:schedule=2/4/6", "cls"], [8], [4, 2])
    partners = random_partners(plans)
    paired = {(p.label, p.where): plans[partners[i]].where for i, p in enumerate(plans) if i in partners}
    assert paired[("tome blocks=1-4", "in blocks 1-4")] == "after block 2"
    assert paired[("cls", "progressive 2→4→6")] == "after block 2"
    assert paired[("cls", "after block 4")] == "after block 4" and paired[("cls", "after block 2")] == "after block 2"
    plans = plans_for(["tome:blocks=1-4", "cls:schedule=2/4/6", "cls"], [8], ["end"])
    partners = random_partners(plans)
    assert [p.label for i, p in enumerate(plans) if i in partners] == ["cls", "grid"]


def test_a_method_with_options_is_its_own_row_beside_the_plain_one():
    """NAME:OPTION=VALUE: the same method with and without an option, two plans with their own labels."""
    plans = [(p.label, p.method, p.method_options)
             for p in plans_for(["cls", "cls:budget=adaptive:kmin=4", "random:seed=3"], [8], [2])]
    assert plans == [("dense", None, {}), ("cls", "cls", {}),
                     ("cls budget=adaptive kmin=4", "cls", {"budget": "adaptive", "kmin": 4}),
                     ("random seed=3", "random", {"seed": 3, "site": "block"}), ("random", "random", {"site": "block"}),
                     ("grid", "grid", {"site": "block"})]
    assert parse_method_spec("cls:prompt-weight=0.5") == ("cls", {"prompt_weight": 0.5})
    for bad, needle in [("cls:budget", "options are OPTION=VALUE"), ("cls:=3", "options are OPTION=VALUE"),
                        ("cls:nope=1", "--nope is not an option of method cls")]:
        with pytest.raises(InputError, match=needle):
            plans_for([bad], [8], [2])


def test_every_cell_is_the_bundles_generate_answer(setup, tmp_path):
    model, data, store, report = setup
    rows = report["rows"]
    assert [r["method"] for r in rows][:3] == ["dense", "cls", "cls"] and len(rows) == 1 + 4 + 2 + 4 + 4
    samples = [json.loads(line) for line in data.read_text().splitlines()]
    for row in (rows[0], rows[1], next(r for r in rows if r["method"] == "divprune")):
        for digest, sample in zip(report["sample_digests"][:2], samples[:2]):
            want = api.generate(row["bundle"], image=data.parent / sample["image"], prompt=sample["question"],
                                max_new_tokens=3)
            cell = row["answers"][digest]
            assert cell["answer"] == want.answer.text
            assert cell["correct"] == stats.exact_match(want.answer.text, sample["answers"])
            if row["method"] != "dense":
                assert cell["extra"]["kept"] == want.kept
    for row in rows:
        correct = [row["answers"][d]["correct"] for d in report["sample_digests"]]
        assert row["accuracy"] == pytest.approx(np.mean(correct))
        assert row["accuracy_ci"][0] <= row["accuracy"] <= row["accuracy_ci"][1]
    assert report["computed"] == len(rows) * 6 and report["reused"] == 0


def test_agreement_is_each_rows_answers_against_dense_and_paired_with_random(setup):
    """Agreement with dense is recomputed here from the stored answers; only rows with a random partner at their K
    and place get a paired difference, and random's own row has none."""
    _model, _data, _store, report = setup
    rows, digests = report["rows"], report["sample_digests"]
    dense = [rows[0]["answers"][d]["answer"] for d in digests]
    assert rows[0]["agreement"]["value"] == 1.0 and rows[0]["agreement"]["vs_random"] is None
    for row in rows[1:]:
        agree = [stats.normalize(row["answers"][d]["answer"]) == stats.normalize(a) for d, a in zip(digests, dense)]
        assert row["agreement"]["value"] == pytest.approx(np.mean(agree))
        lo, hi = row["agreement"]["ci"]
        assert lo <= row["agreement"]["value"] <= hi
        partner = next((r for r in rows if r["method"] == "random" and (r["keep"], r["layer"]) ==
                        (row["keep"], row["layer"])), None)
        if row["method"] == "random" or partner is None:
            assert row["agreement"]["vs_random"] is None
        else:
            mine = np.mean(agree)
            theirs = np.mean([stats.normalize(partner["answers"][d]["answer"]) == stats.normalize(a)
                              for d, a in zip(digests, dense)])
            assert row["agreement"]["vs_random"]["difference"] == pytest.approx(mine - theirs)
    assert any(r["agreement"]["value"] < 1 for r in rows)  # pruning changed some answer: the figure can move


def test_a_rerun_reuses_every_cell_and_bundle(setup):
    model, data, store, report = setup
    again = evaluate_dataset(str(model), data, ["cls", "divprune"], [8, 16], ["1", "end"], store=store,
                             max_new_tokens=3)
    assert again["computed"] == 0 and again["reused"] == report["computed"]
    assert [r["answers"] for r in again["rows"]] == [r["answers"] for r in report["rows"]]
    assert [r["bundle"] for r in again["rows"]] == [r["bundle"] for r in report["rows"]]


def test_an_interrupted_sweep_resumes_with_only_the_missing_cells(setup, tmp_path):
    model, data, _, report = setup
    store, seen = tmp_path / "s.sqlite", []

    def interrupt(key, results):
        seen.append(len(results))
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=store, max_new_tokens=3, on_chunk=interrupt)
    resumed = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=store, max_new_tokens=3)
    assert resumed["reused"] == sum(seen) and resumed["computed"] == 4 * 6 - sum(seen)
    full = {(r["method"], r["keep"], r["where"]): r["answers"] for r in report["rows"]}
    for r in resumed["rows"]:
        assert r["answers"] == full[(r["method"], r["keep"], r["where"])]


def test_another_model_or_decoding_length_keys_new_cells(setup, tmp_path):
    model, data, store, _ = setup
    other = tiny_vlm(tmp_path / "other", seed=2)
    fresh = evaluate_dataset(str(other), data, ["cls"], [8], ["end"], store=store, max_new_tokens=3)
    assert fresh["reused"] == 0 and fresh["computed"] == 4 * 6
    longer = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=store, max_new_tokens=2)
    assert longer["reused"] == 0


def test_cli_table_json_and_html_report(setup, tmp_path):
    model, data, store, _ = setup
    result = run_cli("eval", model, "--dataset", data, "--keep", "8,16", "--layer", "1,end", "--method", "cls",
                     "--method", "divprune", "--store", store, "--max-new-tokens", "3", "--report",
                     tmp_path / "q.html")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["method", "K", "where"] and lines[1].startswith("dense")
    assert any(line.startswith("divprune") and "tower end" in line for line in lines)
    assert "0 cells computed, 90 reused" in result.stdout
    page = (tmp_path / "q.html").read_text()
    assert page.count("<img ") == 2 and "accuracy vs K, pruned after block 1" in page
    as_json = run_cli("eval", model, "--dataset", data, "--keep", "8", "--store", store, "--max-new-tokens", "3",
                      "--json", "--limit", "2")
    assert as_json.exit_code == 0, as_json.output
    data_out = json.loads(as_json.stdout)
    assert data_out["samples"] == 2 and [r["method"] for r in data_out["rows"]] == ["dense", "cls", "random", "grid"]


def test_a_prompt_aware_bundle_gets_each_question_as_its_prompt(setup):
    """cdpruner's bundle takes text_embeds: each cell is generate's answer for that question (which feeds the
    question's rows), the tower runs per question (the kept sets of one image differ between its questions), and
    the setting's key records how the prompt is fed."""
    from vlmprune.compiler.prompt import FEED
    from vlmprune.compiler.quality.store import Store

    model, data, store, first = setup
    report = evaluate_dataset(str(model), data, ["cdpruner"], [8], ["end"], store=store, max_new_tokens=3)
    assert [r["method"] for r in report["rows"]] == ["dense", "cdpruner", "random", "grid"]
    assert report["computed"] == 6 and report["reused"] == 3 * 6  # dense and the baselines: the setup's cells
    row = report["rows"][1]
    assert row["parity_passed"]
    samples = [json.loads(line) for line in data.read_text().splitlines()]
    kept = []
    for digest, sample in zip(report["sample_digests"], samples):
        want = api.generate(row["bundle"], image=data.parent / sample["image"], prompt=sample["question"],
                            max_new_tokens=3)
        cell = row["answers"][digest]
        assert cell["answer"] == want.answer.text and cell["extra"]["kept"] == want.kept
        kept.append(tuple(cell["extra"]["kept"]))
    assert any(kept[i] != kept[i + 1] for i in range(0, len(kept), 2))  # two questions of one image
    described = Store(store)
    try:
        row_of = dict(described._db.execute("SELECT key, description FROM settings"))
    finally:
        described.close()
    assert json.loads(row_of[row["key"]])["text_embeds"] == FEED
    assert "text_embeds" not in json.loads(row_of[first["rows"][1]["key"]])  # cls: not prompt-aware


@pytest.mark.parametrize("args,needle", [
    (["--dataset", "missing.jsonl", "--keep", "8"], "--dataset missing.jsonl: no such file"),
    (["--keep", "8", "--layer", "0"], "--layer must be >= 1 (blocks count from 1) or `end`, got 0"),
    (["--keep", "8", "--layer", "mid"], "--layer 'mid' is not an integer or `end`"),
    (["--keep", "8", "--images", "x"], "--dataset measures accuracy on bundles it compiles itself; drop --images"),
    (["--keep", "8", "--ray-workers", "2"], "--ray-workers needs --ray auto|ADDRESS"),
    (["--keep", "8", "--limit", "0"], "--limit must be an integer >= 1, got 0"),
    (["--keep", "8", "--method", "nope"], "unknown method"),
    (["--keep", "100"], "--keep must satisfy 1 <= keep < 64"),
    (["--keep", "8", "--target", "tpu"], "tpu"),
])
def test_bad_input_is_one_line(setup, tmp_path, args, needle):
    model, data, _, _ = setup
    args = [a if a != "DATA" else data for a in args]
    if "--dataset" not in args:
        args = ["--dataset", data, *args]
    result = run_cli("eval", model, *args, "--store", tmp_path / "s.sqlite")
    one_line_error(result, needle)


def test_without_a_dataset_the_dataset_options_are_refused(setup):
    model, *_ = setup
    with pytest.raises(InputError, match=r"^limit, ray applies to eval dataset only$"):
        api.eval(str(model), images="x", prompts="y", limit=3, ray="auto")


def test_precision_int8_compiles_and_runs_the_int8_bundles(setup, tmp_path):
    # The target's own options reach the sweep's bundles: each one carries model.int8.onnx, the ort runner
    # answers with it, its cells are keyed apart from the fp32 ones, and the kept sets equal fp32's
    # (the score path stays fp32: the kept set is the contract).
    model, data, store, report = setup
    result = run_cli("eval", model, "--dataset", data, "--keep", "8", "--layer", "1", "--method", "cls",
                     "--store", store, "--max-new-tokens", "3", "--precision", "int8", "--json")
    assert result.exit_code == 0, result.output
    int8 = json.loads(result.stdout)
    assert int8["computed"] == 4 * 6 and int8["reused"] == 0
    fp32 = {(r["method"], r["keep"], r["where"]): r for r in report["rows"]}
    for row in int8["rows"]:
        assert (Path(row["bundle"]) / "model.int8.onnx").is_file()
        assert not (Path(fp32[(row["method"], row["keep"], row["where"])]["bundle"]) / "model.int8.onnx").exists()
        if row["method"] == "cls":
            for digest, cell in row["answers"].items():
                assert cell["extra"]["kept"] == fp32[("cls", 8, "after block 1")]["answers"][digest]["extra"]["kept"]


def test_a_bad_target_option_is_one_line(setup, tmp_path):
    model, data, _, _ = setup
    result = run_cli("eval", model, "--dataset", data, "--keep", "8", "--precision", "fp64", "--store",
                     tmp_path / "s.sqlite")
    one_line_error(result, "ort --precision takes fp32 or int8, got 'fp64'")


def test_without_a_dataset_a_target_option_is_refused(setup):
    model, *_ = setup
    with pytest.raises(InputError, match=r"^target_options\['precision'\] applies to eval dataset only$"):
        api.eval(str(model), images="x", prompts="y", target_options={"precision": "int8"})


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_retained_is_null_and_explained_where_dense_answers_nothing_right(setup, tmp_path):
    """With dense accuracy 0 (the tiny model never says "cat"), --json wrote `"retained": NaN` and NaN
    bounds, which is not JSON, and the table said `retained nan` without a reason. Now null, and the table, the
    page and the JSON say why."""
    model, data, store, report = setup
    assert report["rows"][0]["accuracy"] == 0
    result = run_cli("eval", model, "--dataset", data, "--keep", "8", "--store", store, "--max-new-tokens", "3",
                     "--json", "--report", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    for text in (result.stdout, (tmp_path / "e.json").read_text()):
        out = _strict_json(text)
        assert all(r["retained"] is None and r["retained_ci"] is None for r in out["rows"])
        assert out["retained_null"] == "dense accuracy is 0 on these samples: nothing to retain"
    lines = run_cli("eval", model, "--dataset", data, "--keep", "8", "--store", store, "--max-new-tokens", "3",
                    "--report", tmp_path / "e.html").stdout.splitlines()
    assert not any("nan" in line.lower() for line in lines)
    assert "(retained -: dense accuracy is 0 on these samples: nothing to retain)" in lines
    page = (tmp_path / "e.html").read_text()
    assert "nan" not in page.lower() and "nothing to retain" in page
    # What the columns mean is one text (quality.stats), said in each rendering.
    from html import escape

    from vlmprune.compiler.quality import stats
    assert f"(vs random: {stats.VERSUS_RANDOM}; * where it excludes 0. agrees: {stats.AGREES})" in lines
    assert escape(stats.VERSUS_RANDOM) in page and escape(stats.AGREES) in page


def write_typed(root: Path, dense_answers: list[str]) -> Path:
    """The setup's images and questions with types, and answers that make dense right on the count questions
    (its own answers) and wrong on the color ones; ties in the majority broken by text."""
    lines = []
    for i, answer in enumerate(dense_answers):
        kind = "count" if i % 2 == 0 else "color"
        answers = [answer] if kind == "count" else [{1: "zebra", 3: "aardvark", 5: "mole"}[i]]
        lines.append(json.dumps({"image": f"img{i // 2}.png", "question": QUESTIONS[i % 2], "answers": answers,
                                 "type": kind}))
    path = root / "typed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_typed_dataset_is_scored_per_type_against_its_majority_and_random_keep(setup, tmp_path):
    model, data, store, report = setup
    dense_answers = [report["rows"][0]["answers"][d]["answer"] for d in report["sample_digests"]]
    typed = write_typed(data.parent, dense_answers)
    out = evaluate_dataset(str(model), typed, ["cls"], [8], ["end"], store=store, max_new_tokens=3)
    assert [r["method"] for r in out["rows"]] == ["dense", "cls", "random", "grid"]
    assert out["sample_types"] == ["count", "color"] * 3
    assert out["types"]["color"] == {"samples": 3, "majority_answer": "aardvark", "majority_accuracy": 1 / 3}
    assert out["types"]["count"]["samples"] == 3
    dense, cls_row, random_row, grid_row = out["rows"]
    assert dense["by_type"]["count"]["accuracy"] == 1 and dense["by_type"]["color"]["accuracy"] == 0
    assert dense["accuracy"] == 0.5 and dense["retained"] == 1.0
    assert dense["by_type"]["color"]["retained"] is None  # nothing to retain within that type
    assert dense["vs_random"] is None and random_row["vs_random"] is None
    digests = out["sample_digests"]
    for row in (cls_row, grid_row):
        mine = [row["answers"][d]["correct"] for d in digests]
        theirs = [random_row["answers"][d]["correct"] for d in digests]
        want = stats.difference_interval(mine, theirs)
        assert (row["vs_random"]["difference"], *row["vs_random"]["ci"]) == pytest.approx(want)
        assert row["vs_random"]["counts"] == (want[1] > 0 or want[2] < 0)
        count = [i for i, t in enumerate(out["sample_types"]) if t == "count"]
        want = stats.difference_interval([mine[i] for i in count], [theirs[i] for i in count])
        assert (row["by_type"]["count"]["vs_random"]["difference"], *row["by_type"]["count"]["vs_random"]["ci"]) \
            == pytest.approx(want)
    lines = render.eval_lines(api.EvalResult(out))
    assert "accuracy per question type:" in lines
    header = lines[lines.index("accuracy per question type:") + 1].split()
    assert header == ["method", "K", "where", "color", "count"]
    assert lines[lines.index("accuracy per question type:") + 3].split() == ["majority", "answer", "0.333", "0.333"]
    _strict_json(json.dumps(out))
    from vlmprune.compiler.report import quality_html

    page = quality_html(out)
    assert "Accuracy per question type" in page and "aardvark" in page


def test_an_interrupt_says_how_many_cells_are_stored_and_that_a_rerun_resumes(setup, tmp_path):
    """Ctrl-C during the sweep once said `interrupted; nothing was written` while the store held the cells
    the rerun then reused."""
    from vlmprune.compiler.bundle import interrupted_line, tracking

    model, data, _, _ = setup
    store, seen, complete = tmp_path / "s.sqlite", [], []

    def interrupt(key, results):
        seen.append(len(results))
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), tracking(complete):
        evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=store, max_new_tokens=3, on_chunk=interrupt)
    assert interrupted_line(complete) == (f"interrupted; 4 bundles under {tmp_path / 'bundles'} are complete; "
                                          f"{sum(seen)} of 24 cells are stored in {store}: a rerun resumes from them")
    resumed = evaluate_dataset(str(model), data, ["cls"], [8], ["end"], store=store, max_new_tokens=3)
    assert resumed["reused"] == sum(seen)


def test_an_interrupt_during_the_compiles_summarises_the_bundles(setup, tmp_path, monkeypatch):
    """The interrupt line once listed seven bundle paths in one run-on line."""
    from vlmprune.compiler import accuracy
    from vlmprune.compiler.bundle import interrupted_line, record_complete, tracking

    model, data, _, _ = setup
    made = []

    def compile_some(model, plan, key, target, target_options, folder, progress, family_options=None):
        if len(made) == 7:
            raise KeyboardInterrupt
        made.append(folder / key)
        record_complete(f"the bundle at {folder / key}")
        return folder / key, True

    monkeypatch.setattr(accuracy, "bundle_for", compile_some)
    complete = []
    with pytest.raises(KeyboardInterrupt), tracking(complete):
        evaluate_dataset(str(model), data, ["cls", "divprune"], [8, 16], ["1", "end"], store=tmp_path / "s.sqlite")
    assert interrupted_line(complete) == f"interrupted; 7 bundles under {tmp_path / 'bundles'} are complete"
