"""The `vlmprune` command line: one thin command per verb over the library."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import sys
from pathlib import Path

import click

from vlmprune.compiler import __version__
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
            from vlmprune.compiler.bundle import interrupted_line

            click.echo(interrupted_line(complete), err=True)
            sys.exit(130)
    return wrapper


def _ended_one_way(fn, complete: list[str], args, kwargs):
    """Runs the command; every way it ends calls on_command_end before saying how (an interrupt after
    that has nothing left to stop)."""
    from vlmprune.compiler.bundle import tracking

    try:
        with tracking(complete):
            result = fn(*args, **kwargs)
    except VlmpruneError as exc:
        on_command_end()
        click.echo(f"error: {exc}", err=True)
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


@click.group(cls=_Cli, name="vlmprune", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlmprune")
def main():
    """Compile LLaVA-style vision towers into edge artifacts with visual-token pruning in the graph."""


def _extra_options(fn):
    """--OPTION flags for every method option and target option the tables declare, so a new method or
    target needs no CLI edit. Their values reach the library as method_options / target_options."""
    from vlmprune.passes.methods import METHODS
    from vlmprune.targets import TARGETS

    declared: dict[str, tuple[type, list[str]]] = {}
    for cls in METHODS.values():
        for name, (kind, text) in cls.options.items():
            declared.setdefault(name, (kind, []))[1].append(text)
    for cls in TARGETS.values():
        for name, text in cls.options.items():
            declared.setdefault(name, (str, []))[1].append(text)
    for name, (kind, texts) in sorted(declared.items(), reverse=True):
        fn = click.option(f"--{name}", f"opt_{name}", type=kind, default=None,
                          help="; ".join(dict.fromkeys(texts)))(fn)
    return fn


def _split_options(extra: dict) -> tuple[dict, dict]:
    from vlmprune.passes.methods import METHODS
    from vlmprune.targets import TARGETS

    given = {k.removeprefix("opt_"): v for k, v in extra.items() if v is not None}
    target_names = {n for cls in TARGETS.values() for n in cls.options}
    method_names = {n for cls in METHODS.values() for n in cls.options}
    method = {k: v for k, v in given.items() if k in method_names and k not in target_names}
    target = {k: v for k, v in given.items() if k in target_names}
    return method, target


@main.command()
@click.argument("model")
@click.option("--target", "-t", default="ort", show_default=True, help="Deployment target (see `vlmprune targets`).")
@click.option("--method", "-m", default="cls", show_default=True, help="Pruning method (see `vlmprune methods`).")
@click.option("--keep", "-k", type=int, default=192, show_default=True, help="Tokens to keep (K).")
@click.option("--layer", "-l", type=int, default=None,
              help="Prune after this block (from 1), for methods that prune inside the tower. Default: the feature layer.")
@click.option("--no-prune", is_flag=True, help="Dense baseline in the same bundle format.")
@click.option("--batch", type=int, default=None, help="Static batch size. Default: dynamic batch.")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset of the export.")
@click.option("--feature-layer", type=int, default=None, help="Override the model's vision_feature_layer.")
@click.option("--image-size", type=int, default=None,
              help="Static image size S for dynamic-resolution models (qwen2_vl, qwen2_5_vl): a multiple of "
                   "patch x merge (28). Default 448 (1024 patches, 256 merged tokens).")
@click.option("--grid", "grid", default=None,
              help="Anyres models (llava_next): the crops' grid ROWSxCOLS, one of the model's image_grid_pinpoints "
                   "(input [1 + ROWS*COLS, 3, S, S]). Default: the largest (LLaVA-1.6: 2x2 at 672x672).")
@click.option("--crop-budget", "crop_budget", default=None,
              help="Anyres models: split --keep over the crops `proportional` to each crop's saliency mass (the "
                   "default for cls) or `equal` (the default, and only split, for divprune and dart).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("build"), show_default=True,
              help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--debug", is_flag=True, help="If a fusion does not fire, print why each near-match failed.")
@click.option("--cls", "cls_token", type=click.Choice(["drop", "keep"]), default=None,
              help="Drop or keep the [CLS] token in image_features. Default: the model's select strategy "
                   "(LLaVA's vision_feature_select_strategy; towers without one drop it, like LLaVA's default).")
@click.option("--with-llm", is_flag=True,
              help="Also export the language model into llm/ (ort: prefill + decode ONNX; orin: TensorRT Edge-LLM).")
@click.option("--llm-exporter", type=click.Choice(["torch", "genai"]), default=None,
              help="ort, with --with-llm: torch (default; original positions, FastV) or genai (onnxruntime-genai's "
                   "model builder, dense, contiguous positions).")
@click.option("--fastv-layer", type=int, default=None, help="--with-llm: FastV after this LLM layer (from 1).")
@click.option("--fastv-keep", type=float, default=None, help="FastV: share of image tokens kept (default 0.5).")
@click.option("--image-start", type=int, default=None,
              help="FastV: prompt tokens before the image (the image span is compiled into the graph).")
@_extra_options
@_one_line_errors
def compile(model, target, method, keep, layer, no_prune, batch, opset, feature_layer, image_size, output, force,
            as_json, quiet, debug, cls_token, **extra):
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    grid, crop_budget = extra.pop("grid"), extra.pop("crop_budget")
    llm = {name: extra.pop(name) for name in ("with_llm", "llm_exporter", "fastv_layer", "fastv_keep", "image_start")}
    method_options, target_options = _split_options(extra)
    if no_prune:
        _refuse_pruning_options(method_options)
    options = CompileOptions(target=target, method=method, keep=keep, layer=layer, prune=not no_prune, batch=batch,
                             opset=opset, feature_layer=feature_layer, image_size=image_size, force=force,
                             debug=debug, cls=cls_token, method_options=method_options, target_options=target_options,
                             grid=grid, crop_budget=crop_budget, **llm)
    with _stdout_for_data() as emit:
        result = compile_model(model, output, options, _progress(quiet or as_json))
        manifest = result.manifest
        summary = {"bundle": str(result.bundle), "target": target, "method": manifest["method"],
                   "outputs": manifest["outputs"], "parity": manifest["parity"], "seconds": round(result.seconds, 2)}
        if as_json:
            emit(json.dumps(summary, indent=2))
    if not as_json:
        _print_summary(manifest, result)
    if not result.report.passed:
        click.echo(f"error: parity failed (see {result.bundle / 'parity.json'})", err=True)
        sys.exit(1)


def _refuse_pruning_options(method_options: dict) -> None:
    """--no-prune compiles the dense tower: a pruning option given with it would be ignored without a word."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [f"--{name}" for name in ("method", "keep", "layer")
             if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
    given += [f"--{name}" for name in method_options]
    if given:
        raise VlmpruneError(f"--no-prune compiles the dense tower: {', '.join(given)} "
                            f"{'does' if len(given) == 1 else 'do'} not apply to it")


