"""MiniCPM-V 4.6's language model (Qwen3.5, hybrid) exported `--with-llm` (target ort, the torch exporter), against
Hugging Face.

Qwen3.5's decoder interleaves gated delta-net linear-attention layers (Qwen3_5GatedDeltaNet: in_proj_qkv through a
depthwise causal conv1d and SiLU, L2-normed queries and keys, the gated delta rule over a recurrent state, a gated
RMSNorm, out_proj) with gated full-attention layers (a per-head q/k norm, a sigmoid output gate packed with the queries,
a partial rotary embedding). A decode step needs each delta-net's convolution inputs and its recurrent state, so the
graphs carry two states per delta-net (`present.{i}.conv` [batch, channels, L] and `present.{i}.recurrent`
[batch, value heads, dk, dv], taken back as `past_key_values.{i}.*`) beside the attention layers' keys and values, all
numbered by layer; the prefill runs the delta rule over the prompt as one ONNX Scan. The tiny checkpoint
(tiny_minicpm_v, seed 11, spread_llm: every LLM matrix, the convolutions' kernels, A_log, dt_bias and every norm scale
drawn) has 4 layers 48 wide (delta-net, delta-net, attention, delta-net), the delta-nets with 1 key head of 12 and 2
value heads of 8 (grouped: the key head repeated), kernel 4 (channels 12 + 12 + 16 = 40), the attention's rotary
embedding on a quarter of each 24-wide head; vocabulary 320 so that a prompt without a tokenizer is UTF-8 bytes. What
is checked:
- a divprune bundle (K=8) compiled --with-llm passes its compile-time LLM parity (transformers' own forward: logits,
  every key/value, convolution and recurrent state by name, greedy tokens), says what it holds (manifest, README),
  its graphs take and give the delta-nets' states, the prefill scans, and only the attention layer is fused;
- the bundle's prefill + decode graphs (ONNX Runtime) against HF's own MiniCPMV4_6ForConditionalGeneration forward on
  the bundle's kept rows at their original positions inside generate's prompt: the prefill's logits, keys, values,
  convolution and recurrent states, then six greedy decode steps, each step's logits and states against HF's forward on
  its own cache, within the contract's fp32 bound (1e-4);
- text prompts of 1, 5, 40 and 300 tokens (transformers' own prefill is the chunked form, 64-row chunks: 300 is five
  of them) give HF's logits and states: the Scan over any prompt length;
- the recurrent state counts: decode steps fed a zeroed recurrent state leave the bound and fail the same check, and
  HF's own cache with its recurrent states zeroed gives other logits too;
- `vlmprune generate` answers through the bundle's graphs with HF's greedy tokens on the same pruned features
  (--reference), and `vlmprune check` runs the LLM parity again;
- FastV, onnxruntime-genai's builder and Edge-LLM's exporter are refused in one line each, before any work.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (cat_image, check_llm_again, check_generate_through_graphs, check_greedy_steps,
                           check_decode_against_hf, check_state_matters, hf_prefill_at_kept, hf_rows_of, state_gap)
from tiny_models import tiny_minicpm_v
from vlmprune.compiler.pipeline import CompileOptions, compile_model

VOCAB, IMAGE, KEEP, STEPS, KERNEL, PATCH = 320, 300, 8, 6, 4, 8
PROMPT = "what is in the image?"
TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
DELTAS, ATTENTION = [0, 1, 3], [2]
CHANNELS, RECURRENT = 40, [2, 12, 8]  # the conv state's channels (q 12 + k 12 + v 2 x 8); [value heads, dk, dv]
BOUND = 1e-4  # the contract's fp32 bound on logits and caches (torch_exporter.PARITY_ATOL)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_minicpm_v(tmp_path_factory.mktemp("minicpm_v_llm") / "ckpt", 11, image_token_id=IMAGE, tokenizer=True,
                          spread_llm=True, vocab_size=VOCAB, num_hidden_layers=len(TYPES), layer_types=TYPES,
                          linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=12,
                          linear_value_head_dim=8, linear_conv_kernel_dim=KERNEL)


@pytest.fixture(scope="module")
def bundle(ckpt, tmp_path_factory):
    return compile_model(str(ckpt), tmp_path_factory.mktemp("minicpm_v_llm_b") / "b",
                         CompileOptions(method="divprune", keep=KEEP, with_llm=True))


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


def _states(prefix: str) -> list[str]:
    names = []
    for i, kind in enumerate(TYPES):
        names += [f"{prefix}.{i}.conv", f"{prefix}.{i}.recurrent"] if kind == "linear_attention" else \
            [f"{prefix}.{i}.key", f"{prefix}.{i}.value"]
    return names


def test_with_llm_bundle_passes_its_llm_parity_and_says_what_it_holds(bundle):
    manifest = bundle.manifest
    assert bundle.report.passed, manifest["parity"]
    graphs = manifest["llm_graphs"]
    assert graphs["family"] == "qwen3_5_text" and graphs["layers"] == len(TYPES) and graphs["fastv"] is None
    assert graphs["recurrent_layers"] == DELTAS and graphs["recurrent_states"] == [[CHANNELS, KERNEL], RECURRENT]
    assert graphs["cache_layers"] == 1 and graphs["conv_layers"] is None and not graphs["mrope"]
    assert graphs["kv_heads"] == 1 and graphs["head_dim"] == 24
    parity = graphs["parity"]
    print(f"Qwen3.5 compile-time parity: logits + states max-abs {parity['logits_max_abs']:.3g} (fused), "
          f"{parity['decomposed']['logits_max_abs']:.3g} (decomposed)")
    assert parity["passed"] and parity["tokens_identical"] and parity["logits_max_abs"] <= BOUND
    assert parity["decomposed"]["passed"]
    assert [i["name"] for i in graphs["io"]["prefill"]["inputs"]] == ["inputs_embeds", "position_ids"]
    assert [i["name"] for i in graphs["io"]["decode"]["inputs"]] == ["inputs_embeds", "position_ids",
                                                                     *_states("past_key_values")]
    for graph in ("prefill", "decode"):
        outputs = {o["name"]: o["shape"] for o in graphs["io"][graph]["outputs"]}
        assert list(outputs) == ["logits", *_states("present")]
        assert outputs["present.3.conv"][1:] == [CHANNELS, KERNEL] and outputs["present.3.recurrent"][1:] == RECURRENT
    for name, scans in (("prefill.onnx", len(DELTAS)), ("decode.onnx", 0)):
        model = onnx.load(bundle.bundle / "llm" / name, load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MultiHeadAttention") + ops.count("GroupQueryAttention") == len(ATTENTION), name
        assert ops.count("Conv") == len(DELTAS), name
        assert ops.count("Scan") == scans, name  # the prefill's delta rule over the prompt; a decode step is one step
    readme = (bundle.bundle / "README.md").read_text()
    assert "Layers 0, 1, 3 are gated delta-nets" in readme
    assert f"`present.{{i}}.recurrent` [batch, {', '.join(map(str, RECURRENT))}]" in readme


def _hf_prefill(ckpt, bundle, cat):
    """HF's forward on the bundle's kept rows inside generate's prompt (merged_checks.hf_prefill_at_kept)."""
    from vlmprune.compiler.frontend.minicpm_v import MiniCPMVFamily

    def kept_rows(model, pixel, kept):
        return hf_rows_of(MiniCPMVFamily(), model, torch.from_numpy(pixel), PATCH)[0, kept]

    return hf_prefill_at_kept(ckpt, bundle, cat, PROMPT, IMAGE, KEEP, kept_rows)


