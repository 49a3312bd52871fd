"""LFM2-VL's language model (LFM2, hybrid) exported `--with-llm` (target ort, the torch exporter), against Hugging Face.

LFM2's decoder interleaves gated short-convolution layers (Lfm2ShortConv: in_proj into B, C and x, B*x through a
depthwise causal conv1d of kernel conv_L_cache, C times that, out_proj) with grouped-query attention layers (a per-head
q/k norm, RoPE). A decode step needs each convolution's last inputs, so the graphs carry a convolution state per conv
layer (`present.{i}.conv` [batch, hidden, L], taken back as `past_key_values.{i}.conv`) beside the attention layers'
keys and values, all numbered by layer. The tiny checkpoint (tiny_lfm2_vl, seed 11, spread_llm: every LLM matrix, the
convolutions' kernels and biases, every norm scale drawn) has 5 layers 48 wide (conv, conv, attention, conv, attention;
kernel 3, conv biases on), vocabulary 320 so that a prompt without a tokenizer is UTF-8 bytes. What is checked:
- a divprune bundle (K=8) compiled --with-llm passes its compile-time LLM parity (transformers' own forward: logits,
  every key/value and every convolution state by name, greedy tokens), says what it holds (manifest, README), its
  graphs take and give the convolution states, and only the 2 attention layers' attention is fused;
- the bundle's prefill + decode graphs (ONNX Runtime) against HF's own Lfm2VlForConditionalGeneration forward on the
  bundle's kept rows at their original positions inside generate's prompt: the prefill's logits, keys, values and
  convolution states, then six greedy decode steps, each step's logits and states against HF's forward on its own
  cache, within the contract's fp32 bound (1e-4);
- a prompt shorter than the kernel starts the state at zeros, as transformers pads it, and still matches;
- the convolution state counts: decode steps fed a zeroed state (what a graph without one computes) leave the bound
  and fail the same check, and HF's own cache with its conv states zeroed gives other logits too;
- `vlmprune generate` answers through the bundle's graphs with HF's greedy tokens on the same pruned features
  (--reference), and `vlmprune check` runs the LLM parity again;
- FastV, onnxruntime-genai's builder and Edge-LLM's exporter are refused in one line each, before any work.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (cat_image, check_llm_again, check_generate_through_graphs, check_greedy_steps,
                           check_decode_against_hf, check_state_matters, hf_prefill_at_kept, state_gap)
from tiny_models import tiny_lfm2_vl
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, KEEP, STEPS, KERNEL = 320, 300, 8, 6, 3
PROMPT = "what is in the image?"
TYPES = ["conv", "conv", "full_attention", "conv", "full_attention"]
CONVS, ATTENTION = [0, 1, 3], [2, 4]
BOUND = 1e-4  # the contract's fp32 bound on logits and caches (torch_exporter.PARITY_ATOL)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_lfm2_vl(tmp_path_factory.mktemp("lfm2_vl_llm") / "ckpt", 11, image_token_id=IMAGE, tokenizer=True,
                        spread_llm=True, vocab_size=VOCAB, num_hidden_layers=len(TYPES), layer_types=TYPES,
                        conv_bias=True, conv_L_cache=KERNEL)


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    return compile_model(str(ckpt), tmp_path_factory.mktemp("lfm2_vl_llm_b") / "b",
                         CompileOptions(method="divprune", keep=KEEP, with_llm=True))


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


def test_with_llm_bundle_passes_its_llm_parity_and_says_what_it_holds(bundle):
    manifest = bundle.manifest
    assert bundle.report.passed, manifest["parity"]
    graphs = manifest["llm_graphs"]
    assert graphs["family"] == "lfm2" and graphs["layers"] == len(TYPES) and graphs["fastv"] is None
    assert graphs["conv_layers"] == CONVS and graphs["conv_state"] == [48, KERNEL] and graphs["cache_layers"] == 2
    assert graphs["layer_types"] is None and graphs["kv_sources"] is None
    parity = graphs["parity"]
    print(f"LFM2 compile-time parity: logits + states max-abs {parity['logits_max_abs']:.3g} (fused), "
          f"{parity['decomposed']['logits_max_abs']:.3g} (decomposed)")
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= BOUND
    assert parity["decomposed"]["passed"]
    states = ["past_key_values.0.conv", "past_key_values.1.conv", "past_key_values.2.key", "past_key_values.2.value",
              "past_key_values.3.conv", "past_key_values.4.key", "past_key_values.4.value"]
    assert [i["name"] for i in graphs["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids"]
    assert [i["name"] for i in graphs["io"]["decode"]["inputs"]] == ["inputs_embeds", "position_ids", *states]
    presents = [s.replace("past_key_values", "present") for s in states]
    for graph in ("prefill", "decode"):
        outputs = {o["name"]: o["shape"] for o in graphs["io"][graph]["outputs"]}
        assert list(outputs) == ["logits", *presents]
        assert outputs["present.3.conv"][1:] == [48, KERNEL]
    for name in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(bundle.bundle / "llm" / name, load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MultiHeadAttention") + ops.count("GroupQueryAttention") == len(ATTENTION), name
        assert ops.count("Conv") == len(CONVS), name
    readme = (bundle.bundle / "README.md").read_text()
    assert "Layers 0, 1, 3 are short convolutions" in readme and f"`present.{{i}}.conv` [batch, 48, {KERNEL}]" in readme


def _hf_prefill(ckpt, bundle, cat):
    """HF's forward on the bundle's kept rows inside generate's prompt (merged_checks.hf_prefill_at_kept)."""
    from vlmprune.compiler.frontend.lfm2_vl import Lfm2VlFamily

    source = bundle.manifest["model"]
    shape = types.SimpleNamespace(image_size=source["image_size"], patch_size=source["patch_size"])

    def kept_rows(model, pixel, kept):
        inputs = Lfm2VlFamily().hf_image_inputs(None, shape, pixel)
        return model.model.get_image_features(**inputs).pooler_output[0][kept]

    return hf_prefill_at_kept(ckpt, bundle, cat, PROMPT, IMAGE, KEEP, kept_rows)


