"""compiler.quality.store: the SQLite store of finished cells that lets a sweep resume."""

from __future__ import annotations

import json
import sqlite3

import pytest

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.quality.store import SCHEMA, Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "sub" / "cells.sqlite")  # its folder is made
    yield s
    s.close()


def _row(sample, answer="x", correct=True, extra=None):
    return {"sample": sample, "answer": answer, "correct": correct, "extra": extra}


def test_put_done_cells_round_trip(store):
    assert store.done("k") == set() and store.cells("k") == {}
    store.put("k", [_row("s1", "red", True, {"tokens": 3}), _row("s2", "blue", 0)])
    store.put("other", [_row("s1", "green", 1)])
    assert store.done("k") == {"s1", "s2"}
    assert store.cells("k") == {
        "s1": {"sample": "s1", "answer": "red", "correct": True, "extra": {"tokens": 3}},
        "s2": {"sample": "s2", "answer": "blue", "correct": False, "extra": {}},  # no extra reads back as {}
    }
    assert store.cells("other") == {"s1": {"sample": "s1", "answer": "green", "correct": True, "extra": {}}}
    assert store.done("missing") == set()


def test_a_second_store_on_the_file_sees_the_rows(tmp_path):
    """What one run stored, the next one (another connection, another process) reads: the resume."""
    path = tmp_path / "cells.sqlite"
    first = Store(path)
    first.describe("k", {"method": "fastv", "k": 64})
    first.put("k", [_row("s1"), _row("s2", correct=False)])
    second = Store(path)  # while the first is still open (WAL)
    assert second.done("k") == {"s1", "s2"}
    first.close()
    second.close()
    third = Store(path)
    assert third.cells("k")["s2"]["correct"] is False
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT description FROM settings WHERE key='k'").fetchone()[0] == json.dumps(
            {"k": 64, "method": "fastv"})
    third.close()


def test_put_replaces_a_cell(store):
    store.put("k", [_row("s1", "old", False, {"n": 1})])
    store.put("k", [_row("s1", "new", True)])
    assert store.cells("k") == {"s1": {"sample": "s1", "answer": "new", "correct": True, "extra": {}}}
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM cells").fetchone()[0] == 1


def test_describe_replaces_a_description(store):
    store.describe("k", {"a": 1})
    store.describe("k", {"a": 2})
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT description FROM settings").fetchall() == [('{"a": 2}',)]


def test_a_failed_chunk_stores_nothing(store):
    """A chunk is one transaction: a bad row leaves none of its rows behind."""
    with pytest.raises(KeyError):
        store.put("k", [_row("s1"), {"answer": "no sample"}])
    assert store.done("k") == set()


def test_not_a_store(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a database\n" * 100)
    with pytest.raises(InputError) as exc:
        Store(path)
    message = str(exc.value)
    assert message.startswith(f"--store {path}: not a results store (") and "\n" not in message
    assert path.read_text().startswith("these are my notes")  # left as it was


def test_another_schema(tmp_path):
    path = tmp_path / "cells.sqlite"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value=? WHERE name='schema'", (str(SCHEMA + 1),))
    with pytest.raises(InputError) as exc:
        Store(path)
    assert str(exc.value) == (f"--store {path}: written by another version of vlmprune (schema {SCHEMA + 1}, "
                              f"this one reads {SCHEMA}); pass another --store")


def test_schema_is_written_once(tmp_path):
    path = tmp_path / "cells.sqlite"
    Store(path).close()
    Store(path).close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT name, value FROM meta").fetchall() == [("schema", str(SCHEMA))]
