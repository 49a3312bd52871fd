"""The prompt input text_embeds: parity's fixed-seed rows, the bundle input, `run --prompt`, and the refusals."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import onnx_ir as ir
import pytest
import torch
from click.testing import CliRunner

from vlmprune.compiler import api
from vlmprune.compiler.cli import main
from vlmprune.compiler.contract import TEXT
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import family_for, load_source
from vlmprune.compiler.generate import load_vlm
from vlmprune.compiler.parity.reference import MethodPruner, prompt_site
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.compiler.parity import parity_feeds
from vlmprune.compiler.prompt import parity_text, prompt_embeds
from vlmprune.passes.methods import get_method
from vlmprune.passes.prune import prune_record
from vlmprune.targets.runtime import optional_feed

KEEP = 16


@pytest.fixture(scope="module")
def result(compiled, tiny_llava_dir):
    return compiled(tiny_llava_dir, method="cdpruner", keep=KEEP)


@pytest.fixture(scope="module")
def bundle(result):
    return result.bundle


def _reference_kept(model_dir, pixel: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The plain-torch reference on pixel with these text rows (as eval's reference rows are made)."""
    source = load_source(str(model_dir))
    method = get_method("cdpruner")
    params = method.parse(KEEP, {})
    pruner = MethodPruner(method, params, "features", None)
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(pixel)).numpy()
        _, kept, _ = prompt_site(source.pipeline, pruner, dense, pixel, rows)
    return kept.numpy()


def test_parity_rows_are_per_image_and_do_not_depend_on_chunking():
    pixel = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
    whole = parity_text(pixel, 16)
    assert whole.shape == (3, 8, 16) and whole.dtype == np.float32
    np.testing.assert_array_equal(np.concatenate([parity_text(pixel[i:i + 1], 16) for i in range(3)]), whole)
    assert not np.allclose(whole[0], whole[1])
    inputs = [SimpleNamespace(name=TEXT, shape=[3, "T", 16])]
    np.testing.assert_array_equal(parity_feeds(pixel, inputs)[TEXT], whole)  # what parity feeds the runners
    assert parity_feeds(pixel, []) == {}  # a graph without the input gets none


def test_runners_take_the_prompt_as_an_explicit_feed():
    """targets.runtime.optional_feed: the caller's rows checked against the graph's input; none is refused."""
    pixel = np.zeros((3, 3, 8, 8), np.float32)
    inputs = [SimpleNamespace(name=TEXT, shape=[3, "T", 16])]
    with pytest.raises(InputError, match="takes the prompt as its text_embeds input"):
        optional_feed(inputs, pixel)
    with pytest.raises(InputError, match=r"must be \[3, T, 16\]"):
        optional_feed(inputs, pixel, {TEXT: np.zeros((2, 4, 16), np.float32)})
    rows = np.ones((4, 16), np.float32)
    fed = optional_feed(inputs, pixel, {TEXT: rows})[TEXT]  # one prompt for every image
    assert fed.shape == (3, 4, 16) and fed.dtype == np.float32 and fed.flags.writeable
    assert optional_feed([], pixel, {TEXT: rows}) == {}  # a feed for an input the graph lacks is left out


def test_the_bundle_takes_text_embeds(result, bundle):
    assert result.report.passed, result.manifest["parity"]
    for stage in result.report.stages[1:]:  # the greedy trace: where fp32 parted from the fp64 reference, and how close
        assert {"first_divergent_step", "margin_at_divergence", "agreement"} <= set(stage.indices)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [i["name"] for i in manifest["inputs"]] == ["pixel_values", "text_embeds"]
    batch = manifest["inputs"][0]["shape"][0]
    assert manifest["inputs"][1]["shape"] == [batch, "text_tokens", 48]  # the LLM's width, the prompt's length free
    model = ir.load(bundle / "model.decomposed.onnx")
    assert prune_record(model).text == {"name": "text_embeds", "dim": 48}


