"""The ViT tower as vlmprune runs it in torch: blocks 1..F, feature select, projector, and a pruner hook.

Every Hugging Face family whose tower is a stack of pre-norm ViT blocks (CLIP, SigLIP, ViT,
DINOv2, and the LLaVA models built on them) runs through VisionPipeline: the dense forward
is the model's own image-feature path (the parity reference of `--no-prune`, tested
against transformers), and with_pruner() runs a pruning method at its site, handing it the
tensors it needs (SiteTensors, a plain record in compiler.contract). A family adapter says how its modules are laid out
(TowerParts: the embeddings, the blocks and, per block, its norms, projections and layer
scales); the block arithmetic is the same for all of them, written here once. The frontend
knows nothing of methods: a pruner is any callable with a site; compiler.parity.reference builds them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from vlmprune.compiler.contract import SITE_BLOCK as BLOCK, SITE_FEATURES as FEATURES  # the pruning sites
from vlmprune.compiler.contract import SiteTensors  # what a pruner gets: a plain record (re-exported)


@dataclasses.dataclass
class PoolingHead:
    """An attention-pooling head (SigLIP's MAP head): one learned probe query attending over norm(tokens).

    The tensors are the head's own (views of its nn.MultiheadAttention in-projection), so the
    reference and the graph read the checkpoint's weights; `norm` is what the head's keys are
    computed from (SigLIP: post_layernorm, applied to last_hidden_state before the head).
    """

    probe: torch.Tensor  # [D]
    q_weight: torch.Tensor  # [D, D]
    q_bias: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D, D]
    k_bias: torch.Tensor  # [D]
    heads: int
    norm: nn.LayerNorm


class BlockRunner(Protocol):
    """One block of the tower, as a pruner that acts inside the blocks runs it (run_block bound to the block)."""

    def __call__(self, h: torch.Tensor, capture: bool = False, bias: torch.Tensor | None = None,
                 between: Callable | None = None) -> tuple[torch.Tensor, tuple | None]:
        ...


class Pruner(Protocol):
    """A pruning method bound to its parameters: where it runs, and what it returns there."""

    site: str  # BLOCK (after block `layer`) or FEATURES (after the projector)
    layer: int | None
    # Optional, read with getattr (default False): `attention`, a FEATURES pruner that reads the last block's Q, K;
    # `inside`, a BLOCK pruner that acts inside blocks 1..layer (token merging): the pipeline hands it those blocks
    # to run (run_blocks) instead of calling it on block L's output.
    # Optional, read with getattr (default (layer,)): `layers`, the blocks after which a BLOCK pruner is called in
    # turn (progressive pruning); each call gets the patch indices the previous one kept (SiteTensors.patch_ids).
    # Optional, read with getattr (default False): `later`, a BLOCK pruner that runs the blocks after `layer` itself
    # (run_later) on a layout of its own and hands back the dense layout; the pipeline then keeps the rows `kept`
    # of the tail's output (the in-encoder temporal drop of a clip).

    def run_later(self, blocks: list[BlockRunner], tensors: SiteTensors) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """With `later`: block `layer`'s output in tensors.hidden, the blocks after it to run: (the last block's
        output in the dense layout, the feature rows kept [B, K], trace)."""

    def run_blocks(self, blocks: list[BlockRunner], tensors: SiteTensors) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """With `inside`: run blocks 1..layer on tensors.hidden (the embeddings): (tokens, kept, trace)."""

    def __call__(self, tensors: SiteTensors) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(new tokens, kept patch indices [B, K'], trace for parity)."""


@dataclasses.dataclass
class BlockParts:
    """One pre-norm block: x + s1 · O(attn(N1(x))), then + s2 · MLP(N2(.)). Layer scales s1, s2 are optional."""

    norm1: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    out: nn.Module
    heads: int
    scale: float
    norm2: nn.Module
    mlp: nn.Module
    scale1: nn.Module | None = None
    scale2: nn.Module | None = None


