"""`vlmprune eval`: pruned against dense on the model's own LLM, or accuracy over a dataset of bundles."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.options as options
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors, progress_printer, stdout_for_data


@click.command("eval")
@click.argument("model")
@click.option("--images", "images_dir", default=None, help="A directory of images (with --prompts).")
@click.option("--video", "videos", multiple=True,
              help="A clip for a video bundle (compile --video-frames F), in place of --images: a folder of frames or "
                   "a video file, sampled evenly to its F frames (repeatable).")
@click.option("--prompts", "prompts_file", default=None, help="A text file, one prompt per line (with --images).")
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt, in place of --prompts (repeatable).")
@click.option("--dataset", type=click.Path(path_type=Path), default=None,
              help="Accuracy instead: JSON Lines of {image or video, question, answers} (a file, or a folder holding "
                   "questions.jsonl); each method x K x layer, dense, random keep and a uniform grid compiled once "
                   "and run as bundles.")
@click.option("--video-frames", type=int, default=None,
              help="--dataset of videos: compile its bundles for clips of F frames.")
@click.option("--limit", type=int, default=None, help="--dataset: the first N samples.")
@click.option("--layer", "-l", "layers", multiple=True,
              help="--dataset: prune after block L (from 1), at the tower's `end` (default), or in steps after "
                   "blocks joined by / (2/4/6: progressive, --schedule); repeat or comma list.")
@click.option("--target", "-t", default=None,
              help="--dataset: the target the bundles are compiled for and run by, with its runner here "
                   "(default: the host runtime, ONNX Runtime).")
@click.option("--ray", default=None, metavar="auto|ADDRESS",
              help="--dataset: spread the cells over a Ray cluster (auto: the running one, else a local one).")
@click.option("--ray-workers", type=int, default=None, help="--ray: at most this many workers (default: its CPUs).")
@click.option("--store", type=click.Path(path_type=Path), default=None,
              help="--dataset: the results store (SQLite; default $VLMPRUNE_CACHE/quality/results.sqlite).")
@click.option("--method", "-m", "methods", multiple=True,
              help="Pruning method(s): repeat the option or give a comma list. Default: cls (without --bundle). "
                   "With --dataset, NAME:OPTION=VALUE adds a method with its options as a row of its own "
                   "(e.g. cls:budget=adaptive).")
@click.option("--keep", "-k", "keeps", multiple=True,
              help="K value(s): repeat the option or give a comma list. Default: 64 (without --bundle).")
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path),
              help="A bundle compiled from MODEL, evaluated as it runs here (repeatable).")
@click.option("--max-new-tokens", type=int, default=None,
              help="Greedy tokens per answer (default 8; 4 with --dataset).")
@click.option("--image-size", type=int, default=None,
              help="Qwen2-VL / Qwen2.5-VL: the static image size (a multiple of 28). Default: the bundle's, else 448 "
                   "(--dataset: its bundles compiled at it).")
@click.option("--grid", default=None,
              help="Models with crops or tiles (LLaVA-NeXT, InternVL3): their grid ROWSxCOLS. Default: the bundle's, "
                   "else the family's (LLaVA-NeXT: the model's largest; InternVL3: one tile).")
@click.option("--reference", is_flag=True,
              help="--bundle rows: answer with MODEL's LLM in transformers, not a --with-llm bundle's own LLM graphs.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON on stdout.")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the report here: .json (as --json prints it) or .html (one self-contained page).")
@click.option("--force", is_flag=True, help="Replace an existing --report file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@options.target_options
@one_line_errors
def eval_command(model, images_dir, videos, prompts_file, prompt_texts, dataset, video_frames, limit, layers, target,
                 ray, ray_workers, store, methods, keeps, bundles, max_new_tokens, image_size, grid, reference, as_json,
                 report, force, quiet, **extra):
    """Pruned against dense on MODEL's own LLM (a VLM whose family declares its language model): per method and K,
    first-token KL and greedy agreement (--images or --video, --prompts or --prompt), or exact-match accuracy on
    bundles (--dataset). MODEL may be a compiled bundle: its model answers, the bundle is a --bundle row."""
    with stdout_for_data() as emit:
        result = api.eval(model, images=images_dir, prompts=prompts_file, methods=methods, keeps=keeps,
                          video=videos, prompt=prompt_texts, video_frames=video_frames,
                          bundles=bundles, max_new_tokens=max_new_tokens, image_size=image_size, grid=grid,
                          report=report, force=force, progress=progress_printer(quiet or as_json), dataset=dataset,
                          limit=limit, layers=layers, target=target, ray=ray, ray_workers=ray_workers, store=store,
                          target_options={k.removeprefix("topt_"): v for k, v in extra.items() if v is not None},
                          bar=False if (quiet or as_json) else None, reference=reference)
        if report:
            click.echo(f"report written to {report}", err=True)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
            return
    echo_lines(render.eval_lines(result))
