"""Target `ort`: ONNX Runtime (CPU here; the CUDA EP where present)."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmprune.passes.token_prune import InsertTokenPrunePass, RetargetTokenCountPass
from vlmprune.targets.base import StageSpec, Target


class OrtTarget(Target):
    name = "ort"
    summary = "ONNX Runtime (CPU; CUDA EP where present)"

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            return False, f"onnxruntime is not importable ({exc})"
        return True, ""

    def toolchain(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}

    def pipeline(self, config) -> list[ir.passes.PassBase]:
        prune = [] if config is None else [InsertTokenPrunePass(config), RetargetTokenCountPass()]
        return [*prune, RemoveUnusedNodesPass(), TopologicalSortPass()]

    def emit(self, decomposed: ir.Model, out_dir: Path, context: dict) -> dict:
        ir.save(decomposed, out_dir / "model.onnx")
        return {"runtime": "onnxruntime", "providers": ["CPUExecutionProvider"]}

    def stages(self, bundle_dir: Path, manifest: dict) -> list[StageSpec]:
        from vlmprune.compiler.runtime import ort_session, run_session

        def run(pixel_values):
            return run_session(ort_session(bundle_dir / "model.onnx"), pixel_values)

        return [StageSpec("target", "onnxruntime CPU (model.onnx)", "fp32", run)]

    def readme(self, manifest: dict) -> str:
        inp = manifest["inputs"][0]
        return f"""# vlmprune bundle: target `ort` (ONNX Runtime)

Model: {manifest['model']['source']} — {manifest['method']['summary']}

Input `{inp['name']}`: {inp['shape']} {inp['dtype']} (normalized pixels).
Outputs: {', '.join(f"`{o['name']}` {o['shape']} {o['dtype']}" for o in manifest['outputs'])}.

## Run

    pip install onnxruntime numpy
    python - <<'PY'
    import numpy as np, onnxruntime as ort
    sess = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    x = np.zeros({[1 if isinstance(d, str) else d for d in inp['shape']]}, dtype=np.float32)
    print([o.shape for o in sess.run(None, {{"{inp['name']}": x}})])
    PY

or, with vlmprune installed: `vlmprune run . --image photo.jpg`, and `vlmprune check .` to re-run parity.
`model.decomposed.onnx` holds only standard ONNX ops (opens in Netron, runs under `polygraphy run --onnxrt`).
"""
