"""The prompt input's feed for the runners: what a graph's `text_embeds` gets (vlmprune.compiler.prompt's seam).

Every target's runner feeds a session through targets.runtime.run_session, which asks text_feed() here for
a prompt-aware graph's rows; a `feeding(...)` block says what they are: PARITY (parity's fixed-seed rows,
parity_text), or the rows `run --prompt`, `generate` and `eval` computed from the checkpoint
(compiler.prompt). It lives in the frontend, beside parity's images (frontend.images), not with the
run-time code that uses it, because parity and the targets' runners read it and imports run down
the data flow; compiler.prompt re-exports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib

import numpy as np

from vlmprune.compiler.contract import TEXT
from vlmprune.compiler.errors import InputError

PARITY_TOKENS = 8  # text rows per image that parity feeds
PARITY = "parity"  # feeding(PARITY): parity_text's rows
_given: contextvars.ContextVar[np.ndarray | str | None] = contextvars.ContextVar("vlmprune_text_embeds", default=None)


def parity_text(pixel_values: np.ndarray, dim: int, tokens: int = PARITY_TOKENS) -> np.ndarray:
    """[B, tokens, dim] float32: each image's rows drawn from a generator seeded by that image's bytes."""
    pixel = np.ascontiguousarray(pixel_values)
    rows = [np.random.default_rng(zlib.crc32(image.tobytes())).standard_normal((tokens, dim)) for image in pixel]
    return np.stack(rows).astype(np.float32) if rows else np.zeros((0, tokens, dim), np.float32)


@contextlib.contextmanager
def feeding(text_embeds: np.ndarray | str | None):
    """Feed these rows ([B, T, D], or [T, D] for every image; PARITY: parity_text's) to text_embeds in the block.

    None: nothing (a bundle without the input); a graph with the input then refuses to run in one line."""
    token = _given.set(text_embeds if text_embeds is None or isinstance(text_embeds, str)
                       else np.asarray(text_embeds, dtype=np.float32))
    try:
        yield
    finally:
        _given.reset(token)


def text_feed(pixel_values: np.ndarray, dim: int) -> np.ndarray:
    """What text_embeds gets for this batch: the rows given by feeding() (PARITY: parity_text's)."""
    given = _given.get()
    batch = len(pixel_values)
    if given is None:
        raise InputError(f"this bundle takes the prompt as its {TEXT} input (a prompt-aware method), and this "
                         "caller gives none (vlmprune run --prompt, generate and eval give it)")
    if isinstance(given, str):
        return parity_text(pixel_values, dim)
    if given.ndim == 2:
        given = np.broadcast_to(given, (batch, *given.shape))
    if given.ndim != 3 or given.shape[0] != batch or given.shape[2] != dim:
        raise InputError(f"{TEXT} must be [{batch}, T, {dim}] for this batch, got {list(given.shape)}")
    return np.array(given, dtype=np.float32)  # a copy: writable, never the caller's array


def empty_prompt(dim: int) -> np.ndarray:
    """No prompt: zero rows [0, dim] (see the module docstring)."""
    return np.zeros((0, dim), np.float32)
