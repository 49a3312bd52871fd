"""Target `rk3588`: the Rockchip RK3588 NPU through rknn-toolkit2 2.5.0.

The toolkit lives in a virtual environment of its own (targets.rknn_env: its numpy/onnx
pins clash with this one), created on first use and driven by a subprocess
(targets.rknn_worker). The pipeline legalizes the graph (passes.rknn), so model.decomposed.onnx
is the graph the toolkit converts; emit writes it as model.onnx too, and per precision has the
worker load it, build, export the .rknn and run the simulator on the parity images in that
same process: the toolkit simulates only a model it
has just built (a loaded .rknn needs a board), so these outputs are kept for the parity
stage. `vlmprune check` rebuilds from model.onnx instead (the rebuilt .rknn is equivalent,
not byte-identical: 2.5.0's output differs in a few kB between identical builds).

Precisions (--precision, comma-separated; default both):
- fp16: everything in float16 -> model.rknn.
- int8: hybrid quantization -> model.hybrid.rknn: w8a8, with everything the kept indices
  depend on (the graph output the insertion's record names, and what feeds it) and the index
  chain after them kept float16. Calibration: real photographs disjoint from the parity
  images (targets.calibration). Methods that select on the projector output (divprune, dart:
  Method.reads_projector_output) depend on the whole tower, and a method whose merge loses its
  values in int8 (visionzip: Method.int8_loss) would have it quantised, so they are fp16 only here.

Measured on `demo` (keep 192; parity images skimage astronaut and chelsea; 2.5.0 simulator):
fp16 kept-index agreement 1.0 and cosine >= 0.999999 (pruning after the last block; after
block 2 with lambda 0.3 one of chelsea's 192 indices swaps inside the 1e-3 tie band);
int8 hybrid the same agreement, cosine 0.9961 (after block 2) and 0.9994 (last block).
Keeping only the attention-row recompute in float16 (float_scope="score") instead of
everything that feeds TopK drops hybrid agreement to 0.974 - 0.995: the blocks before the
pruning point decide the scores, so they stay float16.

Selection formulation: a one-hot MatMul rather than a Gather, chosen by measurement (see
passes.rknn: one CPU layer and one NPU -> CPU -> NPU round trip fewer, same parity).
A selection with control flow takes its form without (control_flow = False: divprune's greedy
loop is unrolled): the toolkit runs ArgMax, GatherElements and
ScatterElements with runtime indices on its CPU, so each step is a CPU island (measured on
demo: 1343 of 2195 ops on the CPU, parity within the fp16 tie band).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import MODEL, RKNN, Manifest
from vlmprune.compiler.errors import InputError, ToolchainError
from vlmprune.passes.methods import get_method
from vlmprune.passes.prune import prune_record
from vlmprune.passes.rknn import RKNN_MAX_OPSET, TARGET, rknn_legalization, rknn_model_support, rknn_support
import vlmprune.targets.placement as placement
from vlmprune.targets.base import EmitContext, StageSpec, Target, reads_projector_output

# precision -> (worker mode, artifact, parity precision, what it is)
PRECISIONS = {
    "fp16": ("fp16", RKNN, "fp16", "float16 throughout"),
    "int8": ("hybrid", "model.hybrid.rknn", "int8",
             "hybrid: int8 weights and activations, the score path (everything feeding TopK) float16"),
}
DEFAULT_PRECISIONS = ("fp16", "int8")
CALIBRATION_COUNT = 8
PLATFORM = "rk3588"


def parse_precisions(value: str | None) -> tuple[str, ...]:
    if not value:
        return DEFAULT_PRECISIONS
    names = [{"hybrid": "int8"}.get(p, p) for p in (x.strip().lower() for x in value.split(",")) if p]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        raise InputError(f"rk3588 --precision takes fp16, int8 (hybrid) or both as fp16,int8; got {value!r}")
    return tuple(dict.fromkeys(names))


def hybrid_loss(options) -> str | None:
    """Why hybrid int8 does not serve the method compiled by options (its default is then fp16), or None.

    From what the method declares: a selection on the projector output would keep the whole tower
    in float16 (the float scope is everything feeding the kept indices), and the hybrid mode
    quantises the method's own nodes after the selection, which a method with an int8_loss measured
    to lose its values.
    """
    if not options.prune:
        return None
    if reads_projector_output(options):
        return "its selection reads the projector output, so hybrid int8 would keep everything before it in float16"
    if (options.method_options or {}).get("merge"):  # --merge local: merged values, as visionzip's
        from vlmprune.passes.methods.merge import INT8_LOSS

        return INT8_LOSS
    from vlmprune.passes.methods import budget

    method = get_method(options.method)  # as compiled: --budget adaptive declares its own loss
    return budget.wrap(method, method.parse(options.keep, options.method_options or {})).int8_loss or None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path) -> str:
    return _sha(Path(path).read_bytes())


class Rk3588Target(Target):
    name = "rk3588"
    summary = "Rockchip RK3588 NPU: rknn-toolkit2 2.5.0 .rknn (fp16, hybrid int8), simulator parity"
    no_timing_why = ("rknn-toolkit2's simulator gives no latency without a board (eval_perf: \"Not support in "
                     "simulator environment\"), only the build's per-layer cycle estimates, which no clock here "
                     "turns into ms: compile with --keep K and time the bundles on the board")
    no_llm_why = "RKLLM's converter, rkllm-toolkit, is not on the package index"
    options = {"precision": "rk3588: fp16, int8 (hybrid) or fp16,int8 (default)"}
    opsets = (17, RKNN_MAX_OPSET)
    opsets_why = ("rknn-toolkit2 2.5.0 reads opsets up to 19 and offers no down-conversion; 20 and later hold Gelu "
                  "and Attention")
    no_prompt_input = ("rknn-toolkit2 converts static input shapes only, while the prompt's length varies per "
                       "request")
    # Measured: the worker's build and simulator runner (rknn_worker.py) feed the pixel input only.
    no_roi_input = "its RKNN build and simulator runner (rknn_worker.py) take the pixel input only (no ROI inputs yet)"
    reduced_precision = "rk3588's NPU runs the graph in fp16 or hybrid int8"
    control_flow = False  # each greedy step would be a CPU island anyway (module docstring): straight-line

    def refusal(self, method, params: dict | None = None) -> str | None:
        # Measured on the tiny LLaVA (random, grid; either site, with or without --merge local): the simulator
        # returns no kept_indices, the one output that does not depend on the pixels.
        if method.baseline:
            return ("its kept_indices output is a graph constant (the baseline's fixed patch set), which "
                    "rknn-toolkit2 2.5.0 leaves out of the converted model's outputs")
        return super().refusal(method, params)

    def __init__(self, selection: str = "onehot", float_scope: str = "ancestors"):
        self.selection = selection
        self.float_scope = float_scope
        # (sha256 of the .rknn, sha256 of one image) -> the simulator's outputs at export time
        self._simulated: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def available(self) -> tuple[bool, str]:
        import vlmprune.targets.rknn_env as rknn_env

        return rknn_env.creatable()

    def toolchain(self) -> dict[str, str]:
        import onnx

        import vlmprune.targets.rknn_env as rknn_env

        pins = ", ".join(r.replace("==", " ") for r in rknn_env.RUNTIME_REQUIREMENTS if "==" in r)
        return {"rknn-toolkit2": rknn_env.RKNN_TOOLKIT_VERSION, "target_platform": PLATFORM,
                "rknn venv": f"{pins} (torch linked from this environment)", "onnx": onnx.__version__}

    def check_options(self, options) -> dict:
        given = super().check_options(options)
        if options.batch not in (None, 1):
            raise InputError(f"rk3588 runs batch 1: compile with --batch 1 or without --batch, not --batch {options.batch}")
        precisions = parse_precisions(given.get("precision"))
        why = hybrid_loss(options)
        if "int8" in precisions and why:
            if given.get("precision"):
                raise InputError(f"rk3588 --precision int8 with {options.method}: {why}; use fp16")
            precisions = tuple(p for p in precisions if p != "int8")  # the default: what can run
        return {"precision": ",".join(precisions)}

    def legalization(self, config, options) -> list[ir.passes.PassBase]:
        return rknn_legalization(self.selection)

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        return rknn_support(node)

    def check_model(self, model: ir.Model) -> list[str]:
        return rknn_model_support(model)

    def emit(self, model: ir.Model, out_dir: Path, context: EmitContext) -> dict:
        """model.onnx (the decomposed graph: RKNN-legal already), then build, export and simulate each .rknn."""
        import vlmprune.targets.rknn_env as rknn_env

        precisions = parse_precisions(context.target_options["precision"])
        ir.save(model, out_dir / MODEL)
        pixel = context.parity_inputs  # the images parity will feed: simulated now, while the build is live
        record = prune_record(model)
        fields: dict = {"runtime": "RKNN runtime (librknnrt / rknn-toolkit-lite2 2.5.0) on the RK3588 NPU",
                        "target_platform": PLATFORM, "selection": self.selection,
                        "artifacts": {}, "precisions": {}, "placement": {}, "placement_summary": {},
                        "build_seconds": {}, "kept_outputs": [record.kept] if record is not None else []}
        calib_names: list[str] = []
        with tempfile.TemporaryDirectory(prefix="vlmprune-rk3588-") as scratch:
            root = Path(scratch)
            samples = _save_samples(root / "image", pixel)
            dataset = None
            if "int8" in precisions:
                calib, calib_names = context.calibration_inputs(CALIBRATION_COUNT)
                dataset = _save_samples(root / "calib", calib)
                fields["calibration"] = {"images": calib_names, "float_scope": self.float_scope}
            for precision in precisions:
                mode, artifact, _, what = PRECISIONS[precision]
                response = self._worker(out_dir / MODEL, root / precision, mode, samples, dataset, fields)
                shutil.copy2(response["rknn"], out_dir / artifact)
                rknn_sha = _file_sha(out_dir / artifact)
                for image, outputs in zip(pixel, response["runs"]):
                    self._simulated[(rknn_sha, _sha(image.tobytes()))] = {o["name"]: np.load(o["path"]) for o in outputs}
                rows = [{k: r[k] for k in ("op", "type", "device", "dtype", "source") if r.get(k) is not None}
                        for r in response["placement"]]
                fields["artifacts"][precision] = artifact
                fields["precisions"][precision] = what
                fields["placement"][precision] = rows
                fields["placement_summary"][precision] = placement.summarize(rows)
                fields["build_seconds"][precision] = round(response["seconds"].get("build", 0.0), 1)
                if mode == "hybrid":
                    fields["float16_tensors"] = len(response["float16_tensors"])
        fields["rknn_venv"] = {k: v for k, v in rknn_env.venv_info().items() if k in ("install_seconds", "size_bytes")}
        return fields

    def _worker(self, model: Path, out_dir: Path, mode: str, samples: list[list[str]],
                dataset: list[list[str]] | None, fields: dict) -> dict:
        import vlmprune.targets.rknn_env as rknn_env

        request = {"onnx": str(model), "out_dir": str(out_dir), "mode": mode, "target_platform": PLATFORM,
                   "run_samples": samples, "rknn_name": RKNN, "float_scope": self.float_scope,
                   "kept_outputs": fields.get("kept_outputs", [])}
        if mode != "fp16":
            request["dataset"] = dataset
        try:
            return rknn_env.run_worker(request)
        except rknn_env.RknnError as exc:
            raise ToolchainError(f"{TARGET}: {exc}") from None

    def stages(self, bundle_dir: Path, manifest: Manifest, context: EmitContext | None = None) -> list[StageSpec]:
        bundle_dir = Path(bundle_dir)
        fields = manifest.target
        specs = []
        for precision, artifact in fields.get("artifacts", {}).items():
            mode, _, tolerance, _ = PRECISIONS[precision]
            sha = _file_sha(bundle_dir / artifact)
            cached = any(key[0] == sha for key in self._simulated)
            how = "built and simulated with the export" if cached else "rebuilt from model.onnx"
            runtime = f"rknn-toolkit2 {fields.toolchain.get('rknn-toolkit2', '2.5.0')} simulator, " \
                      f"{PLATFORM} {precision} ({artifact}; {how}) (simulated)"
            specs.append(StageSpec(f"rknn-{precision}", runtime, tolerance,
                                   self._runner(bundle_dir, manifest, precision, sha, context)))
        return specs

    def _runner(self, bundle_dir: Path, manifest: Manifest, precision: str, rknn_sha: str, context: EmitContext | None):
        def run(pixel: np.ndarray, feeds=None) -> dict[str, np.ndarray]:  # the pixels only (no_prompt/roi_input)
            keys = [(rknn_sha, _sha(image.tobytes())) for image in pixel]
            missing = [i for i, key in enumerate(keys) if key not in self._simulated]
            fresh = self._rebuild(bundle_dir, manifest, precision, pixel[missing], context) if missing else []
            results = dict(zip(missing, fresh))
            per_image = [results[i] if i in results else self._simulated[key] for i, key in enumerate(keys)]
            return {name: np.concatenate([r[name] for r in per_image]) for name in per_image[0]}
        return run

    def _rebuild(self, bundle_dir: Path, manifest: Manifest, precision: str, pixel: np.ndarray,
                 context: EmitContext | None) -> list[dict]:
        """Build model.onnx again at this precision and simulate pixel (the toolkit cannot simulate a loaded .rknn).

        context: what the pipeline handed the stages (compile's emit context, or check's): the int8 build's
        calibration images come from it, as emit's did."""
        pre = manifest.preprocess
        mode = PRECISIONS[precision][0]
        with tempfile.TemporaryDirectory(prefix="vlmprune-rk3588-check-") as scratch:
            root = Path(scratch)
            samples = _save_samples(root / "image", pixel)
            dataset = None
            if mode != "fp16":
                if context is None:
                    raise InputError(f"rebuilding the {precision} .rknn needs its calibration images, which the "
                                     "pipeline hands the stages (compile and check do)")
                count = len(manifest.target.get("calibration", {}).get("images", [])) or CALIBRATION_COUNT
                calib, _ = context.calibration_inputs(count, pre.size)
                dataset = _save_samples(root / "calib", calib)
            # model.onnx refers to weights.bin beside it, so it is read in place.
            response = self._worker(bundle_dir / MODEL, root / "build", mode, samples, dataset,
                                    manifest.target)
            return [{o["name"]: np.load(o["path"]) for o in outputs} for outputs in response["runs"]]

    def runner(self, bundle_dir: Path, manifest: Manifest):
        raise InputError("the RKNN simulator cannot load a .rknn file; run model.rknn on the board with "
                         "rknn-toolkit-lite2 (see the bundle README)")

    def readme(self, manifest: Manifest) -> str:
        return _readme(manifest)


