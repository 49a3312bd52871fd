"""Targets orin and xavier (TensorRT on Jetson), checked on a host without TensorRT.

Bundle structure and manifest, the plugin node's attributes, the op set of both
graphs against each TensorRT release's parser table, ONNX Runtime parity of both
graphs (model.onnx through the plugin's host twin), nvcc of the bundled kernels
for sm_87, the bundled CMake project (with TensorRT headers, when
VLMPRUNE_TRT_INCLUDE_V3 / _V2 point at them), the legalization passes, and the
device commands up to the point where TensorRT is needed. The wrappers' own
compile check is tests/kernels/test_trt_plugins.py.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from vlmprune.targets import trt_engine as engine_lib
from vlmprune.compiler.frontend import images
from vlmprune.compiler.bundle import load_manifest
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.cli import main
from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.targets.runtime import ort_session, run_session
from vlmprune.passes import tensorrt as trt_passes
from vlmprune.passes.fusion import FusionPass
from vlmprune.passes.methods.cls import TOKEN_PRUNE, ClsMethod
from vlmprune.passes.methods.base import FusedOp
from vlmprune.passes.methods.cls import selection_model
from vlmprune.passes.support import SupportCheckPass
from vlmprune.targets import get_target
from vlmprune.targets import tensorrt as trt_target

REPO = Path(__file__).resolve().parents[2]


def _fuse(model, spelling=None):
    """The cls method's fusion with a target's spelling (ONNX Runtime's by default)."""
    spelling = spelling or FusedOp(TOKEN_PRUNE)
    FusionPass(ClsMethod().fusion_rules({TOKEN_PRUNE: spelling}), {spelling.domain: 1})(model)

PLUGIN = json.loads((REPO / "kernels" / "trt" / "plugin_names.json").read_text())
NO_TRT_LINE = "error: TensorRT is not installed here: run this on the Jetson (see the bundle README)"
SELECTION_OPS = {"TopK", "GatherND", "ScatterElements"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, ort_library):
    """demo for orin (dynamic batch, defaults) and for xavier (static batch 2, block 3, lambda 0.3)."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("trt_bundles")
    return {
        "orin": compile_model("demo", root / "orin", CompileOptions(target="orin", keep=192)),
        "xavier": compile_model("demo", root / "xavier",
                                CompileOptions(target="xavier", keep=192, layer=3, method_options={"lambda": 0.3}, batch=2)),
    }


PLATFORMS = ["orin", "xavier"]


def _proto(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


# ------------------------------------------------------------------- the bundles


@pytest.mark.parametrize("name", PLATFORMS)
def test_bundle_structure(bundles, name):
    result = bundles[name]
    out, platform = result.bundle, trt_target.PLATFORMS[name]
    assert result.report.passed
    expected = {
        "manifest.json", "model.onnx", "model.decomposed.onnx", "weights.bin", "parity.json", "README.md",
        "libvlmprune_ort.so", "vlmprune_engine.py", "plugins/CMakeLists.txt", "plugins/include/vlmprune/kernels.h",
        "plugins/cuda/token_prune.cu", "plugins/trt/plugin_names.json", "plugins/trt/common/tensorrt.cmake",
        "plugins/trt/common/plugin_names.h", f"plugins/trt/{platform.plugin_api}/CMakeLists.txt",
        f"plugins/trt/{platform.plugin_api}/token_prune_plugin.cpp",
    }
    present = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert expected <= present, expected - present
    other_api = "v2" if platform.plugin_api == "v3" else "v3"
    assert not (out / "plugins" / "trt" / other_api).exists()
    manifest = load_manifest(out, verify=True)  # every file's sha256
    assert set(manifest["files"]) == present - {"manifest.json"}
    # The bundled sources are the repository's, byte for byte.
    for rel in ("cuda/token_prune.cu", f"trt/{platform.plugin_api}/token_prune_plugin.cpp", "trt/common/plugin_names.h"):
        assert (out / "plugins" / rel).read_bytes() == (REPO / "kernels" / rel).read_bytes()
    assert (out / "vlmprune_engine.py").read_bytes() == Path(engine_lib.__file__).read_bytes()


@pytest.mark.parametrize("name", PLATFORMS)
def test_manifest_records_device_toolchain_precision_and_profile(bundles, name):
    target = bundles[name].manifest["target"]
    platform = trt_target.PLATFORMS[name]
    assert target["name"] == name and target["runtime"] == "tensorrt"
    assert {k: target["toolchain"][k] for k in ("jetpack", "tensorrt", "cuda", "sm")} == {
        "jetpack": platform.jetpack, "tensorrt": platform.tensorrt, "cuda": platform.cuda, "sm": f"sm_{platform.sm}"}
    assert (target["toolchain"]["tensorrt"], target["toolchain"]["sm"]) == (
        {"orin": ("10.3.0", "sm_87"), "xavier": ("8.5.2", "sm_72")}[name])
    assert target["precision"] == "fp16"
    profile = target["profile"]
    assert profile["input"] == "pixel_values"
    if name == "orin":  # dynamic batch
        assert (profile["min"], profile["opt"], profile["max"]) == ([1, 3, 336, 336], [1, 3, 336, 336], [4, 3, 336, 336])
    else:  # --batch 2: static, min = opt = max
        assert profile["min"] == profile["opt"] == profile["max"] == [2, 3, 336, 336]
    assert target["plugin"]["library"] == "plugins/build/libvlmprune_trt.so"
    assert target["plugin"]["kept_indices_dtype"] == {"orin": "int64", "xavier": "int32"}[name]
    assert target["host_twin"]["library"] == "libvlmprune_ort.so"
    assert target["engine"]["built"].startswith("on the device")
    assert target["fp32_layers"]  # the [CLS] scorer, pinned to fp32 in the engine


@pytest.mark.parametrize("name", PLATFORMS)
def test_plugin_node_follows_the_tensorrt_parser_convention(bundles, name):
    out = bundles[name].bundle
    model = _proto(out / "model.onnx")
    plugin = [n for n in model.graph.node if n.op_type == PLUGIN["name"]]
    assert len(plugin) == 1
    node = plugin[0]
    assert node.domain == trt_passes.PLUGIN_DOMAIN
    assert _attrs(node) == {"plugin_version": PLUGIN["version"].encode(), "plugin_namespace": PLUGIN["namespace"].encode(),
                            "keep": 192, "has_cls": 1}
    kinds = {a.name: a.type for a in node.attribute}
    assert kinds["plugin_version"] == kinds["plugin_namespace"] == onnx.AttributeProto.STRING
    assert kinds["keep"] == kinds["has_cls"] == onnx.AttributeProto.INT
    assert len(node.input) == 2 and len(node.output) == 2
    assert "kept_indices" in node.output  # the plugin's second output is the graph's kept_indices
    assert not SELECTION_OPS & {n.op_type for n in model.graph.node}  # never TopK or Gather for the selection
    assert {o.domain: o.version for o in model.opset_import}[trt_passes.PLUGIN_DOMAIN] == 1
    for graph in ("model.onnx", "model.decomposed.onnx"):
        onnx.checker.check_model(str(out / graph), full_check=True)


@pytest.mark.parametrize("name", PLATFORMS)
def test_op_sets_are_within_the_parser_table(bundles, name):
    out = bundles[name].bundle
    ops = trt_passes.tensorrt_ops(trt_target.PLATFORMS[name].tensorrt)
    for graph in ("model.decomposed.onnx", "model.onnx"):
        model = ir.load(out / graph)
        assert trt_passes.unsupported(model, ops) == [], graph
        standard = {n.op_type for n in model.graph if n.domain in ("", "ai.onnx")}
        assert standard <= set(ops.types), standard - set(ops.types)
        assert ops.opsets[0] <= model.opset_imports[""] <= ops.opsets[1]
        for node in model.graph:
            if node.op_type == "TopK":
                assert ir.convenience.get_const_tensor(node.inputs[1]) is not None  # static K
    decomposed = ir.load(out / "model.decomposed.onnx")
    topk_inputs = [n.inputs[0].dtype for n in decomposed.graph if n.op_type == "TopK"]
    if name == "xavier":  # TensorRT 8.5: opset <= 17, no LayerNormalization / CastLike, TopK on floats only
        assert decomposed.opset_imports[""] == 17
        assert not {"LayerNormalization", "CastLike"} & {n.op_type for n in decomposed.graph}
        assert topk_inputs == [ir.DataType.FLOAT, ir.DataType.FLOAT]
    else:  # TensorRT 10.3 takes the graph as exported (opset 18, int64 TopK)
        assert decomposed.opset_imports[""] == 18
        assert topk_inputs == [ir.DataType.FLOAT, ir.DataType.INT64]


@pytest.mark.parametrize("name", PLATFORMS)
def test_onnx_runtime_parity_of_both_graphs(bundles, name):
    result = bundles[name]
    stages = {s["stage"]: s for s in json.loads((result.bundle / "parity.json").read_text())["stages"]}
    assert {"export", "rewritten", "fused"} <= set(stages) and "target" not in stages  # no engine here
    assert all(s["passed"] and s["precision"] == "fp32" for s in stages.values())
    # The adapter's stage runner (model.onnx + the host twin) against the decomposed graph, fresh inputs.
    target = get_target(name)
    specs = {s.stage: s for s in target.stages(result.bundle, result.manifest)}
    assert set(specs) == {"fused"}
    batch = result.manifest["target"]["profile"]["max"][0] if name == "xavier" else 3
    pixel, _ = images.parity_inputs(batch, 336, result.manifest["preprocess"]["mean"],
                                    result.manifest["preprocess"]["std"], seed=7)
    fused = specs["fused"].run(pixel)
    decomposed = run_session(ort_session(result.bundle / "model.decomposed.onnx"), pixel)
    np.testing.assert_array_equal(fused["kept_indices"], decomposed["kept_indices"])
    np.testing.assert_allclose(fused["image_features"], decomposed["image_features"], rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(fused["kept_indices"], axis=1) > 0)  # ascending, unique


def test_check_reruns_the_stages_of_a_tensorrt_bundle(bundles):
    result = CliRunner().invoke(main, ["check", str(bundles["xavier"].bundle), "-q"])
    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["export", "rewritten", "fused"]


@pytest.mark.parametrize("name", PLATFORMS)
def test_readme_and_trtexec_command(bundles, name):
    out = bundles[name].bundle
    platform = trt_target.PLATFORMS[name]
    readme = (out / "README.md").read_text()
    result = CliRunner().invoke(main, ["build-engine", str(out), "--print-command"])
    assert result.exit_code == 0, result.output
    command = result.stdout.strip()
    profile = bundles[name].manifest["target"]["profile"]
    assert command.startswith("/usr/src/tensorrt/bin/trtexec --onnx=model.onnx ")
    assert f"{platform.trtexec_flag}=plugins/build/libvlmprune_trt.so" in command
    assert "--fp16" in command and "--saveEngine=model.engine" in command
    assert "--precisionConstraints=obey" in command and "--layerPrecisions=" in command
    if profile["batch"] == "dynamic":
        assert "--minShapes=pixel_values:1x3x336x336" in command and "--maxShapes=pixel_values:4x3x336x336" in command
    else:
        assert "Shapes=" not in command  # the static shape is in the ONNX file
    for line in (command, "cmake -S plugins -B plugins/build && cmake --build plugins/build -j",
                 "vlmprune build-engine .", "python3 vlmprune_engine.py build .", "vlmprune check . --engine"):
        assert line in readme, line
    assert f"JetPack {platform.jetpack}" in readme and f"TensorRT {platform.tensorrt}" in readme


# ------------------------------------------------------------------------- int8


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory, ort_library):
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("trt_int8") / "orin_int8"
    return compile_model("demo", out, CompileOptions(target="orin", keep=192, layer=2, target_options={"precision": "int8"}))


def test_int8_bundle_has_an_explicit_qdq_model(int8_bundle):
    out, target = int8_bundle.bundle, int8_bundle.manifest["target"]
    assert int8_bundle.report.passed and target["precision"] == "int8" and target["qdq_model"] == "model.qdq.onnx"
    assert {"model.qdq.onnx", "weights.qdq.bin"} <= set(int8_bundle.manifest["files"])
    stages = {s.stage: s for s in int8_bundle.report.stages}
    assert stages["qdq"].precision == "int8" and stages["qdq"].passed
    assert stages["qdq"].indices["agreement"] == 1.0  # the selection never sees int8 rounding
    model = ir.load(out / "model.qdq.onnx")
    ops = trt_passes.tensorrt_ops("10.3")
    assert trt_passes.unsupported(model, ops) == []
    plugin = [n for n in model.graph if trt_passes.is_plugin_node(n)]
    assert len(plugin) == 1 and not SELECTION_OPS & {n.op_type for n in model.graph}
    dq = [n for n in model.graph if n.op_type == "DequantizeLinear"]
    assert len(dq) > 0 and target["quantization"]["quantized_nodes"] > 0
    for node in dq:  # symmetric int8: zero points are 0
        zero = ir.convenience.get_const_tensor(node.inputs[2]).numpy()
        assert zero.dtype == np.int8 and not zero.any()
    weights = [n for n in dq if ir.convenience.get_const_tensor(n.inputs[0]) is not None]
    assert weights and all(n.attributes.get_int("axis", None) == 1 for n in weights)  # per output channel
    # Nothing that feeds the scores, and not the plugin, reads a dequantized tensor.
    floating = set(target["fp32_layers"]) | {plugin[0].name}
    for node in model.graph:
        if node.name in floating:
            assert not [v for v in node.inputs if v is not None and v.producer() is not None
                        and v.producer().op_type == "DequantizeLinear"], node.name
    command = engine_lib.format_command(engine_lib.trtexec_command(int8_bundle.manifest))
    assert "--onnx=model.qdq.onnx" in command and "--fp16 --int8" in command
    assert command in (out / "README.md").read_text() and "## 2. Build the engine (int8)" in (out / "README.md").read_text()
    decomposed = engine_lib.trtexec_command(int8_bundle.manifest, decomposed=True)
    assert "--int8" not in decomposed  # the decomposed graph has no Q/DQ: it builds in fp16


def test_unknown_precision_is_one_line(tmp_path):
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    with pytest.raises(InputError) as info:
        compile_model("demo", tmp_path / "b", CompileOptions(target="xavier", target_options={"precision": "int16"}))
    assert str(info.value) == "--precision for xavier is one of fp16, int8, got 'int16'"
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------ device commands here


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, even where installed


@pytest.mark.parametrize("args", [["build-engine", "{b}"], ["check", "{b}", "--engine"],
                                  ["run", "{b}", "--image", "{img}"]])
def test_device_commands_fail_in_one_line_without_tensorrt(bundles, no_tensorrt, tmp_path, args):
    from PIL import Image

    image = tmp_path / "photo.png"
    Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(image)
    argv = [a.format(b=bundles["orin"].bundle, img=image) for a in args]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [NO_TRT_LINE]


def test_build_engine_refuses_a_bundle_of_another_target(tmp_path, no_tensorrt, demo_bundle):
    result = CliRunner().invoke(main, ["build-engine", str(demo_bundle.bundle)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {demo_bundle.bundle} targets ort, not TensorRT (orin, xavier)"


def test_build_engine_goes_through_the_api(bundles, no_tensorrt, monkeypatch):
    """`vlmprune build-engine` is the API's build_engine (api.target_command): without TensorRT both say one line,
    the CLI with exit code 2; --print-command's line is the one the API returns."""
    from vlmprune.compiler import api

    out = bundles["orin"].bundle
    with pytest.raises(engine_lib.EngineError) as raised:  # a ToolchainError: one line, exit code 2
        api.build_engine(out)
    assert f"error: {raised.value}" == NO_TRT_LINE
    asked = []
    through = api.target_command
    monkeypatch.setattr(api, "target_command", lambda name, **kw: asked.append(name) or through(name, **kw))
    result = CliRunner().invoke(main, ["build-engine", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [NO_TRT_LINE] and result.stdout == ""
    assert asked == ["build-engine"]  # the CLI asked the API, which did the work
    printed = CliRunner().invoke(main, ["build-engine", str(out), "--print-command"])
    assert printed.exit_code == 0 and printed.stdout.splitlines() == api.build_engine(out, print_command=True)
    assert asked == ["build-engine"] * 2


def test_standalone_engine_script(bundles, no_tensorrt):
    out = bundles["xavier"].bundle
    script = out / "vlmprune_engine.py"
    ast.parse(script.read_text(), feature_version=(3, 8))  # JetPack 5.1's Python
    shown = subprocess.run([sys.executable, str(script), "trtexec", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("/usr/src/tensorrt/bin/trtexec --onnx=model.onnx")
    assert "--plugins=plugins/build/libvlmprune_trt.so" in shown.stdout
    for command in ("build", "run"):
        done = subprocess.run([sys.executable, str(script), command, str(out)], capture_output=True, text=True, cwd=out)
        if done.returncode != 2:  # TensorRT importable in this environment after all
            pytest.skip("tensorrt is importable here")
        assert done.stderr.strip() == NO_TRT_LINE


# ------------------------------------------------- build_engine against a fake TensorRT


class _FakeTensorRT(types.ModuleType):
    """Just the TensorRT Python API that build_engine uses, recording the calls (no engine is built)."""

    def __init__(self, version: str):
        super().__init__("tensorrt")
        self.__version__ = version
        self.float32, self.float16, self.int64 = "float32", "float16", "int64"
        self.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda s, level=None: None})
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0)
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", INT8="INT8", OBEY_PRECISION_CONSTRAINTS="OBEY")
        self.loaded: list[str] = []
        self.calls: dict = {}
        fake = self

        class Layer:
            def __init__(self, name, dtype):
                self.name, self.num_outputs, self.precision, self._dtype, self.types = name, 1, None, dtype, {}

            def get_output(self, j):
                return types.SimpleNamespace(dtype=self._dtype)

            def set_output_type(self, j, dtype):
                self.types[j] = dtype

        class Network:
            def __init__(self):
                self.layers = []

            @property
            def num_layers(self):
                return len(self.layers)

            def get_layer(self, i):
                return self.layers[i]

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                self.network = network

            def parse_from_file(self, path):
                model = onnx.load(path, load_external_data=False)
                floats = {v.name for v in [*model.graph.value_info, *model.graph.output]
                          if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
                self.network.layers = [Layer(n.name, fake.float32 if n.output[0] in floats else fake.int64)
                                       for n in model.graph.node]
                fake.calls["parsed"] = Path(path).name
                return True

        class Config:
            def __init__(self):
                self.flags, self.profiles = set(), []

            def set_flag(self, flag):
                self.flags.add(flag)

            def set_memory_pool_limit(self, pool, size):
                fake.calls["workspace"] = size

            def add_optimization_profile(self, profile):
                self.profiles.append(profile)

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls["profile"] = (name, list(lo), list(opt), list(hi))

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls["network_flags"] = flags
                fake.network = Network()
                return fake.network

            def create_builder_config(self):
                fake.config = Config()
                return fake.config

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return b"fake plan"

        self.Builder, self.OnnxParser = Builder, OnnxParser
        registry = types.SimpleNamespace(load_library=lambda path: fake.loaded.append(path) or object())
        self.get_plugin_registry = lambda: registry
        self.init_libnvinfer_plugins = lambda logger, namespace: None


@pytest.fixture
def orin_copy(bundles, tmp_path):
    out = tmp_path / "orin"
    shutil.copytree(bundles["orin"].bundle, out)
    return out


def test_build_engine_with_a_fake_tensorrt(orin_copy, monkeypatch):
    fake = _FakeTensorRT("10.3.0.26")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(engine_lib.EngineError, match="build the plugin first"):
        engine_lib.build_engine(orin_copy, log=lambda _m: None)
    library = orin_copy / "plugins" / "build" / "libvlmprune_trt.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF")
    lines: list[str] = []
    path = engine_lib.build_engine(orin_copy, workspace_mib=512, log=lines.append)
    manifest = json.loads((orin_copy / "manifest.json").read_text())
    assert lines[0] == "equivalent: " + engine_lib.format_command(engine_lib.trtexec_command(manifest))
    assert fake.loaded == [str(library)]  # TensorRT 10: IPluginRegistry.load_library (getCreators)
    assert fake.calls["parsed"] == "model.onnx" and fake.calls["network_flags"] == 0
    assert fake.calls["workspace"] == 512 << 20
    profile = manifest["target"]["profile"]
    assert fake.calls["profile"] == ("pixel_values", profile["min"], profile["opt"], profile["max"])
    assert fake.config.flags == {"FP16", "OBEY"}
    pinned = [layer.name for layer in fake.network.layers if layer.precision == "float32"]
    assert pinned == manifest["target"]["fp32_layers"]  # the whole [CLS] scorer, found by node name
    record = json.loads((orin_copy / "model.engine.json").read_text())
    assert path.read_bytes() == b"fake plan" and record["sha256"] == hashlib.sha256(b"fake plan").hexdigest()
    assert record["tensorrt"] == "10.3.0.26" and record["precision"] == "fp16"
    assert record["model_sha256"] == manifest["files"]["model.onnx"]
    assert get_target("orin").stages(orin_copy, Manifest(manifest))[-1].stage == "engine"  # the engine joins the parity stages
    # Nothing loads an engine that differs from its record, or comes from another TensorRT.
    path.write_bytes(b"tampered")
    with pytest.raises(engine_lib.EngineError, match="does not match the sha256"):
        engine_lib.EngineRunner(orin_copy)
    fake.__version__ = "8.5.2.2"
    with pytest.raises(engine_lib.EngineError, match="this bundle is for TensorRT 10.3.0"):
        engine_lib.build_engine(orin_copy, log=lambda _m: None)


def test_int8_needs_a_qdq_model_or_a_calibration_cache(orin_copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTensorRT("10.3.0.26"))
    with pytest.raises(engine_lib.EngineError, match="int8 needs a Q/DQ model"):
        engine_lib.build_engine(orin_copy, precision="int8", log=lambda _m: None)


def test_int8_engine_is_built_from_the_qdq_model(int8_bundle, tmp_path, monkeypatch):
    out = tmp_path / "int8"
    shutil.copytree(int8_bundle.bundle, out)
    (out / "plugins" / "build").mkdir()
    (out / "plugins" / "build" / "libvlmprune_trt.so").write_bytes(b"\x7fELF")
    fake = _FakeTensorRT("10.3.0.26")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    engine_lib.build_engine(out, log=lambda _m: None)  # the bundle's precision: int8
    assert fake.calls["parsed"] == "model.qdq.onnx" and fake.config.flags == {"FP16", "INT8", "OBEY"}
    record = json.loads((out / "model.engine.json").read_text())
    assert record["precision"] == "int8" and record["model"] == "model.qdq.onnx"
    assert get_target("orin").stages(out, int8_bundle.manifest)[-1].precision == "int8"


# ------------------------------------------------------------- kernels and plugins


def _nvcc() -> str:
    from vlmprune.kernels import build

    try:
        return build.find_nvcc()
    except build.ToolNotFoundError as exc:
        pytest.skip(str(exc))


def test_bundled_kernels_compile_for_sm87(bundles, tmp_path):
    nvcc = _nvcc()
    plugins = bundles["orin"].bundle / "plugins"
    obj = tmp_path / "token_prune_sm87.o"
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_87", "-Xcompiler", "-fPIC", f"-I{plugins / 'include'}",
           "-c", str(plugins / "cuda" / "token_prune.cu"), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", "--defined-only", str(obj)], capture_output=True, text=True).stdout
    assert "vlmp_select_topk_cuda" in symbols and "vlmp_gather_summary_cuda" in symbols


@pytest.mark.parametrize("name,env_var", [("orin", "VLMPRUNE_TRT_INCLUDE_V3"), ("xavier", "VLMPRUNE_TRT_INCLUDE_V2")])
def test_bundled_plugin_builds_with_cmake(bundles, tmp_path, name, env_var):
    """The bundle's own CMake project, as the device runs it, against the release's public headers."""
    include = os.environ.get(env_var)
    if not include:
        pytest.skip(f"{env_var} is not set (a folder with the TensorRT headers)")
    nvcc = _nvcc()
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    args = [f"-DTENSORRT_INCLUDE_DIR={include}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    if name == "xavier":
        # libnvinfer only provides getPluginRegistry/getLogger at link time; sm_72 is older than this nvcc.
        stub = tmp_path / "stub"
        stub.mkdir()
        (stub / "stub.cpp").write_text('extern "C" void* getPluginRegistry() noexcept { return 0; }\n'
                                       'extern "C" void* getLogger() noexcept { return 0; }\n')
        subprocess.run(["g++", "-shared", "-fPIC", str(stub / "stub.cpp"), "-o", str(stub / "libnvinfer.so")], check=True)
        args += [f"-DTENSORRT_LIB_DIR={stub}", "-DCMAKE_CUDA_ARCHITECTURES=75"]
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(bundles[name].bundle / "plugins"), "-B", str(build), *args],
                ["cmake", "--build", str(build), "-j2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    library = build / "libvlmprune_trt.so"
    exported = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if line.strip()}
    if name == "orin":
        assert {"getCreators", "setLoggerFinder"} <= names
    else:
        assert not {"getCreators", "setLoggerFinder"} & names


def test_host_twin_contract_matches_the_plugin(ort_library):
    source = (REPO / "kernels" / "ort" / "vlmprune_ort_ops.cc").read_text()
    header = (REPO / "kernels" / "trt" / "common" / "plugin_names.h").read_text()
    assert '#include "common/plugin_names.h"' in source  # the twin reads the plugins' own contract
    for const, plugin_const, value in (("kPluginName", "kTokenPruneName", PLUGIN["name"]),
                                       ("kPluginVersion", "kTokenPruneVersion", PLUGIN["version"]),
                                       ("kPluginNamespace", "kTokenPruneNamespace", PLUGIN["namespace"])):
        assert f"constexpr const char* {const} = vlmprune::trt::{plugin_const};" in source
        assert f'constexpr char const* {plugin_const} = "{value}";' in header
    assert f'constexpr const char* kPluginDomain = "{trt_passes.PLUGIN_DOMAIN}";' in source
    # A node meant for another plugin version is refused, not run.
    model = selection_model(2, 64, 16, 20)
    _fuse(model, trt_target.PLUGIN_OP)
    next(iter(model.graph)).attributes["plugin_version"] = ir.AttrString("plugin_version", "2")
    rng = np.random.default_rng(0)
    feeds = {"hidden": rng.standard_normal((2, 65, 16)).astype(np.float32),
             "scores": rng.random((2, 64), dtype=np.float32)}
    with pytest.raises(Exception, match="'plugin_version' is '2', this library implements '1'"):
        ort_session(ir.to_proto(model).SerializeToString(), (ort_library,)).run(None, feeds)


# ------------------------------------------------------------ legalization passes


def _feeds(b=3, n=64, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"hidden": rng.standard_normal((b, n + 1, d)).astype(np.float32),
            "scores": rng.random((b, n), dtype=np.float32).round(2)}  # rounding makes real ties


def _run(model: ir.Model, feeds, libs=()):
    return ort_session(ir.to_proto(model).SerializeToString(), libs).run(None, feeds)


def test_sort_indices_as_float_then_fuse_to_the_plugin(ort_library):
    reference = _run(selection_model(3, 64, 16, 20, opset=17), _feeds())
    model = selection_model(3, 64, 16, 20, opset=17)
    sort = trt_passes.SortIndicesAsFloatPass(trt_passes.tensorrt_ops("8.5"))
    assert sort(model).modified and not sort(model).modified
    second = [n for n in model.graph if n.op_type in ("Cast", "TopK")]
    assert [n.op_type for n in second] == ["TopK", "Cast", "TopK", "Cast"]
    assert [n.inputs[0].dtype for n in second if n.op_type == "TopK"] == [ir.DataType.FLOAT, ir.DataType.FLOAT]
    legal = _run(model, _feeds())
    np.testing.assert_array_equal(legal[1], reference[1])  # ties included
    np.testing.assert_array_equal(legal[0], reference[0])
    assert trt_passes.unsupported(model, trt_passes.tensorrt_ops("8.5")) == []
    _fuse(model, trt_target.PLUGIN_OP)
    assert [(n.domain, n.op_type) for n in model.graph] == [("trt.plugins", "VlmpTokenPrune")]
    fused = _run(model, _feeds(), (ort_library,))
    np.testing.assert_array_equal(fused[1], reference[1])
    np.testing.assert_allclose(fused[0], reference[0], rtol=1e-5, atol=1e-6)


def test_sort_indices_as_float_is_not_needed_on_tensorrt_10():
    model = selection_model(3, 64, 16, 20)
    assert not trt_passes.SortIndicesAsFloatPass(trt_passes.tensorrt_ops("10.3"))(model).modified
    assert trt_passes.unsupported(model, trt_passes.tensorrt_ops("10.3")) == []


def test_ort_spelling_is_unchanged():
    model = selection_model(3, 64, 16, 20)
    _fuse(model)
    assert [(n.domain, n.op_type) for n in model.graph] == [("vlmprune", "TokenPrune")]
    assert set(next(iter(model.graph)).attributes) == {"keep", "has_cls"}


def test_unsupported_ops_are_listed_in_one_line(tiny_dense_path):
    model = ir.load(tiny_dense_path)
    target = get_target("xavier")
    with pytest.raises(StructureError) as info:
        SupportCheckPass(target.name, target.supports, target.check_model)(model)
    message = str(info.value)
    assert "\n" not in message and message.startswith("xavier cannot run this graph: ")
    assert "opset 18 (TensorRT 8.5 parses 7..17)" in message
    assert "LayerNormalization: not in TensorRT 8.5's ONNX parser table" in message
    # The raw export's Squeeze of a shape slice has no shape annotation yet: the legalization infers it.
    assert [p.split(":")[0] for p in trt_passes.unsupported(model, trt_passes.tensorrt_ops("10.3"))] == ["Squeeze"]
    for p in trt_passes.legalization_passes(trt_passes.tensorrt_ops("10.3"), model.opset_imports[""]):
        p(model)
    assert trt_passes.unsupported(model, trt_passes.tensorrt_ops("10.3")) == []


def test_legalization_for_tensorrt_85_keeps_the_numbers(tiny_dense_path):
    pixel = np.random.default_rng(3).standard_normal((2, 3, 112, 112)).astype(np.float32)
    reference = run_session(ort_session(tiny_dense_path), pixel)
    model = ir.load(tiny_dense_path)
    ops = trt_passes.tensorrt_ops("8.5")
    names = [type(p).__name__ for p in trt_passes.legalization_passes(ops)]
    assert names == ["ShapeInferencePass", "DowngradeOpsetPass", "DecomposeLayerNormalizationPass",
                     "FoldCastLikePass", "SqueezeAxesPass", "SortIndicesAsFloatPass"]
    for p in trt_passes.legalization_passes(ops):
        p(model)
    assert trt_passes.unsupported(model, ops) == []
    assert model.opset_imports[""] == 17
    reduces = [n for n in model.graph if n.op_type.startswith("Reduce")]
    assert reduces and all(len(n.inputs) == 1 and "axes" in n.attributes for n in reduces)  # opset-17 form
    path = tiny_dense_path.with_name("legal85.onnx")
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    legal = run_session(ort_session(path), pixel)
    for name, value in reference.items():
        np.testing.assert_allclose(legal[name], value, rtol=1e-4, atol=1e-5)


def test_downgrade_refuses_what_it_cannot_express():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 8]))
    axes = ir.Value(name="axes", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))  # a runtime input
    node = ir.node("ReduceMean", [x, axes], attributes={"keepdims": 0}, name="mean")
    graph = ir.Graph([x, axes], node.outputs, nodes=[node], opset_imports={"": 18})
    with pytest.raises(StructureError, match="cannot rewrite opset 18 to 17: ReduceMean with runtime axes"):
        trt_passes.DowngradeOpsetPass(17)(ir.Model(graph, ir_version=10))


