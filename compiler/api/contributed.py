"""The commands the targets contribute (Target.commands; `vlmprune build-engine`), run as every command is: by a
call here, which the CLI makes too.

A target declares each command's name, options and help as a click command in its own module (the API and the CLI
name no target); its callback does the work, given the parameters and `log`, and returns the lines it ends with on
stdout (build-engine --print-command: the trtexec command).
"""

from __future__ import annotations

from pathlib import Path

import click

from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.errors import InputError
from vlmprune.targets import TARGETS


def target_commands() -> list:
    """The click commands the targets contribute (Target.commands, e.g. build-engine), one per name."""
    commands: dict[str, object] = {}
    for cls in TARGETS.values():
        for command in cls().commands():
            commands.setdefault(command.name, command)
    return list(commands.values())


def target_command(name: str, *, progress: Progress = None, **params) -> list[str]:
    """Run the command NAME a target contributes with its parameters (the click command's names: bundle_dir,
    print_command, ...; the ones not given take the command's defaults). Its lines as it works go to progress;
    returns the lines it ends with. Raises InputError for an unknown command or parameter, and the target's one
    line where the work cannot be done here (no TensorRT, a bundle of another target)."""
    commands = {command.name: command for command in target_commands()}
    if name not in commands:
        raise InputError(f"no target adds a command {name!r}; they add: {', '.join(commands) or 'none'}")
    command = commands[name]
    declared = {param.name: param for param in command.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise InputError(f"{name} takes no {', '.join(unknown)}; it takes {', '.join(declared)}")
    missing = [p for p, param in declared.items() if param.required and params.get(p) is None]
    if missing:
        raise InputError(f"{name} needs {', '.join(missing)}")
    context = click.Context(command)  # where click keeps a flag's default (False)
    given = {p: params[p] if p in params else param.get_default(context) for p, param in declared.items()}
    return list(command.callback(**given, log=reporter(progress)) or [])


def build_engine(bundle: str | Path, *, progress: Progress = None, **options) -> list[str]:
    """`vlmprune build-engine`: build BUNDLE's engine on this device with its target's builder (options as the
    command's: precision, calibration_cache, decomposed, workspace, output; print_command=True only returns the
    equivalent command line). Returns the lines the command ends with."""
    return target_command("build-engine", progress=progress, bundle_dir=Path(bundle), **options)
