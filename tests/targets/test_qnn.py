"""Target qnn end to end: `demo` -> HTP-legal ONNX -> QDQ -> EPContext + binary -> HTP emulator parity.

No mocks: onnxruntime-qnn's HTP emulator (x86_64), CPU fallback disabled. Two compiles of
`demo`: a static batch of 1 pruning early (after block 2, lambda 0.3) for the default SoC,
and the default dynamic batch for another SoC, whose parity runs two real images through
the batch-1 artifacts.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import VlmpruneError
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets import qnn_tools

QNN_OK, QNN_REASON = qnn_tools.available()
needs_qnn = pytest.mark.usefixtures("qnn_ready")  # skips, saying why, without the HTP emulator


@pytest.fixture(scope="module")
def early(tmp_path_factory):
    if not QNN_OK:
        pytest.skip(QNN_REASON)
    out = tmp_path_factory.mktemp("qnn") / "demo_l2"
    return compile_model("demo", out, CompileOptions(target="qnn", keep=192, layer=2, method_options={"lambda": 0.3}, batch=1))


@pytest.fixture(scope="module")
def sm8550(tmp_path_factory):
    if not QNN_OK:
        pytest.skip(QNN_REASON)
    out = tmp_path_factory.mktemp("qnn") / "demo_sm8550"
    return compile_model("demo", out, CompileOptions(target="qnn", keep=192, target_options={"soc": "SM8550"}))


@needs_qnn
def test_bundle_holds_qdq_epcontext_and_binary(early):
    fields = early.manifest["target"]
    binaries = fields["artifacts"]["context_binaries"]
    assert {"model.onnx", "model.qdq.onnx", "model_ctx.onnx", *binaries} <= set(early.manifest["files"])
    assert binaries and all((early.bundle / b).stat().st_size > 100_000 for b in binaries)
    ctx = onnx.load(str(early.bundle / "model_ctx.onnx"))
    assert [n.op_type for n in ctx.graph.node] == ["EPContext"]
    qdq_ops = {n.op_type for n in onnx.load(str(early.bundle / "model.qdq.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "TopK", "Gather"} <= qdq_ops and "GatherND" not in qdq_ops
    qnn_tools.check_qdq(onnx.load(str(early.bundle / "model.qdq.onnx")))  # no MatMul of two 16-bit activations
    assert fields["soc"] == "SM8650" and fields["soc_model"] == "57"
    assert fields["quantization"]["activations"] == "uint16" and fields["quantization"]["weights"] == "uint8"


@needs_qnn
def test_every_node_is_placed_on_htp_with_its_cycles(early):
    fields = early.manifest["target"]
    rows = fields["placement"]["qdq"]
    assert rows and {r["device"] for r in rows} == {"HTP"}
    assert fields["placement_summary"]["qdq"]["cpu_ops"] == {}
    topk = [r for r in rows if r["type"] == "TopK"]
    assert len(topk) == 2 and all(r.get("cycles", 0) > 0 for r in topk)
    assert fields["op_trace"]["cycles"] > 0 and fields["op_trace"]["ops"] >= len(rows) // 2


@needs_qnn
def test_parity_in_the_emulator(early, sm8550):
    for result, images in ((early, 2), (sm8550, 2)):  # a static batch of 1 is fed two images, one at a time
        stages = {s.stage: s for s in result.report.stages}
        assert result.report.passed, result.manifest["parity"]
        qdq, ctx = stages["qnn-qdq"], stages["qnn-ctx"]
        for stage in (qdq, ctx):
            assert stage.precision == "int16" and "(simulated)" in stage.runtime and "CPU fallback off" in stage.runtime
            assert len(stage.indices["per_image"]) == images
            assert stage.indices["agreement"] >= 0.99
        # The EPContext binary is the QDQ model compiled: identical figures.
        assert ctx.indices["per_image"] == qdq.indices["per_image"]
        assert ctx.outputs == qdq.outputs
    assert sm8550.manifest["target"]["soc_model"] == "43"
    assert "SM8550" in {s.stage: s for s in sm8550.report.stages}["qnn-ctx"].runtime


@needs_qnn
def test_readme_has_the_device_commands(early):
    readme = (early.bundle / "README.md").read_text()
    for needle in ("Android", "Windows", "Linux arm64", "QNNExecutionProvider", "model_ctx.onnx", "simulated"):
        assert needle in readme


def test_soc_names_and_ids():
    assert qnn_tools.resolve_soc(None) == ("SM8650", "57")
    assert qnn_tools.resolve_soc("sm8550") == ("SM8550", "43")
    assert qnn_tools.resolve_soc(69) == ("SM8750", "69")
    with pytest.raises(qnn_tools.QnnError, match="accepted: SM8350"):
        qnn_tools.resolve_soc("SM9999")


def test_targets_lists_the_soc_values():
    result = CliRunner().invoke(main, ["targets"])
    assert result.exit_code == 0
    assert "qnn --soc values (default SM8650)" in result.output and "SM8550    soc_model 43" in result.output


def test_precision_option():
    from vlmprune.targets.qnn import parse_precision

    assert parse_precision(None) == "int16" and parse_precision("INT16") == "int16"
    with pytest.raises(VlmpruneError, match="qnn --precision"):
        parse_precision("fp16")


def test_int8_is_refused_in_one_line_before_any_work(tmp_path):
    """--precision int8 once compiled for half a minute, then failed parity (cosine 0.2065); it is refused with
    what was measured, before any work."""
    result = CliRunner().invoke(main, ["compile", "demo", "--target", "qnn", "--precision", "int8", "-k", "64",
                                       "-o", str(tmp_path / "q8")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("error: qnn --precision int8 is refused: 8-bit activations keep a token cosine of ")
    assert lines[0].endswith("compile with --precision int16 (the default)")
    assert not (tmp_path / "q8").exists()


def test_eight_bit_softmax_keeps_its_calibrated_range(tmp_path):
    """onnxruntime's QNN helpers fix a Softmax output to [0, 1]: with 8-bit steps of 1/255, attention over 577 keys
    (probabilities under 0.003) read 0 or 1/255 and the demo tower's features lost cosine (0.26 after one softmax)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"], axis=-1, name="softmax"),
                               helper.make_node("Mul", ["p", "w"], ["y"], name="scale")], "attention",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 577])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 577])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    calib = [{"x": rng.normal(0, 0.5, (1, 577)).astype(np.float32)} for _ in range(4)]
    qnn_tools.quantize_qdq(tmp_path / "m.onnx", tmp_path / "q.onnx", calib, act_type="uint8", weight_type="uint8")
    x = calib[0]["x"]
    want = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    cosine = float(np.dot(want.ravel(), got.ravel()) / (np.linalg.norm(want) * np.linalg.norm(got)))
    assert cosine > 0.99, cosine


