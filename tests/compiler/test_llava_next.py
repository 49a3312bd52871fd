"""LLaVA-NeXT (llava_next): anyres crops of one grid, one global budget over the crops.

A tiny LlavaNextForConditionalGeneration (CLIP tower at 56 px: 4 x 4 = 16 patches per crop;
grids 1x2, 2x1, 2x2) saved offline. The dense bundle equals transformers'
get_image_features (its pooler_output: pack_image_features with image_newline); the pruned
ones equal the crop-budget reference (passes.methods.crops) on ONNX Runtime and in the
graphs the TensorRT targets get; what the family or a target cannot serve is one line.

"Batch" for a crops input: one bundle call is one image (its C crops); the reference and
the budget split are batched over images, and tested at 1 and 3 images.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.images import parity_crops
from vlmprune.compiler.pipeline import CompileOptions, check_bundle, compile_model
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.methods.crops import emit_split, equal_budgets, split_budget
from vlmprune.targets.runtime import ort_session, run_session

N, SIDE, CROPS = 16, 4, 5


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(11)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=56, patch_size=14)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=128)
    config = LlavaNextConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                             vision_feature_select_strategy="default", image_token_index=100,
                             image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]])
    path = tmp_path_factory.mktemp("tiny_llava_next")
    LlavaNextForConditionalGeneration(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_model(llava_next_dir):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(llava_next_dir, attn_implementation="sdpa").eval()


def _hf_features(model, pixel: np.ndarray, crops: int, resolution) -> torch.Tensor:
    """transformers' own path, one image at a time: get_image_features' pooler_output (pack_image_features)."""
    x = torch.from_numpy(pixel)
    with torch.inference_mode():
        return torch.stack([model.get_image_features(pixel_values=x[i: i + crops],
                                                     image_sizes=torch.tensor([resolution])).pooler_output[0]
                            for i in range(0, len(x), crops)])


@pytest.mark.parametrize("grid", [None, "1x2"])
def test_dense_path_is_hf_get_image_features(llava_next_dir, hf_model, grid):
    source = load_source(str(llava_next_dir))
    if grid:
        source.regrid(grid)
    crops = source.crops
    assert source.family == "llava_next" and crops["grid"] == ([2, 2] if grid is None else [1, 2])
    pixel, _ = parity_crops(2, crops, source.image_size, source.mean, source.std)
    assert pixel.shape == (2 * crops["count"], 3, 56, 56)
    with torch.inference_mode():
        got = source.pipeline(torch.from_numpy(pixel))
    expected = _hf_features(hf_model, pixel, crops["count"], crops["resolution"])
    rows, cols = crops["grid"]
    assert got.shape == (2, N + rows * SIDE * (cols * SIDE + 1), 48)  # base, then grid rows + image_newline
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_dense_bundle_equals_hf(llava_next_dir, hf_model, tmp_path):
    result = compile_model(str(llava_next_dir), tmp_path / "b", CompileOptions(prune=False))
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["inputs"][0]["shape"] == [CROPS, 3, 56, 56]
    pixel, _ = parity_crops(2, load_source(str(llava_next_dir)).crops, 56, result.manifest["preprocess"]["mean"],
                            result.manifest["preprocess"]["std"])
    session = ort_session(tmp_path / "b" / "model.onnx")
    got = np.concatenate([run_session(session, pixel[i: i + CROPS])["image_features"] for i in (0, CROPS)])
    expected = _hf_features(hf_model, pixel, CROPS, [112, 112]).numpy()
    assert np.abs(got - expected).max() < 1e-5  # fp32, ONNX Runtime against transformers


@pytest.mark.parametrize("size", [(112, 112), (60, 112), (111, 97), (70, 101), (101, 70)])
def test_readme_assembly_rule_is_hf_packing(llava_next_dir, hf_model, size):
    """The bundle README's rule (llava_next.assemble_llm_input) with every token kept is transformers'
    pack_image_features, unpadding included, for images of any size that select the 2x2 grid."""
    from vlmprune.compiler.frontend.llava_next import assemble_llm_input

    source = load_source(str(llava_next_dir))
    source.pipeline.pack = False
    x = torch.randn(CROPS, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        tokens = source.pipeline(x).reshape(CROPS * N, -1)
        expected = hf_model.get_image_features(pixel_values=x, image_sizes=torch.tensor([size])).pooler_output[0]
        table = torch.from_numpy(source.position_table)
        got = assemble_llm_input(tokens, table, source.pipeline.image_newline, (2, 2), SIDE, size)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        kept = torch.tensor([0, 5, 17, 18, 40, 79])  # a pruned set: rows with no kept token get no newline
        pruned = assemble_llm_input(tokens[kept], table[kept], source.pipeline.image_newline, (2, 2), SIDE)
    # base 0, 5; grid (Y, X): 17 -> (0, 1), 18 -> (0, 2), 40 -> (2, 4), 79 -> (7, 7): three rows, three newlines
    assert pruned.shape[0] == 6 + 3 and torch.equal(pruned[:2], tokens[[0, 5]])


# ------------------------------------------------------------------------ the budget split


def test_split_budget_rules():
    assert equal_budgets(192, 5, 576) == [39, 39, 38, 38, 38]  # largest remainder, ties to the lower crop
    assert equal_budgets(3, 5, 576) == [1, 1, 1, 0, 0]
    # A crop whose share exceeds N keeps all N; the rest is split over the others.
    assert split_budget(torch.tensor([[100.0, 1, 1, 1, 1]]), 40, 16).tolist() == [[16, 6, 6, 6, 6]]
    assert split_budget(torch.tensor([[1.0, 3.0]]), 10, 16).tolist() == [[3, 7]]  # 2.5 / 7.5: tie to crop 0
    masses = torch.rand(64, 5, generator=torch.Generator().manual_seed(0)) * 10
    for keep in (1, 7, 40, 79):
        budgets = split_budget(masses, keep, 16)
        assert (budgets.sum(-1) == keep).all() and (budgets >= 0).all() and (budgets <= 16).all()
        share = keep * masses / masses.sum(-1, keepdim=True)
        uncapped = (share <= 16).all(-1)
        assert ((budgets - share).abs() < 1)[uncapped].all()  # within one of the exact share


@pytest.mark.parametrize("batch", [1, 3])
def test_split_graph_equals_reference(batch, tmp_path):
    mass = ir.Value(name="mass", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch, CROPS]))
    graph = ir.Graph([mass], [], nodes=[], name="split", opset_imports={"": 18})
    b = Builder(graph, 18, "split")
    out = emit_split(b, mass, 40, CROPS, N)
    graph.extend(b.nodes)
    out.name = "budgets"
    out.type, out.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([batch, CROPS])
    graph.outputs.append(out)
    path = tmp_path / "split.onnx"
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    ir.save(model, path)
    onnx.checker.check_model(onnx.load(path), full_check=True)
    session = ort_session(path)
    rng = np.random.default_rng(batch)
    for masses in (rng.random((batch, CROPS)) * 8, np.full((batch, CROPS), 2.0), rng.random((batch, CROPS)) ** 8):
        masses = masses.astype(np.float32)
        got = session.run(None, {"mass": masses})[0]
        assert np.array_equal(got, split_budget(torch.from_numpy(masses), 40, N).numpy())


# ------------------------------------------------------------------------ pruned bundles


def _options(**kwargs) -> CompileOptions:
    """CompileOptions with this family's options (--grid, --crop-budget) in family_options, as the CLI passes them."""
    family = {k: kwargs.pop(k) for k in ("grid", "crop_budget") if k in kwargs}
    return CompileOptions(**kwargs, family_options=family)


