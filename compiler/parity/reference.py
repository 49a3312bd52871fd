"""The parity references: what every stage of a bundle is compared against.

- A source with a torch model (presets, Hugging Face directories): PyTorch eager in fp32,
  the family adapter's dense pipeline with the method's plain-torch reference at its site
  (MethodPruner). Its dense output is the model's own image-feature path.
- An .onnx source has no torch model. The original graph is run with what the method
  needs exposed (block L's output, Q and K; or the token output), and the method's
  reference runs on those tensors, in fp64. Where only per-token ops lie between the
  pruning site and `image_features` (the site is the tower's end), that gives value
  references too: the whole output where nothing but slicing lies in between, and the
  rows the method copies (kept tokens) where a per-token op such as a LayerNorm does;
  merged rows are then left undefined (NaN, not compared).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import FEATURES, KEPT, KEPT_POSITIONS
from vlmprune.compiler.frontend import Source
from vlmprune.compiler.frontend.tower import BLOCK, FEATURES as FEATURES_SITE, SiteTensors
from vlmprune.passes.graph.dataflow import consumers_downstream, producers_upstream
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.base import Method
from vlmprune.passes.methods.crops import CropBudget
from vlmprune.passes.graph.structure import find_tower_structure
from vlmprune.targets.runtime import ort_session, run_session

@dataclasses.dataclass
class MethodPruner:
    """A method bound to its parameters, as the frontend's pipeline calls it at its site."""

    method: Method
    params: dict
    site: str
    layer: int | None

    def __call__(self, tensors: SiteTensors):
        result = self.method.reference(self.params, tensors)
        return result.tokens, result.kept, result.trace


@dataclasses.dataclass
class Reference:
    """Reference outputs by name, the method's trace (scores or greedy steps), and which method made them."""

    outputs: dict[str, np.ndarray]
    trace: dict | None = None
    method: Method | None = None
    params: dict | None = None


def pruner_for(record: dict) -> MethodPruner:
    method = get_method(record["method"])
    if "crops" in record["params"]:  # an anyres model's crops under one global budget
        method = CropBudget(method)
    return MethodPruner(method, record["params"], record["site"], record["layer"])


def dense_reference(source: Source, pixel: np.ndarray) -> Reference:
    """The dense pipeline's output on pixel: the model's own image-feature path."""
    with torch.inference_mode():
        return Reference({FEATURES: source.pipeline(torch.from_numpy(pixel)).numpy()})


def torch_reference(source: Source, record: dict | None, pixel: np.ndarray,
                    dense: Reference | None = None) -> tuple[Reference, Reference | None]:
    """(dense reference, pruned reference or None for a dense bundle) from the torch model.

    dense: the dense reference where it is at hand already (compiler.pipeline.cache), else computed here.
    """
    x = torch.from_numpy(pixel)
    dense = dense_reference(source, pixel) if dense is None else dense
    with torch.inference_mode():
        if record is None:
            return dense, None
        pruner = pruner_for(record)
        pipeline = source.pipeline.with_pruner(pruner)
        if pruner.site == FEATURES_SITE and hasattr(pipeline, "prune_features"):  # the tower's end: run it once
            feats, kept = pipeline.prune_features(torch.from_numpy(dense.outputs[FEATURES]), x)
        else:
            feats, kept = pipeline(x)
        outputs = {FEATURES: feats.numpy(), KEPT: kept.numpy()}
        if source.position_table is not None:  # the LLM positions of the reference's kept tokens
            outputs[KEPT_POSITIONS] = np.asarray(source.position_table)[kept.numpy()]
        return dense, Reference(outputs, _numpy(pipeline.last_trace), pruner.method, record["params"])