def _save_samples(stem: Path, pixel: np.ndarray) -> list[list[str]]:
    """One .npy per image ([1, C, H, W]: the .rknn runs batch 1); returns worker samples."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(pixel):
        path = stem.parent / f"{stem.name}{i}.npy"
        np.save(path, image[None])
        paths.append([str(path)])
    return paths


def _readme(manifest: Manifest) -> str:
    fields = manifest.target
    inp = manifest.inputs[0]
    outputs = manifest.outputs
    artifacts = fields.get("artifacts", {})
    lines = [f"- `{a}`: {fields['precisions'][p]}" for p, a in artifacts.items()]
    first = next(iter(artifacts.values()), RKNN)
    summaries = [placement.summary_line(p, s) for p, s in fields.get("placement_summary", {}).items()]
    out_names = ", ".join(f"`{o.name}` {o.shape} {o.dtype}" for o in outputs)
    n_out, out_order = len(outputs), ", ".join(o.name for o in outputs)
    version = manifest.target.toolchain.get("rknn-toolkit2", "2.5.0")
    return f"""# vlmprune bundle: target `rk3588` (Rockchip RK3588 NPU, rknn-toolkit2 {version})

Model: {manifest.model.source} — {manifest.method.summary}

Input `{inp.name}`: {inp.shape} float32, NCHW, normalized pixels (mean {manifest.preprocess.mean},
std {manifest.preprocess.std}, {manifest.preprocess.size}x{manifest.preprocess.size}); batch 1.
Outputs: {out_names}.

