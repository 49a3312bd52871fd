"""The exported LLM graphs (prefill with FastV inside, decode step) against the plain-torch reference.

ONNX Runtime CPU at a fixed seed, batch 1 and 2, a tiny Llama (FastV after layer 2) and a tiny
Qwen2 (after layer 1): the last token's logits, the kept image tokens, every layer's present
key and value (two cache lengths), and greedy decoding on the shortened cache.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from test_fastv import tiny_lm
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm.torch_exporter import (DECODE, DECODE_DECOMPOSED, PREFILL, PREFILL_DECOMPOSED, export_decoder,
                                                  export_prefill)
from vlmprune.compiler.llm.fastv import FastVSpec, reference_generate, reference_prefill
from vlmprune.targets.runtime import ort_session

CASES = {"llama": (3, FastVSpec(image_start=3, image_len=16, layer=2, keep=0.5)),
         "qwen2": (2, FastVSpec(image_start=2, image_len=12, layer=1, keep=0.25))}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    layers, spec = CASES[request.param]
    model = tiny_lm(request.param, layers=layers, seed=7)
    folder = tmp_path_factory.mktemp(f"llm_{request.param}")
    info = export_decoder(model, spec, folder)
    return model, spec, folder, info


def _positions(batch: int, length: int, gaps: bool = False) -> torch.Tensor:
    """0..T-1, or (gaps) the positions a tower-pruned image hands over: text, kept patches' own, text after."""
    if not gaps:
        return torch.arange(length).expand(batch, -1)
    return torch.cat([torch.arange(length - 5), torch.arange(length + 10, length + 15)]).expand(batch, -1)


def _prefill(folder, embeds, positions):
    session = ort_session(folder / PREFILL)
    outs = session.run(None, {"inputs_embeds": embeds.numpy(), "position_ids": positions.numpy()})
    return dict(zip([o.name for o in session.get_outputs()], outs))