def _compile(path, out, **kwargs):
    result = compile_model(str(path), out, _options(**{"keep": 30, **kwargs}))
    assert result.report.passed, result.manifest["parity"]
    return result


@pytest.mark.parametrize("method,target,budget", [("cls", "orin", "equal"), ("divprune", "ort", None),
                                                  ("divprune", "xavier", None), ("dart", "ort", None)])
def test_pruned_bundles_match_the_reference(llava_next_dir, tmp_path, method, target, budget):
    result = _compile(llava_next_dir, tmp_path / "b", method=method, target=target, crop_budget=budget)
    m = result.manifest
    shapes = {o["name"]: o["shape"] for o in m["outputs"]}
    summary = 1 if method == "cls" else 0
    assert shapes == {"image_features": [1, 30 + summary, 48], "kept_indices": [1, 30], "kept_positions": [1, 30, 3]}
    assert m["method"]["params"]["crops"] == {"grid": [2, 2], "count": 5, "side": 4,
                                              "budget": budget or ("proportional" if method == "cls" else "equal"),
                                              "noun": "crops", "order": "base + 2x2 grid"}
    stages = {s.stage: s for s in result.report.stages}
    assert stages["rewritten"].indices["agreement"] == 1.0
    assert stages["rewritten"].outputs["kept_positions"]["passed"]
    assert m["model"]["family"] == "llava_next" and m["model"]["crops"] == 5 and m["model"]["positions"] == "cyx"
    if target == "ort":
        assert list(stages)[-1] == "fused" and m["target"]["fused"] is (method == "divprune")
    onnx.checker.check_model(str(tmp_path / "b" / "model.decomposed.onnx"))


