"""Errors a user can act on.

Every failure the CLI reports as one line derives from VlmpruneError; anything else
is a bug and keeps its traceback.
"""

import re
import traceback

from onnx_ir.passes import PreconditionError


# An option named in a message: its command-line spelling and its Python API spelling, between markers that
# no message holds, so that one message serves both surfaces (option() writes it, rendered() reads it).
_OPEN, _SEP, _CLOSE = "\x02", "\x1f", "\x03"
_OPTION = re.compile(f"{_OPEN}([^{_SEP}]*){_SEP}([^{_CLOSE}]*){_CLOSE}")
CLI, API = "cli", "api"


def option(flag: str, keyword: str | None = None) -> str:
    """`flag` as the CLI spells it (`--force`), `keyword` as a caller of compiler.api spells it (`force=True`;
    default: the flag's name as a keyword, `--save-outputs` -> `save_outputs`), for a message's text.

    An error raised by the library cannot know whether the CLI or a script called it: it names the option
    through this, and each surface renders its own spelling (str(error) the API's, the CLI boundary
    VlmpruneError.cli_text()).
    """
    keyword = keyword or flag.lstrip("-").replace("-", "_")
    return f"{_OPEN}{flag}{_SEP}{keyword}{_CLOSE}"


def rendered(text: str, surface: str = API) -> str:
    """text with every option() in it spelled for surface (CLI or API)."""
    return _OPTION.sub(lambda m: m.group(1 if surface == CLI else 2), text)


FORCE = option("--force", "force=True")  # "use {FORCE} to replace it"


class VlmpruneError(Exception):
    """A problem with the user's input or environment, reported as one line.

    Its message may name options through option(): str() spells them as API keywords (`force=True`),
    cli_text() as command-line flags (`--force`).
    """

    def __str__(self) -> str:
        return rendered(super().__str__(), API)

    def cli_text(self) -> str:
        return rendered(super().__str__(), CLI)


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
