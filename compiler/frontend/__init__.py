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
from vlmprune.compiler.frontend.onnx_tower import load_onnx_tower
from vlmprune.compiler.frontend.presets import PRESETS, load_preset
from vlmprune.compiler.frontend.source import Source
from vlmprune.compiler.frontend.vit import VitAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (LlavaAdapter, ClipTowerAdapter, VitAdapter, Dinov2Adapter)

__all__ = ["ADAPTERS", "PRESETS", "Source", "adapter_for", "export_onnx", "load_source"]


def adapter_for(model_type: str, where: str) -> ModelAdapter:
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter()
    known = ", ".join(t for a in ADAPTERS for t in a.model_types)
    raise InputError(f"{where}: model_type {model_type!r} is not supported ({known})")


def load_source(spec: str, feature_layer: int | None = None) -> Source:
    """Resolve MODEL (a preset name, a Hugging Face directory or an .onnx file)."""
    if spec in PRESETS:
        return load_preset(spec)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"{spec}: no such file or directory (and not a preset: {', '.join(PRESETS)})")
    if path.is_dir():
        checkpoint = Checkpoint(path)
        return adapter_for(checkpoint.model_type, str(path)).load(checkpoint, feature_layer)
    if path.suffix == ".onnx":
        return load_onnx_tower(path)
    raise InputError(f"{spec}: expected a preset, a Hugging Face directory or an .onnx file")
