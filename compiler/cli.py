"""The `vlmprune` command line: one thin command per verb over the library."""

from __future__ import annotations

import contextlib
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
    code 1 and how to see the traceback (VLMPRUNE_DEBUG=1 re-raises it).
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VlmpruneError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was written", err=True)
            sys.exit(130)
        except (SystemExit, click.exceptions.Exit, click.ClickException):
            raise
        except Exception as exc:
            if os.environ.get("VLMPRUNE_DEBUG"):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            click.echo(f"error: internal error ({type(exc).__name__}: {first}); this is a vlmprune bug: "
                       "rerun with VLMPRUNE_DEBUG=1 for the traceback and report it", err=True)
            sys.exit(1)
    return wrapper


@contextlib.contextmanager
def _stdout_for_data(enabled: bool):
    """While enabled, everything but the data goes to stderr: file descriptor 1 is pointed at stderr
    (native libraries, e.g. QNN's `# LIBNATIVE:` line) and so is sys.stdout (stray prints).
    Yields the writer for the data itself, the one thing that reaches the real stdout."""
    if not enabled:
        yield click.echo
        return
    original = sys.stdout
    original.flush()
    try:
        real = original.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a captured stream (click's test runner)
        real = False
    saved = os.dup(1)
    os.dup2(2, 1)
    data = os.fdopen(os.dup(saved), "w") if real else original
    sys.stdout = sys.stderr
    try:
        yield lambda text: (data.write(text + "\n"), data.flush())
    finally:
        sys.stderr.flush()
        sys.stdout = original
        os.dup2(saved, 1)
        os.close(saved)
        if real:
            data.close()


def _progress(quiet: bool):
    return (lambda _m: None) if quiet else (lambda m: click.echo(m, err=True))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("build"), show_default=True,
              help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--debug", is_flag=True, help="If a fusion does not fire, print why each near-match failed.")
@click.option("--cls", "cls_token", type=click.Choice(["drop", "keep"]), default=None,
              help="Drop or keep the [CLS] token in image_features. Default: the model's select strategy "
                   "(LLaVA's vision_feature_select_strategy; towers without one drop it, like LLaVA's default).")
@_extra_options
@_one_line_errors
def compile(model, target, method, keep, layer, no_prune, batch, opset, feature_layer, output, force, as_json, quiet,
            debug, cls_token, **extra):
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle."""
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    method_options, target_options = _split_options(extra)
    options = CompileOptions(target=target, method=method, keep=keep, layer=layer, prune=not no_prune, batch=batch,
                             opset=opset, feature_layer=feature_layer, force=force, debug=debug, cls=cls_token,
                             method_options=method_options, target_options=target_options)
    with _stdout_for_data(as_json) as emit:
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


def _later(method: dict) -> str:
    n = method["num_blocks"] - method["layer"]
    return (f"the {n} later blocks run on {method['tokens_out']} tokens" if n > 1 else
            f"the last block runs on {method['tokens_out']} tokens")


def _print_summary(manifest: dict, result) -> None:
    method = manifest["method"]
    if method["name"] == "none":
        click.echo("tokens: dense (no pruning)")
    elif method["site"] == "block":
        where = (f"at the tower's end (after block {method['layer']}/{method['num_blocks']})"
                 if method["layer"] == method["num_blocks"] else
                 f"after block {method['layer']}/{method['num_blocks']}; " + _later(method))
        click.echo(f"tokens: {method['num_patches']} patch tokens -> {method['summary'].split(' (')[0]} ({where})")
    else:
        click.echo(f"tokens: {method['num_patches']} tokens -> {method['summary'].split(' (')[0]} "
                   "(on the projector output)")
    for name, stage in manifest["parity"]["stages"].items():
        figures = []
        if "cosine_min" in stage:
            figures.append(f"cosine {stage['cosine_min']:.7f}")
        if "max_abs" in stage:
            figures.append(f"max-abs {stage['max_abs']:.2e}")
        if "index_agreement" in stage:
            figures.append(f"kept-index agreement {stage['index_agreement']:.4f}")
            if stage.get("tie_resolved_images"):
                images = ", ".join(map(str, stage["tie_resolved_images"]))
                why = ("it diverges at a greedy step whose two best candidates tie" if "first_divergent_step" in stage
                       else "every differing index lies in the K-th boundary tie band")
                figures.append(f"image {images}: {why}")
        status = "PASS" if stage["passed"] else "FAIL"
        click.echo(f"parity {name:<10} {status}  {', '.join(figures)}" + (f"  {stage['error']}" if "error" in stage else ""))
    _print_placement_summary(manifest)
    click.echo(f"bundle: {result.bundle} ({result.seconds:.1f}s)")


def _print_placement_summary(manifest: dict) -> None:
    from vlmprune.targets.placement import summary_line

    for name, summary in manifest["target"].get("placement_summary", {}).items():
        click.echo(summary_line(name, summary))


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--batch", type=int, default=None, help="Parity batch (dynamic-batch bundles; default 2).")
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Also write the parity report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the full parity report as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--engine", is_flag=True, help="TensorRT bundles: require the engine stage (run on the device).")
@_one_line_errors
def check(bundle_dir, batch, report, as_json, quiet, engine):
    """Re-run BUNDLE's parity against the PyTorch reference; exit 1 if any stage fails."""
    from vlmprune.compiler.pipeline import check_bundle

    if engine:
        from vlmprune.targets.tensorrt import require_engine

        require_engine(bundle_dir)
    with _stdout_for_data(as_json) as emit:
        result = check_bundle(bundle_dir, batch, _progress(quiet or as_json))
        if engine and "engine" not in [s.stage for s in result.stages]:
            raise VlmpruneError("the engine stage did not run (see the progress lines above)")
        data = result.to_json()
        if report:
            report.write_text(json.dumps(data, indent=2) + "\n")
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
@_one_line_errors
def inspect(bundle_dir):
    """Print BUNDLE's manifest readably (after checking every file's sha256)."""
    from vlmprune.compiler.bundle import load_manifest

    m = load_manifest(bundle_dir, verify=True)
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


@main.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--image", "image_files", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image file; repeat it to fill a static batch (one image per batch slot).")
@_one_line_errors
def run(bundle_dir, image_files):
    """Run BUNDLE on IMAGE with its target's runtime here (ort, the qnn emulator, an engine on a Jetson)."""
    import numpy as np

    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.frontend.images import UPSCALE_WARNING, load_image_file
    from vlmprune.targets import get_target

    m = load_manifest(bundle_dir, verify=True)
    static = m["target"].get("batch") or m["inputs"][0]["shape"][0]
    if isinstance(static, int) and static != len(image_files):
        raise VlmpruneError(f"this bundle has a static batch of {static}: pass --image {static} times "
                            f"(got {len(image_files)}), or recompile with --batch {len(image_files)}")
    runner, runtime = get_target(m["target"]["name"]).runner(Path(bundle_dir), m)
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
    click.echo(f"({runtime})")
    outputs = runner(np.concatenate(batch))
    for name, value in outputs.items():
        click.echo(f"{name}: shape {list(value.shape)} dtype {value.dtype}")
    if "kept_indices" in outputs:
        click.echo("kept (image 0): " + " ".join(map(str, outputs["kept_indices"][0].tolist())))


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
        for option, (_kind, text) in method.options.items():
            click.echo(f"  --{option}: {text.split(': ', 1)[-1]}")
        rows = []
        for target_name, target_cls in TARGETS.items():
            target = target_cls()
            refused = target.refusal(method)
            if refused:
                rows.append(f"{target_name} refuses it ({refused})")
                continue
            fused = [op for op, spelling in target.spellings.items() if method.fusion_rules({op: spelling})]
            parts = [] if target.formulation(method) == "standard" else [target.formulation(method)]
            parts += [f"fused into {', '.join(fused)}"] if fused else []
            rows.append(f"{target_name} ({', '.join(parts) or 'standard ops'})")
        click.echo("  targets:  " + ", ".join(rows))
        if method.official:
            click.echo(f"  official: {method.official}")


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


if __name__ == "__main__":
    main()
