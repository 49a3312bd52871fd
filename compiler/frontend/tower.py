"""The ViT tower as vlmprune runs it in torch: blocks 1..F, feature select, projector, and a pruner hook.

Every Hugging Face family whose tower is a stack of pre-norm ViT blocks (CLIP, SigLIP,
and the LLaVA models built on them) runs through VisionPipeline: the dense forward is
the model's own image-feature path (the parity reference of `--no-prune`, tested
against transformers' get_image_features), and with_pruner() runs a pruning method at
its site, handing it the tensors it needs (SiteTensors). The frontend knows nothing of
methods: a pruner is any callable with a site; compiler.reference builds them.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import nn

BLOCK, FEATURES = "block", "features"


@dataclasses.dataclass
class SiteTensors:
    """What a pruner gets at its site, all torch tensors of one batch."""

    hidden: torch.Tensor  # [B, (1)+N, D]
    has_cls: bool
    q: torch.Tensor | None = None  # [B, H, T, dh], block L's projected queries
    k: torch.Tensor | None = None  # [B, H, T, dh]
    scale: float | None = None  # the block's attention scale
    pixel_values: torch.Tensor | None = None  # [B, C, H, W], normalised
    patch_size: int | None = None


class Pruner(Protocol):
    """A pruning method bound to its parameters: where it runs, and what it returns there."""

    site: str  # BLOCK (after block `layer`) or FEATURES (after the projector)
    layer: int | None

    def __call__(self, tensors: SiteTensors) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(new tokens, kept patch indices [B, K'], trace for parity)."""


class Projector(nn.Module):
    """LLaVA's MLP projector (linear -> GELU -> linear); same parameter names as transformers'."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, bias: bool = True):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_hidden, bias=bias)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(d_hidden, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionPipeline(nn.Module):
    """pixel_values -> [blocks 1..F] -> feature select -> projector, with an optional pruner at its site.

    F is the LLaVA feature layer (blocks after it are never run). With a pruner, forward
    returns (features, kept_indices) and keeps the pruner's trace in last_trace.
    """

    def __init__(self, vision_model: nn.Module, projector: nn.Module | None, num_blocks: int,
                 drop_cls: bool, has_cls: bool, patch_size: int, pruner: Pruner | None = None):
        super().__init__()
        self.vision_model = vision_model
        self.projector = projector
        self.num_blocks = num_blocks
        self.drop_cls = drop_cls
        self.has_cls = has_cls
        self.patch_size = patch_size
        self.pruner = pruner
        self.last_trace: dict | None = None

    def with_pruner(self, pruner: Pruner | None) -> VisionPipeline:
        """The same weights, pruning (or not) as given."""
        return VisionPipeline(self.vision_model, self.projector, self.num_blocks, self.drop_cls, self.has_cls,
                              self.patch_size, pruner)

    def forward(self, pixel_values: torch.Tensor):
        vm, pruner = self.vision_model, self.pruner
        h = vm.embeddings(pixel_values)
        pre = getattr(vm, "pre_layrnorm", None)
        if pre is not None:
            h = pre(h)
        kept = None
        at_block = pruner is not None and pruner.site == BLOCK
        for i, layer in enumerate(vm.encoder.layers[: self.num_blocks], start=1):
            if at_block and i == pruner.layer:
                h, qk = _run_capturing_qk(layer, h)
                h, kept = self._prune(SiteTensors(h, self.has_cls, *qk, pixel_values, self.patch_size))
            else:
                h = _run(layer, h)
        has_cls = self.has_cls
        if self.drop_cls and has_cls:
            h, has_cls = h[:, 1:], False
        if self.projector is not None:
            h = self.projector(h)
        if pruner is not None and pruner.site == FEATURES:
            h, kept = self._prune(SiteTensors(h, has_cls, pixel_values=pixel_values, patch_size=self.patch_size))
        return h if pruner is None else (h, kept)

    def _prune(self, tensors: SiteTensors):
        tokens, kept, self.last_trace = self.pruner(tensors)
        return tokens, kept


def _run(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = layer(h, None)
    return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden_states,)


def _run_capturing_qk(layer: nn.Module, h: torch.Tensor):
    """Run a block and keep its own Q and K projections ([B, H, T, dh]) and scale: no recompute of the big matmuls.

    The pre-norm block of transformers' CLIP/SigLIP encoder layers with SDPA, spelled out
    (x + attn(LN1(x)), then + MLP(LN2(.))) so that Q and K are plain values: forward hooks
    would do the same in eager mode, but torch.compile (dynamo) does not run hooks
    registered inside forward, and the reference must compile as a user's model does
    (tools/bench_tower.py). Eager outputs are bit-identical to the layer's own forward.
    """
    attn = layer.self_attn
    b, t, _ = h.shape
    x = layer.layer_norm1(h)
    q, k, v = (proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scale)
    h = h + attn.out_proj(a.transpose(1, 2).reshape(b, t, -1))
    return h + layer.mlp(layer.layer_norm2(h)), (q, k, attn.scale)


class Exported(nn.Module):
    """The dense pipeline with its input named `pixel_values` for the exporter's dynamic_shapes."""

    def __init__(self, pipeline: VisionPipeline):
        super().__init__()
        self.pipeline = pipeline

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pipeline(pixel_values)
