"""`vlmprune run --benchmark`, and inputs/outputs as .npz files (Polygraphy's --load-inputs / --save-outputs).

Latency is measured around the runner `vlmprune run` uses (the target's runtime here:
ONNX Runtime, the QNN HTP emulator, the TensorRT engine on a Jetson), host array in to
host arrays out, one call per iteration after the warm-up calls, with time.perf_counter.
Percentiles are nearest-rank over the measured iterations, so every figure reported is
one that was measured; throughput is the batch divided by the mean latency.
"""

from __future__ import annotations

import io
import math
import time
import zipfile
from pathlib import Path

import numpy as np

from vlmprune.compiler.bundle.manifest import Tensor
from vlmprune.compiler.errors import InputError


def check_counts(warmup: int, iterations: int) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InputError(f"--warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise InputError(f"--iterations must be an integer >= 1, got {iterations!r}")


def nearest_rank(sorted_ms: list[float], q: float) -> float:
    """The q-th percentile by nearest rank (a measured value, never interpolated)."""
    rank = max(1, math.ceil(q / 100.0 * len(sorted_ms)))
    return sorted_ms[rank - 1]


def benchmark(runner, pixel: np.ndarray, warmup: int, iterations: int, emulated: str = "") -> dict:
    """Latency min/mean/p50/p90/p99/max in ms and throughput in images/s at this batch.

    emulated: what the runner is where it emulates the device (Target.emulated_time): its figures keep the keys
    (latency_ms, throughput_images_per_s) and `measures` says they are emulator time.
    """
    check_counts(warmup, iterations)
    for _ in range(warmup):
        runner(pixel)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        runner(pixel)
        times.append((time.perf_counter() - start) * 1e3)
    ordered = sorted(times)
    mean = sum(times) / len(times)
    return {"batch": int(pixel.shape[0]), "warmup": warmup, "iterations": iterations,
            "measures": f"emulator time: {emulated}" if emulated else "latency",
            "latency_ms": {"min": ordered[0], "mean": mean, "p50": nearest_rank(ordered, 50),
                           "p90": nearest_rank(ordered, 90), "p99": nearest_rank(ordered, 99), "max": ordered[-1]},
            "throughput_images_per_s": pixel.shape[0] / (mean / 1e3)}


def format_benchmark(result: dict, runtime: str) -> list[str]:
    lat = result["latency_ms"]
    emulated = result.get("measures", "latency") != "latency"
    out = [f"benchmark ({runtime}): batch {result['batch']}, {result['warmup']} warm-up + "
           f"{result['iterations']} timed runs"]
    if emulated:
        out.append(f"(times are {result['measures']})")
    return out + [f"{'emulator time' if emulated else 'latency'} ms: min {lat['min']:.3f}  p50 {lat['p50']:.3f}  "
                  f"p90 {lat['p90']:.3f}  p99 {lat['p99']:.3f}  (mean {lat['mean']:.3f}, max {lat['max']:.3f})",
                  f"{'emulator throughput' if emulated else 'throughput'}: "
                  f"{result['throughput_images_per_s']:.2f} images/s at batch {result['batch']}"]


def load_inputs(path: Path, spec: Tensor) -> np.ndarray:
    """The bundle's input (spec: the manifest's first input, the pixels) from an .npz file: the array named like the
    input, or the file's only array.

    It must have the input's rank, channels, image size and (for a static batch) batch,
    and be float32 (another float type is refused rather than silently converted).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--load-inputs {path}: no such file")
    not_npz = f"--load-inputs {path}: not an .npz file of input arrays"
    if not zipfile.is_zipfile(path):  # np.load would take it as a .npy, or offer to unpickle it
        raise InputError(f"{not_npz} (not a zip archive, which numpy.savez writes)")
    try:
        with np.load(path, allow_pickle=False) as data:
            names = list(data.files)
            if spec.name in names:
                array = data[spec.name]
            elif len(names) == 1:
                array = data[names[0]]
            else:
                raise InputError(f"--load-inputs {path}: no array named {spec.name!r} "
                                 f"(it holds {', '.join(names) or 'none'})")
    except InputError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        why = ("it holds pickled Python objects, which are never loaded" if "pickle" in str(exc)
               else (str(exc).splitlines() or [type(exc).__name__])[0])
        raise InputError(f"{not_npz} ({why})") from None
    return check_inputs(array, spec, f"--load-inputs {path}")


def check_inputs(array: np.ndarray, spec: Tensor, what: str = "inputs") -> np.ndarray:
    """array, if it is the bundle's input (spec: the manifest's first input, the pixels): its rank, channels, image
    size, static batch, float32 and finite.

    what names where it came from in the message (the .npz file, or the Python API's inputs=).
    """
    shape = spec.shape
    if array.dtype != np.float32:
        raise InputError(f"{what}: {spec.name} is {array.dtype}, the bundle takes float32")
    if array.ndim != len(shape) or any(isinstance(d, int) and d != a for d, a in zip(shape, array.shape)):
        raise InputError(f"{what}: {spec.name} has shape {list(array.shape)}, the bundle takes {shape}")
    if not np.isfinite(array).all():
        raise InputError(f"{what}: {spec.name} holds NaN or infinite values")
    return array


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """arrays as one .npz file's bytes (written by compiler.bundle.output_files, atomically)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()
