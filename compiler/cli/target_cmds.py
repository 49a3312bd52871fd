"""The commands the targets contribute (Target.commands; e.g. build-engine), run through the API.

Each keeps the options and help its target declares; the CLI adds only its one-line error boundary and prints
the command's lines on stdout.
"""

from __future__ import annotations

import click

from vlmprune.compiler import api
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors


def target_commands() -> list[click.Command]:
    """Every target's declared command, once each (targets that share a module share its commands)."""
    found: dict[str, click.Command] = {}
    for declared in api.target_commands():
        found.setdefault(declared.name, _through_api(declared))
    return list(found.values())


def _through_api(declared: click.Command) -> click.Command:
    name = declared.name

    @one_line_errors
    def callback(**params):
        echo_lines(api.target_command(name, progress=click.echo, **params))

    return click.Command(name, params=declared.params, help=declared.help, short_help=declared.short_help,
                         callback=callback)
