"""`--budget adaptive` and its constants (--alpha, --beta, --gamma, --kmin): parsed, or refused in one line.

The rule and its wrapper method (AdaptiveBudget) are passes.methods.budget's; this part sits below the
method interface (passes.methods.base), which runs it, so that imports run one way: base imports it, and
budget, which builds on base, re-exports it.
"""

from __future__ import annotations

from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.options import finite_option, positive_int
from vlmprune.passes.methods.selection import BY_SCORE

ADAPTIVE, FIXED = "adaptive", "fixed"
DEFAULTS = {"alpha": 1.0, "beta": 0.5, "gamma": -0.6, "kmin": 1}
OPTIONS = ("alpha", "beta", "gamma", "kmin")


def parse(method, params: dict) -> dict:
    """Check --budget and its constants for `method`; params gains the constants when adaptive."""
    budget = params.get("budget")
    if budget in (None, FIXED):
        given = [f"--{o}" for o in OPTIONS if params.get(o) is not None]
        if given:
            raise InputError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} --budget adaptive; "
                             "give --budget adaptive with it")
        params.pop("budget", None)  # fixed: the default, as without the flag
        return params
    if budget != ADAPTIVE:
        raise InputError(f"--budget must be fixed or adaptive, got {budget!r}")
    why = refusal(method, params)
    if why:
        raise InputError(f"method {method.name} does not take --budget adaptive: {why}")
    for name in ("alpha", "beta", "gamma"):
        params[name] = finite_option(method.name, name, DEFAULTS[name] if params.get(name) is None else params[name])
    params["kmin"] = positive_int(method.name, "kmin", DEFAULTS["kmin"] if params.get("kmin") is None
                                  else params["kmin"])
    if params["kmin"] > params["keep"]:
        raise InputError(f"--kmin ({params['kmin']}) must be <= --keep ({params['keep']}), the largest K")
    return params


def refusal(method, params: dict) -> str:
    """Why `method` with `params` has no single ranked score to cut per image, or ""."""
    if method.variable_k:
        return "it sets its own K per image"
    if method.selection != BY_SCORE or method.baseline:
        return "it ranks no score (a greedy or constant selection)"
    if params.get("merge") or "crops" in params or params.get("scorer"):
        return "--merge local, --scorer int8 and anyres crops keep a fixed K"
    return ""
