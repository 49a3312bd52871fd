"""vlmprune's Python API: each `vlmprune` command as one call that returns a typed result.

A CI script or a notebook calls these instead of shelling out, and the CLI (compiler/cli.py)
is a thin layer over them: it parses options, calls one function here and prints the
result (its `lines()`, or its `to_json()` for --json). Options are keyword-only with the
CLI's defaults. Bad input raises vlmprune.compiler.errors.InputError (a VlmpruneError) with
the message the CLI prints after `error:`, the options in it named as this API's keywords
(`force=True` where the CLI says `--force`: compiler.errors.option); a failing parity figure is data (`passed`), not
an exception. `progress`, where taken, receives the lines the CLI prints on stderr while a
command works (progress, notes and warnings); None drops them.

    from vlmprune.compiler import api
    bundle = api.compile("demo", "build/demo", keep=64)
    report = api.check(bundle.bundle)
    result = api.run(bundle.bundle, images=["photo.jpg"], benchmark=True)
    print(report.passed, result.kept[0][:8], result.benchmark["latency_ms"]["p50"])

(README.md's example; tests/compiler/test_api.py runs it.) The CLI's own error boundary
(`tracking`, `interrupted_line`) is re-exported here so that the CLI needs nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from vlmprune.compiler import benchmark as bench
from vlmprune.compiler import pictures, roi
from vlmprune.compiler.bundle import interrupted_line, tracking  # noqa: F401 (the CLI's error boundary)
from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET, KEPT, PROBE_KEEP
from vlmprune.compiler.errors import InputError, VlmpruneError, option
from vlmprune.compiler import frontend
from vlmprune.compiler.frontend import family_of, family_option_names
from vlmprune.compiler.frontend.images import require_image_files
from vlmprune.compiler.bundle.manifest import Manifest, MethodSection
from vlmprune.compiler.bundle.output_files import check_output_file, write_file
from vlmprune.compiler.parity import DEFAULT_TOLERANCES, ParityReport, compared_text, figure_text, parse_overrides, summary_bounds
from vlmprune.compiler import pipeline
from vlmprune.compiler.contract import TEXT
from vlmprune.compiler.prompt import empty_prompt, prompt_embeds
from vlmprune.compiler.pipeline import CompileOptions, check_bundle, compile_model
from vlmprune.passes.methods.base import GENERIC_OPTIONS
from vlmprune.passes.methods import DEFAULT_METHOD, METHODS, NEEDS_TRAINED_WEIGHTS
from vlmprune.targets import DEFAULT_TARGET, HOST_TARGET, PLANNED, TARGETS, get_target, require_engine
from vlmprune.targets import placement

Progress = Callable[[str], None] | None
EVAL_KEEP = 64  # eval's K where neither --keep nor --bundle gives one

__all__ = ["CompileResult", "InspectResult", "Manifest", "ParityReport", "RunResult", "EvalResult", "CompareResult",
           "MethodInfo", "TargetListing", "compile", "check", "run", "inspect", "eval", "compare", "generate",
           "generate_json", "methods", "targets", "DEFAULT_METHOD", "DEFAULT_TARGET"]


def _say(progress: Progress) -> Callable[[str], None]:
    return progress or (lambda _m: None)


# ---------------------------------------------------------------------- options the tables declare


def declared_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a method or target declares -> (type, its help texts): the CLI's --lambda, --precision, ..."""
    declared: dict[str, tuple[type, list[str]]] = {name: (kind, [text])
                                                   for name, (kind, text) in GENERIC_OPTIONS.items()}
    for cls in METHODS.values():
        for name, (kind, text) in cls.options.items():
            declared.setdefault(name, (kind, []))[1].append(text)
    for name, (kind, texts) in declared_target_options().items():
        declared.setdefault(name, (kind, []))[1].extend(texts)
    return declared


def declared_target_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a target declares -> (type, its help texts): eval --dataset's --precision, --calibration, ..."""
    declared: dict[str, tuple[type, list[str]]] = {}
    for cls in TARGETS.values():
        for name, text in cls.options.items():
            declared.setdefault(name, (str, []))[1].append(text)
    return declared


def declared_family_options() -> dict[str, tuple[type, list[str]]]:
    """Every option a model family declares -> (type, its help texts): the CLI's --grid, --image-size, ..."""
    return family_option_names()


def split_options(given: dict) -> tuple[dict, dict]:
    """Declared options given (None: not given) -> (method_options, target_options); a target's name wins."""
    given = {k: v for k, v in given.items() if v is not None}
    target_names = {n for cls in TARGETS.values() for n in cls.options}
    method_names = {n for cls in METHODS.values() for n in cls.options} | set(GENERIC_OPTIONS)
    method = {k: v for k, v in given.items() if k in method_names and k not in target_names}
    target = {k: v for k, v in given.items() if k in target_names}
    return method, target


