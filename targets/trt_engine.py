"""TensorRT engines of `orin` / `xavier` bundles: build, run, and the equivalent trtexec command.

This runs on the Jetson. It needs only the standard library, numpy, TensorRT's Python
bindings and cuda-python (pycuda as a fallback), never the rest of vlmprune: the
bundle carries a copy of this file as vlmprune_engine.py, so a device whose Python
cannot install vlmprune (JetPack 5.1 ships Python 3.8) still builds and runs the
engine with `python3 vlmprune_engine.py build .`. Hence Python 3.8 syntax here.

Contract with the bundle (targets/tensorrt.py writes it): manifest.json's "target"
holds the TensorRT version, the plugin library path, the optimization profile, the
precision and the layers kept in fp32 (the [CLS] scorer, so fp16 does not move the
K-th boundary). build_engine writes model.engine and model.engine.json (its sha256,
the TensorRT it was built with, the command); nothing loads an engine whose digest
or TensorRT version differs from that record.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import shlex
import sys
from pathlib import Path

import numpy as np

try:  # inside vlmprune: errors become one line and exit code 2 in the CLI
    from vlmprune.compiler.errors import ToolchainError as _ErrorBase  # noqa: F401
except ImportError:  # the bundle's standalone copy
    _ErrorBase = RuntimeError

NO_TENSORRT = "TensorRT is not installed here: run this on the Jetson (see the bundle README)"
NO_CUDA = "neither cuda-python nor pycuda is installed here (pip install cuda-python)"
# The bundle's names, spelled here because this file runs standalone (JetPack's Python); each mirrors the
# vlmprune.compiler.contract constant of the same name, and tests/compiler/test_contract.py holds them equal.
ENGINE = "model.engine"
ENGINE_RECORD = "model.engine.json"
MANIFEST = "manifest.json"
MODEL = "model.onnx"
DECOMPOSED = "model.decomposed.onnx"
KEPT = "kept_indices"
TEXT = "text_embeds"  # the prompt's rows (prompt-aware methods)
DIGEST_KEY = "manifest_sha256"  # vlmprune.compiler.bundle.manifest.DIGEST_KEY
TRTEXEC = "/usr/src/tensorrt/bin/trtexec"  # where JetPack installs it (not on PATH)
TENSORRT_TARGETS = ("orin", "xavier")


class EngineError(_ErrorBase):
    """Something a user on the device can act on, said in one line."""


# ------------------------------------------------------------------------- bundle


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# The functions here take manifest.json's raw dict (`manifest: dict`), not vlmprune.compiler.contract.Manifest: this
# script imports nothing of vlmprune (it runs on the Jetson with TensorRT alone), so it reads the JSON as it is. A
# Manifest from vlmprune's side is a dict too, and is passed as one (targets/tensorrt.py).
def _manifest_digest(manifest: dict) -> str:
    """The manifest's own digest, as vlmprune.compiler.bundle.manifest computes it (repeated: this file runs
    standalone)."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_bundle(bundle_dir) -> dict:
    """The manifest of a TensorRT bundle, after checking every listed file's sha256."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise EngineError(f"{bundle_dir}: not a vlmprune bundle (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise EngineError(f"{path}: not valid JSON; the bundle was modified") from None
    if manifest.get(DIGEST_KEY) != _manifest_digest(manifest):
        raise EngineError(f"{bundle_dir}: manifest.json does not match its recorded digest: the bundle was modified "
                          "after it was compiled; recompile it")
    for name, expected in manifest.get("files", {}).items():
        file = bundle_dir / name
        if not file.is_file():
            raise EngineError(f"{bundle_dir}: {name} is listed in the manifest but missing")
        if _sha256(file) != expected:
            raise EngineError(f"{bundle_dir}: {name} does not match its sha256 in the manifest; refusing to load it")
    target = manifest.get("target", {}).get("name")
    if target not in TENSORRT_TARGETS:
        raise EngineError(f"{bundle_dir} targets {target}, not TensorRT ({', '.join(TENSORRT_TARGETS)})")
    return manifest


def _shape_arg(name: str, shape) -> str:
    return f"{name}:{'x'.join(str(d) for d in shape)}"


def _profile_inputs(profile: dict) -> list:
    """Every input's range in the manifest's profile: the pixels ("input", "min", ...), then "inputs" (text_embeds)."""
    first = {"name": profile["input"], "min": profile["min"], "opt": profile["opt"], "max": profile["max"]}
    return [first] + list(profile.get("inputs", []))


def trtexec_command(manifest: dict, precision: str | None = None, decomposed: bool = False, engine: str = ENGINE,
                    calibration_cache: str | None = None) -> list:
    """The trtexec invocation that builds the same engine as build_engine (run from the bundle folder)."""
    target = manifest["target"]
    precision = precision or ("fp16" if decomposed else target.get("precision", "fp16"))
    profile = target["profile"]
    cmd = [TRTEXEC, f"--onnx={'model.decomposed.onnx' if decomposed else _model_file(manifest, precision)}"]
    if not decomposed and target.get("fused"):
        cmd.append(f"{target['plugin']['trtexec_flag']}={target['plugin']['library']}")
    cmd.append("--fp16")
    if precision == "int8":
        cmd.append("--int8")
        if calibration_cache:
            cmd.append(f"--calib={calibration_cache}")
    ranges = _profile_inputs(profile)
    if any(spec["min"] != spec["max"] for spec in ranges):  # trtexec: every input of the profile, comma-separated
        for flag, key in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
            cmd.append(f"{flag}=" + ",".join(_shape_arg(spec["name"], spec[key]) for spec in ranges))
    fp32 = target.get("fp32_layers", [])
    if fp32:
        cmd += ["--precisionConstraints=obey", "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in fp32)]
    cmd.append(f"--saveEngine={engine}")
    return cmd


def format_command(cmd: list) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def _model_file(manifest: dict, precision: str) -> str:
    if precision == "int8":
        qdq = manifest["target"].get("qdq_model")
        return qdq if qdq else MODEL
    return MODEL


# ----------------------------------------------------------------------- TensorRT


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineError(NO_TENSORRT) from None
    return trt


def _major_minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


def _check_version(trt, manifest: dict) -> None:
    wanted = manifest["target"]["toolchain"]["tensorrt"]
    if _major_minor(trt.__version__) != _major_minor(wanted):
        raise EngineError(f"this bundle is for TensorRT {wanted} ({manifest['target']['name']}); "
                          f"this device has TensorRT {trt.__version__}")


def load_plugin(trt, bundle_dir: Path, manifest: dict, logger) -> Path | None:
    """Register the bundle's plugin library with TensorRT; None for a bundle without the fused node."""
    target = manifest["target"]
    if not target.get("fused"):
        return None
    library = Path(bundle_dir) / target["plugin"]["library"]
    if not library.is_file():
        raise EngineError(f"{library} not found: build the plugin first "
                          f"(cmake -S plugins -B plugins/build && cmake --build plugins/build -j)")
    if int(trt.__version__.split(".")[0]) >= 10:
        # IPluginV3: the library exports getCreators(); loadLibrary() registers them.
        handle = trt.get_plugin_registry().load_library(str(library))
        if handle is None:
            raise EngineError(f"TensorRT could not load {library} (see its log above)")
    else:
        # IPluginV2DynamicExt: the creator registers itself when the library is loaded.
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        trt.init_libnvinfer_plugins(logger, "")
    return library


