"""Target `qnn`: Qualcomm HTP (Hexagon NPU) through ONNX Runtime's QNN execution provider.

The pipeline legalizes the graph for HTP (passes.qnn: static shapes, Gather selection), so
model.decomposed.onnx and model.onnx are the float graph that is quantized. emit quantizes it
to QDQ with onnxruntime.quantization's QNN helpers (16-bit activations, 8-bit weights by
default; the method's selection, found by the roles the insertion recorded, stays float and
runs on HTP in fp16; every MatMul of two activations reads one side as 8-bit, see
targets.qnn_tools.quantize_qdq) into model.qdq.onnx, and compiles that for --soc into an
EPContext model, model_ctx.onnx, whose QNN context binary (.bin) sits beside it. HTP compiles
no control flow, so a selection with a Loop (divprune's greedy loop) takes its unrolled form here.

Parity runs both the QDQ model and the EPContext model in onnxruntime-qnn's HTP emulator
(libQnnHtp on x86_64) with CPU fallback disabled, so a node HTP cannot take fails the
stage instead of running on the CPU. Nothing here ran on a phone: the stages are labelled
"(simulated)". Op placement comes from ONNX Runtime's assignment of nodes to execution
providers (session.record_ep_graph_assignment_info), taken with fallback allowed so that
it shows what would leave HTP.

Precision (--precision): int16 (uint16 activations, uint8 weights). int8 activations are refused
with the measurement: on the demo tower (Softmax outputs on their calibrated range, see
qnn_tools.quantize_qdq) they keep a token cosine of 0.966 unpruned, under the 0.99 the parity
contract asks of 8-bit, and reorder the [CLS]-attention ranking (kept-index agreement 0.84 at
-k 64), while int16 keeps >= 0.9996.

Selection formulation: Gather, by measurement (demo tower, pruning after block 2 and after
the last block, HTP emulator, SM8650): Gather and GatherElements run on HTP, the selection
costs ~30k emulated cycles and the features keep cosine >= 0.9993; the one-hot MatMul also
stays on HTP but costs ~5M cycles and, quantized, loses the features (cosine -0.14).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import MODEL, QDQ_MODEL, QNN_CONTEXT, Manifest
from vlmprune.compiler.errors import InputError, ToolchainError
from vlmprune.passes.methods.builder import selection_nodes
from vlmprune.passes.qnn import TARGET, htp_legalization, htp_model_support, htp_support
import vlmprune.targets.placement as placement
from vlmprune.targets.base import EmitContext, StageSpec, Target

# precision -> (activation type, weight type)
PRECISIONS = {"int16": ("uint16", "uint8"), "int8": ("uint8", "uint8")}
DEFAULT_PRECISION = "int16"
# measured on demo (module docstring); PRECISIONS keeps int8 for qnn_tools experiments
REFUSED_PRECISIONS = {"int8": "8-bit activations keep a token cosine of 0.966 on demo even unpruned (parity asks "
                              ">= 0.99 of 8-bit) and reorder the selection's scores (kept-index agreement 0.84 for "
                              "cls -k 64)"}
CALIBRATION_COUNT = 8
QDQ, CTX = QDQ_MODEL, QNN_CONTEXT


def parse_precision(value: str | None) -> str:
    name = (value or DEFAULT_PRECISION).strip().lower()
    if name not in PRECISIONS:
        raise InputError(f"qnn --precision takes {DEFAULT_PRECISION} (activation bits), got {value!r}")
    if name in REFUSED_PRECISIONS:
        raise InputError(f"qnn --precision {name} is refused: {REFUSED_PRECISIONS[name]}; compile with --precision "
                         f"{DEFAULT_PRECISION} (the default)")
    return name


class QnnTarget(Target):
    name = "qnn"
    summary = "Qualcomm HTP: ONNX Runtime QNN EP (QDQ + EPContext for --soc), HTP emulator parity"
    reduced_precision = "HTP runs the graph quantised (16-bit activations, 8-bit weights)"
    no_llm_why = ("onnxruntime-genai's builder has no QNN execution provider, and an HTP LLM needs static, "
                  "quantized, split graphs")
    options = {"precision": "qnn: int16 activations (the default; int8 is refused: it loses parity)",
               "soc": "qnn: the Snapdragon SoC to compile for (default SM8650; see `vlmprune targets`)"}
    control_flow = False  # HTP compiles no control flow
    emulated_time = "onnxruntime-qnn's HTP emulator on this host's CPU, not the HTP's latency"  # ~1.6 s per image
    no_timing_why = ("onnxruntime-qnn's HTP emulator reports emulated cycles per op, not time, and no clock here "
                     "turns them into ms: compile with --keep K and time the bundles on the phone")
    no_prompt_input = "QNN HTP compiles static input shapes only, while the prompt's length varies per request"

    def __init__(self, selection: str = "gather"):
        self.selection = selection

    def available(self) -> tuple[bool, str]:
        import vlmprune.targets.qnn_tools as qnn_tools

        return qnn_tools.available()

    def toolchain(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        import vlmprune.targets.qnn_tools as qnn_tools

        versions = {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}
        try:
            import onnxruntime_qnn

            versions["onnxruntime-qnn"] = onnxruntime_qnn.__version__
            versions["qnn sdk"] = qnn_tools.qnn_sdk_version()
        except ImportError:
            pass
        return versions

    def listing(self) -> list[str]:
        """The --soc values, for `vlmprune targets`."""
        from vlmprune.targets.qnn_tools import DEFAULT_SOC, SOCS

        return [f"qnn --soc values (default {DEFAULT_SOC}):",
                *(f"  {soc:<9} soc_model {model:<3} HTP {arch}  {product}" for soc, (model, arch, product) in SOCS.items())]

    def check_options(self, options) -> dict:
        import vlmprune.targets.qnn_tools as qnn_tools

        given = super().check_options(options)
        if options.batch not in (None, 1):
            raise InputError(f"qnn compiles batch 1 (a context binary per shape; measured at --batch 3 on demo the "
                             "quantized features lose parity, cosine 0.985 for cls): compile without --batch, not "
                             f"--batch {options.batch}")
        precision = parse_precision(given.get("precision"))
        try:
            soc, soc_model = qnn_tools.resolve_soc(given.get("soc"))
        except qnn_tools.QnnError as exc:
            raise InputError(str(exc)) from None
        return {"precision": precision, "soc": soc, "soc_model": soc_model}

    def legalization(self, config, options) -> list[ir.passes.PassBase]:
        return htp_legalization(options.batch or 1, self.selection)

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        return htp_support(node)

    def check_model(self, model: ir.Model) -> list[str]:
        return htp_model_support(model)

    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """model.onnx (the decomposed graph: HTP-legal already), QDQ model.qdq.onnx, model_ctx.onnx + .bin for the SoC."""
        import onnx

        import vlmprune.targets.qnn_tools as qnn_tools

        options, chosen = context.options, context.target_options
        precision, soc, soc_model = chosen["precision"], chosen["soc"], chosen["soc_model"]
        act, weight = PRECISIONS[precision]
        needs = context.quantization  # what the family's graph needs beyond this recipe, by measurement
        if needs.wide_weights:
            weight = "uint16"
        batch = options.batch or 1
        ir.save(model, out_dir / MODEL)
        # The selection stays float (fp16 on HTP), found by the roles the insertion recorded; so do the attention
        # cores, found by structure, where the family's attention needs it.
        float_nodes = [n.name for n in selection_nodes(model.graph)]
        attention = [n.name for n in qnn_tools.attention_cores(onnx.load(str(out_dir / MODEL)))] \
            if needs.float_attention else []
        calib, names = context.calibration_inputs(CALIBRATION_COUNT)
        input_name = model.graph.inputs[0].name
        samples = [{input_name: calib[[(i * batch + j) % len(calib) for j in range(batch)]]}
                   for i in range(max(1, len(calib) // batch))]
        # --roi: the calibration images' fixed-seed ROI beside them (the emit context's: compiler.roi)
        samples = [{**x, **context.calibration_feed(model.graph.inputs[1:], x[input_name])} for x in samples]
        try:
            qnn_tools.quantize_qdq(out_dir / MODEL, out_dir / QDQ, samples, act_type=act, weight_type=weight,
                                   float_nodes=float_nodes + attention, headroom=needs.headroom)
            qnn_tools.check_qdq(onnx.load(str(out_dir / QDQ)))
            ctx, binaries = qnn_tools.make_epcontext(out_dir / QDQ, out_dir, soc_model, ctx_name=CTX)
            rows = [{"op": r["op"], "type": r["type"],
                     "device": "HTP" if r["provider"] == qnn_tools.EP_NAME else placement.CPU}
                    for r in qnn_tools.placement(out_dir / QDQ, soc_model)]
            trace = qnn_tools.op_trace(out_dir / QDQ, samples[0], soc_model)
        except qnn_tools.QnnError as exc:
            raise ToolchainError(f"{TARGET}: {exc}") from None
        arch, product = qnn_tools.SOCS[soc][1:]
        return {"runtime": "ONNX Runtime QNN EP on the Hexagon NPU (HTP)", "soc": soc, "soc_model": soc_model,
                "htp_arch": arch, "device": product, "precision": precision,
                "quantization": {"activations": act, "weights": weight,
                                 "float_nodes": f"{len(float_nodes)} nodes of the selection (fp16 on HTP)"
                                                + (f", {len(attention)} of the attention cores" if attention else ""),
                                 "activation_matmuls": ("float (fp16 on HTP): " + needs.float_attention if attention
                                                        else "input 1 read as uint8" if act == "uint16" else "uint8"),
                                 **({"wide_weights": needs.wide_weights} if needs.wide_weights else {}),
                                 **({"range_headroom": needs.headroom} if needs.headroom != 1.0 else {})},
                "calibration": {"images": names}, "batch": batch, "selection": self.selection,
                "artifacts": {"qdq": QDQ, "epcontext": CTX, "context_binaries": [b.name for b in binaries]},
                "placement": {"qdq": _with_cycles(rows, trace)}, "placement_summary": {"qdq": placement.summarize(rows)},
                "placement_source": "onnxruntime EP graph assignment (session.record_ep_graph_assignment_info); "
                                    "cycles from the HTP emulator's op trace (QNN profiling 'detailed', one image)",
                "op_trace": {"ops": len(trace), "cycles": sum(r["cycles"] for r in trace), "rows": trace}}

    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        from vlmprune.targets.runtime import run_session
        import vlmprune.targets.qnn_tools as qnn_tools

        bundle_dir = Path(bundle_dir)
        fields = manifest.target
        batch = fields.get("batch", 1)
        soc, soc_model = fields.get("soc", qnn_tools.DEFAULT_SOC), fields.get("soc_model", qnn_tools.DEFAULT_SOC_MODEL)
        precision = fields.precision or DEFAULT_PRECISION
        version = fields.toolchain.get("onnxruntime-qnn", "")

        def on_htp(name: str):
            def run(pixel, feeds=None):
                session = qnn_tools.htp_session(bundle_dir / name, soc_model)
                return _in_batches(lambda x, fed: run_session(session, x, fed), pixel, batch, feeds)
            return run

        emulator = f"onnxruntime-qnn {version} HTP emulator, {soc} (soc_model {soc_model}), CPU fallback off"
        return [StageSpec("qnn-qdq", f"{emulator} ({QDQ}) (simulated)", precision, on_htp(QDQ)),
                StageSpec("qnn-ctx", f"{emulator} ({CTX} + context binary) (simulated)", precision, on_htp(CTX))]

    def runner(self, bundle_dir: Path, manifest: Manifest):
        """The EPContext model on the HTP emulator here (on the HTP of a device there)."""
        import vlmprune.targets.qnn_tools as qnn_tools
        from vlmprune.targets.runtime import run_session

        ok, why = qnn_tools.available()
        if not ok:
            raise ToolchainError(f"cannot run a qnn bundle here: {why}")
        fields = manifest.target
        session = qnn_tools.htp_session(Path(bundle_dir) / CTX, fields["soc_model"])
        run = lambda pixel, feeds=None: run_session(session, pixel, feeds)  # noqa: E731
        return run, f"simulated: onnxruntime-qnn HTP emulator, {fields['soc']}"

    def readme(self, manifest: Manifest) -> str:
        return _readme(manifest)


def _with_cycles(rows: list[dict], trace: list[dict]) -> list[dict]:
    """Add to each ONNX node the emulated HTP cycles of the QNN ops it was lowered to.

    QNN names its ops after the ONNX node (node, node/Fusion, node_suffix); a trace op is
    credited to the longest node name it starts with.
    """
    names = sorted((r["op"] for r in rows), key=len, reverse=True)
    cycles: dict[str, int] = {}
    for t in trace:
        owner = next((n for n in names if t["op"] == n or t["op"].startswith((n + "/", n + "_", n + ":"))), None)
        if owner is not None:
            cycles[owner] = cycles.get(owner, 0) + t["cycles"]
    return [{**r, "cycles": cycles[r["op"]]} if r["op"] in cycles else r for r in rows]


def _in_batches(run, pixel: np.ndarray, batch: int, feeds=None) -> dict[str, np.ndarray]:
    """Run a static-batch model over the parity images, `batch` at a time; feeds ([B, ...] each) cut like them."""
    if len(pixel) % batch:
        raise ValueError(f"{len(pixel)} images do not fill batches of {batch}")
    feeds = feeds or {}
    outs = [run(pixel[i: i + batch], {name: value[i: i + batch] for name, value in feeds.items()})
            for i in range(0, len(pixel), batch)]
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def _readme(manifest: Manifest) -> str:
    fields = manifest.target
    inp = manifest.inputs[0]
    out_names = ", ".join(f"`{o.name}` {o.shape} {o.dtype}" for o in manifest.outputs)
    binaries = ", ".join(f"`{b}`" for b in fields["artifacts"]["context_binaries"])
    summary = placement.summary_line("qdq", fields["placement_summary"]["qdq"])
    q = fields["quantization"]
    return f"""# vlmprune bundle: target `qnn` (Qualcomm HTP via ONNX Runtime's QNN EP)

