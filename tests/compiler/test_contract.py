"""compiler.contract is the one home of the bundle's names: no other module spells them as its own constant."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vlmprune.compiler import contract

from vlmprune.compiler.bundle import manifest
from vlmprune.targets import rknn_worker, trt_engine

REPO = Path(__file__).resolve().parents[2]
# Names, not words: the node roles ("score", "tokens") and the llm/ folder ("llm") are also ordinary words
# other constants hold with another meaning (parity's BY_SCORE, a manifest section's key).
NAMES = {value: name for name, value in vars(contract).items()
         if name.isupper() and isinstance(value, str) and value not in ("llm", *contract.ROLES)}
STANDALONE = {"targets/trt_engine.py", "targets/rknn_worker.py"}  # no vlmprune import: tested to mirror below
# Modules still allowed to define a bundle name of their own, until it moves into the contract: none left.
PENDING: set[str] = set()


def _constants(path: Path):
    """(line, value) of every string constant assigned at any level of path, tuples unpacked."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield node.lineno, value.value


def _modules():
    for folder in ("compiler", "passes", "targets", "tools"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel != "compiler/contract.py" and rel not in STANDALONE | PENDING:
                yield rel


@pytest.mark.parametrize("rel", list(_modules()))
def test_no_module_but_the_contract_defines_a_bundle_name(rel):
    twins = [f"{rel}:{line} assigns {value!r}: import contract.{NAMES[value]} instead"
             for line, value in _constants(REPO / rel) if value in NAMES]
    assert not twins, "\n".join(twins)


def test_the_standalone_scripts_spell_the_contract_s_values():
    """trt_engine.py (JetPack's Python) and rknn_worker.py (the rknn venv) cannot import vlmprune."""
    for name in ("ENGINE", "MANIFEST", "MODEL", "DECOMPOSED", "KEPT", "TEXT"):
        assert getattr(trt_engine, name) == getattr(contract, name), name
    assert trt_engine.DIGEST_KEY == manifest.DIGEST_KEY
    assert rknn_worker.RKNN == contract.RKNN


def test_the_contract_s_values_are_distinct_where_they_name_different_things():
    values = [v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str) and k != "LLM_MODEL"]
    assert len(values) == len(set(values))  # LLM_MODEL is model.onnx inside llm/, by the runtimes' choice


EPSILONS = {name: value for name, value in vars(contract).items() if name.endswith("_EPS")}


@pytest.mark.parametrize("rel", [rel for rel in _modules() if not rel.startswith("tools/")])
def test_the_shared_epsilons_have_one_home(rel):
    """NORM_EPS, SCORE_EPS and COSINE_EPS are the contract's: a library module that defines one of those names again,
    or writes the norm floor 1e-12 as a literal, would let a reference and its graph drift apart by one edit. (tools/
    holds independent peers of the methods, which spell the official code's constants themselves.)"""
    twins = []
    for node in ast.walk(ast.parse((REPO / rel).read_text(), rel)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in EPSILONS for t in node.targets):
            twins.append(f"{rel}:{node.lineno} defines {node.targets[0].id}")
        if isinstance(node, ast.Constant) and node.value == EPSILONS["NORM_EPS"] and type(node.value) is float:
            twins.append(f"{rel}:{node.lineno} writes {node.value!r}: import contract.NORM_EPS")
    assert not twins, "\n".join(twins)
