"""The language model for target orin through TensorRT Edge-LLM's exporter (its own venv, by subprocess).

A tiny seeded LLaVA (Llama text model, norms perturbed so no two weights are equal) and a
tiny fp16 Qwen2.5-VL: the files Edge-LLM writes, its graph's inputs and custom ops, every
weight equal to the checkpoint's, and the graph minus its plugins in ONNX Runtime against the
PyTorch math. No TensorRT here: the plugins themselves are checked on the device only.
"""

from __future__ import annotations

import json
import os

import onnx
import pytest
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm import edgellm_env, export
from vlmprune.compiler.llm.edgellm import (LLM_DIR, MINIMAL_CHAT_TEMPLATE, PLUGIN_DOMAIN, export_edgellm,
                                           readme_section, write_lm_checkpoint)
from vlmprune.compiler.bundle.manifest import Manifest

EXPECTED_INPUTS = ["inputs_embeds", "past_key_values_0", "past_key_values_1", "rope_rotary_cos_sin", "positions",
                   "query_start_offsets", "query_lengths", "past_lengths", "attention_sequence_lengths",
                   "state_indices", "execution_phase_marker", "context_sequence_count_carrier", "kv_page_table",
                   "logits_indices"]


@pytest.fixture(scope="session")
def edgellm_ready():
    """tensorrt-edgellm[export] 0.11.0's venv: reused if ready, else created (~40-70 s, host torch reused).

    Skips, saying why, when VLMPRUNE_EDGELLM_CREATE=0, when the venv cannot be made here
    (platform, host torch), or when the package index cannot be reached (an offline machine).
    """
    ok, reason = edgellm_env.available()
    if ok:
        return edgellm_env.edgellm_python()
    if os.environ.get(edgellm_env.CREATE_ENV, "1") == "0":
        pytest.skip(f"Edge-LLM venv not created and {edgellm_env.CREATE_ENV}=0")
    ok, reason = edgellm_env.creatable()
    if not ok:
        pytest.skip(f"TensorRT Edge-LLM exporter unavailable: {reason}")
    reachable, why = edgellm_env.index_reachable()
    if not reachable:
        pytest.skip(f"Edge-LLM venv not created and cannot be: {why}")
    try:
        return edgellm_env.edgellm_python()
    except edgellm_env.EdgeLlmError as exc:
        pytest.skip(f"Edge-LLM venv could not be created: {exc}")


def _perturb_norms(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones everywhere would be one deduplicated initializer in the graph
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model


def tiny_llava(seed: int = 3):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    llava = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=299))
    return _perturb_norms(llava.eval(), seed)


