"""`vlmprune methods` and `vlmprune targets` as calls: the tables as data, each entry asked what it is.

A method says what it needs and which options it takes, each target how it runs it (or why it refuses it), each
family what it has; the listing names none of them.
"""

from __future__ import annotations

import dataclasses

from vlmprune.compiler import frontend
from vlmprune.compiler.contract import PROBE_KEEP
from vlmprune.passes.methods import METHODS, NEEDS_TRAINED_WEIGHTS
from vlmprune.passes.methods.base import GENERIC_OPTIONS
from vlmprune.targets import PLANNED, TARGETS


@dataclasses.dataclass
class MethodInfo:
    """One pruning method as `vlmprune methods` lists it."""

    name: str
    summary: str
    needs: str  # what it needs from the model
    serves: str  # the families that have it
    options: dict[str, str]  # --OPTION -> what it does
    targets: list[str]  # per target: how it runs the method, or why it refuses it
    official: str | None = None


def methods() -> list[MethodInfo]:
    """The pruning methods: what each needs from the model, its options, and how each target runs it."""
    out = []
    for name, cls in METHODS.items():
        method = cls()
        params = method.parse(PROBE_KEEP, {})
        rows = []
        for target_name, target_cls in TARGETS.items():
            target = target_cls()
            refused = target.refusal(method)
            if refused:
                rows.append(f"{target_name} refuses it ({refused})")
                continue
            parts = [] if target.formulation(method) == "standard" else [target.formulation(method)]
            parts += [_fusion_text(method, target.spellings)]
            rows.append(f"{target_name} ({', '.join(p for p in parts if p) or 'standard ops'})")
        out.append(MethodInfo(name, method.summary, method.needs(params).describe(), _serves(method),
                              {**{option: text.split(": ", 1)[-1] for option, (_kind, text) in method.options.items()},
                               **_generic_options(method, params)},
                              rows, method.official or None))
    return out


def _generic_options(method, params: dict) -> dict[str, str]:
    """The options the base class parses (--merge, --width, --scorer) that this method takes."""
    taken = {}
    if method.local_merge:
        taken.update({name: text for name, (_kind, text) in GENERIC_OPTIONS.items() if name in ("merge", "width")})
    if method.scores_by_cls_kernel(params):
        taken["scorer"] = GENERIC_OPTIONS["scorer"][1]
    if method.prompt_weight:  # passes.methods.relevance
        taken["prompt_weight"] = GENERIC_OPTIONS["prompt_weight"][1]
    if method.roi_keep:  # passes.methods.roi, and --coverage built on it
        taken.update({name: GENERIC_OPTIONS[name][1] for name in ("roi", "roi_max", "coverage")})
    from vlmprune.passes.methods import schedule

    if schedule.refusal(method, params) is None:  # --schedule: a score-based method at a block site
        taken["schedule"] = GENERIC_OPTIONS["schedule"][1]
    return taken


def unavailable_methods() -> dict[str, str]:
    """What `vlmprune methods` ends with: the parts of pruning designs that are trained networks, refused by name
    -> why."""
    return dict(NEEDS_TRAINED_WEIGHTS)


def _serves(method) -> str:
    """The families that have what the method needs (Method.serves against Family.has), in the table's order."""
    parts = []
    for capability, using in method.serves():
        names = [f.has[capability] for f in frontend.FAMILIES if capability in f.has]  # the table as it is now
        if names:
            parts.append(capability.phrase.format(", ".join(names)) + using)
    return "; ".join(parts)


def _fusion_text(method, spellings) -> str:
    """What a target fuses the method into, per value of an option that changes it ('' where nothing is fused)."""
    for option, values in method.choices.items():
        groups: dict[tuple[str, ...], list[str]] = {}
        for value in values:
            groups.setdefault(tuple(method.fused_into(spellings, method.parse(PROBE_KEEP, {option: value}))), []).append(value)
        if len(groups) > 1:
            return "; ".join(f"{'fused into ' + ', '.join(ops) if ops else 'standard ops'} with --{option} "
                             f"{' or '.join(chosen)}" for ops, chosen in groups.items())
    fused = method.fused_into(spellings, method.parse(PROBE_KEEP, {}))
    return f"fused into {', '.join(fused)}" if fused else ""


@dataclasses.dataclass
class TargetInfo:
    """One target as `vlmprune targets` lists it: whether its toolchain is here, or planned."""

    name: str
    summary: str
    available: bool | None  # None: planned, not in this version
    why: str = ""  # why it is unavailable here


@dataclasses.dataclass
class TargetListing:
    """`vlmprune targets`: each target and whether its toolchain is here, the targets' own lines, the LLM exporters."""

    targets: list[TargetInfo]
    notes: list[str]  # what each target lists of its own (e.g. a target option's values)
    llm: list[str]  # the --with-llm exporters, per target


def targets() -> TargetListing:
    """The targets, whether each one's toolchain is available here, and the language-model exporters."""
    from vlmprune.compiler.llm.export import exporter_lines

    listed, notes = [], []
    for name, cls in TARGETS.items():
        target = cls()
        ok, why = target.available()
        listed.append(TargetInfo(name, target.summary, ok, why))
    listed += [TargetInfo(name, summary, None) for name, summary in PLANNED.items()]
    notes.append("--opset (each target's range; others are refused before any work): " + "; ".join(
        f"{name} {cls().opsets[0]}-{cls().opsets[1]}" for name, cls in TARGETS.items()))
    for cls in TARGETS.values():
        notes += cls().listing()
    return TargetListing(listed, notes, exporter_lines())
