"""Errors a user can act on.

Every failure the CLI reports as one line derives from VlmpruneError; anything else
is a bug and keeps its traceback.
"""

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
