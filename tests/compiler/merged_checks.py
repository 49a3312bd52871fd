"""The checks the merged-token families' tests make alike (SmolVLM, Gemma 3, InternVL3, LFM2-VL: pruned after a
patch-merging connector), written once: a pruned bundle's rows against the family's own Hugging Face rows on ort,
parity on each target, `vlmprune methods`. Each family's test module keeps its own fixtures, parameters and what
only it has; what differs between them (how HF is fed, the sizes) is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch

from cli_helpers import run_cli
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.parity.reference import torch_reference
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets import qnn_tools
from vlmprune.targets.runtime import ort_session, run_session


# The cases every merged-token family's tests run (parametrize with them): other methods on ort, the TensorRT targets
# (host parity), the HTP emulator and the RKNN simulator.
OTHER_METHODS = ("method, options", [("dart", {"pivots": 2}), ("random", {"site": "features"}),
                                     ("grid", {"site": "features"})])
TENSORRT_CASES = ("target, method, batch, options", [("orin", "divprune", 3, {}), ("xavier", "dart", 1, {"pivots": 2})])
QNN_RK3588_CASES = ("target, method", [("qnn", "divprune"), ("rk3588", "divprune")])


def refused_methods(inside: str, scored: str) -> list[tuple[list[str], str]]:
    """(compile arguments, the refusal's words) for the methods a merged-token family refuses: those inside the tower
    (`inside`: the family's why_not_block words) and those scored by the tower (`scored`: its why_not_scored's)."""
    block = [(["--method", name], inside) for name in ("cls", "visionzip", "tome", "random")]
    return block + [(["--method", "cls", "--score", "attention"], scored), (["--method", "holov"], scored),
                    (["--method", "cdpruner"], scored)]


def assert_close(got, expected) -> None:
    """fp32 rows equal to the reference's, to 1e-5 of its largest value."""
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), rtol=1e-5,
                               atol=1e-5 * float(torch.as_tensor(expected).abs().max()))


def hf_rows_of(family, model, pixel: torch.Tensor, patch: int) -> torch.Tensor:
    """get_image_features' rows [B, T, D] for B square images [B, 3, S, S], fed as the family's processor feeds them
    (family.hf_image_inputs), one image's rows a pooler_output entry."""
    import types

    source = types.SimpleNamespace(image_size=pixel.shape[-1], patch_size=patch)
    with torch.inference_mode():
        rows = model.model.get_image_features(**family.hf_image_inputs(None, source, pixel.numpy()))
    return torch.stack(list(rows.pooler_output))


def check_dense_rows(source, hf_rows: Callable[[torch.Tensor], torch.Tensor], *, size: int, tokens: int,
                     width: int) -> None:
    """The dense pipeline at one square size: its merged grid's token counts, and at batch 1 and 3 rows equal to HF's
    own (hf_rows: pixels [B, 3, S, S] -> get_image_features' [B, T, D])."""
    assert not source.has_cls and source.num_patches == tokens and source.image_size == size
    side = round(tokens ** 0.5)
    assert source.details["token_counts"]["merged_grid_thw"] == [1, side, side]
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, tokens, width)
        assert_close(got, hf_rows(x))


