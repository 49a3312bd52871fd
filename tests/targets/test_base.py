"""Targets and methods meet through declarations: a formulation's control flow, int8 properties, CLI contributions."""

from __future__ import annotations

import pytest

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import Formulation
from vlmprune.targets import TARGETS, get_target


class _Greedy(type(get_method("dart"))):
    """A method that no target names, with a Loop form first and a straight-line one."""

    name = "greedy-toy"
    formulations = (Formulation("while", control_flow=True), Formulation("flat"))


@pytest.mark.parametrize("target,form", [("ort", "while"), ("orin", "flat"), ("xavier", "flat"),
                                         ("rk3588", "flat"), ("qnn", "flat")])
def test_formulation_is_chosen_from_the_declarations(target, form):
    assert get_target(target).formulation(_Greedy()) == form
    assert get_target(target).formulation(get_method("divprune")) == {"while": "loop", "flat": "unrolled"}[form]


def _rk3588_int8(method: str, **method_options) -> dict:
    options = CompileOptions(target="rk3588", method=method, method_options=method_options,
                             target_options={"precision": "int8"})
    return get_target("rk3588").check_options(options)


def test_int8_refusal_follows_what_the_method_declares(monkeypatch):
    # cls scoring the merged tokens selects on the projector output: refused as divprune and dart are, on every int8.
    with pytest.raises(InputError) as info:
        _rk3588_int8("cls", score="attention")
    assert str(info.value) == ("rk3588 --precision int8 with cls: its selection reads the projector output, so "
                               "hybrid int8 would keep everything before it in float16; use fp16")
    with pytest.raises(InputError, match="^--precision int8 with cls: its selection reads the projector output, so "
                                         "everything before it must stay in floating point"):
        get_target("orin").check_options(CompileOptions(target="orin", method="cls", method_options={
            "score": "attention"}, target_options={"precision": "int8"}))
    assert _rk3588_int8("cls") == {"precision": "int8"}
    monkeypatch.setattr(type(get_method("cls")), "int8_loss", "its merge loses its values in int8")
    with pytest.raises(InputError) as info:
        _rk3588_int8("cls")
    assert str(info.value) == "rk3588 --precision int8 with cls: its merge loses its values in int8; use fp16"
    # TensorRT's int8 keeps the method's own nodes in floating point: the loss does not apply there.
    orin = CompileOptions(target="orin", method="cls", target_options={"precision": "int8"})
    assert get_target("orin").check_options(orin) == {"precision": "int8"}


def test_targets_contribute_their_commands_and_listings():
    from vlmprune.compiler.cli import main

    contributed = {c.name: c for cls in TARGETS.values() for c in cls().commands()}
    assert list(contributed) == ["build-engine"]
    assert main.commands["build-engine"] is contributed["build-engine"]
    assert get_target("qnn").listing()[0] == "qnn --soc values (default SM8650):"
    assert get_target("ort").listing() == []
