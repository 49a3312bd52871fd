"""torch.onnx.export (dynamo) of a dense pipeline -> onnx_ir.Model, with constants folded."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from vlmprune.compiler.contract import FEATURES, PIXELS
from vlmprune.compiler.errors import VlmpruneError, failure_cause
from vlmprune.compiler.frontend.tower import Exported, VisionPipeline

# The exporter's per-node Python stack trace: the files and line numbers of the installed source. A bundle carrying
# it differs by where vlmprune (and torch, transformers) is installed and by any edit to a line above a traced one,
# and tells a device the build machine's paths. The scopes and class names the exporter also writes stay.
STACK_TRACE = "pkg.torch.onnx.stack_trace"


def export_onnx(pipeline: VisionPipeline, image_size: int, batch: int | None, opset: int,
                pixel_shape: tuple[int, ...] | None = None):
    """The dense pipeline as ONNX: input `pixel_values`, output `image_features`.

    batch=None exports a dynamic batch dimension (traced at batch 2 so that the exporter
    cannot specialise it to 1). pixel_shape: one image's input where it is not [3, S, S] (MiniCPM-V's sliced image,
    the processor's NaViT-packed patches [3, p, L·p]).
    """
    example = torch.zeros(batch or 2, *(pixel_shape or (3, image_size, image_size)))
    dynamic = None if batch else {PIXELS: {0: torch.export.Dim("batch", min=1, max=4096)}}
    return torch_onnx("torch.onnx export", Exported(pipeline.with_pruner(None)), (example,), input_names=[PIXELS],
                      output_names=[FEATURES], dynamic_shapes=dynamic, opset_version=opset)


def torch_onnx(what: str, module: torch.nn.Module, args: tuple, **kwargs):
    """torch.onnx.export (dynamo) of module -> onnx_ir.Model with constants folded, without the exporter's chatter.

    A failure is one line with its cause (errors.failure_cause), not the exporter's
    preamble; torch's own log of it (exportdb hints) is silenced, as it only repeats the
    error. The exporter's optimizer is off: it spends most of its time in pattern rewrites
    vlmprune does not need (23 of 40 s on ViT-L); constant folding is what the passes rely on.
    """
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            torch_log.setLevel(logging.CRITICAL)
            program = torch.onnx.export(module.eval(), args, dynamo=True, verbose=False, optimize=False, **kwargs)
    except Exception as exc:  # the exporter's failure is the user's to act on, in one line
        raise VlmpruneError(f"{what} failed: {failure_cause(exc)}") from exc
    finally:
        torch_log.setLevel(level)
    model = program.model
    without_stack_traces(model)
    fold_constants(model)
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    RemoveUnusedNodesPass()(model)
    return model


def without_stack_traces(model) -> None:
    """Drop STACK_TRACE from every node (subgraphs included): the same source exports the same bytes anywhere."""
    for node in model.graph.all_nodes():
        node.metadata_props.pop(STACK_TRACE, None)