def _later(method: dict) -> str:
    n = method["num_blocks"] - method["layer"]
    return (f"the {n} later blocks run on {method['tokens_out']} tokens" if n > 1 else
            f"the last block runs on {method['tokens_out']} tokens")


def _print_summary(manifest: dict, result) -> None:
    method = manifest["method"]
    counts = manifest["model"].get("token_counts")
    if counts:  # a merging tower: its patches are not the tokens the LLM sees
        t, h, w = counts["merged_grid_thw"]
        click.echo(f"image {counts['image_size']}x{counts['image_size']}: {counts['patch_grid'][0]}x"
                   f"{counts['patch_grid'][1]} = {counts['patches']} patches, merged "
                   f"{counts['spatial_merge']}x{counts['spatial_merge']} into {h}x{w} = {counts['tokens']} tokens")
    if method["name"] == "none":
        click.echo("tokens: dense (no pruning)")
    elif method["site"] == "block":
        where = (f"at the tower's end, after block {method['layer']}/{method['num_blocks']}"
                 if method["layer"] == method["num_blocks"] else
                 f"after block {method['layer']}/{method['num_blocks']}; " + _later(method))
        click.echo(f"tokens: {_tokens_in(method, 'patch tokens')} -> {method['summary'].split(' (')[0]} ({where})")
    else:
        click.echo(f"tokens: {_tokens_in(method, 'tokens')} -> {method['summary'].split(' (')[0]} "
                   "(on the projector output)")
    from vlmprune.compiler.parity import DEFAULT_TOLERANCES, figure_text, summary_bounds

    for name, stage in manifest["parity"]["stages"].items():
        figures = []
        default = DEFAULT_TOLERANCES.get(stage.get("precision"))  # compile holds every stage to its defaults
        bounds = summary_bounds(default) if default else {}
        if "cosine_min" in stage:
            figures.append(f"cosine {figure_text(stage['cosine_min'], 7, **bounds.get('cosine_min', {}))}")
        if "max_abs" in stage:
            figures.append(f"max-abs {figure_text(stage['max_abs'], 3, **bounds.get('max_abs', {}))}")
        if "index_agreement" in stage:
            figures.append(f"kept-index agreement "
                           f"{figure_text(stage['index_agreement'], 4, **bounds.get('index_agreement', {}))}")
            if stage.get("tie_resolved_images"):
                images = ", ".join(map(str, stage["tie_resolved_images"]))
                why = ("it diverges at a greedy step whose two best candidates tie" if "first_divergent_step" in stage
                       else "every differing index lies in the K-th boundary tie band")
                figures.append(f"image {images}: {why}")
        status = "PASS" if stage["passed"] else "FAIL"
        click.echo(f"parity {name:<10} {status}  {', '.join(figures)}" + (f"  {stage['error']}" if "error" in stage else ""))
    if manifest.get("llm_graphs"):
        click.echo(_llm_parity_line(manifest["llm_graphs"]))
    _print_placement_summary(manifest)
    click.echo(f"bundle: {result.bundle} ({result.seconds:.1f}s)")