@pytest.fixture(scope="module")
def llava_export(edgellm_ready, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("llava")
    llava = tiny_llava()
    llava.save_pretrained(checkpoint)
    folder = tmp_path_factory.mktemp("bundle")
    info = export_edgellm(str(checkpoint), Manifest({"llm": {"image_tokens": 4, "hidden_size": 64}}), None, folder)
    return llava, folder, info


def test_files_and_manifest_fields(llava_export):
    llava, folder, info = llava_export
    names = sorted(p.name for p in (folder / LLM_DIR).iterdir())
    assert {"model.onnx", "model.onnx.data", "embedding.safetensors", "config.json", "chat_template.jinja",
            "edgellm_export.log"} <= set(names)
    assert info["files"]["all"] == [f"{LLM_DIR}/{n}" for n in names]
    assert info["family"] == "llama" and info["layers"] == 2 and info["vocab_size"] == 300
    assert info["exporter"].startswith("TensorRT Edge-LLM 0.11.0")
    assert info["minimal_chat_template"] and "no chat template" in info["chat_template"]
    assert (folder / LLM_DIR / "chat_template.jinja").read_text() == MINIMAL_CHAT_TEMPLATE
    runtime = json.loads((folder / LLM_DIR / "config.json").read_text())
    assert runtime["edgellm_version"] == "0.11.0" and runtime["num_hidden_layers"] == 2
    json.dumps(info)  # the manifest takes it as is


def test_graph_inputs_outputs_and_custom_ops(llava_export):
    _llava, folder, info = llava_export
    graph = info["graph"]
    assert [v["name"] for v in graph["inputs"]] == EXPECTED_INPUTS
    assert [v["name"] for v in graph["outputs"]] == ["logits", "present_key_values_0", "present_key_values_1"]
    inputs = {v["name"]: v for v in graph["inputs"]}
    assert inputs["inputs_embeds"]["shape"] == ["physical_tokens", 64] and inputs["inputs_embeds"]["dtype"] == "float16"
    assert inputs["past_key_values_0"]["shape"] == [2, "num_pages", 128, 2, 16]  # paged: [k/v, pages, 128, kv, d]
    assert inputs["rope_rotary_cos_sin"]["dtype"] == "float32"  # RoPE is data: one row per token
    assert graph["custom_ops"] == [f"{PLUGIN_DOMAIN}::AttentionPlugin"] and graph["attention_plugins"] == 2
    assert graph["domains"] == ["ai.onnx", PLUGIN_DOMAIN]
    assert graph["checker"].startswith("passed")
    proto = onnx.load(str(folder / LLM_DIR / "model.onnx"), load_external_data=False)
    assert not any(v.name == "input_ids" for v in proto.graph.input)  # the embedding lookup is outside the engine


def test_weights_equal_the_checkpoint_and_standard_ops_match(llava_export):
    _llava, _folder, info = llava_export
    weights = info["checks"]["weights"]
    # per layer: fused QKV, o, gate, up, down, two norms; then lm_head, final norm, the embedding table
    assert weights["passed"] and weights["missing"] == [] and weights["tensors_checked"] == 2 * 7 + 3
    assert weights["max_abs"] == 0.0
    ops = info["checks"]["standard_ops_in_onnxruntime"]
    assert ops["ran"] and ops["passed"], ops
    assert ops["qkv_max_abs"] < 2e-3 and ops["logits_max_abs"] < 2e-3


def test_readme_section_has_the_build_commands(llava_export):
    _llava, _folder, info = llava_export
    text = readme_section(Manifest({"llm_graphs": info}))
    assert "llm_build --onnxDir llm --engineDir engines/llm" in text and "--maxInputLen" in text
    assert "llm_inference --engineDir engines/llm" in text and "trt_edgellm::AttentionPlugin" in text
    assert "JetPack 7.2" in info["device_requirements"] and "TensorRT 10.3" in text
    # the pipeline's readme_section asks the exporter the manifest names by id; none without --with-llm
    assert export.readme_section(Manifest({"llm_graphs": {**info, "exporter_id": "edgellm"}})) == text
    assert export.readme_section(Manifest()) == ""


def test_the_lm_checkpoint_leaves_the_model_alone(tmp_path):
    llava = tiny_llava(seed=5)
    from vlmprune.compiler.llm.edgellm import _resolve

    before = llava.lm_head.weight.detach().clone()
    llava.save_pretrained(tmp_path / "ck")
    _kind, lm, _source, _config = _resolve(str(tmp_path / "ck"))
    written = write_lm_checkpoint(lm, tmp_path / "out")
    assert written["minimal_chat_template"] and written["tokenizer_files"] == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert lm.lm_head.weight.dtype == torch.float32 and torch.equal(lm.lm_head.weight.detach(), before)


def test_other_families_are_refused_in_one_line(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(InputError, match="takes `demo`, a LLaVA checkpoint") as exc:
        export_edgellm(str(tmp_path / "ck"), Manifest(), None, tmp_path / "bundle")
    assert "\n" not in str(exc.value)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(InputError, match="'gpt2' is not supported"):
        export_edgellm(gpt2, Manifest(), None, tmp_path / "bundle")

    class FastV:
        fastv_layer = 1

    with pytest.raises(InputError, match="FastV is not part of TensorRT Edge-LLM"):
        export_edgellm("demo", Manifest(), FastV(), tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()  # refused before any work


def test_qwen2_5_vl_language_model_goes_through_skip_visual(edgellm_ready, tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(1)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=56),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303,
        bos_token_id=None, eos_token_id=None)
    model = _perturb_norms(Qwen2_5_VLForConditionalGeneration(config).eval(), 1).half()
    model.save_pretrained(tmp_path / "qwen")  # fp16: handed over as links, no copy
    info = export_edgellm(str(tmp_path / "qwen"), Manifest(), None, tmp_path / "bundle")
    assert "Qwen2.5-VL" in info["source"] and info["layers"] == 2
    assert not (tmp_path / "bundle" / "visual").exists()
    assert info["checks"]["weights"]["passed"] and info["checks"]["weights"]["max_abs"] == 0.0
    # q/k/v biases (Qwen2) fused into one initializer and checked too
    assert info["checks"]["weights"]["tensors_checked"] == 2 * 8 + 3
    assert info["checks"]["standard_ops_in_onnxruntime"]["passed"]
    assert info["edgellm_config"]["rope_scaling"]["mrope_section"] == [2, 3, 3]
    assert "--vlm" in readme_section(Manifest({"llm_graphs": info}))


def test_compile_orin_with_llm_and_check_repeat_the_edgellm_checks(edgellm_ready, tiny_llava_dir, tmp_path):
    """The CLI end to end: `compile --target orin --with-llm` puts Edge-LLM's graph in the bundle; check re-runs it."""
    from click.testing import CliRunner

    from vlmprune.compiler import bundle
    from vlmprune.compiler.cli import main

    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["compile", str(tiny_llava_dir), "--target", "orin", "--keep", "16",
                                       "--with-llm", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = bundle.load_manifest(out, verify=True)  # llm/ is hashed like every other file
    assert {"llm/model.onnx", "llm/model.onnx.data", "llm/embedding.safetensors"} <= set(manifest["files"])
    assert manifest["llm_graphs"]["exporter"].startswith("TensorRT Edge-LLM")
    assert manifest["llm_graphs"]["exporter_id"] == "edgellm"
    assert "llm_build --onnxDir llm" in (out / "README.md").read_text()
    checked = CliRunner().invoke(main, ["check", str(out), "--json"])
    assert checked.exit_code == 0, checked.output
    llm = [s for s in json.loads(checked.stdout)["stages"] if s["stage"] == "llm"]
    assert len(llm) == 1 and llm[0]["passed"] and llm[0]["outputs"]["weights"]["passed"]
    assert llm[0]["outputs"]["standard ops"]["passed"] and llm[0]["outputs"]["device"]["passed"] is None


def test_readme_and_targets_state_the_same_environment_cost(monkeypatch):
    """The README's figure for building the exporter's venv is the one `vlmprune targets` prints."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    seconds, size = edgellm_env.CREATE_COST
    assert f"about {size} and {seconds} on a 2-core machine" in readme
    monkeypatch.delenv(edgellm_env.PYTHON_ENV, raising=False)
    monkeypatch.setenv("VLMPRUNE_CACHE", "/nonexistent-cache-for-this-test")
    ok, why = edgellm_env.creatable()
    assert ok and f"(~{seconds}, ~{size};" in why
