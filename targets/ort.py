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
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir

from vlmprune.compiler.contract import MODEL
from vlmprune.compiler.errors import ToolchainError
from vlmprune.passes.methods.base import FusedOp
from vlmprune.targets.base import StageSpec, Target

LIBRARY = "libvlmprune_ort.so"
ORT_OPS = {name: FusedOp(name) for name in ("TokenPrune", "DivPruneSelect", "ClsAttentionScore")}


class OrtTarget(Target):
    name = "ort"
    summary = "ONNX Runtime (CPU; CUDA EP where present) + vlmprune custom-op library"
    llm_exporters = ("torch", "genai")  # torch.onnx prefill + decode (FastV), or onnxruntime-genai's builder
    spellings = ORT_OPS  # control flow taken: a Loop is the one node DivPruneSelect's rule matches (above)

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

    def emit(self, model: ir.Model, out_dir: Path, context: dict) -> dict:
        """model.onnx, and the op library when the graph holds fused ops."""
        ir.save(model, out_dir / MODEL)
        if not fused_ops(model):
            return {"runtime": "onnxruntime", "fused": False}
        shutil.copy2(library(), out_dir / LIBRARY)
        return {"runtime": "onnxruntime", "fused": True, "custom_op_library": LIBRARY, "custom_domain": "vlmprune",
                "fused_ops": fused_ops(model)}

    def stages(self, bundle_dir: Path, manifest: dict) -> list[StageSpec]:
        """One stage, `fused`: model.onnx as shipped, whether or not the method fused into a custom op here
        (the manifest's target.fused says which), so that its name never depends on the method."""
        run, runtime = self.runner(bundle_dir, manifest)
        # --scorer int8: the decision is INT8 (ClsAttentionScore), so kept indices are held to the 8-bit agreement.
        int8 = manifest["method"].get("params", {}).get("scorer") == "int8"
        return [StageSpec("fused", runtime + (" (INT8 scorer)" if int8 else ""), "int8" if int8 else "fp32", run)]

    def runner(self, bundle_dir: Path, manifest: dict):
        from vlmprune.targets.runtime import ort_session, run_session

        bundle_dir = Path(bundle_dir)
        library_name = manifest.target.get("custom_op_library")
        libs = (bundle_dir / library_name,) if library_name else ()
        session = None

        def run(pixel_values):
            nonlocal session
            session = session or ort_session(bundle_dir / MODEL, libs)
            return run_session(session, pixel_values)

        runtime = "onnxruntime CPU" + (f" + {LIBRARY}" if libs else "") + f" ({MODEL})"
        return run, runtime

    def readme(self, manifest: dict) -> str:
        inp = manifest.inputs[0]
        fused = manifest.target.fused
        register = f'\n    so.register_custom_ops_library("{LIBRARY}")' if fused else ""
        shape = [1 if isinstance(d, str) else d for d in inp.shape]
        ops = ", ".join(f"`{op}`" for op in manifest.target.fused_ops)
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


def library() -> Path:
    from vlmprune.kernels import build

    try:
        return build.build_ort_library()
    except build.KernelBuildError as exc:
        raise ToolchainError(f"cannot build the ONNX Runtime custom-op library: {str(exc).splitlines()[0]}") from None
