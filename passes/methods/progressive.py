"""The Progressive method: a score-based method in steps across blocks (`--schedule`, passes.methods.schedule).

The insertion (passes.progressive) emits step s through emit_step at its block; the torch
reference is called once per step (the tower's pipeline reads `layers` off the pruner), each
call knowing its block (SiteTensors.layer) and the original patch index of every token still
present (SiteTensors.patch_ids). The rules (what an intermediate step keeps, what the final
step outputs, how forced patches follow) are in passes.methods.schedule's docstring.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.passes.methods.base import GraphInputs, Method, SiteTensors, TorchResult
from vlmprune.passes.methods.builder import INT64_MAX, SELECT, TOKENS, role_of
from vlmprune.passes.methods.schedule_steps import Step, layers, resolve
from vlmprune.passes.methods.selection import gather_rows, select_topk, split_prefix


class Progressive(Method):
    """`inner` in steps (module docstring); name, options and output stay the method's own.

    num_patches: N, which the geometric counts need (the reference gets it from the insertion's
    record; the insertion reads it from the graph).
    """

    def __init__(self, inner: Method, num_patches: int | None = None):
        self.inner, self.num_patches = inner, num_patches
        self.name, self.summary, self.official = inner.name, inner.summary, inner.official
        self.options, self.choices, self.version = inner.options, inner.choices, inner.version
        self.selection, self.roi_keep, self.formulations = inner.selection, inner.roi_keep, inner.formulations
        self.int8_loss = inner.int8_loss

    def parse(self, keep, options):
        return self.inner.parse(keep, options)

    def needs(self, params):
        return self.inner.needs(params)

    def roi_bound(self, params):
        return self.inner.roi_bound(params)

    def check(self, params, spec):
        blocks = spec.num_blocks
        beyond = [layer for layer in layers(params) if blocks is not None and layer > blocks]
        if beyond:
            raise InputError(f"--schedule block {beyond[0]} is beyond this tower's {blocks} blocks (1..{blocks})")
        if spec.layer is not None and spec.layer != layers(params)[-1]:
            raise InputError(f"--layer {spec.layer} is not the schedule's last block ({layers(params)[-1]}); "
                             "leave --layer out with --schedule")
        self.inner.check(params, spec)
        resolve(params, spec.num_patches)

    def check_onnx_source(self, params):
        raise InputError("--schedule needs a torch reference (a preset or a Hugging Face directory): an .onnx "
                         "source's reference reads the dense graph's blocks, which never run on pruned tokens")

    def serves(self):
        return self.inner.serves()

    def output_tokens(self, params):
        return self.inner.output_tokens(params)

    def copied_rows(self, params):
        return self.inner.copied_rows(params)

    def describe(self, params):
        steps = resolve(params, self.num_patches) if self.num_patches else None
        where = ("; progressive: " + ", ".join(f"{s.keep} after block {s.layer}" for s in steps) if steps
                 else f"; progressive after blocks {params['schedule']}")
        return self.inner.describe(params) + where

    def fusion_rules(self, spellings, record=None):
        return self.inner.fusion_rules(spellings, record)  # the final step is the method's own emission

    def step_params(self, params: dict, step: Step) -> dict:
        """The method's parameters for an intermediate step: its options, K_s (only its score is read)."""
        out = {**params, "keep": step.keep}
        if "dominant" in params:  # visionzip's split, kept consistent with K_s (its score is what is read)
            out["dominant"] = step.keep - params.get("contextual", 0)
        return out

    # ------------------------------------------------------------------ reference

    def reference(self, params: dict, inputs: SiteTensors) -> TorchResult:
        n = self.num_patches or inputs.hidden.shape[1] - inputs.prefix
        steps = resolve(params, n)
        at = [s.layer for s in steps]
        if inputs.layer not in at:
            raise InputError(f"--schedule: the reference was called after block {inputs.layer}, not one of {at}")
        index = at.index(inputs.layer)
        ids = inputs.patch_ids  # [B, N_s] original patch indices of the tokens present; None: all of them
        forced = getattr(inputs, "forced", None)  # original coordinates (compiler.parity.reference.with_forced)
        local = inputs
        if forced is not None and ids is not None:
            local = _replace(inputs, forced=torch.gather(forced.expand(ids.shape[0], -1), 1, ids))
        if index < len(steps) - 1:  # an intermediate step: the method's score, its K_s best, no summary
            result = self.inner.reference(self.step_params(params, steps[index]), local)
            kept = select_topk(result.trace["scores"], steps[index].keep)
            prefix, patches = split_prefix(inputs.hidden, inputs.prefix)
            tokens = torch.cat([*prefix, gather_rows(patches, kept)], dim=1)
            # what this step ranked, in original coordinates (parity's tie band per step: step_scores)
            trace = {"scores": _original(result.trace["scores"], ids, n), "boundary": steps[index].keep}
            return TorchResult(tokens, kept if ids is None else torch.gather(ids, 1, kept), trace)
        result = self.inner.reference(params, local)
        if ids is None:
            return result
        trace = dict(result.trace)
        if "scores" in trace:  # in original coordinates; tokens pruned earlier score below every one present
            trace["scores"] = _original(trace["scores"], ids, n)
        if forced is not None:
            trace["forced"] = forced.expand(ids.shape[0], -1)
        return TorchResult(result.tokens, torch.gather(ids, 1, result.kept), trace)

    # ------------------------------------------------------------------ graph

    def emit(self, b, params, inputs, formulation):
        raise InputError("--schedule is inserted step by step (passes.progressive), not at one site")

    def emit_step(self, b, params: dict, inputs: GraphInputs, formulation: str, step: Step, last: bool):
        """Step `step`'s nodes at its block: the method itself when last, else its score's K_s best (no summary).
        Returns (tokens, kept indices into the tokens present) as Method.emit does."""
        if last:
            return self.inner.emit(b, params, inputs, formulation)
        start = len(b.nodes)
        self.inner.emit(b, self.step_params(params, step), inputs, formulation)  # its tokens go unused
        topk = next((node for node in b.nodes[start:] if node.op_type == "TopK" and role_of(node) == SELECT), None)
        if topk is None:
            raise InputError(f"method {self.name} emitted no selection TopK to read its score from")
        scores = topk.inputs[0]  # [B, N_s]: what the method ranks, forced patches lifted
        with b.role(SELECT):
            _, top = b.op("TopK", [scores, b.ints("step_k", [step.keep])], "step_topk", num_outputs=2, axis=-1,
                          largest=1, sorted=1)
            kept = b.sort_ascending(top, step.keep, "step_kept")
        with b.role(TOKENS):
            patches = b.slice(inputs.hidden, inputs.prefix, INT64_MAX, 1, "step_patches") if inputs.prefix \
                else inputs.hidden
            rows = b.gather_rows(patches, kept, "step_rows")
            tokens = b.op("Concat", [b.slice(inputs.hidden, 0, inputs.prefix, 1, "step_prefix"), rows],
                          "step_tokens", axis=1) if inputs.prefix else rows
        # The method's own tokens for K_s are not wanted: leave them to RemoveUnusedNodesPass.
        return tokens, kept


def _original(scores: torch.Tensor, ids: torch.Tensor | None, n: int) -> torch.Tensor:
    """Scores [B, N_s] of the tokens present -> [B, N] by original patch index; a patch an earlier step pruned
    scores 1 below the lowest present, so that it never lies at a boundary."""
    if ids is None:
        return scores
    low = scores.amin(dim=-1, keepdim=True) - 1.0
    return low.expand(-1, n).clone().scatter(1, ids, scores)


def _replace(inputs: SiteTensors, **changes) -> SiteTensors:
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return type(inputs)(**{**fields, **changes})