def llm_option_texts() -> dict:
    """--with-llm's help, and --llm-exporter's choices and help, from what each target declares it takes
    (Target.llm_exporters) and what each exporter says of itself: the CLI names no target or exporter."""
    from vlmprune.compiler.llm.export import EXPORTERS

    takes = {name: cls.llm_exporters for name, cls in TARGETS.items() if cls.llm_exporters}
    with_llm = "Also export the language model into llm/ (" + "; ".join(
        f"{name}: {EXPORTERS[ids[0]]().summary}" for name, ids in takes.items()) + ")."
    several = {name: ids for name, ids in takes.items() if len(ids) > 1}
    choices = list(dict.fromkeys(i for ids in several.values() for i in ids))
    helps = []
    for name, ids in several.items():
        told = [f"{i} ({'default; ' if n == 0 else ''}{EXPORTERS[i]().features})" for n, i in enumerate(ids)]
        helps.append(f"{name}, with --with-llm: {' or '.join(told)}")
    return {"with_llm": with_llm, "exporters": choices, "exporter": "; ".join(helps) + "."}


def target_commands() -> list:
    """The click commands the targets contribute (Target.commands, e.g. build-engine), one per name."""
    commands: dict[str, object] = {}
    for cls in TARGETS.values():
        for command in cls().commands():
            commands.setdefault(command.name, command)
    return list(commands.values())


# ---------------------------------------------------------------------- compile


@dataclasses.dataclass
class CompileResult(pipeline.CompileResult):
    """A compiled bundle: where it is, its manifest, the parity report it was checked with, and how long it took
    (the pipeline's result, with what the CLI prints of it)."""

    @property
    def passed(self) -> bool:
        return self.report.passed

    def to_json(self) -> dict:
        """`vlmprune compile --json`'s summary."""
        m = self.manifest
        return {"bundle": str(self.bundle), "target": m.target.name, "method": dict(m.method),
                "outputs": [dict(o) for o in m.outputs], "parity": dict(m.parity), "seconds": round(self.seconds, 2),
                "timings": [s.to_json() for s in self.timings]}

    def lines(self) -> list[str]:
        """The summary `vlmprune compile` prints: tokens in and out, each parity stage's figures, placement."""
        manifest, method = self.manifest, self.manifest.method
        out = []
        counts = manifest.model.get("token_counts")
        if counts:  # a merging tower: its patches are not the tokens the LLM sees
            t, h, w = counts["merged_grid_thw"]
            out.append(f"image {counts['image_size']}x{counts['image_size']}: {counts['patch_grid'][0]}x"
                       f"{counts['patch_grid'][1]} = {counts['patches']} patches, merged "
                       f"{counts['spatial_merge']}x{counts['spatial_merge']} into {h}x{w}"
                       + (f" per temporal patch: a clip of {counts['video_frames']} frames, {t} temporal patches, "
                          f"{counts['tokens']} tokens" if counts.get("video_frames") else f" = {counts['tokens']} tokens"))
        if not method.pruned:
            out.append("tokens: dense (no pruning)")
        elif method.site == "block":
            where = (f"at the tower's end, after block {method.layer}/{method.num_blocks}"
                     if method.layer == method.num_blocks else
                     f"after block {method.layer}/{method.num_blocks}; " + _later(method))
            steps = method.steps
            if steps:  # --schedule: every step
                where = ("progressive, " + ", ".join(f"{s['keep']} after block {s['layer']}" for s in steps)
                         + f" of {method.num_blocks}" + ("" if method.layer == method.num_blocks else
                                                         "; " + _later(method)))
            out.append(f"tokens: {_tokens_in(method, 'patch tokens')} -> {_own_summary(method)} ({where})")
        else:
            out.append(f"tokens: {_tokens_in(method, 'tokens')} -> {_own_summary(method)} "
                       "(on the projector output)")
        out += [_stage_line(name, stage) for name, stage in manifest.parity.stages.items()]
        if manifest.llm_graphs:
            out.append(llm_parity_line(manifest.llm_graphs))
        out += _placement_summary(manifest)
        out.append(f"bundle: {self.bundle} ({self.seconds:.1f}s)")
        return out

    def timing_lines(self) -> list[str]:
        """`compile --timings`: seconds, share and peak RSS per stage of this compile (compiler.pipeline.timings)."""
        from vlmprune.compiler.pipeline.timings import table

        return table(self.timings)