def test_run_with_a_prompt_embeds_it_with_the_checkpoints_table(bundle, tiny_llava_dir, tmp_path):
    pixel, _ = family_for(load_source(str(tiny_llava_dir))).parity_pixels(load_source(str(tiny_llava_dir)), 1)
    pixel = pixel[:1]
    said = []
    prompted = api.run(bundle, inputs=pixel, prompt="what colour is the cat", progress=said.append)
    vlm = load_vlm(str(tiny_llava_dir))
    rows, _ = prompt_embeds(vlm, "what colour is the cat", 48)
    table = vlm.model.get_input_embeddings().weight.detach().numpy()
    ids = [b % 128 for b in "what colour is the cat".encode()]
    np.testing.assert_array_equal(rows, table[ids])  # the prompt's rows of the embedding table
    assert any("text_embeds: 22 prompt tokens" in line for line in said)
    np.testing.assert_array_equal(prompted.outputs["kept_indices"], _reference_kept(tiny_llava_dir, pixel, rows))
    plain = api.run(bundle, inputs=pixel, progress=said.append)  # no prompt: no rows, relevance 1
    assert any("no --prompt, no rows" in line for line in said)
    np.testing.assert_array_equal(plain.outputs["kept_indices"],
                                  _reference_kept(tiny_llava_dir, pixel, np.zeros((0, 48), np.float32)))
    assert prompted.outputs["kept_indices"].tolist() != plain.outputs["kept_indices"].tolist()
    np.savez(tmp_path / "x.npz", pixel_values=pixel)
    cli = CliRunner().invoke(main, ["run", str(bundle), "--load-inputs", str(tmp_path / "x.npz"), "--prompt",
                                    "what colour is the cat", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["kept_indices"] == prompted.outputs["kept_indices"].tolist()


def test_prompt_on_a_bundle_without_the_input_is_one_line(compiled, tiny_llava_dir, tmp_path):
    other = compiled(tiny_llava_dir, method="divprune", keep=KEEP)
    with pytest.raises(InputError, match="prompt and model apply to bundles with a text_embeds input"):
        api.run(other.bundle, inputs=np.zeros((1, 3, 112, 112), np.float32), prompt="hi")


@pytest.mark.parametrize("target", ["qnn", "rk3588"])
def test_targets_without_a_prompt_input_refuse_in_one_line(tiny_llava_dir, tmp_path, target):
    with pytest.raises(InputError, match=f"target {target} cannot run method cdpruner: it reads the prompt"):
        compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(target=target, method="cdpruner", keep=KEEP))
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def vlm_bundle(tmp_path_factory):
    """A tiny LLaVA with a real (offline) tokenizer (test_generate's), compiled with cdpruner for ort."""
    from test_generate import tiny_vlm

    root = tmp_path_factory.mktemp("cdpruner_vlm")
    model = tiny_vlm(root / "model")
    result = compile_model(str(model), root / "b", CompileOptions(method="cdpruner", keep=KEEP))
    assert result.report.passed, result.manifest["parity"]
    return model, result.bundle


def test_generate_and_eval_feed_the_prompts_rows(vlm_bundle, tmp_path):
    from PIL import Image

    from test_generate import PROMPT
    from vlmprune.compiler.evaluate import evaluate
    from vlmprune.compiler.generate import build_prompt, generate, load_pixels

    model, bundle = vlm_bundle
    image = tmp_path / "images" / "a.png"
    image.parent.mkdir()
    Image.fromarray((np.random.default_rng(3).random((112, 112, 3)) * 255).astype(np.uint8)).save(image)
    out = generate(bundle, None, image, PROMPT, max_new_tokens=2)
    vlm = load_vlm(str(model))
    built = build_prompt(vlm, PROMPT)
    table = vlm.model.get_input_embeddings().weight.detach().numpy()
    pixel, _ = load_pixels(vlm, image)
    expected = _reference_kept(model, pixel, table[built.before + built.after])
    assert out.kept == expected[0].tolist()  # the bundle got the prompt's rows (template included)
    other = generate(bundle, None, image, "describe a cat", max_new_tokens=2)
    assert other.kept != out.kept  # another prompt, another selection
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\ndescribe a cat\n")
    report = evaluate(str(model), image.parent, prompts, ["cdpruner"], [KEEP], max_new_tokens=2, bundles=[bundle])
    reference_row, bundle_row = report["results"]
    # eval: the method's reference and the bundle, each fed every prompt's own rows, answer alike
    assert reference_row["kl_mean"] == pytest.approx(bundle_row["kl_mean"], rel=1e-3, abs=1e-6)


def _dart_with_text(x: np.ndarray, text: np.ndarray, keep: int, pivots: int, text_pivots: int) -> list[int]:
    """DART for one image, written from the official logic (ZichenWen1/DART get_retained_image_token) in Edge-LLM's
    ordered form: image pivots by L1 norm, then text pivots by L1 norm; each pivot in turn takes
    ceil(remaining / pivots left) of the not-yet-kept image tokens least similar to it; text pivots are not kept."""
    order = list(np.argsort(-np.abs(x).sum(-1), kind="stable")[:pivots])
    vectors = [x[i] for i in order]
    vectors += [text[i] for i in np.argsort(-np.abs(text).sum(-1), kind="stable")[:text_pivots]]
    kept = list(order)
    for j, v in enumerate(vectors):
        remaining = keep - len(kept)
        if remaining <= 0:
            break
        take = -(-remaining // (len(vectors) - j))
        cos = x @ v / np.maximum(np.linalg.norm(x, axis=-1) * np.linalg.norm(v), 1e-8)
        cos[kept] = np.inf
        kept += list(np.argsort(cos, kind="stable")[:take])
    return sorted(int(i) for i in kept)


@pytest.mark.parametrize("batch", [1, 3])
def test_dart_text_pivots_graph_reference_and_official(batch):
    n, d = 48, 16
    from vlmprune.passes.methods.base import GraphInputs, PromptSiteTensors
    from vlmprune.passes.methods.builder import Builder
    from vlmprune.targets.runtime import ort_session

    method = get_method("dart")
    params = method.parse(12, {"pivots": 2, "text_pivots": 3})
    assert method.needs(params).text and not method.needs(method.parse(12, {})).text
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, n, d)).astype(np.float32)
    text = rng.standard_normal((batch, 5, d)).astype(np.float32)
    f32 = ir.TensorType(ir.DataType.FLOAT)
    hidden = ir.Value(name="hidden", type=f32, shape=ir.Shape(["batch", n, d]))
    text_in = ir.Value(name="text_embeds", type=f32, shape=ir.Shape(["batch", "t", d]))
    graph = ir.Graph([hidden, text_in], [], nodes=[], name="dart", opset_imports={"": 18})
    b = Builder(graph, 18, "vlmprune/dart")
    tokens, kept = method.emit(b, params, GraphInputs(hidden, False, n, text=text_in), "standard")
    graph.extend(b.nodes)
    kept.name = "kept_indices"
    graph.outputs.extend([tokens, kept])
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    out = ort_session(proto.SerializeToString()).run(["kept_indices"], {"hidden": x, "text_embeds": text})[0]
    with torch.inference_mode():
        ref = method.reference(params, PromptSiteTensors(torch.from_numpy(x).double(), False,
                                                         text=torch.from_numpy(text).double()))
    np.testing.assert_array_equal(out, ref.kept.numpy())
    for i in range(batch):
        assert out[i].tolist() == _dart_with_text(x[i].astype(np.float64), text[i].astype(np.float64), 12, 2, 3)
    without = method.reference(method.parse(12, {"pivots": 2}), PromptSiteTensors(torch.from_numpy(x), False))
    assert without.kept.tolist() != ref.kept.tolist()  # the prompt's pivots change the selection
    with pytest.raises(InputError, match="needs a prompt of at least 3 text_embeds rows, got 2"):
        method.reference(params, PromptSiteTensors(torch.from_numpy(x), False, text=torch.from_numpy(text[:, :2])))
    with pytest.raises(InputError, match="--text-pivots of method dart must be an integer >= 0"):
        method.parse(12, {"text_pivots": -1})


