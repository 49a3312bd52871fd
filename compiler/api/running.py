"""`vlmprune run` as a call: a bundle run with its target's runtime here, its outputs as numpy arrays.

Also what `compare` shares with it: the prompt input of a prompt-aware bundle (run_text), the images loaded by the
bundle's family (load_images) and its static batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from vlmprune.compiler import benchmark as bench
from vlmprune.compiler import pictures, roi
from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.bundle.output_files import check_output_file, write_file
from vlmprune.compiler.contract import KEPT, TEXT
from vlmprune.compiler.errors import InputError, option
from vlmprune.compiler.frontend import family_of
from vlmprune.compiler.frontend.images import require_image_files
from vlmprune.compiler.prompt import empty_prompt, prompt_embeds
from vlmprune.passes.methods import METHODS
from vlmprune.targets import get_target


SMALL_OUTPUT = 8  # an integer output of at most this many elements (a count per image) is printed with its values


def is_small(value: np.ndarray) -> bool:
    """A small integer output (e.g. the tokens each image kept): --json gives its values, and `run` prints them."""
    return value.size <= SMALL_OUTPUT and bool(np.issubdtype(value.dtype, np.integer))


@dataclasses.dataclass
class RunResult:
    """One run of a bundle here: its outputs as numpy arrays, the kept indices, and the benchmark's figures."""

    bundle: Path
    runtime: str  # what ran it, e.g. "onnxruntime 1.22.0 CPUExecutionProvider"
    inputs: np.ndarray  # the pixel values the bundle ran on (the family's preprocessing of the images)
    outputs: dict[str, np.ndarray]
    benchmark: dict | None = None  # latency_ms {min, mean, p50, p90, p99, max}, throughput_images_per_s, ...
    saved_outputs: Path | None = None
    show: Path | None = None

    @property
    def kept(self) -> np.ndarray | None:
        """The kept patch indices, (batch, K) int64; None for a bundle without them (dense)."""
        return self.outputs.get(KEPT)

    def to_json(self) -> dict:
        """`vlmprune run --json`'s summary."""
        data = {"bundle": str(self.bundle), "runtime": self.runtime, "batch": int(self.inputs.shape[0]),
                "outputs": {name: {"shape": list(v.shape), "dtype": str(v.dtype),
                                   **({"value": v.tolist()} if is_small(v) else {})}
                            for name, v in self.outputs.items()}}
        if self.kept is not None:
            data[KEPT] = self.kept.tolist()
        if self.benchmark is not None:
            data["benchmark"] = self.benchmark
        if self.saved_outputs:
            data["saved_outputs"] = str(self.saved_outputs)
        if self.show:
            data["show"] = str(self.show)
        return data