def build_engine(bundle_dir, precision: str | None = None, decomposed: bool = False, output: str | None = None,
                 workspace_mib: int | None = None, calibration_cache: str | None = None, log=print) -> Path:
    """Parse the bundle's model, build a serialized engine for this GPU, save it with its record.

    precision None: the bundle's (fp16, or int8 for a bundle compiled with its Q/DQ model).
    """
    bundle_dir = Path(bundle_dir)
    manifest = load_bundle(bundle_dir)
    precision = precision or ("fp16" if decomposed else manifest["target"].get("precision", "fp16"))
    if precision not in ("fp16", "int8"):
        raise EngineError(f"precision must be fp16 or int8, got {precision!r}")
    trt = import_tensorrt()
    _check_version(trt, manifest)
    model_file = DECOMPOSED if decomposed else _model_file(manifest, precision)
    if precision == "int8" and model_file != manifest["target"].get("qdq_model") and not calibration_cache:
        raise EngineError("int8 needs a Q/DQ model in the bundle (compile with --precision int8) "
                          "or --calibration-cache FILE")
    engine_name = output or ENGINE
    log("equivalent: " + format_command(trtexec_command(manifest, precision, decomposed, engine_name,
                                                        calibration_cache)))
    logger = trt.Logger(trt.Logger.WARNING)
    if not decomposed:
        load_plugin(trt, bundle_dir, manifest, logger)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(bundle_dir / model_file)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineError(f"TensorRT's ONNX parser refused {model_file}: " + " | ".join(errors))
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
        if calibration_cache:
            config.int8_calibrator = _cache_calibrator(trt, Path(calibration_cache))
    profile_spec = manifest["target"]["profile"]
    profile = builder.create_optimization_profile()
    for spec in _profile_inputs(profile_spec):
        profile.set_shape(spec["name"], spec["min"], spec["opt"], spec["max"])
    config.add_optimization_profile(profile)
    pinned = _pin_fp32(trt, network, manifest["target"].get("fp32_layers", []))
    if pinned:
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    log(f"building {precision} engine from {model_file} (TensorRT {trt.__version__}; {pinned} layers pinned to fp32)")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError("TensorRT failed to build the engine (see its log above)")
    engine_path = bundle_dir / engine_name
    engine_path.write_bytes(bytes(serialized))
    record = {
        "engine": engine_name, "sha256": _sha256(engine_path), "model": model_file,
        "model_sha256": manifest["files"].get(model_file), "tensorrt": trt.__version__, "precision": precision,
        "decomposed": decomposed, "profile": profile_spec, "fp32_layers_pinned": pinned,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "trtexec": format_command(trtexec_command(manifest, precision, decomposed, engine_name, calibration_cache)),
    }
    _record_path(engine_path).write_text(json.dumps(record, indent=2) + "\n")
    log(f"engine: {engine_path} ({engine_path.stat().st_size / 1e6:.1f} MB)")
    return engine_path