def test_kept_positions_and_budgets(llava_next_dir, tmp_path):
    """(crop, row, col) of each kept token, in crop-then-raster order; proportional budgets follow the masses."""
    from vlmprune.compiler.parity.reference import pruner_for
    from vlmprune.passes.prune import prune_record

    result = _compile(llava_next_dir, tmp_path / "b", keep=47)
    source = load_source(str(llava_next_dir))
    pixel, _ = parity_crops(3, source.crops, 56, source.mean, source.std)
    session = ort_session(tmp_path / "b" / "model.onnx")
    outs = [run_session(session, pixel[i: i + CROPS]) for i in range(0, 3 * CROPS, CROPS)]
    for out in outs:
        kept, pos = out["kept_indices"][0], out["kept_positions"][0]
        assert np.array_equal(kept, np.sort(kept)) and len(set(kept)) == 47
        assert np.array_equal(pos[:, 0] * N + pos[:, 1] * SIDE + pos[:, 2], kept)
        assert (pos[:, 1:] < SIDE).all() and (pos[:, 0] < CROPS).all()
    # The reference at 3 images in one batch equals it image by image, and the graph (one image per call).
    record = prune_record(ir.load(tmp_path / "b" / "model.decomposed.onnx"))
    pipeline = source.pipeline.with_pruner(pruner_for(record))
    pipeline.pack = False
    with torch.inference_mode():
        feats, kept = pipeline(torch.from_numpy(pixel))
        budgets = pipeline.last_trace["budgets"]
        for i in range(3):
            one, kept_one = pipeline(torch.from_numpy(pixel[i * CROPS: (i + 1) * CROPS]))
            assert torch.equal(kept_one[0], kept[i]) and torch.allclose(one[0], feats[i], atol=1e-6)
            assert np.array_equal(outs[i]["kept_indices"][0], kept[i].numpy())
            assert np.abs(outs[i]["image_features"][0] - feats[i].numpy()).max() < 1e-4
            # Each crop keeps its budget; the budgets follow each image's crop masses (not one fixed split).
            assert np.array_equal(np.bincount(outs[i]["kept_positions"][0][:, 0], minlength=CROPS), budgets[i].numpy())
    assert (budgets.sum(-1) == 47).all() and len({tuple(b) for b in budgets.tolist()}) == 3
    assert list(s.stage for s in result.report.stages) == ["export", "rewritten", "fused"]
    readme = (tmp_path / "b" / "README.md").read_text()
    assert "image_newline" in readme and "kept_positions` [1, 47, 3]" in readme and "proportional" in readme


