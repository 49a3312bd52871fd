"""torch.onnx.export (dynamo) of a dense pipeline -> onnx_ir.Model, with constants folded."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import threading
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
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), \
                one_torchlib_registry():
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


_REGISTRY_LOCK = threading.Lock()


@contextlib.contextmanager
def one_torchlib_registry():
    """Within the block, each torch.onnx export builds its ATen-to-ONNX registry from one made per opset.

    The exporter rebuilds that registry from torchlib for every export, re-parsing the source of every torchlib
    function: about 0.5 s on a 2-core Xeon, a quarter of a tiny CLIP tower's export (1.3-1.6 s instead of 1.8-2.1 s
    after the first), paid three times by a compile --with-llm (tower, prefill, decode) and once per export by a
    sweep or a test run. The table depends only on the opset and the installed
    torch/onnxscript, so one is built and each export gets its own copy of the table (what it could register into
    stays its own). Where the installed torch has no such method (the exporter's private layout moved), nothing
    changes and every export builds its own, as before.
    """
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    registry_class = getattr(_registration, "ONNXRegistry", None)
    original = vars(registry_class).get("from_torchlib") if registry_class is not None else None
    if not isinstance(original, classmethod):
        yield
        return
    build = original.__get__(None, registry_class)

    def from_torchlib(*args, **kwargs):
        made = _registry_for(build, *args, **kwargs)
        own = copy.copy(made)  # whatever else the registry holds (its opset), as built
        own.functions = {target: list(decomps) for target, decomps in made.functions.items()}
        return own

    with _REGISTRY_LOCK:
        registry_class.from_torchlib = staticmethod(from_torchlib)
        try:
            yield
        finally:
            registry_class.from_torchlib = original


@functools.lru_cache(maxsize=4)
def _registry_for(build, *args, **kwargs):
    return build(*args, **kwargs)


def without_stack_traces(model) -> None:
    """Drop STACK_TRACE from every node (subgraphs included): the same source exports the same bytes anywhere."""
    for node in model.graph.all_nodes():
        node.metadata_props.pop(STACK_TRACE, None)