def test_dart_text_pivots_compile_with_parity_at_batch_3_and_need_a_prompt(compiled, tiny_llava_dir):
    result = compiled(tiny_llava_dir, method="dart", keep=KEEP, method_options={"pivots": 3, "text_pivots": 2}, batch=3)
    assert result.report.passed, result.manifest["parity"]
    assert [i["name"] for i in result.manifest["inputs"]] == ["pixel_values", "text_embeds"]
    assert all(len(s.indices["per_image"]) == 3 for s in result.report.stages if s.indices)
    pixel = np.zeros((3, 3, 112, 112), np.float32)
    with pytest.raises(InputError, match="needs a prompt of at least 2 tokens: give prompt"):
        api.run(result.bundle, inputs=pixel)
    plain = compiled(tiny_llava_dir, method="dart", keep=KEEP, method_options={"pivots": 3})
    assert [i["name"] for i in plain.manifest["inputs"]] == ["pixel_values"]  # no text pivots, no input


@pytest.mark.parametrize("model", ["tiny_siglip_dir", "tiny_dinov2_registers_dir"])
def test_cdpruner_on_bare_towers(compiled, request, model):
    """No projector: the prompt is as wide as the tower; SigLIP has no [CLS], DINOv2 a [CLS] and registers."""
    result = compiled(request.getfixturevalue(model), method="cdpruner", keep=KEEP)
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["inputs"][1]["name"] == "text_embeds"