def _tokens_in(method: dict, noun: str) -> str:
    """The tokens the method ranks: N, or an anyres image's C crops of N each (num_patches is per crop)."""
    n, crops = method["num_patches"], method["params"].get("crops")
    return f"{crops['count'] * n} {noun} ({crops['count']} crops x {n})" if crops else f"{n} {noun}"


def _llm_parity_line(llm: dict) -> str:
    """The language model's compile-time check, in its exporter's figures (`check` repeats it as stage llm)."""
    from vlmprune.compiler.parity import figure_text

    parity = llm.get("parity")
    if parity:  # torch.onnx or onnxruntime-genai: logits and greedy tokens against the reference decoder
        passed = parity["passed"]
        figures = [f"logits max-abs {figure_text(parity['logits_max_abs'], 3, at_most=parity.get('tolerance'))}",
                   f"greedy tokens {'identical' if parity['tokens_identical'] else 'DIFFER'} over "
                   f"{parity['decode_steps']} decode steps"]
    else:  # TensorRT Edge-LLM: the graph's weights, and the graph minus its plugins where that runs here
        weights, ops = llm["checks"]["weights"], llm["checks"]["standard_ops_in_onnxruntime"]
        passed = weights["passed"] and (not ops.get("ran") or ops["passed"])
        figures = [f"weights max-abs {weights['max_abs']:.2e} over {weights['tensors_checked']} tensors",
                   f"standard-ops logits max-abs {figure_text(ops['logits_max_abs'], 3, at_most=ops.get('tolerance'))}"
                   if ops.get("ran")
                   else "standard ops not run here"]
    return f"parity {'llm':<10} {'PASS' if passed else 'FAIL'}  {', '.join(figures)}"


def _print_placement_summary(manifest: dict) -> None:
    from vlmprune.targets.placement import summary_line

    for name, summary in manifest["target"].get("placement_summary", {}).items():
        click.echo(summary_line(name, summary))


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--batch", type=int, default=None, help="Parity batch (dynamic-batch bundles; default 2).")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the parity report here: .html (one self-contained page: figures, tie bands, kept "
                   "sets, heat map) or .json (the report's data, as --json prints it).")
@click.option("--junit", type=click.Path(path_type=Path), default=None,
              help="Also write a JUnit XML file here (one test case per stage and output) for CI test reporters.")
@click.option("--atol", multiple=True, help="Max-abs tolerance: VALUE for every value output, or OUTPUT:VALUE.")
@click.option("--rtol", multiple=True,
              help="Relative tolerance (every element within atol + rtol·|ref|): VALUE or OUTPUT:VALUE.")
@click.option("--cosine", multiple=True, help="Minimum per-token cosine: VALUE or OUTPUT:VALUE.")
@click.option("--force", is_flag=True, help="Replace an existing --report / --junit file.")
@click.option("--json", "as_json", is_flag=True, help="Print the full parity report as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--engine", is_flag=True, help="TensorRT bundles: require the engine stage (run on the device).")
@click.option("--model", default=None,
              help="Where the bundle's source is now, if it moved since the compile (its content hash must match).")
