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

from vlmprune.compiler.contract import FEATURES, KEPT, KEPT_POSITIONS, NUM_TOKENS, SITE_FEATURES, PruneRecord
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import Source
from vlmprune.compiler.frontend.prompt_input import parity_text
from vlmprune.compiler.frontend.roi_input import parity_roi
from vlmprune.compiler.frontend.tower import BLOCK, SiteTensors
from vlmprune.passes.graph.dataflow import consumers_downstream, producers_upstream
from vlmprune.passes.methods import budget, coverage, get_method, relevance, schedule
from vlmprune.passes.methods.base import Method, PromptSiteTensors
from vlmprune.passes.methods.crops import CropBudget
from vlmprune.passes.methods.roi import forced_reference
from vlmprune.passes.graph.structure import find_tower_structure
from vlmprune.targets.runtime import ort_session, run_session, text_rows

@dataclasses.dataclass
class MethodPruner:
    """A method bound to its parameters, as the frontend's pipeline calls it at its site."""

    method: Method
    params: dict
    site: str
    layer: int | None
    forced: torch.Tensor | None = None  # --roi: F [B, N] of parity's ROI (forced_for)
    text: torch.Tensor | None = None  # text_embeds [B, T, D], for a method that reads the blocks too (--prompt-weight)
    layers: tuple[int, ...] | None = None  # --schedule: the blocks after which it is called in turn (tower.Pruner)

    def __call__(self, tensors: SiteTensors):
        tensors = with_forced(tensors, self.forced)
        if self.text is not None:
            fields = {f.name: getattr(tensors, f.name) for f in dataclasses.fields(tensors)}
            tensors = PromptSiteTensors(**{**fields, "text": self.text})
        result = self.method.reference(self.params, tensors)
        if not self.layers:
            return result.tokens, result.kept, result.trace
        # --schedule: called once per step; the last call's trace gains what each earlier step ranked
        if tensors.layer == self.layers[0]:
            self._earlier = []
        if tensors.layer != self.layers[-1]:
            self._earlier.append(result.trace)
            return result.tokens, result.kept, result.trace
        trace = {**result.trace, "step_scores": torch.stack([t["scores"] for t in self._earlier]),
                 "step_boundaries": [t["boundary"] for t in self._earlier]}
        return result.tokens, result.kept, trace

    @property
    def inside(self) -> bool:
        """Whether the method acts inside blocks 1..L (Method.in_blocks, Pruner.inside)."""
        return self.method.in_blocks

    def run_blocks(self, blocks, tensors: SiteTensors):
        result = self.method.reference_blocks(self.params, blocks, tensors)
        return result.tokens, result.kept, result.trace

    @property
    def later(self) -> bool:
        """Whether the method runs the blocks after its site (Method.later_blocks, Pruner.later)."""
        return self.method.later_blocks

    def run_later(self, blocks, tensors: SiteTensors):
        result = self.method.reference_later(self.params, blocks, tensors)
        return result.tokens, result.kept, result.trace

    @property
    def attention(self) -> bool:
        """Whether the method reads attention (at a FEATURES site: the last block's Q and K, Pruner.attention)."""
        return self.method.needs(self.params).attention


@dataclasses.dataclass
class Reference:
    """Reference outputs by name, the method's trace (scores or greedy steps), and which method made them."""

    outputs: dict[str, np.ndarray]
    trace: dict | None = None
    method: Method | None = None
    params: dict | None = None


def forced_for(record: PruneRecord | None, pixel: np.ndarray) -> torch.Tensor | None:
    """--roi: F [B, N] bool from parity's fixed-seed ROI (compiler.roi.parity_roi, what the runners feed), or None."""
    found = record.roi if record is not None else None
    forced = None if found is None else forced_reference(found, parity_roi(pixel, found["kind"],
                                                                           found.get("max_boxes")))
    if record is None:
        return forced
    return coverage.forced_reference(record.params, record.num_patches, forced, len(pixel))  # --coverage


def with_forced(tensors: SiteTensors, forced: torch.Tensor | None) -> SiteTensors:
    """The site's tensors with --roi's forced set (PromptSiteTensors.forced); unchanged without one."""
    if forced is None:
        return tensors
    fields = {f.name: getattr(tensors, f.name) for f in dataclasses.fields(tensors)}
    return PromptSiteTensors(**{**fields, "forced": forced})


def pruner_for(record: PruneRecord) -> MethodPruner:
    method = budget.wrap(get_method(record.method), record.params)  # --budget adaptive
    if "crops" in record.params:  # an anyres model's crops under one global budget
        method = CropBudget(method)
    method = schedule.wrap(method, record.params, record.num_patches)  # --schedule: in steps
    steps = tuple(s["layer"] for s in record.steps) if record.steps is not None else None
    return MethodPruner(method, record.params, record.site, record.layer, layers=steps)


