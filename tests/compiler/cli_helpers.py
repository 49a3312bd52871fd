"""What the CLI tests share: invoking `vlmprune` in-process, and the one-line-error promise.

The promise (README): bad input is exactly one `error:` line, exit code 2, no traceback.
"""

from __future__ import annotations

from click.testing import CliRunner

from vlmprune.compiler.cli import main


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, needle: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output
