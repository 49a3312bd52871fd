"""`--schedule`'s text and its steps: parsed for every method by base.Method.parse, resolved per tower.

The rules (the two spellings, the geometric counts, what is refused) are in passes.methods.schedule's
docstring. This part sits below the method interface (passes.methods.base), which runs parse, and below
progressive.Progressive, which runs the steps, so that imports run one way: schedule, whose wrap builds
the Progressive method, re-exports it.
"""

from __future__ import annotations

import dataclasses

from vlmprune.compiler.contract import SITE_BLOCK as BLOCK
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.selection import BY_SCORE

GENERIC = {
    "schedule": (str, "progressive pruning in steps: the blocks after which each step prunes, 2,4,6 (or 2/4/6; the "
                      "counts geometric from N to --keep), or with counts 2:512,4:320,6:192; the last step keeps "
                      "--keep after the last block (score-based methods at a block site: cls, visionzip)"),
}


@dataclasses.dataclass(frozen=True)
class Step:
    layer: int  # prune after this block (from 1)
    keep: int  # tokens kept by this step


def split(text) -> list[tuple[int, int | None]]:
    """`2,4,6`, `2/4/6`, `2:512,4:320,6` -> [(layer, count or None)]; one line for what does not read."""
    if isinstance(text, (list, tuple)):
        text = ",".join(str(s) for s in text)
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"--schedule is a list of blocks (2,4,6) or of block:count steps (2:512,4:320,6:192), "
                         f"got {text!r}")
    steps = []
    for part in text.replace("/", ",").split(","):
        layer, colon, count = part.strip().partition(":")
        try:
            steps.append((int(layer), int(count) if colon else None))
        except ValueError:
            raise InputError(f"--schedule step {part.strip()!r} is not BLOCK or BLOCK:COUNT (e.g. 2,4,6 or "
                             "2:512,4:320,6:192)") from None
    return steps


def parse(method, params: dict) -> dict:
    """Check --schedule for `method`; params["schedule"] becomes its canonical text (`2,4,6`, `2:512,4:320,6:192`)."""
    text = params.get("schedule")
    if text is None:
        return params
    steps, keep = split(text), params["keep"]
    if len(steps) < 2:
        raise InputError(f"--schedule {text}: one step is --layer {steps[0][0]}; a schedule has two or more")
    layers = [layer for layer, _ in steps]
    if layers[0] < 1 or any(a >= b for a, b in zip(layers, layers[1:])):
        raise InputError(f"--schedule {text}: the blocks must increase from 1 (each step after a later block)")
    counts = [count for _, count in steps]
    if counts[-1] is None and any(c is not None for c in counts[:-1]):
        counts[-1] = keep  # `2:512,4:320,6`: the last step keeps --keep
    if any(c is None for c in counts) and any(c is not None for c in counts):
        raise InputError(f"--schedule {text}: give a count for every step (2:512,4:320,6:192) or for none (2,4,6)")
    if counts[0] is not None:
        if counts[-1] != keep:
            raise InputError(f"--schedule {text}: the last step keeps --keep ({keep}), not {counts[-1]}")
        if any(a <= b for a, b in zip(counts, counts[1:])):
            raise InputError(f"--schedule {text}: the counts must decrease step by step (each step prunes)")
    why = refusal(method, params)
    if why:
        raise InputError(f"method {method.name} cannot take --schedule: {why}")
    params["schedule"] = ",".join(str(layer) if count is None else f"{layer}:{count}"
                                  for layer, count in zip(layers, counts))
    return params


def refusal(method, params: dict) -> str | None:
    """Why `method` with these parameters has no single score to rank at each of several blocks, or None."""
    if method.baseline:
        return "it is a baseline that keeps the same patches for every image (no score to recompute per step)"
    if method.selection != BY_SCORE:
        return "its selection is greedy (each pick depends on the others): no score to rank at each step"
    if method.variable_k or params.get("budget"):
        return "K varies per image (--budget adaptive, prumerge+), and a step's token count must be one constant"
    if getattr(method, "later_blocks", False):
        return ("it runs the blocks after its site on a layout of its own (the clip's kept tokens as one sequence), "
                "which a later step does not prune again")
    if method.needs(params).site != BLOCK:
        return "it prunes the projector output (the tower's end), where no block is left to step through"
    if params.get("merge"):
        return "--merge local's windows need the whole patch grid, which an earlier step has thinned"
    if method.needs(params).pixels:
        return "its pixel term (--lambda) scores the original patch grid, not the tokens an earlier step left"
    if params.get("scorer"):
        return "--scorer int8 runs one fused scorer (not checked over several steps)"
    if "crops" in params:
        return "LLaVA-NeXT's crops share one budget over several grids"
    return None


def layers(params: dict) -> list[int]:
    """The blocks after which the steps prune, the last one the method's layer."""
    return [layer for layer, _ in split(params["schedule"])]


def resolve(params: dict, n: int) -> list[Step]:
    """The steps with their counts for N patch tokens (module docstring: given, or geometric from N to K)."""
    steps, keep = split(params["schedule"]), params["keep"]
    total = len(steps)
    if n - keep < total:
        raise InputError(f"--schedule of {total} steps needs at least {total} tokens to drop, and K = {keep} of "
                         f"N = {n} leaves {n - keep}")
    if steps[0][1] is not None:
        counts = [count for _, count in steps]
        if counts[0] >= n:
            raise InputError(f"--schedule: the first step keeps {counts[0]}, and the tower has {n} patch tokens")
    else:
        counts = [round(n * (keep / n) ** (s / total)) for s in range(1, total + 1)]
        counts[-1] = keep
        for s in range(total - 2, -1, -1):  # strictly decreasing, above K ...
            counts[s] = max(counts[s], counts[s + 1] + 1)
        for s in range(total):  # ... and below N
            counts[s] = min(counts[s], n - 1 - s)
    return [Step(layer, count) for (layer, _), count in zip(steps, counts)]
