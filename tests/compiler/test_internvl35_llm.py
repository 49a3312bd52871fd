"""InternVL3.5's language model (Qwen3) exported `--with-llm`, beyond what test_internvl_smolvlm_llm checks of every
family (compile-time parity, `check`, HF's forward and greedy logits, generate = --reference, FastV).

Qwen3's layer is Qwen2's without the q/k/v biases and with an RMSNorm over each head's queries and keys before the
rotation (q_norm, k_norm). The tiny checkpoint (tiny_internvl35, seed 7) has every LLM weight spread, its q/k norm
scales around 1 among them, and a head size (32) apart from hidden / heads (48 / 2), as Qwen3's released configs have.
What is checked:
- the norms count: the exporter's prefill without them, or HF's model with their scales reset to 1, gives other
  logits (> 1e-3), so the parity bounds below (1e-4) would catch a norm left out or its scale dropped;
- the bundle's prefill + decode graphs (ONNX Runtime) against HF's own full-model forward on the bundle's kept rows at
  their original positions: the prefill's logits and every layer's cache, then six greedy decode steps, each step's
  logits and caches against HF's forward on its own cache, all within the contract's fp32 bound (1e-4);
- onnxruntime-genai's builder (its Qwen3Model): `--llm-exporter genai` compiles, its graph holds each layer's q_norm and
  k_norm with the checkpoint's scales, its compile-time parity (HF at contiguous positions, batch 1 and 2, greedy
  tokens) passes and `check` runs it again;
- refused in one line, before the tower's export: orin's Edge-LLM exporter (its checks have no q/k norm) and
  InternVL3.5's MoE language model (Qwen3-MoE) through the genai exporter.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import cat_image, check_decode_against_hf, check_llm_again, hf_prefill_at_kept
from tiny_models import edited_copy, tiny_internvl35
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, KEEP, LAYERS, STEPS = 320, 300, 8, 2, 6
PROMPT = "what is in the image?"
LLM = dict(image_token_id=IMAGE, tokenizer=True, spread_llm=True, vocab_size=VOCAB, num_hidden_layers=LAYERS,
           num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
BOUND = 1e-4  # the contract's fp32 bound on logits and caches (torch_exporter.PARITY_ATOL)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_internvl35(tmp_path_factory.mktemp("internvl35") / "ckpt", 7, **LLM)


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    """A divprune K=8 bundle compiled --with-llm (target ort, the torch exporter)."""
    return compile_model(str(ckpt), tmp_path_factory.mktemp("internvl35_b") / "b",
                         CompileOptions(method="divprune", keep=KEEP, with_llm=True))


def test_the_qk_norms_count(ckpt):
    """Without the norms the exporter's prefill gives other logits, and HF's model with their scales reset to 1 too."""
    from vlmprune.compiler.llm.fastv import reference_prefill
    from vlmprune.compiler.llm.lm_source import language_model
    from vlmprune.compiler.llm.torch_exporter import PrefillGraph

    lm = language_model(str(ckpt))
    config = lm.config
    assert config.model_type == "qwen3" and config.head_dim * config.num_attention_heads != config.hidden_size
    embeds = torch.randn(1, 12, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        want = reference_prefill(lm, embeds, None, positions).logits
        graph = PrefillGraph(lm, None)
        assert graph.qk_norm
        torch.testing.assert_close(graph(embeds, positions)[0][:, 0], want, rtol=0, atol=1e-5)
        graph.qk_norm = False
        assert (graph(embeds, positions)[0][:, 0] - want).abs().max() > 1e-3
        for layer in lm.model.layers:
            assert (layer.self_attn.q_norm.weight - 1).abs().max() > 0.1
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        assert (reference_prefill(lm, embeds, None, positions).logits - want).abs().max() > 1e-3


def test_graphs_are_hfs_forward_logits_and_caches_over_prefill_and_decode(ckpt, bundle, tmp_path_factory):
    """The bundle's 8 kept rows (HF's own tower rows) at their original positions inside generate's prompt: the
    prefill graph's logits and every layer's key and value = HF's full-model forward (mm_encoder_outputs) and its
    cache; then STEPS greedy steps, each decode graph's logits and caches = HF's forward on its own cache."""
    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    assert bundle.report.passed and bundle.manifest["llm_graphs"]["family"] == "qwen3"

    def kept_rows(model, pixel, kept):
        return model.model.get_image_features(pixel_values=torch.from_numpy(pixel)).pooler_output[0][kept]

    model, embed, embeds, position_ids, hf, cache = hf_prefill_at_kept(ckpt, bundle, cat_image(tmp_path_factory),
                                                                       PROMPT, IMAGE, KEEP, kept_rows,
                                                                       rows_as_batch=True)
    graphs = GraphRunner(bundle.bundle / "llm")
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy())
    end = check_decode_against_hf("InternVL3.5 (Qwen3)", model, embed, graphs, state, hf, cache, logits,
                                  int(position_ids[0, -1]) + 1, STEPS, BOUND)
    assert end["past_key_values.0.key"].shape[2] == embeds.shape[1] + STEPS


def test_the_genai_builder_takes_qwen3_with_its_qk_norms(ckpt, tmp_path):
    """`--llm-exporter genai`: the builder's Qwen3 graph holds each layer's q_norm and k_norm with the checkpoint's
    scales; its parity against HF (batch 1 and 2, greedy tokens) passes; `check` runs it again."""
    from onnx import numpy_helper

    from vlmprune.compiler.llm.lm_source import language_model

    out = tmp_path / "g"
    result = run_cli("compile", ckpt, "-o", out, "--method", "divprune", "--keep", str(KEEP), "--with-llm",
                     "--llm-exporter", "genai")
    assert result.exit_code == 0, result.output
    graphs = json.loads((out / "manifest.json").read_text())["llm_graphs"]
    parity = graphs["parity"]
    print(f"InternVL3.5 (Qwen3) genai graph vs HF: logits max-abs {parity['logits_max_abs']:.3g} "
          f"(bound {parity['tolerance']:.3g}), per batch "
          + ", ".join(f"{b}: {r['logits_max_abs']:.3g}" for b, r in parity["per_batch"].items()))
    assert graphs["exporter_id"] == "genai" and graphs["family"] == "qwen3" and graphs["layers"] == LAYERS
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= parity["tolerance"]
    model = onnx.load(out / "llm" / "model.onnx")  # with its weights (model.onnx.data beside it)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    lm = language_model(str(ckpt))
    for i, layer in enumerate(lm.model.layers):
        for norm in ("q_norm", "k_norm"):
            want = getattr(layer.self_attn, norm).weight.detach().numpy()
            np.testing.assert_array_equal(weights[f"model.layers.{i}.attn.{norm}.layernorm.weight"], want)
    check_llm_again(out, ckpt)


def test_orins_edgellm_exporter_refuses_qwen3_in_one_line_saying_why(ckpt, tmp_path):
    result = run_cli("compile", ckpt, "-o", tmp_path / "b", "--target", "orin", "--method", "divprune", "--keep",
                     str(KEEP), "--with-llm")
    one_line_error(result, "language model type 'qwen3' is not supported: TensorRT Edge-LLM lists Qwen3, but the "
                           "checks vlmprune runs on its graph here")
    assert "q_norm/k_norm" in result.output and not (tmp_path / "b").exists()


def test_the_genai_exporter_refuses_qwen3_moe_in_one_line(ckpt, tmp_path):
    moe = edited_copy(ckpt, tmp_path / "moe", lambda c: c["text_config"].update(model_type="qwen3_moe"))
    result = run_cli("compile", moe, "-o", tmp_path / "b", "--method", "divprune", "--keep", str(KEEP),
                     "--with-llm", "--llm-exporter", "genai")
    one_line_error(result, "language model type 'qwen3_moe' is not supported for export: Qwen3-MoE's decoder")
    assert not (tmp_path / "b").exists()
