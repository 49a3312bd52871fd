"""--schedule (progressive pruning in steps across blocks) and --coverage F (a uniform grid forced into K): parsing and
refusals, the inserted ops on the tiny CLIP tower, numbers against the torch reference in steps, the ONNX checker, and
tiny compiles whose parity passes with the manifest's steps."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.contract import PruneRecord
from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.compiler.parity.reference import MethodPruner, pruner_for
from vlmprune.passes.methods import coverage, get_method, schedule
from vlmprune.passes.methods.grid import grid_indices
from vlmprune.passes.progressive import InsertProgressivePruningPass, insertion_pass
from vlmprune.passes.prune import KEPT_INDICES, prune_record
from vlmprune.passes.retarget import RetargetTokenCountPass
from vlmprune.targets.runtime import ort_session, run_session

CLS = get_method("cls")


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text,canonical", [("2,4,6", "2,4,6"), ("2/4/6", "2,4,6"), ("2:40,4:30,6:16", "2:40,4:30,6:16"),
                                            ("2:40/4:30/6", "2:40,4:30,6:16")])
def test_schedule_forms(text, canonical):
    assert CLS.parse(16, {"schedule": text})["schedule"] == canonical


@pytest.mark.parametrize("method,options,match", [
    ("cls", {"schedule": "4,2"}, "must increase"),
    ("cls", {"schedule": "0,2"}, "must increase"),
    ("cls", {"schedule": "2"}, "one step is --layer 2"),
    ("cls", {"schedule": "2:10,4:30,6:16"}, "must decrease"),
    ("cls", {"schedule": "2:40,4:30,6:12"}, r"keeps --keep \(16\), not 12"),
    ("cls", {"schedule": "2:40,4,6"}, "for every step"),
    ("cls", {"schedule": "2,x"}, "not BLOCK or BLOCK:COUNT"),
    ("cls", {"schedule": "1,2", "lambda": 0.5}, "pixel term"),
    ("cls", {"schedule": "1,2", "budget": "adaptive"}, "K varies per image"),
    ("cls", {"schedule": "1,2", "merge": "local"}, "whole patch grid"),
    ("cls", {"schedule": "1,2", "scorer": "int8"}, "--scorer int8"),
    ("cls", {"schedule": "1,2", "score": "attention"}, "projector output"),
    ("divprune", {"schedule": "1,2"}, "greedy"),
    ("dart", {"schedule": "1,2"}, "greedy"),
    ("grid", {"schedule": "1,2"}, "baseline"),
    ("prumerge+", {"schedule": "1,2"}, "K varies per image"),
    ("cls", {"coverage": 1.0}, "0 <= F < 1"),
    ("cls", {"coverage": -0.1}, "0 <= F < 1"),
    ("cls", {"coverage": 0.99}, "keeps only the grid"),
    ("divprune", {"coverage": 0.25}, "greedy"),
    ("grid", {"coverage": 0.25}, "baseline"),
    ("cls", {"coverage": 0.25, "budget": "adaptive"}, "budget adaptive"),
])
def test_refusals_are_one_line(method, options, match):
    with pytest.raises(InputError, match=match) as info:
        get_method(method).parse(16, dict(options))
    assert "\n" not in str(info.value)


def test_geometric_counts_and_their_guards():
    assert schedule.resolve({"keep": 192, "schedule": "2,4,6"}, 1024) == [
        schedule.Step(2, 586), schedule.Step(4, 335), schedule.Step(6, 192)]
    steps = schedule.resolve({"keep": 16, "schedule": "1,2,3"}, 64)
    assert [s.keep for s in steps] == [40, 25, 16]
    for keep, n in ((60, 64), (61, 64), (2, 5), (1, 4)):  # strictly decreasing from below N to K, whatever rounds
        counts = [s.keep for s in schedule.resolve({"keep": keep, "schedule": "1,2,3"}, n)]
        assert n > counts[0] > counts[1] > counts[2] == keep, (keep, n, counts)
    with pytest.raises(InputError, match="needs at least 3 tokens to drop"):
        schedule.resolve({"keep": 62, "schedule": "1,2,3"}, 64)
    with pytest.raises(InputError, match="first step keeps 70"):
        schedule.resolve({"keep": 16, "schedule": "1:70,2:30,3:16"}, 64)


def test_coverage_zero_is_the_plain_method():
    assert CLS.parse(16, {"coverage": 0.0}) == CLS.parse(16, {})
    assert coverage.count(CLS.parse(16, {"coverage": 0.25})) == 4
    assert coverage.count(CLS.parse(10, {"coverage": 0.25})) == 3  # round half up


# ---------------------------------------------------------------------------- graph


def _progressive(path, keep: int, text: str, **options):
    model = ir.load(path)
    params = CLS.parse(keep, {"schedule": text, **options})
    result = insertion_pass(CLS, params, None, None)(model)
    RetargetTokenCountPass()(model)
    return result, params


def test_inserted_steps_ops_record_and_checker(tiny_dense_path):
    result, params = _progressive(tiny_dense_path, 16, "1,2,3")
    assert result.modified
    model = result.model
    ops = [n.op_type for n in model.graph if n.name and n.name.startswith("vlmprune/")]
    # each step recomputes its [CLS] row (one Softmax), ranks it (TopK + the raster sort); two compositions
    assert ops.count("Softmax") == 3 and ops.count("GatherElements") == 2
    assert ops.count("TopK") == 2 * 3 + 2 * 2  # the intermediate steps' unused method TopKs are still there
    record = prune_record(model)
    assert record.steps == ({"layer": 1, "keep": 40, "tokens_in": 65, "tokens_out": 41},
                            {"layer": 2, "keep": 25, "tokens_in": 41, "tokens_out": 26},
                            {"layer": 3, "keep": 16, "tokens_in": 26, "tokens_out": 18})
    assert (record.layer, record.tokens_in, record.tokens_out) == (3, 65, 18)
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    ops = [n.op_type for n in model.graph if n.name and n.name.startswith("vlmprune/")]
    assert ops.count("TopK") == 2 * 3  # once unused nodes are gone: a selection and a sort per step
    assert not InsertProgressivePruningPass(schedule.wrap(CLS, params), params)(model).modified  # already in place
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output][-1] == KEPT_INDICES


def test_schedule_beyond_the_tower_is_refused(tiny_dense_path):
    with pytest.raises(InputError, match="block 5 is beyond this tower's 3 blocks"):
        _progressive(tiny_dense_path, 16, "2,5")
    model = ir.load(tiny_dense_path)
    params = CLS.parse(16, {"schedule": "1,2"})
    with pytest.raises(StructureError, match="not the schedule's last block"):
        insertion_pass(CLS, params, 3, None)(model)


def _reference(source, params, n: int, forced=None):
    record = PruneRecord("cls", params, "block", schedule.layers(params)[-1], num_patches=n,
                         steps=[{"layer": s.layer} for s in schedule.resolve(params, n)])
    pruner = pruner_for(record)
    pruner.forced = forced
    return source.pipeline.with_pruner(pruner)


@pytest.mark.parametrize("text,batch,options", [("1,2,3", 1, {}), ("1:48,3", 3, {}), ("1,3", 2, {"coverage": 0.25})])
def test_numbers_match_the_reference_in_steps(tiny_dense_path, tiny_source, text, batch, options):
    keep = 16
    result, params = _progressive(tiny_dense_path, keep, text, **options)
    session = ort_session(ir.to_proto(result.model).SerializeToString())
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 3, 112, 112)).astype(np.float32))
    out = run_session(session, x.numpy())
    forced = coverage.forced_reference(params, 64, None, batch)
    pipeline = _reference(tiny_source, params, 64, forced)
    with torch.no_grad():
        feats, kept = pipeline(x)
    np.testing.assert_array_equal(out[KEPT_INDICES], kept.numpy())
    assert np.all(np.diff(out[KEPT_INDICES], axis=1) > 0)  # original patch indices, raster order
    assert out["image_features"].shape == (batch, keep + 1, 32)
    np.testing.assert_allclose(out["image_features"], feats.numpy(), atol=1e-5, rtol=1e-4)
    trace = pipeline.last_trace
    assert trace["step_scores"].shape == (len(schedule.split(text)) - 1, batch, 64)
    if options:  # every grid patch kept, at every step: K = G grid + (K - G) by the score
        grid = grid_indices(64, coverage.count(params))
        assert all(set(grid) <= set(row) for row in out[KEPT_INDICES].tolist())


def test_reference_steps_differ_from_one_step(tiny_source):
    """The schedule is not one step in disguise: a step after block 1 changes what block 3 scores."""
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 3, 112, 112)).astype(np.float32))
    params = CLS.parse(8, {"schedule": "1:20,3"})
    with torch.no_grad():
        feats, kept = _reference(tiny_source, params, 64)(x)
        one, one_kept = tiny_source.pipeline.with_pruner(MethodPruner(CLS, CLS.parse(8, {}), "block", 3))(x)
    assert kept.shape == one_kept.shape == (2, 8)
    assert not torch.allclose(feats, one)


@pytest.mark.parametrize("keep", [16, 20])
def test_coverage_keeps_the_grid_and_counts_add_to_k(tiny_dense_path, tiny_source, keep):
    from vlmprune.passes.prune import InsertPruningPass

    x = np.random.default_rng(2).standard_normal((2, 3, 112, 112)).astype(np.float32)
    outs = {}
    for f in (0.0, 0.5):
        model = ir.load(tiny_dense_path)
        params = CLS.parse(keep, {"coverage": f})
        InsertPruningPass(CLS, params, 2)(model)
        RetargetTokenCountPass()(model)
        outs[f] = run_session(ort_session(ir.to_proto(model).SerializeToString()), x)[KEPT_INDICES]
        if f:
            g = coverage.count(params)
            grid = set(grid_indices(64, g).tolist())
            for row, plain in zip(outs[f].tolist(), outs[0.0].tolist()):
                assert grid <= set(row) and len(set(row)) == keep  # G grid patches + K - G others
                # the rest are the method's best among the others: within the plain top K's non-grid patches
                assert set(row) - grid <= set(plain) - grid
    with torch.no_grad():
        _, kept = tiny_source.pipeline.with_pruner(MethodPruner(CLS, CLS.parse(keep, {}), "block", 2))(
            torch.from_numpy(x))
    np.testing.assert_array_equal(outs[0.0], kept.numpy())  # F = 0: the plain method


# ---------------------------------------------------------------------------- end to end


def test_tiny_compile_in_steps_passes_parity(tiny_llava_dir, tmp_path):
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    with pytest.raises(InputError, match="not the last block of --schedule"):
        compile_model(str(tiny_llava_dir), tmp_path / "x", CompileOptions(
            method="cls", keep=12, layer=1, method_options={"schedule": "1,2"}))
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        target="ort", method="cls", keep=12, method_options={"schedule": "1,2", "coverage": 0.25}))
    assert result.report.passed, result.manifest["parity"]
    method = result.manifest["method"]
    assert [(s["layer"], s["keep"]) for s in method["steps"]] == [(1, 28), (2, 12)]
    assert method["layer"] == 2 and "progressive" in method["summary"] and "coverage: 3" in method["summary"]
    stages = {s.stage: s for s in result.report.stages}
    assert stages["rewritten"].indices["agreement"] == 1.0 and "step_boundary_ties" in stages["rewritten"].indices
    assert stages["fused"].outputs["roi_forced"]["passed"]  # the grid patches: every one kept
    assert result.manifest["fused_ops"] if "fused_ops" in result.manifest else True


def test_dinov2_compile_in_steps_passes_parity(tiny_dinov2_dir, tmp_path):
    """A DINOv2 tower (layer scales, [CLS]), as the llava_dinov2 family's: cls in two steps with a grid."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    result = compile_model(str(tiny_dinov2_dir), tmp_path / "d", CompileOptions(
        target="ort", method="cls", keep=16, method_options={"schedule": "1:32,2", "coverage": 0.25}))
    assert result.report.passed, result.manifest["parity"]
    assert [(s["layer"], s["keep"]) for s in result.manifest["method"]["steps"]] == [(1, 32), (2, 16)]


def test_eval_places_and_specs():
    from vlmprune.compiler.accuracy import parse_layers, parse_method_spec, plans_for

    assert parse_method_spec("cls:schedule=2:512/4:320/6:192:lambda=0") == (
        "cls", {"schedule": "2:512/4:320/6:192", "lambda": 0})
    with pytest.raises(InputError, match="progressive place"):
        parse_layers(["4/2"])
    plans = plans_for(["cls", "divprune", "cls:coverage=0.25"], [48, 96], parse_layers(["2/4/6,6"]))
    where = {(p.label, p.keep, p.where) for p in plans}
    assert ("cls", 48, "progressive 2→4→6") in where and ("cls", 48, "after block 6") in where
    assert ("cls coverage=0.25", 96, "progressive 2→4→6") in where
    assert ("grid", 48, "after block 6") in where and ("divprune", 48, "tower end") in where
    progressive = next(p for p in plans if p.where == "progressive 2→4→6")
    assert progressive.layer == 6 and progressive.method_options["schedule"] == "2/4/6"
    assert len({(p.label, p.keep, p.where) for p in plans}) == len(plans)  # no row twice
