"""The prompt input of prompt-aware methods: the bundle input `text_embeds` [B, T, D_llm].

A prompt-aware method (cdpruner, dart --text-pivots, a score-based method with --prompt-weight
W > 0: passes.methods.relevance) reads the prompt as the prompt's rows of the LLM's
embedding table, as OpenVINO GenAI's CDPruner stage does: no text tower, nothing
model-specific. The graph takes them as a second input beside the pixels
(passes.prune adds it; the manifest lists it). Who feeds it:

- parity (compile, `vlmprune check`): a fixed-seed text_embeds, PARITY_TOKENS rows per
  image, seeded by the image's own bytes (CRC-32), so that the rows an image gets do not
  depend on how the batch is chunked, and every image of a batch gets its own;
- `vlmprune run --prompt`, `generate` and `eval`: the prompt's token ids looked up in the
  checkpoint's embedding table (prompt_embeds); `eval --dataset` each sample's question, as
  `generate` feeds it (bundle_feed), and keys the stored answers of such a bundle by FEED;
- `vlmprune run` without --prompt: no rows (T = 0), which a prompt-aware method treats as
  "no condition" (cdpruner: relevance 1, the plain DPP over the features' similarity); a
  method that needs rows (dart --text-pivots: Method.min_text_rows) is refused in one line.

Every target's runner takes the prompt as an explicit feed, run(pixels, {text_embeds: rows})
(targets.runtime.run_session), from the caller that knows it: `run`/`generate`/`eval` the rows they
computed (prompt_feeds), parity its fixed-seed rows (compiler.parity.parity_feeds). A graph with the input
that is fed none refuses to run in one line rather than guess a prompt.
"""

from __future__ import annotations


import numpy as np

# re-exported: parity's rows live in the frontend, beside parity's images
from vlmprune.compiler.frontend.prompt_input import PARITY_TOKENS, empty_prompt, parity_text  # noqa: F401
from vlmprune.compiler.generate import build_prompt, require_prompt
# re-exported: generate and eval feed a built prompt's rows with them, below both this module and generate
from vlmprune.compiler.prompt_rows import FEED, bundle_feed, rows_for_ids, text_input_dim  # noqa: F401


def prompt_ids(vlm, prompt: str) -> tuple[list[int], str]:
    """The token ids whose embedding rows are the prompt, and how they were made.

    As OpenVINO GenAI's CDPruner takes them: every non-image token of the LLM's input (the
    chat template's and the question's), i.e. generate's Prompt before + after the image.
    A checkpoint without a tokenizer and with a vocabulary under 256 (tiny test models)
    cannot take generate's UTF-8 convention: there the question's UTF-8 bytes modulo the
    vocabulary are the ids (said so in the run's output).
    """
    require_prompt(prompt)
    vocab = vlm.model.config.text_config.vocab_size
    if vlm.tokenizer is None and vocab < 256:
        return [b % vocab for b in prompt.encode("utf-8")], f"no tokenizer, vocabulary {vocab}: UTF-8 bytes mod {vocab}"
    built = build_prompt(vlm, prompt)
    return built.before + built.after, built.how


def prompt_embeds(vlm, prompt: str | None, dim: int) -> tuple[np.ndarray, str]:
    """[T, D] float32: the prompt's rows of the LLM's embedding table (empty_prompt() without a prompt)."""
    if prompt is None:
        return empty_prompt(dim), "no prompt: text_embeds has no rows"
    ids, how = prompt_ids(vlm, prompt)
    return rows_for_ids(vlm, ids, dim), f"{len(ids)} prompt tokens ({how})"