def test_graphs_are_valid_onnx_sharing_one_weights_file(exported):
    """The decomposed pair is standard ops only; the shipped pair has every layer's attention and
    every norm after a residual Add fused, nothing else."""
    model, spec, folder, info = exported
    layers = model.config.num_hidden_layers
    for name in (PREFILL_DECOMPOSED, DECODE_DECOMPOSED):
        onnx.checker.check_model(str(folder / name), full_check=True)
        proto = onnx.load(str(folder / name), load_external_data=False)
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    for name in (PREFILL, DECODE):
        onnx.checker.check_model(str(folder / name), full_check=True)
        proto = onnx.load(str(folder / name), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        assert {n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")} == {"com.microsoft"}
        assert ops.count("MultiHeadAttention") + ops.count("GroupQueryAttention") == layers and "Where" not in ops
        assert ops.count("GroupQueryAttention") == (layers if name == PREFILL else 0), name  # causal: prefill
        assert ops.count("Softmax") == (1 if name == PREFILL else 0)  # FastV's own score row stays
        # every norm right after a residual Add fused (passes.llm_norm_fusion): all 2·layers + 1 but the first
        # layer's input norm, and in prefill the one after FastV's selection (it reads the Gather of the kept rows)
        # and the final one (it reads the last row's Slice: the head runs on the last token)
        fused_norms = 2 * layers - (2 if name == PREFILL else 0)
        assert ops.count("SkipSimplifiedLayerNormalization") == fused_norms, name
        assert ops.count("Pow") == 2 * layers + 1 - fused_norms, name
    assert sorted(p.name for p in folder.iterdir()) == ["decode.decomposed.onnx", "decode.onnx", "llm.weights.bin",
                                                        "prefill.decomposed.onnx", "prefill.onnx"]
    names = [o["name"] for o in info["io"]["decode"]["inputs"]]
    assert names[:2] == ["inputs_embeds", "position_ids"] and names[2] == "past_key_values.0.key"


@pytest.mark.parametrize("batch,gaps", [(1, False), (2, False), (2, True)])
def test_prefill_matches_the_reference(exported, batch, gaps):
    model, spec, folder, _info = exported
    embeds = torch.randn(batch, spec.image_end + 5, 32, generator=torch.Generator().manual_seed(batch))
    positions = _positions(batch, embeds.shape[1], gaps)
    ref = reference_prefill(model, embeds, spec, positions)
    got = _prefill(folder, embeds, positions)
    np.testing.assert_array_equal(got["kept_image_indices"], ref.kept.numpy())
    np.testing.assert_allclose(got["logits"][:, 0], ref.logits.numpy(), rtol=0, atol=1e-4)
    for i, layer in enumerate(ref.cache.layers):
        np.testing.assert_allclose(got[f"present.{i}.key"], layer.keys.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[f"present.{i}.value"], layer.values.numpy(), rtol=0, atol=1e-4)
    lengths = {got[f"present.{i}.key"].shape[2] for i in range(len(ref.cache.layers))}
    assert lengths == {embeds.shape[1], embeds.shape[1] - spec.image_len + spec.kept}


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_decode_on_the_shortened_cache_matches_the_reference(exported, batch):
    model, spec, folder, _info = exported
    steps = 4
    embeds = torch.randn(batch, spec.image_end + 3, 32, generator=torch.Generator().manual_seed(20 + batch))
    expected = reference_generate(model, embeds, spec, steps)
    got = _prefill(folder, embeds, _positions(batch, embeds.shape[1]))
    layers = model.config.num_hidden_layers
    past = {f"past_key_values.{i}.{part}": got[f"present.{i}.{part}"] for i in range(layers)
            for part in ("key", "value")}
    tokens = [got["logits"][:, 0].argmax(-1)]
    decode = ort_session(folder / DECODE)
    names = [o.name for o in decode.get_outputs()]
    table = model.get_input_embeddings().weight.detach().numpy()
    for step in range(1, steps):
        feed = {"inputs_embeds": table[tokens[-1]][:, None],
                "position_ids": np.full((batch, 1), embeds.shape[1] + step - 1, dtype=np.int64), **past}
        outs = dict(zip(names, decode.run(None, feed)))
        tokens.append(outs["logits"][:, 0].argmax(-1))
        past = {f"past_key_values.{i}.{part}": outs[f"present.{i}.{part}"] for i in range(layers)
                for part in ("key", "value")}
    np.testing.assert_array_equal(np.stack(tokens, axis=1), expected.numpy())
    assert past["past_key_values.0.key"].shape[2] == embeds.shape[1] + steps - 1
    shortened = embeds.shape[1] - spec.image_len + spec.kept
    assert past[f"past_key_values.{layers - 1}.key"].shape[2] == shortened + steps - 1


def test_a_span_the_model_cannot_serve_is_refused_before_export():
    with pytest.raises(InputError, match="--fastv-layer must be between 1 and 1"):
        export_prefill(tiny_lm("qwen2", layers=2), FastVSpec(image_start=0, image_len=4, layer=2))


class _SplitsWrong(torch.nn.Module):
    def forward(self, x):
        a, b = x.split([2, 3], dim=-1)  # 5 of a dimension of 4: torch.export fails, deep inside
        return a.sum() + b.sum()


def test_an_exporter_failure_shows_its_cause_and_torch_says_nothing(capfd):
    """torch.onnx wraps the cause in "Failed to export the model with torch.export. This is step 1/3 ... Next
    steps:", and torch logs its own traceback on stderr: the line is the innermost exception, and nothing leaks."""
    from vlmprune.compiler.errors import VlmpruneError
    from vlmprune.compiler.frontend.export import torch_onnx

    with pytest.raises(VlmpruneError) as info:
        torch_onnx("torch.onnx export of the language model", _SplitsWrong(), (torch.zeros(1, 4),))
    assert str(info.value) == ("torch.onnx export of the language model failed: "
                               "ValueError: Split sizes add up to 5 but got the tensor's size of 4")
    assert "Next steps" in str(info.value.__cause__)  # the preamble it replaces
    assert capfd.readouterr().err == ""


def test_a_tools_log_gives_the_innermost_exception_of_its_last_chain():
    """The onnxruntime-genai builder's and Edge-LLM exporter's logs: a Python traceback chain, printed outermost last."""
    import subprocess
    import sys

    from vlmprune.compiler.errors import failure_cause

    script = ("import logging; logging.warning('ERROR-looking chatter first')\n"
              "try:\n    {}['mrope_section']\nexcept KeyError as e:\n"
              "    try:\n        raise ValueError('Split sizes add up to 14 but got the tensor size of 12') from e\n"
              "    except ValueError as f:\n        raise RuntimeError('Failed to export. Next steps:') from f\n")
    log = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True).stderr
    assert log.rstrip().endswith("RuntimeError: Failed to export. Next steps:")
    assert failure_cause(log) == "KeyError: 'mrope_section'"
    assert failure_cause("building...\nERROR: no such layer type\ndone") == "ERROR: no such layer type"


# ------------------------------------------------------------------ vlmprune compile --with-llm


def _cli(*args):
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("args,needle", [
    (["--target", "xavier", "--with-llm"], "--with-llm: target xavier does not take the language model yet"),
    (["--target", "orin", "--with-llm", "--fastv-layer", "1", "--image-start", "3"],
     "FastV is not part of TensorRT Edge-LLM's language-model graph"),
    (["--fastv-layer", "1"], "--fastv-layer applies to the language model: add --with-llm"),
    (["--with-llm", "--fastv-layer", "1"], "FastV needs --image-start"),
    (["--with-llm", "--fastv-layer", "1", "--image-start", "3", "--fastv-keep", "1.5"], "--fastv-keep is the share"),
    (["--with-llm", "--fastv-keep", "0.5"], "--fastv-keep needs --fastv-layer"),
    (["--llm-exporter", "genai"], "--llm-exporter applies to the language model: add --with-llm"),
    (["--with-llm", "--llm-exporter", "genai", "--fastv-layer", "1", "--image-start", "3"],
     "FastV cannot be compiled into onnxruntime-genai's graph"),
    (["--target", "orin", "--with-llm", "--llm-exporter", "torch"], "--llm-exporter applies to target ort"),
    (["--target", "qnn", "--with-llm"], "has no QNN execution provider"),
    (["--with-llm", "--fastv-layer", "2", "--image-start", "3"],  # demo's LLM has 2 layers
     "--fastv-layer must be between 1 and 1 (this LLM has 2 layers), got 2"),
])
def test_llm_options_are_refused_in_one_line_before_any_work(tmp_path, args, needle):
    result = _cli("compile", "demo", *args, "-o", tmp_path / "b")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in result.output
    assert not [line for line in result.output.splitlines() if line.startswith("[")]  # no step began: no load
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------ the exporter registry


def test_every_target_declares_exporters_the_registry_has():
    """A target names its exporters by id (targets sit below the LLM side); each id is one registered exporter."""
    from vlmprune.compiler.llm.export import EXPORTERS
    from vlmprune.targets import TARGETS

    assert all(cls.id == llm_id for llm_id, cls in EXPORTERS.items())
    for name, target in TARGETS.items():
        assert set(target.llm_exporters) <= set(EXPORTERS), name
        assert target.llm_exporters or target.no_llm_why != "no LLM toolchain", f"{name} says why it takes no LLM"
    taken = {i for target in TARGETS.values() for i in target.llm_exporters}
    assert taken == set(EXPORTERS)  # no exporter is left without a target
    assert {name: t.llm_exporters for name, t in TARGETS.items() if t.llm_exporters} == \
        {"ort": ("torch", "genai"), "orin": ("edgellm",)}


@pytest.mark.parametrize("target", ["xavier", "rk3588", "qnn", "openvino"])
def test_the_refusal_line_is_the_targets_declaration(tmp_path, target):
    from vlmprune.targets import TARGETS

    result = _cli("compile", "demo", "--target", target, "--with-llm", "-o", tmp_path / "b")
    assert result.exit_code == 2 and not (tmp_path / "b").exists()
    assert result.output.splitlines() == [f"error: --with-llm: target {target} does not take the language model yet "
                                          f"({TARGETS[target].no_llm_why}; supported: ort, orin)"]


def test_a_declaration_is_all_it_takes(monkeypatch):
    """Give xavier Edge-LLM in its declaration: it takes --with-llm, refuses --llm-exporter, and is listed."""
    from types import SimpleNamespace

    from vlmprune.compiler.llm.export import check_llm_options, exporter_for, exporter_lines
    from vlmprune.targets.tensorrt import XavierTarget

    monkeypatch.setattr(XavierTarget, "llm_exporters", ("edgellm",))
    options = SimpleNamespace(target="xavier", with_llm=True, llm_exporter=None, fastv_layer=None, fastv_keep=None,
                              image_start=None)
    assert exporter_for(options).id == "edgellm" and check_llm_options(options) is None
    with pytest.raises(InputError) as refused:
        check_llm_options(SimpleNamespace(**{**vars(options), "llm_exporter": "genai"}))
    assert str(refused.value) == ("--llm-exporter applies to target ort; target xavier's language model is exported "
                                  "with TensorRT Edge-LLM")
    with pytest.raises(InputError, match="FastV is not part of TensorRT Edge-LLM's language-model graph"):
        check_llm_options(SimpleNamespace(**{**vars(options), "fastv_layer": 1, "image_start": 3}))
    assert [line.split()[0] for line in exporter_lines()] == ["ort", "ort", "orin", "xavier", "rk3588", "qnn", "openvino"]
    assert next(line for line in exporter_lines() if line.split()[0] == "xavier").startswith(
        "  xavier   TensorRT Edge-LLM 0.11.0 exporter: ")


def test_check_and_readme_ask_the_exporter_by_its_id_never_by_the_exporter_string():
    from vlmprune.compiler.llm.export import check_llm, readme_section
    from vlmprune.compiler.bundle.manifest import Manifest

    # No exporter_id:
    legacy = Manifest({"llm_graphs": {"exporter": "TensorRT Edge-LLM 0.11.0 (tensorrt-edgellm-export)"}})
    line = ("the bundle's llm_graphs names no known LLM exporter (exporter_id None; known: torch, genai, edgellm): "
            "compile it again with this vlmprune")
    with pytest.raises(InputError) as exc:
        readme_section(legacy)
    assert str(exc.value) == line
    with pytest.raises(InputError) as exc:
        check_llm("demo", ".", legacy)
    assert str(exc.value) == line
    assert readme_section(Manifest()) == ""


def test_the_language_model_source_is_imported_one_way():
    """Every exporter reads the LM from lm_source; none imports the registry, another exporter, or FastV for it."""
    import ast
    from pathlib import Path

    import vlmprune.compiler.llm as llm

    def imports(module: str) -> set[str]:
        tree = ast.parse((Path(llm.__file__).parent / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    prefix = "vlmprune.compiler.llm."
    for module in ("torch_exporter", "genai", "edgellm", "fastv", "lm_source", "exporter"):
        assert prefix + "export" not in imports(module), module
    assert prefix + "fastv" not in imports("genai") and prefix + "fastv" not in imports("edgellm")
    assert prefix + "torch_exporter" not in imports("edgellm") | imports("genai")
    assert not {i for i in imports("lm_source") if i.startswith(prefix)}


def test_with_llm_adds_the_decoder_to_the_bundle_and_the_manifest_hashes_it(tiny_llava_dir, tmp_path):
    import json

    from vlmprune.compiler import bundle

    out = tmp_path / "b"
    result = _cli("compile", tiny_llava_dir, "--keep", 16, "--with-llm", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    manifest = bundle.load_manifest(out, verify=True)
    assert {"llm/prefill.onnx", "llm/decode.onnx", "llm/prefill.decomposed.onnx", "llm/decode.decomposed.onnx",
            "llm/llm.weights.bin"} <= set(manifest["files"])
    graphs = manifest["llm_graphs"]
    assert graphs["parity"]["passed"] and graphs["parity"]["tokens_identical"] and graphs["fastv"] is None
    assert graphs["parity"]["decomposed"]["passed"] and graphs["parity"]["fused_vs_decomposed"] <= 1e-4
    assert graphs["exporter_id"] == "torch" and graphs["exporter"].startswith("torch.onnx (dynamo)")
    assert "## The language model (`--with-llm`)" in (out / "README.md").read_text()
    assert json.loads(result.stdout)["parity"]["passed"] is True
    checked = _cli("check", out, "--json", "--junit", tmp_path / "check.xml")  # check re-runs the LLM's parity
    assert checked.exit_code == 0, checked.output
    stages = {s["stage"]: s for s in json.loads(checked.stdout)["stages"]}
    assert stages["llm"]["passed"] and stages["llm"]["runtime"] == "onnxruntime (prefill + decode)"
    assert set(stages["llm"]["outputs"]) == {"logits + present", "greedy tokens", "fused vs decomposed prefill",
                                             "decomposed: logits + present, greedy tokens"}
    assert 'classname="vlmprune.parity.llm"' in (tmp_path / "check.xml").read_text()
    with open(out / "llm" / "llm.weights.bin", "r+b") as f:  # one flipped byte: the bundle is refused
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(InputError, match="llm/llm.weights.bin"):
        bundle.load_manifest(out, verify=True)


@pytest.fixture(scope="module")
def tiny_qwen25_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL with a 2-layer language model (FastV needs a layer after the one that scores)."""
    from tiny_models import spread, tiny_qwen

    path = tiny_qwen(tmp_path_factory.mktemp("tiny_qwen25_llm"), "qwen2_5_vl", 5, num_hidden_layers=2,
                     num_attention_heads=4,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000.0})
    # attention near-uniform is blind to positions: sharpen the language model's q and k, and save again
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path)
    spread(model, suffixes=("q_proj.weight", "k_proj.weight"), std=0.3)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow
def test_qwen_language_model_takes_mrope_positions_with_fastv(tiny_qwen25_dir, tmp_path):
    """Qwen2.5-VL's LLM: position_ids [3, batch, sequence] (t, h, w), FastV inside, parity at compile and in check."""
    import json

    out = tmp_path / "b"
    result = _cli("compile", tiny_qwen25_dir, "--target", "ort", "--method", "divprune", "--keep", 8,
                  "--image-size", 112, "--with-llm", "--fastv-layer", 1, "--image-start", 2, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    graphs = json.loads((out / "manifest.json").read_text())["llm_graphs"]
    assert graphs["family"] == "qwen2_5_vl_text" and graphs["mrope"] is True
    inputs = {v["name"]: v["shape"] for v in graphs["io"]["prefill"]["inputs"]}
    assert len(inputs["position_ids"]) == 3 and inputs["position_ids"][0] == 3
    assert graphs["fastv"]["kept"] == 4 and graphs["parity"]["passed"] and graphs["parity"]["kept_identical"]
    assert "[3, batch, sequence]" in (out / "README.md").read_text()
    checked = _cli("check", out, "--json")
    assert checked.exit_code == 0, checked.output
    assert [s["passed"] for s in json.loads(checked.stdout)["stages"] if s["stage"] == "llm"] == [True]


def test_fastv_layer_out_of_range_is_refused_before_the_export(tiny_qwen25_dir, tmp_path):
    """The LLM's layer count comes from the checkpoint's config; it was refused 9 s in, after the tower's export."""
    result = _cli("compile", tiny_qwen25_dir, "--method", "divprune", "--keep", 8, "--image-size", 112, "--with-llm",
                  "--fastv-layer", 2, "--image-start", 2, "-o", tmp_path / "b")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == ["error: --fastv-layer must be between 1 and 1 (this LLM has 2 layers), got 2"]
    assert not (tmp_path / "b").exists()


def test_mrope_positions_are_not_the_1d_ones(tiny_qwen25_dir, tmp_path):
    """The parity prompt's image span has h and w that differ from t: 1-D positions would give other logits."""
    from vlmprune.compiler.llm.fastv import reference_prefill
    from vlmprune.compiler.llm.lm_source import language_model
    from vlmprune.compiler.llm.torch_exporter import parity_positions

    lm = language_model(str(tiny_qwen25_dir))
    positions = parity_positions(lm.config, 1, 14, 2, 9)
    assert positions.shape == (3, 1, 14)
    assert positions[:, 0, 2].tolist() == [2, 2, 2] and positions[:, 0, 10].tolist() == [2, 4, 4]
    assert positions[:, 0, 11].tolist() == [5, 5, 5]  # text resumes after the span's largest position
    embeds = torch.randn(1, 14, 48, generator=torch.Generator().manual_seed(0))
    grid = reference_prefill(lm, embeds, None, positions).cache.layers[0].keys  # [1, kv_heads, T, d] after RoPE
    flat = reference_prefill(lm, embeds, None, positions[0:1].expand(3, -1, -1)).cache.layers[0].keys
    torch.testing.assert_close(grid[:, :, :3], flat[:, :, :3], rtol=0, atol=0)  # t = h = w there: the same rotation
    assert (grid[:, :, 3:11] - flat[:, :, 3:11]).abs().max() > 1e-2  # h, w != t: the other sections rotate
