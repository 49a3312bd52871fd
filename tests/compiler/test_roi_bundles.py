"""ROI forced keep end to end: `--roi boxes|mask` compiles from the tiny LLaVA with cls, parity at batch 1 and 3
proves every forced patch kept, `run --roi-box / --roi-mask` feeds a region and `--show` hatches it; the targets
that declare no ROI input refuse in one line; the parity ROI and the run flags' bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vlmprune.compiler import api, pictures
from vlmprune.compiler import roi as host
from vlmprune.compiler.bundle import load_manifest
from vlmprune.compiler.cli import main
from vlmprune.compiler.contract import DECOMPOSED, KEPT, ROI_BOXES, ROI_COUNT, ROI_MASK
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets.runtime import ort_session, run_session

KEEP = 16


def _compile(model, out, kind: str, target: str = "ort", batch: int | None = None):
    return compile_model(str(model), out, CompileOptions(target=target, method="cls", keep=KEEP, batch=batch,
                                                         method_options={"lambda": 0.2, "roi": kind}))


@pytest.fixture(scope="module")
def bundles(tiny_llava_dir, tmp_path_factory):
    """kind -> the compile result at batch 1 (dynamic batch), then parity at a static batch of 3 below."""
    root = tmp_path_factory.mktemp("roi")
    return {kind: _compile(tiny_llava_dir, root / kind, kind) for kind in ("boxes", "mask")}


def _forced_stages(result, images: int):
    assert result.report.passed, result.manifest["parity"]
    checked = [s for s in result.report.stages if "roi_forced" in s.outputs]
    assert "rewritten" in {s.stage for s in checked}
    for stage in checked:
        verdict = stage.outputs["roi_forced"]
        assert verdict["passed"] and verdict["rows_compared"] == images
        assert all(0 < f <= KEEP for f in verdict["forced"]), verdict  # something forced, all of it inside K
    return checked


@pytest.mark.parametrize("kind", ["boxes", "mask"])
def test_roi_compiles_with_cls_and_parity_keeps_every_forced_patch(bundles, kind):
    result = bundles[kind]
    assert {s.stage for s in _forced_stages(result, 2)} == {"rewritten", "fused"}  # the fused TokenPrune too
    manifest = result.manifest
    names = [i["name"] for i in manifest["inputs"]]
    layout = manifest["method"]["roi"]
    assert names == ["pixel_values", *layout["inputs"]]
    assert layout == {"kind": kind, "height": 112, "width": 112, "patch": 14, "grid": [8, 8],
                      "inputs": [ROI_MASK] if kind == "mask" else [ROI_BOXES, ROI_COUNT],
                      **({"max_boxes": 4} if kind == "boxes" else {})}
    assert "forced keep" in manifest["method"]["summary"]


@pytest.mark.parametrize("kind", ["boxes", "mask"])
def test_roi_parity_at_batch_3(tiny_llava_dir, tmp_path, kind):
    result = _compile(tiny_llava_dir, tmp_path / "b", kind, batch=3)
    _forced_stages(result, 3)
    assert [i["shape"][0] for i in result.manifest["inputs"]] == [3] * len(result.manifest["inputs"])


@pytest.mark.parametrize("kind", ["boxes", "mask"])
def test_the_graph_forces_what_the_numpy_definition_forces(bundles, kind):
    """Independently of parity: the bundle's own graph on the parity ROI keeps every patch that numpy's forced set
    names, and without the region it keeps a different set that misses some (so the forcing did the keeping)."""
    bundle = bundles[kind].bundle
    layout = load_manifest(bundle)["method"]["roi"]
    pixel = np.random.default_rng(5).standard_normal((6, 3, 112, 112)).astype(np.float32)
    session = ort_session(bundle / DECOMPOSED)
    fed = host.parity_roi_feed(pixel, session.get_inputs())  # what parity feeds the runners
    assert fed.keys() == host.parity_roi(pixel, kind, layout.get("max_boxes")).keys()
    kept = run_session(session, pixel, fed)[KEPT]
    forced = host.forced_numpy(layout, host.parity_roi(pixel, kind, layout.get("max_boxes")))
    assert forced.any(axis=1).all() and host.forced_check(forced, kept)["passed"]
    plain = run_session(session, pixel)[KEPT]  # no ROI feeds: no region
    assert not host.forced_check(forced, plain)["passed"]


def _image(path):
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(path)
    return path


def _bundle(result):
    return result.bundle


def test_run_roi_box_keeps_the_box_and_show_hatches_it(bundles, tmp_path):
    bundle, image = _bundle(bundles["boxes"]), _image(tmp_path / "x.png")
    # patches (row 5, cols 0-1): centres (7, 77) and (21, 77)
    show = tmp_path / "show.png"
    result = api.run(bundle, images=[image], roi_boxes=["0,70,28,84"], show=show)
    assert {40, 41} <= set(result.kept[0].tolist())
    drawn = np.asarray(Image.open(show).convert("RGB"))
    f = pictures.display_scale(112)
    cell_px = 112 * f // 8
    period, half = max(4, cell_px // 3), cell_px // 2  # the hatching: pixels with (y + x) % period small
    for index in (40, 41):  # a pixel of a hatch line in the cell's interior (cells start at multiples of period)
        t, l, _, _ = pictures.cell(index, 8, cell_px)
        assert tuple(drawn[t + half, l + half - (2 * half) % period]) == pictures.HATCH_RGB
    cli = CliRunner().invoke(main, ["run", str(bundle), "--image", str(image), "--roi-box", "0,70,28,84",
                                    "--roi-box", "80,0,112,20", "--json"])
    assert cli.exit_code == 0, cli.output
    assert {40, 41, 6, 7} <= set(json.loads(cli.stdout)[KEPT][0])  # the second box: patches (0, 6) and (0, 7)


def test_run_roi_mask_file(bundles, tmp_path):
    bundle, image = _bundle(bundles["mask"]), _image(tmp_path / "x.png")
    mask = np.zeros((112, 112), np.uint8)
    mask[100, 100] = 255  # one pixel: patch (7, 7)
    Image.fromarray(mask).save(tmp_path / "m.png")
    result = api.run(bundle, images=[image], roi_mask=tmp_path / "m.png")
    assert 63 in result.kept[0].tolist()
    Image.fromarray(mask[:50]).save(tmp_path / "small.png")
    with pytest.raises(InputError, match="must be the tower input's 112x112"):
        api.run(bundle, images=[image], roi_mask=tmp_path / "small.png")


@pytest.mark.parametrize("kind, flags, match", [
    ("boxes", {"roi_boxes": ["1,2,3"]}, "four numbers"),
    ("boxes", {"roi_boxes": ["5,5,2,9"]}, "x0 < x1"),
    ("boxes", {"roi_boxes": ["200,200,300,300"]}, "outside the tower's 112x112 input"),
    ("boxes", {"roi_boxes": ["0,0,1000,100"]}, "reaches past the tower's 112x112 input"),
    ("boxes", {"roi_boxes": ["0,0,9,9"] * 5}, "at most 4 boxes"),
    ("boxes", {"roi_mask": "m.png"}, "give --roi-box, not --roi-mask"),
    ("mask", {"roi_boxes": ["0,0,9,9"]}, "give --roi-mask, not --roi-box"),
])
def test_run_flags_bad_input(bundles, tmp_path, kind, flags, match):
    image = _image(tmp_path / "x.png")
    if "roi_mask" in flags:
        Image.fromarray(np.zeros((112, 112), np.uint8)).save(tmp_path / "m.png")
        flags = {"roi_mask": tmp_path / "m.png"}
    with pytest.raises(InputError, match=match):
        api.run(_bundle(bundles[kind]), images=[image], **flags)


@pytest.mark.parametrize("box", ["0,0,1000,100", "-5,0,20,20", "0,0,20,337"])
def test_a_box_past_the_input_is_refused_naming_the_input_size(box):
    """Clipping it silently would force other patches than asked (0,0,1000,100 on a 336-px input forced 168)."""
    layout = {"kind": "boxes", "max_boxes": 4, "width": 336, "height": 336}
    with pytest.raises(InputError, match="reaches past the tower's 336x336 input") as info:
        host.boxes_from_flags([box], layout)
    assert "\n" not in str(info.value)
    assert host.boxes_from_flags(["0,0,336,336"], layout)[ROI_COUNT].tolist() == [1]  # the whole input is fine


def test_roi_flags_on_a_bundle_without_roi(tiny_llava_dir, tmp_path):
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(method="cls", keep=KEEP))
    with pytest.raises(InputError, match="bundles compiled with --roi"):
        api.run(_bundle(result), images=[_image(tmp_path / "x.png")], roi_boxes=["0,0,9,9"])


@pytest.mark.parametrize("target", ["orin", "xavier", "rk3588"])
def test_targets_without_roi_inputs_refuse_in_one_line(tmp_path, target):
    with pytest.raises(InputError, match=f"target {target} cannot run method cls: --roi adds the ROI inputs") as info:
        compile_model("demo", tmp_path / "b", CompileOptions(target=target, method="cls", keep=KEEP,
                                                            method_options={"roi": "boxes"}))
    assert "\n" not in str(info.value)


def test_methods_that_cannot_keep_forced_patches_refuse_in_one_line(tiny_llava_dir, tmp_path):
    for method in ("divprune", "random"):
        with pytest.raises(InputError, match=f"method {method} cannot take --roi"):
            compile_model(str(tiny_llava_dir), tmp_path / method,
                          CompileOptions(method=method, keep=KEEP, method_options={"roi": "mask"}))


def test_qnn_compiles_roi_boxes_with_static_shapes(tiny_llava_dir, tmp_path, qnn_ready):
    result = _compile(tiny_llava_dir, tmp_path / "q", "boxes", target="qnn")
    checked = _forced_stages(result, 2)
    assert {"qnn-qdq", "qnn-ctx"} <= {s.stage for s in checked}
    assert [i["shape"] for i in result.manifest["inputs"]][1:] == [[1, 4, 4], [1]]


def test_parity_roi_is_seeded_by_each_image_and_padding_is_a_whole_image_box():
    pixel = np.random.default_rng(0).standard_normal((3, 3, 112, 112)).astype(np.float32)
    whole = host.parity_roi(pixel, "boxes", 3)
    alone = host.parity_roi(pixel[1:2], "boxes", 3)
    np.testing.assert_array_equal(whole[ROI_BOXES][1:2], alone[ROI_BOXES])
    assert whole[ROI_COUNT].tolist() == [1, 1, 1]
    assert (whole[ROI_BOXES][:, 1:] == [0, 0, 112, 112]).all()  # ignored only because roi_count says 1
    assert len({tuple(b) for b in whole[ROI_BOXES][:, 0]}) == 3
    mask = host.parity_roi(pixel, "mask")[ROI_MASK]
    assert mask.shape == (3, 112, 112) and (mask.reshape(3, -1).max(axis=1) == 1).all()


def test_an_onnx_tower_takes_roi_with_its_graph_reference(tiny_clip_dir, tmp_path):
    """An .onnx source's reference is its own graph's tensors (compiler.parity.reference.onnx_reference): the forced
    set reaches that reference too."""
    import contextlib
    import io
    import warnings

    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_clip_dir, attn_implementation="eager").eval()
    path = tmp_path / "tower.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 3, 112, 112),), str(path), dynamo=False, opset_version=14,
                          input_names=["pixel_values"])
    result = compile_model(str(path), tmp_path / "b", CompileOptions(method="cls", keep=KEEP, layer=2,
                                                                    method_options={"roi": "boxes"}))
    _forced_stages(result, 2)


def test_check_reruns_the_forced_patch_parity(bundles):
    cli = CliRunner().invoke(main, ["check", str(bundles["mask"].bundle)])
    assert cli.exit_code == 0, cli.output
    stages = json.loads((bundles["mask"].bundle / "parity.json").read_text())["stages"]
    assert all(s["outputs"]["roi_forced"]["passed"] for s in stages if s["stage"] != "export")


def test_roi_with_local_merge(tiny_llava_dir, tmp_path):
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        method="cls", keep=KEEP, method_options={"roi": "boxes", "merge": "local"}))
    _forced_stages(result, 2)