@dataclasses.dataclass
class TowerParts:
    """A family's tower as VisionPipeline runs it."""

    module: nn.Module  # the transformer (its config is module.config)
    embed: Callable[[torch.Tensor], torch.Tensor]  # pixels -> tokens, position embeddings added
    blocks: list[nn.Module]
    parts: Callable[[nn.Module], BlockParts]
    final_norm: nn.Module | None = None  # applied after the last block (the family's last_hidden_state)
    head: PoolingHead | None = None  # an attention-pooling head (SigLIP's), for methods that score with it


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
    """pixel_values -> [blocks 1..F] (-> final norm) -> feature select -> projector, with an optional pruner.

    F is the feature layer (blocks after it are never run); the final norm runs only when F
    is the last block and the family's features are its normed output (final_norm). With a
    pruner, forward returns (features, kept_indices) and keeps the pruner's trace in last_trace.
    frames: a video pipeline's frames per clip (its features are that many frames of rows, frame by frame); the
    FEATURES-site pruner is told it, since a temporal method (evs, dycoke) compares frame with frame and, told 1,
    would rank the whole clip as one frame.
    """

    def __init__(self, tower: TowerParts, projector: nn.Module | None, num_blocks: int, drop_cls: bool,
                 has_cls: bool, patch_size: int, prefix: int | None = None, final_norm: bool = False,
                 pruner: Pruner | None = None, frames: int = 1):
        super().__init__()
        self.tower = tower
        self.vision_model = tower.module
        self.projector = projector
        self.num_blocks = num_blocks
        self.drop_cls = drop_cls
        self.has_cls = has_cls
        self.prefix = int(has_cls) if prefix is None else prefix
        self.patch_size = patch_size
        self.final_norm = final_norm and tower.final_norm is not None and num_blocks == len(tower.blocks)
        self.pruner = pruner
        self.frames = frames
        self.last_trace: dict | None = None

    def with_pruner(self, pruner: Pruner | None) -> VisionPipeline:
        """The same weights, pruning (or not) as given."""
        return VisionPipeline(self.tower, self.projector, self.num_blocks, self.drop_cls, self.has_cls,
                              self.patch_size, self.prefix, self.final_norm, pruner, self.frames)

    def forward(self, pixel_values: torch.Tensor):
        tower, pruner = self.tower, self.pruner
        h = tower.embed(pixel_values)
        kept = None
        at_block = pruner is not None and pruner.site == BLOCK
        # A FEATURES-site pruner that reads attention (Pruner.attention) gets the last block's Q and K.
        wants_qk = pruner is not None and pruner.site == FEATURES and getattr(pruner, "attention", False)
        qk_last = None
        first = 1
        if at_block and getattr(pruner, "inside", False):  # the pruner runs blocks 1..L itself (Pruner.inside)
            runners = [functools.partial(run_block, tower.parts(layer)) for layer in tower.blocks[: pruner.layer]]
            h, kept, self.last_trace = pruner.run_blocks(runners, SiteTensors(
                h, self.has_cls, pixel_values=pixel_values, patch_size=self.patch_size, prefix=self.prefix,
                head=tower.head))
            first = pruner.layer + 1
        # The blocks after which a BLOCK pruner is called (Pruner.layers: several for a progressive schedule).
        steps = tuple(getattr(pruner, "layers", None) or (pruner.layer,)) if at_block and first == 1 else ()
        later = at_block and getattr(pruner, "later", False)  # Pruner.later: it runs the blocks after its site
        for i, layer in enumerate(tower.blocks[first - 1: self.num_blocks], start=first):
            capture = i in steps or wants_qk and i == self.num_blocks
            h, qk = run_block(tower.parts(layer), h, capture)
            if capture and not at_block:
                qk_last = qk
            elif capture and later:
                runners = [functools.partial(run_block, tower.parts(rest)) for rest in tower.blocks[i: self.num_blocks]]
                h, kept, self.last_trace = pruner.run_later(runners, SiteTensors(
                    h, self.has_cls, *qk, pixel_values, self.patch_size, self.prefix, tower.head, layer=i))
                break
            elif capture:
                h, kept = self._prune(SiteTensors(h, self.has_cls, *qk, pixel_values, self.patch_size, self.prefix,
                                                  tower.head, layer=i, patch_ids=kept))
        if self.final_norm:
            h = tower.final_norm(h)
        prefix = self.prefix
        if self.drop_cls and prefix:
            h, prefix = h[:, prefix:], 0
        if self.projector is not None:
            h = self.projector(h)
        if pruner is not None and pruner.site == FEATURES:
            h, kept = self.prune_features(h, pixel_values, qk_last)
        if later:  # the tail ran on the dense layout again: its rows of the kept tokens
            h = torch.gather(h, 1, kept[..., None].expand(-1, -1, h.shape[-1]))
        return h if pruner is None else (h, kept)

    def prune_features(self, features: torch.Tensor, pixel_values: torch.Tensor, qk: tuple | None = None):
        """The pruner at the FEATURES site, on features the dense forward gave: (tokens, kept).

        What forward runs there; the parity reference calls it on the dense reference's
        output, so that the tower runs once for both references (compiler.parity.reference).
        qk: the last block's (Q, K, scale), for a pruner that reads attention (forward passes it).
        """
        prefix = 0 if self.drop_cls else self.prefix
        q, k, scale = qk if qk is not None else (None, None, None)
        return self._prune(SiteTensors(features, self.has_cls and prefix > 0, q, k, scale, pixel_values=pixel_values,
                                       patch_size=self.patch_size, prefix=prefix, frames=self.frames))

    def _prune(self, tensors: SiteTensors):
        tokens, kept, self.last_trace = self.pruner(tensors)
        return tokens, kept


def run_block(parts: BlockParts, h: torch.Tensor, capture: bool = False, bias: torch.Tensor | None = None,
              between: Callable | None = None):
    """One pre-norm block; with capture, also its own Q and K ([B, H, T, dh]) and attention scale.

    For a pruner that acts inside the blocks (Pruner.inside): bias is added to the attention logits
    (broadcast to [B, H, T, T]), and between(h, k) replaces the residual stream between the attention
    and the MLP (k: the block's keys [B, H, T, dh]).

    Spelled out rather than calling the layer with hooks on its projections: forward hooks
    registered inside forward are not run under torch.compile (dynamo), and the reference
    must compile as a user's model does (tools/bench_tower.py). SDPA, as the towers are
    loaded with; eager outputs are bit-identical to the layer's own forward (tested per family).
    """
    b, t, _ = h.shape
    x = parts.norm1(h)
    q, k, v = (proj(x).view(b, t, parts.heads, -1).transpose(1, 2) for proj in (parts.q, parts.k, parts.v))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=parts.scale)
    a = parts.out(a.transpose(1, 2).reshape(b, t, -1))
    h = h + (parts.scale1(a) if parts.scale1 is not None else a)
    if between is not None:
        h = between(h, k)
    m = parts.mlp(parts.norm2(h))
    h = h + (parts.scale2(m) if parts.scale2 is not None else m)
    return h, ((q, k, parts.scale) if capture else None)


class Exported(nn.Module):
    """The dense pipeline with its input named `pixel_values` for the exporter's dynamic_shapes."""

    def __init__(self, pipeline: VisionPipeline):
        super().__init__()
        self.pipeline = pipeline

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pipeline(pixel_values)