def onnx_reference(dense_path: Path, record: dict | None, pixel: np.ndarray, run_chunked) -> Reference:
    """The reference of an .onnx source, from its own (dense, output-normalised) graph; see the module docstring."""
    model = ir.load(dense_path)
    features = model.graph.outputs[0]
    if record is None:
        return Reference(run_chunked(lambda x: run_session(ort_session(dense_path), x))(pixel))
    pruner = pruner_for(record)
    structure = find_tower_structure(model.graph)
    exposed = [features]
    block = None
    if record["site"] == BLOCK:
        block = structure.blocks[record["layer"] - 1]
        exposed += [block.output, block.q, block.k]
    model.graph.outputs.extend(v for v in exposed if not v.is_graph_output())
    probe = dense_path.with_name(".probe.onnx")  # beside the weights it refers to
    ir.save(model, probe)
    try:
        out = run_chunked(lambda x: run_session(ort_session(probe), x))(pixel)
    finally:
        probe.unlink()
    dense = out[features.name]
    double = lambda name: torch.from_numpy(out[name]).double()  # noqa: E731
    if block is None:
        tensors = SiteTensors(double(features.name), record["has_cls"], prefix=record["prefix"])
    else:
        k = double(block.k.name)
        tensors = SiteTensors(double(block.output.name), record["has_cls"], double(block.q.name),
                              k.transpose(-1, -2) if block.k_transposed else k, block.scale,
                              torch.from_numpy(pixel).double(), structure.patch_size, record["prefix"])
    with torch.inference_mode():
        result = pruner.method.reference(record["params"], tensors)
    outputs = {KEPT: result.kept.numpy()}
    if block is None:
        outputs[FEATURES] = result.tokens.numpy().astype(dense.dtype)
    elif record["layer"] == len(structure.blocks):
        values = _end_of_tower(model, block, features, dense, result, pruner, record)
        if values is not None:
            outputs[FEATURES] = values
    return Reference(outputs, _numpy(result.trace), pruner.method, record["params"])


def _end_of_tower(model, block, features, dense, result, pruner: MethodPruner, record) -> np.ndarray | None:
    """Value reference for a BLOCK site after the last block (see the module docstring)."""
    path = token_path(block.output, features)
    if path is None:
        return None
    prefix = record["prefix"]
    kept_prefix = dense.shape[1] == record["num_patches"] + prefix and prefix > 0
    if path == "slice":  # image_features is the block output, its prefix perhaps sliced off
        tokens = result.tokens.numpy().astype(dense.dtype)
        return tokens if kept_prefix or not prefix else tokens[:, prefix:]
    copies = pruner.method.copied_rows(record["params"])
    patches = dense[:, prefix:] if kept_prefix else dense
    rows = np.take_along_axis(patches, result.kept.numpy()[:, :copies, None], axis=1)
    merged = pruner.method.output_tokens(record["params"]) - copies
    undefined = np.full((dense.shape[0], merged, dense.shape[2]), np.nan, dtype=dense.dtype)
    return np.concatenate(([dense[:, :prefix]] if kept_prefix else []) + [rows, undefined], axis=1)


# Ops that act on each token alone: gathering rows commutes with them (given the conditions in token_path).
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Erf", "Tanh", "Sigmoid", "Relu",
                "Gelu", "Cast", "Identity"}
_REDUCE_LAST = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2"}


def token_path(start: ir.Value, end: ir.Value) -> str | None:
    """How `end` follows from `start` ([B, T, D] each): "slice" (Slice along the tokens / Identity only),
    "per-token" (every op acts on each token row alone: elementwise ops, LayerNormalization fused or
    decomposed, reductions over the last axis, MatMul/Gemm by a constant), or None (anything else)."""
    region = [n for n in producers_upstream(end) if n in consumers_downstream(start)]
    if end.producer() is not None and end.producer() not in region:
        return None
    kind = "slice"
    for node in region:
        op = node.op_type
        if op == "Slice":
            axes = ir.convenience.get_const_tensor(node.inputs[3]) if len(node.inputs) > 3 else None
            if axes is None or axes.numpy().reshape(-1).tolist() not in ([1], [-2]):
                return None
            continue
        if op == "Identity":
            continue
        kind = "per-token"
        if op in _ELEMENTWISE or op == "LayerNormalization":
            if any(v is not None and v.shape is not None and len(v.shape) == 3 and v.shape[-2] not in (1, None)
                   and ir.convenience.get_const_tensor(v) is not None for v in node.inputs):
                return None  # a constant with a token axis: differs per token position
            continue
        if op in _REDUCE_LAST:
            axes = ir.convenience.get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
            axes = axes.numpy().reshape(-1).tolist() if axes is not None else list(node.attributes.get_ints("axes", []))
            if axes not in ([-1], [2]):
                return None
            continue
        if op in ("MatMul", "Gemm") and ir.convenience.get_const_tensor(node.inputs[1]) is not None:
            continue
        return None
    return kind


def _numpy(trace: dict | None) -> dict | None:
    """The trace with tensors as numpy arrays (parity works in numpy)."""
    if trace is None:
        return None
    out = {}
    for key, value in trace.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.double().numpy()
        elif key == "steps":
            out[key] = [(pick.numpy(), gap.double().numpy()) for pick, gap in value]
        else:
            out[key] = value
    return out
