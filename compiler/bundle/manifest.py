"""The bundle's manifest.json as a type: load, verify, and typed read-only views of its sections.

`Manifest` is the manifest's JSON object itself (a dict subclass), so what is written to disk
and what bundles on disk hold do not change; the views only name the fields a reader uses
(`m.target.name`, `m.method.pruned`, `m.inputs[0].shape`) so that no reader spells a key twice.
A view is also a read-only Mapping of its section: a target's own fields (what its emit
recorded) are read as `m.target.get("qdq_model")`.

Every file's sha256 is recorded in the manifest, and the manifest records the digest of its
own content, so an edited manifest (keep changed by hand, a file list trimmed) is caught like
an edited model: nothing is loaded from a bundle that does not match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vlmprune.compiler.contract import MANIFEST, NUM_TOKENS, TEXT, PruneRecord
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.dense import Dense

DIGEST_KEY = "manifest_sha256"  # the manifest's digest of its own content (manifest_digest)
# The sections every bundle has, and their JSON type; a manifest without one is refused on load.
SECTIONS = {"target": dict, "model": dict, "method": dict, "inputs": list, "outputs": list, "preprocess": dict,
            "compile_options": dict}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON, its own digest field left out."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Section(Mapping):
    """A read-only view of one manifest section; subclasses name its fields."""

    def __init__(self, data: Mapping):
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


class TargetSection(Section):
    """What the target recorded: its name, options, toolchain, and its emit's own fields (get them by key)."""

    name = property(lambda self: self._data["name"])
    summary = property(lambda self: self._data["summary"])
    options = property(lambda self: self._data.get("options", {}))
    toolchain = property(lambda self: self._data.get("toolchain", {}))
    fused = property(lambda self: self._data.get("fused", False))  # the selection runs as one custom op
    fused_ops = property(lambda self: self._data.get("fused_ops", []))
    precision = property(lambda self: self._data.get("precision"))


class ModelSection(Section):
    """The source model: where it was loaded from, its family, content hash and geometry, and the family's details."""

    source = property(lambda self: self._data["source"])
    kind = property(lambda self: self._data["kind"])  # "preset", "hf" or "onnx"
    family = property(lambda self: self._data.get("family"))
    sha256 = property(lambda self: self._data["sha256"])
    image_size = property(lambda self: self._data.get("image_size"))
    patch_size = property(lambda self: self._data.get("patch_size"))
    positions = property(lambda self: self._data.get("positions"))
    # The families' own fields, for the readers that need one (details has them all).
    token_counts = property(lambda self: self._data.get("token_counts") or {})  # a merging tower's grids and counts
    video_frames = property(lambda self: self.token_counts.get("video_frames"))  # compile --video-frames F
    merged_grid_thw = property(lambda self: self.token_counts.get("merged_grid_thw"))  # the merged tokens' t, h, w
    deepstack = property(lambda self: self._data.get("deepstack"))  # Qwen3-VL's DeepStack planes
    grid = property(lambda self: self._data.get("grid"))  # anyres: the crops grid ("RxC"), its crop count
    crops = property(lambda self: self._data.get("crops"))
    resolution = property(lambda self: self._data.get("resolution"))  # anyres: [height, width] of the grid

    @property
    def details(self) -> dict:
        """The family's own fields (grid, crops, token_counts, ...), everything but the common ones."""
        common = {"source", "kind", "family", "sha256", "image_size", "patch_size", "positions",
                  "feature_layer_override"}
        return {k: v for k, v in self._data.items() if k not in common}


class MethodSection(Section):
    """The method that pruned the tower, or methods.dense.Dense's record for a dense bundle."""

    name = property(lambda self: self._data["name"])
    summary = property(lambda self: self._data["summary"])
    pruned = property(lambda self: self._data["name"] != Dense.name)  # False: a dense bundle (--no-prune)
    params = property(lambda self: self._data.get("params", {}))
    keep = property(lambda self: self._data.get("keep"))
    site = property(lambda self: self._data.get("site"))
    layer = property(lambda self: self._data.get("layer"))
    num_blocks = property(lambda self: self._data.get("num_blocks"))
    formulation = property(lambda self: self._data.get("formulation"))
    tokens_in = property(lambda self: self._data.get("tokens_in"))
    tokens_out = property(lambda self: self._data.get("tokens_out"))
    num_patches = property(lambda self: self._data.get("num_patches"))
    has_cls = property(lambda self: self._data.get("has_cls"))
    kept_count = property(lambda self: self._data.get("kept_count"))
    steps = property(lambda self: self._data.get("steps", []))  # --schedule: each step's layer, keep, token counts
    # --roi: its inputs' layout (passes.methods.roi.layout: kind, height, width, patch, grid, inputs, max_boxes)
    roi = property(lambda self: self._data.get("roi"))

    @property
    def prefix(self) -> int | None:
        """Tokens before the patch tokens (PruneRecord.prefix_of: older bundles too); None for a dense bundle."""
        if not self.pruned:
            return None
        return PruneRecord.prefix_of(self._data)

    def method(self):
        """The method object (passes.methods), Dense for a dense bundle."""
        return get_method(self.name) if self.pruned else Dense()


class Tensor(Section):
    """One graph input or output: name, shape (ints and symbolic names), dtype."""

    name = property(lambda self: self._data["name"])
    shape = property(lambda self: self._data["shape"])
    dtype = property(lambda self: self._data["dtype"])


class PreprocessSection(Section):
    mean = property(lambda self: self._data["mean"])
    std = property(lambda self: self._data["std"])
    size = property(lambda self: self._data["size"])