@pytest.mark.parametrize("method,budget", [("cls", "equal"), ("divprune", "equal"), ("dart", "equal")])
def test_reference_at_batch_3_is_image_by_image(llava_next_dir, method, budget):
    """The crop-budget reference, batched over 3 images, equals it run one image at a time."""
    from vlmprune.compiler.parity.reference import MethodPruner
    from vlmprune.passes.methods import get_method
    from vlmprune.passes.methods.crops import CropBudget, crop_params

    source = load_source(str(llava_next_dir))
    inner = get_method(method)
    params = crop_params(inner.parse(30, {}), source.crops, budget)
    site = inner.needs(params).site
    pipeline = source.pipeline.with_pruner(MethodPruner(CropBudget(inner), params, site, 2 if site == "block" else None))
    pipeline.pack = False
    pixel = torch.from_numpy(parity_crops(3, source.crops, 56, source.mean, source.std)[0])
    with torch.inference_mode():
        feats, kept = pipeline(pixel)
        assert feats.shape == (3, 30 + (method == "cls"), 48)  # cls: + its summary token
        for i in range(3):
            one, kept_one = pipeline(pixel[i * CROPS: (i + 1) * CROPS])
            assert torch.equal(kept_one[0], kept[i]) and torch.allclose(one[0], feats[i], atol=1e-6)
            assert np.bincount(kept[i].numpy() // N, minlength=CROPS).tolist() == equal_budgets(30, CROPS, N)


def test_grid_option_and_check_reload_it(llava_next_dir, tmp_path):
    result = _compile(llava_next_dir, tmp_path / "b", grid="1x2", keep=20)
    m = result.manifest
    assert m["inputs"][0]["shape"] == [3, 3, 56, 56] and m["model"]["grid"] == "1x2"
    assert m["compile_options"]["family_options"] == {"grid": "1x2"} and m["model"]["family"] == "llava_next"
    assert check_bundle(tmp_path / "b").passed  # check reloads the source with the bundle's grid
    from click.testing import CliRunner
    from PIL import Image
    from skimage import data

    from vlmprune.compiler.cli import main

    Image.fromarray(data.astronaut()[:300]).save(tmp_path / "wide.png")  # padded by the processor, as a user's
    run = CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--image", str(tmp_path / "wide.png")])
    assert run.exit_code == 0, run.output
    assert "1x2 grid" in run.output and "(3 crops)" in run.output and "kept_positions: shape [1, 20, 3]" in run.output


# ------------------------------------------------------------------------ refusals, one line each


@pytest.mark.parametrize("options,message", [
    (dict(method="visionzip"), "method visionzip is not available for anyres crops"),
    (dict(method="random"), "method random is a baseline of one fixed patch set per image; anyres crops"),
    (dict(method="divprune", crop_budget="proportional"), "no per-patch score to split the budget"),
    (dict(layer=1), "anyres crops are pruned at the tower's end"),
    (dict(grid="3x3"), "this model's grids are 1x2, 2x1, 2x2"),
    (dict(grid="two"), "--grid is ROWSxCOLS"),
    (dict(crop_budget="mass"), "--crop-budget is proportional or equal"),
    (dict(batch=2), "--batch does not apply to anyres models"),
    (dict(cls="keep"), "--cls keep is not available for anyres crops"),
    (dict(keep=80), "--keep must satisfy 1 <= keep < 80"),
    (dict(method="cls", target="rk3588"), "target rk3588 cannot run an anyres model: its input is the 5 "
                                                        "crops of one image as a batch of 5, and rk3588 runs batch 1"),
    (dict(method="divprune", target="qnn"), "target qnn cannot run an anyres model: its input is the 5 crops"),
    (dict(prune=False, target="rk3588"), "target rk3588 cannot run an anyres model"),
])
def test_refusals(llava_next_dir, tmp_path, options, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        compile_model(str(llava_next_dir), tmp_path / "b", _options(**options))
    assert not (tmp_path / "b").exists()


def test_grid_on_another_family_is_refused(tiny_clip_dir, tmp_path):
    with pytest.raises(InputError, match="--grid applies to anyres models"):
        compile_model(str(tiny_clip_dir), tmp_path / "b", CompileOptions(family_options={"grid": "2x2"}))


def test_cli_refusal_is_one_line(llava_next_dir, tmp_path):
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    result = CliRunner().invoke(main, ["compile", str(llava_next_dir), "--crop-budget", "mass", "-o",
                                       str(tmp_path / "b")])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "error: --crop-budget" in result.output


def test_with_llm_exports_llava_next_language_model(llava_next_dir, tmp_path):
    """--with-llm takes a LLaVA-NeXT checkpoint's language model (dense: the assembled count varies with K's rows)."""
    import json

    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["compile", str(llava_next_dir), "--target", "ort", "--keep", "30",
                                       "--with-llm", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    graphs = json.loads((out / "manifest.json").read_text())["llm_graphs"]
    assert graphs["family"] == "llama" and graphs["parity"]["passed"] and graphs["fastv"] is None
    # The summary counts the image's tokens over all its crops (the manifest's num_patches is per crop).
    assert result.stdout.splitlines()[0] == ("tokens: 80 patch tokens (5 crops x 16) -> [CLS] attention: top 30 + 1 "
                                             "summary, over 5 crops (base + 2x2 grid; proportional budget) (at the tower's end, "
                                             "after block 2/2)")
