"""A built prompt's rows of the LLM's embedding table, as a prompt-aware bundle's text_embeds gets them.

`generate` and `eval` feed a bundle the non-image token ids of generate's built Prompt (bundle_feed),
and `run --prompt` the same ids (compiler.prompt.prompt_embeds). This part needs nothing of generate,
so it sits below both it and compiler.prompt (which builds prompts with generate and re-exports this):
imports run one way.
"""

from __future__ import annotations

import numpy as np

from vlmprune.compiler.contract import TEXT, Manifest
from vlmprune.compiler.errors import InputError

# How `generate` and `eval --dataset` feed a question (bundle_feed): `eval --dataset` keys a prompt-aware bundle's
# stored answers by it, so change the text when the convention changes.
FEED = "v1: the non-image token ids of generate's built prompt (template + question), rows of the LLM's embedding table"


def text_input_dim(manifest: Manifest) -> int | None:
    """The width of the bundle's text_embeds input, or None for a bundle without one."""
    found = next((i for i in manifest.inputs if i.name == TEXT), None)
    return None if found is None else found.shape[-1]


def rows_for_ids(vlm, ids: list[int], dim: int) -> np.ndarray:
    """[T, D] float32: rows `ids` of vlm's LLM embedding table (generate and eval: the ids of their built Prompt)."""
    table = vlm.model.get_input_embeddings().weight.detach().float()
    if table.shape[1] != dim:
        raise InputError(f"the bundle's {TEXT} are {dim} wide, but the embedding table of {vlm.spec} is "
                         f"{table.shape[1]} wide")
    return table[list(ids)].numpy()


def bundle_feed(manifest: Manifest, vlm, prompt) -> dict[str, np.ndarray]:
    """The feeds a bundle's runner gets for a built generate.Prompt: {text_embeds: its non-image ids' rows}; {} for a
    bundle without the input."""
    dim = text_input_dim(manifest)
    return {} if dim is None else {TEXT: rows_for_ids(vlm, prompt.before + prompt.after, dim)}
