"""`vlmprune generate`: a bundle's image tokens answered by its LLM, the bundle's own graphs or the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vlmprune.compiler import api
from vlmprune.compiler.cli.boundary import one_line_errors, progress_printer, stdout_for_data


@click.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--model", default=None,
              help="The checkpoint whose LLM answers (a VLM directory of a family that declares its language "
                   "model, or `demo`). Default: the bundle's own source.")
@click.option("--image", default=None, help="The image file.")
@click.option("--video", default=None, help="A video bundle (compile --video-frames F): a folder of frames or a short "
                                             "video file, sampled evenly to its F frames (in place of --image).")
@click.option("--prompt", required=True, help="The question; the checkpoint's chat template wraps it.")
@click.option("--dense", is_flag=True, help="Feed the model's own (unpruned) image features instead of the bundle's.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Greedy tokens to generate.")
@click.option("--reference", is_flag=True,
              help="Answer with the checkpoint's LLM in transformers, not the bundle's own exported LLM graphs "
                   "(which a --with-llm bundle runs by default).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer and what was fed to the LLM as JSON.")
@one_line_errors
def generate(bundle_dir, model, image, video, prompt, dense, max_new_tokens, reference, as_json):
    """Run BUNDLE on IMAGE (a video bundle on --video) and let its LLM answer PROMPT (greedy, on the CPU): a
    --with-llm bundle's own LLM graphs where they run here, else (or with --reference) the checkpoint's LLM in
    transformers."""
    with stdout_for_data() as emit:
        result = api.generate(bundle_dir, image=image, prompt=prompt, model=model, dense=dense,
                              max_new_tokens=max_new_tokens, progress=progress_printer(as_json), reference=reference,
                              video=video)
        if result.fastv_warning:  # on stderr with --json too: the graph the bundle ships would drop the wrong tokens
            click.echo(f"warning: {result.fastv_warning}", err=True)
        a = result.answer
        if as_json:
            emit(json.dumps(api.generate_json(result)))
            return
    click.echo(f"({result.path}: {a.image_tokens} image tokens, {result.runtime}; language model: {result.llm})",
               err=True)
    if a.text is None:
        click.echo("(no tokenizer in the checkpoint: the answer's token ids)", err=True)
        click.echo(" ".join(map(str, a.tokens)))
    else:
        click.echo(a.text)
