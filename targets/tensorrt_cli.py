"""`vlmprune build-engine`: the command the TensorRT targets (orin, xavier) add to the CLI (Target.commands).

It lives beside the target, not in the CLI: only a TensorRT bundle has an engine to build,
and the CLI names no target. Its options and help are declared here; the CLI runs it through the
API (api.build_engine, api.target_command), which gives the callback `log` for its lines as it
works and prints the lines it returns, inside the CLI's one-line error boundary.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("build-engine")
@click.argument("bundle_dir", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp16", "int8"]), default=None,
              help="Default: the bundle's (fp16; int8 for a bundle compiled with --precision int8).")
@click.option("--calibration-cache", type=click.Path(dir_okay=False), default=None,
              help="A TensorRT INT8 calibration cache (implicit quantization).")
@click.option("--decomposed", is_flag=True, help="Build model.decomposed.onnx (no plugin) instead of model.onnx.")
@click.option("--workspace", type=int, default=None, help="Builder workspace limit in MiB.")
@click.option("--output", default=None, help="Engine file name inside the bundle (default model.engine).")
@click.option("--print-command", is_flag=True, help="Only print the equivalent trtexec command.")
def build_engine(bundle_dir, precision, calibration_cache, decomposed, workspace, output, print_command,
                 log=click.echo) -> list[str]:
    """Build BUNDLE's TensorRT engine on this device (orin/xavier bundles) and print the trtexec equivalent."""
    import vlmprune.targets.trt_engine as engine

    if print_command:
        manifest = engine.load_bundle(bundle_dir)
        cmd = engine.trtexec_command(manifest, precision, decomposed, output or engine.ENGINE, calibration_cache)
        return [engine.format_command(cmd)]
    engine.build_engine(bundle_dir, precision, decomposed, output, workspace, calibration_cache, log=log)
    return []