@_one_line_errors
def check(bundle_dir, batch, report, junit, atol, rtol, cosine, force, as_json, quiet, engine, model):
    """Re-run BUNDLE's parity against the PyTorch reference; exit 1 if any stage fails."""
    import time

    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.output_files import check_output_file, write_file
    from vlmprune.compiler.parity import parse_overrides
    from vlmprune.compiler.pipeline import check_bundle

    if report:
        check_output_file(report, force, (".html", ".htm", ".json"), "--report")
        if Path(report).suffix.lower() != ".json":
            from vlmprune.compiler.pictures import require_pillow

            require_pillow()
    if junit:
        check_output_file(junit, force, (".xml",), "--junit")
    if report and junit and Path(report).resolve() == Path(junit).resolve():
        raise VlmpruneError("--report and --junit name the same file")
    tolerances = None
    if atol or rtol or cosine:
        outputs = [o["name"] for o in load_manifest(bundle_dir, verify=False)["outputs"]]
        tolerances = parse_overrides({"atol": atol, "rtol": rtol, "cosine": cosine},
                                     [o for o in outputs if o != "kept_indices"], ["kept_indices"])
    if engine:
        from vlmprune.targets.tensorrt import require_engine

        require_engine(bundle_dir)
    with _stdout_for_data() as emit:
        started = time.perf_counter()
        result = check_bundle(bundle_dir, batch, _progress(quiet or as_json), tolerances, model)
        seconds = time.perf_counter() - started
        if engine and "engine" not in [s.stage for s in result.stages]:
            raise VlmpruneError("the engine stage did not run (see the progress lines above)")
        data = result.to_json()
        if report or junit:
            from vlmprune.compiler import report as reports

            manifest = load_manifest(bundle_dir, verify=False)  # check_bundle verified it
            name = Path(bundle_dir).resolve().name
        if report and Path(report).suffix.lower() == ".json":
            write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
        elif report:
            page = reports.html_report(data, manifest, name, reports.parity_images(data, manifest))
            write_file(report, page.encode(), force)
        if report:
            click.echo(f"report written to {report}", err=True)
        if junit:
            write_file(junit, reports.junit_xml(data, manifest, name, seconds), force)
            click.echo(f"JUnit written to {junit}", err=True)
        if as_json:
            emit(json.dumps(data, indent=2))
    if not as_json:
        for stage in result.stages:
            click.echo(f"{stage.stage:<10} {'PASS' if stage.passed else 'FAIL'}")
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
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.ops import op_lines, op_rows

    m = load_manifest(bundle_dir, verify=True)
    if as_json:
        click.echo(json.dumps({"bundle": str(bundle_dir), "manifest": m, "ops": op_rows(bundle_dir, m)}, indent=2))
        return
    click.echo(f"vlmprune {m['vlmprune_version']} bundle: {bundle_dir}")
    t = m["target"]
    click.echo(f"target:   {t['name']} — {t['summary']}")
    click.echo("toolchain: " + ", ".join(f"{k} {v}" for k, v in t["toolchain"].items()))
    click.echo(f"model:    {m['model']['source']} ({m['model']['kind']}, sha256 {m['model']['sha256'][:16]}…)")
    click.echo(f"method:   {m['method']['summary']}")
    for kind in ("inputs", "outputs"):
        for io in m[kind]:
            click.echo(f"{kind[:-1]:<9} {io['name']} {io['shape']} {io['dtype']}")
    click.echo(f"parity:   {'PASS' if m['parity']['passed'] else 'FAIL'} ({', '.join(m['parity']['stages'])})")
    click.echo("files:")
    for name, digest in m["files"].items():
        click.echo(f"  {name:<28} {digest[:16]}…")
    from vlmprune.targets.placement import table

    for name, rows in t.get("placement", {}).items():
        click.echo(f"placement of {name} ({len(rows)} ops):")
        for line in table(rows):
            click.echo(line)
    _print_placement_summary(m)
    if ops:
        rows = op_rows(bundle_dir, m)
        click.echo(f"ops of model.onnx ({len(rows)}):")
        for line in op_lines(rows, bool(m["target"].get("placement"))):
            click.echo(line)


@main.command()
def targets():
    """List the targets and whether each one's toolchain is available here."""
    from vlmprune.targets import PLANNED, TARGETS

    for name, cls in TARGETS.items():
        target = cls()
        ok, why = target.available()
        click.echo(f"{name:<8} {'available' if ok else 'unavailable: ' + why:<40} {target.summary}")
    for name, summary in PLANNED.items():
        click.echo(f"{name:<8} {'planned (not in this version)':<40} {summary}")
    from vlmprune.targets.qnn_tools import DEFAULT_SOC, SOCS

    click.echo(f"qnn --soc values (default {DEFAULT_SOC}):")
    for soc, (model, arch, product) in SOCS.items():
        click.echo(f"  {soc:<9} soc_model {model:<3} HTP {arch}  {product}")
    from vlmprune.compiler.errors import ToolchainError
    from vlmprune.compiler.llm import edgellm_env, genai
    from vlmprune.compiler.llm.export import NO_LLM_WHY

    try:
        builder = f"onnxruntime-genai {genai.genai_version()}"
    except ToolchainError as exc:
        builder = f"unavailable: {exc}"
    ready, why = edgellm_env.creatable()
    click.echo("--with-llm (the language model):")
    click.echo("  ort      torch.onnx prefill + decode (default; original positions, FastV)")
    click.echo(f"  ort      --llm-exporter genai: {builder}")
    click.echo(f"  orin     TensorRT Edge-LLM {edgellm_env.EDGELLM_VERSION} exporter: "
               f"{'' if ready else 'unavailable: '}{why}")
    for name, reason in NO_LLM_WHY.items():
        click.echo(f"  {name:<8} not supported: {reason}")


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--image", "image_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image file; repeat it to fill a static batch (one image per batch slot).")
@click.option("--load-inputs", type=click.Path(path_type=Path), default=None,
              help="Run on the input array of this .npz file instead of --image (as Polygraphy's --load-inputs).")