def test_graphs_are_hfs_forward_logits_and_states_over_prefill_and_decode(ckpt, bundle, cat):
    """Prefill logits, keys, values, convolution and recurrent states = HF's forward and its cache; then STEPS greedy
    steps, each decode graph's logits and states = HF's forward on its own cache. A zeroed recurrent state fails the
    same check, and HF's own cache with its recurrent states zeroed gives other logits."""
    from vlmprune.compiler.llm.torch_exporter import GraphRunner

    model, embed, embeds, position_ids, hf, cache = _hf_prefill(ckpt, bundle, cat)
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer" if t == "linear_attention" else
                                                                "DynamicLayer" for t in TYPES]
    graphs = GraphRunner(bundle.bundle / "llm")
    logits, state = graphs.prefill(embeds.numpy(), position_ids.numpy())
    assert state["past_key_values.3.conv"].shape == (1, CHANNELS, KERNEL)
    assert state["past_key_values.3.recurrent"].shape == (1, *RECURRENT)
    assert np.abs(state["past_key_values.3.conv"]).min() > 0  # the prompt fills the state: no zero column left
    position = int(position_ids[0, -1]) + 1
    saved = copy.deepcopy(cache)  # the prefill's cache, for the negative case below
    end = check_decode_against_hf("Qwen3.5", model, embed, graphs, state, hf, cache, logits, position, STEPS, BOUND)
    assert end["past_key_values.2.key"].shape[2] == embeds.shape[1] + STEPS
    assert end["past_key_values.0.conv"].shape[2] == KERNEL and end["past_key_values.0.recurrent"].shape[1:] == \
        tuple(RECURRENT)  # the states keep their sizes

    # the negative case: without the recurrent state the same check fails, and HF's logits move too
    def zero_hf(cache):
        for i in DELTAS:
            cache.layers[i].recurrent_states[0].zero_()

    check_state_matters("Qwen3.5", model, embed, graphs, state, hf, saved, logits, position, STEPS, BOUND, "recurrent",
                        zero_hf)