Model: {manifest.model.source} — {manifest.method.summary}

Built for {fields['soc']} ({fields['device']}, HTP {fields['htp_arch']}, soc_model {fields['soc_model']}).
Input `{inp.name}`: {inp.shape} float32, NCHW, normalized pixels (mean {manifest.preprocess.mean},
std {manifest.preprocess.std}). Outputs: {out_names}.

Files:
- `{CTX}` + {binaries}: the EPContext model and its QNN context binary, compiled for {fields['soc']};
  keep them in one folder. Loads fastest; runs only on that SoC's HTP.
- `{QDQ}`: the QDQ model ({q['activations']} activations, {q['weights']} weights; the score path's
  float nodes run in fp16 on HTP). Runs on any HTP the QNN EP supports (compiled when the session starts).
- `model.onnx`: the float graph that was quantized; `model.decomposed.onnx`: the portable pruned graph.

Parity was measured in onnxruntime-qnn's HTP emulator on x86_64 with CPU fallback disabled (labelled
"simulated" in `parity.json`); no phone was involved. {summary}.

## Android (arm64-v8a)

Use ONNX Runtime with the QNN EP (Maven `com.microsoft.onnxruntime:onnxruntime-android-qnn`, or a build with
`--use_qnn`), and ship the QNN HTP libraries of the same QNN SDK (`libQnnHtp.so`, `libQnnHtpV{fields['htp_arch'][1:]}Stub.so`,
`libQnnHtpV{fields['htp_arch'][1:]}Skel.so`, `libQnnHtpPrepare.so`, `libQnnSystem.so`) in the app's native library folder:

    OrtSession.SessionOptions so = new OrtSession.SessionOptions();
    so.addConfigEntry("session.disable_cpu_ep_fallback", "1");
    so.addQnn(Map.of("backend_path", "libQnnHtp.so"));
    OrtSession session = env.createSession(modelDir + "/{CTX}", so);

## Windows on Arm (Snapdragon X) and Linux arm64

    pip install onnxruntime-qnn        # Windows arm64 / Linux aarch64 wheels carry the QNN libraries
    python - <<'PY'
    import numpy as np, onnxruntime as ort
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    sess = ort.InferenceSession("{CTX}", so, providers=[("QNNExecutionProvider", {{"backend_path": "QnnHtp.dll"}})])
    x = np.zeros({inp.shape}, dtype=np.float32)   # preprocessed image(s)
    features, kept, *positions = sess.run(None, {{"{inp.name}": x}})  # + kept_positions where the bundle has it
    print(features.shape, kept[0][:10])
    PY

(`libQnnHtp.so` on Linux.) With onnxruntime-qnn 2.x (a plugin EP, as here) register it first:
`ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())` and add it
with `so.add_provider_for_devices(...)`. To compile for another SoC, recompile the bundle with `--soc` (`vlmprune
targets` lists them); `{QDQ}` needs no recompile. Check every file's sha256 against `manifest.json` before loading
it; `vlmprune check .` re-runs parity in the emulator.
"""
