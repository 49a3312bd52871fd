"""Target `openvino`: Intel CPUs, integrated GPUs and NPUs through OpenVINO.

The pruned graph stays in standard ONNX ops (model.onnx is model.decomposed.onnx: OpenVINO has
no use for the vlmprune custom ops, and its ONNX frontend reads every op the selection is
written in), and is converted with OpenVINO's own `ov.convert_model` into OpenVINO IR,
model.xml + model.bin, saved in fp32 (compress_to_fp16 off: the precision is the runtime's
choice, below, not the file's).

Precision (--precision):
- f32: the IR compiled with INFERENCE_PRECISION_HINT f32. OpenVINO's CPU plugin defaults to bf16
  wherever the CPU has bf16 instructions (it did on this AMD EPYC with avx512_bf16 and no AMX),
  so the hint is set explicitly: without it an "f32" bundle would silently run bf16.
- bf16: the same IR compiled with INFERENCE_PRECISION_HINT bf16. The whole graph runs in bf16,
  the score path included, so the kept set may swap tokens at the K-th boundary: parity holds it
  to the contract's "bf16" tolerances (compiler.parity), compares image features on the tokens both
  sides kept, and reports the swap and the tie band. Where the CPU has no bf16 (OPTIMIZATION_
  CAPABILITIES lacks BF16) the stage says in one line that it runs f32 instead.
- int8: NNCF post-training quantization (nncf.quantize, ONNX backend, transformer preset, SmoothQuant
  off: advanced_parameters says why) of the decomposed graph, calibrated on --calibration DIR or the
  built-in photographs as the ort target is, with what the ort target keeps fp32 kept out of it
  (nncf.IgnoredScope over targets.ort_quant.excluded_nodes: everything the kept indices depend on, the
  selection, and the attention MatMuls and the MLP's second MatMul; the same "kept set is fp32's"
  contract as ort and rk3588). The ONNX backend, not the OpenVINO one: the ignored nodes are named in
  the ONNX graph, and after ov.convert_model only some names survive (measured: 40 of 61 score-path
  nodes of the tests' tiny CLIP; quantizing the rest moved the kept set). The QDQ graph is converted to
  model.int8.xml + .bin and compiled with the f32 hint, so that what NNCF left unquantized stays f32.
  A method whose selection reads the projector output (divprune, dart, holov, cdpruner) is refused,
  as on ort: the fp32 score path would be the whole tower.
- int8-bf16: the same int8 IR compiled with the bf16 hint, so what NNCF left unquantized (the score
  path included) runs bf16: the kept set is bf16's (held to the contract's "int8-bf16" tolerance:
  bf16's agreement and tie band, int8's feature cosine). Why a precision of its own: on a CPU with AMX
  it is the fastest (clip-l-336 pruned after block 2, 2 threads, Xeon with AMX: 86.6 ms against bf16's
  122.8 and int8's 153.0 under the f32 hint, kept agreement 0.9935), since int8 with the f32 hint
  leaves the attention and the MLP's second MatMul in f32.

Methods (demo, K = 64, parity here): every method compiles and passes at f32; at bf16 all but
cdpruner pass (its greedy DPP left a step off a tie: agreement 0.85, so that compile fails parity)
and tome is refused up front (Method.float32_only: its merges flip below fp32).

Devices (--device CPU | GPU | NPU, OpenVINO's names): the IR is device-independent; the bundle
records the device it is meant for and its README compiles it there. A device this machine lacks
(`ov.Core().available_devices`) is checked on CPU, and every stage and runner line says so, as
rk3588's and qnn's simulators are labelled.

The language model is left out: OpenVINO GenAI reads optimum-intel's IR of the LLM, which this
version does not export (no_llm_why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import DECOMPOSED, MODEL, OPENVINO_INT8_IR, OPENVINO_IR, Manifest
from vlmprune.compiler.errors import InputError, ToolchainError
from vlmprune.targets.base import EmitContext, StageSpec, Target


@dataclasses.dataclass(frozen=True)
class Precision:
    """One --precision: the IR it runs, the inference-precision hint it is compiled with, the parity tolerance."""

    ir: str
    hint: str
    parity: str  # compiler.parity.DEFAULT_TOLERANCES key
    what: str
    quantized: bool = False  # NNCF PTQ writes model.int8.xml (emit_int8), calibrated as ort --precision int8


PRECISIONS = {
    "f32": Precision(OPENVINO_IR, "f32", "fp32", "fp32 throughout (INFERENCE_PRECISION_HINT f32)"),
    "bf16": Precision(OPENVINO_IR, "bf16", "bf16", "bf16 throughout, the score path included "
                                                   "(INFERENCE_PRECISION_HINT bf16)"),
    # the kept set stays fp32's: held to fp32's agreement, the features to int8's cosine (as ort --precision int8)
    "int8": Precision(OPENVINO_INT8_IR, "f32", "int8-fp32-score", "NNCF PTQ int8 outside the score path, the rest "
                                                                  "fp32 (INFERENCE_PRECISION_HINT f32)", quantized=True),
    # the same int8 IR under the bf16 hint: what NNCF left unquantized (the score path included) runs bf16, so the
    # kept set is bf16's (held to bf16's agreement and tie band), the features int8's cosine
    "int8-bf16": Precision(OPENVINO_INT8_IR, "bf16", "int8-bf16", "NNCF PTQ int8 outside the score path, the rest "
                                                                  "bf16, the score path included "
                                                                  "(INFERENCE_PRECISION_HINT bf16)", quantized=True),
}
DEFAULT_PRECISION = "f32"
DEVICES = ("CPU", "GPU", "NPU")
DEFAULT_DEVICE = "CPU"
CHECK_DEVICE = "CPU"  # where a device absent here is checked
THREADS_ENV = "VLMPRUNE_ORT_THREADS"  # the same thread count the ONNX Runtime sessions take (targets.runtime)


def openvino():
    """The openvino module, imported with OpenVINO's and NNCF's usage telemetry declined for this process.

    Both send usage events unless a consent file says no (`import openvino` sends one, from ovc), each from a
    process forked by a worker thread: here that fork killed a Python process with SIGBUS, and a compiler sends
    nothing of its users'. Both ask openvino_telemetry whether they run in CI (disable_in_ci=True) and then
    decline: that check answers yes here, before either is imported. The user's consent file is left alone.
    """
    try:
        from openvino_telemetry.utils import opt_in_checker
    except ImportError:  # no telemetry package: nothing is sent
        pass
    else:
        opt_in_checker.OptInChecker._run_in_ci = staticmethod(lambda: True)
    import openvino as ov

    return ov


def parse_precision(value: str | None) -> str:
    name = (value or DEFAULT_PRECISION).strip().lower()
    name = {"fp32": "f32", "float32": "f32", "bfloat16": "bf16", "int8+bf16": "int8-bf16"}.get(name, name)
    if name not in PRECISIONS:
        raise InputError(f"openvino --precision takes {', '.join(PRECISIONS)}, got {value!r}")
    return name


def parse_device(value: str | None) -> str:
    name = (value or DEFAULT_DEVICE).strip().upper()
    if name not in DEVICES:
        raise InputError(f"openvino --device takes {', '.join(DEVICES)} (OpenVINO's device names), got {value!r}")
    return name


def present_devices() -> list[str]:
    """OpenVINO's devices on this machine, by family ("GPU.0" -> "GPU")."""
    ov = openvino()

    return sorted({d.split(".")[0] for d in ov.Core().available_devices})