def test_profile_of_static_and_dynamic_batch():
    def model(batch):
        x = ir.Value(name="pixel_values", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch, 3, 28, 28]))
        return ir.Model(ir.Graph([x], [], nodes=[], opset_imports={"": 18}), ir_version=10)

    assert trt_target._profile(model(3), None) == {"input": "pixel_values", "min": [3, 3, 28, 28],
                                                   "opt": [3, 3, 28, 28], "max": [3, 3, 28, 28], "batch": "static"}
    dynamic = trt_target._profile(model("batch"), None)
    assert (dynamic["min"][0], dynamic["opt"][0], dynamic["max"][0], dynamic["batch"]) == (1, 1, 4, "dynamic")


def test_downgrade_converts_opset_20s_castlike_reducemax_and_gelu_to_17():
    """xavier at --opset 19..22 failed: CastLike-19, ReduceMax-20 and Gelu-20 had no opset-17 form."""
    import onnx.helper as oh

    f = onnx.TensorProto.FLOAT
    nodes = [oh.make_node("CastLike", ["half", "x"], ["h"]),
             oh.make_node("Mul", ["x", "h"], ["xh"]),
             oh.make_node("Gelu", ["xh"], ["g"]),
             oh.make_node("Gelu", ["x"], ["t"], approximate="tanh"),
             oh.make_node("Add", ["g", "t"], ["s"]),
             oh.make_node("ReduceMax", ["s", "axes"], ["y"], keepdims=1),
             oh.make_node("Cast", ["y"], ["out"], to=f)]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", f, [2, 8])],
                          [oh.make_tensor_value_info("out", f, [2, 1])],
                          [onnx.numpy_helper.from_array(np.array(0.5, np.float64), "half"),
                           onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    import onnxruntime as ort

    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    model = ir.from_proto(proto)
    for p in trt_passes.legalization_passes(trt_passes.tensorrt_ops("8.5"), 20):
        p(model)
    assert model.opset_imports[""] == 17
    ops = [n.op_type for n in model.graph]
    assert "Gelu" not in ops and "Erf" in ops and "Tanh" in ops
    assert all("saturate" not in n.attributes for n in model.graph if n.op_type.startswith("Cast"))
    assert trt_passes.unsupported(model, trt_passes.tensorrt_ops("8.5")) == []
    legal = ir.to_proto(model)
    onnx.checker.check_model(legal, full_check=True)
    got = ort.InferenceSession(legal.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target, opset, says", [
    ("orin", 23, "--opset 23: target orin compiles opsets 17 to 22 (TensorRT 10.3 parses up to opset 20"),
    ("xavier", 23, "--opset 23: target xavier compiles opsets 17 to 22"),
    ("rk3588", 20, "--opset 20: target rk3588 compiles opsets 17 to 19 (rknn-toolkit2 2.5.0 reads"),
])
def test_an_opset_outside_the_targets_declared_range_is_refused_before_any_work(target, opset, says, tmp_path):
    from vlmprune.compiler import api

    with pytest.raises(InputError) as info:
        api.compile("demo", tmp_path / "b", target=target, opset=opset, keep=32)
    assert str(info.value).startswith(says) and "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
    assert get_target(target).opsets[1] >= 19


def test_downgrade_takes_resize_18_at_its_defaults_and_refuses_antialias():
    """xavier on LLaVA-OneVision clips failed: its bilinear pooling exports as Resize-18, which had no opset-17 form;
    with antialias, axes and keep_aspect_ratio_policy at their defaults it is Resize-13."""
    import onnx.helper as oh
    import onnxruntime as ort

    f = onnx.TensorProto.FLOAT

    def resize_model(**attrs):
        node = oh.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear", **attrs)
        graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", f, [2, 3, 5, 5])],
                              [oh.make_tensor_value_info("y", f, [2, 3, 3, 3])],
                              [onnx.numpy_helper.from_array(np.array([2, 3, 3, 3], np.int64), "sizes")])
        return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)

    proto = resize_model(antialias=0, keep_aspect_ratio_policy="stretch")
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    model = ir.from_proto(proto)
    trt_passes.DowngradeOpsetPass(17)(model)
    assert model.opset_imports[""] == 17
    legal = ir.to_proto(model)
    onnx.checker.check_model(legal, full_check=True)
    got = ort.InferenceSession(legal.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(StructureError, match="Resize-18 with antialias"):
        trt_passes.DowngradeOpsetPass(17)(ir.from_proto(resize_model(antialias=1)))