@click.option("--save-outputs", type=click.Path(path_type=Path), default=None,
              help="Write every output to this .npz file (as Polygraphy's --save-outputs).")
@click.option("--show", type=click.Path(path_type=Path), default=None,
              help="Draw what was kept on the image as the model saw it, into this PNG.")
@click.option("--benchmark", is_flag=True, help="Time the runtime: latency min/p50/p90/p99 and throughput.")
@click.option("--warmup", type=int, default=None, help="--benchmark: untimed runs first (default 5).")
@click.option("--iterations", type=int, default=None, help="--benchmark: timed runs (default 50).")
@click.option("--json", "as_json", is_flag=True, help="Print the outputs' shapes, kept indices and benchmark as JSON.")
@click.option("--force", is_flag=True, help="Replace an existing --show / --save-outputs file.")
@_one_line_errors
def run(bundle_dir, image_files, load_inputs, save_outputs, show, benchmark, warmup, iterations, as_json, force):
    """Run BUNDLE on IMAGE with its target's runtime here (ort, the qnn emulator, an engine on a Jetson)."""
    from vlmprune.compiler import benchmark as bench
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.output_files import check_output_file, write_file
    from vlmprune.targets import get_target

    if bool(image_files) == bool(load_inputs):
        raise VlmpruneError("give the input either as --image (one or more) or as --load-inputs FILE.npz")
    if not benchmark and (warmup is not None or iterations is not None):
        raise VlmpruneError("--warmup and --iterations only apply with --benchmark")
    warmup, iterations = 5 if warmup is None else warmup, 50 if iterations is None else iterations
    bench.check_counts(warmup, iterations)
    if show:
        from vlmprune.compiler.pictures import require_pillow

        require_pillow()
        check_output_file(show, force, (".png",), "--show")
    if save_outputs:
        check_output_file(save_outputs, force, (".npz",), "--save-outputs")
    if show and save_outputs and Path(show).resolve() == Path(save_outputs).resolve():
        raise VlmpruneError("--show and --save-outputs name the same file")
    m = load_manifest(bundle_dir, verify=True)
    if show and m["method"]["name"] == "none":
        raise VlmpruneError("--show needs a pruned bundle: this one keeps every patch (compiled with --no-prune)")
    if show and m["model"].get("grid"):
        raise VlmpruneError("--show draws one patch grid per image; an anyres bundle (several crops per image) "
                            "cannot be drawn yet")
    # The runtime first: on a machine without it (TensorRT off the Jetson) that is the one line to say.
    with _stdout_for_data():  # a runtime that loads its libraries now (qnn) has them talk to stderr too
        runner, runtime = get_target(m["target"]["name"]).runner(Path(bundle_dir), m)
    static = m["target"].get("batch") or m["inputs"][0]["shape"][0]
    if image_files and m["model"].get("grid"):  # an anyres bundle: one image is the input's crops
        if len(image_files) != 1:
            raise VlmpruneError(f"this bundle takes one image per call (its {static} crops): pass --image once")
        pixel = _load_crops(m, image_files[0])
    elif image_files:
        if isinstance(static, int) and static != len(image_files):
            raise VlmpruneError(f"this bundle has a static batch of {static}: pass --image {static} times "
                                f"(got {len(image_files)}), or recompile with --batch {len(image_files)}")
        pixel = _load_images(m, image_files)
    else:
        pixel = bench.load_inputs(load_inputs, m)
        click.echo(f"{load_inputs}: {m['inputs'][0]['name']} {list(pixel.shape)} float32", err=True)
    summary = {"bundle": str(bundle_dir), "runtime": runtime, "batch": int(pixel.shape[0])}
    with _stdout_for_data() as emit:
        outputs = runner(pixel)
        summary["outputs"] = {name: {"shape": list(v.shape), "dtype": str(v.dtype)} for name, v in outputs.items()}
        if "kept_indices" in outputs:
            summary["kept_indices"] = outputs["kept_indices"].tolist()
        if benchmark:
            summary["benchmark"] = bench.benchmark(runner, pixel, warmup, iterations)
        if save_outputs:
            write_file(save_outputs, bench.npz_bytes(outputs), force)
            summary["saved_outputs"] = str(save_outputs)
        if show:
            summary["show"] = str(show)
            _show(m, Path(bundle_dir), pixel, outputs, show, force)
        if as_json:
            emit(json.dumps(summary, indent=2))
    if as_json:
        return
    click.echo(f"({runtime})")
    for name, value in outputs.items():
        click.echo(f"{name}: shape {list(value.shape)} dtype {value.dtype}")
    if "kept_indices" in outputs:
        click.echo("kept (image 0): " + " ".join(map(str, outputs["kept_indices"][0].tolist())))
    if benchmark:
        for line in bench.format_benchmark(summary["benchmark"], runtime):
            click.echo(line)
    if save_outputs:
        click.echo(f"outputs written to {save_outputs}")
    if show:
        click.echo(f"picture written to {show}")