def bf16_note(device: str) -> str:
    """One line where bf16 cannot run as asked on `device` here, else ""."""
    ov = openvino()

    capabilities = ov.Core().get_property(device, "OPTIMIZATION_CAPABILITIES")
    if "BF16" in capabilities:
        return ""
    return f"{device} here has no bf16 (OPTIMIZATION_CAPABILITIES {capabilities}): OpenVINO runs the graph in f32 instead"


class OpenVinoTarget(Target):
    name = "openvino"
    summary = "OpenVINO (Intel CPU, iGPU, NPU): IR from ov.convert_model, f32 / bf16 hint / NNCF int8"
    no_llm_why = ("OpenVINO GenAI reads optimum-intel's IR of the language model, which this version does not "
                  "export: the tower bundle only")
    options = {"precision": "openvino: f32 (default), bf16 (INFERENCE_PRECISION_HINT), int8 (NNCF PTQ, the score "
                            "path fp32) or int8-bf16 (the same int8 IR, the rest bf16: the fastest on AMX)",
               "calibration": "openvino --precision int8: as for ort",
               "device": "openvino: CPU (default), GPU or NPU; one absent here is checked on CPU, labelled so"}

    def available(self) -> tuple[bool, str]:
        import importlib.util

        for module in ("openvino", "nncf"):
            if importlib.util.find_spec(module) is None:
                return False, f"{module} is not installed (pip install 'vlmprune[openvino]')"
        return True, ""

    def toolchain(self) -> dict[str, str]:
        ov = openvino()  # first: telemetry declined before nncf imports openvino
        import nncf
        import onnx

        return {"openvino": ov.get_version().split("-")[0], "nncf": nncf.__version__, "onnx": onnx.__version__}

    def listing(self) -> list[str]:
        return [f"openvino --precision: {', '.join(PRECISIONS)} (default {DEFAULT_PRECISION}); --device: "
                f"{', '.join(DEVICES)} (default {DEFAULT_DEVICE}; one absent here is checked on {CHECK_DEVICE})"]

    def check_options(self, options) -> dict:
        import vlmprune.targets.ort_quant as ort_quant
        from vlmprune.targets.base import reads_projector_output

        given = super().check_options(options)
        precision, device = parse_precision(given.get("precision")), parse_device(given.get("device"))
        if given.get("calibration") is not None and not PRECISIONS[precision].quantized:
            raise InputError("--calibration calibrates --precision int8: add --precision int8 or drop --calibration")
        if PRECISIONS[precision].quantized and reads_projector_output(options):
            raise InputError(f"openvino --precision {precision} with {options.method}: its selection reads the "
                             "projector output, so the unquantized score path would be the whole tower and nothing "
                             "would be quantized")
        if PRECISIONS[precision].hint == "bf16" and options.prune:
            from vlmprune.passes.methods import get_method

            why = get_method(options.method).float32_only
            if why:
                raise InputError(f"openvino --precision {precision} cannot run method {options.method}: {why}, and "
                                 "the bf16 hint runs what is not int8 in bfloat16; compile with --precision f32")
        chosen = {"precision": precision, "device": device}
        if given.get("calibration") is not None:
            ort_quant.check_calibration_dir(given["calibration"])
            chosen["calibration"] = str(Path(given["calibration"]).expanduser().resolve())
        return chosen

    # ------------------------------------------------------------------ artifacts

    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """model.onnx (standard ops), model.xml + model.bin (OpenVINO IR, fp32); int8: model.int8.xml + .bin too."""
        ov = openvino()

        chosen = context.target_options
        precision, device = chosen["precision"], chosen["device"]
        out_dir = Path(out_dir)
        ir.save(model, out_dir / MODEL)
        try:
            ov.save_model(ov.convert_model(str(out_dir / MODEL)), str(out_dir / OPENVINO_IR), compress_to_fp16=False)
        except Exception as exc:  # the frontend names the op it cannot read
            raise ToolchainError(f"openvino: ov.convert_model cannot read the graph: {first_line(exc)}") from None
        fields = {"runtime": "OpenVINO", "precision": precision, "device": device, "ir": PRECISIONS[precision].ir,
                  "inference_precision_hint": PRECISIONS[precision].hint, "what": PRECISIONS[precision].what}
        if PRECISIONS[precision].quantized:
            fields["int8"] = emit_int8(out_dir, context)
        if device not in present_devices():
            fields["checked_on"] = CHECK_DEVICE
        return fields

    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        """One stage, `openvino`: the bundle's IR at its precision, on its device or on CPU where that is absent."""
        fields = manifest.target
        precision = PRECISIONS[fields.precision or DEFAULT_PRECISION]
        run, runtime = self.runner(bundle_dir, manifest)
        return [StageSpec("openvino", runtime, precision.parity, run)]

    def runner(self, bundle_dir: Path, manifest: Manifest):
        """The IR compiled on the bundle's device (CPU where this machine lacks it) with its precision hint."""
        ov = openvino()

        fields = manifest.target
        name = fields.precision or DEFAULT_PRECISION
        precision, wanted = PRECISIONS[name], fields.get("device", DEFAULT_DEVICE)
        device = wanted if wanted in present_devices() else CHECK_DEVICE
        graph = Path(bundle_dir) / precision.ir
        compiled = None

        def run(pixel_values: np.ndarray, feeds=None) -> dict[str, np.ndarray]:
            nonlocal compiled
            compiled = compiled or compile_ir(graph, device, precision.hint)
            return run_compiled(compiled, pixel_values, feeds)

        label = f"OpenVINO {ov.get_version().split('-')[0]} {device} ({precision.ir}, {name}"
        note = bf16_note(device) if precision.hint == "bf16" else ""
        label += f"; {note})" if note else ")"
        if device != wanted:
            label += f" (checked on {device}: no {wanted} here)"
        return run, label

    def readme(self, manifest: Manifest) -> str:
        return _readme(manifest)