class LlmSection(Section):
    """The LLM hand-off (compiler.llm.handoff.llm_section): how the image rows splice into the language model."""

    features_output = property(lambda self: self._data["features_output"])
    image_tokens = property(lambda self: self._data.get("image_tokens"))  # an int, or a symbolic name (variable K)
    dense_image_tokens = property(lambda self: self._data.get("dense_image_tokens"))
    hidden_size = property(lambda self: self._data.get("hidden_size"))
    dtype = property(lambda self: self._data.get("dtype"))
    rows = property(lambda self: self._data["rows"])  # {"prefix", "kept", "extra"}
    positions = property(lambda self: self._data["positions"])
    text_resumes_at = property(lambda self: self._data.get("text_resumes_at"))
    num_tokens = property(lambda self: self._data.get("num_tokens"))  # K varies per image: how to read the rows
    extra_rows = property(lambda self: (self._data["rows"] or {}).get("extra"))  # rows with no patch position


class KeepAutoSection(Section):
    """--keep auto (compiler.pipeline.auto_keep): the K -> latency curve K was chosen on, and where it was timed."""

    chosen = property(lambda self: self._data["chosen"])
    budget_ms = property(lambda self: self._data["budget_ms"])
    curve = property(lambda self: self._data["curve"])  # [[K, ms], ...], every K timed
    timed_on = property(lambda self: self._data["timed_on"])
    load = property(lambda self: self._data.get("load"))  # other processes' CPU share while it was timed


class ParitySection(Section):
    passed = property(lambda self: self._data["passed"])
    stages = property(lambda self: self._data.get("stages", []))


class Manifest(dict):
    """manifest.json: the dict as written, with typed views of its sections."""

    @classmethod
    def load(cls, bundle_dir: Path, verify: bool = True) -> Manifest:
        """Read manifest.json; with verify, refuse a bundle whose manifest or files were modified."""
        bundle_dir = Path(bundle_dir)
        path = bundle_dir / MANIFEST
        if not bundle_dir.is_dir():
            raise InputError(f"{bundle_dir}: no such bundle directory")
        if not path.is_file():
            raise InputError(f"{bundle_dir}: not a vlmprune bundle (no {MANIFEST})")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)}); the bundle was modified") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: not a vlmprune manifest; the bundle was modified")
        manifest = cls(data)
        if verify:
            manifest.verify(bundle_dir)
        manifest.check_sections(path)
        return manifest

    def extended(self, **sections) -> Manifest:
        """A new manifest with these sections added after the ones it has (the file keeps that order): how the
        compile adds what it learns in turn (the hand-off, the LLM graphs, parity) without writing into a dict."""
        return Manifest({**self, **sections})

    def verify(self, bundle_dir: Path) -> None:
        """Refuse (one line) a manifest that does not match its own digest, or a file that does not match its sha256."""
        if self.get(DIGEST_KEY) != manifest_digest(self):
            raise InputError(f"{bundle_dir}: {MANIFEST} does not match its recorded digest: the bundle was "
                             "modified after it was compiled; recompile it")
        for name, expected in self.files.items():
            file = Path(bundle_dir) / name
            if not file.is_file():
                raise InputError(f"{bundle_dir}: {name} is listed in the manifest but missing")
            if sha256_file(file) != expected:
                raise InputError(f"{bundle_dir}: {name} does not match its sha256 in the manifest; "
                                 "the bundle was modified; refusing to load it")

    def check_sections(self, path: Path) -> None:
        """One line naming the first section a reader needs that this manifest lacks."""
        for key, kind in SECTIONS.items():
            if not isinstance(self.get(key), kind):
                raise InputError(f"{path}: not a vlmprune manifest (no {key!r} section); "
                                 "the bundle was modified or is not a vlmprune bundle")

    target = property(lambda self: TargetSection(self["target"]))
    model = property(lambda self: ModelSection(self["model"]))
    method = property(lambda self: MethodSection(self["method"]))
    inputs = property(lambda self: [Tensor(t) for t in self["inputs"]])
    outputs = property(lambda self: [Tensor(t) for t in self["outputs"]])
    output_names = property(lambda self: [t["name"] for t in self["outputs"]])
    preprocess = property(lambda self: PreprocessSection(self["preprocess"]))
    compile_options = property(lambda self: self["compile_options"])
    cls_section = property(lambda self: self.get("cls", {}))  # whether image_features starts with [CLS]
    llm = property(lambda self: LlmSection(self["llm"]) if self.get("llm") is not None else None)  # the handoff
    keep_auto = property(lambda self: KeepAutoSection(self["keep_auto"]) if self.get("keep_auto") else None)
    llm_graphs = property(lambda self: self.get("llm_graphs"))  # the language model's graphs, with --with-llm
    parity = property(lambda self: ParitySection(self["parity"]) if "parity" in self else None)

    @property
    def record(self) -> PruneRecord | None:
        """The prune record the bundle was compiled from (what its decomposed graph holds), None for a dense one."""
        if not self.method.pruned:
            return None
        text = next((t for t in self.inputs if t.name == TEXT), None)
        return PruneRecord.from_manifest(
            self["method"], text=None if text is None else {"name": TEXT, "dim": text.shape[2]},
            num_tokens=NUM_TOKENS if NUM_TOKENS in self.output_names else None)
    files = property(lambda self: self.get("files", {}))  # bundle-relative path -> sha256
    version = property(lambda self: self["vlmprune_version"])