def run(bundle: str | Path, *, images: Iterable[str | Path] = (), inputs: str | Path | np.ndarray | None = None,
        benchmark: bool = False, warmup: int | None = None, iterations: int | None = None,
        save_outputs: str | Path | None = None, show: str | Path | None = None, force: bool = False,
        progress: Progress = None, prompt: str | None = None, model: str | None = None, roi_boxes: Iterable[str] = (),
        roi_mask: str | Path | None = None, video: str | Path | None = None) -> RunResult:
    """Run BUNDLE with its target's runtime here (`vlmprune run`) on images, a video or inputs, one of them.

    images: image files, preprocessed as the bundle's model does (one per static batch slot);
    inputs: the pixel values as a float32 array, or an .npz file holding one (--load-inputs).
    benchmark: also time the runtime (warmup 5, iterations 50 by default). save_outputs: write
    every output to this .npz; show: draw what was kept into this PNG. Returns a RunResult.
    prompt: for a bundle with the text_embeds input (a prompt-aware method), the prompt whose rows
    of the embedding table of `model` (default: the bundle's own checkpoint) it gets; without
    one it gets no rows (compiler.prompt: the method then runs unconditioned).
    roi_boxes ("x0,y0,x1,y1" each, pixels of the tower's input) or roi_mask (a PNG at the tower input's size): the
    region of interest of a bundle compiled with --roi, the same for every image (compiler.roi); without: none.
    Raises InputError for bad input, a modified bundle, or a runtime this machine lacks.
    """
    say = reporter(progress)
    if prompt is not None:
        from vlmprune.compiler.generate import require_prompt

        require_prompt(prompt)  # before the images are read and the checkpoint loaded
    images = require_image_files(images, option("--image", "images"))
    roi_boxes = list(roi_boxes)
    if bool(images) + (inputs is not None) + (video is not None) != 1:
        raise InputError(f"give the input either as {option('--image', 'images')} (one or more), as "
                         f"{option('--video PATH', 'video')} or as {option('--load-inputs FILE.npz', 'inputs')}")
    if not benchmark and (warmup is not None or iterations is not None):
        raise InputError(f"{option('--warmup')} and {option('--iterations')} only apply with "
                         f"{option('--benchmark', 'benchmark=True')}")
    warmup, iterations = 5 if warmup is None else warmup, 50 if iterations is None else iterations
    bench.check_counts(warmup, iterations)
    if show:
        pictures.require_pillow()
        check_output_file(show, force, (".png",), option("--show"))
    if save_outputs:
        check_output_file(save_outputs, force, (".npz",), option("--save-outputs"))
    if show and save_outputs and Path(show).resolve() == Path(save_outputs).resolve():
        raise InputError(f"{option('--show')} and {option('--save-outputs')} name the same file")
    bundle = Path(bundle)
    m = Manifest.load(bundle, verify=True)
    if show and not m.method.pruned:
        raise InputError(f"{option('--show')} needs a pruned bundle: this one keeps every patch (compiled with "
                         f"{option('--no-prune', 'prune=False')})")
    family = family_of(m)
    if show and family.cannot_draw(m):
        raise InputError(f"{option('--show')} draws one patch grid per image; {family.cannot_draw(m)} cannot be drawn yet")
    # The runtime first: on a machine without it (TensorRT off the Jetson) that is the one line to say.
    runner, runtime = get_target(m.target.name).runner(bundle, m)
    if images:  # the family's input loader (an anyres bundle: one image is the input's crops)
        pixel = load_images(m, images, say, static_batch(m))
    elif video is not None:  # a video bundle: one clip's frames
        pixel, notes = family.load_video(m, video)
        for note in notes:
            say(note)
    elif isinstance(inputs, np.ndarray):
        pixel = bench.check_inputs(inputs, m.inputs[0], "inputs")
    else:
        pixel = bench.load_inputs(inputs, m.inputs[0])
        say(f"{inputs}: {m.inputs[0].name} {list(pixel.shape)} float32")
    text = run_text(m, prompt, model, say)
    region = roi.run_roi(m.method.roi, roi_boxes, roi_mask)  # --roi bundles: the flags' region, or none
    # the runner's feeds beside the pixels: the prompt's rows (a prompt-aware bundle), the flags' region (--roi)
    feeds = {**({} if text is None else {TEXT: text}), **(region or {})}
    outputs = runner(pixel, feeds)
    result = RunResult(bundle, runtime, pixel, outputs)
    if benchmark:
        result.benchmark = bench.benchmark(lambda x: runner(x, feeds), pixel, warmup, iterations,
                                           get_target(m.target.name).emulated_time)
    if save_outputs:
        write_file(save_outputs, bench.npz_bytes(outputs), force)
        result.saved_outputs = Path(save_outputs)
    if show:
        if KEPT not in outputs:
            raise InputError(f"{option('--show')} needs the bundle's kept_indices output, and this bundle has none")
        if family.takes_video(m):
            sels, note = pictures.video_selections(m, pixel, outputs[KEPT], bundle.resolve().name), None
        else:
            sels, note = pictures.selections_for_run(m, pixel, outputs[KEPT], bundle.resolve().name,
                                                     roi.forced_for_run(m.method.roi, region, len(pixel)))
        if note:
            say(f"warning: {note}")
        drawn = [pictures.picture(sel) for sel in sels]
        write_file(show, pictures.png_bytes(drawn[0] if len(drawn) == 1 else pictures.grid_of(drawn)), force)
        result.show = Path(show)
    return result


def run_text(m: Manifest, prompt: str | None, model: str | None, say) -> np.ndarray | None:
    """text_embeds for `run`: the prompt's embedding rows, or none (compiler.prompt); None for other bundles."""
    text_input = next((i for i in m.inputs if i.name == TEXT), None)
    if text_input is None:
        if prompt is not None or model is not None:
            raise InputError(f"{option('--prompt')} and {option('--model')} apply to bundles with a {TEXT} input "
                             f"(prompt-aware methods such as cdpruner); this one ({m.method.name}) has none")
        return None
    dim = text_input.shape[-1]
    fewest = METHODS[m.method.name]().min_text_rows(m.method.params)
    if prompt is None:
        if model is not None:
            raise InputError(f"{option('--model')} applies with {option('--prompt')} (the checkpoint whose embedding "
                             "table embeds it)")
        if fewest:
            raise InputError(f"this {m.method.name} bundle needs a prompt of at least {fewest} tokens: give "
                             f"{option('--prompt')}")
        say(f"{TEXT}: no --prompt, no rows: {m.method.name} runs unconditioned")
        return empty_prompt(dim)
    from vlmprune.compiler.generate import default_model, load_vlm

    vlm = load_vlm(model or default_model(m), bundle=m)
    rows, how = prompt_embeds(vlm, prompt, dim)
    if len(rows) < fewest:
        raise InputError(f"this {m.method.name} bundle needs a prompt of at least {fewest} tokens; {option('--prompt')} gives "
                         f"{len(rows)}")
    say(f"{TEXT}: {how}, {list(rows.shape)} from {vlm.spec}'s embedding table")
    return rows


def static_batch(m: Manifest):
    """The bundle's static batch (an int: one image per slot), else its input's batch dimension (a name: dynamic)."""
    return m.target.get("batch") or m.inputs[0].shape[0]


def load_images(m: Manifest, image_files, say: Callable[[str], None], static=None) -> np.ndarray:
    """The images preprocessed as the bundle's model does, by its family, saying how (and warning of heavy
    upscaling)."""
    pixel, notes = family_of(m).load_images(m, image_files, static)
    for note in notes:
        say(note)
    return pixel