def _load_images(m: dict, image_files) -> "np.ndarray":
    """The images preprocessed as the bundle's model does, saying how (and warning of heavy upscaling)."""
    import numpy as np

    from vlmprune.compiler.frontend.images import UPSCALE_WARNING, load_image_file

    pre = m["preprocess"]
    batch = []
    for image in image_files:
        try:
            pixel, described, scale = load_image_file(image, pre["size"], pre["mean"], pre["std"])
        except Exception as exc:
            raise VlmpruneError(f"{image}: cannot read the image ({exc})") from None
        click.echo(f"{image}: {described}", err=True)
        if scale > UPSCALE_WARNING:
            click.echo(f"warning: {image} is upscaled x{scale:.3g}: the model sees mostly interpolated pixels, "
                       "and the kept patches say little about the picture", err=True)
        batch.append(pixel)
    return np.concatenate(batch)


def _load_crops(m: dict, image) -> "np.ndarray":
    """An anyres bundle's input: the processor's crops of one image for the bundle's grid."""
    from vlmprune.compiler.frontend.images import load_image_crops

    model, pre = m["model"], m["preprocess"]
    rows, cols = (int(v) for v in model["grid"].split("x"))
    crops = {"grid": [rows, cols], "count": model["crops"], "resolution": model["resolution"]}
    try:
        pixel, described = load_image_crops(image, crops, pre["size"], pre["mean"], pre["std"])
    except Exception as exc:
        raise VlmpruneError(f"{image}: cannot read the image ({exc})") from None
    click.echo(f"{image}: {described}", err=True)
    return pixel


def _show(m: dict, bundle_dir: Path, pixel, outputs: dict, path: Path, force: bool) -> None:
    from vlmprune.compiler import pictures
    from vlmprune.compiler.output_files import write_file

    if "kept_indices" not in outputs:
        raise VlmpruneError("--show needs the bundle's kept_indices output, and this bundle has none")
    sels, note = pictures.selections_for_run(m, pixel, outputs["kept_indices"], bundle_dir.resolve().name)
    if note:
        click.echo(f"warning: {note}", err=True)
    images = [pictures.picture(sel) for sel in sels]
    write_file(path, pictures.png_bytes(images[0] if len(images) == 1 else pictures.grid_of(images)), force)


