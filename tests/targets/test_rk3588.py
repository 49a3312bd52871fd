"""Target rk3588 end to end: `demo` -> legalized ONNX -> .rknn (fp16, hybrid int8) -> simulator parity.

No mocks: rknn-toolkit2 2.5.0 runs in its own venv, created on first use (~45 s, ~600 MB on
a fresh 2-core machine; VLMPRUNE_RKNN_CREATE=0 skips instead). Two compiles of `demo`: a
static batch of 1 pruning early (after block 2, lambda 0.3), and the default dynamic batch,
whose parity runs two real images through the batch-1 artifacts one at a time.
"""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import VlmpruneError
from vlmprune.compiler.pipeline import CompileOptions, check_bundle, compile_model


@pytest.fixture(scope="module")
def early(rknn_ready, tmp_path_factory):
    out = tmp_path_factory.mktemp("rk3588") / "demo_l2"
    return compile_model("demo", out, CompileOptions(target="rk3588", keep=192, layer=2, method_options={"lambda": 0.3}, batch=1))


@pytest.fixture(scope="module")
def dynamic(rknn_ready, tmp_path_factory):
    out = tmp_path_factory.mktemp("rk3588") / "demo_dyn"
    return compile_model("demo", out, CompileOptions(target="rk3588", keep=192))


def test_bundle_holds_the_rknn_files_and_the_legalized_graph(early):
    files = set(early.manifest["files"])
    assert {"model.rknn", "model.hybrid.rknn", "model.onnx", "model.decomposed.onnx", "weights.bin", "README.md",
            "parity.json"} <= files
    for name in ("model.rknn", "model.hybrid.rknn"):
        assert (early.bundle / name).stat().st_size > 100_000
    graph = onnx.load(str(early.bundle / "model.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert not ops & {"GatherND", "CastLike", "ScatterElements", "Shape"}
    assert {"Equal", "TopK"} <= ops  # the one-hot selection, chosen by measurement
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*graph.input, *graph.output]]
    assert all(d and d[0] == 1 for d in dims)


def test_manifest_records_every_op_placement(early):
    target = early.manifest["target"]
    assert set(target["placement"]) == {"fp16", "int8"}
    for precision, rows in target["placement"].items():
        assert rows and all(r["device"] in ("NPU", "CPU") for r in rows)
        devices = {r["type"]: r["device"] for r in rows}
        assert devices["TopK"] == "CPU" and "NPU" in devices.values()
        summary = target["placement_summary"][precision]
        assert summary["ops"] == len(rows) and sum(summary["devices"].values()) == len(rows)
        assert summary["devices"]["NPU"] > 10 * summary["devices"]["CPU"]
    assert target["float16_tensors"] > 0
    assert target["calibration"]["images"][0].startswith("skimage.data.")


def test_parity_per_design(early, dynamic):
    for result, images in ((early, 2), (dynamic, 2)):  # a static batch of 1 is fed two images, one at a time
        stages = {s.stage: s for s in result.report.stages}
        assert result.report.passed, result.manifest["parity"]
        # model.decomposed.onnx is the RKNN-legal graph itself: `rewritten` checks what the toolkit converts.
        assert ["export", "rewritten", "rknn-fp16", "rknn-int8"] == list(stages)
        fp16, int8 = stages["rknn-fp16"], stages["rknn-int8"]
        assert fp16.precision == "fp16" and int8.precision == "int8"
        assert "(simulated)" in fp16.runtime and "(simulated)" in int8.runtime
        assert len(fp16.indices["per_image"]) == images
        # Each image agrees exactly, or differs only inside the K-th boundary's tie band (chelsea after
        # block 2 with lambda 0.3: one of 192 indices, see targets/rk3588.py).
        for i, agreement in enumerate(fp16.indices["per_image"]):
            assert agreement == 1.0 or i in fp16.indices["tie_resolved_images"], fp16.indices
        assert int8.indices["agreement"] >= 0.99
        assert stages["rewritten"].outputs["image_features"]["max_abs"] <= 1e-5


def test_readme_has_the_board_commands(early):
    readme = (early.bundle / "README.md").read_text()
    assert "rknn-toolkit-lite2" in readme and "RKNNLite" in readme and "librknnrt" in readme
    assert "model.hybrid.rknn" in readme and "simulated" in readme


def test_inspect_prints_the_placement_table(early):
    result = CliRunner().invoke(main, ["inspect", str(early.bundle)])
    assert result.exit_code == 0, result.output
    assert "placement of fp16" in result.output and "placement of int8" in result.output
    assert "TopK" in result.output and " NPU " in result.output


@pytest.mark.slow
def test_check_rebuilds_from_model_onnx(early):
    report = check_bundle(early.bundle)
    stages = {s.stage: s for s in report.stages}
    assert report.passed
    assert "rebuilt from model.onnx" in stages["rknn-fp16"].runtime
    assert json.loads((early.bundle / "parity.json").read_text())["passed"]


def test_other_static_batches_are_refused_in_one_line(tmp_path):
    with pytest.raises(VlmpruneError, match="runs batch 1") as info:
        compile_model("demo", tmp_path / "b2", CompileOptions(target="rk3588", keep=192, batch=2))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "b2").exists()


def test_precision_option():
    from vlmprune.targets.rk3588 import parse_precisions

    assert parse_precisions(None) == ("fp16", "int8")
    assert parse_precisions("hybrid") == ("int8",)
    with pytest.raises(VlmpruneError, match="rk3588 --precision"):
        parse_precisions("int4")


def test_run_says_where_an_rknn_runs(early, tmp_path):
    image = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (64, 64)).save(image)
    result = CliRunner().invoke(main, ["run", str(early.bundle), "--image", str(image)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: the RKNN simulator cannot load a .rknn")


def test_compile_leaves_no_temporary_directories(rknn_ready, tiny_llava_dir, tmp_path, monkeypatch):
    """The compile gets a temporary root of its own (here and in the toolkit's process), so that another
    vlmprune running on the machine cannot make this fail."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    result = compile_model(str(tiny_llava_dir), tmp_path / "b",
                           CompileOptions(target="rk3588", keep=16, target_options={"precision": "fp16"}))
    assert result.report.passed and tempfile.gettempdir() == str(root)
    assert [p.name for p in root.iterdir() if p.name.startswith("vlmprune-")] == []