def compile(model: str, output: str | Path = "build", *, target: str = DEFAULT_TARGET,
            method: str = DEFAULT_METHOD, keep: int | str = DEFAULT_KEEP, layer: int | None = None, prune: bool = True,
            batch: int | None = None, opset: int = DEFAULT_OPSET,
            feature_layer: int | None = None, cls: str | None = None, with_llm: bool = False,
            llm_exporter: str | None = None, fastv_layer: int | None = None, fastv_keep: float | None = None,
            image_start: int | None = None, method_options: dict | None = None, target_options: dict | None = None,
            family_options: dict | None = None, cache: bool = True, force: bool = False, debug: bool = False,
            progress: Progress = None, latency_ms: float | None = None) -> CompileResult:
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle at output.

    The keywords are `vlmprune compile`'s options (prune=False is --no-prune; method_options,
    target_options and family_options hold the options the tables declare, e.g. {"lambda": 0.3},
    {"precision": "int8"}, {"grid": "2x2"}); keep="auto" with latency_ms picks the largest K whose latency on
    the target fits that budget (compiler.pipeline.auto_keep). Returns the CompileResult even when a parity stage
    fails (result.passed is False; the CLI exits 1). Raises InputError for bad options or a model
    it cannot compile, ToolchainError where a target's toolchain is missing.
    """
    options = CompileOptions(target=target, method=method, keep=keep, layer=layer, prune=prune, batch=batch,
                             opset=opset, feature_layer=feature_layer, force=force, debug=debug, cls=cls,
                             method_options=dict(method_options or {}), target_options=dict(target_options or {}),
                             family_options={k: v for k, v in (family_options or {}).items() if v is not None},
                             cache=cache, with_llm=with_llm, llm_exporter=llm_exporter, fastv_layer=fastv_layer,
                             fastv_keep=fastv_keep, image_start=image_start, latency_ms=latency_ms)
    if not str(output).strip():  # Path("") is ".": the current directory, which nobody means
        raise InputError("output is empty: name the bundle's directory")
    result = compile_model(model, Path(output), options, _say(progress))
    return CompileResult(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})


def _later(method: MethodSection) -> str:
    n = method.num_blocks - method.layer
    return (f"the {n} later blocks run on {method.tokens_out} tokens" if n > 1 else
            f"the last block runs on {method.tokens_out} tokens")


def _own_summary(method: MethodSection) -> str:
    """The method's own line, without the " (where, N patch tokens)" the pipeline appends to it: the last
    parenthesis only, as the method's line may hold its own ("random keep (baseline): 32 patches ...")."""
    return method.summary.rsplit(" (", 1)[0]


def _tokens_in(method: MethodSection, noun: str) -> str:
    """The tokens the method ranks: N, or an anyres image's C crops of N each (num_patches is per crop)."""
    n, crops = method.num_patches, method.params.get("crops")
    return f"{crops['count'] * n} {noun} ({crops['count']} crops x {n})" if crops else f"{n} {noun}"


def _stage_line(name: str, stage: dict) -> str:
    """One parity stage of the manifest in figures, each held to its precision's defaults (as compile holds it)."""
    figures = []
    default = DEFAULT_TOLERANCES.get(stage.get("precision"))
    bounds = summary_bounds(default) if default else {}
    if "cosine_min" in stage:
        figures.append(f"cosine {figure_text(stage['cosine_min'], 7, **bounds.get('cosine_min', {}))}")
    if "max_abs" in stage:
        bound = stage.get("max_abs_bound")  # the stage's own (scale-relative) bound; absent in older manifests
        held = {"at_most": bound} if bound is not None else bounds.get("max_abs", {})
        figures.append(f"max-abs {figure_text(stage['max_abs'], 3, **held)}"
                       + (f" (≤ {bound:.3g})" if bound is not None else ""))
    if "index_agreement" in stage:
        figures.append(f"kept-index agreement "
                       f"{figure_text(stage['index_agreement'], 4, **bounds.get('index_agreement', {}))}")
        if stage.get("tie_resolved_images"):
            images = ", ".join(map(str, stage["tie_resolved_images"]))
            why = ("it diverges at a greedy step whose two best candidates tie" if "first_divergent_step" in stage
                   else "every differing index lies in the K-th boundary tie band")
            many = len(stage["tie_resolved_images"]) > 1
            why = why.replace("it diverges", "they diverge") if many else why
            figures.append(f"image{'s' if many else ''} {images}: {why}")
    if compared_text(stage):
        figures.append(compared_text(stage))
    status = "PASS" if stage["passed"] else "FAIL"
    return f"parity {name:<10} {status}  {', '.join(figures)}" + (f"  {stage['error']}" if "error" in stage else "")


def llm_parity_line(llm: dict) -> str:
    """The language model's compile-time check, in its exporter's figures (`check` repeats it as stage llm)."""
    from vlmprune.compiler.llm.export import parity_figures

    passed, figures = parity_figures(llm)
    return f"parity {'llm':<10} {'PASS' if passed else 'FAIL'}  {', '.join(figures)}"


def _placement_summary(manifest: Manifest) -> list[str]:
    return [placement.summary_line(name, summary)
            for name, summary in manifest.target.get("placement_summary", {}).items()]


# ---------------------------------------------------------------------- check


def _tolerance_specs(value) -> tuple[str, ...]:
    """A tolerance keyword as check's repeated option: VALUE or OUTPUT:VALUE strings (a number is VALUE)."""
    if value is None:
        return ()
    values = [value] if isinstance(value, (str, int, float)) else list(value)
    return tuple(str(v) for v in values)


