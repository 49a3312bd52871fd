"""The `vlmprune` console script (and `python -m vlmprune.compiler`): the CLI inside an interrupt boundary.

Importing the CLI imports torch, ONNX and every method and target (its options are built
from their tables), seconds before any command's own error boundary is entered; a Ctrl-C
then is one line and exit code 130, as it is later, not a traceback of the import.
"""

import signal
import sys


def _ignore_interrupts() -> None:
    """Once the command has ended and said how: what is left (click's exit, the interpreter's shutdown,
    seconds with torch loaded) has nothing to stop, and a Ctrl-C there would end the process with 130
    (silently, once the shutdown restores SIGINT's default) as if the command had not finished."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main() -> None:
    try:
        from vlmprune.compiler import cli
        from vlmprune.compiler.cli import boundary
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; nothing was written\n")  # bundle.interrupted_line([]), unimported
        sys.exit(130)
    boundary.on_command_end = _ignore_interrupts
    try:
        cli.main()
    finally:  # also where click itself ended it (--help, a usage error)
        _ignore_interrupts()


if __name__ == "__main__":
    main()