def check_rows_on_ort(result, model_dir, hf_rows: Callable[[torch.Tensor], torch.Tensor], *, size: int, keep: int,
                      tokens: int, width: int, family: str, readme: str) -> None:
    """A divprune bundle on ort: its outputs, standard ops only and no Conv (the patch embedding is one MatMul), both
    graphs pass the ONNX checker, and at batch 1 and 3 their rows are the torch reference's and HF's own rows
    (hf_rows: pixels [B, 3, S, S] -> get_image_features' [B, T, D]) at kept_indices."""
    assert result.report.passed, result.manifest["parity"]
    manifest = result.manifest
    outputs = {o["name"]: o["shape"] for o in manifest["outputs"]}
    assert outputs == {"image_features": ["batch", keep, width], "kept_indices": ["batch", keep]}
    assert manifest["method"]["site"] == "features" and manifest["method"]["num_patches"] == tokens
    assert manifest["model"]["family"] == family
    assert readme in (result.bundle / "README.md").read_text()
    source = load_source(str(model_dir))
    record = manifest.record
    assert record.method == "divprune"
    library = (result.bundle / manifest["target"]["custom_op_library"],)
    decomposed = onnx.load(str(result.bundle / "model.decomposed.onnx"), load_external_data=False)
    assert {n.domain for n in decomposed.graph.node} <= {"", "ai.onnx"}  # standard ops only
    assert "Conv" not in {n.op_type for n in decomposed.graph.node}  # the patch embedding is one MatMul
    for graph in ("model.decomposed.onnx", "model.onnx"):
        onnx.checker.check_model(str(result.bundle / graph), full_check=True)
        for batch in (1, 3):
            pixel, _ = parity_inputs(batch, size, source.mean, source.std)
            _, expected = torch_reference(source, record, pixel)
            got = run_session(ort_session(result.bundle / graph, library), pixel)
            np.testing.assert_array_equal(got["kept_indices"], expected.outputs["kept_indices"])
            np.testing.assert_allclose(got["image_features"], expected.outputs["image_features"], rtol=1e-4, atol=1e-5)
            hf = hf_rows(torch.from_numpy(pixel)).numpy()
            assert_close(got["image_features"], np.take_along_axis(hf, got["kept_indices"][..., None], axis=1))


def compiled(model_dir, out, **options):
    """compile_model with these CompileOptions, its parity passed."""
    result = compile_model(str(model_dir), out, CompileOptions(**options))
    assert result.report.passed, result.manifest["parity"]
    return result


def stages(result) -> list[dict]:
    return json.loads((result.bundle / "parity.json").read_text())["stages"]


def check_other_method(model_dir, out, method: str, options: dict, *, keep: int, width: int, **more):
    """Another method on ort: parity, and K rows of the LLM's width."""
    result = compiled(model_dir, out, method=method, keep=keep, method_options=options, **more)
    outputs = {o["name"]: o["shape"] for o in result.manifest["outputs"]}
    assert outputs["kept_indices"][-1] == keep and outputs["image_features"][-1] == width
    return result


def check_tensorrt(model_dir, out, target: str, method: str, batch: int, options: dict) -> None:
    """orin / xavier (host parity): every stage passes."""
    result = compiled(model_dir, out, target=target, method=method, keep=6, batch=batch, method_options=options)
    assert len(stages(result)) >= 3 and all(s["passed"] for s in stages(result))


def check_openvino(model_dir, out) -> None:
    pytest.importorskip("openvino", reason="openvino is not installed (pip install 'vlmprune[openvino]')")
    result = compiled(model_dir, out, target="openvino", method="divprune", keep=6)
    assert any("openvino" in s["stage"] for s in stages(result)), [s["stage"] for s in stages(result)]


def check_qnn_or_rk3588(request, model_dir, out, target: str, method: str) -> None:
    """The whole graph, connector too, on the HTP emulator (int16) or the RKNN simulator (fp16), each gated on its
    toolchain."""
    if target == "rk3588":
        request.getfixturevalue("rknn_ready")
    elif not qnn_tools.available()[0]:
        pytest.skip(f"QNN toolchain unavailable: {qnn_tools.available()[1]}")
    result = compiled(model_dir, out, target=target, method=method, keep=6, batch=1)
    assert len(stages(result)) >= 3


def check_methods_listing(name: str) -> None:
    """`vlmprune methods` names the family among divprune's and dart's, not among the block-site methods'."""
    result = run_cli("methods")
    assert result.exit_code == 0
    lines = {}
    for line in result.output.splitlines():
        if line and not line.startswith(" "):
            method = line.split(":")[0]
        elif line.strip().startswith("serves:"):
            lines[method] = line
    assert name in lines["divprune"] and name in lines["dart"]
    assert name not in lines["cls"] and name not in lines["visionzip"]


# ---------------------------------------------------------------------------------------------- the LLM side