def check(bundle: str | Path, *, batch: int | None = None, atol=(), rtol=(), cosine=(), engine: bool = False,
          model: str | None = None, cache: bool = True, report: str | Path | None = None,
          junit: str | Path | None = None, force: bool = False, progress: Progress = None) -> ParityReport:
    """Re-run BUNDLE's parity against a freshly loaded PyTorch reference (`vlmprune check`).

    atol / rtol / cosine: a number for every value output, or "OUTPUT:VALUE" strings (repeatable, as
    the CLI's options). report: also write an .html page or .json data there; junit: a JUnit .xml.
    engine: require the target's device-engine stage. Returns the ParityReport (report.passed, its
    stages, report.to_json() as --json prints it); a failing stage is data, not an exception.
    Raises InputError for bad options, a modified bundle or a moved/changed source.
    """
    atol, rtol, cosine = _tolerance_specs(atol), _tolerance_specs(rtol), _tolerance_specs(cosine)
    if report:
        check_output_file(report, force, (".html", ".htm", ".json"), option("--report"))
        if Path(report).suffix.lower() != ".json":
            pictures.require_pillow()
    if junit:
        check_output_file(junit, force, (".xml",), option("--junit"))
    if report and junit and Path(report).resolve() == Path(junit).resolve():
        raise InputError(f"{option('--report')} and {option('--junit')} name the same file")
    tolerances = None
    if atol or rtol or cosine:
        outputs = Manifest.load(bundle, verify=False).output_names
        tolerances = parse_overrides({"atol": atol, "rtol": rtol, "cosine": cosine},
                                     [o for o in outputs if o != KEPT], [KEPT])
    required = None  # engine: the stage the bundle's target names for its device engine
    if engine:
        required = require_engine(Manifest.load(bundle, verify=False).target.name, bundle)
    started = time.perf_counter()
    result = check_bundle(bundle, batch, _say(progress), tolerances, model, cache=cache)
    seconds = time.perf_counter() - started
    if required and required not in [s.stage for s in result.stages]:
        raise InputError(f"the {required} stage did not run (see the progress lines above)")
    if report or junit:
        from vlmprune.compiler import report as reports

        data = result.to_json()
        manifest = Manifest.load(bundle, verify=False)  # check_bundle verified it
        name = Path(bundle).resolve().name
        if report and Path(report).suffix.lower() == ".json":
            write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
        elif report:
            write_file(report, reports.html_report(result, manifest, name, reports.parity_images(result, manifest))
                       .encode(), force)
        if junit:
            write_file(junit, reports.junit_xml(result, manifest, name, seconds), force)
    return result


# ---------------------------------------------------------------------- run

SMALL_OUTPUT = 8  # an integer output of at most this many elements (a count per image) is printed with its values


def _small_value(value: np.ndarray) -> str:
    """", value [57]" for a small integer output (e.g. the tokens each image kept), else ""."""
    if value.size > SMALL_OUTPUT or not np.issubdtype(value.dtype, np.integer):
        return ""
    return f", value {value.tolist()}"


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
                                   **({"value": v.tolist()} if _small_value(v) else {})}
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

    def lines(self) -> list[str]:
        """What `vlmprune run` prints: the runtime, each output's shape, image 0's kept indices, the figures."""
        out = [f"({self.runtime})"]
        out += [f"{name}: shape {list(value.shape)} dtype {value.dtype}" + _small_value(value)
                for name, value in self.outputs.items()]
        if self.kept is not None:
            out.append("kept (image 0): " + " ".join(map(str, self.kept[0].tolist())))
        if self.benchmark is not None:
            out += bench.format_benchmark(self.benchmark, self.runtime)
        if self.saved_outputs:
            out.append(f"outputs written to {self.saved_outputs}")
        if self.show:
            out.append(f"picture written to {self.show}")
        return out


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
    say = _say(progress)
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
        pixel = _load_images(m, images, say, _static_batch(m))
    elif video is not None:  # a video bundle: one clip's frames
        pixel, notes = family.load_video(m, video)
        for note in notes:
            say(note)
    elif isinstance(inputs, np.ndarray):
        pixel = bench.check_inputs(inputs, m, "inputs")
    else:
        pixel = bench.load_inputs(inputs, m)
        say(f"{inputs}: {m.inputs[0].name} {list(pixel.shape)} float32")
    text = _run_text(m, prompt, model, say)
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


def _run_text(m: Manifest, prompt: str | None, model: str | None, say) -> np.ndarray | None:
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


def _static_batch(m: Manifest):
    return m.target.get("batch") or m.inputs[0].shape[0]


def _load_images(m: Manifest, image_files, say: Callable[[str], None], static=None) -> np.ndarray:
    """The images preprocessed as the bundle's model does, by its family, saying how (and warning of heavy
    upscaling)."""
    pixel, notes = family_of(m).load_images(m, image_files, static)
    for note in notes:
        say(note)
    return pixel


# ---------------------------------------------------------------------- compare


@dataclasses.dataclass
class CompareResult:
    output: Path
    pictures: int  # one per bundle

    def lines(self) -> list[str]:
        return [f"{self.pictures} picture{'' if self.pictures == 1 else 's'} written to {self.output}"]


