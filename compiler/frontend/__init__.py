"""vlmprune.compiler.frontend: model sources, one adapter per family, and the torch export.

MODEL is a preset name, a Hugging Face directory (its config.json's model_type picks the
family adapter from the table below) or an .onnx tower. The table is the whole list:
adapters are named explicitly, never discovered.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import ClipTowerAdapter
from vlmprune.compiler.frontend.dinov2 import Dinov2Adapter
from vlmprune.compiler.frontend.export import export_onnx
from vlmprune.compiler.frontend.llava import LlavaAdapter
from vlmprune.compiler.frontend.llava_next import LlavaNextAdapter
from vlmprune.compiler.frontend.onnx_tower import load_onnx_tower
from vlmprune.compiler.frontend.presets import PRESETS, load_preset
from vlmprune.compiler.frontend.qwen2_vl import Qwen2VLAdapter
from vlmprune.compiler.frontend.source import Source
from vlmprune.compiler.frontend.vit import VitAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (LlavaAdapter, LlavaNextAdapter, ClipTowerAdapter, VitAdapter,
                                           Dinov2Adapter, Qwen2VLAdapter)

__all__ = ["ADAPTERS", "PRESETS", "Source", "adapter_for", "export_onnx", "load_source"]


# Model types refused on purpose, with the reason (one line each).
REFUSED = {t: "its connector pixel-shuffles each s x s patch neighbourhood into one token (and splits images into "
              "crops): pruning inside the tower breaks the shuffle, and no [CLS]-free method scores whole shuffle "
              "groups; only its connector output could be pruned (divprune, dart, per shuffle group), which no "
              "adapter does yet"
           for t in ("idefics3", "smolvlm")}


def adapter_for(model_type: str, where: str) -> ModelAdapter:
    if model_type in REFUSED:
        raise InputError(f"{where}: model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter()
    known = ", ".join(t for a in ADAPTERS for t in a.model_types)
    raise InputError(f"{where}: model_type {model_type!r} is not supported ({known})")


def load_source(spec: str, feature_layer: int | None = None, image_size: int | None = None) -> Source:
    """Resolve MODEL (a preset name, a Hugging Face directory or an .onnx file).

    image_size: the static size to compile a dynamic-resolution family at (--image-size);
    every other source has its own fixed size and refuses one.
    """
    if image_size is not None:
        _check_image_size_applies(spec)
    if spec in PRESETS:
        return load_preset(spec)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"{spec}: no such file or directory (and not a preset: {', '.join(PRESETS)})")
    if path.is_dir():
        checkpoint = Checkpoint(path)
        adapter = adapter_for(checkpoint.model_type, str(path))
        if image_size is not None:
            return adapter.load(checkpoint, feature_layer, image_size=image_size)
        return adapter.load(checkpoint, feature_layer)
    if path.suffix == ".onnx":
        return load_onnx_tower(path)
    raise InputError(f"{spec}: expected a preset, a Hugging Face directory or an .onnx file")


def _check_image_size_applies(spec: str) -> None:
    """--image-size only for Hugging Face directories of a family that takes it (dynamic_resolution)."""
    takes = [a for a in ADAPTERS if getattr(a, "dynamic_resolution", False)]
    families = ", ".join(t for a in takes for t in a.model_types)
    path = Path(spec)
    if spec not in PRESETS and not path.exists():
        return  # load_source says what is missing
    if spec not in PRESETS and path.is_dir() and (path / "config.json").is_file():
        model_type = Checkpoint(path).model_type
        if any(model_type in a.model_types for a in takes):
            return
        what = f"model_type {model_type!r}"
    else:
        what = f"preset {spec}" if spec in PRESETS else spec
    raise InputError(f"--image-size applies to Hugging Face directories of a dynamic-resolution family "
                     f"({families}); {what} has a fixed image size")