def llm_side_fixtures(build: Callable, name: str, **options):
    """The LLM-side fixtures of a family's test module, (llm_dir, cat, llm_bundle), to assign to those names there:
    build(path) saves its tiny checkpoint with a tokenizer; the bundle is divprune K=8 (options: more
    CompileOptions)."""

    @pytest.fixture(scope="module")
    def llm_dir(tmp_path_factory):
        return build(tmp_path_factory.mktemp(f"tiny_{name}_llm"))

    @pytest.fixture(scope="module")
    def cat(tmp_path_factory):
        return cat_image(tmp_path_factory)

    @pytest.fixture(scope="module")
    def llm_bundle(llm_dir, tmp_path_factory):
        out = tmp_path_factory.mktemp(f"{name}_llm") / "divprune"
        return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8, **options))

    return llm_dir, cat, llm_bundle


def cat_image(tmp_path_factory):
    """skimage's cat, saved as a PNG for generate's --image."""
    from PIL import Image
    from skimage import data

    path = tmp_path_factory.mktemp("images") / "cat.png"
    Image.fromarray(data.chelsea()).save(path)
    return path


def check_dense_splice(llm_dir, image, prompt_text: str, tokens: int, width: int):
    """generate's dense splice of the model's own rows gives HF's own forward's first logits; (vlm, prompt, pixel)."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.evaluate import hf_first_logits

    vlm = gen.load_vlm(str(llm_dir))
    pixel, _ = gen.load_pixels(vlm, image)
    prompt = gen.build_prompt(vlm, prompt_text)
    rows = gen.dense_image(vlm, pixel)
    assert rows.rows.shape == (tokens, width)
    positions, text_start = rows.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, rows.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, tokens)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    return vlm, prompt, pixel, hf


def check_pruned_splice(llm_bundle, llm_dir, image, prompt_text: str, tokens: int, image_token: int,
                        hf_rows: Callable, pooled: Callable = lambda rows: rows, extra: Callable = lambda ids: {}):
    """The bundle's kept rows, spliced by generate at their original positions, give the logits of HF's own forward
    given its own tower's rows of those tokens (hf_rows(model, pixel) [1, T, D], as its mm_encoder_outputs take them:
    pooled(rows)) at those positions, with the family's further arguments (extra(ids)); consecutive positions give
    others. Returns HF's logits as a function of the image positions and of arguments overriding those."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from vlmprune.compiler import generate as gen

    assert llm_bundle.report.passed, llm_bundle.manifest["parity"]
    vlm = gen.load_vlm(str(llm_dir))
    pixel, _ = gen.load_pixels(vlm, image)
    prompt = gen.build_prompt(vlm, prompt_text)
    bundle = gen.bundle_tokens(llm_bundle.bundle, llm_bundle.manifest, pixel, vlm)
    kept = np.asarray(bundle.kept)
    offset = len(prompt.before)
    positions, text_start = gen.bundle_positions(bundle, offset)
    np.testing.assert_array_equal(positions, offset + kept)  # original positions: the dense grid's
    assert text_start == offset + tokens
    ours = gen.answer(vlm, prompt, bundle.features, positions, text_start, 1)

    model = vlm.model
    rows = hf_rows(model, torch.from_numpy(pixel))[0, kept]
    ids = torch.tensor([prompt.before + [image_token] * len(kept) + prompt.after])

    def logits(image_positions, **overrides):
        position_ids = torch.from_numpy(np.concatenate([np.arange(offset), image_positions,
                                                        text_start + np.arange(len(prompt.after))]))[None]
        with torch.inference_mode():
            return model(input_ids=ids, position_ids=position_ids, logits_to_keep=1,
                         mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=pooled(rows))},
                         **{**extra(ids), **overrides}).logits[0, -1].float()

    hf = logits(positions)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    assert (logits(offset + np.arange(len(kept))) - hf).abs().max() > 1e-4  # the positions count
    return lambda **overrides: logits(positions, **overrides), hf


def check_generate_cli(llm_bundle, llm_dir, image, prompt_text: str, keep: int = 8) -> None:
    """`vlmprune generate` answers through the bundle and the family's LLM (transformers), with its chat template."""
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", image,
                     "--prompt", prompt_text, "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert f"pruned: {keep} image tokens" in result.output and "the checkpoint's chat template" in result.output