def compare(bundles: Iterable[str | Path], *, image: str | Path, output: str | Path, columns: int | None = None,
            force: bool = False, progress: Progress = None) -> CompareResult:
    """Draw what each bundle keeps on the same image, side by side, into the PNG output (`vlmprune compare`).

    Returns a CompareResult; raises InputError for a dense bundle, a bundle that cannot be drawn, or bad options.
    """
    say = _say(progress)
    bundles = [Path(b) for b in bundles]
    image, = require_image_files([image], option("--image", "image"))
    pictures.require_pillow()
    check_output_file(output, force, (".png",), option("-o", "output"))
    if columns is not None and (columns < 1):
        raise InputError(f"{option('--columns')} must be >= 1, got {columns}")
    manifests = [Manifest.load(b, verify=True) for b in bundles]  # every bundle checked before any run
    for b, m in zip(bundles, manifests):
        if not m.method.pruned:
            raise InputError(f"{b}: a dense bundle (--no-prune) keeps every patch; nothing to compare")
        if family_of(m).cannot_draw(m):
            raise InputError(f"{b}: {family_of(m).cannot_draw(m)} cannot be drawn yet")
    tiles, said = [], set()

    def once(line: str) -> None:  # the same image preprocessed the same way for several bundles: said once
        if line not in said:
            said.add(line)
            say(line)

    for b, m in zip(bundles, manifests):
        with _naming(b):  # several bundles: a refusal says which one
            pixel = _load_images(m, [image], once)
            static = _static_batch(m)
            if isinstance(static, int) and static > 1:  # a static batch: the same image in every slot
                pixel = np.repeat(pixel, static, axis=0)
            runner, runtime = get_target(m.target.name).runner(b, m)
            say(f"{b}: {runtime}")
            text = _run_text(m, None, None, say)  # a prompt-aware bundle: no prompt (compiler.prompt)
            kept = runner(pixel, {} if text is None else {TEXT: text})[KEPT][:1]
            sels, note = pictures.selections_for_run(m, pixel[:1], kept, b.resolve().name)
        if note:
            say(f"warning: {b}: {note}")
        tiles.append(pictures.picture(sels[0]))
    write_file(output, pictures.png_bytes(pictures.grid_of(tiles, columns)), force)
    return CompareResult(Path(output), len(tiles))


@contextlib.contextmanager
def _naming(bundle: Path):
    """A VlmpruneError raised inside, prefixed with the bundle it concerns (unless it names it already)."""
    try:
        yield
    except VlmpruneError as exc:
        text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        if text.startswith(str(bundle)):
            raise
        raise type(exc)(f"{bundle}: {text}") from exc


# ---------------------------------------------------------------------- inspect


@dataclasses.dataclass
class InspectResult:
    """A verified bundle as `vlmprune inspect` shows it: the manifest, its placement tables, model.onnx's ops."""

    bundle: Path
    manifest: Manifest
    ops: list[dict] | None = None  # model.onnx's ops (name, op type, role, placement), where asked for

    @property
    def placement(self) -> dict[str, list[dict]]:
        """Per graph, where the target placed each op (targets that report it: qnn, rk3588)."""
        return self.manifest.target.get("placement", {})

    @property
    def placement_summary(self) -> list[str]:
        return _placement_summary(self.manifest)

    def to_json(self) -> dict:
        """`vlmprune inspect --json`: the verified manifest and the op listing."""
        return {"bundle": str(self.bundle), "manifest": self.manifest, "ops": self.ops}

    def lines(self) -> list[str]:
        from vlmprune.compiler.ops import op_lines

        m, t = self.manifest, self.manifest.target
        out = [f"vlmprune {m.version} bundle: {self.bundle}",
               f"target:   {t.name} — {t.summary}",
               "toolchain: " + ", ".join(f"{k} {v}" for k, v in t.toolchain.items()),
               f"model:    {m.model.source} ({m.model.kind}, sha256 {m.model.sha256[:16]}…)",
               f"method:   {m.method.summary}"]
        for kind, tensors in (("input", m.inputs), ("output", m.outputs)):
            out += [f"{kind:<9} {io.name} {io.shape} {io.dtype}" for io in tensors]
        out.append(f"parity:   {'PASS' if m.parity.passed else 'FAIL'} ({', '.join(m.parity.stages)})")
        out.append("files:")
        out += [f"  {name:<28} {digest[:16]}…" for name, digest in m.files.items()]
        for name, rows in self.placement.items():
            out.append(f"placement of {name} ({len(rows)} ops):")
            out += placement.table(rows)
        out += self.placement_summary
        if self.ops is not None:
            out.append(f"ops of model.onnx ({len(self.ops)}):")
            out += op_lines(self.ops, bool(t.get("placement")))
        return out


def inspect(bundle: str | Path, *, ops: bool = True) -> InspectResult:
    """BUNDLE's manifest after checking every file's sha256, with model.onnx's ops where ops (`vlmprune inspect`).

    Raises InputError for a missing, foreign or modified bundle.
    """
    from vlmprune.compiler.ops import op_rows

    m = Manifest.load(bundle, verify=True)
    return InspectResult(Path(bundle), m, op_rows(bundle, m) if ops else None)


# ---------------------------------------------------------------------- generate and eval


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
                           _say(progress), reference, None if video is None else Path(video))


def generate_json(result) -> dict:
    """`vlmprune generate --json`: the answer and what was fed to the LLM (a GenerateResult as data)."""
    a = result.answer
    return {"path": result.path, "runtime": result.runtime, "llm": result.llm, "fastv_kept": result.fastv_kept,
            "prompt": result.prompt.text,
            "image_start": result.image_start, "image_tokens": a.image_tokens, KEPT: result.kept,
            "position_ids": a.position_ids, "tokens": a.tokens, "text": a.text}


