"""Errors a user can act on.

Every failure the CLI reports as one line derives from VlmpruneError; anything else
is a bug and keeps its traceback.
"""

import re
import traceback

from onnx_ir.passes import PreconditionError


class VlmpruneError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class InputError(VlmpruneError):
    """Bad arguments or a model the compiler cannot handle."""


class StructureError(PreconditionError, VlmpruneError):
    """The graph lacks a structure a pass needs (says what it looked for).

    It is also an onnx_ir PreconditionError, so a pass's requires() can raise it
    and the pass framework lets it through unwrapped.
    """


class ToolchainError(VlmpruneError):
    """An optional SDK or build tool is missing or failed."""


class ParityError(VlmpruneError):
    """A parity stage could not be run at all (failing figures are data, not errors)."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")


def failure_cause(failure: BaseException | str) -> str:
    """The one line that says why a tool failed: an exception (with its chain) or a tool's output.

    Exporters wrap the real error in a preamble ("Failed to export the model with
    torch.export. This is step 1/3 ... Next steps:"): the cause is the innermost exception
    of the last traceback chain, as Python prints it ("ValueError: ..."). Output without a
    traceback gives its last error-looking line, else its last line.
    """
    if isinstance(failure, BaseException):
        failure = "".join(traceback.format_exception(failure))
    lines = [_ANSI.sub("", line).rstrip() for line in failure.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        k = len(starts) - 1
        while k > 0 and next((x.strip() for x in reversed(lines[:starts[k]]) if x.strip()), "") in _CHAINED:
            k -= 1  # the exception this one was raised from (or while handling)
        found = next((x for x in lines[starts[k] + 1:] if x and not x[0].isspace()), "")
        if found:
            return found.strip()[:300]
    texts = [line.strip() for line in lines if line.strip()]
    errors = [line for line in texts if re.match(r"[\w.]*(Error|Exception)\b|(?i:error)\b", line)]
    return (errors or texts or ["no output"])[-1][:300]