def test_in_batches_splits_parity_images():
    from vlmprune.targets.qnn import _in_batches

    out = _in_batches(lambda x, fed: {"y": x * 2 + fed["z"]}, np.arange(4.0).reshape(4, 1), 2,
                      {"z": np.arange(4.0).reshape(4, 1) * 10})  # the feeds cut like the pixels
    np.testing.assert_array_equal(out["y"], np.arange(4.0).reshape(4, 1) * 12)


@needs_qnn
def test_run_on_the_emulator(early, tmp_path):
    from PIL import Image
    from skimage import data

    image = tmp_path / "astronaut.png"
    Image.fromarray(data.astronaut()).save(image)
    result = CliRunner().invoke(main, ["run", str(early.bundle), "--image", str(image)])
    assert result.exit_code == 0, result.output
    assert "simulated" in result.output and "image_features: shape [1, 193, 256]" in result.output
    assert len(result.output.split("kept (image 0): ")[1].split()) == 192


@needs_qnn
def test_native_chatter_stays_off_stdout(tiny_llava_dir, tmp_path):
    """QNN's libraries print ` # LIBNATIVE: ...` on file descriptor 1 as they load: it reaches neither stdout nor
    stderr (every qnn command once printed it, -q too), and stdout holds only the summary (a compile in its own
    process: the native write is a real one)."""
    import subprocess
    import sys

    from PIL import Image
    from skimage import data

    cli = [sys.executable, "-c", "from vlmprune.compiler.cli import main; main()"]
    out = tmp_path / "b"
    done = subprocess.run([*cli, "compile", str(tiny_llava_dir), "-t", "qnn", "--keep", "16", "-o", str(out), "-q"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "LIBNATIVE" not in done.stderr + done.stdout and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[0].startswith("tokens: 64 patch tokens -> ")
    image = tmp_path / "astronaut.png"
    Image.fromarray(data.astronaut()).save(image)
    ran = subprocess.run([*cli, "run", str(out), "--image", str(image)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr
    assert "LIBNATIVE" not in ran.stdout + ran.stderr and ran.stdout.splitlines()[0].startswith("(simulated")
    drawn = subprocess.run([*cli, "compare", str(out), "--image", str(image), "-o", str(tmp_path / "c.png")],
                           capture_output=True, text=True, timeout=600)
    assert drawn.returncode == 0, drawn.stderr
    assert drawn.stdout.splitlines() == [f"1 picture written to {tmp_path / 'c.png'}"]


# ------------------------------------------------- what a family's graph needs of the quantizing target (declared)


def _attention_graph(second: str = "MatMul") -> onnx.ModelProto:
    """q.k^T -> Softmax -> probs.v (second: the op after the Softmax), beside a weight MatMul that is no attention."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["logits"], name="qk"),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="softmax"),
             helper.make_node(second, ["probs", "v"], ["attended"], name="pv"),
             helper.make_node("MatMul", ["attended", "w"], ["y"], name="proj")]
    graph = helper.make_graph(nodes, "attention",
                              [helper.make_tensor_value_info("q", f, [1, 4, 8]),
                               helper.make_tensor_value_info("kt", f, [1, 8, 4]),
                               helper.make_tensor_value_info("v", f, [1, 4, 8])],
                              [helper.make_tensor_value_info("y", f, [1, 4, 8])],
                              [helper.make_tensor("w", f, [8, 8], np.eye(8, dtype=np.float32).ravel())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_attention_cores_are_found_by_structure():
    """The three nodes of q.k^T -> Softmax -> probs.v, named anything; a weight MatMul is not one, nor a Softmax
    whose probabilities are not multiplied into an activation."""
    cores = qnn_tools.attention_cores(_attention_graph())
    assert [(n.name, n.op_type) for n in cores] == [("qk", "MatMul"), ("softmax", "Softmax"), ("pv", "MatMul")]
    assert qnn_tools.attention_cores(_attention_graph(second="Mul")) == []


def _output_scale(qdq: onnx.ModelProto, output: str) -> float:
    """The scale of the QuantizeLinear / DequantizeLinear pair that gives the graph output `output`."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qdq.graph.initializer}
    node = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == output)
    return float(inits[node.input[1]])


def test_headroom_widens_the_sixteen_bit_ranges_it_calibrated(tmp_path):
    """headroom 4: every 16-bit activation range is four times the calibrated one, so an image past the calibration
    set's extremes does not clip; as calibrated (1), it does."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"], name="scale")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    calib = [{"x": rng.uniform(-1, 1, (1, 64)).astype(np.float32)} for _ in range(4)]
    past = np.linspace(-3, 3, 64, dtype=np.float32)[None]  # three times the calibration's extremes
    outs, scales = {}, {}
    for headroom in (1.0, 4.0):
        path = qnn_tools.quantize_qdq(tmp_path / "m.onnx", tmp_path / f"q{headroom}.onnx", calib, headroom=headroom)
        scales[headroom] = _output_scale(onnx.load(str(path)), "y")
        outs[headroom] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": past})[0]
    assert scales[4.0] == pytest.approx(4 * scales[1.0], rel=1e-2)
    assert np.abs(outs[1.0] - 2 * past).max() > 1.0  # clipped at the calibrated extremes (about +-2)
    assert np.abs(outs[4.0] - 2 * past).max() < 1e-2


@needs_qnn
def test_a_familys_declared_needs_reach_the_qnn_recipe(monkeypatch, tmp_path, tiny_vit_dir):
    """Family.quantization is the family's to declare and the target's to apply: a toy ViT family declaring float
    attention and a headroom compiles on qnn with parity, the manifest saying what was applied. (Its 16-bit weights
    are Gemma 4's test's: the tiny ViT's LayerNorms and biased MatMuls, fused to Gemm, have no 16-bit-weight HTP
    kernel, so the EP refuses them, which the contract's QuantizationNeeds says.)"""
    from vlmprune.compiler import frontend
    from vlmprune.compiler.contract import QuantizationNeeds
    from vlmprune.compiler.frontend.vit import VitFamily

    class Needy(VitFamily):
        quantization = QuantizationNeeds(float_attention="a test's reason for float attention", headroom=2.0)

    family = Needy()
    monkeypatch.setattr(frontend, "FAMILIES", tuple(family if f.id == family.id else f for f in frontend.FAMILIES))
    result = compile_model(str(tiny_vit_dir), tmp_path / "b", CompileOptions(target="qnn", keep=16, method="cls"))
    assert result.report.passed, [(s.stage, s.passed) for s in result.report.stages]
    assert any(s.stage.startswith("qnn") for s in result.report.stages)  # the emulator's stage ran, and passed
    fields = result.manifest["target"]["quantization"]
    assert fields["weights"] == "uint8" and "wide_weights" not in fields
    assert fields["range_headroom"] == 2.0
    assert fields["activation_matmuls"] == "float (fp16 on HTP): a test's reason for float attention"
    assert "of the attention cores" in fields["float_nodes"]
    qnn_tools.check_qdq(onnx.load(str(tmp_path / "b" / "model.qdq.onnx")))
