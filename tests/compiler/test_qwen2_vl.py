"""Qwen2-VL and Qwen2.5-VL through their adapter: the dense path equals transformers' get_image_features on
the processor's own patches, the kept tokens' (t, h, w) equal get_rope_index's, divprune and dart compile with
parity (ort, orin, xavier; batch 1 and 3), and what the family cannot serve is refused in one line.

Tiny offline checkpoints saved by transformers (full ...ForConditionalGeneration directories): Qwen2-VL with 2
blocks, Qwen2.5-VL with 3 (block 2 full attention, blocks 1 and 3 in 56-px windows). At 112 px: 8x8 patches,
16 merged tokens, four equal windows; at 140 px: 10x10 patches, 25 tokens, windows of 16, 8, 8 and 4 patches
(masked attention).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from tiny_models import edited_copy, tiny_qwen
from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.pipeline import CompileOptions, check_bundle, compile_model
from vlmprune.compiler.parity.reference import torch_reference
from vlmprune.targets import qnn_tools
from vlmprune.targets.runtime import ort_session, run_session

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
IMAGE, VIDEO, START, END = 120, 121, 122, 123  # the tiny vocabulary's special tokens


def _save(factory, family: str, seed: int):
    return tiny_qwen(factory.mktemp(f"tiny_{family}"), family, seed)


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    return {family: _save(tmp_path_factory, family, seed) for seed, family in enumerate(FAMILIES, start=10)}


@pytest.fixture(scope="module")
def hf_models(qwen_dirs):
    from transformers import AutoModelForImageTextToText

    return {family: AutoModelForImageTextToText.from_pretrained(path).eval() for family, path in qwen_dirs.items()}


def _hf_features(model, pixel: torch.Tensor) -> torch.Tensor:
    """transformers' own image-feature path on the patches its image processor makes of each image."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False)
    inputs = processor(images=list(pixel.numpy()), return_tensors="pt", input_data_format="channels_first")
    with torch.inference_mode():
        per_image = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                   image_grid_thw=inputs["image_grid_thw"]).pooler_output
    return torch.stack(list(per_image))


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [112, 140])
def test_dense_path_is_hf_get_image_features(qwen_dirs, hf_models, family, size):
    source = load_source(str(qwen_dirs[family]), image_size=size)
    side = size // 28
    assert source.family == "qwen2_vl" and source.num_patches == side * side and not source.has_cls
    assert source.details["token_counts"]["patches"] == (size // 14) ** 2
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, side * side, 48)
        _assert_close(got, _hf_features(hf_models[family], x))


def test_window_attention_is_what_makes_it_equal(qwen_dirs, hf_models):
    """The same tower with every block attending over the whole image is not Qwen2.5-VL: the comparison can fail."""
    for size in (112, 140):
        source = load_source(str(qwen_dirs["qwen2_5_vl"]), image_size=size)
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3))
        expected = _hf_features(hf_models["qwen2_5_vl"], x)
        source.pipeline.grid.full_blocks = set(range(source.pipeline.num_blocks))
        with torch.inference_mode():
            wrong = source.pipeline(x)
        assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


def _rope_positions(model, source, offset: int) -> np.ndarray:
    """The mRoPE (t, h, w) that get_rope_index gives the image tokens of `offset` text tokens + one image."""
    tokens = source.num_patches
    side = source.image_size // source.patch_size
    input_ids = torch.tensor([[5] * (offset - 1) + [START] + [IMAGE] * tokens + [END, 6, 7]])
    types = (input_ids == IMAGE).int()
    position_ids, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=torch.tensor([[1, side, side]]))
    return position_ids[:, 0, offset: offset + tokens].T.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_are_hf_rope_index(qwen_dirs, hf_models, family):
    source = load_source(str(qwen_dirs[family]), image_size=140)
    assert source.positions == "thw"
    offset = 4
    np.testing.assert_array_equal(source.position_table + offset, _rope_positions(hf_models[family], source, offset))


def _run(path, pixel, libraries=()):
    return run_session(ort_session(path, libraries), pixel)


@pytest.fixture(scope="module")
def divprune_bundle(qwen_dirs, tmp_path_factory):
    """Qwen2.5-VL at 140 px (unequal, masked windows) with divprune for ort, dynamic batch."""
    out = tmp_path_factory.mktemp("qwen_bundles") / "divprune"
    return compile_model(str(qwen_dirs["qwen2_5_vl"]), out, CompileOptions(method="divprune", keep=8,
                                                                           family_options={"image_size": 140}))