Artifacts:
{chr(10).join(lines)}
- `model.onnx` (= `model.decomposed.onnx`): the RKNN-legal graph they were built from (static batch 1,
  opset <= 19, one-hot selection), standard ops only; it reads `weights.bin`.

Parity was measured in the rknn-toolkit2 simulator (results labelled "simulated" in `parity.json`); the board
itself was not run. Op placement (every layer in `manifest.json`, `target.placement`; `vlmprune inspect .`):
{chr(10).join('- ' + s for s in summaries)}

## Run on the board (Python: rknn-toolkit-lite2)

On the RK3588 (Debian/Ubuntu aarch64, RKNPU driver >= 0.9.6), with the 2.5.0 runtime `librknnrt.so` in
`/usr/lib` (from the rknn-toolkit2 2.5.0 release, `rknpu2/runtime/Linux/librknn_api/aarch64/`):

    pip install rknn-toolkit-lite2=={version} numpy
    python3 - <<'PY'
    import numpy as np
    from rknnlite.api import RKNNLite
    rknn = RKNNLite()
    assert rknn.load_rknn("{first}") == 0
    assert rknn.init_runtime(core_mask=RKNNLite.NPU_CORE_AUTO) == 0
    x = np.zeros({inp.shape}, dtype=np.float32)  # preprocessed image, NCHW
    features, kept, *positions = rknn.inference(inputs=[x], data_format=["nchw"])  # + kept_positions where present
    print(features.shape, kept.astype(np.int64)[0][:10])
    rknn.release()
    PY

## Run on the board (C: librknnrt)

    rknn_context ctx;
    rknn_init(&ctx, model_data, model_size, 0, NULL);          /* bytes of {first} */
    rknn_input in = {{.index = 0, .type = RKNN_TENSOR_FLOAT32, .fmt = RKNN_TENSOR_NCHW,
                     .size = {int(np.prod(inp.shape))} * sizeof(float), .buf = pixels}};
    rknn_inputs_set(ctx, 1, &in);
    rknn_run(ctx, NULL);
    rknn_output out[{n_out}] = {{{{0}}}};                    /* {out_order} */
    for (int i = 0; i < {n_out}; i++) out[i].want_float = 1;   /* indices and positions come as floats */
    rknn_outputs_get(ctx, {n_out}, out, NULL);
    rknn_outputs_release(ctx, {n_out}, out);
    rknn_destroy(ctx);

Build with `-lrknnrt` against `rknn_api.h` of the same release. Check every file's sha256 against
`manifest.json` before copying it to the board. `vlmprune check .` re-runs parity here (rebuilding from
`model.onnx` in the simulator).
"""