def check_eval(llm_bundle, llm_dir, tmp_path, prompts: list[str], tokens: int, keep: int = 8):
    """eval's harness holds (its dense splice is HF's forward), and the bundle's rows give its reference's figures.
    Returns (the report, its images folder) for the family's own checks (check_eval_is_generate)."""
    from skimage import data

    from cli_helpers import eval_inputs
    from vlmprune.compiler.evaluate import evaluate

    images, prompts = eval_inputs(tmp_path, {"cat.png": data.chelsea(), "coffee.png": data.coffee()}, prompts)
    report = evaluate(str(llm_dir), images, prompts, ["divprune"], [keep], max_new_tokens=2,
                      bundles=[llm_bundle.bundle])
    assert report["harness_kl_max"] < 1e-8 and report["dense_image_tokens"] == tokens
    reference, compiled = report["results"]
    assert reference["from"] == "reference" and compiled["from"].startswith("bundle")
    for a, b in zip(reference["samples"], compiled["samples"]):
        assert np.isfinite(a["kl"]) and a["kl"] > 0
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6) and a["pruned_tokens"] == b["pruned_tokens"]
    return report, images


def check_eval_is_generate(report: dict, llm_bundle, llm_dir, images) -> None:
    """eval's answers are generate's: each sample of the bundle's row, the tokens `generate` gives through the bundle on
    that image and prompt, and its dense tokens `generate --dense`'s (one code path for both commands' prompts,
    pixels and splices, so that eval's figures describe what generate answers)."""
    from vlmprune.compiler import generate as gen

    row = next(r for r in report["results"] if r["from"].startswith("bundle"))
    steps = report["max_new_tokens"]
    for sample in row["samples"]:
        image = images / sample["image"]
        pruned = gen.generate(llm_bundle.bundle, str(llm_dir), image, sample["prompt"], max_new_tokens=steps)
        dense = gen.generate(llm_bundle.bundle, str(llm_dir), image, sample["prompt"], max_new_tokens=steps,
                             dense=True)
        assert pruned.answer.tokens == sample["pruned_tokens"] and dense.answer.tokens == sample["dense_tokens"]
        assert pruned.answer.image_tokens == sample["image_tokens"]


def check_generate_through_graphs(bundle_dir, model_dir, image, prompt_text: str, keep: int) -> str:
    """`vlmprune generate` on a --with-llm bundle decodes with llm/prefill.onnx + decode.onnx by default and gives
    the greedy tokens (and first logits) of HF's own language model on the same pruned features (--reference);
    then the CLI's run of it. Returns the CLI's output for the family's own checks."""
    from vlmprune.compiler import generate as gen

    graph = gen.generate(bundle_dir, str(model_dir), image, prompt_text, max_new_tokens=6)
    assert graph.llm == "the bundle's LLM graphs (llm/prefill.onnx + llm/decode.onnx, ONNX Runtime)"
    reference = gen.generate(bundle_dir, str(model_dir), image, prompt_text, max_new_tokens=6, reference=True)
    assert reference.llm.startswith("transformers (--reference")
    assert graph.kept == reference.kept and len(graph.kept) == keep
    assert graph.answer.position_ids == reference.answer.position_ids
    torch.testing.assert_close(graph.answer.first_logits, reference.answer.first_logits, rtol=0, atol=1e-4)
    assert graph.answer.tokens == reference.answer.tokens and len(graph.answer.tokens) >= 2
    result = run_cli("generate", bundle_dir, "--model", model_dir, "--image", image, "--prompt", prompt_text,
                     "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "language model: the bundle's LLM graphs" in result.output
    assert f"pruned: {keep} image tokens" in result.output
    return result.output



def check_greedy_steps(model, embed, graphs, state, hf, cache, logits, position: int, steps: int = 6,
                       step_extra: Callable = lambda token: {}, atol: float = 1e-4,
                       on_step: Callable | None = None) -> dict:
    """After a prefill that matched (hf and cache: HF's last logits and cache; logits and state: the bundle's prefill
    graph's), `steps` greedy decode steps from position on: each step's logits from the bundle's decode graph
    (graphs.step, given step_extra(token ids [1, 1]): Gemma 4's per-layer embeddings) equal HF's forward on its own
    cache, and both pick the same token. on_step(logits, hf logits, state, cache) after each step: a caller's own
    figures (the caches' gap). Returns the decode graph's last state."""
    token = int(hf.argmax())
    assert int(np.argmax(logits)) == token
    for _ in range(steps):
        with torch.inference_mode():
            step = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache,
                         use_cache=True)
            hf, cache = step.logits[0, -1].float(), step.cache
            row = embed(torch.tensor([[token]]))
        logits, state = graphs.step(row.numpy(), np.array([[position]]), state, step_extra(torch.tensor([[token]])))
        np.testing.assert_allclose(logits, hf.numpy(), rtol=0, atol=atol)
        if on_step is not None:
            on_step(logits, hf.numpy(), state, cache)
        token, position = int(hf.argmax()), position + 1
        assert int(np.argmax(logits)) == token
    return state


