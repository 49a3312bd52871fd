"""vlmprune.compiler.frontend: model sources, one adapter per family, and the torch export.

MODEL is a preset name, a Hugging Face directory (its config.json's model_type picks the
family adapter from the table below) or an .onnx tower. The table (FAMILIES) is the whole
list: each family object (compiler.frontend.family) brings its adapter, named explicitly,
never discovered. A loaded source, and a bundle's manifest, find their family by its id.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.clip import ClipFamily
from vlmprune.compiler.frontend.dinov2 import Dinov2Family
from vlmprune.compiler.frontend.gemma3 import Gemma3Family
from vlmprune.compiler.frontend.gemma4 import Gemma4Family
from vlmprune.compiler.frontend.internvl import InternVLFamily
from vlmprune.compiler.frontend.lfm2_vl import Lfm2VlFamily
from vlmprune.compiler.frontend.export import export_onnx
from vlmprune.compiler.frontend.family import DenseRequest, Family
from vlmprune.compiler.frontend.llava import LlavaFamily
from vlmprune.compiler.frontend.llava_dinov2 import LlavaDinov2Family
from vlmprune.compiler.frontend.llava_next import LlavaNextFamily
from vlmprune.compiler.frontend.llava_onevision import LlavaOnevisionFamily
from vlmprune.compiler.frontend.minicpm_v import MiniCPMVFamily
from vlmprune.compiler.frontend.onnx_tower import OnnxFamily, load_onnx_tower
from vlmprune.compiler.frontend.presets import PRESETS, load_preset
from vlmprune.compiler.frontend.qwen2_vl import Qwen2VLFamily
from vlmprune.compiler.frontend.qwen3_vl import Qwen3VLFamily
from vlmprune.compiler.frontend.smolvlm import SmolVLMFamily
from vlmprune.compiler.frontend.source import Source
from vlmprune.compiler.frontend.vit import VitFamily

# The whole list of families, each with its adapter (None: loaded otherwise, an .onnx file); never discovered.
FAMILIES: tuple[Family, ...] = (LlavaDinov2Family(), LlavaFamily(), LlavaNextFamily(), LlavaOnevisionFamily(),
                                ClipFamily(), VitFamily(),
                                Dinov2Family(), Qwen2VLFamily(), Qwen3VLFamily(), InternVLFamily(),
                                SmolVLMFamily(), Gemma3Family(), Lfm2VlFamily(), MiniCPMVFamily(), Gemma4Family(),
                                OnnxFamily())


def _adapters() -> tuple[type[ModelAdapter], ...]:
    """The families' adapters in table order, read from FAMILIES when asked: the table is the one line a family adds."""
    return tuple(f.adapter for f in FAMILIES if f.adapter is not None)


ADAPTERS: tuple[type[ModelAdapter], ...] = _adapters()

__all__ = ["ADAPTERS", "FAMILIES", "PRESETS", "DenseRequest", "Family", "Source", "adapter_for", "check_family_options",
           "export_onnx", "family_for", "family_of", "family_option_names", "load_fixed", "load_source"]


# Model types refused on purpose, with the reason (one line each).
REFUSED = {t: "its connector pixel-shuffles each s x s patch neighbourhood into one token (and splits images into "
              "crops): pruning inside the tower breaks the shuffle, and no [CLS]-free method scores whole shuffle "
              "groups; only its connector output could be pruned (divprune, dart, per shuffle group), which the "
              "smolvlm family does for SmolVLM checkpoints, not yet for Idefics3"
           for t in ("idefics3",)}


def adapter_for(checkpoint: Checkpoint, where: str) -> ModelAdapter:
    model_type = checkpoint.model_type
    if model_type in REFUSED:
        raise InputError(f"{where}: model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    for adapter in _adapters():
        if adapter.claims(checkpoint):
            return adapter()
    known = ", ".join(dict.fromkeys(t for a in _adapters() for t in a.model_types))
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
        adapter = adapter_for(checkpoint, str(path))
        if image_size is not None:
            return adapter.load(checkpoint, feature_layer, image_size=image_size)
        return adapter.load(checkpoint, feature_layer)
    if path.suffix == ".onnx":
        return load_onnx_tower(path)
    raise InputError(f"{spec}: expected a preset, a Hugging Face directory or an .onnx file")


def _check_image_size_applies(spec: str) -> None:
    """--image-size only for Hugging Face directories of a family that takes it (dynamic_resolution)."""
    takes = [a for a in _adapters() if getattr(a, "dynamic_resolution", False)]
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


def family_by_id(family: str) -> Family:
    for f in FAMILIES:
        if f.id == family:
            return f
    raise InputError(f"unknown model family {family!r} ({', '.join(f.id for f in FAMILIES)})")


def family_for(source: Source) -> Family:
    """The family object of a loaded source (presets too: each is built through a family's adapter)."""
    return family_by_id(source.family)


def family_of(manifest: Manifest) -> Family:
    """The family object of a compiled bundle, by the id its manifest records (model.family)."""
    return family_by_id(manifest.model.family)


def family_option_names() -> dict[str, tuple[type, list[str]]]:
    """Every family option the families declare -> (type, its help texts): the CLI's --grid, --image-size, ..."""
    declared: dict[str, tuple[type, list[str]]] = {}
    for f in FAMILIES:
        for name, (kind, text) in f.options.items():
            declared.setdefault(name, (kind, []))[1].append(text)
    return declared


def check_family_options(options: dict) -> dict:
    """The family options given (None: not given), each checked by the families that declare it, before any work."""
    given = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(family_option_names()))
    if unknown:
        raise InputError(f"--{unknown[0].replace('_', '-')} is not an option of any model family")
    for f in FAMILIES:
        f.check_options({k: v for k, v in given.items() if k in f.options})
    return given


def load_fixed(spec: str, feature_layer: int | None, options: dict, *, prune: bool, batch: int | None,
               cls: str | None) -> tuple[Source, Family]:
    """Load MODEL and let its family fix it for this compile (its options, --cls, the batch it allows).

    A family option of another family is refused in that family's own words.
    """
    given = check_family_options(options)
    source = load_source(spec, feature_layer, given.get("image_size"))
    family = family_for(source)
    for name in given:
        if name not in family.options:
            owner = next(f for f in FAMILIES if name in f.options)
            raise InputError(owner.refuse_elsewhere(name, source))
    family.fix(source, given, prune=prune, batch=batch, cls=cls)
    return source, family