def test_graphs_are_hfs_forward_logits_and_states_over_prefill_and_decode(ckpt, bundle, cat):
    """Prefill logits, keys, values and convolution states = HF's forward and its cache; then STEPS greedy steps, each
    decode graph's logits and states = HF's forward on its own cache. A zeroed convolution state fails the same
    check, and HF's own cache with its conv states zeroed gives other logits."""
    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    model, embed, embeds, position_ids, hf, cache = _hf_prefill(ckpt, bundle, cat)
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer" if t == "conv" else
                                                                "DynamicLayer" for t in TYPES]
    graphs = GraphRunner(bundle.bundle / "llm")
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy())
    assert state["past_key_values.3.conv"].shape == (1, 48, KERNEL)
    assert np.abs(state["past_key_values.3.conv"]).min() > 0  # the prompt fills the state: no zero column left
    position = int(position_ids[0, -1]) + 1
    saved = copy.deepcopy(cache)  # the prefill's cache, for the negative case below
    end = check_decode_against_hf("LFM2", model, embed, graphs, state, hf, cache, logits, position, STEPS, BOUND)
    assert end["past_key_values.2.key"].shape[2] == embeds.shape[1] + STEPS
    assert end["past_key_values.0.conv"].shape[2] == KERNEL  # the state stays L wide

    # the negative case: without the conv state the same check fails, and HF's logits move too
    def zero_hf(cache):
        for i in CONVS:
            cache.layers[i].conv_states[0].zero_()

    check_state_matters("LFM2", model, embed, graphs, state, hf, saved, logits, position, STEPS, BOUND, "conv",
                        zero_hf)


def test_generate_answers_through_the_bundles_graphs_with_hfs_greedy_tokens(bundle, ckpt, cat):
    """`vlmprune generate` decodes with the bundle's graphs (the convolution states carried step to step like the
    caches) and gives HF's greedy tokens and first logits on the same pruned features (--reference)."""
    check_generate_through_graphs(bundle.bundle, ckpt, cat, PROMPT, KEEP)


def test_check_runs_the_llm_parity_again(bundle, ckpt):
    check_llm_again(bundle.bundle, ckpt)


@pytest.mark.parametrize("args, line", [
    (["--fastv-layer", "1", "--image-start", "3"], "--fastv-layer with language model type 'lfm2' is not supported: "
                                                   "FastV's reference runs every layer as attention"),
    (["--llm-exporter", "genai"], "language model type 'lfm2' is not supported by the onnxruntime-genai exporter"),
    (["--target", "orin"], "--with-llm for orin (TensorRT Edge-LLM) takes `demo`, a LLaVA checkpoint")],
    ids=["fastv", "genai", "edgellm"])
def test_what_the_exporters_do_not_take_is_refused_in_one_line_before_any_work(ckpt, tmp_path, args, line):
    """FastV (its reference runs every layer as attention), onnxruntime-genai's builder and Edge-LLM's exporter (their
    decoders have no convolution layers): one line each, before the tower's export, nothing written."""
    result = run_cli("compile", ckpt, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm", *args)
    one_line_error(result, line)
    assert "emit target" not in result.output and not (tmp_path / "b").exists()


def test_a_prompt_shorter_than_the_kernel_starts_the_state_at_zeros(ckpt, bundle):
    """A 2-token prompt (kernel 3): the prefill's convolution state is zeros before the prompt, as transformers pads
    it, and the graphs still give HF's logits and states, prefill and two decode steps."""
    from transformers import AutoModelForImageTextToText

    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    embed = model.get_input_embeddings()
    ids = torch.tensor([[256, 72]])
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=torch.arange(2)[None], use_cache=True)
        embeds = embed(ids)
    graphs = GraphRunner(bundle.bundle / "llm")
    logits, state = graphs.prefill(embeds.numpy(), np.arange(2)[None])
    hf = out.logits[0, -1].float()
    np.testing.assert_allclose(logits, hf.numpy(), rtol=0, atol=BOUND)
    assert state_gap(state, out.cache) <= BOUND and not state["past_key_values.0.conv"][..., 0].any()

    def states_match(_logits, _want, state, cache):
        assert state_gap(state, cache) <= BOUND

    check_greedy_steps(model, embed, graphs, state, hf, out.cache, logits, 2, 2, atol=BOUND, on_step=states_match)