@dataclasses.dataclass
class EvalResult:
    """`vlmprune eval`'s report: per method and K (and per bundle), first-token KL and answer agreement."""

    data: dict  # the report as --json prints it: rows, and what they were measured over (images and prompts, or a dataset)
    report: Path | None = None

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def to_json(self) -> dict:
        return self.data

    def lines(self) -> list[str]:
        """The table `vlmprune eval` prints, and what it was measured over."""
        from vlmprune.compiler.evaluate import table

        data = self.data
        if "dataset" in data:
            from vlmprune.compiler.accuracy import table as accuracy_table

            return accuracy_table(data)
        starts = sorted(set(data["image_start"]))
        inputs = (f"clips of {data['video_frames']} frames" if data.get("video_frames") else "images")
        return [*table(data),
                f"({len(data['images'])} {inputs} x {len(data['prompts'])} prompts; dense: "
                f"{data['dense_image_tokens']} image tokens; harness check KL {data['harness_kl_max']:.2g})",
                f"(the image starts at prompt token {', '.join(map(str, starts))}: FastV's --image-start for "
                f"{'these prompts' if len(starts) == 1 else 'the prompts, in order of value'})"]


def eval(model: str, *, images: str | Path | None = None, prompts: str | Path | None = None,
         methods: Iterable[str] | None = None, keeps: Iterable[int] | None = None, bundles: Iterable[str | Path] = (),
         max_new_tokens: int | None = None, image_size: int | None = None, grid: str | None = None,
         report: str | Path | None = None, force: bool = False, progress: Progress = None,
         dataset: str | Path | None = None, limit: int | None = None, layers: Iterable = (),
         target: str | None = None, target_options: dict | None = None, ray: str | None = None,
         ray_workers: int | None = None, store: str | Path | None = None, bar: bool | None = None,
         reference: bool = False, video: Iterable[str | Path] = (), prompt: Iterable[str] = (),
         video_frames: int | None = None) -> EvalResult:
    """Pruned against dense on MODEL's own LLM (`vlmprune eval`).

    MODEL may be a compiled bundle instead (images, prompts or clips): its source model answers, the bundle is a
    bundles row (`eval BUNDLE --video PATH --prompt TEXT`).
    video (clips: folders of frames or video files) in place of images, for video bundles (compile --video-frames
    F); prompt (texts, each a prompt) in place of prompts. A dataset whose rows name videos needs video_frames: its
    bundles are compiled for clips of that many frames.

    Two modes. images (a directory) and prompts (a text file, one prompt a line): per method and K,
    first-token KL and greedy agreement against dense; methods and keeps (each item a value or a comma
    list, as the CLI's options) default to cls and 64 unless bundles (compiled from MODEL) are given.
    dataset (JSON Lines of image, question, answers; the first `limit`): exact-match accuracy per
    method x K x layer (ints, or "end") beside dense, random keep and a uniform grid, each compiled once
    for target and run as a bundle; cells kept in store (default under $VLMPRUNE_CACHE/quality/), run
    here or on the Ray cluster at `ray` ("auto" or an address) with at most ray_workers actors.
    target_options (dataset only): the target's own options, as `compile` takes them (ort: precision,
    calibration), so that e.g. an int8 sweep's bundles are the int8 ones a user deploys.
    report: also write the report as .json or .html. Returns an EvalResult. Raises InputError for bad input.
    reference (images and prompts): a bundle compiled --with-llm answers with the checkpoint's language model in
    transformers, not its own LLM graphs (each row's `llm` says which answered).
    """
    if report:
        check_output_file(report, force, (".json", ".html", ".htm"), option("--report"))
    if dataset is not None and reference:
        raise InputError(f"{option('--reference', 'reference')} applies to eval --bundle rows (--images, --prompts): "
                         "the --dataset sweep's bundles hold no language model")
    video, prompt = [Path(v) for v in video or ()], [str(p) for p in prompt or ()]
    if dataset is not None:
        clash = [option(*names) for names, value in ((("--video", "video"), video), (("--prompt", "prompt"), prompt))
                 if value]
        if clash:
            raise InputError(f"{option('--dataset')} takes its clips and questions from its rows; drop "
                             f"{', '.join(clash)}")
        if _bundle_dir(model):
            raise InputError(f"{option('--dataset')} measures accuracy on bundles it compiles itself: pass the MODEL "
                             f"they are compiled from, not the bundle {model}")
        data = _eval_dataset(model, dataset, methods, keeps, bundles, images, prompts, max_new_tokens, limit, layers,
                             target, target_options, ray, ray_workers, store, progress, bar, image_size, grid,
                             video_frames)
    else:
        from vlmprune.compiler.evaluate import evaluate
        from vlmprune.compiler.bundle import load_manifest as load_bundle_manifest
        from vlmprune.compiler.generate import default_model

        given = [option(*names) for names, value in ((("--limit",), limit), (("--layer", "layers"), layers or None),
                                                     (("--ray",), ray), (("--ray-workers",), ray_workers),
                                                     (("--store",), store),
                                                     (("--video-frames", "video_frames"), video_frames)) if value]
        given += [option(f"--{name.replace('_', '-')}", f"target_options[{name!r}]") for name in target_options or {}]
        if given or target is not None:
            raise InputError(f"{', '.join(given) or option('--target')} applies to eval {option('--dataset')} only"
                             + (" (a clip's frames are its bundle's)" if video_frames else ""))
        for first, second in (((images, "--images", "images"), (video, "--video", "video")),
                              ((prompts, "--prompts", "prompts"), (prompt, "--prompt", "prompt"))):
            if first[0] and second[0]:
                raise InputError(f"{option(*first[1:])} and {option(*second[1:])}: give one of them")
        if (images is None and not video) or (prompts is None and not prompt):
            raise InputError(f"eval needs {option('--dataset FILE.jsonl', 'dataset')}, or "
                             f"{option('--images DIR', 'images')} (or {option('--video PATH', 'video')}) and "
                             f"{option('--prompts FILE', 'prompts')} (or {option('--prompt TEXT', 'prompt')})")
        bundles = [Path(b) for b in bundles]
        if _bundle_dir(model):  # eval BUNDLE: its source model answers, the bundle is a row
            bundles = [Path(model), *bundles]
            model = default_model(load_bundle_manifest(model, verify=True))
        if not bundles:
            methods, keeps = methods or (DEFAULT_METHOD,), keeps or (EVAL_KEEP,)
        methods, keeps = _comma_list(methods or ()), _comma_list(keeps or (), int, option("--keep", "keeps"))
        data = evaluate(model, None if images is None else Path(images), None if prompts is None else Path(prompts),
                        methods, keeps, max_new_tokens or 8, _say(progress), bundles, image_size, grid, reference,
                        video, prompt)
    if report and Path(report).suffix.lower() == ".json":
        write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
    elif report:
        from vlmprune.compiler.report import eval_html, quality_html

        write_file(report, (quality_html(data) if dataset is not None else eval_html(data)).encode(), force)
    return EvalResult(data, Path(report) if report else None)


