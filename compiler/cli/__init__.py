"""The `vlmprune` command line: one thin command per verb over the Python API (compiler/api/).

Each command parses its options, calls one api function and prints its result (the lines are
render.py's); what a command computes lives in the API, so a script gets the same results without
shelling out. The targets' own commands (build-engine) go through the API too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import sys
from pathlib import Path

import click

from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET
from vlmprune.compiler import __version__, api
from vlmprune.compiler.cli import render
from vlmprune.compiler.errors import VlmpruneError


def _one_line_errors(fn):
    """The CLI's one error boundary: a user error is one line on stderr and exit code 2, never a traceback.

    Anything else is a bug in vlmprune: it is reported in one line too, with exit
    code 3 (not 1, parity failed: a CI gate must tell a crash from a failing figure)
    and how to see the traceback (VLMPRUNE_DEBUG=1 re-raises it).
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        complete: list[str] = []  # the outputs written whole so far, for a true interrupt line
        try:  # outermost, so a Ctrl-C anywhere before on_command_end has taken effect is this line, not click's
            return _ended_one_way(fn, complete, args, kwargs)
        except KeyboardInterrupt:
            on_command_end()
            click.echo(api.interrupted_line(complete), err=True)
            sys.exit(130)
    return wrapper


def _ended_one_way(fn, complete: list[str], args, kwargs):
    """Runs the command; every way it ends calls on_command_end before saying how (an interrupt after
    that has nothing left to stop)."""
    try:
        with api.tracking(complete):
            result = fn(*args, **kwargs)
    except VlmpruneError as exc:
        on_command_end()
        click.echo(f"error: {exc.cli_text()}", err=True)  # options as flags (compiler.errors.option)
        sys.exit(2)
    except BrokenPipeError:  # `vlmprune inspect B | head`: the reader left; not an error of ours
        on_command_end()
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # as a shell reports a process ended by SIGPIPE
    except (SystemExit, click.exceptions.Exit, click.ClickException):
        on_command_end()
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        on_command_end()
        if os.environ.get("VLMPRUNE_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        click.echo(f"error: internal error ({type(exc).__name__}: {first}); this is a vlmprune bug: "
                   "rerun with VLMPRUNE_DEBUG=1 for the traceback and report it", err=True)
        sys.exit(3)
    on_command_end()
    return result


# Called as a command's boundary is left, however it ended. The console script (compiler/__main__.py)
# ignores Ctrl-C from then on, the command having said how it ended; in-process callers keep their own.
on_command_end = lambda: None  # noqa: E731