@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_weight_on_cls_score_attention_qwen2_vl(tmp_path, batch):
    """--prompt-weight at the features site of Qwen2-VL (cls --score attention): text_embeds is the LLM's width, the
    bundle's kept set is the plain-torch formula's top K over score/max(score) + W · relevance, and parity passes."""
    from tiny_models import tiny_qwen
    from vlmprune.compiler.frontend.images import parity_inputs
    from vlmprune.compiler.parity.reference import torch_reference
    from vlmprune.passes.methods import relevance
    from vlmprune.targets.runtime import ort_session

    model = tiny_qwen(tmp_path / "qwen", "qwen2_vl", 10)
    keep, weight = 6, 3.0
    options = dict(method="cls", keep=keep, family_options={"image_size": 112}, batch=batch)
    result = compile_model(str(model), tmp_path / "b", CompileOptions(
        **options, method_options={"score": "attention", "prompt_weight": weight}))
    assert result.report.passed, result.manifest["parity"]
    names = [i["name"] for i in result.manifest["inputs"]]
    assert names == ["pixel_values", "text_embeds"]
    width = result.manifest["inputs"][1]["shape"][-1]
    source = load_source(str(model), image_size=112)
    pixel, _ = parity_inputs(batch, 112, source.mean, source.std)
    rng = np.random.default_rng(batch)
    text = rng.standard_normal((batch, 5, width)).astype(np.float32)
    session = ort_session(str(result.bundle / "model.onnx"))
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {"pixel_values": pixel, "text_embeds": text})))
    manifest = result.manifest
    record = result.manifest.record
    plain_record = dataclasses.replace(record, params={k: v for k, v in record.params.items() if k != "prompt_weight"})
    dense, plain = torch_reference(source, plain_record, pixel)  # (the weighted reference: parity's, passed above)
    # The plain formula over the unweighted reference's own scores and the dense features, with these rows.
    scores = plain.trace["scores"].astype(np.float64)
    features = dense.outputs["image_features"].astype(np.float64)
    unit = features / np.maximum(np.linalg.norm(features, axis=-1, keepdims=True), 1e-12)
    unit_t = text / np.maximum(np.linalg.norm(text, axis=-1, keepdims=True), 1e-12)
    r = -np.einsum("bnd,btd->bnt", unit, unit_t.astype(np.float64)).mean(-1)
    rel = (r - r.min(-1, keepdims=True)) / (r.max(-1, keepdims=True) - r.min(-1, keepdims=True) + relevance.RANGE_EPS)
    total = scores / scores.max(-1, keepdims=True) + weight * rel
    want = np.sort(np.argsort(-total, kind="stable")[:, :keep], axis=1)
    np.testing.assert_array_equal(got["kept_indices"], want)
    assert not np.array_equal(want, plain.outputs["kept_indices"])  # the prompt moved the selection