def _bundle_dir(model) -> bool:
    """Whether eval's MODEL names a compiled bundle (a folder with its manifest) rather than a checkpoint."""
    from vlmprune.compiler.contract import MANIFEST

    return Path(str(model)).is_dir() and (Path(str(model)) / MANIFEST).is_file()


def _eval_dataset(model, dataset, methods, keeps, bundles, images, prompts, max_new_tokens, limit, layers, target,
                  target_options, ray, ray_workers, store, progress, bar, image_size, grid, video_frames) -> dict:
    from vlmprune.compiler.accuracy import evaluate_dataset
    from vlmprune.compiler.quality.executors import InProcess, RayExecutor

    clash = [option(*names) for names, value in ((("--images",), images), (("--prompts",), prompts),
                                                 (("--bundle", "bundles"), list(bundles))) if value]
    if clash:
        raise InputError(f"{option('--dataset')} measures accuracy on bundles it compiles itself; drop "
                         f"{', '.join(clash)}")
    if ray_workers is not None and ray is None:
        raise InputError(f"{option('--ray-workers')} needs {option('--ray auto|ADDRESS', 'ray')}")
    target = target or HOST_TARGET
    get_target(target)  # one line for an unknown target, before any work
    executor = RayExecutor(ray, ray_workers) if ray is not None else InProcess()
    return evaluate_dataset(model, Path(dataset), _comma_list(methods or (DEFAULT_METHOD,)),
                            _comma_list(keeps or (EVAL_KEEP,), int, option("--keep", "keeps")), list(layers or ()), limit=limit,
                            target=target, target_options=target_options, max_new_tokens=max_new_tokens or 4,
                            store=Path(store) if store else None, executor=executor, progress=_say(progress), bar=bar,
                            video_frames=video_frames, family_options={"image_size": image_size, "grid": grid})


def _comma_list(values, kind=str, what="value") -> list:
    """Values as eval's repeatable options take them: each one a value or a comma list of values."""
    out = []
    for value in values:
        for part in str(value).split(","):
            if part.strip():
                try:
                    out.append(kind(part.strip()))
                except ValueError:
                    raise InputError(f"{what} {part.strip()!r} is not an integer") from None
    return out


# ---------------------------------------------------------------------- listings


@dataclasses.dataclass
class MethodInfo:
    """One pruning method as `vlmprune methods` lists it."""

    name: str
    summary: str
    needs: str  # what it needs from the model
    serves: str  # the families that have it
    options: dict[str, str]  # --OPTION -> what it does
    targets: list[str]  # per target: how it runs the method, or why it refuses it
    official: str | None = None

    def lines(self) -> list[str]:
        out = [f"{self.name}: {self.summary}", f"  needs:    {self.needs}", f"  serves:   {self.serves}"]
        out += [f"  --{option.replace('_', '-')}: {text}" for option, text in self.options.items()]
        out.append("  targets:  " + ", ".join(self.targets))
        if self.official:
            out.append(f"  official: {self.official}")
        return out