@main.command()
@click.argument("bundle_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--image", required=True, type=click.Path(exists=True, dir_okay=False), help="The image every bundle runs on.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="The PNG to write.")
@click.option("--columns", type=int, default=None, help="Pictures per row (default: up to 4).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@_one_line_errors
def compare(bundle_dirs, image, output, columns, force):
    """Draw what each BUNDLE keeps on the same IMAGE, side by side, named with its method and K."""
    import numpy as np

    from vlmprune.compiler import pictures
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.output_files import check_output_file, write_file
    from vlmprune.targets import get_target

    pictures.require_pillow()
    check_output_file(output, force, (".png",), "-o")
    if columns is not None and (columns < 1):
        raise VlmpruneError(f"--columns must be >= 1, got {columns}")
    manifests = [load_manifest(b, verify=True) for b in bundle_dirs]  # every bundle checked before any run
    for b, m in zip(bundle_dirs, manifests):
        if m["method"]["name"] == "none":
            raise VlmpruneError(f"{b}: a dense bundle (--no-prune) keeps every patch; nothing to compare")
        if m["model"].get("grid"):
            raise VlmpruneError(f"{b}: an anyres bundle (several crops per image) cannot be drawn yet")
    tiles = []
    for b, m in zip(bundle_dirs, manifests):
        pixel = _load_images(m, [image])
        static = m["target"].get("batch") or m["inputs"][0]["shape"][0]
        if isinstance(static, int) and static > 1:  # a static batch: the same image in every slot
            pixel = np.repeat(pixel, static, axis=0)
        with _stdout_for_data():  # as in run: a runtime's native chatter (qnn) goes to stderr
            runner, runtime = get_target(m["target"]["name"]).runner(Path(b), m)
            click.echo(f"{b}: {runtime}", err=True)
            kept = runner(pixel)["kept_indices"][:1]
        sels, note = pictures.selections_for_run(m, pixel[:1], kept, Path(b).resolve().name)
        if note:
            click.echo(f"warning: {b}: {note}", err=True)
        tiles.append(pictures.picture(sels[0]))
    write_file(output, pictures.png_bytes(pictures.grid_of(tiles, columns)), force)
    click.echo(f"{len(tiles)} picture{'' if len(tiles) == 1 else 's'} written to {output}")


@main.command()
def methods():
    """List the pruning methods: what each needs from the model, its options, and how each target runs it."""
    from vlmprune.passes.methods import METHODS
    from vlmprune.targets import TARGETS

    for name, cls in METHODS.items():
        method = cls()
        params = method.parse(64, {})
        click.echo(f"{name}: {method.summary}")
        click.echo(f"  needs:    {method.needs(params).describe()}")
        click.echo(f"  serves:   {method.serves()}")
        for option, (_kind, text) in method.options.items():
            click.echo(f"  --{option}: {text.split(': ', 1)[-1]}")
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
        click.echo("  targets:  " + ", ".join(rows))
        if method.official:
            click.echo(f"  official: {method.official}")


def _fusion_text(method, spellings) -> str:
    """What a target fuses the method into, per value of an option that changes it ('' where nothing is fused)."""
    for option, values in method.choices.items():
        groups: dict[tuple[str, ...], list[str]] = {}
        for value in values:
            groups.setdefault(tuple(method.fused_into(spellings, method.parse(64, {option: value}))), []).append(value)
        if len(groups) > 1:
            return "; ".join(f"{'fused into ' + ', '.join(ops) if ops else 'standard ops'} with --{option} "
                             f"{' or '.join(chosen)}" for ops, chosen in groups.items())
    fused = method.fused_into(spellings, method.parse(64, {}))
    return f"fused into {', '.join(fused)}" if fused else ""


@main.command("build-engine")
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp16", "int8"]), default=None,
              help="Default: the bundle's (fp16; int8 for a bundle compiled with --precision int8).")
@click.option("--calibration-cache", type=click.Path(dir_okay=False), default=None,
              help="A TensorRT INT8 calibration cache (implicit quantization).")
@click.option("--decomposed", is_flag=True, help="Build model.decomposed.onnx (no plugin) instead of model.onnx.")
@click.option("--workspace", type=int, default=None, help="Builder workspace limit in MiB.")
@click.option("--output", default=None, help="Engine file name inside the bundle (default model.engine).")
@click.option("--print-command", is_flag=True, help="Only print the equivalent trtexec command.")
@_one_line_errors
def build_engine(bundle_dir, precision, calibration_cache, decomposed, workspace, output, print_command):
    """Build BUNDLE's TensorRT engine on this device (orin/xavier bundles) and print the trtexec equivalent."""
    from vlmprune.targets import trt_engine as engine

    if print_command:
        manifest = engine.load_bundle(bundle_dir)
        cmd = engine.trtexec_command(manifest, precision, decomposed, output or engine.ENGINE, calibration_cache)
        click.echo(engine.format_command(cmd))
        return
    engine.build_engine(bundle_dir, precision, decomposed, output, workspace, calibration_cache, log=click.echo)


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--model", default=None,
              help="The checkpoint whose LLM answers (a LLaVA-1.5, LLaVA-NeXT, Qwen2-VL or Qwen2.5-VL directory, or "
                   "`demo`). Default: the bundle's own source.")