def _record_path(engine_path: Path) -> Path:
    return engine_path.with_name(engine_path.name + ".json")


def _pin_fp32(trt, network, names) -> int:
    """Keep the named layers (the [CLS] scorer) in fp32; returns how many were found."""
    wanted = set(names)
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.name not in wanted:
            continue
        floats = [j for j in range(layer.num_outputs) if layer.get_output(j).dtype in (trt.float32, trt.float16)]
        if floats:
            layer.precision = trt.float32
            for j in floats:
                layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def _cache_calibrator(trt, cache: Path):
    """An INT8 calibrator that only replays a calibration cache (no batches on the device)."""
    if not cache.is_file():
        raise EngineError(f"{cache}: no such calibration cache")

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            super().__init__()

        def get_batch_size(self):
            return 1

        def get_batch(self, names):
            return None

        def read_calibration_cache(self):
            return cache.read_bytes()

        def write_calibration_cache(self, data):
            return None

    return CacheCalibrator()


# -------------------------------------------------------------------- CUDA memory


class _CudaPython:
    """Device buffers and a stream through cuda-python's runtime API."""

    def __init__(self):
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
        self.rt = cudart
        self.stream = self._ok(cudart.cudaStreamCreate())

    def _ok(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(getattr(err, "value", err)) != 0:
            raise EngineError(f"CUDA error {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def alloc(self, nbytes: int) -> int:
        return int(self._ok(self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self._ok(self.rt.cudaFree(ptr))

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._ok(self.rt.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self.stream))

    def to_host(self, array: np.ndarray, ptr: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._ok(self.rt.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, self.stream))

    def handle(self) -> int:
        return int(self.stream)

    def sync(self) -> None:
        self._ok(self.rt.cudaStreamSynchronize(self.stream))


class _PyCuda:
    """The same through pycuda (optional fallback)."""

    def __init__(self):
        import pycuda.autoinit  # noqa: F401  (creates the context)
        import pycuda.driver as cuda

        self.cuda = cuda
        self.stream = cuda.Stream()
        self.buffers = {}

    def alloc(self, nbytes: int) -> int:
        buf = self.cuda.mem_alloc(max(nbytes, 1))
        self.buffers[int(buf)] = buf
        return int(buf)

    def free(self, ptr: int) -> None:
        self.buffers.pop(ptr).free()

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        self.cuda.memcpy_htod_async(ptr, array, self.stream)

    def to_host(self, array: np.ndarray, ptr: int) -> None:
        self.cuda.memcpy_dtoh_async(array, ptr, self.stream)

    def handle(self) -> int:
        return self.stream.handle

    def sync(self) -> None:
        self.stream.synchronize()


def _cuda():
    for kind in (_CudaPython, _PyCuda):
        try:
            return kind()
        except ImportError:
            continue
    raise EngineError(NO_CUDA)


# ------------------------------------------------------------------------ running


class EngineRunner:
    """Runs a bundle's engine: pixel_values [B, 3, S, S] fp32 (and the other inputs by name: text_embeds [B, T, D]
    fp32) -> {output name: array} (kept indices int64)."""

    def __init__(self, bundle_dir, engine: str = ENGINE):
        bundle_dir = Path(bundle_dir)
        manifest = load_bundle(bundle_dir)
        trt = import_tensorrt()
        engine_path = bundle_dir / engine
        record_path = _record_path(engine_path)
        if not engine_path.is_file():
            raise EngineError(f"{engine_path} not found: build it on the device first "
                              f"(vlmprune build-engine {bundle_dir})")
        if not record_path.is_file():
            raise EngineError(f"{engine_path} has no {record_path.name}: build it with `vlmprune build-engine`, "
                              "which records its sha256")
        record = json.loads(record_path.read_text())
        if _sha256(engine_path) != record["sha256"]:
            raise EngineError(f"{engine_path} does not match the sha256 in {record_path.name}; refusing to load it")
        if record.get("model_sha256") and record["model_sha256"] != manifest["files"].get(record["model"]):
            raise EngineError(f"{engine_path} was built from another {record['model']} than this bundle's")
        if _major_minor(record["tensorrt"]) != _major_minor(trt.__version__):
            raise EngineError(f"{engine_path} was built with TensorRT {record['tensorrt']}; this is {trt.__version__}")
        self.trt, self.record, self.manifest = trt, record, manifest
        self.logger = trt.Logger(trt.Logger.WARNING)
        if not record.get("decomposed"):
            load_plugin(trt, bundle_dir, manifest, self.logger)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT could not deserialize {engine_path} (see its log above)")
        self.context = self.engine.create_execution_context()
        self.cuda = _cuda()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    @property
    def precision(self) -> str:
        return self.record["precision"]

    def __call__(self, pixel_values: np.ndarray, extra: dict | None = None) -> dict:
        trt, engine, context, cuda = self.trt, self.engine, self.context, self.cuda
        given = dict(extra or {})
        given[self.inputs[0]] = pixel_values
        missing = [n for n in self.inputs if n not in given]
        if missing:
            raise EngineError(f"the engine takes {', '.join(missing)} beside the pixels, and none was given")
        buffers, results = [], {}
        try:
            for name in self.inputs:
                x = np.ascontiguousarray(given[name], dtype=trt.nptype(engine.get_tensor_dtype(name)))
                if name == TEXT and x.ndim == 3 and x.shape[1] == 0:  # no prompt: one zero row (the profile's T >= 1)
                    x = np.zeros((x.shape[0], 1, x.shape[2]), dtype=x.dtype)
                context.set_input_shape(name, tuple(x.shape))
                ptr = cuda.alloc(x.nbytes)
                buffers.append(ptr)
                cuda.to_device(ptr, x)
                context.set_tensor_address(name, ptr)
            for out in self.outputs:
                shape = tuple(context.get_tensor_shape(out))
                results[out] = np.empty(shape, dtype=trt.nptype(engine.get_tensor_dtype(out)))
                ptr = cuda.alloc(results[out].nbytes)
                buffers.append(ptr)
                context.set_tensor_address(out, ptr)
            if not context.execute_async_v3(cuda.handle()):
                raise EngineError("TensorRT failed to run the engine (see its log above)")
            for out, ptr in zip(self.outputs, buffers[len(self.inputs):]):
                cuda.to_host(results[out], ptr)
            cuda.sync()
        finally:
            for ptr in buffers:
                cuda.free(ptr)
        # TensorRT 8.5 returns the kept indices as int32; the bundle's contract is int64.
        return {k: v.astype(np.int64) if v.dtype.kind == "i" else v for k, v in results.items()}


# ----------------------------------------------------------------- standalone CLI


def _smoke_run(bundle_dir, engine: str, npy: str | None, repeat: int) -> None:
    import time

    runner = EngineRunner(bundle_dir, engine)
    profile = runner.manifest["target"]["profile"]
    pixel = np.load(npy) if npy else np.zeros(profile["opt"], dtype=np.float32)
    # Other inputs (text_embeds) at their opt shape, seeded rows: a smoke run, not a prompt.
    extra = {spec["name"]: np.random.default_rng(0).standard_normal([pixel.shape[0], *spec["opt"][1:]]).astype(
        np.float32) for spec in profile.get("inputs", [])}
    outputs = runner(pixel, extra)  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        outputs = runner(pixel, extra)
    seconds = (time.perf_counter() - start) / max(repeat, 1)
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} dtype {value.dtype}")
    if KEPT in outputs:
        print("kept (image 0): " + " ".join(map(str, outputs[KEPT][0].tolist())))
    print(f"{seconds * 1e3:.2f} ms per batch of {pixel.shape[0]} (with host copies; mean of {repeat})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vlmprune_engine.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build model.engine on this device")
    build.add_argument("bundle", nargs="?", default=".")
    build.add_argument("--precision", default=None, choices=("fp16", "int8"), help="default: the bundle's")
    build.add_argument("--decomposed", action="store_true", help="build model.decomposed.onnx (no plugin)")
    build.add_argument("--workspace", type=int, default=None, help="workspace limit in MiB")
    build.add_argument("--calibration-cache", default=None)
    build.add_argument("--output", default=None, help=f"engine file name in the bundle (default {ENGINE})")
    infer = sub.add_parser("run", help="run the engine once and print the outputs (smoke test and timing)")
    infer.add_argument("bundle", nargs="?", default=".")
    infer.add_argument("--npy", default=None, help="pixel values [B, 3, S, S] float32 (.npy); default: zeros")
    infer.add_argument("--engine", default=ENGINE)
    infer.add_argument("--repeat", type=int, default=10, help="timed runs after one warm-up")
    show = sub.add_parser("trtexec", help="print the equivalent trtexec command")
    show.add_argument("bundle", nargs="?", default=".")
    show.add_argument("--precision", default=None, choices=("fp16", "int8"), help="default: the bundle's")
    show.add_argument("--decomposed", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build_engine(args.bundle, args.precision, args.decomposed, args.output, args.workspace,
                         args.calibration_cache)
        elif args.command == "run":
            _smoke_run(args.bundle, args.engine, args.npy, args.repeat)
        else:
            print(format_command(trtexec_command(load_bundle(args.bundle), args.precision, args.decomposed)))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