def test_methods_lists_cdpruner_only_for_one_to_one_feature_layers():
    """cdpruner refuses Qwen2-VL's merged tokens and LLaVA-NeXT's crops (its check), so `vlmprune methods` does not
    list them: its capability is FEATURE_LAYER, which only the single-grid families declare."""
    from vlmprune.compiler.frontend.family import FEATURE_LAYER
    from vlmprune.compiler.frontend import FAMILIES

    info = next(m for m in api.methods() if m.name == "cdpruner")
    assert "Qwen2-VL" not in info.serves and "LLaVA-NeXT" not in info.serves
    for name in ("LLaVA", "CLIP, SigLIP", "DINOv2", ".onnx towers"):
        assert name in info.serves
    assert {f.id for f in FAMILIES if FEATURE_LAYER in f.has} >= {"llava", "clip", "dinov2"}
    assert not {f.id for f in FAMILIES if FEATURE_LAYER in f.has} & {"qwen2_vl", "llava_next"}
    holov = next(m for m in api.methods() if m.name == "holov")
    assert "prompt_weight" in holov.options and "prompt_weight" not in info.options


@pytest.mark.parametrize("args,needle", [
    (["--method", "cls"], "method cls does not take --prompt-weight: it prunes after block L, whose hidden states "
                          "are the tower's width and have no counterpart of the prompt's LLM-width text_embeds; use a "
                          "score-based method at the projector output (the features site: holov, cls --score "
                          "attention)"),
    (["--method", "divprune"], "method divprune does not take --prompt-weight: its selection is greedy"),
])
def test_prompt_weight_refusals_on_the_cli_are_one_line(tiny_llava_dir, tmp_path, args, needle):
    from cli_helpers import one_line_error, run_cli

    result = run_cli("compile", tiny_llava_dir, "-o", tmp_path / "b", "--keep", "8", "--prompt-weight", "1", *args)
    one_line_error(result, needle)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("target", ["qnn", "rk3588"])
def test_prompt_weight_bundles_are_refused_by_static_shape_targets(tiny_llava_dir, tmp_path, target):
    with pytest.raises(InputError, match=f"target {target} cannot run method holov: it reads the prompt"):
        compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
            target=target, method="holov", keep=KEEP, method_options={"prompt_weight": 1.0}))


def test_eval_reference_and_bundle_of_a_prompt_weighted_holov_agree(tmp_path):
    """`eval`'s method reference (compiler.evaluate) feeds a --prompt-weight setting the prompt's rows on the
    method's own path (the feature layer's Q and K): its rows equal the bundle's for the same prompt."""
    from test_generate import PROMPT, tiny_vlm
    from vlmprune.compiler.evaluate import Setting, _bundle_rows, _reference_rows
    from vlmprune.compiler.generate import build_prompt
    from vlmprune.compiler.bundle import load_manifest

    model = tiny_vlm(tmp_path / "model")
    result = compile_model(str(model), tmp_path / "b", CompileOptions(method="holov", keep=KEEP,
                                                                       method_options={"prompt_weight": 3.0}))
    assert result.report.passed, result.manifest["parity"]
    vlm = load_vlm(str(model))
    method = get_method("holov")
    weighted = _reference_rows(vlm, Setting(method, method.parse(KEEP, {"prompt_weight": 3.0}), "features", None))
    plain = _reference_rows(vlm, Setting(method, method.parse(KEEP, {}), "features", None))
    bundle = _bundle_rows(result.bundle, load_manifest(result.bundle, verify=True), vlm)
    pixel = np.random.default_rng(5).standard_normal((1, 3, 112, 112)).astype(np.float32)
    kept_sets = []
    for text in (PROMPT, "describe a cat"):
        built = build_prompt(vlm, text)
        want, _ = weighted(pixel, built)
        got, _ = bundle(pixel, built)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
        kept_sets.append(got.numpy())
    assert not np.allclose(plain(pixel, built)[0].numpy(), kept_sets[-1])  # the prompt moved the selection


