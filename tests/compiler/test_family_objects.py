"""The family seam (compiler.frontend.family): each family declares its options and capabilities and answers
the pipeline's questions, so that the pipeline, the targets' contract and the CLI never test a family.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from cli_helpers import one_line_error, run_cli
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import ADAPTERS, FAMILIES, family_for, family_of, load_source
from vlmprune.compiler.frontend.family import CLS_TOKEN, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.llava_next import LlavaNextFamily
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.passes.methods import METHODS

REPO = Path(__file__).resolve().parents[2]


def test_pipeline_tests_no_family():
    text = (REPO / "compiler" / "pipeline" / "__init__.py").read_text()
    for needle in ("source.crops", "source.kind ==", "source.pipeline", "source.family", "_fix_crops",
                   "_crops_on_target", "_over_crops", "StaticBatchPass", "FeatureOutputPass", "anyres"):
        assert needle not in text, needle


@pytest.mark.parametrize("module", ["base.py", "calibration.py"])
def test_the_target_contract_imports_no_frontend(module):
    tree = ast.parse((REPO / "targets" / module).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in imported if m.startswith("vlmprune.compiler.frontend")]


def test_one_table_gives_families_and_adapters():
    ids = [f.id for f in FAMILIES]
    # Unique ids, main's families all there; a new family is its module and its line, not an edit here.
    assert len(set(ids)) == len(ids) and {"llava", "llava_next", "clip", "vit", "dinov2", "qwen2_vl", "onnx"} <= set(ids)
    assert ADAPTERS == tuple(f.adapter for f in FAMILIES if f.adapter is not None)
    for family in FAMILIES:
        assert isinstance(family, Family) and PATCH_TOKENS in family.has
        assert family.adapter is None or family.adapter.family == family.id
        assert family.positions.kind in ("indices", "thw", "cyx")
    positions = {f.id: f.positions.kind for f in FAMILIES}
    assert positions["llava_next"] == "cyx" and positions["qwen2_vl"] == "thw" and positions["llava"] == "indices"
    models = {f.id: f.language_model for f in FAMILIES}
    assert models["qwen2_vl"] == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
    assert models["clip"] == {}


def test_family_options_replace_the_fixed_fields():
    fields = {f.name for f in dataclasses.fields(CompileOptions)}
    assert "family_options" in fields and not fields & {"image_size", "grid", "crop_budget"}
    declared = {}
    for family in FAMILIES:
        for name in family.options:
            declared.setdefault(name, set()).add(family.id)
    # --image-size: the families whose adapter takes a static size (dynamic_resolution), main's named here too
    sized = {f.id for f in FAMILIES if getattr(f.adapter, "dynamic_resolution", False)}
    assert {"qwen2_vl", "qwen3_vl", "smolvlm", "lfm2_vl"} <= sized
    # MiniCPM-V's --grid slices one image into a source and slices under one budget, with no per-tile split to choose
    assert declared == {"grid": {"llava_next", "internvl", "smolvlm", "minicpm_v"},
                        "crop_budget": {"llava_next", "internvl", "smolvlm"},
                        "image_size": sized, "video_frames": {"qwen2_vl", "llava_next", "llava_onevision"}}


def test_cli_flags_come_from_the_family_declarations():
    help_text = " ".join(run_cli("compile", "--help").output.split())
    for family in FAMILIES:
        for name, (_kind, text) in family.options.items():
            assert f"--{name.replace('_', '-')}" in help_text
            assert " ".join(text.split()) in help_text


def test_an_option_of_another_family_is_refused_in_its_words(tiny_clip_dir, tmp_path):
    result = run_cli("compile", tiny_clip_dir, "--crop-budget", "equal", "-o", tmp_path / "b")
    one_line_error(result, "--crop-budget applies to anyres models (llava_next), not to this clip_vision_model model")
    assert not (tmp_path / "b").exists()
    with pytest.raises(InputError, match=r"--image-size applies to Hugging Face directories of a dynamic-resolution "
                                         r"family \(qwen2_vl, qwen2_5_vl, qwen3_vl[^)]*\); preset demo has a fixed "
                                         r"image size"):
        compile_model("demo", tmp_path / "c", CompileOptions(family_options={"image_size": 112}))
    with pytest.raises(InputError, match="--image-size must be >= 1, got 0"):
        compile_model("demo", tmp_path / "c", CompileOptions(family_options={"image_size": 0}))


def test_a_loaded_source_and_a_manifest_find_their_family(demo_bundle, tiny_clip_dir):
    assert family_for(load_source(str(tiny_clip_dir))).id == "clip"
    assert demo_bundle.manifest["model"]["family"] == "llava"
    assert family_of(demo_bundle.manifest).id == "llava"
    assert family_of(demo_bundle.manifest).cannot_draw(demo_bundle.manifest) is None
    with pytest.raises(InputError, match="unknown model family 'nope'"):
        family_of(Manifest({"model": {"family": "nope"}}))


def test_the_anyres_readme_is_the_familys_section():
    manifest = Manifest({"model": {"grid": "1x2", "crops": 3, "image_size": 56, "patch_size": 14,
                                   "resolution": [56, 112]}, "method": {"name": "none"}})
    text = LlavaNextFamily().readme_section(manifest)
    assert text.startswith("\n## Assembling the LLM input (LLaVA-NeXT anyres crops)\n")
    assert "`image_features` [1, 52, D]" in text  # 4x4 base tokens + 4 grid rows of 8 tokens and a newline
    assert Family().readme_section(manifest) == ""


def test_methods_declare_needs_and_the_cli_joins_them_with_the_families():
    for cls in METHODS.values():
        for capability, _using in cls().serves():
            assert any(capability in f.has for f in FAMILIES), (cls.name, capability)
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+): .*\n(?:.*\n)*?  serves:   (.*)$",
                                                        run_cli("methods").output, re.M)}
    # The family names come from the families' declarations, in table order (main's, at least, named here).
    with_cls = ", ".join(f.has[CLS_TOKEN] for f in FAMILIES if CLS_TOKEN in f.has)
    assert "LLaVA on CLIP, CLIP, ViT, DINOv2" in with_cls
    assert lines["cls"] == (f"towers with a [CLS] token ({with_cls}); "
                            "LLaVA-NeXT's crops under one budget; SigLIP towers with their attention-pooling head, "
                            "with --score probe; "
                            "Qwen2-VL / Qwen2.5-VL, Qwen3-VL merged tokens, with --score attention")
    every = ", ".join(f.has[PATCH_TOKENS] for f in FAMILIES)
    # main's families in table order, the families added since before the .onnx towers (any order)
    assert "LLaVA, LLaVA-NeXT, LLaVA-OneVision clips, CLIP, SigLIP, ViT, DINOv2, Qwen2-VL / Qwen2.5-VL, Qwen3-VL, InternVL3, " in every
    assert "SmolVLM" in every and "Gemma 3" in every and every.endswith(", .onnx towers")
    assert lines["divprune"] == f"every family (no [CLS] needed: {every})"


def test_a_former_manifests_family_fields_become_family_options():
    from vlmprune.compiler.bundle.manifest import Manifest
    from vlmprune.compiler.pipeline import options_of

    saved = {"method": "cls", "keep": 20, "image_size": None, "grid": "1x2", "crop_budget": "equal", "debug": True}
    options = options_of(Manifest({"compile_options": saved}), debug=False)
    assert options.family_options == {"grid": "1x2", "crop_budget": "equal"}
    assert (options.method, options.keep, options.debug) == ("cls", 20, False)


def test_llm_side_holds_no_family_or_position_kind_table():
    """generate, handoff and lm_source ask the family object; none names a family or a positions kind."""
    import ast
    import inspect

    from vlmprune.compiler.llm import handoff, lm_source

    from vlmprune.compiler import generate

    named = {"indices", "thw", "cyx", "llava_next", "qwen2_vl"}
    for module in (generate, handoff, lm_source):
        tree = ast.parse(inspect.getsource(module))
        found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in named}
        assert not found, f"{module.__name__} names {sorted(found)}"
    assert lm_source.vlm_classes() == {t: c for f in FAMILIES for t, c in f.language_model.items()}


def test_positions_rule_is_the_manifest_llm_section(tmp_path):
    """What a family's positions object says is what its bundle's manifest hands the LLM runtime."""
    from vlmprune.compiler.llm.handoff import llm_section

    base = {"outputs": [{"name": "image_features", "shape": [1, 4, 8], "dtype": "float"}],
            "method": {"name": "none", "num_patches": 4}, "preprocess": {"size": 28}}
    models = {"llava": {}, "qwen2_vl": {"token_counts": {"merged_grid_thw": [1, 2, 2]}},
              "llava_next": {"grid": "1x2", "image_size": 28, "patch_size": 14}}
    for family in FAMILIES:
        model = {"family": family.id, "image_size": 28, "patch_size": 14, **models.get(family.id, {})}
        llm = llm_section(Manifest({**base, "model": model}))
        rule = family.positions
        assert llm["positions"]["kind"] == rule.kind and llm["positions"]["rule"] == rule.rule
        assert llm["positions"]["meaning"] == rule.meaning
        dense = rule.dense_image_tokens(model, 4)
        assert llm["dense_image_tokens"] == dense and llm["text_resumes_at"] == rule.text_resumes_at(model, dense, 0)
    assert llm_section(Manifest({**base, "model": {"family": "qwen2_vl", **models["qwen2_vl"]}}))["text_resumes_at"] == 2
    assert llm_section(Manifest({**base, "model": {"family": "llava_next", **models["llava_next"]}}))["dense_image_tokens"] == 14  # 2² base + 2 rows of (2·2 + newline)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: type(f).__name__)
def test_a_bundle_at_another_declared_option_is_named_in_one_line(family):
    """eval --bundle: a bundle compiled at another --image-size or --grid than the source runs takes other pixels.
    Each family is held to the compile-time options it declares, and to nothing else."""
    import types

    source = types.SimpleNamespace(image_size=224, details={"grid": "2x2"})
    assert family.other_input({"image_size": 224, "grid": "2x2"}, source) is None
    other_size = family.other_input({"image_size": 336, "grid": "2x2"}, source)
    other_grid = family.other_input({"image_size": 224, "grid": "1x3"}, source)
    if "image_size" in family.options:
        assert other_size == "compiled at --image-size 336, eval runs at 224 (pass --image-size 336)"
    else:
        assert other_size is None
    if "grid" in family.options:
        assert other_grid == "compiled for --grid 1x3, eval runs 2x2 (pass --grid 1x3)"
    else:
        assert other_grid is None
