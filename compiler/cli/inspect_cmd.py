"""`vlmprune inspect`, `targets` and `methods`: what a bundle holds, and what this installation offers."""

from __future__ import annotations

import json
from pathlib import Path

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors


@click.command()
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print the verified manifest and the op listing of model.onnx as JSON on stdout.")
@click.option("--ops", is_flag=True, help="Also list model.onnx's ops (role, and placement where the target reports it).")
@one_line_errors
def inspect(bundle_dir, as_json, ops):
    """Print BUNDLE's manifest readably (after checking every file's sha256)."""
    result = api.inspect(bundle_dir, ops=as_json or ops)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    echo_lines(render.inspect_lines(result))


@click.command()
def targets():
    """List the targets and whether each one's toolchain is available here."""
    echo_lines(render.targets_lines(api.targets()))


@click.command()
def methods():
    """List the pruning methods: what each needs from the model, its options, and how each target runs it."""
    for method in api.methods():
        echo_lines(render.method_lines(method))
    echo_lines(render.unavailable_lines(api.unavailable_methods()))