@pytest.mark.parametrize("length", [1, 5, 40, 300])
def test_prompts_of_any_length_give_hfs_logits_and_states(ckpt, bundle, length):
    """A text prompt of `length` tokens through the prefill graph (the delta rule scanned row by row) = HF's forward
    (its chunked form, 64-row chunks), logits and every state within the bound, then two decode steps on them. Where
    HF's fp32 forward itself is further than the bound from its fp64 run (the attention layer's keys and values, |x|
    up to ~10, at long prompts), a state is held to that floor instead: within twice HF's own fp32 error, and the
    graph's state is as near the fp64 run as HF's."""
    from transformers import AutoModelForImageTextToText

    from vlmprune.compiler.llm.torch_exporter import GraphRunner, reference_states

    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    embed = model.get_input_embeddings()
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=torch.arange(length)[None], use_cache=True)
        exact = copy.deepcopy(model).double()(input_ids=ids, position_ids=torch.arange(length)[None], use_cache=True)
        embeds = embed(ids)
    graphs = GraphRunner(bundle.bundle / "llm")
    logits, state = graphs.prefill(embeds.numpy(), np.arange(length)[None])
    hf = out.logits[0, -1].float()
    gap = float(np.abs(logits - hf.numpy()).max())
    worst = {}
    for name, want in reference_states(out.cache).items():
        got = state[name.replace("present.", "past_key_values.", 1)]
        fp64 = reference_states(exact.cache)[name].numpy()
        figures = (float(np.abs(got - want.numpy()).max()), float(np.abs(want.numpy() - fp64).max()),
                   float(np.abs(got - fp64).max()))  # graph vs HF, HF vs fp64, graph vs fp64
        worst[name] = figures
        assert figures[0] <= max(BOUND, 2 * figures[1]) and figures[2] <= max(BOUND, 2 * figures[1]), (name, figures)
    print(f"Qwen3.5 prompt of {length} tokens: prefill logits max-abs {gap:.3g}; states (graph vs HF, HF fp32 vs "
          f"fp64): delta-nets {max(v[0] for k, v in worst.items() if '.key' not in k and '.value' not in k):.3g}, "
          f"keys/values {max(worst[k][0] for k in worst if k.endswith(('.key', '.value'))):.3g} "
          f"(HF's own {max(worst[k][1] for k in worst if k.endswith(('.key', '.value'))):.3g})")
    assert gap <= BOUND
    assert all(v[0] <= BOUND for k, v in worst.items() if k.endswith((".conv", ".recurrent")))  # the bound, plainly
    if length < KERNEL:  # zeros before the prompt, as transformers pads the conv state
        assert not state["past_key_values.0.conv"][..., :KERNEL - length].any()

    def states_match(_logits, _want, state, cache):
        assert state_gap(state, cache) <= max(BOUND, 2 * max(v[1] for v in worst.values()))

    check_greedy_steps(model, embed, graphs, state, hf, out.cache, logits, length, 2, atol=BOUND,
                       on_step=states_match)


def test_generate_answers_through_the_bundles_graphs_with_hfs_greedy_tokens(bundle, ckpt, cat):
    """`vlmprune generate` decodes with the bundle's graphs (the delta-nets' states carried step to step like the
    caches) and gives HF's greedy tokens and first logits on the same pruned features (--reference)."""
    check_generate_through_graphs(bundle.bundle, ckpt, cat, PROMPT, KEEP)


def test_check_runs_the_llm_parity_again(bundle, ckpt):
    check_llm_again(bundle.bundle, ckpt)


@pytest.mark.parametrize("args, line", [
    (["--fastv-layer", "1", "--image-start", "3"], "--fastv-layer with language model type 'qwen3_5_text' is not "
                                                   "supported: FastV's reference runs every layer as attention"),
    (["--llm-exporter", "genai"], "language model type 'qwen3_5_text' is not supported by the onnxruntime-genai "
                                  "exporter"),
    (["--target", "orin"], "is model type 'minicpmv4_6'")],
    ids=["fastv", "genai", "edgellm"])
def test_what_the_exporters_do_not_take_is_refused_in_one_line_before_any_work(ckpt, tmp_path, args, line):
    """FastV (its reference runs every layer as attention), onnxruntime-genai's builder and Edge-LLM's exporter (their
    decoders have no linear-attention layers): one line each, before the tower's export, nothing written."""
    result = run_cli("compile", ckpt, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6", "--with-llm", *args)
    one_line_error(result, line)
    assert "emit target" not in result.output and not (tmp_path / "b").exists()
