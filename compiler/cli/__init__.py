"""The `vlmprune` command line: one thin command per verb over the Python API (compiler/api/).

Each command parses its options, calls one api function and prints its result (the lines are
render.py's); what a command computes lives in the API, so a script gets the same results without
shelling out. The targets' own commands (build-engine) go through the API too.

This module is the group: its usage errors in one line, and the commands it holds. Each command (or small
family of commands) is a module of its own (compile_cmd, check_cmd, inspect_cmd, run_cmd, generate_cmd,
eval_cmd, target_cmds), over the shared error boundary (boundary.py) and option families (options.py); the
commands import none of this module, so the imports run one way.
"""

from __future__ import annotations

import contextlib

import click

from vlmprune.compiler import __version__, api
from vlmprune.compiler.cli import check_cmd, compile_cmd, eval_cmd, generate_cmd, inspect_cmd, run_cmd, target_cmds


class _UsageLine(click.ClickException):
    """A click usage error, shown as every other bad input is: one `error:` line, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


class _Cli(click.Group):
    """The `vlmprune` group: a bad type, an unknown option or a missing argument, in any command, is one line
    naming where the usage is, instead of click's usage block (no arguments at all still print the help)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_in_one_line():  # the group's own options
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with _usage_in_one_line():  # the command's name, and its options and arguments
            return super().invoke(ctx)


@contextlib.contextmanager
def _usage_in_one_line():
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "vlmprune"
        raise _UsageLine(f"{' '.join(exc.format_message().split())} (see {where} --help)") from None


@click.group(cls=_Cli, name="vlmprune", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlmprune")
def main():
    """Compile LLaVA-style vision towers into edge artifacts with visual-token pruning in the graph."""
    api.quiet_imports()


COMMANDS = (compile_cmd.compile, check_cmd.check, inspect_cmd.inspect, inspect_cmd.targets, run_cmd.run,
            run_cmd.compare, inspect_cmd.methods, generate_cmd.generate, eval_cmd.eval_command)


def _register() -> None:
    """The CLI's own commands, then each target's (target_cmds), which never replaces one of the CLI's own."""
    for command in (*COMMANDS, *target_cmds.target_commands()):
        if command.name not in main.commands:
            main.add_command(command)


_register()