@click.option("--image", required=True, help="The image file.")
@click.option("--prompt", required=True, help="The question; the checkpoint's chat template wraps it.")
@click.option("--dense", is_flag=True, help="Feed the model's own (unpruned) image features instead of the bundle's.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Greedy tokens to generate.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer and what was fed to the LLM as JSON.")
@_one_line_errors
def generate(bundle_dir, model, image, prompt, dense, max_new_tokens, as_json):
    """Run BUNDLE on IMAGE and let the checkpoint's LLM answer PROMPT (greedy, transformers on the CPU)."""
    from vlmprune.compiler.llm.generate import generate as run_generate

    with _stdout_for_data() as emit:
        result = run_generate(bundle_dir, model, Path(image), prompt, dense, max_new_tokens,
                              _progress(as_json))
        if result.fastv_warning:  # on stderr with --json too: the graph the bundle ships would drop the wrong tokens
            click.echo(f"warning: {result.fastv_warning}", err=True)
        a = result.answer
        if as_json:
            emit(json.dumps({"path": result.path, "runtime": result.runtime, "prompt": result.prompt.text,
                             "image_start": result.image_start,
                             "image_tokens": a.image_tokens, "kept_indices": result.kept,
                             "position_ids": a.position_ids, "tokens": a.tokens, "text": a.text}))
            return
    click.echo(f"({result.path}: {a.image_tokens} image tokens, {result.runtime})", err=True)
    if a.text is None:
        click.echo("(no tokenizer in the checkpoint: the answer's token ids)", err=True)
        click.echo(" ".join(map(str, a.tokens)))
    else:
        click.echo(a.text)


def _comma_list(values, kind=str, what="value"):
    out = []
    for value in values:
        for part in str(value).split(","):
            if part.strip():
                try:
                    out.append(kind(part.strip()))
                except ValueError:
                    raise VlmpruneError(f"{what} {part.strip()!r} is not an integer") from None
    return out


@main.command("eval")
@click.argument("model")
@click.option("--images", "images_dir", required=True, help="A directory of images.")
@click.option("--prompts", "prompts_file", required=True, help="A text file, one prompt per line.")
@click.option("--method", "-m", "methods", multiple=True,
              help="Pruning method(s): repeat the option or give a comma list. Default: cls (without --bundle).")
@click.option("--keep", "-k", "keeps", multiple=True,
              help="K value(s): repeat the option or give a comma list. Default: 64 (without --bundle).")
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path),
              help="A bundle compiled from MODEL, evaluated as it runs here (repeatable).")
@click.option("--max-new-tokens", type=int, default=8, show_default=True, help="Greedy tokens compared per answer.")
@click.option("--image-size", type=int, default=None,
              help="Qwen2-VL / Qwen2.5-VL: the static image size (a multiple of 28). Default: the bundle's, else 448.")
@click.option("--grid", default=None,
              help="LLaVA-NeXT: the crops' grid ROWSxCOLS. Default: the bundle's, else the model's largest.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON on stdout.")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the report here: .json (as --json prints it) or .html (one self-contained page).")
@click.option("--force", is_flag=True, help="Replace an existing --report file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@_one_line_errors
def eval_command(model, images_dir, prompts_file, methods, keeps, bundles, max_new_tokens, image_size, grid, as_json,
                 report, force, quiet):
    """Per method and K: first-token KL and greedy-answer agreement of pruned vs dense on MODEL's own LLM
    (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL / Qwen2.5-VL)."""
    from vlmprune.compiler.llm.evaluate import evaluate, table
    from vlmprune.compiler.output_files import check_output_file, write_file

    if report:
        check_output_file(report, force, (".json", ".html", ".htm"), "--report")
    if not bundles:
        methods, keeps = methods or ("cls",), keeps or ("64",)
    methods = _comma_list(methods)
    keeps = _comma_list(keeps, int, "--keep")
    with _stdout_for_data() as emit:
        data = evaluate(model, Path(images_dir), Path(prompts_file), methods, keeps, max_new_tokens,
                        _progress(quiet or as_json), list(bundles), image_size, grid)
        if report and report.suffix.lower() == ".json":
            write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
        elif report:
            from vlmprune.compiler.report import eval_html

            write_file(report, eval_html(data).encode(), force)
        if report:
            click.echo(f"report written to {report}", err=True)
        if as_json:
            emit(json.dumps(data, indent=2))
            return
    for line in table(data):
        click.echo(line)
    click.echo(f"({len(data['images'])} images x {len(data['prompts'])} prompts; dense: "
               f"{data['dense_image_tokens']} image tokens; harness check KL {data['harness_kl_max']:.2g})")
    starts = sorted(set(data["image_start"]))
    click.echo(f"(the image starts at prompt token {', '.join(map(str, starts))}: FastV's --image-start for "
               f"{'these prompts' if len(starts) == 1 else 'the prompts, in order of value'})")


if __name__ == "__main__":
    main()
