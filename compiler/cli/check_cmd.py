"""`vlmprune check`: a bundle's parity again, against the reference, with its report and JUnit files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from vlmprune.compiler import api
import vlmprune.compiler.cli.render as render
from vlmprune.compiler.cli.boundary import echo_lines, one_line_errors, progress_printer, stdout_for_data


@click.command()
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
@one_line_errors
def check(bundle_dir, batch, report, junit, atol, rtol, cosine, force, as_json, quiet, engine, model, no_cache):
    """Re-run BUNDLE's parity against the PyTorch reference; exit 1 if any stage fails."""
    with stdout_for_data() as emit:
        result = api.check(bundle_dir, batch=batch, atol=atol, rtol=rtol, cosine=cosine, engine=engine, model=model,
                           cache=not no_cache, report=report, junit=junit, force=force,
                           progress=progress_printer(quiet or as_json))
        if report:
            click.echo(f"report written to {report}", err=True)
        if junit:
            click.echo(f"JUnit written to {junit}", err=True)
        if as_json:
            emit(json.dumps(result.to_json(), indent=2))
    if not as_json:
        echo_lines(render.check_lines(result))  # each stage with its figures and bounds
    if not result.passed:
        failed = [s.stage for s in result.stages if not s.passed]
        click.echo(f"error: parity failed at {', '.join(failed)}", err=True)
        sys.exit(1)