def methods() -> list[MethodInfo]:
    """The pruning methods: what each needs from the model, its options, and how each target runs it."""
    out = []
    for name, cls in METHODS.items():
        method = cls()
        params = method.parse(PROBE_KEEP, {})
        rows = []
        for target_name, target_cls in TARGETS.items():
            target = target_cls()
            refused = target.refusal(method)
            if refused:
                rows.append(f"{target_name} refuses it ({refused})")
                continue
            parts = [] if target.formulation(method) == "standard" else [target.formulation(method)]
            parts += [_fusion_text(method, target.spellings)]
            rows.append(f"{target_name} ({', '.join(p for p in parts if p) or 'standard ops'})")
        out.append(MethodInfo(name, method.summary, method.needs(params).describe(), _serves(method),
                              {**{option: text.split(": ", 1)[-1] for option, (_kind, text) in method.options.items()},
                               **_generic_options(method, params)},
                              rows, method.official or None))
    return out


def _generic_options(method, params: dict) -> dict[str, str]:
    """The options the base class parses (--merge, --width, --scorer) that this method takes."""
    taken = {}
    if method.local_merge:
        taken.update({name: text for name, (_kind, text) in GENERIC_OPTIONS.items() if name in ("merge", "width")})
    if method.scores_by_cls_kernel(params):
        taken["scorer"] = GENERIC_OPTIONS["scorer"][1]
    if method.prompt_weight:  # passes.methods.relevance
        taken["prompt_weight"] = GENERIC_OPTIONS["prompt_weight"][1]
    if method.roi_keep:  # passes.methods.roi, and --coverage built on it
        taken.update({name: GENERIC_OPTIONS[name][1] for name in ("roi", "roi_max", "coverage")})
    from vlmprune.passes.methods import schedule

    if schedule.refusal(method, params) is None:  # --schedule: a score-based method at a block site
        taken["schedule"] = GENERIC_OPTIONS["schedule"][1]
    return taken


def unavailable_methods() -> list[str]:
    """The lines `vlmprune methods` ends with: the parts of pruning designs that are trained networks, refused by
    name."""
    return ["not available (trained weights that do not exist here):",
            *(f"  {name}: {why}" for name, why in NEEDS_TRAINED_WEIGHTS.items())]


def _serves(method) -> str:
    """The families that have what the method needs (Method.serves against Family.has), in the table's order."""
    parts = []
    for capability, using in method.serves():
        names = [f.has[capability] for f in frontend.FAMILIES if capability in f.has]  # the table as it is now
        if names:
            parts.append(capability.phrase.format(", ".join(names)) + using)
    return "; ".join(parts)


def _fusion_text(method, spellings) -> str:
    """What a target fuses the method into, per value of an option that changes it ('' where nothing is fused)."""
    for option, values in method.choices.items():
        groups: dict[tuple[str, ...], list[str]] = {}
        for value in values:
            groups.setdefault(tuple(method.fused_into(spellings, method.parse(PROBE_KEEP, {option: value}))), []).append(value)
        if len(groups) > 1:
            return "; ".join(f"{'fused into ' + ', '.join(ops) if ops else 'standard ops'} with --{option} "
                             f"{' or '.join(chosen)}" for ops, chosen in groups.items())
    fused = method.fused_into(spellings, method.parse(PROBE_KEEP, {}))
    return f"fused into {', '.join(fused)}" if fused else ""


@dataclasses.dataclass
class TargetInfo:
    name: str
    summary: str
    available: bool | None  # None: planned, not in this version
    why: str = ""  # why it is unavailable here

    def line(self) -> str:
        state = ("planned (not in this version)" if self.available is None else
                 "available" if self.available else "unavailable: " + self.why)
        return f"{self.name:<8} {state:<40} {self.summary}"


@dataclasses.dataclass
class TargetListing:
    """`vlmprune targets`: each target and whether its toolchain is here, the targets' own lines, the LLM exporters."""

    targets: list[TargetInfo]
    notes: list[str]  # what each target lists of its own (e.g. a target option's values)
    llm: list[str]  # the --with-llm exporters, per target

    def lines(self) -> list[str]:
        return [*(t.line() for t in self.targets), *self.notes, "--with-llm (the language model):", *self.llm]


def targets() -> TargetListing:
    """The targets, whether each one's toolchain is available here, and the language-model exporters."""
    from vlmprune.compiler.llm.export import exporter_lines

    listed, notes = [], []
    for name, cls in TARGETS.items():
        target = cls()
        ok, why = target.available()
        listed.append(TargetInfo(name, target.summary, ok, why))
    listed += [TargetInfo(name, summary, None) for name, summary in PLANNED.items()]
    notes.append("--opset (each target's range; others are refused before any work): " + "; ".join(
        f"{name} {cls().opsets[0]}-{cls().opsets[1]}" for name, cls in TARGETS.items()))
    for cls in TARGETS.values():
        notes += cls().listing()
    return TargetListing(listed, notes, exporter_lines())


# transformers imports torchao whenever it is installed (the [bench] extra), and torchao then logs its CUDA-only
# libraries that a CPU machine cannot load, and torch's pytree its deprecation notes: import-time chatter about a
# package no command here uses, which `-q` and a clean stderr should not carry.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Keep QUIET_LOGGERS' import-time warnings off stderr (errors still show)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
