"""Target `ort`: ONNX Runtime (CPU here; the CUDA EP where present).

model.onnx holds the method's fused ops where it has any (`vlmprune.TokenPrune`,
`vlmprune.DivPruneSelect`), run by the bundled custom-op library (kernels/ort over the
CPU kernels); model.decomposed.onnx is the same graph in standard ops.

Formulations, by measurement (ONNX Runtime 1.32 CPU, 2 threads, N = 576, K = 192):
divprune's greedy loop is written as an ONNX Loop, which the DivPruneSelect op replaces in
model.onnx: the Loop and the unrolled chain cost 7.7 - 11.7 ms per image (D = 256), the
fused op 0.23 ms (the distance matrix before it stays a standard MatMul); the Loop is one
node the fusion rule can match, the unrolled chain ~1900. dart's per-pivot steps are a short
chain of TopKs with constant K, and visionzip's merge a few MatMuls: fast in standard ops
(tools/bench_methods.py, clip-l-336: every method's selection is under 2% of the dense
tower), so they have no custom op.

Every block's attention is fused into com.microsoft.MultiHeadAttention in model.onnx, whatever
the method (dense bundles too): passes/attention_fusion.py says what it matches and why that op.

--precision int8 adds model.int8.onnx beside model.onnx (which stays fp32: the graph every other
stage and tool reads, and the reference the int8 stage is held to): static QDQ, calibrated on
--calibration DIR or the built-in photographs, with everything the kept indices depend on kept
fp32 (targets.ort_quant says what is quantized, why, and the measurement). `vlmprune run`, eval
and generate run model.int8.onnx in such a bundle (runner); parity adds the stage `int8`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir

from vlmprune.compiler.contract import MODEL, Manifest
from vlmprune.compiler.errors import InputError, ToolchainError
from vlmprune.passes.attention_fusion import FUSED_ATTENTION, MS_DOMAIN, attention_rules
from vlmprune.passes.gelu_fusion import FUSED_GELU, gelu_rules
from vlmprune.passes.methods.base import FusedOp, int8_scorer
from vlmprune.targets.base import EmitContext, StageSpec, Target

LIBRARY = "libvlmprune_ort.so"
ORT_OPS = {name: FusedOp(name) for name in ("TokenPrune", "DivPruneSelect", "ClsAttentionScore")}


class OrtTarget(Target):
    name = "ort"
    summary = "ONNX Runtime (CPU; CUDA EP where present) + vlmprune custom-op library"
    llm_exporters = ("torch", "genai")  # torch.onnx prefill + decode (FastV), or onnxruntime-genai's builder
    spellings = ORT_OPS  # control flow taken: a Loop is the one node DivPruneSelect's rule matches (above)
    options = {"precision": "ort: fp32 (default) or int8 (adds model.int8.onnx: static QDQ, the score path fp32)",
               "calibration": "ort --precision int8: a folder of PNG/JPEG images to calibrate on (default: built-in "
                              "photographs, disjoint from the parity images)"}

    def check_options(self, options) -> dict:
        """--precision fp32 | int8, and --calibration DIR (int8 only; a folder of PNG/JPEG files)."""
        import vlmprune.targets.ort_quant as ort_quant
        from vlmprune.targets.base import reads_projector_output

        given = super().check_options(options)
        precision = (given.get("precision") or "fp32").strip().lower()
        if precision not in ("fp32", "int8"):
            raise InputError(f"ort --precision takes fp32 or int8, got {given['precision']!r}")
        if given.get("calibration") is not None and precision != "int8":
            raise InputError("--calibration calibrates --precision int8: add --precision int8 or drop --calibration")
        if precision == "int8" and reads_projector_output(options):
            raise InputError(f"ort --precision int8 with {options.method}: its selection reads the projector output, "
                             "so the fp32 score path would be the whole tower and nothing would be quantized")
        chosen = {"precision": precision}
        if given.get("calibration") is not None:
            ort_quant.check_calibration_dir(given["calibration"])
            chosen["calibration"] = str(Path(given["calibration"]).expanduser().resolve())
        return chosen

    def own_fusion_rules(self, config, options) -> tuple[list, dict[str, int]]:
        """Each block's attention -> com.microsoft.MultiHeadAttention, the tanh GELU -> com.microsoft.FastGelu
        (ONNX Runtime's contrib ops, no library)."""
        return [*attention_rules(), *gelu_rules()], {MS_DOMAIN: 1}

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        if f"{node.domain}.{node.op_type}" in (FUSED_ATTENTION, FUSED_GELU):
            return True, ""
        return super().supports(node)

    def available(self) -> tuple[bool, str]:
        import importlib.util

        if importlib.util.find_spec("onnxruntime") is None:
            return False, "onnxruntime is not installed"
        for tool in ("g++", "npm"):
            if shutil.which(tool) is None:
                return False, f"{tool} is needed to build the custom-op library"
        return True, ""

    def toolchain(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}

    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """model.onnx, and the op library when the graph holds fused ops; --precision int8: model.int8.onnx too."""
        ir.save(model, out_dir / MODEL)
        int8 = {}
        if context.target_options.get("precision") == "int8":
            from vlmprune.passes.prune import prune_record
            import vlmprune.targets.ort_quant as ort_quant

            fusion = self.fusion(context.config, context.options, prune_record(model))
            int8 = {"int8": ort_quant.emit_int8(out_dir, context, fusion)}
        if not fused_ops(model):  # fused: the vlmprune op library is needed; fused_ops: every non-standard op
            return {"runtime": "onnxruntime", "fused": False, "fused_ops": contrib_ops(model), **int8}
        shutil.copy2(library(), out_dir / LIBRARY)
        return {"runtime": "onnxruntime", "fused": True, "custom_op_library": LIBRARY, "custom_domain": "vlmprune",
                "fused_ops": fused_ops(model) + contrib_ops(model), **int8}

    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        """One stage, `fused`: model.onnx as shipped, whether or not the method fused into a custom op here
        (the manifest's target.fused says which), so that its name never depends on the method.
        --precision int8 adds `int8`: model.int8.onnx, its features held to int8's cosine and its kept indices to
        fp32's agreement (parity's "int8-fp32-score": the score path is fp32 there)."""
        run, runtime = self.runner(bundle_dir, manifest, MODEL)
        # --scorer int8: the decision is INT8 (ClsAttentionScore), so kept indices are held to the 8-bit agreement.
        int8 = int8_scorer(manifest.method.params)
        stages = [StageSpec("fused", runtime + (" (INT8 scorer)" if int8 else ""), "int8" if int8 else "fp32", run)]
        if manifest.target.get("int8"):
            from vlmprune.targets.ort_quant import INT8_MODEL

            run8, runtime8 = self.runner(bundle_dir, manifest, INT8_MODEL)
            stages.append(StageSpec("int8", runtime8 + " (QDQ int8, score path fp32)",
                                    "int8" if int8 else "int8-fp32-score", run8))
        return stages

    def runner(self, bundle_dir: Path, manifest: Manifest, graph: str | None = None):
        """graph: the file to run (default: model.int8.onnx in a --precision int8 bundle, else model.onnx)."""
        from vlmprune.targets.ort_quant import INT8_MODEL
        from vlmprune.targets.runtime import ort_session, run_session

        graph = graph or (INT8_MODEL if manifest.target.get("int8") else MODEL)
        bundle_dir = Path(bundle_dir)
        library_name = manifest.target.get("custom_op_library")
        libs = (bundle_dir / library_name,) if library_name else ()
        session = None

        def run(pixel_values, feeds=None):
            nonlocal session
            session = session or ort_session(bundle_dir / graph, libs)
            return run_session(session, pixel_values, feeds)

        runtime = "onnxruntime CPU" + (f" + {LIBRARY}" if libs else "") + f" ({graph})"
        return run, runtime

    def readme(self, manifest: Manifest) -> str:
        inp = manifest.inputs[0]
        fused = manifest.target.fused
        register = f'\n    so.register_custom_ops_library("{LIBRARY}")' if fused else ""
        shape = [1 if isinstance(d, str) else d for d in inp.shape]
        ops = ", ".join(f"`{op}`" for op in manifest.target.fused_ops if op.startswith("vlmprune."))
        return f"""# vlmprune bundle: target `ort` (ONNX Runtime)

Model: {manifest.model.source} — {manifest.method.summary}

Input `{inp.name}`: {inp.shape} {inp.dtype} (normalized pixels).
Outputs: {', '.join(f"`{o.name}` {o.shape} {o.dtype}" for o in manifest.outputs)}.

## Run (x86-64 Linux, onnxruntime >= 1.20)

    pip install onnxruntime numpy
    python - <<'PY'
    import numpy as np, onnxruntime as ort
    so = ort.SessionOptions(){register}
    sess = ort.InferenceSession("{MODEL}", so, providers=["CPUExecutionProvider"])
    x = np.zeros({shape}, dtype=np.float32)
    print([o.shape for o in sess.run(None, {{"{inp.name}": x}})])
    PY

With vlmprune installed: `vlmprune run . --image photo.jpg`; `vlmprune check .` re-runs parity.
`model.decomposed.onnx` holds only standard ONNX ops (opens in Netron, runs under
`polygraphy run --onnxrt`); both graphs read their weights from `weights.bin`.
{"`" + LIBRARY + "` implements " + ops + "; check its sha256 against manifest.json before loading it." if fused else ""}
"""


def fused_ops(model: ir.Model) -> list[str]:
    return sorted({f"{n.domain}.{n.op_type}" for n in model.graph.all_nodes() if n.domain == "vlmprune"})


def contrib_ops(model: ir.Model) -> list[str]:
    """ONNX Runtime's own contrib ops in the graph (the fused attention), which need no library."""
    return sorted({f"{n.domain}.{n.op_type}" for n in model.graph.all_nodes() if n.domain == MS_DOMAIN})


def library() -> Path:
    from vlmprune.kernels import build

    try:
        return build.build_ort_library()
    except build.KernelBuildError as exc:
        raise ToolchainError(f"cannot build the ONNX Runtime custom-op library: {str(exc).splitlines()[0]}") from None
