"""The option types and option families more than one command shares, built from what the components declare.

The methods', targets' and families' own flags come from their declarations (api.declared_options and the like),
so a new method, target or family needs no CLI edit; the command modules only place the decorators.
"""

from __future__ import annotations

import click

from vlmprune.compiler import api


class KeepType(click.ParamType):
    """--keep: an integer K, or `auto` (with --latency-ms; compiler.pipeline.auto_keep)."""

    name = "integer|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or (isinstance(value, str) and value.strip().lower() == "auto"):
            return value if isinstance(value, int) else "auto"
        try:
            return int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer or auto", param, ctx)


class NonEmptyPath(click.Path):
    """A path that is not "": pathlib reads "" as ".", the current directory, which no one means by -o ""."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path (name the directory or file to write)", param, ctx)
        return super().convert(value, param, ctx)


def extra_options(fn):
    """--OPTION flags for every method option and target option the tables declare, so a new method or
    target needs no CLI edit. Their values reach the library as method_options / target_options."""
    for name, (kind, texts) in sorted(api.declared_options().items(), reverse=True):
        fn = click.option(f"--{name.replace('_', '-')}", f"opt_{name}", type=kind, default=None,
                          help="; ".join(dict.fromkeys(texts)))(fn)
    return fn


def target_options(fn):
    """--OPTION flags for every option the targets declare (eval --dataset: its bundles compiled with them)."""
    for name, (kind, texts) in sorted(api.declared_target_options().items(), reverse=True):
        fn = click.option(f"--{name.replace('_', '-')}", f"topt_{name}", type=kind, default=None,
                          help="--dataset: " + "; ".join(dict.fromkeys(texts)))(fn)
    return fn


def family_options(fn):
    """--OPTION flags for every option the model families declare (Family.options: --grid, --crop-budget,
    --image-size), so a new family needs no CLI edit. Their values reach the library as family_options."""
    for name, (kind, texts) in reversed(list(api.declared_family_options().items())):
        fn = click.option(f"--{name.replace('_', '-')}", f"family_{name}", type=kind, default=None,
                          help="; ".join(dict.fromkeys(texts)))(fn)
    return fn
