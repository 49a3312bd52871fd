"""The product cache: what a compile makes that does not depend on the method, kept for the next compile.

A compile's dearest steps do not depend on the pruning method or K: the dense export
(torch.onnx, tens of seconds on a ViT-L), the dense torch reference on the parity photos
and the "export" parity stage (ONNX Runtime on that same export, against that reference).
A second compile of the same model with another method, or a sweep over K, reuses them
from $VLMPRUNE_CACHE/products (the root kernels/build.py resolves; ~/.cache/vlmprune).

Entries are content-addressed: the key is a sha256 over the weights' content hash, the
family and the pipeline's own settings (image size, feature layer, [CLS] drop, crops,
packing, a clip's frames), opset and batch, and what changes the bytes: the versions of vlmprune, its own
Python sources, torch, onnx, onnxscript, onnx_ir, transformers and ONNX Runtime. An entry
is written into a temporary folder and renamed into place, so concurrent compiles never
see half an entry; it records the sha256 of each of its files, and one that no longer
matches (truncated, flipped bytes) is removed and rebuilt, never used. Deleting the
folder is always safe. The folder is bounded ($VLMPRUNE_PRODUCTS_MAX_GB, default 20): writing an entry
removes the least recently used ones over it. `--no-cache` (CompileOptions.cache=False) reads and writes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmprune.compiler import __version__
from vlmprune.compiler.bundle import sha256_file
from vlmprune.compiler.contract import WEIGHTS  # an entry's weights file, named as in a bundle
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import DenseRequest, Source
from vlmprune.compiler.parity import StageResult
from vlmprune.compiler.parity.reference import Reference
from vlmprune.kernels.build import publish_dir, cache_dir

Progress = Callable[[str], None]
ENTRY = "entry.json"  # an entry's record: its key parts and the sha256 of each file; written last
GRAPH = "dense.onnx"
LAYOUT = 2  # an entry's files: 2, a bundle's own layout of the dense graph and its weights (save_dense)
REFERENCE, STAGE = "reference.npz", "stage.json"
# The pipeline settings that can change the export, read from the pipeline itself so that a family's own
# setting (llava_next's pack and grid, a feature layer's num_blocks) is part of the key without naming it here.
_SETTING_TYPES = (bool, int, float, str, type(None))
_PACKAGES = ("torch", "onnx", "onnxscript", "onnx_ir", "transformers", "onnxruntime", "numpy")

# The key of the dense export each dense file was made from (in this process), for the parity products of the
# same compile; a --no-cache compile, or one into the same folder from an .onnx source, leaves none.
_made: dict[Path, str] = {}


def products_dir() -> Path:
    """$VLMPRUNE_PRODUCTS where set (a test session's own folder, say, beside the shared kernels and venvs),
    else $VLMPRUNE_CACHE/products."""
    override = os.environ.get("VLMPRUNE_PRODUCTS")
    return Path(override).expanduser() if override else cache_dir() / "products"


def dense_export(source: Source, family: str, request: DenseRequest, export: Callable[[], ir.Model], folder: Path,
                 name: str, enabled: bool) -> ir.Model:
    """The dense model export() makes (the family's dense_model for request), written into folder: its graph as
    name, its weights as WEIGHTS (every later graph of the compile refers to that one file).

    An entry holds exactly those two files as a bundle lays them out (save_dense), so a hit
    copies them into folder (the kernel copies; nothing is re-serialised) and a --no-cache
    compile writes the same bytes. The model returned reads folder's copy, on a hit as on
    a miss, so the two give the same graph, and the bundle never depends on the cache. An
    .onnx tower (its family's dense model is the graph itself) is read, not exported: the
    caller passes enabled=False, there is nothing to keep. A hit does not call export(), so
    a family's dense_model must depend on the key's parts alone.
    """
    dense_path = Path(folder) / name
    _made.pop(dense_path.resolve(), None)
    if not enabled:  # read back like a hit: the exported model in memory still holds the torch weights' storage
        save_dense(export(), folder, name)
        return ir.load(dense_path)
    limit_bytes()  # a bad $VLMPRUNE_PRODUCTS_MAX_GB is refused before the export, not after it
    parts = export_parts(source, family, request.batch, request.opset, request.cls)
    key = _key(parts)
    entry = _read(key, (GRAPH, WEIGHTS), request.step)
    if entry is not None:
        request.step(f"export (cached: {key[:12]})")
    else:
        model = export()
        entry = _write(key, parts, lambda tmp: save_dense(model, tmp, GRAPH))
    shutil.copyfile(entry / WEIGHTS, Path(folder) / WEIGHTS)
    shutil.copyfile(entry / GRAPH, dense_path)
    _made[dense_path.resolve()] = key
    return ir.load(dense_path)


def save_dense(model: ir.Model, folder: Path, name: str) -> ir.Model:
    """The layout of a bundle's dense graph: initializers over 1 KiB in folder/WEIGHTS, the graph beside it."""
    ir.external_data.unload_from_model(model, folder, WEIGHTS, size_threshold_bytes=1024)
    ir.save(model, Path(folder) / name)
    return model


def dense_reference(dense_path: Path, pixel: np.ndarray, compute: Callable[[], Reference], step: Progress) -> Reference:
    """The dense torch reference on the parity inputs, cached beside the export it belongs to."""
    key = _product_key(dense_path, "reference", pixel)
    if key is None:
        return compute()
    entry = _read(key, (REFERENCE,), step)
    if entry is not None:
        step("reference (cached)")
        with np.load(entry / REFERENCE) as saved:
            return Reference({name: saved[name] for name in saved.files})
    reference = compute()
    _write(key, {"product": "reference"}, lambda folder: np.savez(folder / REFERENCE, **reference.outputs))
    return reference


def export_stage(dense_path: Path, pixel: np.ndarray, tolerances: dict | None, run: Callable[[], StageResult],
                 step: Progress) -> StageResult:
    """The "export" parity stage (the dense export against the dense reference): the same export on the same
    inputs under the same tolerances gives the same result, so it is kept like the export."""
    key = _product_key(dense_path, "export-stage", pixel, tolerances)
    if key is None:
        return run()
    entry = _read(key, (STAGE,), step)
    if entry is not None:
        step("export parity (cached)")
        return StageResult.from_json(json.loads((entry / STAGE).read_text()))
    result = run()
    _write(key, {"product": "export-stage"},
           lambda folder: (folder / STAGE).write_text(json.dumps(result.to_json(), indent=1) + "\n"))
    return result


def export_parts(source: Source, family: str, batch: int | None, opset: int, cls: str | None) -> dict:
    """What the dense export's bytes depend on (the cache key's parts)."""
    pipeline = source.pipeline
    settings = {name: value for name, value in sorted(vars(pipeline).items())
                if not name.startswith("_") and _is_setting(value)}
    # frames: a video source's clip length is the export's batch (the family's export_batch), which request.batch
    # (the user's --batch, None for a clip) does not say; named here so that no pipeline has to hold it.
    return {"product": "dense-export", "layout": LAYOUT, "weights": source.content_hash, "family": family,
            "image_size": source.image_size, "crops": source.crops, "frames": source.frames,
            "pipeline": type(pipeline).__qualname__,
            "settings": settings, "batch": batch, "opset": opset, "cls": cls, "versions": versions()}


def _is_setting(value) -> bool:
    return isinstance(value, _SETTING_TYPES) or (isinstance(value, tuple) and all(_is_setting(v) for v in value))


# The code each product comes from: the frontend makes the export and the dense reference and imports nothing
# else of vlmprune but errors (tests/test_layers.py); the export stage is run and judged by these modules.
EXPORT_CODE = ("vlmprune.compiler.frontend", "vlmprune.compiler.errors", "vlmprune.compiler.contract")
STAGE_CODE = ("vlmprune.compiler.parity", "vlmprune.compiler.parity.reference", "vlmprune.targets.runtime")


@lru_cache(maxsize=None)
def sources(modules: tuple[str, ...]) -> str:
    """sha256 of these modules' (or packages') Python files: an edited checkout is another vlmprune."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec.submodule_search_locations is None:  # a module
            files = [(Path(spec.origin), Path(spec.origin).name)]
        else:
            files = [(path, path.relative_to(root)) for root in map(Path, spec.submodule_search_locations)
                     for path in sorted(root.rglob("*.py"))]
        for path, rel in files:
            digest.update(f"{name}:{rel}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def versions() -> dict:
    """vlmprune's version and its exporting code, and the versions of the packages that write or run the graphs."""
    out = {"vlmprune": __version__, "sources": sources(EXPORT_CODE)}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _product_key(dense_path: Path, product: str, pixel: np.ndarray, tolerances: dict | None = None) -> str | None:
    """A parity product's key: its export's key, the inputs' bytes and the tolerances; None when not cached."""
    export = _made.get(Path(dense_path).resolve())
    if export is None:
        return None
    inputs = hashlib.sha256(f"{pixel.dtype}{pixel.shape}".encode() + np.ascontiguousarray(pixel).tobytes())
    return _key({"product": product, "export": export, "inputs": inputs.hexdigest(), "tolerances": tolerances,
                 "sources": sources(STAGE_CODE)})


def _read(key: str, files: tuple[str, ...], step: Progress) -> Path | None:
    """The entry's folder if it is whole; a damaged one is removed (and said so), to be rebuilt."""
    entry = products_dir() / key
    if not entry.exists():
        return None
    try:
        recorded = json.loads((entry / ENTRY).read_text())["files"]
        damaged = next((name for name in files if sha256_file(entry / name) != recorded[name]), None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        damaged = f"{ENTRY} ({type(exc).__name__})"
    if damaged is None:
        os.utime(entry / ENTRY)  # used now: the last to be evicted
        return entry
    step(f"cache entry {key[:12]} is damaged ({damaged} does not match its sha256): removed, rebuilding")
    _remove(entry)
    return None


def _write(key: str, parts: dict, fill: Callable[[Path], object]) -> Path:
    """Fill a temporary folder, record its files' sha256, and rename it into place (atomic; first writer wins)."""
    root = products_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=root))
    try:
        fill(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        (tmp / ENTRY).write_text(json.dumps({"key": key, "parts": parts, "files": files}, indent=1) + "\n")
        entry = publish_dir(tmp, root / key)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    evict(root, keep=entry)
    return entry


def limit_bytes() -> int:
    """$VLMPRUNE_PRODUCTS_MAX_GB (default 20): what the products folder may hold before the least recently used
    entries go."""
    raw = os.environ.get("VLMPRUNE_PRODUCTS_MAX_GB", "20")
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"VLMPRUNE_PRODUCTS_MAX_GB must be a number of gigabytes, got {raw!r}") from None
    return int(value * 1e9)


def evict(root: Path, keep: Path) -> list[str]:
    """Remove the least recently used entries (by their record's mtime, which a hit touches) until the folder fits
    limit_bytes(); never keep, the entry just written, even when it alone is over the limit."""
    entries = []
    for entry in root.iterdir():
        if entry.name.startswith(".") or not (entry / ENTRY).is_file():
            continue  # another compile's temporary folder, or one being removed
        try:
            size = sum(f.stat().st_size for f in entry.iterdir())
            entries.append(((entry / ENTRY).stat().st_mtime, entry, size))
        except OSError:  # removed meanwhile
            continue
    limit, total, removed = limit_bytes(), sum(size for _, _, size in entries), []
    for _, entry, size in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if entry != keep:
            _remove(entry)
            total -= size
            removed.append(entry.name)
    return removed


def _remove(entry: Path) -> None:
    """Rename first, so that no reader finds a half-deleted entry, then delete."""
    trash = Path(tempfile.mkdtemp(prefix=".removed-", dir=entry.parent))
    try:
        entry.rename(trash / entry.name)
    except OSError:  # another compile removed it first
        pass
    shutil.rmtree(trash, ignore_errors=True)
