"""compile_model is the composition of the public stages (compiler.pipeline.stages), and the options are validated once.

The tiny LLaVA checkpoint (tests/conftest.py: 3-block CLIP tower, 64 patches) compiled twice: by compile_model, and
by the stages called one by one; the two bundles must be the same bundle.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx_ir as ir
import pytest

from vlmprune.compiler import pipeline
from vlmprune.compiler.contract import DECOMPOSED
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, compile_model, options
from vlmprune.targets.runtime import ort_session, run_session

OPTIONS = dict(method="cls", keep=16, layer=1, method_options={"lambda": 0.3})


def _by_stages(model: str, folder, opts: CompileOptions):
    """compile_model's body, spelled out with the public stages (no --keep auto, no staging directory)."""
    plan = pipeline.validate_options(opts)
    pipeline.ready(model, plan)
    folder.mkdir()
    loaded = pipeline.load(model, plan)
    dense = pipeline.export_dense(loaded, plan.options, folder)
    plan = pipeline.fit(plan, loaded)
    lowered = pipeline.lower(dense.model, loaded, plan, folder=folder)
    fused = pipeline.fuse(lowered, plan)
    emitted = pipeline.emit(fused, loaded, plan, folder)
    manifest = pipeline.describe(loaded, plan, fused, emitted)
    manifest = pipeline.export_llm(model, manifest, plan, folder)
    report = pipeline.run_parity(loaded, dense.path, folder, manifest, plan.target, emitted.batch, emitted.context)
    return pipeline.write_bundle(folder, manifest, report, loaded, plan.target, dense.path), report, lowered, fused


def _ops(path) -> list[str]:
    return [f"{node.domain}:{node.op_type}" for node in ir.load(path).graph]


def test_the_stages_one_by_one_make_compile_models_bundle(tiny_llava_dir, tmp_path):
    model = str(tiny_llava_dir)
    composed = compile_model(model, tmp_path / "composed", CompileOptions(**OPTIONS))
    manifest, report, lowered, fused = _by_stages(model, tmp_path / "staged", CompileOptions(**OPTIONS))
    a, b = tmp_path / "composed", tmp_path / "staged"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert manifest["method"] == composed.manifest["method"] and manifest["method"]["keep"] == 16
    assert manifest == composed.manifest  # every section, every file by its sha256, the parity summary
    assert report.passed and composed.report.passed
    assert [s.stage for s in report.stages] == [s.stage for s in composed.report.stages]
    assert json.loads((a / "parity.json").read_text()) == json.loads((b / "parity.json").read_text())
    assert _ops(a / DECOMPOSED) == _ops(b / DECOMPOSED) and "vlmprune" not in {o.split(":")[0] for o in _ops(b / DECOMPOSED)}
    assert lowered.path == b / DECOMPOSED and lowered.record is fused.record and fused.fusions  # ort fuses the selection
    assert any(o.startswith("vlmprune:") for o in _ops(b / "model.onnx"))
    pixel = np.random.default_rng(0).standard_normal((2, 3, 112, 112)).astype(np.float32)
    got, want = (run_session(ort_session(d / DECOMPOSED), pixel, {}) for d in (b, a))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


@pytest.fixture
def validations(monkeypatch):
    """Calls to validate_options: the real function, wrapped to count, wherever a vlmprune module holds it."""
    real, calls = options.validate_options, []

    def counting(opts):
        calls.append(opts)
        return real(opts)

    for module in [m for name, m in sys.modules.items() if name.startswith("vlmprune") and m is not None]:
        if getattr(module, "validate_options", None) is real:
            monkeypatch.setattr(module, "validate_options", counting)
    return calls


def test_one_compile_validates_its_options_once(validations, tiny_llava_dir, tmp_path):
    compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(**OPTIONS))
    assert len(validations) == 1


def test_keep_auto_validates_its_options_once(validations, tiny_llava_dir, tmp_path):
    """Each candidate K is the plan at that K (Plan.with_keep), never a second validation of every option."""
    result = compile_model(str(tiny_llava_dir), tmp_path / "b",
                           CompileOptions(method="cls", keep="auto", latency_ms=10000.0, layer=1))
    assert len(validations) == 1
    assert result.manifest["keep_auto"]["chosen"] == 63 == result.manifest["method"]["keep"]
    assert len(result.manifest["keep_auto"]["curve"]) > 1 and result.manifest["compile_options"]["latency_ms"] is None


def _loaded_plan(tiny_llava_dir, **given):
    plan = pipeline.validate_options(CompileOptions(**{**OPTIONS, **given}))
    return plan, pipeline.load(str(tiny_llava_dir), plan)


@pytest.mark.parametrize("stage,needle", [
    (lambda plan, loaded: pipeline.fit(plan.with_keep(64), loaded), "--keep must satisfy 1 <= keep < 64"),
    (lambda plan, loaded: pipeline.fit(pipeline.validate_options(CompileOptions(**{**OPTIONS, "layer": 9})), loaded),
     "--layer 9 is out of range: this tower runs 2 blocks"),  # feature layer -2 of 3
    (lambda plan, loaded: pipeline.lower(None, loaded, plan), "lower takes a plan fitted to its source"),
    (lambda plan, loaded: plan.with_keep(0), "--keep must be an integer >= 1, got 0"),
    (lambda plan, loaded: pipeline.parity_batch(1, 4), "this bundle has a static batch of 1; --batch 4"),
], ids=["k-over-the-patches", "layer-past-the-tower", "unfitted-plan", "k-zero", "static-batch"])
def test_a_stage_refuses_a_bad_input_in_one_line(tiny_llava_dir, stage, needle):
    plan, loaded = _loaded_plan(tiny_llava_dir)
    with pytest.raises(InputError, match=needle.replace("(", r"\(")) as caught:
        stage(plan, loaded)
    assert "\n" not in str(caught.value) and str(caught.value)


def test_validation_refuses_before_any_stage(tiny_llava_dir, tmp_path):
    with pytest.raises(InputError, match="--keep auto needs --latency-ms") as caught:
        compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(keep="auto"))
    assert "\n" not in str(caught.value) and not (tmp_path / "b").exists()
