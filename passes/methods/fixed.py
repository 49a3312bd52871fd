"""Baselines whose kept set is a graph constant: the same K patches for every image and batch row.

`random` and `grid` compare methods against "keep any K" and "keep a uniform grid": they are
reference points for accuracy tables, not pruning methods one would deploy. Nothing is scored:
the emission is one Gather with constant indices (ascending, raster order), and kept_indices is
that constant broadcast over the batch. The prefix tokens ([CLS], registers) pass through, as
divprune and dart pass them. Either site: `--site block` (after block L, --layer; default) or
`--site features` (the projector output, the tower's end).

Every node has the "tokens" role: no node decides which patches are kept, so nothing upstream
has to stay in floating point (an int8 mode may quantise the whole tower). `--merge local`
(passes.methods.merge) is the exception: its assignment of each pruned patch to a kept
neighbour is discrete, so it and the keys it reads (block L's, or the projector output's)
stay with the selection's precision.
"""

from __future__ import annotations

import abc

import numpy as np
import onnx_ir as ir
import torch

from vlmprune.compiler.contract import PATCH_TOKENS, SITE_FEATURES
from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import BLOCK, BY_SCORE, GraphInputs, Method, Needs, SiteSpec, SiteTensors, \
    TorchResult
from vlmprune.passes.methods.builder import INT64_MAX, TOKENS
from vlmprune.passes.methods.selection import split_prefix

SITES = (BLOCK, SITE_FEATURES)
SITE_HELP = ("random, grid: where the baseline prunes: block (after block L, --layer; default) or features "
             "(the projector output, the tower's end)")


class FixedMethod(Method):
    """A baseline that keeps the same constant indices for every image; subclasses say which (indices)."""

    baseline = True
    selection = BY_SCORE  # a constant selection: parity asks for the same set, with nothing ranked
    choices = {"site": SITES}
    local_merge = True  # --merge local: its output is the kept rows (base.Method.__init_subclass__)

    @abc.abstractmethod
    def indices(self, params: dict, n: int) -> np.ndarray:
        """The K kept patch indices of N, ascending, int64."""

    def defaults(self, keep: int) -> dict:
        return {"site": BLOCK}

    def parse(self, keep, options):
        params = super().parse(keep, options)
        if params["site"] not in SITES:
            raise InputError(f"--site of method {self.name} is block or features, got {params['site']!r}")
        return params

    def check(self, params: dict, spec: SiteSpec) -> None:
        if params["site"] == BLOCK and spec.merge is not None and spec.merge >= 2:
            raise InputError(f"method {self.name} keeps K of the tower's output tokens, and this tower merges "
                             f"{spec.merge}x{spec.merge} patches into one after its blocks: use --site features")
        super().check(params, spec)

    def serves(self):
        # check()'s condition in words: the families that meet it are theirs to say, not this module's.
        return ((PATCH_TOKENS, " (--site features where the tower's tokens are merged after its blocks; not on "
                               "crops under one budget)"),)

    def needs(self, params: dict) -> Needs:
        return Needs(site=params["site"])

    def reads_projector_output(self, params: dict) -> bool:
        # The kept set is a constant: no output of the tower decides it, unless --merge local's assignment reads the
        # projector output's tokens as its keys (--site features).
        return bool(params.get("merge")) and params["site"] == SITE_FEATURES

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        prefix, patches = split_prefix(inputs.hidden, inputs.prefix)
        index = torch.from_numpy(self.indices(params, patches.shape[1])).to(patches.device)
        kept = index.unsqueeze(0).expand(patches.shape[0], -1).contiguous()
        return TorchResult(torch.cat([*prefix, patches.index_select(1, index)], dim=1), kept)

    def emit(self, b, params: dict, inputs: GraphInputs, formulation: str) -> tuple[ir.Value, ir.Value]:
        index = self.indices(params, inputs.num_patches)
        with b.role(TOKENS):
            hidden = inputs.hidden
            patches = b.slice(hidden, inputs.prefix, INT64_MAX, 1, "patches") if inputs.prefix else hidden
            gathered = b.op("Gather", [patches, b.ints("kept_patches", index)], "gather_kept", axis=1)
            # No empty slice for a tower without a prefix: zero-sized tensors are not every runtime's business.
            tokens = (b.op("Concat", [b.slice(hidden, 0, inputs.prefix, 1, "cls"), gathered], "tokens", axis=1)
                      if inputs.prefix else gathered)
            batch = b.slice(b.op("Shape", [hidden], "hidden_shape"), 0, 1, 0, "batch")
            shape = b.op("Concat", [batch, b.ints("keep", [len(index)])], "kept_shape", axis=0)
            kept = b.op("Expand", [b.ints("kept_row", index[None]), shape], "kept")
        return tokens, kept
