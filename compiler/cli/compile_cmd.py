"""`vlmprune compile`: a model into a bundle, with the method's, target's and family's declared flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.options as options
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors, progress_printer, stdout_for_data
from vlmprune.compiler.contract import DEFAULT_KEEP, DEFAULT_OPSET
from vlmprune.compiler.errors import VlmpruneError

KEEP = options.KeepType()
_LLM = api.llm_option_texts()  # --with-llm / --llm-exporter, from the declarations


@click.command()
@click.argument("model")
@click.option("--target", "-t", default=api.DEFAULT_TARGET, show_default=True,
              help="Deployment target (see `vlmprune targets`).")
@click.option("--method", "-m", default=api.DEFAULT_METHOD, show_default=True,
              help="Pruning method (see `vlmprune methods`).")
@click.option("--keep", "-k", type=KEEP, default=DEFAULT_KEEP, show_default=True,
              help="Tokens to keep (K), or auto: the largest K whose latency on the target fits --latency-ms.")
@click.option("--latency-ms", type=float, default=None,
              help="--keep auto: the latency budget, ms per call of the tower on the target's runtime (timed here).")
@click.option("--layer", "-l", type=int, default=None,
              help="Prune after this block (from 1), for methods that prune inside the tower. Default: the feature layer.")
@click.option("--no-prune", is_flag=True, help="Dense baseline in the same bundle format.")
@click.option("--batch", type=int, default=None, help="Static batch size. Default: dynamic batch.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="ONNX opset of the export.")
@click.option("--feature-layer", type=int, default=None, help="Override the model's vision_feature_layer.")
@options.family_options
@click.option("-o", "--output", type=options.NonEmptyPath(path_type=Path), default=Path("build"),
              show_default=True,
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
@options.extra_options
@one_line_errors
def compile(model, target, method, keep, latency_ms, layer, no_prune, batch, opset, feature_layer, output, force,
            as_json, quiet, timings, debug, cls_token, **extra):
    """Compile MODEL (a preset such as `demo`, a Hugging Face directory, or an .onnx tower) into a bundle."""
    family_options = {k.removeprefix("family_"): extra.pop(k) for k in list(extra) if k.startswith("family_")}
    llm = {name: extra.pop(name) for name in ("with_llm", "llm_exporter", "fastv_layer", "fastv_keep", "image_start")}
    cache = not extra.pop("no_cache")
    method_options, target_options = api.split_options({k.removeprefix("opt_"): v for k, v in extra.items()})
    if no_prune:
        _refuse_pruning_options(method_options)
    with stdout_for_data() as emit:
        result = api.compile(model, output, target=target, method=method, keep=keep, layer=layer, prune=not no_prune,
                             batch=batch, opset=opset, feature_layer=feature_layer, cls=cls_token,
                             method_options=method_options, target_options=target_options,
                             family_options=family_options, cache=cache, force=force, debug=debug,
                             progress=progress_printer(quiet or as_json), latency_ms=latency_ms, **llm)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
    if not as_json:
        echo_lines(render.compile_lines(result))
        if timings:
            echo_lines(render.timing_lines(result))
    if not result.passed:
        click.echo(f"error: parity failed (see {result.bundle / 'parity.json'})", err=True)
        sys.exit(1)


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
