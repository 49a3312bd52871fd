"""Executors: the in-process one runs tasks in order with one worker per task; Ray is refused in one line without
the extra (tests/compiler/test_accuracy_ray.py runs a real cluster)."""

from __future__ import annotations

import sys

import pytest

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.quality.executors import InProcess, RayExecutor, Task


class Doubler:
    built = 0

    def __init__(self):
        Doubler.built += 1

    def __call__(self, chunk):
        return [{"sample": str(x), "answer": str(2 * x), "correct": x % 2 == 0} for x in chunk]


def test_in_process_runs_every_chunk_in_order_with_one_worker_per_task():
    Doubler.built = 0
    tasks = [Task("a", Doubler, ((1, 2), (3,))), Task("b", Doubler, ((4,),))]
    out = list(InProcess().run(tasks))
    assert [(key, [r["answer"] for r in results]) for key, results in out] == \
        [("a", ["2", "4"]), ("a", ["6"]), ("b", ["8"])]
    assert Doubler.built == 2


def test_ray_without_the_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where the extra is not installed
    with pytest.raises(InputError, match=r"^--ray needs Ray: pip install 'vlmprune\[ray\]'$"):
        RayExecutor("auto")
