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
    # The CLI's build-engine takes the options the target declares and runs through the API (api.target_command)
    registered, declared = main.commands["build-engine"], contributed["build-engine"]
    assert registered.params == declared.params and registered.help == declared.help
    assert registered.callback is not declared.callback
    assert get_target("qnn").listing()[0] == "qnn --soc values (default SM8650):"
    assert get_target("ort").listing() == []


@pytest.mark.parametrize("which", ["rknn", "edgellm"])
def test_creating_a_toolchain_venv_says_what_how_big_and_how_long_before_and_what_it_took_after(which):
    """Creating the rknn venv (628 MB, ~27 s) or the Edge-LLM one (~1 GB, ~1 min) printed nothing. The lines, from
    each environment's own declaration; the creation path on the environment already made here says nothing more
    (a complete venv is reused) and its record gives the after line."""
    if which == "rknn":
        from vlmprune.targets import rknn_env as env_module
    else:
        from vlmprune.compiler.llm import edgellm_env as env_module
    env = env_module.ENV
    venv = env.venv_dir()
    size, seconds = env.cost
    assert size and seconds
    assert env.creating_line(venv) == (f"creating the {env.label} at {venv} (once: ~{size} from the package index, "
                                       f"~{seconds})...")
    if not env.available()[0] or env.custom_python() is not None:
        pytest.skip(f"the {env.label} is not created here ({env.available()[1]}): its creation is not run by tests")
    said: list[str] = []
    info = env_module.create_venv(venv, said.append)
    assert said == [] and info == env.info()  # reused as it is, without a word
    assert env.ready_line(venv, info) == (f"{env.label} ready at {venv} ({info['size_bytes'] / 1e6:.0f} MB, "
                                          f"{info['install_seconds']:.0f} s)")


def test_targets_read_their_emit_context_by_field():
    """Target.emit is handed an EmitContext: no target reads it by key (the dict it replaced was read by key in ten
    places), and every attribute a target reads on it is one EmitContext has, so a misspelt field fails here and not
    on the one target and precision that reach it."""
    import ast
    import dataclasses
    from pathlib import Path

    from vlmprune.targets.base import EmitContext

    names = {f.name for f in dataclasses.fields(EmitContext)} | {n for n in vars(EmitContext) if not n.startswith("_")}
    read, keyed = set(), []
    emits = 0
    for path in sorted((Path(__file__).resolve().parents[2] / "targets").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            # every function handed the context: the emits and their helpers (annotated; an untyped one is missed)
            if not isinstance(fn, ast.FunctionDef) or not any(
                    a.arg == "context" and ast.unparse(a.annotation or ast.Constant(None)) == "EmitContext"
                    for a in fn.args.args):
                continue
            emits += 1
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "context":
                    read.add(node.attr)
                if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "context":
                    keyed.append(f"{path.name}:{node.lineno}")
    assert emits >= len(TARGETS) - 1  # orin and xavier share one emit; ort_quant, openvino and tensorrt add helpers
    assert not keyed and "get" not in read
    assert read and read <= names, sorted(read - names)


def test_the_emit_context_calibrates_at_its_size_and_normalisation():
    """EmitContext.calibration_inputs: the frontend's preprocessing handed down, at the context's image size (or the
    size a target asks for) and with its mean and std; never the parity images it is later checked on."""
    import numpy as np

    from vlmprune.compiler.frontend import images
    from vlmprune.targets.base import EmitContext

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    parity, _ = images.parity_inputs(2, 32, mean, std)
    context = EmitContext(None, CompileOptions(), {}, 32, mean, std, images, parity)
    calib, names = context.calibration_inputs(2)
    assert calib.shape == (2, 3, 32, 32) and len(names) == 2
    assert not np.allclose(calib, parity)
    other, _ = EmitContext(None, CompileOptions(), {}, 32, (0.0,) * 3, (1.0,) * 3, images, parity).calibration_inputs(2)
    np.testing.assert_allclose(calib, (other - np.reshape(mean, (1, 3, 1, 1))) / np.reshape(std, (1, 3, 1, 1)),
                               rtol=1e-5, atol=1e-5)
    assert context.calibration_inputs(1, size=48)[0].shape == (1, 3, 48, 48)
