"""`--with-llm`: the five calls the pipeline makes, answered by the exporter the target declares.

The table below is the whole list of LLM exporters: they are named explicitly, never
discovered. A target declares which exporters it takes (Target.llm_exporters; the first is its
default) and why it takes none (Target.no_llm_why); `--llm-exporter` picks among a target's
own. The manifest's `llm_graphs.exporter_id` names the exporter that wrote a bundle's llm/, so
`check` and the README ask that exporter again. Adding an exporter is one module (an
LlmExporter subclass, compiler.llm.exporter) plus its tests, and one line here.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm.edgellm import EdgeLlmExporter
from vlmprune.compiler.llm.exporter import LlmExporter, parity_record_figures
from vlmprune.compiler.llm.fastv import FastVSpec
from vlmprune.compiler.llm.genai import GenaiExporter
from vlmprune.compiler.llm.torch_exporter import TorchExporter
from vlmprune.targets import TARGETS, get_target

EXPORTERS: dict[str, type[LlmExporter]] = {e.id: e for e in (TorchExporter, GenaiExporter, EdgeLlmExporter)}


def _llm_targets() -> list[str]:
    return [name for name, cls in TARGETS.items() if cls.llm_exporters]


def _choosable() -> list[str]:
    """The exporter ids --llm-exporter can name: those of the targets that take more than one."""
    ids = [i for cls in TARGETS.values() if len(cls.llm_exporters) > 1 for i in cls.llm_exporters]
    return list(dict.fromkeys(ids))


def exporter_for(options) -> LlmExporter:
    """The exporter of options' target: --llm-exporter where given, else the target's default; one line otherwise."""
    target = get_target(options.target)
    if not target.llm_exporters:
        raise InputError(f"--with-llm: target {target.name} does not take the language model yet "
                         f"({target.no_llm_why}; supported: {', '.join(_llm_targets())})")
    chosen = getattr(options, "llm_exporter", None)
    if chosen is None:
        return EXPORTERS[target.llm_exporters[0]]()
    if chosen not in _choosable():
        raise InputError(f"--llm-exporter is {' or '.join(_choosable())}, got {chosen!r}")
    if chosen not in target.llm_exporters or len(target.llm_exporters) < 2:
        choosers = [name for name, cls in TARGETS.items() if len(cls.llm_exporters) > 1]
        raise InputError(f"--llm-exporter applies to target {', '.join(choosers)}; target {target.name}'s language "
                         f"model is exported with {EXPORTERS[target.llm_exporters[0]].name}")
    return EXPORTERS[chosen]()


def exporter_of(manifest: Manifest) -> LlmExporter:
    """The exporter that wrote a bundle's llm/, by the id its manifest records."""
    return _recorded(manifest.llm_graphs)


def _recorded(llm: dict) -> LlmExporter:
    """The exporter an llm_graphs record names (exporter_id); one line for an id no exporter has."""
    llm_id = llm.get("exporter_id")
    if llm_id not in EXPORTERS:
        raise InputError(f"the bundle's llm_graphs names no known LLM exporter (exporter_id {llm_id!r}; known: "
                         f"{', '.join(EXPORTERS)}): compile it again with this vlmprune")
    return EXPORTERS[llm_id]()


def parity_figures(llm: dict) -> tuple[bool, list[str]]:
    """(passed, figures) of the compile summary's `parity llm` line, as the exporter that wrote llm_graphs says them
    (a record without an exporter id: the default's parity record)."""
    if llm.get("exporter_id") is None:
        return parity_record_figures(llm)
    return _recorded(llm).parity_figures(llm)


def exporter_lines() -> list[str]:
    """`vlmprune targets`' lines for --with-llm, from the targets' declarations (one per target and exporter)."""
    lines = []
    for name, cls in TARGETS.items():
        ids = cls.llm_exporters
        if not ids:
            lines.append(f"  {name:<8} not supported: {cls.no_llm_why}")
        for i, llm_id in enumerate(ids):
            exporter = EXPORTERS[llm_id]()
            if len(ids) == 1:
                text = f"{exporter.summary}: {exporter.status()}"
            elif i == 0:
                text = f"{exporter.summary} (default; {exporter.features})"
            else:
                text = f"--llm-exporter {llm_id}: {exporter.status()}"
            lines.append(f"  {name:<8} {text}")
    return lines


def check_llm_options(options) -> FastVSpec | None:
    """--with-llm, --fastv-layer, --fastv-keep, --image-start before any work; the span's length comes later.

    Returns a FastVSpec with a placeholder length (the bundle's image-token count fills it in).
    """
    with_llm = getattr(options, "with_llm", False)
    layer, keep, start = (getattr(options, name, None) for name in ("fastv_layer", "fastv_keep", "image_start"))
    if not with_llm:
        given = [flag for flag, v in (("--llm-exporter", getattr(options, "llm_exporter", None)),
                                      ("--fastv-layer", layer), ("--fastv-keep", keep), ("--image-start", start))
                 if v is not None]
        if given:
            raise InputError(f"{given[0]} applies to the language model: add --with-llm")
        return None
    exporter_for(options).check_options(layer)
    if layer is None:
        if keep is not None:
            raise InputError("--fastv-keep needs --fastv-layer (FastV is off without it)")
        return None
    if start is None:
        raise InputError("FastV needs --image-start: the number of prompt tokens before the image "
                         "(the image span is compiled into the graph)")
    spec = FastVSpec(start, 1, layer, 0.5 if keep is None else keep)
    spec.check(layer + 1)  # the layer's upper bound is checked once the LLM is loaded
    return spec


def check_llm_model(spec: str, options) -> None:
    """--with-llm against MODEL's config alone (no weights), as its exporter asks, before the tower's export."""
    fastv = check_llm_options(options)
    if getattr(options, "with_llm", False):
        exporter_for(options).check_model(spec, fastv)


def emit_llm(model_spec: str, manifest: Manifest, options, folder: Path, progress=lambda _m: None) -> dict:
    """Export the language model into folder/llm with the target's exporter and check it; the manifest fields."""
    fastv = check_llm_options(options)
    exporter = exporter_for(options)
    return {"exporter_id": exporter.id, **exporter.export(model_spec, manifest, options, Path(folder), progress, fastv)}


def check_llm(model_spec: str, bundle_dir: Path, manifest: Manifest):
    """`vlmprune check` for the language model: its exporter's compile-time check again, on the bundle's own files."""
    return exporter_of(manifest).check(model_spec, Path(bundle_dir), manifest)


def readme_section(manifest: Manifest) -> str:
    """The bundle README's language-model section (empty without --with-llm)."""
    if not manifest.llm_graphs:
        return ""
    return exporter_of(manifest).readme_section(manifest)
