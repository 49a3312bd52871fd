"""`vlmprune generate` as a call: a bundle's kept tokens answered by its language model (compiler.generate)."""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.contract import KEPT


def generate(bundle: str | Path, *, image: str | Path | None = None, prompt: str, model: str | None = None,
             dense: bool = False, max_new_tokens: int = 32, progress: Progress = None, reference: bool = False,
             video: str | Path | None = None):
    """Run BUNDLE on image (or a video bundle on a clip, video) and let its language model answer prompt, greedily
    (`vlmprune generate`).

    A bundle compiled --with-llm answers with its own exported LLM graphs where they can run here;
    reference: with the checkpoint's language model in transformers instead (as bundles without an LLM do).
    model: the checkpoint (default: the bundle's source); dense: feed the model's own image features instead.
    Returns compiler.generate.GenerateResult (answer.text, answer.tokens, kept, runtime, llm: which language
    model answered, fastv_warning). Raises InputError for bad input.
    """
    from vlmprune.compiler.generate import generate as generate_answer

    return generate_answer(Path(bundle), model, None if image is None else Path(image), prompt, dense, max_new_tokens,
                           reporter(progress), reference, None if video is None else Path(video))


def generate_json(result) -> dict:
    """`vlmprune generate --json`: the answer and what was fed to the LLM (a GenerateResult as data)."""
    a = result.answer
    return {"path": result.path, "runtime": result.runtime, "llm": result.llm, "fastv_kept": result.fastv_kept,
            "prompt": result.prompt.text,
            "image_start": result.image_start, "image_tokens": a.image_tokens, KEPT: result.kept,
            "position_ids": a.position_ids, "tokens": a.tokens, "text": a.text}
