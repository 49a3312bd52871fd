"""Targets `orin` and `xavier`: TensorRT on NVIDIA Jetson, engine built on the device.

One adapter, parametrised by a JetsonPlatform. The host writes what the device needs:

- model.onnx: the fused node spelled as TensorRT's ONNX parser expects a plugin
  node (op_type = the plugin's name, attributes plugin_version / plugin_namespace,
  its fields keep / has_cls), over a graph legal for that TensorRT's parser;
- model.decomposed.onnx: the same graph in standard ops only, legalized the same way
  (passes.tensorrt: the op table of that TensorRT release, checked before writing);
- plugins/: the plugin sources (kernels/include, kernels/cuda, kernels/trt/common and
  the wrapper of the platform's plugin API) with a top CMakeLists.txt;
- vlmprune_engine.py (targets/trt_engine.py): builds and runs the engine without vlmprune;
- libvlmprune_ort.so: the plugin's host-side twin (ONNX Runtime op over the same
  kernels), so that model.onnx is checked here.

The engine is built on the device: engines are tied to a TensorRT version and GPU,
and NVIDIA ships no x86 TensorRT for Jetson. With an engine (and TensorRT) at hand,
stages() adds it as the `engine` parity stage, after `fused` (model.onnx under ONNX Runtime) and `qdq`.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.contract import DECOMPOSED, MODEL, QDQ_MODEL, QDQ_WEIGHTS, TEXT, Manifest
from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.passes import tensorrt as trt_passes
from vlmprune.passes.methods.base import FusedOp, int8_scorer
from vlmprune.passes.methods.builder import feeding_selection, role_of, selection_nodes
import vlmprune.targets.ort as ort_target
import vlmprune.targets.trt_engine as engine_lib
from vlmprune.targets.ort_quant import dequantized_nodes, static_qdq  # the same quantizer, the same rewiring
from vlmprune.targets.base import EmitContext, StageSpec, Target, reads_projector_output

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
HOST_TWIN = ort_target.LIBRARY  # libvlmprune_ort.so: registers trt.plugins.VlmpTokenPrune too
PLUGIN_LIBRARY = "plugins/build/libvlmprune_trt.so"
DEFAULT_MAX_BATCH = 4  # dynamic-batch bundles: profile 1..4 images, tuned for 1
PRECISIONS = ("fp16", "int8")
CALIBRATION_IMAGES = 8
ENGINE_STAGE = "engine"  # the parity stage of an engine built on the device (`check --engine` requires it)
QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")
PLUGIN_OP = FusedOp(
    op_type=trt_passes.PLUGIN_CONTRACT["name"],
    domain=trt_passes.PLUGIN_DOMAIN,
    attributes=(("plugin_version", trt_passes.PLUGIN_CONTRACT["version"]),
                ("plugin_namespace", trt_passes.PLUGIN_CONTRACT["namespace"])),
)
# --scorer int8: ClsScoreFusion's ClsAttentionScore spelled as the VlmpClsScore plugin (vlmp_cls_scores_cuda).
SCORER_OP = FusedOp(
    op_type=trt_passes.SCORER_CONTRACT["name"],
    domain=trt_passes.PLUGIN_DOMAIN,
    attributes=(("plugin_version", trt_passes.SCORER_CONTRACT["version"]),
                ("plugin_namespace", trt_passes.SCORER_CONTRACT["namespace"])),
)


@dataclasses.dataclass(frozen=True)
class JetsonPlatform:
    """The device side of one target: its JetPack and what that JetPack ships."""

    name: str
    device: str
    jetpack: str
    l4t: str
    tensorrt: str
    cuda: str
    sm: int
    plugin_api: str  # folder under kernels/trt
    plugin_interface: str
    trtexec_flag: str  # how trtexec loads the plugin library
    kept_dtype: str  # the plugin's kept_indices type in the engine
    cmake_minimum: str
    device_python: str
    opsets: tuple[int, int] = (17, 22)  # the exports the legalization brings into the parser's range (its own says)
    opsets_why: str = ""

    @property
    def ops(self) -> trt_passes.TensorRTOps:
        return trt_passes.tensorrt_ops(self.tensorrt)


ORIN = JetsonPlatform(
    name="orin", device="Jetson AGX Orin / Orin NX / Orin Nano", jetpack="6.1", l4t="r36.4",
    tensorrt="10.3.0", cuda="12.6", sm=87, plugin_api="v3", plugin_interface="IPluginV3",
    trtexec_flag="--dynamicPlugins", kept_dtype="int64", cmake_minimum="3.18", device_python="3.10",
    opsets_why="TensorRT 10.3 parses up to opset 20; 21 and 22 are converted to 20, while 23's Attention op has no "
               "opset-20 form here",
)
XAVIER = JetsonPlatform(
    name="xavier", device="Jetson AGX Xavier / Xavier NX", jetpack="5.1", l4t="r35",
    tensorrt="8.5.2", cuda="11.4", sm=72, plugin_api="v2", plugin_interface="IPluginV2DynamicExt",
    trtexec_flag="--plugins", kept_dtype="int32", cmake_minimum="3.16", device_python="3.8",
    opsets_why="TensorRT 8.5 parses up to opset 17; 18 to 22 are converted to 17 (Reduce* axes, Split, Cast and "
               "CastLike-19/21, Gelu-20), while 23's Attention op has no opset-17 form here",
)
PLATFORMS = {p.name: p for p in (ORIN, XAVIER)}


@dataclasses.dataclass(frozen=True)
class _InputMeta:
    """An engine input as runtime.optional_feed reads one (name, shape)."""

    name: str
    shape: tuple


class TensorRTTarget(Target):
    """One Jetson target. Formulations: cls fuses select + gather + summary into the VlmpTokenPrune plugin;
    a selection with control flow takes its form without (divprune's greedy loop, unrolled into a chain of
    standard layers: the parser's Loop import adds a loop per pick and nothing here can measure either on a
    Jetson; a plugin for it is left to a device session); visionzip and dart are TopK chains with constant K,
    standard layers as they are. int8 keeps the method's own nodes in floating point (write_qdq_model), so a
    method's int8_loss does not apply here; what reads the projector output is refused."""

    platform: JetsonPlatform
    no_timing_why = ("its candidates are timed by building each K's engine on the device (`vlmprune build-engine`), "
                     "and there is no device here: compile with --keep K and time the bundles on the Jetson")
    spellings = {"TokenPrune": PLUGIN_OP, "ClsAttentionScore": SCORER_OP}
    control_flow = False  # the parser's Loop import: see the class docstring
    # text_embeds (prompt-aware methods): the profile's T range (_profile) and the device runner feed it.
    no_roi_input = "its engine profile and device runner take the pixel input only (no ROI inputs yet)"
    options = {"precision": "orin/xavier: fp16 (default) or int8 (explicit Q/DQ model)"}

    def __init__(self, platform: JetsonPlatform | None = None):
        self.platform = platform or self.platform
        p = self.platform
        self.name = p.name
        self.opsets, self.opsets_why = p.opsets, p.opsets_why
        self.summary = (f"{p.device}: TensorRT {p.tensorrt}, CUDA {p.cuda}, sm_{p.sm}, JetPack {p.jetpack} "
                        f"({p.plugin_interface} plugin; engine built on the device)")

    # ------------------------------------------------------------------ contract

    def available(self) -> tuple[bool, str]:
        # Emitting and checking here needs what the ort target needs (the host twin library).
        return ort_target.OrtTarget().available()

    def toolchain(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        p = self.platform
        return {"jetpack": p.jetpack, "l4t": p.l4t, "tensorrt": p.tensorrt, "cuda": p.cuda, "sm": f"sm_{p.sm}",
                "onnx": onnx.__version__, "onnxruntime (host twin)": onnxruntime.__version__}

    def check_options(self, options) -> dict:
        given = super().check_options(options)
        precision = given.get("precision") or "fp16"
        if precision not in PRECISIONS:
            raise InputError(f"--precision for {self.name} is one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "int8" and not options.prune:
            raise InputError("--precision int8 quantizes around the pruning; it needs a pruned bundle")
        if precision == "int8" and reads_projector_output(options):
            raise InputError(f"--precision int8 with {options.method}: its selection reads the projector output, "
                             "so everything before it must stay in floating point to keep the kept set; use fp16")
        return {"precision": precision}

    def legalization(self, config, options) -> list[ir.passes.PassBase]:
        return trt_passes.legalization_passes(self.platform.ops)

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        return trt_passes.node_support(node, self.platform.ops)

    def check_model(self, model: ir.Model) -> list[str]:
        return trt_passes.model_support(model, self.platform.ops)

    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """model.onnx (the plugin node where the method fuses), plugin sources, engine script, commands."""
        p, options = self.platform, context.options
        precision = context.target_options.get("precision", "fp16")
        fused = any(trt_passes.is_plugin_node(n) for n in model.graph)
        fields = {"runtime": "tensorrt", "device": p.device, "precision": precision,
                  "profile": _profile(model, options.batch),
                  "onnx_opset": model.opset_imports.get(""), "op_table": p.ops.source,
                  "fp32_layers": [n.name for n in selection_nodes(model.graph) if n.name],
                  "engine": {"file": engine_lib.ENGINE, "record": engine_lib.ENGINE_RECORD,
                             "built": "on the device: see README.md (vlmprune build-engine . or trtexec)"}}
        ir.save(model, out_dir / MODEL)
        shutil.copy2(engine_lib.__file__, out_dir / "vlmprune_engine.py")
        if precision == "int8":
            fields["qdq_model"] = QDQ_MODEL
            fields["quantization"] = write_qdq_model(out_dir, self.fusion(context.config, options), p.ops, context)
        if not fused:
            return {**fields, "fused": False}
        if any(n.op_type == SCORER_OP.op_type and trt_passes.is_plugin_node(n) for n in model.graph):
            fields["scorer_plugin"] = {"name": SCORER_OP.op_type, "version": trt_passes.SCORER_CONTRACT["version"],
                                       "namespace": trt_passes.SCORER_CONTRACT["namespace"],
                                       "host_twin_op": f"{SCORER_OP.domain}.{SCORER_OP.op_type}"}
        shutil.copy2(ort_target.library(), out_dir / HOST_TWIN)
        _copy_plugin_sources(p, out_dir / "plugins")
        return {
            **fields, "fused": True,
            "plugin": {"name": PLUGIN_OP.op_type, "version": trt_passes.PLUGIN_CONTRACT["version"],
                       "namespace": trt_passes.PLUGIN_CONTRACT["namespace"], "onnx_domain": PLUGIN_OP.domain,
                       "interface": p.plugin_interface, "sources": "plugins/", "library": PLUGIN_LIBRARY,
                       "trtexec_flag": p.trtexec_flag, "kept_indices_dtype": p.kept_dtype},
            "host_twin": {"library": HOST_TWIN, "runtime": "onnxruntime",
                          "op": f"{PLUGIN_OP.domain}.{PLUGIN_OP.op_type}",
                          "note": "the plugin's semantics over the same kernels (CPU), for parity off the device"},
        }

    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        from vlmprune.targets.runtime import ort_session, run_session

        bundle_dir = Path(bundle_dir)
        target = manifest.target
        fused = target.fused
        libs = (bundle_dir / HOST_TWIN,) if fused else ()

        def on_cpu(name: str):
            return lambda pixel, feeds=None: run_session(ort_session(bundle_dir / name, libs), pixel, feeds)

        what = "the plugin's host twin" if fused else "standard ops"
        # --scorer int8: the VlmpClsScore decision is INT8, so kept indices are held to the 8-bit agreement (as on ort).
        int8 = int8_scorer(manifest.method.params)
        stages = [StageSpec("fused",  # model.onnx on the host twin or in standard ops, named as on ort
                            f"onnxruntime CPU{' + ' + HOST_TWIN if fused else ''} ({MODEL}, {what}"
                            f"{', INT8 scorer' if int8 else ''})", "int8" if int8 else "fp32", on_cpu(MODEL))]
        if target.get("qdq_model"):
            stages.append(StageSpec("qdq", f"onnxruntime CPU{' + ' + HOST_TWIN if fused else ''} ({QDQ_MODEL}, "
                                    "explicit int8 Q/DQ)", "int8", on_cpu(QDQ_MODEL)))
        if engine_available(bundle_dir):
            runner = _LazyEngine(bundle_dir)
            stages.append(StageSpec(ENGINE_STAGE, f"TensorRT engine ({engine_lib.ENGINE})", runner.precision(), runner))
        return stages

    def runner(self, bundle_dir: Path, manifest: Manifest):
        """The engine, on the device; one line where TensorRT or the engine is absent."""
        runner = engine_lib.EngineRunner(bundle_dir)
        described = f"TensorRT {runner.trt.__version__} engine ({engine_lib.ENGINE}, {runner.precision})"
        if len(runner.inputs) == 1:
            return (lambda pixel, feeds=None: runner(pixel)), described
        from vlmprune.targets.runtime import optional_feed

        # text_embeds: the caller's rows (as run_session feeds ORT), checked against the engine's width
        metas = [_InputMeta(n, tuple(runner.engine.get_tensor_shape(n))) for n in runner.inputs[1:]]
        return (lambda pixel, feeds=None: runner(pixel, optional_feed(metas, pixel, feeds))), described

    def readme(self, manifest: Manifest) -> str:
        return _readme(self.platform, manifest)

    def commands(self) -> list:
        from vlmprune.targets.tensorrt_cli import build_engine

        return [build_engine]

    def require_engine(self, bundle_dir: Path) -> str:
        require_engine(bundle_dir)
        return ENGINE_STAGE


class OrinTarget(TensorRTTarget):
    platform = ORIN
    llm_exporters = ("edgellm",)  # TensorRT Edge-LLM's own exporter: the graph its C++ builder takes


class XavierTarget(TensorRTTarget):
    platform = XAVIER
    no_llm_why = "TensorRT Edge-LLM does not run on JetPack 5 / TensorRT 8.5"


# ------------------------------------------------------------------------ helpers


def require_engine(bundle_dir: Path) -> None:
    """For `check --engine`: a TensorRT bundle, TensorRT importable here, and an engine built by build-engine."""
    bundle_dir = Path(bundle_dir)
    engine_lib.load_bundle(bundle_dir)
    engine_lib.import_tensorrt()
    for name in (engine_lib.ENGINE, engine_lib.ENGINE_RECORD):
        if not (bundle_dir / name).is_file():
            raise engine_lib.EngineError(f"{bundle_dir / name} not found: build the engine on the device first "
                                         f"(vlmprune build-engine {bundle_dir})")


def engine_available(bundle_dir: Path) -> bool:
    """An engine built by build-engine is in the bundle and TensorRT is importable here."""
    bundle_dir = Path(bundle_dir)
    if not ((bundle_dir / engine_lib.ENGINE).is_file() and (bundle_dir / engine_lib.ENGINE_RECORD).is_file()):
        return False
    try:
        engine_lib.import_tensorrt()
    except engine_lib.EngineError:
        return False
    return True


class _LazyEngine:
    """The engine runner, created on first use (parity runs it inside its own error handling)."""

    def __init__(self, bundle_dir: Path):
        self.bundle_dir = bundle_dir
        self.runner = None

    def precision(self) -> str:
        import json

        record = json.loads((self.bundle_dir / engine_lib.ENGINE_RECORD).read_text())
        return record.get("precision", "fp16")

    def __call__(self, pixel_values, feeds=None):
        if self.runner is None:
            self.runner = engine_lib.EngineRunner(self.bundle_dir)
        return self.runner(pixel_values)  # the pixels only: the engine stage feeds no other input (runner() does)


def write_qdq_model(out_dir: Path, fusion, ops, context: EmitContext) -> dict:
    """model.qdq.onnx: the graph with explicit int8 Q/DQ (TensorRT's explicit quantization), fused like model.onnx.

    ONNX Runtime's quantize_static on model.decomposed.onnx (its calibration cannot load
    custom ops), then the target's fusion pipeline where the method fuses. int8 symmetric
    activations (per tensor, MinMax over real calibration images disjoint from the parity
    images) and weights (per output channel) on MatMul / Gemm / Conv. Everything that
    feeds the selection, and the selection itself, stays in floating point (found by the
    roles the insertion recorded): the quantizer puts Q/DQ on a tensor for all of its
    consumers, so the excluded nodes are rewired to the float tensor afterwards, and the
    kept indices do not depend on int8 rounding.
    """
    import tempfile

    from onnxruntime.quantization import CalibrationMethod, QuantType

    decomposed = ir.load(out_dir / DECOMPOSED)
    exclude = sorted({n.name for n in feeding_selection(decomposed.graph)} |
                     {n.name for n in decomposed.graph if role_of(n) is not None})  # and the emitted gathers
    value = decomposed.graph.inputs[0]
    batch = value.shape[0] if isinstance(value.shape[0], int) else 1
    count = max(batch, CALIBRATION_IMAGES // batch * batch)
    pixel, names = context.calibration_inputs(count, value.shape[-1])

    with tempfile.TemporaryDirectory(prefix=".qdq-", dir=out_dir) as tmp:
        model, rewired = static_qdq(
            out_dir / DECOMPOSED, Path(tmp), value.name, pixel, batch, exclude,
            activation_type=QuantType.QInt8, op_types_to_quantize=list(QUANTIZED_OPS),
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False,
                           "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}})
        ShapeInferencePass()(model)  # types of the quantizer's new tensors, for the support check
        if fusion is not None:
            fusion(model)
        ir.save(model, out_dir / QDQ_MODEL, external_data=QDQ_WEIGHTS)
    quantized = dequantized_nodes(model.graph, QUANTIZED_OPS)
    return {"model": QDQ_MODEL, "weights_file": QDQ_WEIGHTS, "format": "QDQ (explicit quantization)",
            "activations": "int8 symmetric, per tensor, MinMax calibration",
            "weights": "int8 symmetric, per output channel", "calibration_images": names,
            "quantized_nodes": len(quantized), "kept_float_nodes": len(exclude), "rewired_to_float": rewired,
            "kept_float": "everything feeding the selection, the selection, and the method's gathers"}


# The prompt's rows (text_embeds [B, T, D]) an engine takes: T in [1, TEXT_MAX], tuned for TEXT_OPT. T >= 1 because
# TensorRT's empty tensors are avoided: the device runner feeds one zero row for an empty prompt (T = 0), which every
# prompt-aware graph reads as no prompt (its cosine with any token is 0 by the norm floor, the mean over rows is 0).
TEXT_OPT, TEXT_MAX = 64, 2048


def _profile(model: ir.Model, batch: int | None) -> dict:
    """The optimization profile of the pixel input (static batch -> min = opt = max), and under "inputs" the other
    inputs' ranges (text_embeds: the same batch, T in [1, TEXT_MAX])."""
    value = model.graph.inputs[0]
    rest = [d if isinstance(d, int) else None for d in value.shape[1:]]
    if any(d is None for d in rest):
        raise StructureError(f"input {value.name} has dynamic dimensions besides the batch: {value.shape}")
    fixed = value.shape[0] if isinstance(value.shape[0], int) else batch
    lo, opt, hi = (fixed, fixed, fixed) if fixed else (1, 1, DEFAULT_MAX_BATCH)
    out = {"input": value.name, "min": [lo, *rest], "opt": [opt, *rest], "max": [hi, *rest],
           "batch": "static" if fixed else "dynamic"}
    for other in model.graph.inputs[1:]:
        if other.name != TEXT:
            raise StructureError(f"input {other.name}: the engine profile knows the pixels and {TEXT} only")
        width = other.shape[-1] if other.shape is not None else None
        if not isinstance(width, int):
            raise StructureError(f"input {TEXT} needs a static width for the engine profile, got {other.shape}")
        out.setdefault("inputs", []).append({"name": TEXT, "min": [lo, 1, width], "opt": [opt, TEXT_OPT, width],
                                             "max": [hi, TEXT_MAX, width]})
    return out


def _copy_plugin_sources(platform: JetsonPlatform, dest: Path) -> None:
    """kernels/{include, cuda/token_prune.cu, trt/common, trt/<api>} + a top CMakeLists.txt."""
    dest.mkdir()
    shutil.copytree(KERNELS_DIR / "include", dest / "include")
    (dest / "cuda").mkdir()
    shutil.copy2(KERNELS_DIR / "cuda" / "token_prune.cu", dest / "cuda" / "token_prune.cu")
    (dest / "trt").mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(KERNELS_DIR / "trt" / "common", dest / "trt" / "common", ignore=ignore)
    shutil.copytree(KERNELS_DIR / "trt" / platform.plugin_api, dest / "trt" / platform.plugin_api, ignore=ignore)
    shutil.copy2(KERNELS_DIR / "trt" / "plugin_names.json", dest / "trt" / "plugin_names.json")
    (dest / "CMakeLists.txt").write_text(plugin_cmakelists(platform))


def plugin_cmakelists(p: JetsonPlatform) -> str:
    return f"""# libvlmprune_trt.so for this bundle: {p.device}, JetPack {p.jetpack}
# (TensorRT {p.tensorrt}, CUDA {p.cuda}, sm_{p.sm}); the {p.plugin_interface} wrapper of trt/{p.plugin_api}.
# On the device, from the bundle folder:
#
#   cmake -S plugins -B plugins/build && cmake --build plugins/build -j
#
# The library is written to plugins/build/libvlmprune_trt.so. Options (see
# trt/{p.plugin_api}/CMakeLists.txt and trt/common/tensorrt.cmake): -DCMAKE_CUDA_ARCHITECTURES,
# -DTENSORRT_ROOT / -DTENSORRT_INCLUDE_DIR / -DTENSORRT_LIB_DIR for a TensorRT outside JetPack's folders.
cmake_minimum_required(VERSION {p.cmake_minimum}...3.28)

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES {p.sm})
endif()
# JetPack installs nvcc outside PATH.
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{{CUDACXX}} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release)
endif()

project(vlmprune_bundle_plugin LANGUAGES CXX CUDA)

set(CMAKE_LIBRARY_OUTPUT_DIRECTORY "${{CMAKE_BINARY_DIR}}")
add_subdirectory(trt/{p.plugin_api})
"""


def _shown(cmd: list) -> str:
    """A trtexec command for the README; a --layerPrecisions list of hundreds of layers is abbreviated."""
    shown = []
    for arg in cmd:
        if arg.startswith("--layerPrecisions=") and len(arg) > 2000:
            count = arg.count(":fp32")
            arg = f"--layerPrecisions=<{count} layers from manifest.json target.fp32_layers, each :fp32>"
        shown.append(arg)
    return engine_lib.format_command(shown)


def _text_note(profile: dict) -> str:
    """The README's line on text_embeds, for a prompt-aware bundle ("" otherwise)."""
    text = next((spec for spec in profile.get("inputs", []) if spec["name"] == TEXT), None)
    if text is None:
        return ""
    return (f"\nInput `{TEXT}`: [batch, T, {text['min'][2]}] float32, the prompt's rows of the LLM's embedding table "
            f"(vlmprune run --prompt, generate and eval compute them); the engine profile takes T from "
            f"{text['min'][1]} to {text['max'][1]} (opt {text['opt'][1]}); for no prompt feed one zero row, "
            "which the graph reads as no prompt (vlmprune's runner does so).")


def _readme(p: JetsonPlatform, manifest: Manifest) -> str:
    target = manifest.target
    inp, outputs = manifest.inputs[0], manifest.outputs
    profile = target["profile"]
    fused = target.fused
    cmd = _shown(engine_lib.trtexec_command(manifest))
    decomposed_cmd = _shown(engine_lib.trtexec_command(manifest, decomposed=True, engine="model.decomposed.engine"))
    plugin_flag = f"{p.trtexec_flag}={PLUGIN_LIBRARY}"
    batch = (f"static batch {profile['min'][0]}" if profile["batch"] == "static"
             else f"dynamic batch: profile min {profile['min'][0]}, opt {profile['opt'][0]}, max {profile['max'][0]}")
    plugin_step = f"""## 1. Build the plugin (once per JetPack install)

    cmake -S plugins -B plugins/build && cmake --build plugins/build -j$(nproc)

This compiles `plugins/` ({p.plugin_interface} over the CUDA kernels, sm_{p.sm}) into
`{PLUGIN_LIBRARY}`. It needs CMake >= {p.cmake_minimum} and the CUDA {p.cuda} toolkit of
JetPack (`/usr/local/cuda`); TensorRT is found in `/usr/include/aarch64-linux-gnu` and
`/usr/lib/aarch64-linux-gnu` (override with `-DTENSORRT_ROOT=...`).
""" if fused else ("## 1. No plugin\n\nmodel.onnx has standard ops only: "
                  + ("this bundle is dense (no pruning).\n" if not manifest.method.pruned else
                     f"the {manifest.method.name} selection runs as standard TensorRT layers.\n"))
    contract = trt_passes.PLUGIN_CONTRACT
    precision = target.precision or "fp16"
    quant = target.get("quantization")
    qdq_files = (f"- `{QDQ_MODEL}` + `{QDQ_WEIGHTS}`: the int8 engine's graph, explicit Q/DQ on "
                 f"{quant['quantized_nodes']} MatMul/Gemm/Conv (weights: {quant['weights']}; activations: "
                 f"{quant['activations']} over {len(quant['calibration_images'])} images); everything that feeds "
                 "the selection stays in floating point.\n" if quant else "")
    model_note = (f"the pruning is one `{PLUGIN_OP.op_type}` node (plugin_version {contract['version']}, "
                  f"plugin_namespace {contract['namespace']}), which TensorRT's ONNX parser maps to the plugin."
                  if fused else "standard ops.")
    plugin_files = (f"- `plugins/`: the plugin sources and CMakeLists.txt; `{HOST_TWIN}`: the plugin's host twin "
                    "(ONNX Runtime op over the same kernels on the CPU), used for parity off the device."
                    if fused else "")
    fp32_note = ("The layers listed in --layerPrecisions compute the selection (its scores and indices); they "
                 "stay fp32 so that fp16 does not move the K-th boundary. " if target.get("fp32_layers") else "")
    modern_python = tuple(map(int, p.device_python.split("."))) >= (3, 10)
    with_vlmprune, standalone = "vlmprune build-engine .", "python3 vlmprune_engine.py build ."
    build_first = with_vlmprune if modern_python else standalone
    build_second = (f", without vlmprune installed:\n\n    {standalone}" if modern_python
                    else f", with vlmprune installed (Python >= 3.10):\n\n    {with_vlmprune}")
    python_note = (
        "`vlmprune` needs Python >= 3.10 (JetPack 6 ships 3.10); `vlmprune_engine.py` needs only numpy, "
        "TensorRT's Python bindings and cuda-python (or pycuda)."
        if modern_python else
        "JetPack 5.1 ships Python 3.8, which vlmprune itself does not support: use `python3 vlmprune_engine.py` "
        "(numpy, TensorRT's Python bindings, cuda-python or pycuda) or trtexec there; `vlmprune build-engine` / "
        "`run` / `check --engine` work from a Python >= 3.10 environment that has TensorRT 8.5's bindings."
    )
    return f"""# vlmprune bundle: target `{p.name}` ({p.device}, TensorRT {p.tensorrt})

Model: {manifest.model.source} — {manifest.method.summary}

Input `{inp.name}`: {inp.shape} {inp.dtype} (normalized pixels); {batch}.{_text_note(profile)}
Outputs: {', '.join(f"`{o.name}` {o.shape} {o.dtype}" for o in outputs)}
(the engine returns `kept_indices` as {p.kept_dtype}).

Device: {p.device} with JetPack {p.jetpack} (L4T {p.l4t}: TensorRT {p.tensorrt}, CUDA {p.cuda}, sm_{p.sm}).
The engine is built on the device, from this folder: an engine only runs on the TensorRT
version and GPU it was built with. Copy the whole folder to the Jetson and run, inside it:

{plugin_step}
## 2. Build the engine ({precision})

    {build_first}

or{build_second}

or with trtexec (the same engine; JetPack puts trtexec in /usr/src/tensorrt/bin):

    {cmd}

Either writes `model.engine`; the first two also write `model.engine.json` (its sha256, the
TensorRT version, the command), which `vlmprune run` and `check --engine` verify before
loading it. {fp32_note}{python_note}

## 3. Run and check

    vlmprune run . --image photo.jpg      # shapes and the kept indices of image 0
    vlmprune check . --engine             # the engine against the PyTorch reference ({precision} tolerances)
    /usr/src/tensorrt/bin/trtexec --loadEngine=model.engine {plugin_flag if fused else ""}   # timing

`check --engine` loads the model source ({manifest.model.source}) with PyTorch to compute
the reference, so it needs vlmprune's dependencies and that source on the device.

## Files

- `model.onnx`: the graph for TensorRT; {model_note}
- `model.decomposed.onnx`: the same graph in standard ONNX ops that TensorRT {p.tensorrt}'s parser supports
  (opset {target.get('onnx_opset')}); builds without the plugin: `{decomposed_cmd}`.
- `weights.bin`: the weights both graphs read.
{qdq_files}{plugin_files}
- `vlmprune_engine.py`: builds (`build`) and smoke-runs (`run [--npy pixels.npy]`) the engine without vlmprune.
- `parity.json`: every parity stage checked when the bundle was compiled; `manifest.json`: versions,
  optimization profile, precision and every file's sha256.
"""