@pytest.mark.parametrize("target", ["orin", "xavier"])
def test_jetson_bundles_take_text_embeds_in_their_engine_profile(tiny_llava_dir, tmp_path, target):
    """orin / xavier: the ORT parity stages pass with text_embeds, the engine profile gives its T range (1..TEXT_MAX,
    the batch the pixels'), and the trtexec command of the README and build-engine names both inputs."""
    from vlmprune.targets import tensorrt as trt_target
    from vlmprune.targets import trt_engine

    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(target=target, method="cdpruner",
                                                                               keep=KEEP))
    assert result.report.passed, result.manifest["parity"]
    assert [i["name"] for i in result.manifest["inputs"]] == ["pixel_values", "text_embeds"]
    profile = result.manifest["target"]["profile"]
    width = result.manifest["inputs"][1]["shape"][-1]
    lo, opt, hi = profile["min"][0], profile["opt"][0], profile["max"][0]
    assert profile["inputs"] == [{"name": "text_embeds", "min": [lo, 1, width],
                                  "opt": [opt, trt_target.TEXT_OPT, width], "max": [hi, trt_target.TEXT_MAX, width]}]
    cmd = trt_engine.format_command(trt_engine.trtexec_command(result.manifest))
    shapes = lambda key: ",".join(f"{s['name']}:{'x'.join(map(str, s[key]))}"  # noqa: E731
                                  for s in trt_engine._profile_inputs(profile))
    for flag, key in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
        assert f"{flag}={shapes(key)}" in cmd
    assert f"text_embeds:{hi}x{trt_target.TEXT_MAX}x{width}" in cmd
    readme = (result.bundle / "README.md").read_text()
    assert f"--minShapes={shapes('min')}" in readme
    assert f"Input `text_embeds`: [batch, T, {width}] float32" in readme and "feed one zero row" in readme
    # The device runner's stand-in for no prompt, one zero row, is what the graph makes of no rows.
    from vlmprune.targets.runtime import ort_session

    session = ort_session(str(result.bundle / "model.decomposed.onnx"))
    pixel = np.random.default_rng(1).standard_normal([lo, *profile["min"][1:]]).astype(np.float32)
    empty, zero = (session.run(None, {"pixel_values": pixel, "text_embeds": np.zeros((lo, t, width), np.float32)})
                   for t in (0, 1))
    for a, b in zip(empty, zero):
        np.testing.assert_array_equal(a, b)


class _FakeEngine:
    """The few TensorRT engine / context / CUDA calls EngineRunner.__call__ makes (no TensorRT here): it records
    the shapes and arrays each input gets, and answers zeros of the outputs' shapes."""

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs, self.shapes, self.device = inputs, outputs, {}, {}

    # engine
    def get_tensor_dtype(self, name):
        return np.float32 if name in self.inputs else np.int64

    # context
    def set_input_shape(self, name, shape):
        self.shapes[name] = shape

    def get_tensor_shape(self, name):
        return (self.shapes["pixel_values"][0], 4)

    def set_tensor_address(self, name, ptr):
        self.device[ptr] = name

    def execute_async_v3(self, stream):
        return True

    # cuda
    def alloc(self, nbytes):
        return len(self.device) + 1

    def to_device(self, ptr, array):
        self.shapes[("copied", ptr)] = array.copy()

    def to_host(self, array, ptr):
        array[...] = 0

    def free(self, ptr):
        pass

    def handle(self):
        return 0

    def sync(self):
        pass


def test_engine_runner_feeds_text_embeds_and_one_zero_row_for_no_prompt():
    from vlmprune.targets import trt_engine

    fake = _FakeEngine(["pixel_values", "text_embeds"], ["kept_indices"])
    runner = object.__new__(trt_engine.EngineRunner)
    runner.trt = type("trt", (), {"nptype": staticmethod(lambda dtype: dtype)})
    runner.engine = runner.context = runner.cuda = fake
    runner.inputs, runner.outputs = fake.inputs, fake.outputs
    pixel = np.ones((2, 3, 8, 8), np.float32)
    text = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    out = runner(pixel, {"text_embeds": text})
    assert fake.shapes["pixel_values"] == (2, 3, 8, 8) and fake.shapes["text_embeds"] == (2, 5, 16)
    np.testing.assert_array_equal(fake.shapes[("copied", 2)], text)
    assert out["kept_indices"].shape == (2, 4) and out["kept_indices"].dtype == np.int64
    runner(pixel, {"text_embeds": np.zeros((2, 0, 16), np.float32)})  # no prompt: the profile's T >= 1
    assert fake.shapes["text_embeds"] == (2, 1, 16)
    with pytest.raises(trt_engine.EngineError, match="the engine takes text_embeds beside the pixels"):
        runner(pixel)
