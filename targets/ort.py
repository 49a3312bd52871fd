"""Target `ort`: ONNX Runtime (CPU here; the CUDA EP where present).

model.onnx holds the fused `vlmprune.TokenPrune` node, run by the bundled
custom-op library (kernels/ort over the CPU kernels); model.decomposed.onnx is
the same graph in standard ops.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.compiler.errors import StructureError, ToolchainError
from vlmprune.passes.fusion import TokenPruneFusionPass, fusion_failure
from vlmprune.passes.token_prune import InsertTokenPrunePass, RetargetTokenCountPass
from vlmprune.targets.base import StageSpec, Target

LIBRARY = "libvlmprune_ort.so"


class OrtTarget(Target):
    name = "ort"
    summary = "ONNX Runtime (CPU; CUDA EP where present) + vlmprune custom-op library"

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            return False, f"onnxruntime is not importable ({exc})"
        for tool in ("g++", "npm"):
            if shutil.which(tool) is None:
                return False, f"{tool} is needed to build the custom-op library"
        return True, ""

    def toolchain(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}

    def pipeline(self, config) -> list[ir.passes.PassBase]:
        prune = [] if config is None else [InsertTokenPrunePass(config), RetargetTokenCountPass()]
        return [*prune, RemoveUnusedNodesPass(), TopologicalSortPass()]

    def emit(self, decomposed: ir.Model, out_dir: Path, context: dict) -> dict:
        """Fuse (in place: model.decomposed.onnx is already written) and bundle the op library."""
        if context.get("site") is None:
            ir.save(decomposed, out_dir / "model.onnx")
            return {"runtime": "onnxruntime", "fused": False}
        fusion = TokenPruneFusionPass(debug=True)
        fusion(decomposed)
        if not fusion.fired:
            raise StructureError(fusion_failure(fusion, context.get("debug", False)))
        RemoveUnusedNodesPass()(decomposed)
        ir.save(decomposed, out_dir / "model.onnx")
        shutil.copy2(_library(), out_dir / LIBRARY)
        return {"runtime": "onnxruntime", "fused": True, "custom_op_library": LIBRARY, "custom_domain": "vlmprune"}

    def stages(self, bundle_dir: Path, manifest: dict) -> list[StageSpec]:
        from vlmprune.compiler.runtime import ort_session, run_session

        fused = manifest["target"].get("fused", False)
        libs = (bundle_dir / LIBRARY,) if fused else ()

        def run(pixel_values):
            return run_session(ort_session(bundle_dir / "model.onnx", libs), pixel_values)

        name, runtime = ("fused", f"onnxruntime CPU + {LIBRARY} (model.onnx)") if fused else (
            "target", "onnxruntime CPU (model.onnx)")
        return [StageSpec(name, runtime, "fp32", run)]

    def readme(self, manifest: dict) -> str:
        inp = manifest["inputs"][0]
        fused = manifest["target"].get("fused", False)
        register = f'\n    so.register_custom_ops_library("{LIBRARY}")' if fused else ""
        shape = [1 if isinstance(d, str) else d for d in inp["shape"]]
        return f"""# vlmprune bundle: target `ort` (ONNX Runtime)

Model: {manifest['model']['source']} — {manifest['method']['summary']}

Input `{inp['name']}`: {inp['shape']} {inp['dtype']} (normalized pixels).
Outputs: {', '.join(f"`{o['name']}` {o['shape']} {o['dtype']}" for o in manifest['outputs'])}.

## Run (x86-64 Linux, onnxruntime >= 1.20)

    pip install onnxruntime numpy
    python - <<'PY'
    import numpy as np, onnxruntime as ort
    so = ort.SessionOptions(){register}
    sess = ort.InferenceSession("model.onnx", so, providers=["CPUExecutionProvider"])
    x = np.zeros({shape}, dtype=np.float32)
    print([o.shape for o in sess.run(None, {{"{inp['name']}": x}})])
    PY

With vlmprune installed: `vlmprune run . --image photo.jpg`; `vlmprune check .` re-runs parity.
`model.decomposed.onnx` holds only standard ONNX ops (opens in Netron, runs under
`polygraphy run --onnxrt`); both graphs read their weights from `weights.bin`.
{"`" + LIBRARY + "` implements the `vlmprune.TokenPrune` node; check its sha256 against manifest.json before loading it." if fused else ""}
"""


def _library() -> Path:
    from vlmprune.kernels import build

    try:
        return build.build_ort_library()
    except build.KernelBuildError as exc:
        raise ToolchainError(f"cannot build the ONNX Runtime custom-op library: {str(exc).splitlines()[0]}") from None
