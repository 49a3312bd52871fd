"""`vlmprune run` and `compare`: bundles run here on images, their outputs, timings and pictures."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors, stdout_for_data, to_stderr
from vlmprune.compiler.cli.options import NonEmptyPath


@click.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--image", "image_files", multiple=True, type=click.Path(),
              help="An image file; repeat it to fill a static batch (one image per batch slot).")
@click.option("--video", type=click.Path(), default=None,
              help="A video bundle (compile --video-frames F): a folder of frames or a short video file (imageio), "
                   "sampled evenly to its F frames.")
@click.option("--load-inputs", type=click.Path(path_type=Path), default=None,
              help="Run on the input array of this .npz file instead of --image (as Polygraphy's --load-inputs).")
@click.option("--save-outputs", type=click.Path(path_type=Path), default=None,
              help="Write every output to this .npz file (as Polygraphy's --save-outputs).")
@click.option("--show", type=click.Path(path_type=Path), default=None,
              help="Draw what was kept on the image as the model saw it, into this PNG.")
@click.option("--benchmark", is_flag=True, help="Time the runtime: latency min/p50/p90/p99 and throughput (named emulator time where the "
                   "runtime here emulates the device).")
@click.option("--warmup", type=int, default=None, help="--benchmark: untimed runs first (default 5).")
@click.option("--iterations", type=int, default=None, help="--benchmark: timed runs (default 50).")
@click.option("--json", "as_json", is_flag=True, help="Print the outputs' shapes, kept indices and benchmark as JSON.")
@click.option("--force", is_flag=True, help="Replace an existing --show / --save-outputs file.")
@click.option("--prompt", default=None,
              help="A prompt-aware bundle (text_embeds input, e.g. cdpruner): the prompt, embedded with the "
                   "checkpoint's embedding table (without it: no rows, the method runs unconditioned).")
@click.option("--model", default=None, help="With --prompt: the checkpoint to embed it with (default: the bundle's).")
@click.option("--roi-box", "roi_boxes", multiple=True, metavar="X0,Y0,X1,Y1",
              help="A bundle compiled with --roi boxes: a box whose patches are always kept, in pixels of the "
                   "tower's input (as --show draws it); repeatable, up to the bundle's --roi-max.")
@click.option("--roi-mask", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A bundle compiled with --roi mask: a PNG at the tower input's size; patches with any non-zero "
                   "pixel are always kept.")
@one_line_errors
def run(bundle_dir, image_files, video, load_inputs, save_outputs, show, benchmark, warmup, iterations, as_json,
        force, prompt, model, roi_boxes, roi_mask):
    """Run BUNDLE on IMAGE with its target's runtime here (ONNX Runtime, an emulator, an engine on the device)."""
    with stdout_for_data() as emit:  # a runtime's native chatter (an emulator's libraries) goes to stderr too
        result = api.run(bundle_dir, images=image_files, inputs=load_inputs, benchmark=benchmark, warmup=warmup,
                         iterations=iterations, save_outputs=save_outputs, show=show, force=force, progress=to_stderr,
                         prompt=prompt, model=model, roi_boxes=roi_boxes, roi_mask=roi_mask, video=video)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
            return
    echo_lines(render.run_lines(result))


@click.command()
@click.argument("bundle_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--image", required=True, type=click.Path(), help="The image every bundle runs on.")
@click.option("-o", "--output", required=True, type=NonEmptyPath(path_type=Path), help="The PNG to write.")
@click.option("--columns", type=int, default=None, help="Pictures per row (default: up to 4).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@one_line_errors
def compare(bundle_dirs, image, output, columns, force):
    """Draw what each BUNDLE keeps on the same IMAGE, side by side, named with its method and K."""
    with stdout_for_data():  # as in run: a runtime's native chatter goes to stderr
        result = api.compare(bundle_dirs, image=image, output=output, columns=columns, force=force, progress=to_stderr)
    echo_lines(render.compare_lines(result))