def dense_reference(source: Source, pixel: np.ndarray) -> Reference:
    """The dense pipeline's output on pixel: the model's own image-feature path."""
    with torch.inference_mode():
        return Reference({FEATURES: source.pipeline(torch.from_numpy(pixel)).numpy()})


def torch_reference(source: Source, record: PruneRecord | None, pixel: np.ndarray,
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
        pruner.forced = forced_for(record, pixel)
        pipeline = source.pipeline.with_pruner(pruner)
        needs = pruner.method.needs(record.params)
        if relevance.weight(record.params) > 0:  # --prompt-weight: the method's own path, and the prompt
            pruner.text = torch.from_numpy(parity_text(pixel, dense.outputs[FEATURES].shape[-1]))
        if needs.tower_features or needs.text and pruner.text is None:  # the feature layer and text_embeds too
            feats, kept, pipeline.last_trace = prompt_site(source.pipeline, pruner, dense.outputs[FEATURES], pixel)
        # The tower's end: run it once, unless the method reads the last block's attention, which only forward has.
        elif pruner.site == SITE_FEATURES and hasattr(pipeline, "prune_features") and not pruner.attention:
            feats, kept = pipeline.prune_features(torch.from_numpy(dense.outputs[FEATURES]), x)
        else:
            feats, kept = pipeline(x)
        outputs = {FEATURES: feats.numpy(), KEPT: kept.numpy()}
        if "num_tokens" in (pipeline.last_trace or {}):  # K varies per image: the padded rows are zero
            outputs.update(padded_outputs(outputs[FEATURES], pruner.method.output_tokens(record.params),
                                          pipeline.last_trace["num_tokens"]))
        if source.position_table is not None:  # the LLM positions of the reference's kept tokens
            outputs[KEPT_POSITIONS] = np.asarray(source.position_table)[kept.numpy()]
        return dense, Reference(outputs, _numpy(pipeline.last_trace), pruner.method, record.params)


def padded_outputs(features: np.ndarray, slots: int, count) -> dict[str, np.ndarray]:
    """A variable-K reference's image_features with the rows after each image's valid ones zeroed (the projector
    after a BLOCK site makes the method's zero rows non-zero, as passes.outputs.ZeroPaddingPass undoes in the
    graph), and num_tokens: the valid rows, a prefix the output keeps ([CLS]) included."""
    lead = features.shape[1] - slots  # slots: the method's output rows, K_max (+ extras), prefix left out
    rows = np.asarray(count, dtype=np.int64) + lead
    valid = np.arange(features.shape[1])[None, :] < rows[:, None]
    return {FEATURES: features * valid[..., None].astype(features.dtype), NUM_TOKENS: rows}


@dataclasses.dataclass
class _Capture:
    """A pruner that prunes nothing: it keeps the hidden states after block `layer` (the feature layer)."""

    layer: int
    site: str = BLOCK
    hidden: torch.Tensor | None = None

    def __call__(self, tensors: SiteTensors):
        self.hidden = tensors.hidden
        return tensors.hidden, torch.zeros(tensors.hidden.shape[0], 0, dtype=torch.long), {}


def prompt_site(pipeline, pruner: MethodPruner, dense: np.ndarray, pixel: np.ndarray,
                text: np.ndarray | None = None):
    """A FEATURES-site method that also reads the feature layer's hidden states and text_embeds, in fp64.

    text: the prompt's rows ([T, D] for every image, or [B, T, D]) as a bundle's runner is fed them; None: parity's
    fixed-seed rows (parity_text).

    fp64 so that parity names the greedy step where the fp32 graph parts from exact arithmetic
    (its margin), rather than comparing two fp32 roundings. The kept rows are copies: exact in fp32 again.
    """
    name, needs = pruner.method.name, pruner.method.needs(pruner.params)
    if pruner.site != SITE_FEATURES or needs.tower_features and not hasattr(pipeline, "num_blocks"):
        raise InputError(f"method {name} needs the feature layer's hidden states, which this model's pipeline does "
                         "not give (a ViT tower pipeline does: LLaVA, CLIP, SigLIP, DINOv2)")
    capture = _Capture(getattr(pipeline, "num_blocks", 0))
    if needs.tower_features:
        pipeline.with_pruner(capture)(torch.from_numpy(pixel))
    prefix = 0 if getattr(pipeline, "drop_cls", True) else pipeline.prefix
    # text_embeds is as wide as the projector output (the LLM's width): what the graph's input takes
    needs_text = needs.text
    if needs_text:
        rows = parity_text(pixel, dense.shape[-1]) if text is None else text_rows(text, len(pixel), dense.shape[-1])
    text = torch.from_numpy(rows).double() if needs_text else None
    tensors = PromptSiteTensors(torch.from_numpy(dense).double(), getattr(pipeline, "has_cls", False) and prefix > 0,
                                prefix=prefix,
                                features=None if capture.hidden is None else capture.hidden.double(), text=text)
    result = pruner.method.reference(pruner.params, tensors)
    return result.tokens.to(torch.from_numpy(dense).dtype), result.kept, result.trace


def onnx_reference(dense_path: Path, record: PruneRecord | None, pixel: np.ndarray, run_chunked) -> Reference:
    """The reference of an .onnx source, from its own (dense, output-normalised) graph; see the module docstring."""
    model = ir.load(dense_path)
    features = model.graph.outputs[0]
    if record is None:
        return Reference(run_chunked(lambda x: run_session(ort_session(dense_path), x))(pixel))
    pruner = pruner_for(record)
    structure = find_tower_structure(model.graph)
    exposed = [features]
    block = None
    if record.site == BLOCK:
        block = structure.blocks[record.layer - 1]
        exposed += [block.output, block.q, block.k]
    last = structure.blocks[-1].output if pruner.method.needs(record.params).tower_features else None
    if last is not None:
        exposed.append(last)
    # A FEATURES method that reads attention (holov): the last block's Q and K, the feature layer's.
    qk_block = structure.blocks[-1] if block is None and pruner.method.needs(record.params).attention else None
    if qk_block is not None:
        exposed += [qk_block.q, qk_block.k]
    model.graph.outputs.extend(v for v in exposed if not v.is_graph_output())
    probe = dense_path.with_name(".probe.onnx")  # beside the weights it refers to
    ir.save(model, probe)
    try:
        out = run_chunked(lambda x: run_session(ort_session(probe), x))(pixel)
    finally:
        probe.unlink()
    dense = out[features.name]
    double = lambda name: torch.from_numpy(out[name]).double()  # noqa: E731
    needs_text = pruner.method.needs(record.params).text
    if block is None and (last is not None or needs_text):  # a prompt-aware method (see prompt_site)
        text = torch.from_numpy(parity_text(pixel, dense.shape[-1])).double() if needs_text else None
        tensors = PromptSiteTensors(double(features.name), record.has_cls, prefix=record.prefix,
                                    features=None if last is None else double(last.name), text=text)
    elif block is None:
        qk = () if qk_block is None else (double(qk_block.q.name), double(qk_block.k.name), qk_block.scale)
        if qk and qk_block.k_transposed:
            qk = (qk[0], qk[1].transpose(-1, -2), qk[2])
        tensors = SiteTensors(double(features.name), record.has_cls, *qk, prefix=record.prefix)
    else:
        k = double(block.k.name)
        tensors = SiteTensors(double(block.output.name), record.has_cls, double(block.q.name),
                              k.transpose(-1, -2) if block.k_transposed else k, block.scale,
                              torch.from_numpy(pixel).double(), structure.patch_size, record.prefix)
    with torch.inference_mode():
        result = pruner.method.reference(record.params, with_forced(tensors, forced_for(record, pixel)))
    outputs = {KEPT: result.kept.numpy()}
    if "num_tokens" in result.trace:  # the rows of image_features: the prefix the dense output keeps counts in them
        lead = dense.shape[1] - record.num_patches if dense.shape[1] > record.num_patches else 0
        outputs[NUM_TOKENS] = (result.trace["num_tokens"].numpy() + lead).astype(np.int64)
    if block is None:
        outputs[FEATURES] = result.tokens.numpy().astype(dense.dtype)
    elif record.layer == len(structure.blocks) and ("num_tokens" not in result.trace
                                                       or token_path(block.output, features) == "slice"):
        # A variable K's rows sit at per-image places: copied rows from the dense output define none of them.
        values = _end_of_tower(model, block, features, dense, result, pruner, record)
        if values is not None:
            outputs[FEATURES] = values
    return Reference(outputs, _numpy(result.trace), pruner.method, record.params)


def _end_of_tower(model, block, features, dense, result, pruner: MethodPruner,
                  record: PruneRecord) -> np.ndarray | None:
    """Value reference for a BLOCK site after the last block (see the module docstring)."""
    path = token_path(block.output, features)
    if path is None:
        return None
    prefix = record.prefix
    kept_prefix = dense.shape[1] == record.num_patches + prefix and prefix > 0
    if path == "slice":  # image_features is the block output, its prefix perhaps sliced off
        tokens = result.tokens.numpy().astype(dense.dtype)
        return tokens if kept_prefix or not prefix else tokens[:, prefix:]
    copies = pruner.method.copied_rows(record.params)
    patches = dense[:, prefix:] if kept_prefix else dense
    rows = np.take_along_axis(patches, result.kept.numpy()[:, :copies, None], axis=1)
    merged = pruner.method.output_tokens(record.params) - copies
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