def hf_prefill_at_kept(model_dir, bundle, image, prompt_text: str, image_token: int, keep: int,
                       kept_rows: Callable, rows_as_batch: bool = False):
    """(model, embed, graphs' prefill inputs, HF's last logits and cache): a bundle's kept rows (HF's own tower rows,
    kept_rows(model, pixel, kept) [keep, D]) at their original positions inside generate's prompt, through HF's
    full-model forward: what the exported prefill must equal (check_decode_against_hf). rows_as_batch: the model's
    forward takes the rows as one [1, keep, D] tensor (InternVL's), not a list of one image's (LFM2-VL's,
    MiniCPM-V's)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(model_dir))
    pixel, _ = gen.load_pixels(vlm, image)
    prompt = gen.build_prompt(vlm, prompt_text)
    tokens = gen.bundle_tokens(bundle.bundle, bundle.manifest, pixel, vlm)
    offset = len(prompt.before)
    positions, text_start = gen.bundle_positions(tokens, offset)
    model = vlm.model
    with torch.inference_mode():
        rows = kept_rows(model, pixel, np.asarray(tokens.kept))
        ids = torch.tensor([prompt.before + [image_token] * keep + prompt.after])
        position_ids = torch.from_numpy(np.concatenate([np.arange(offset), positions,
                                                        text_start + np.arange(len(prompt.after))]))[None]
        assert position_ids[0, offset + keep - 1] - position_ids[0, offset] > keep  # gaps: original positions
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids), use_cache=True,
                    logits_to_keep=1, mm_encoder_outputs={"image": BaseModelOutputWithPooling(
                        pooler_output=rows[None] if rows_as_batch else [rows])})
        embed = model.get_input_embeddings()
        embeds = torch.cat([embed(torch.tensor([prompt.before])), rows[None], embed(torch.tensor([prompt.after]))], 1)
    return model, embed, embeds, position_ids, out.logits[0, -1].float(), out.cache


def state_gap(state, cache) -> float:
    """The largest gap between a decode graph's state and HF's cache, every key, value and other state (convolution,
    recurrent) by name (torch_exporter.reference_states), the same names on both sides."""
    from vlmprune.compiler.llm.torch_exporter import reference_states

    want = {k.replace("present.", "past_key_values.", 1): v for k, v in reference_states(cache).items()}
    assert set(want) == set(state)
    return max(float(np.abs(state[k] - v.numpy()).max()) for k, v in want.items())


class ZeroedStates:
    """A bundle's graphs with every state named *.suffix (conv, recurrent) zeroed before a decode step: what a decode
    graph that keeps no such state computes (the negative case of the hybrid decoders' tests)."""

    def __init__(self, graphs, suffix: str):
        self.graphs, self.suffix = graphs, f".{suffix}"

    def step(self, embeds, positions, state, extra=None):
        blank = {k: np.zeros_like(v) if k.endswith(self.suffix) else v for k, v in state.items()}
        return self.graphs.step(embeds, positions, blank, extra)


def check_decode_against_hf(label: str, model, embed, graphs, state, hf, cache, logits, position: int, steps: int,
                        bound: float) -> dict:
    """Prefill logits and states = HF's forward and its cache (state_gap: every key, value and other state by name),
    then `steps` greedy steps (check_greedy_steps), each decode graph's logits and states = HF's on its own cache, all
    within bound; the figures printed under label. Returns the last decode state. cache is advanced in place."""
    figures = {"prefill logits": float(np.abs(logits - hf.numpy()).max()), "prefill states": state_gap(state, cache)}
    gaps = []

    def on_step(logits, want, state, cache):
        gaps.append((float(np.abs(logits - want).max()), state_gap(state, cache)))

    end = check_greedy_steps(model, embed, graphs, state, hf, cache, logits, position, steps, atol=bound,
                             on_step=on_step)
    figures["decode logits"] = max(g[0] for g in gaps)
    figures["decode states"] = max(g[1] for g in gaps)
    print(f"{label} graphs vs HF's forward, {steps} decode steps: "
          + ", ".join(f"{k} max-abs {v:.3g}" for k, v in figures.items()))
    assert all(v <= bound for v in figures.values()), figures
    return end


def check_state_matters(label: str, model, embed, graphs, state, hf, saved, logits, position: int, steps: int,
                        bound: float, suffix: str, zero_hf: Callable) -> None:
    """The negative case of a hybrid decoder's test: with every *.suffix state zeroed the graphs fail the same greedy
    check, and HF's own cache with those states zeroed (zero_hf(cache)) moves its logits too, both by over 100 bounds:
    the state is read, so parity would catch a graph that drops it. saved: the prefill's cache (not advanced)."""
    import copy

    zeroed_graphs = ZeroedStates(graphs, suffix)
    with pytest.raises(AssertionError):
        check_greedy_steps(model, embed, zeroed_graphs, state, hf, copy.deepcopy(saved), logits, position, steps,
                           atol=bound)
    token = torch.tensor([[int(hf.argmax())]])
    zeroed = zeroed_graphs.step(embed(token).detach().numpy(), np.array([[position]]), state)[0]
    with torch.inference_mode():
        want = model(input_ids=token, position_ids=torch.tensor([[position]]), cache=copy.deepcopy(saved),
                     use_cache=True).logits[0, -1].float()
        blank = copy.deepcopy(saved)
        zero_hf(blank)
        hf_blank = model(input_ids=token, position_ids=torch.tensor([[position]]), cache=blank,
                         use_cache=True).logits[0, -1].float()
    print(f"{label} without the {suffix} state: decode logits max-abs {np.abs(zeroed - want.numpy()).max():.3g} "
          f"(bound {bound:g}); HF with its {suffix} states zeroed {float((hf_blank - want).abs().max()):.3g}")
    assert np.abs(zeroed - want.numpy()).max() > 100 * bound
    assert float((hf_blank - want).abs().max()) > 100 * bound


def check_llm_again(bundle_dir, model_dir) -> None:
    """`vlmprune check` on a --with-llm bundle runs its one `llm` parity stage again, and it passes."""
    checked = run_cli("check", bundle_dir, "--model", model_dir, "--json")
    assert checked.exit_code == 0, checked.output
    llm = [s for s in json.loads(checked.stdout)["stages"] if s["stage"] == "llm"]
    assert len(llm) == 1 and llm[0]["passed"], llm


def compile_tiles(model_dir, out, grid: str, **options):
    """A tiled bundle (--grid) of a tiled family (InternVL3, SmolVLM), divprune K = 10 unless options say otherwise;
    every parity stage passes."""
    options = {"method": "divprune", "keep": 10, **options}
    result = compile_model(str(model_dir), out, CompileOptions(family_options={"grid": grid}, **options))
    assert result.report.passed, result.manifest["parity"]
    return result


def check_tile_rows(result, pixel: np.ndarray, hf_rows: torch.Tensor, *, tiles: int, tokens: int, keep: int) -> None:
    """A tiled bundle's rows, run as its target's last parity stage here runs them (ort and orin / xavier: model.onnx
    on ONNX Runtime, TensorRT's stand-in with the plugins' host twin; openvino: the IR on the CPU plugin), on the
    image's tiles pixel, are HF's rows of those tiles end to end (hf_rows [tiles·tokens, D]) at kept_indices, and the
    equal split keeps rows of every tile."""
    from vlmprune.targets import get_target

    m = result.manifest
    out = get_target(m["target"]["name"]).stages(result.bundle, m)[-1].run(pixel)
    features, kept = out["image_features"], out["kept_indices"]
    assert features.shape == (1, keep, hf_rows.shape[-1]) and kept.shape == (1, keep)
    assert kept.min() >= 0 and kept.max() < tiles * tokens and len(set(kept[0].tolist())) == keep
    assert len(set((kept[0] // tokens).tolist())) == tiles
    assert_close(torch.from_numpy(features[0]), hf_rows[torch.from_numpy(kept[0]).long()])


def check_pruned_tiles_splice(result, model_dir, image, prompt_text: str, image_token: int, hf_rows: Callable,
                              pooled: Callable = lambda rows: rows[None]):
    """A bundle over one image's parts (tiles, MiniCPM-V's slices): its kept rows, spliced by generate among the
    processor's text between the parts (Prompt.between, Prompt.tile_rows: between_tiles), give the logits of HF's own
    forward on the processor's prompt (hf_forward_ids: every part's rows and the text between) with the pruned image
    tokens dropped, fed its own tower's rows of the kept tokens (hf_rows(model, pixel): the image's rows end to end,
    [T, D] or [parts, T_c, D]; as the forward's mm_encoder_outputs take them: pooled(rows)), every kept and marker token
    at its dense position; consecutive positions give other logits. Written once: the tiled families differ only in
    how HF is fed. Returns (vlm, pixel, the line load_pixels says, kept)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(model_dir), bundle=result.manifest)
    pixel, described = gen.load_pixels(vlm, image)
    prompt = gen.build_prompt(vlm, prompt_text)
    tokens = gen.bundle_tokens(result.bundle, result.manifest, pixel, vlm)
    kept = np.asarray(tokens.kept)
    assert (np.diff(kept) > 0).all()  # raster order: the kept rows meet the image tokens in the same order
    positions, text_start = gen.bundle_positions(tokens, len(prompt.before))
    ours = gen.answer(vlm, prompt, tokens.features, positions, text_start, 1)

    dense = gen.hf_forward_ids(vlm, prompt, tokens.llm["dense_image_tokens"])["input_ids"][0]
    slots = np.flatnonzero(dense.numpy() == image_token)  # the dense image tokens, part by part
    assert len(slots) == tokens.llm["dense_image_tokens"]
    keep = np.ones(len(dense), dtype=bool)
    keep[np.setdiff1d(slots, slots[kept])] = False
    ids, where = dense[torch.from_numpy(keep)][None], np.flatnonzero(keep)
    assert ours.position_ids == where.tolist()
    all_rows = hf_rows(vlm.model, torch.from_numpy(pixel))
    rows = all_rows.reshape(-1, all_rows.shape[-1])[torch.from_numpy(kept)]

    def logits(position_ids):
        with torch.inference_mode():
            return vlm.model(input_ids=ids, position_ids=torch.from_numpy(position_ids)[None], logits_to_keep=1,
                             mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=pooled(rows))},
                             ).logits[0, -1].float()

    hf = logits(where)
    print(f"{len(kept)} of {len(slots)} image tokens among {len(dense) - len(slots)} others: first logits max-abs "
          f"{float((ours.first_logits - hf).abs().max()):.3g} against HF's forward")
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)
    assert (logits(np.arange(len(where))) - hf).abs().max() > 1e-4  # the positions count
    return vlm, pixel, described, kept


def check_dense_tiles(model_dir, cut: Callable, hf_rows: Callable, *, resolution: int, tokens: int) -> None:
    """A 2x2 grid's five tiles (the grid, then the thumbnail) of a 300x280 photo: the dense pipeline's rows of each
    tile = HF's (hf_rows(pixel) [5·tokens, D]); cut(source.crops) gives the tiles as the family's processor cuts
    them."""
    from vlmprune.compiler.frontend.tiles import set_tiles

    source = load_source(str(model_dir))
    set_tiles(source, (2, 2))
    assert source.crops == {"grid": [2, 2], "count": 5, "side": 4, "thumbnail": True,
                            "resolution": [resolution, resolution]}
    pixel = torch.from_numpy(cut(source.crops))
    with torch.inference_mode():
        got = source.pipeline(pixel)
    assert got.shape[:2] == (5, tokens)
    assert_close(got.reshape(5 * tokens, -1), hf_rows(pixel).reshape(5 * tokens, -1))
