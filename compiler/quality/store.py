"""Finished cells of a sweep, in SQLite: one row per (setting key, sample digest).

A setting's key hashes everything that decides its answers: the model's content hash, the
method, its version and parameters, K, the layer, the target and the decoding length
(sweep.setting_key). A changed model or method version is a new key, so its old rows are
never read again; `vlmprune eval` reports how many cells it reused and computed. Only the
driver writes, one transaction per finished chunk, so an interrupted sweep keeps every
chunk it finished and resumes from there; WAL mode lets a reader look in meanwhile.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from vlmprune.compiler.errors import InputError

SCHEMA = 1


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=60)
        except sqlite3.DatabaseError as exc:
            raise InputError(f"--store {self.path}: cannot open it ({exc})") from None
        try:
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if tables and "meta" not in tables:
                raise InputError(f"--store {self.path}: not a results store (an SQLite file of other tables)")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(
                "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);"
                "CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, description TEXT);"
                "CREATE TABLE IF NOT EXISTS cells (key TEXT, sample TEXT, answer TEXT, correct INTEGER, "
                "extra TEXT, PRIMARY KEY (key, sample));")
            row = self._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
                self._db.commit()
            elif row[0] != str(SCHEMA):
                raise InputError(f"--store {self.path}: written by another version of vlmprune (schema {row[0]}, "
                                 f"this one reads {SCHEMA}); pass another --store")
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise InputError(f"--store {self.path}: not a results store ({exc})") from None
        except InputError:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def describe(self, key: str, description: dict) -> None:
        self._db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, json.dumps(description, sort_keys=True)))
        self._db.commit()

    def done(self, key: str) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT sample FROM cells WHERE key=?", (key,))}

    def put(self, key: str, results: list[dict]) -> None:
        """One chunk's results ({"sample", "answer", "correct", "extra"}), in one transaction."""
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO cells VALUES (?, ?, ?, ?, ?)",
                                 [(key, r["sample"], r["answer"], int(bool(r["correct"])),
                                   json.dumps(r.get("extra") or {})) for r in results])

    def cells(self, key: str) -> dict[str, dict]:
        out = {}
        for sample, answer, correct, extra in self._db.execute(
                "SELECT sample, answer, correct, extra FROM cells WHERE key=?", (key,)):
            out[sample] = {"sample": sample, "answer": answer, "correct": bool(correct), "extra": json.loads(extra)}
        return out