def first_line(exc: Exception) -> str:
    return " ".join(str(exc).split("\n")[0].split()) or type(exc).__name__


def compile_ir(path: Path, device: str, hint: str):
    """ov.CompiledModel of the IR at path on device, with the precision hint (and the product's thread count)."""
    ov = openvino()

    config = {"INFERENCE_PRECISION_HINT": hint}
    threads = int(os.environ.get(THREADS_ENV, "0"))
    if threads and device == "CPU":
        config["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    return core.compile_model(core.read_model(str(path)), device, config)


@dataclasses.dataclass(frozen=True)
class _InputMeta:
    """An input as targets.runtime.optional_feed reads one: its name and shape (a str for a dynamic dimension)."""

    name: str
    shape: list


def run_compiled(compiled, pixel_values: np.ndarray, feeds=None) -> dict[str, np.ndarray]:
    """Run on the pixels, the inputs beside them (prompt, ROI) from the caller's feeds as the ONNX Runtime sessions
    take them (targets.runtime.optional_feed)."""
    from vlmprune.targets.runtime import optional_feed

    metas = [_InputMeta(i.any_name, [d.get_length() if d.is_static else "?" for d in i.get_partial_shape()])
             for i in compiled.inputs]
    feed = {metas[0].name: np.ascontiguousarray(pixel_values), **optional_feed(metas[1:], pixel_values, feeds)}
    result = compiled(feed)
    return {o.any_name: np.asarray(result[o]) for o in compiled.outputs}


# ---------------------------------------------------------------------------- int8 (NNCF)


def emit_int8(out_dir: Path, context: EmitContext) -> dict:
    """model.int8.xml + .bin: NNCF PTQ of the decomposed graph outside the score path; the manifest's int8 fields."""
    import vlmprune.targets.ort_quant as ort_quant

    chosen = context.target_options
    pixels, names = ort_quant.calibration_pixels(chosen.get("calibration"), context.image_size, context.mean,
                                                 context.std, context.images)
    fields = quantize(Path(out_dir) / DECOMPOSED, Path(out_dir) / OPENVINO_INT8_IR, pixels,
                      context.calibration_feed)
    return {**fields, "calibration_images": [Path(n).name for n in names],
            "calibration": "user folder (--calibration)" if chosen.get("calibration") else
                           "built-in photographs (targets.calibration), disjoint from the parity images"}


INLINE_LIMIT = 2_000_000_000  # bytes: protobuf's limit on one serialized ModelProto, with a margin


def advanced_parameters():
    """NNCF's advanced parameters here: SmoothQuant off (alpha -1), by measurement on the tiny CLIP of the tests
    (cls keep 16 after block 1, 3 noise images): with it the features' min token cosine to f32 was 0.949, without
    0.982 (the ort groups kept fp32 in both; the kept set fp32's in both)."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    return AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))


@contextlib.contextmanager
def _quiet():
    """NNCF's warnings off, and its progress bars on stderr: stdout is kept for data (`--json`)."""
    import logging

    openvino()  # first: telemetry declined before nncf imports openvino
    import nncf

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    nncf.set_log_level(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logging.disable(previous)


def quantize(decomposed: Path, out_path: Path, pixels: np.ndarray, extra=None) -> dict:
    """NNCF post-training quantization of the ONNX graph at `decomposed`, the score path and the ort target's fp32
    groups ignored (targets.ort_quant.excluded_nodes); saved as IR. extra(inputs, pixels): a sample's arrays of the
    graph's inputs after the pixels (EmitContext.calibration_feed: --roi's fixed-seed ROI); None: none but the
    pixels' own defaults (targets.runtime.optional_feed)."""
    ov = openvino()  # first: telemetry declined before nncf imports openvino
    import nncf
    import onnx

    from vlmprune.targets.ort_quant import DEFAULT, excluded_nodes
    from vlmprune.targets.runtime import optional_feed

    graph = ir.load(decomposed)
    fp32 = sorted({n.name for n in excluded_nodes(graph.graph, DEFAULT)})
    value = graph.graph.inputs[0]
    batch = value.shape[0] if isinstance(value.shape[0], int) else 1
    samples = [pixels[[(i + j) % len(pixels) for j in range(batch)]] for i in range(0, len(pixels), batch)]
    extra = extra or (lambda inputs, x: optional_feed(inputs, x))
    # --roi: the calibration images' fixed-seed ROI beside them (the emit context's: compiler.roi)
    feeds = [{value.name: x, **extra(graph.graph.inputs[1:], x)} for x in samples]
    try:
        with _quiet():
            quantized = nncf.quantize(onnx.load(str(decomposed)), nncf.Dataset(feeds), subset_size=len(feeds),
                                      model_type=nncf.ModelType.TRANSFORMER, advanced_parameters=advanced_parameters(),
                                      ignored_scope=nncf.IgnoredScope(names=fp32, validate=False))
    except Exception as exc:  # NNCF raises many kinds; one line names it
        raise ToolchainError(f"openvino --precision int8: nncf.quantize failed: {first_line(exc)}") from None
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=Path(out_path).parent) as tmp:
        path = Path(tmp) / "q.onnx"
        # inline below protobuf's 2 GB: an external-data file written here was once found empty when
        # ov.convert_model mapped it (SIGBUS), which one file cannot be
        inline = quantized.ByteSize() < INLINE_LIMIT
        onnx.save(quantized, str(path), save_as_external_data=not inline, location="q.bin")
        ov.save_model(ov.convert_model(str(path)), str(out_path), compress_to_fp16=False)
    ops = [n.op_type for n in quantized.graph.node]
    return {"model": Path(out_path).name, "format": "OpenVINO IR with FakeQuantize (NNCF PTQ, ONNX backend, "
                                                    "ModelType.TRANSFORMER, SmoothQuant off)",
            "quantize_pairs": ops.count("QuantizeLinear"), "fp32_nodes": len(fp32),
            "fp32": "everything the kept indices depend on, the selection and its gathers/merge, and the groups "
                    f"{', '.join(DEFAULT.exclude)} (nncf.IgnoredScope: the ort target's measured choice, "
                    "targets.ort_quant)"}


# ---------------------------------------------------------------------------- README


def _readme(manifest: Manifest) -> str:
    fields = manifest.target
    inp = manifest.inputs[0]
    name = fields.precision or DEFAULT_PRECISION
    precision, device = PRECISIONS[name], fields.get("device", DEFAULT_DEVICE)
    shape = [1 if isinstance(d, str) else d for d in inp.shape]
    # the NPU plugin picks its own precision (f16); the hint is for CPU and GPU
    config = "{}" if device == "NPU" else f'{{"INFERENCE_PRECISION_HINT": "{precision.hint}"}}'
    checked = (f"\nThis machine has no {device}: parity ran on {fields['checked_on']} (labelled so in parity.json); "
               f"run `vlmprune check .` on the {device} machine to check it there.\n" if fields.get("checked_on") else "")
    return f"""# vlmprune bundle: target `openvino` (OpenVINO, {device}, {name})

Model: {manifest.model.source} — {manifest.method.summary}

Input `{inp.name}`: {inp.shape} {inp.dtype} (normalized pixels).
Outputs: {', '.join(f"`{o.name}` {o.shape} {o.dtype}" for o in manifest.outputs)}.

Files: `{precision.ir}` + its `.bin` (OpenVINO IR; {precision.what}); `{OPENVINO_IR}` is the fp32 IR,
`model.onnx` / `model.decomposed.onnx` the same graph in standard ONNX ops (no custom op).
{checked}
## Run (Linux or Windows, x86-64; Intel CPU, Arc / Core Ultra iGPU, Core Ultra NPU)

    pip install openvino=={fields.toolchain.get('openvino', '2026.4')} numpy
    python - <<'PY'
    import numpy as np, openvino as ov
    core = ov.Core()
    compiled = core.compile_model("{precision.ir}", "{device}", {config})
    x = np.zeros({shape}, dtype=np.float32)
    result = compiled({{"{inp.name}": x}})
    print({{o.any_name: result[o].shape for o in compiled.outputs}})
    PY

Set the hint on CPU: OpenVINO's CPU plugin runs bf16 by default where the CPU has it, so `f32` must be asked for.
`benchmark_app -m {precision.ir} -d {device} -hint latency -infer_precision {precision.hint}` times it on the device.
With vlmprune installed: `vlmprune run . --image photo.jpg [--benchmark]`; `vlmprune check .` re-runs parity.
Check every file's sha256 against manifest.json before loading it.
"""
