"""How every `vlmprune` command ends and where it writes: the CLI's one error boundary, and stdout kept for data.

Each command module wraps its callback in one_line_errors and does its work inside stdout_for_data, so that a
user error is one line and exit code 2 in every command, and a native library's chatter never mixes with the
--json data. The console script (compiler/__main__.py) sets on_command_end here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.errors import VlmpruneError


def one_line_errors(fn):
    """The CLI's one error boundary: a user error is one line on stderr and exit code 2, never a traceback.

    Anything else is a bug in vlmprune: it is reported in one line too, with exit
    code 3 (not 1, parity failed: a CI gate must tell a crash from a failing figure)
    and how to see the traceback (VLMPRUNE_DEBUG=1 re-raises it).
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        complete: list[str] = []  # the outputs written whole so far, for a true interrupt line
        try:  # outermost, so a Ctrl-C anywhere before on_command_end has taken effect is this line, not click's
            return _ended_one_way(fn, complete, args, kwargs)
        except KeyboardInterrupt:
            on_command_end()
            click.echo(api.interrupted_line(complete), err=True)
            sys.exit(130)
    return wrapper


def _ended_one_way(fn, complete: list[str], args, kwargs):
    """Runs the command; every way it ends calls on_command_end before saying how (an interrupt after
    that has nothing left to stop)."""
    try:
        with api.tracking(complete):
            result = fn(*args, **kwargs)
    except VlmpruneError as exc:
        on_command_end()
        click.echo(f"error: {exc.cli_text()}", err=True)  # options as flags (compiler.errors.option)
        sys.exit(2)
    except BrokenPipeError:  # `vlmprune inspect B | head`: the reader left; not an error of ours
        on_command_end()
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # as a shell reports a process ended by SIGPIPE
    except (SystemExit, click.exceptions.Exit, click.ClickException):
        on_command_end()
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        on_command_end()
        if os.environ.get("VLMPRUNE_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        click.echo(f"error: internal error ({type(exc).__name__}: {first}); this is a vlmprune bug: "
                   "rerun with VLMPRUNE_DEBUG=1 for the traceback and report it", err=True)
        sys.exit(3)
    on_command_end()
    return result


# Called as a command's boundary is left, however it ended. The console script (compiler/__main__.py)
# ignores Ctrl-C from then on, the command having said how it ended; in-process callers keep their own.
on_command_end = lambda: None  # noqa: E731


@contextlib.contextmanager
def stdout_for_data():
    """While a command works, everything but its data goes to stderr: file descriptor 1 is pointed at stderr
    (native libraries, e.g. QNN's `# LIBNATIVE:` line) and so is sys.stdout (stray prints), with or
    without --json. Yields the writer for the --json data, the one thing that reaches the real stdout
    inside the block; the human summary is printed after it."""
    original = sys.stdout
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all (`>&-`): nothing to keep clean
        yield click.echo
        return
    original.flush()
    try:
        real = original.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a captured stream (click's test runner)
        real = False
    os.dup2(2, 1)
    data = os.fdopen(os.dup(saved), "w") if real else original
    sys.stdout = sys.stderr
    try:
        yield lambda text: (data.write(text + "\n"), data.flush())
    finally:
        sys.stderr.flush()
        with contextlib.suppress(OSError, AttributeError):  # C stdio's buffer (a library's printf) goes too
            ctypes.CDLL(None).fflush(None)
        sys.stdout = original
        os.dup2(saved, 1)
        os.close(saved)
        if real:
            data.close()


def progress_printer(quiet: bool):
    """The progress callback a command hands the API: what it sends, as lines on stderr (a parity stage's record as
    render.progress_line writes it), none with -q (or --json)."""
    return (lambda _m: None) if quiet else (lambda m: click.echo(render.progress_line(m), err=True))


def echo_lines(lines) -> None:
    """A result's lines (render.py's) on stdout."""
    for line in lines:
        click.echo(line)


def to_stderr(line: str) -> None:
    click.echo(line, err=True)
