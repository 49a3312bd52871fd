"""The checks of a method option's value: one line naming the option and the method.

Every method's parse checks its own options with them, and so do the generic options' own modules
(passes.methods.budget_options: --alpha, --kmin); they sit below the method interface
(passes.methods.base, which re-exports them) so that those modules, which base.Method.parse runs, need
nothing of base.
"""

from __future__ import annotations

import math

from vlmprune.compiler.errors import InputError


def positive_int(method: str, name: str, value, minimum: int = 1) -> int:
    """An integer method option, at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"--{name} of method {method} must be an integer >= {minimum}, got {value!r}")
    return value


def finite_option(method: str, name: str, value, minimum: float | None = None, maximum: float | None = None) -> float:
    """A float method option: finite and inside [minimum, maximum], else one line naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"--{name} of method {method} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"--{name} of method {method} must be >= {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise InputError(f"--{name} of method {method} must be <= {maximum:g}, got {value:g}")
    return float(value)