@contextlib.contextmanager
def _stdout_for_data():
    """While a command works, everything but its data goes to stderr: file descriptor 1 is pointed at stderr
    (native libraries, e.g. QNN's `# LIBNATIVE:` line) and so is sys.stdout (stray prints), with or
    without --json. Yields the writer for the --json data, the one thing that reaches the real stdout
    inside the block; the human summary is printed after it."""
    original = sys.stdout
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all (`>&-`): nothing to keep clean
        yield click.echo
        return
    original.flush()
    try:
        real = original.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a captured stream (click's test runner)
        real = False
    os.dup2(2, 1)
    data = os.fdopen(os.dup(saved), "w") if real else original
    sys.stdout = sys.stderr
    try:
        yield lambda text: (data.write(text + "\n"), data.flush())
    finally:
        sys.stderr.flush()
        with contextlib.suppress(OSError, AttributeError):  # C stdio's buffer (a library's printf) goes too
            ctypes.CDLL(None).fflush(None)
        sys.stdout = original
        os.dup2(saved, 1)
        os.close(saved)
        if real:
            data.close()


def _progress(quiet: bool):
    return (lambda _m: None) if quiet else (lambda m: click.echo(m, err=True))


class _KeepType(click.ParamType):
    """--keep: an integer K, or `auto` (with --latency-ms; compiler.pipeline.auto_keep)."""

    name = "integer|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or (isinstance(value, str) and value.strip().lower() == "auto"):
            return value if isinstance(value, int) else "auto"
        try:
            return int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer or auto", param, ctx)


_KEEP = _KeepType()
_LLM = api.llm_option_texts()  # --with-llm / --llm-exporter, from the declarations


class _UsageLine(click.ClickException):
    """A click usage error, shown as every other bad input is: one `error:` line, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


class _Cli(click.Group):
    """The `vlmprune` group: a bad type, an unknown option or a missing argument, in any command, is one line
    naming where the usage is, instead of click's usage block (no arguments at all still print the help)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_in_one_line():  # the group's own options
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with _usage_in_one_line():  # the command's name, and its options and arguments
            return super().invoke(ctx)


@contextlib.contextmanager
def _usage_in_one_line():
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "vlmprune"
        raise _UsageLine(f"{' '.join(exc.format_message().split())} (see {where} --help)") from None



class _NonEmptyPath(click.Path):
    """A path that is not "": pathlib reads "" as ".", the current directory, which no one means by -o ""."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path (name the directory or file to write)", param, ctx)
        return super().convert(value, param, ctx)


@click.group(cls=_Cli, name="vlmprune", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlmprune")
def main():
    """Compile LLaVA-style vision towers into edge artifacts with visual-token pruning in the graph."""
    api.quiet_imports()


def _extra_options(fn):
    """--OPTION flags for every method option and target option the tables declare, so a new method or
    target needs no CLI edit. Their values reach the library as method_options / target_options."""
    for name, (kind, texts) in sorted(api.declared_options().items(), reverse=True):
        fn = click.option(f"--{name.replace('_', '-')}", f"opt_{name}", type=kind, default=None,
                          help="; ".join(dict.fromkeys(texts)))(fn)
    return fn


def _target_options(fn):
    """--OPTION flags for every option the targets declare (eval --dataset: its bundles compiled with them)."""
    for name, (kind, texts) in sorted(api.declared_target_options().items(), reverse=True):
        fn = click.option(f"--{name.replace('_', '-')}", f"topt_{name}", type=kind, default=None,
                          help="--dataset: " + "; ".join(dict.fromkeys(texts)))(fn)
    return fn


def _family_options(fn):
    """--OPTION flags for every option the model families declare (Family.options: --grid, --crop-budget,
    --image-size), so a new family needs no CLI edit. Their values reach the library as family_options."""
    for name, (kind, texts) in reversed(list(api.declared_family_options().items())):
        fn = click.option(f"--{name.replace('_', '-')}", f"family_{name}", type=kind, default=None,
                          help="; ".join(dict.fromkeys(texts)))(fn)
    return fn


@main.command()
@click.argument("model")
@click.option("--target", "-t", default=api.DEFAULT_TARGET, show_default=True,
              help="Deployment target (see `vlmprune targets`).")
@click.option("--method", "-m", default=api.DEFAULT_METHOD, show_default=True,
              help="Pruning method (see `vlmprune methods`).")
@click.option("--keep", "-k", type=_KEEP, default=DEFAULT_KEEP, show_default=True,
              help="Tokens to keep (K), or auto: the largest K whose latency on the target fits --latency-ms.")
@click.option("--latency-ms", type=float, default=None,
              help="--keep auto: the latency budget, ms per call of the tower on the target's runtime (timed here).")
@click.option("--layer", "-l", type=int, default=None,
              help="Prune after this block (from 1), for methods that prune inside the tower. Default: the feature layer.")
@click.option("--no-prune", is_flag=True, help="Dense baseline in the same bundle format.")
@click.option("--batch", type=int, default=None, help="Static batch size. Default: dynamic batch.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="ONNX opset of the export.")
@click.option("--feature-layer", type=int, default=None, help="Override the model's vision_feature_layer.")
@_family_options
@click.option("-o", "--output", type=_NonEmptyPath(path_type=Path), default=Path("build"), show_default=True,
              help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--timings", is_flag=True,
              help="After the summary, a table of each stage's seconds and the peak memory (RSS) at its end.")
@click.option("--debug", is_flag=True, help="If a fusion does not fire, print why each near-match failed.")
@click.option("--cls", "cls_token", type=click.Choice(["drop", "keep"]), default=None,
              help="Drop or keep the [CLS] token in image_features. Default: the model's select strategy "
                   "(LLaVA's vision_feature_select_strategy; towers without one drop it, like LLaVA's default).")
@click.option("--with-llm", is_flag=True, help=_LLM["with_llm"])
@click.option("--llm-exporter", type=click.Choice(_LLM["exporters"]), default=None, help=_LLM["exporter"])
@click.option("--fastv-layer", type=int, default=None, help="--with-llm: FastV after this LLM layer (from 1).")
@click.option("--fastv-keep", type=float, default=None, help="FastV: share of image tokens kept (default 0.5).")
@click.option("--image-start", type=int, default=None,
              help="FastV: prompt tokens before the image (the image span is compiled into the graph).")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Neither reuse nor keep the dense export and its parity products ($VLMPRUNE_CACHE/products).")
@_extra_options
@_one_line_errors
def compile(model, target, method, keep, latency_ms, layer, no_prune, batch, opset, feature_layer, output, force,
            as_json, quiet, timings, debug, cls_token, **extra):
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle."""
    family_options = {k.removeprefix("family_"): extra.pop(k) for k in list(extra) if k.startswith("family_")}
    llm = {name: extra.pop(name) for name in ("with_llm", "llm_exporter", "fastv_layer", "fastv_keep", "image_start")}
    cache = not extra.pop("no_cache")
    method_options, target_options = api.split_options({k.removeprefix("opt_"): v for k, v in extra.items()})
    if no_prune:
        _refuse_pruning_options(method_options)
    with _stdout_for_data() as emit:
        result = api.compile(model, output, target=target, method=method, keep=keep, layer=layer, prune=not no_prune,
                             batch=batch, opset=opset, feature_layer=feature_layer, cls=cls_token,
                             method_options=method_options, target_options=target_options,
                             family_options=family_options, cache=cache, force=force, debug=debug,
                             progress=_progress(quiet or as_json), latency_ms=latency_ms, **llm)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
    if not as_json:
        _echo(render.compile_lines(result))
        if timings:
            _echo(render.timing_lines(result))
    if not result.passed:
        click.echo(f"error: parity failed (see {result.bundle / 'parity.json'})", err=True)
        sys.exit(1)


def _echo(lines) -> None:
    for line in lines:
        click.echo(line)


def _refuse_pruning_options(method_options: dict) -> None:
    """--no-prune compiles the dense tower: a pruning option given with it would be ignored without a word."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("method", "keep", "latency_ms", "layer")
             if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
    given += [f"--{name}" for name in method_options]
    if given:
        raise VlmpruneError(f"--no-prune compiles the dense tower: {', '.join(given)} "
                            f"{'does' if len(given) == 1 else 'do'} not apply to it")


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--batch", type=int, default=None, help="Parity batch (dynamic-batch bundles; default 2).")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the parity report here: .html (one self-contained page: figures, tie bands, kept "
                   "sets, heat map) or .json (the report's data, as --json prints it).")
@click.option("--junit", type=click.Path(path_type=Path), default=None,
              help="Also write a JUnit XML file here (one test case per stage and output) for CI test reporters.")
@click.option("--atol", multiple=True,
              help="Max-abs tolerance: VALUE for every value output, or OUTPUT:VALUE (replaces the whole default bound, "
                   "1e-4 + 1e-5 × the output's largest magnitude in fp32).")
@click.option("--rtol", multiple=True,
              help="Relative tolerance (every element within atol + rtol·|ref|): VALUE or OUTPUT:VALUE.")
@click.option("--cosine", multiple=True, help="Minimum per-token cosine: VALUE or OUTPUT:VALUE.")
@click.option("--force", is_flag=True, help="Replace an existing --report / --junit file.")
@click.option("--json", "as_json", is_flag=True, help="Print the full parity report as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--engine", is_flag=True,
              help="Require the bundle's engine stage, for a target whose engine is built on the device "
                   "(its README says how).")
@click.option("--model", default=None,
              help="Where the bundle's source is now, if it moved since the compile (its content hash must match).")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Neither reuse nor keep the dense export and its parity products ($VLMPRUNE_CACHE/products).")
@_one_line_errors
def check(bundle_dir, batch, report, junit, atol, rtol, cosine, force, as_json, quiet, engine, model, no_cache):
    """Re-run BUNDLE's parity against the PyTorch reference; exit 1 if any stage fails."""
    with _stdout_for_data() as emit:
        result = api.check(bundle_dir, batch=batch, atol=atol, rtol=rtol, cosine=cosine, engine=engine, model=model,
                           cache=not no_cache, report=report, junit=junit, force=force,
                           progress=_progress(quiet or as_json))
        if report:
            click.echo(f"report written to {report}", err=True)
        if junit:
            click.echo(f"JUnit written to {junit}", err=True)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
    if not as_json:
        _echo(result.lines())  # each stage with its figures and bounds: -q leaves only these lines
    if not result.passed:
        failed = [s.stage for s in result.stages if not s.passed]
        click.echo(f"error: parity failed at {', '.join(failed)}", err=True)
        sys.exit(1)


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print the verified manifest and the op listing of model.onnx as JSON on stdout.")
@click.option("--ops", is_flag=True, help="Also list model.onnx's ops (role, and placement where the target reports it).")
@_one_line_errors
def inspect(bundle_dir, as_json, ops):
    """Print BUNDLE's manifest readably (after checking every file's sha256)."""
    result = api.inspect(bundle_dir, ops=as_json or ops)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    _echo(render.inspect_lines(result))


@main.command()
def targets():
    """List the targets and whether each one's toolchain is available here."""
    _echo(render.targets_lines(api.targets()))


@main.command()
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
@_one_line_errors
def run(bundle_dir, image_files, video, load_inputs, save_outputs, show, benchmark, warmup, iterations, as_json,
        force, prompt, model, roi_boxes, roi_mask):
    """Run BUNDLE on IMAGE with its target's runtime here (ONNX Runtime, an emulator, an engine on the device)."""
    with _stdout_for_data() as emit:  # a runtime's native chatter (an emulator's libraries) goes to stderr too
        result = api.run(bundle_dir, images=image_files, inputs=load_inputs, benchmark=benchmark, warmup=warmup,
                         iterations=iterations, save_outputs=save_outputs, show=show, force=force, progress=_stderr,
                         prompt=prompt, model=model, roi_boxes=roi_boxes, roi_mask=roi_mask, video=video)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
            return
    _echo(render.run_lines(result))


def _stderr(line: str) -> None:
    click.echo(line, err=True)


@main.command()
@click.argument("bundle_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--image", required=True, type=click.Path(), help="The image every bundle runs on.")
@click.option("-o", "--output", required=True, type=_NonEmptyPath(path_type=Path), help="The PNG to write.")
@click.option("--columns", type=int, default=None, help="Pictures per row (default: up to 4).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@_one_line_errors
def compare(bundle_dirs, image, output, columns, force):
    """Draw what each BUNDLE keeps on the same IMAGE, side by side, named with its method and K."""
    with _stdout_for_data():  # as in run: a runtime's native chatter goes to stderr
        result = api.compare(bundle_dirs, image=image, output=output, columns=columns, force=force, progress=_stderr)
    _echo(render.compare_lines(result))


@main.command()
def methods():
    """List the pruning methods: what each needs from the model, its options, and how each target runs it."""
    for method in api.methods():
        _echo(render.method_lines(method))
    _echo(render.unavailable_lines(api.unavailable_methods()))


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--model", default=None,
              help="The checkpoint whose LLM answers (a LLaVA-1.5, LLaVA-NeXT, Qwen2-VL or Qwen2.5-VL directory, or "
                   "`demo`). Default: the bundle's own source.")
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
@_one_line_errors
def generate(bundle_dir, model, image, video, prompt, dense, max_new_tokens, reference, as_json):
    """Run BUNDLE on IMAGE (a video bundle on --video) and let its LLM answer PROMPT (greedy, on the CPU): a
    --with-llm bundle's own LLM graphs where they run here, else (or with --reference) the checkpoint's LLM in
    transformers."""
    with _stdout_for_data() as emit:
        result = api.generate(bundle_dir, image=image, prompt=prompt, model=model, dense=dense,
                              max_new_tokens=max_new_tokens, progress=_progress(as_json), reference=reference,
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


@main.command("eval")
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
              help="LLaVA-NeXT: the crops' grid ROWSxCOLS. Default: the bundle's, else the model's largest.")
@click.option("--reference", is_flag=True,
              help="--bundle rows: answer with MODEL's LLM in transformers, not a --with-llm bundle's own LLM graphs.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON on stdout.")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the report here: .json (as --json prints it) or .html (one self-contained page).")
@click.option("--force", is_flag=True, help="Replace an existing --report file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@_target_options
@_one_line_errors
def eval_command(model, images_dir, videos, prompts_file, prompt_texts, dataset, video_frames, limit, layers, target,
                 ray, ray_workers, store, methods, keeps, bundles, max_new_tokens, image_size, grid, reference, as_json,
                 report, force, quiet, **extra):
    """Pruned against dense on MODEL's own LLM (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL / Qwen2.5-VL): per method and K,
    first-token KL and greedy agreement (--images or --video, --prompts or --prompt), or exact-match accuracy on
    bundles (--dataset). MODEL may be a compiled bundle: its model answers, the bundle is a --bundle row."""
    with _stdout_for_data() as emit:
        result = api.eval(model, images=images_dir, prompts=prompts_file, methods=methods, keeps=keeps,
                          video=videos, prompt=prompt_texts, video_frames=video_frames,
                          bundles=bundles, max_new_tokens=max_new_tokens, image_size=image_size, grid=grid,
                          report=report, force=force, progress=_progress(quiet or as_json), dataset=dataset,
                          limit=limit, layers=layers, target=target, ray=ray, ray_workers=ray_workers, store=store,
                          target_options={k.removeprefix("topt_"): v for k, v in extra.items() if v is not None},
                          bar=False if (quiet or as_json) else None, reference=reference)
        if report:
            click.echo(f"report written to {report}", err=True)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
            return
    _echo(render.eval_lines(result))


def _add_target_commands() -> None:
    """Register the commands each target contributes (Target.commands; e.g. build-engine): each with the options
    and help its target declares, run through the API (api.target_command) inside the CLI's one-line error
    boundary, its lines on stdout; targets that share a module share its commands, registered once."""
    for declared in api.target_commands():
        if declared.name not in main.commands:
            main.add_command(_through_api(declared))


def _through_api(declared: click.Command) -> click.Command:
    name = declared.name

    @_one_line_errors
    def callback(**params):
        _echo(api.target_command(name, progress=click.echo, **params))

    return click.Command(name, params=declared.params, help=declared.help, short_help=declared.short_help,
                         callback=callback)


_add_target_commands()