def test_divprune_on_ort_batch_1_and_3_with_hf_positions(divprune_bundle, qwen_dirs, hf_models):
    result = divprune_bundle
    assert result.report.passed, result.manifest["parity"]
    manifest = result.manifest
    outputs = {o["name"]: o for o in manifest["outputs"]}
    assert list(outputs) == ["image_features", "kept_indices", "kept_positions"]
    assert outputs["kept_positions"]["shape"] == ["batch", 8, 3] and outputs["kept_positions"]["dtype"] == "int64"
    assert manifest["model"]["positions"] == "thw" and manifest["model"]["token_counts"]["merged_grid_thw"] == [1, 5, 5]
    assert manifest["compile_options"]["family_options"] == {"image_size": 140}
    assert manifest["method"]["num_patches"] == 25
    assert [s.stage for s in result.report.stages] == ["export", "rewritten", "fused"]
    source = load_source(str(qwen_dirs["qwen2_5_vl"]), image_size=140)
    record = manifest.record
    assert record.method == "divprune"
    offset = 4
    hf_positions = _rope_positions(hf_models["qwen2_5_vl"], source, offset)
    for graph in ("model.decomposed.onnx", "model.onnx"):
        onnx.checker.check_model(str(result.bundle / graph), full_check=True)
        for batch in (1, 3):
            pixel, _ = parity_inputs(batch, 140, source.mean, source.std)
            _, expected = torch_reference(source, record, pixel)
            got = _run(result.bundle / graph, pixel, (result.bundle / manifest["target"]["custom_op_library"],))
            np.testing.assert_array_equal(got["kept_indices"], expected.outputs["kept_indices"])
            np.testing.assert_allclose(got["image_features"], expected.outputs["image_features"], rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(got["kept_positions"], expected.outputs["kept_positions"])
            # What the LLM needs: each kept token's original mRoPE position, as transformers computes it.
            np.testing.assert_array_equal(got["kept_positions"] + offset, hf_positions[got["kept_indices"]])
    # `vlmprune check` reloads the model at the bundle's --image-size (compile_options) and passes again.
    assert check_bundle(result.bundle, batch=3).passed


@pytest.mark.parametrize("family, target, method, batch", [("qwen2_vl", "orin", "dart", 3),
                                                           ("qwen2_5_vl", "xavier", "dart", 1)])
def test_tensorrt_targets(qwen_dirs, tmp_path, family, target, method, batch):
    result = compile_model(str(qwen_dirs[family]), tmp_path / "b",
                           CompileOptions(target=target, method=method, keep=6, batch=batch,
                                          family_options={"image_size": 112},
                                          method_options={"pivots": 2}))
    assert result.report.passed, result.manifest["parity"]
    for stage in result.report.stages[1:]:  # after the dense export stage
        assert len(stage.indices["per_image"]) == (3 if batch == 3 else 2)
    outputs = {o["name"]: o["shape"] for o in result.manifest["outputs"]}
    assert outputs["kept_positions"] == [batch, 6, 3]
    stages = json.loads((result.bundle / "parity.json").read_text())["stages"]
    positions = [s["outputs"]["kept_positions"] for s in stages if "kept_positions" in s["outputs"]]
    assert positions and all(p["exact"] and p["passed"] and p["rows_wrong"] == 0 for p in positions)


@pytest.mark.parametrize("target", ["qnn", "rk3588"])
def test_qnn_and_rk3588(request, qwen_dirs, tmp_path, target):
    """The whole Qwen2.5-VL graph on the HTP emulator (nothing on the CPU) and the RKNN simulator (fp16)."""
    if target == "rk3588":
        request.getfixturevalue("rknn_ready")
    elif not qnn_tools.available()[0]:
        pytest.skip(f"QNN toolchain unavailable: {qnn_tools.available()[1]}")
    result = compile_model(str(qwen_dirs["qwen2_5_vl"]), tmp_path / "b",
                           CompileOptions(target=target, method="dart", keep=6, batch=1,
                                          family_options={"image_size": 112},
                                          method_options={"pivots": 2}))
    assert result.report.passed, result.manifest["parity"]
    stages = json.loads((result.bundle / "parity.json").read_text())["stages"]
    assert len(stages) >= 3 and all("kept_positions" in s["outputs"] for s in stages[1:])
    if target == "qnn":
        assert all(not v["cpu_ops"] for v in result.manifest["target"]["placement_summary"].values())


@pytest.mark.parametrize("method", ["cls", "visionzip"])
def test_methods_that_need_cls_are_refused(qwen_dirs, tmp_path, method):
    with pytest.raises(InputError, match=f"method {method} needs a \\[CLS\\] token"):
        compile_model(str(qwen_dirs["qwen2_vl"]), tmp_path / "b", CompileOptions(method=method, keep=8))
    assert not (tmp_path / "b").exists()


def test_cls_on_qwen_points_to_score_attention(qwen_dirs, tmp_path):
    result = CliRunner().invoke(main, ["compile", str(qwen_dirs["qwen2_5_vl"]), "-m", "cls", "--keep", "8",
                                       "--image-size", "112", "-q", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        "error: method cls needs a [CLS] token, and this tower's merged tokens have none: use --score attention "
        "(the attention each merged token receives), or divprune or dart"]


def test_a_family_option_names_the_model_type_not_the_family(qwen_dirs, tmp_path):
    """Qwen2.5-VL is loaded by the qwen2_vl family's adapter; the user's checkpoint says qwen2_5_vl."""
    result = CliRunner().invoke(main, ["compile", str(qwen_dirs["qwen2_5_vl"]), "-m", "divprune", "--keep", "8",
                                       "--grid", "2x2", "-q", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == ["error: --grid applies to anyres models (llava_next), not to this "
                                          "qwen2_5_vl model"]


def test_generate_names_the_model_type_of_a_wrong_checkpoint(demo_bundle, qwen_dirs, tmp_path):
    from PIL import Image

    image = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(image)
    result = CliRunner().invoke(main, ["generate", str(demo_bundle.bundle), "--image", str(image), "--prompt", "hi",
                                       "--model", str(qwen_dirs["qwen2_5_vl"])])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (f"error: {qwen_dirs['qwen2_5_vl']} is not the model this bundle was "
                                              "compiled from (demo): it is a qwen2_5_vl checkpoint, the bundle's "
                                              "model a llava one")


def test_mrope_section_that_does_not_fill_the_heads_is_refused_before_any_work(qwen_dirs, tmp_path):
    """Hugging Face's own forward fails on it; under --with-llm it surfaced as torch.onnx's preamble after the
    tower's export. The tiny LLM's heads are 24 wide: its sections must sum to 12."""
    copy = edited_copy(qwen_dirs["qwen2_5_vl"], tmp_path / "q",
                       lambda config: config["text_config"]["rope_parameters"].update(mrope_section=[4, 4, 6]))
    result = CliRunner().invoke(main, ["compile", str(copy), "-m", "divprune", "--keep", "8", "--image-size", "112",
                                       "--with-llm", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert lines[-1] == (f"error: {copy}: mrope_section [4, 4, 6] must sum to 12 (half the language model's "
                         "head_dim 24); the checkpoint and config disagree")
    assert not [line for line in lines if "export" in line], result.output  # refused on loading, before exporting
    assert not (tmp_path / "b").exists()


def test_score_attention_on_an_onnx_tower_is_refused_before_the_passes(qwen_dirs, tmp_path):
    """An .onnx Qwen tower (a dense bundle's graph) has no torch tower to hand over the score block's Q and K:
    refused on loading, not at parity after the passes and the target's emission."""
    dense = compile_model(str(qwen_dirs["qwen2_5_vl"]), tmp_path / "dense",
                          CompileOptions(prune=False, family_options={"image_size": 112})).bundle
    result = CliRunner().invoke(main, ["compile", str(dense / "model.decomposed.onnx"), "-m", "cls", "--score",
                                       "attention", "--keep", "8", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert lines[-1] == ("error: method cls with --score attention needs a Qwen2-VL / Qwen2.5-VL directory: the score "
                         "block's Q and K come from its torch tower, which an .onnx tower does not have (divprune and "
                         "dart serve .onnx towers)")
    assert not [line for line in lines if "passes:" in line], result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, message", [
    (["--image-size", "100"], "--image-size must be a multiple of 28"),
    (["--image-size", "0"], "--image-size must be >= 1"),
    (["--feature-layer", "1"], "--feature-layer does not apply to qwen2_vl"),
    (["--keep", "16"], "--keep must satisfy 1 <= keep < 16"),  # 112 px: 16 merged tokens
    (["--image-size", "112", "--method", "divprune", "--layer", "1"], "--layer does not apply"),
    (["--target", "rk3588", "--batch", "1", "--precision", "int8"], "rk3588 --precision int8 with dart"),
])
def test_bad_options_are_one_line(qwen_dirs, tmp_path, args, message):
    argv = ["compile", str(qwen_dirs["qwen2_vl"]), "-q", "--method", "dart", "--keep", "4",
            "-o", str(tmp_path / "b")]
    if "--image-size" not in args:
        argv += ["--image-size", "112"]
    result = CliRunner().invoke(main, argv + args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not (tmp_path / "b").exists()


def test_image_size_is_refused_by_fixed_size_sources(tiny_clip_dir):
    with pytest.raises(InputError, match="--image-size applies to Hugging Face directories of a dynamic-resolution"):
        load_source(str(tiny_clip_dir), image_size=112)
    with pytest.raises(InputError, match="preset demo has a fixed image size"):
        load_source("demo", image_size=336)


def test_vision_weights_only_and_shapes_checked(qwen_dirs, tmp_path):
    copy = edited_copy(qwen_dirs["qwen2_5_vl"], tmp_path / "q",
                       lambda config: config["vision_config"].update(intermediate_size=40))
    with pytest.raises(InputError, match="the checkpoint and config disagree"):
        load_source(str(copy))


# ---------------------------------------------------------------------------- cls --score attention
# (passes.methods.received: the attention each merged token receives at the last full-attention block)


def _hf_received(model, pixel: torch.Tensor, block: int) -> torch.Tensor:
    """[B, M]: from transformers' own eager attention weights of `block` (one call per image), mean over heads and
    queries, mean over each merger group, put into raster order with transformers' own reverse window index."""
    import importlib

    from transformers import Qwen2VLImageProcessorPil
    from transformers.vision_utils import get_vision_window_index

    visual = model.model.visual
    modeling = importlib.import_module(type(visual).__module__)
    captured, original = [], modeling.eager_attention_forward

    def recording(module, *args, **kwargs):
        out, weights = original(module, *args, **kwargs)
        if module is visual.blocks[block].attn:
            captured.append(weights.detach())
        return out, weights

    processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False)
    inputs = processor(images=list(pixel.numpy()), return_tensors="pt", input_data_format="channels_first")
    implementation = visual.config._attn_implementation
    modeling.eager_attention_forward, visual.config._attn_implementation = recording, "eager"
    try:
        with torch.inference_mode():
            model.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    finally:
        modeling.eager_attention_forward, visual.config._attn_implementation = original, implementation
    assert len(captured) == pixel.shape[0]  # full attention: one chunk per image
    unit = visual.config.spatial_merge_size ** 2
    scores = []
    for weights, grid in zip(captured, inputs["image_grid_thw"]):
        received = weights.mean(dim=(0, 1, 2))  # [N]: heads, queries
        merged = received.reshape(-1, unit).mean(dim=-1)
        if hasattr(visual, "fullatt_block_indexes"):  # Qwen2.5-VL: back from window order
            window_index, _ = get_vision_window_index(grid[None], visual.spatial_merge_size, visual.window_size,
                                                      visual.patch_size)
            merged = merged[torch.argsort(window_index)]
        scores.append(merged)
    return torch.stack(scores)


@pytest.mark.parametrize("family, size, block", [("qwen2_vl", 112, 1), ("qwen2_5_vl", 112, 1), ("qwen2_5_vl", 140, 1)])
def test_received_attention_is_hf_attention_weights(qwen_dirs, hf_models, family, size, block):
    from vlmprune.compiler.contract import PruneRecord
    from vlmprune.compiler.parity.reference import pruner_for

    source = load_source(str(qwen_dirs[family]), image_size=size)
    assert source.pipeline.score_block() == block  # Qwen2-VL: its last block; Qwen2.5-VL: fullatt_block_indexes[-1]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(7))
    expected = _hf_received(hf_models[family], x, block)
    expected = expected / expected.amax(dim=-1, keepdim=True)
    record = PruneRecord("cls", {"keep": 5, "lambda": 0.0, "score": "attention"}, "features", None)
    pipeline = source.pipeline.with_pruner(pruner_for(record))
    with torch.inference_mode():
        tokens, kept = pipeline(x)
    torch.testing.assert_close(pipeline.last_trace["scores"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kept.numpy(), np.sort(np.argsort(-expected.numpy(), kind="stable")[:, :5], axis=1))
    assert tokens.shape == (2, 6, 48)
    # The wrong block (a window block of Qwen2.5-VL, or Qwen2-VL's first) gives other numbers: the check can fail.
    other = _hf_received(hf_models[family], x, 0) if family == "qwen2_vl" else None
    if other is not None:
        assert (other / other.amax(dim=-1, keepdim=True) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family, size, keep", [("qwen2_vl", 112, 6), ("qwen2_5_vl", 140, 6),
                                               ("qwen2_5_vl", 56, 2)])  # 56 px: one window, the whole image
def test_cls_score_attention_on_ort_batch_1_and_3(qwen_dirs, hf_models, tmp_path, family, size, keep):
    result = compile_model(str(qwen_dirs[family]), tmp_path / "b",
                           CompileOptions(method="cls", keep=keep, family_options={"image_size": size},
                                          method_options={"score": "attention"}))
    assert result.report.passed, result.manifest["parity"]
    assert [s.stage for s in result.report.stages] == ["export", "rewritten", "fused"]
    manifest = result.manifest
    assert manifest["method"]["params"]["score"] == "attention" and manifest["method"]["site"] == "features"
    outputs = {o["name"]: o["shape"] for o in manifest["outputs"]}
    assert outputs["image_features"] == ["batch", keep + 1, 48] and outputs["kept_positions"] == ["batch", keep, 3]
    graph = onnx.load(str(result.bundle / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "TokenPrune" for n in graph.node)  # declined: no [CLS] to copy
    source = load_source(str(qwen_dirs[family]), image_size=size)
    block = source.pipeline.score_block()
    assert block == (2 if size == 56 else 1)  # a single window is the whole image: the last block spans it too
    record = manifest.record
    assert record.method == "cls"
    offset = 4
    hf_positions = _rope_positions(hf_models[family], source, offset)
    for batch in (1, 3):
        pixel, _ = parity_inputs(batch, size, source.mean, source.std)
        _, expected = torch_reference(source, record, pixel)
        got = _run(result.bundle / "model.onnx", pixel)
        np.testing.assert_array_equal(got["kept_indices"], expected.outputs["kept_indices"])
        np.testing.assert_allclose(got["image_features"], expected.outputs["image_features"], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got["kept_positions"], expected.outputs["kept_positions"])
        np.testing.assert_array_equal(got["kept_positions"] + offset, hf_positions[got["kept_indices"]])
        # Its own selection: the top K of the HF-computed received attention, in raster order.
        hf = _hf_received(hf_models[family], torch.from_numpy(pixel), block).numpy()
        np.testing.assert_array_equal(got["kept_indices"], np.sort(np.argsort(-hf, kind="stable")[:, :keep], axis=1))


@pytest.mark.parametrize("options, message", [
    ({"score": "attention", "lambda": 0.5}, "--lambda of method cls must be 0 with --score attention"),
    ({"score": "attn"}, "--score of method cls is one of cls, probe, attention"),
])
def test_cls_score_attention_bad_options(qwen_dirs, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        compile_model(str(qwen_dirs["qwen2_vl"]), tmp_path / "b",
                      CompileOptions(method="cls", keep=6, family_options={"image_size": 112}, method_options=options))
    assert not (tmp_path / "b").exists()


def test_score_attention_is_refused_on_clip_and_by_visionzip(tiny_clip_dir, qwen_dirs, tmp_path):
    with pytest.raises(InputError, match="cls with --score attention needs a tower whose merged tokens"):
        compile_model(str(tiny_clip_dir), tmp_path / "b", CompileOptions(method="cls", keep=6,
                                                                         method_options={"score": "attention"}))
    with pytest.raises(InputError, match="--score of method visionzip is one of cls, probe, got 'attention'"):
        compile_model(str(qwen_dirs["qwen2_vl"]), tmp_path / "c", CompileOptions(method="visionzip", keep=6,
                                                                                 family_options={"image_size": 112},
                                                                                 method_options={"score": "attention"}))
    result = CliRunner().invoke(main, ["methods"])
    assert result.exit_code == 0 and "Qwen2-VL / Qwen2.5-VL, Qwen3-VL merged tokens, with --score attention" in result.output
    assert "or attention (the attention each merged token receives" in result.output
