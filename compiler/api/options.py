"""What every command of the API shares: the progress callback, and the options the tables declare.

The CLI builds its --lambda, --precision, --grid, ... flags from these (it names no method, target or family),
and a script passes the same names as method_options / target_options / family_options.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vlmprune.compiler.frontend import family_option_names
from vlmprune.compiler.parity import StageResult
from vlmprune.passes.methods import METHODS
from vlmprune.passes.methods.base import GENERIC_OPTIONS
from vlmprune.targets import TARGETS

# What a command sends while it works: its lines (progress, notes, warnings) and, as each parity stage of `compile`
# and `check` ends, that stage's record (compiler.parity.StageResult): data, which the CLI renders as a line.
Progress = Callable[["str | StageResult"], None] | None


def reporter(progress: Progress) -> Callable[[str | StageResult], None]:
    """progress, or a callback that drops the lines (None: the caller wants none)."""
    return progress or (lambda _m: None)


def declared_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a method or target declares -> (type, its help texts): the CLI's --lambda, --precision, ..."""
    declared: dict[str, tuple[type, list[str]]] = {name: (kind, [text])
                                                   for name, (kind, text) in GENERIC_OPTIONS.items()}
    for cls in METHODS.values():
        for name, (kind, text) in cls.options.items():
            declared.setdefault(name, (kind, []))[1].append(text)
    for name, (kind, texts) in declared_target_options().items():
        declared.setdefault(name, (kind, []))[1].extend(texts)
    return declared


def declared_target_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a target declares -> (type, its help texts): eval --dataset's --precision, --calibration, ..."""
    declared: dict[str, tuple[type, list[str]]] = {}
    for cls in TARGETS.values():
        for name, text in cls.options.items():
            declared.setdefault(name, (str, []))[1].append(text)
    return declared


def declared_family_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a model family declares -> (type, its help texts): the CLI's --grid, --image-size, ..."""
    return family_option_names()


def split_options(given: dict) -> tuple[dict, dict]:
    """Declared options given (None: not given) -> (method_options, target_options); a target's name wins."""
    given = {k: v for k, v in given.items() if v is not None}
    target_names = {n for cls in TARGETS.values() for n in cls.options}
    method_names = {n for cls in METHODS.values() for n in cls.options} | set(GENERIC_OPTIONS)
    method = {k: v for k, v in given.items() if k in method_names and k not in target_names}
    target = {k: v for k, v in given.items() if k in target_names}
    return method, target


def llm_option_texts() -> dict:
    """--with-llm's help, and --llm-exporter's choices and help, from what each target declares it takes
    (Target.llm_exporters) and what each exporter says of itself: the CLI names no target or exporter."""
    from vlmprune.compiler.llm.export import EXPORTERS

    takes = {name: cls.llm_exporters for name, cls in TARGETS.items() if cls.llm_exporters}
    with_llm = "Also export the language model into llm/ (" + "; ".join(
        f"{name}: {EXPORTERS[ids[0]]().summary}" for name, ids in takes.items()) + ")."
    several = {name: ids for name, ids in takes.items() if len(ids) > 1}
    choices = list(dict.fromkeys(i for ids in several.values() for i in ids))
    helps = []
    for name, ids in several.items():
        told = [f"{i} ({'default; ' if n == 0 else ''}{EXPORTERS[i]().features})" for n, i in enumerate(ids)]
        helps.append(f"{name}, with --with-llm: {' or '.join(told)}")
    return {"with_llm": with_llm, "exporters": choices, "exporter": "; ".join(helps) + "."}


# transformers imports torchao whenever it is installed (the [bench] extra), and torchao then logs its CUDA-only
# libraries that a CPU machine cannot load, and torch's pytree its deprecation notes: import-time chatter about a
# package no command here uses, which `-q` and a clean stderr should not carry.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Keep QUIET_LOGGERS' import-time warnings off stderr (errors still show)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
