"""compiler.quality.sweep: cells computed once, reused after, and kept across an interruption."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from vlmprune.compiler.quality.dataset import Sample
from vlmprune.compiler.quality.executors import InProcess
from vlmprune.compiler.quality.stats import exact_match
from vlmprune.compiler.quality.store import Store
from vlmprune.compiler.quality.sweep import Setting, run_sweep, setting_key


@dataclasses.dataclass(frozen=True)
class Reverser:
    """A picklable worker factory: its worker answers each question reversed, and logs to `log` every worker it
    builds and every sample it answers, so a test counts the work actually done."""

    log: str
    tag: str = ""

    def __call__(self):
        self._write({"made": self.tag})
        return self._answer

    def _answer(self, chunk: list[Sample]) -> list[dict]:
        self._write({"chunk": [s.digest for s in chunk]})
        return [{"sample": s.digest, "answer": self.tag + s.question[::-1],
                 "correct": exact_match(self.tag + s.question[::-1], s.answers), "extra": {"n": len(chunk)}}
                for s in chunk]

    def _write(self, event: dict) -> None:
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _answered(log: Path) -> list[str]:
    return [d for e in _events(log) for d in e.get("chunk", [])]


def _samples(n: int = 6) -> list[Sample]:
    """Samples on n // 2 images, two questions each; every other one answered right by a Reverser."""
    return [Sample(i, f"/img/{i // 2}.png", f"q{i}", (f"{i}q",) if i % 2 else ("no",), f"digest{i}")
            for i in range(n)]


def _setting(log: Path, tag: str = "", **description) -> Setting:
    description = {"model": "m0", "method": "reverse", "k": 8, **description}
    return Setting(setting_key(description), description, Reverser(str(log), tag))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "cells.sqlite")
    yield s
    s.close()


def test_first_sweep_computes_every_cell(tmp_path, store):
    log, samples = tmp_path / "log", _samples()
    settings = [_setting(log, k=8), _setting(log, "B", k=16)]
    pickle.loads(pickle.dumps(settings[0].make))  # what a Ray worker is handed must pickle
    seen = []
    result = run_sweep(settings, samples, store, InProcess(), chunk=4, progress=False,
                       on_chunk=lambda key, results: seen.append((key, len(results))))
    assert (result.computed, result.reused) == (12, 0)
    assert sorted(_answered(log)) == sorted([s.digest for s in samples] * 2)  # each cell once
    assert [e["made"] for e in _events(log) if "made" in e] == ["", "B"]  # one worker per setting
    assert seen == [(settings[0].key, 4), (settings[0].key, 2), (settings[1].key, 4), (settings[1].key, 2)]
    for setting in settings:
        cells = result.cells[setting.key]
        assert set(cells) == {s.digest for s in samples}
        for s in samples:
            assert cells[s.digest]["answer"] == setting.make.tag + s.question[::-1]
            assert cells[s.digest]["correct"] is (s.index % 2 == 1 and setting.make.tag == "")
    assert store.cells(settings[0].key) == result.cells[settings[0].key]


def test_second_sweep_reuses_every_cell(tmp_path, store):
    log, samples = tmp_path / "log", _samples()
    settings = [_setting(log, k=8), _setting(log, k=16)]
    first = run_sweep(settings, samples, store, chunk=4, progress=False)
    log.unlink()
    again = run_sweep(settings, samples, Store(store.path), chunk=4, progress=False)
    assert (again.computed, again.reused) == (0, 12)
    assert _events(log) == []  # no worker built, nothing answered
    assert again.cells == first.cells


def test_an_interrupted_sweep_keeps_its_finished_chunks(tmp_path, store):
    log, samples = tmp_path / "log", _samples()
    setting = _setting(log)

    def stop(key, results):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep([setting], samples, store, chunk=2, progress=False, on_chunk=stop)
    first_chunk = _answered(log)
    assert first_chunk == ["digest0", "digest1"]
    reopened = Store(store.path)  # the chunk was committed, not just held by this connection
    assert reopened.done(setting.key) == set(first_chunk)

    log.unlink()
    result = run_sweep([setting], samples, reopened, chunk=2, progress=False)
    assert (result.computed, result.reused) == (4, 2)
    assert sorted(_answered(log)) == [f"digest{i}" for i in range(2, 6)]  # only the rest
    assert set(result.cells[setting.key]) == {s.digest for s in samples}


def test_a_changed_setting_is_computed_again(tmp_path, store):
    log, samples = tmp_path / "log", _samples()
    old = _setting(log, method_version=1)
    run_sweep([old], samples, store, progress=False)
    new = _setting(log, method_version=2)
    assert new.key != old.key
    result = run_sweep([new], samples, store, progress=False)
    assert (result.computed, result.reused) == (6, 0)
    assert store.done(old.key) == {s.digest for s in samples}  # the old rows stay, unread


def test_new_samples_are_computed_and_cells_cover_only_the_samples_asked(tmp_path, store):
    log, samples = tmp_path / "log", _samples(8)
    setting = _setting(log)
    part = run_sweep([setting], samples[:4], store, progress=False)
    assert (part.computed, part.reused) == (4, 0)
    log.unlink()
    full = run_sweep([setting], samples, store, progress=False)
    assert (full.computed, full.reused) == (4, 4)
    assert sorted(_answered(log)) == [f"digest{i}" for i in range(4, 8)]
    fewer = run_sweep([setting], samples[:2], store, progress=False)
    assert set(fewer.cells[setting.key]) == {"digest0", "digest1"}  # stored cells of other samples left out


def test_setting_key():
    a = {"model": "abc", "method": "fastv", "params": {"k": 64, "layer": 2}, "target": "cpu"}
    b = {"target": "cpu", "params": {"layer": 2, "k": 64}, "method": "fastv", "model": "abc"}
    assert setting_key(a) == setting_key(b)  # dict order does not matter, nested either
    assert len(setting_key(a)) == 24 and setting_key(a) == setting_key(json.loads(json.dumps(a)))
    for change in ({"model": "abd"}, {"params": {"k": 32, "layer": 2}}, {"target": "orin"}, {"decode": 8}):
        assert setting_key({**a, **change}) != setting_key(a)


def test_without_a_bar_each_finished_setting_is_one_line(tmp_path, store):
    """A sweep whose stderr is not a terminal (CI) printed nothing for its whole length; it says each
    setting as it finishes, and nothing per chunk. With a bar (a terminal) the bar says it instead."""
    log, samples = tmp_path / "log", _samples()
    settings = [dataclasses.replace(_setting(log, k=8), label="reverse K=8"), _setting(log, k=16)]
    lines = []
    run_sweep(settings, samples, store, chunk=2, progress=False, log=lines.append)
    assert [line.split(" (")[0] for line in lines] == ["eval: reverse K=8 done", f"eval: {settings[1].key} done"]
    assert "1 of 2 settings, 6 of 12 cells" in lines[0] and "2 of 2 settings, 12 of 12 cells" in lines[1]
    lines.clear()
    run_sweep(settings, samples, Store(store.path), chunk=2, progress=False, log=lines.append)
    assert lines == []  # nothing to compute: nothing to say
    again = [_setting(log, k=32)]
    run_sweep(again, samples, store, chunk=2, progress=True, log=lines.append)
    assert lines == []  # the bar is shown
