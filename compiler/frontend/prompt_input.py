"""Parity's prompt input: the fixed-seed rows a prompt-aware graph's `text_embeds` gets in parity.

Every target's runner takes the inputs beside the pixels as explicit feeds (targets.runtime.run_session);
the caller that knows them builds them: parity its fixed-seed rows here (parity_text, parity_text_feed), `run
--prompt`, `generate` and `eval` the prompt's rows (compiler.prompt). It lives in the frontend, beside parity's
images (frontend.images), because parity's reference and the pipeline read it and imports run down the data
flow; compiler.prompt re-exports it.
"""

from __future__ import annotations

import zlib

import numpy as np

from vlmprune.compiler.contract import TEXT

PARITY_TOKENS = 8  # text rows per image that parity feeds


def parity_text(pixel_values: np.ndarray, dim: int, tokens: int = PARITY_TOKENS) -> np.ndarray:
    """[B, tokens, dim] float32: each image's rows drawn from a generator seeded by that image's bytes."""
    pixel = np.ascontiguousarray(pixel_values)
    rows = [np.random.default_rng(zlib.crc32(image.tobytes())).standard_normal((tokens, dim)) for image in pixel]
    return np.stack(rows).astype(np.float32) if rows else np.zeros((0, tokens, dim), np.float32)


def parity_text_feed(pixel_values: np.ndarray, inputs) -> dict[str, np.ndarray]:
    """{text_embeds: parity_text's rows} where inputs (a graph's or a manifest's: name and shape) have the input,
    as wide as it; {} where they have none."""
    found = next((i for i in inputs if i.name == TEXT), None)
    return {} if found is None else {TEXT: parity_text(pixel_values, list(found.shape)[-1])}


def empty_prompt(dim: int) -> np.ndarray:
    """No prompt: zero rows [0, dim] (see compiler.prompt's docstring)."""
    return np.zeros((0, dim), np.float32)
