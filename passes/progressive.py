"""Insert a progressive schedule (`--schedule`): a score-based method in several steps across blocks.

What each step computes is passes.methods.schedule's (its docstring has the rules); this
pass places the steps, as InsertPruningPass places one: step s at block L_s's output, found
by structure, every consumer of it rewired to the step's tokens. Between steps it runs
RetargetTokenCountPass, so that the blocks up to the next step run on the step's tokens and
the next step's emission reads shapes that hold (each step's token value carries its own
`vlmprune.tokens` "old,new", and a later retarget finds nothing left of the earlier ones).

kept_indices [B, K] are original patch indices: each step's kept indices (into the tokens
present) are composed through the previous step's with one GatherElements. The forced set of
--roi / --coverage is built once, in original coordinates, and mapped to the tokens present
at every later step (GatherElements by the composed indices). The record is InsertPruningPass's,
its site the final step's, with `steps`: every step's block, count and token counts, which the
manifest lists.
"""

from __future__ import annotations

import onnx_ir as ir

from vlmprune.compiler.contract import KEPT, PRUNE_META, TOKENS_META, PruneRecord
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import consumers_downstream, opset
from vlmprune.passes.graph.structure import find_tower_structure, static_dim
from vlmprune.passes.methods import coverage, roi, schedule
from vlmprune.passes.methods.base import BLOCK, GraphInputs, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.prune import InsertPruningPass, prune_record, summary
from vlmprune.passes.retarget import RetargetTokenCountPass


class InsertProgressivePruningPass(InsertPruningPass):
    """InsertPruningPass for a method wrapped by schedule.wrap (passes.methods.progressive.Progressive)."""

    def ensures(self, model: ir.Model) -> None:
        """Each step's tokens hold the count recorded on them, the last the record's tokens_out; the kept output
        is [B, K] int64."""
        record = prune_record(model)
        if record is None or record.steps is None:
            raise ir.passes.PostconditionError("the progressive insertion left no vlmprune.prune record with steps")
        kept = next((v for v in model.graph.outputs if v.name == record.kept), None)
        if kept is None or kept.shape is None or list(kept.shape)[1:] != [record.kept_count]:
            raise ir.passes.PostconditionError(f"no graph output {record.kept} [B, {record.kept_count}]")
        values = [v for n in model.graph.all_nodes() for v in n.outputs if TOKENS_META in v.metadata_props]
        counts = [int(v.metadata_props[TOKENS_META].split(",")[1]) for v in values]
        if sorted(counts, reverse=True) != [s["tokens_out"] for s in record.steps]:
            raise ir.passes.PostconditionError(f"the steps' token values hold {counts}, the record "
                                               f"{[s['tokens_out'] for s in record.steps]}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if prune_record(model) is not None:  # the same pruning, already in place
            return ir.passes.PassResult(model, modified=False)
        graph, method, params = model.graph, self.method, self.params
        structure = find_tower_structure(graph)  # once, on the dense graph: later blocks keep their values
        blocks = len(structure.blocks)
        final = schedule.layers(params)[-1]
        if self.layer is not None and self.layer != final:
            raise StructureError(f"--layer {self.layer} is not the schedule's last block ({final})")
        first = structure.blocks[min(schedule.layers(params)[0], blocks) - 1].output
        tokens = static_dim(first, 1)
        n = structure.num_patches
        if tokens is None or n is None or tokens < n:
            raise StructureError("--schedule needs the tower's static token count and its patch grid")
        prefix = tokens - n
        has_pixels = structure.pixel_input is not None and structure.grid is not None
        spec = SiteSpec(n, prefix > 0, final, blocks, has_pixels, prefix, self.head is not None, tower_cls=prefix > 0)
        method.check(params, spec)  # the schedule against the tower's blocks and N, and the method itself
        method.num_patches = n
        steps = schedule.resolve(params, n)
        width = static_dim(first, 2)
        clash = [s for s in steps[:-1] if prefix + s.keep == width]
        if clash:  # RetargetTokenCountPass goes by value: a count equal to the width would be rewritten as one
            raise StructureError(f"--schedule: step {clash[0].layer} keeps {prefix + clash[0].keep} tokens, the "
                                 f"tower's width; choose another count")
        pixel = structure.pixel_input
        force = Builder(graph, opset(model), f"vlmprune/{method.name}_forced")
        found = roi.add_inputs(graph, force, params, structure,
                               pixel.shape[0] if pixel is not None and pixel.shape is not None else None)
        forced = coverage.emit_forced(force, params, n, found[0] if found is not None else None)
        composed, n_now, kept_value, out_tokens = None, n, None, None
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            block = structure.blocks[step.layer - 1]
            hidden = block.output
            b = Builder(graph, opset(model), f"vlmprune/{method.name}_L{step.layer}")
            inputs = GraphInputs(hidden, prefix > 0, n_now, block, structure, prefix, self.head)
            if forced is not None:
                inputs.forced = forced if composed is None else coverage.emit_mapped(b, forced, composed)
            consumers = list(hidden.uses())
            new, local = method.emit_step(b, params, inputs, self.formulation, step, last)
            composed = schedule.emit_compose(b, composed, local)
            anchor = hidden.producer()
            if anchor is None:
                raise StructureError("the tokens to prune are a graph input, not computed by the tower")
            graph.insert_after(anchor, (force.nodes if index == 0 else []) + b.nodes)
            for use in consumers:
                use.node.replace_input_with(use.idx, new)
            if hidden.is_graph_output():  # the output keeps its name: consumers go by it
                name = hidden.name
                hidden.name = f"{name}.dense"
                graph.outputs[graph.outputs.index(hidden)] = new
                new.name = name
            count = prefix + (method.output_tokens(params) if last else step.keep)
            new.shape = ir.Shape([hidden.shape[0], count, hidden.shape[2]]) if hidden.shape is not None else None
            new.type = hidden.type
            new.metadata_props[TOKENS_META] = f"{prefix + n_now},{count}"
            for node in consumers_downstream(new):  # stale until retargeted
                for out in node.outputs:
                    out.shape = None
            RetargetTokenCountPass()(model)  # the next step reads shapes that hold
            n_now, kept_value, out_tokens = step.keep, composed, count
        batch = first.shape[0] if first.shape is not None else None
        kept_value.name, kept_value.type = KEPT, ir.TensorType(ir.DataType.INT64)
        kept_value.shape = ir.Shape([batch, params["keep"]])
        graph.outputs.append(kept_value)
        record = PruneRecord(method.name, params, BLOCK, final, self.formulation, blocks, prefix + n, out_tokens, n,
                             prefix > 0, prefix, KEPT, params["keep"], summary(method, params),
                             roi=found[1] if found is not None else None,
                             steps=tuple(schedule.steps_record(steps, prefix, n, out_tokens)))
        model.metadata_props[PRUNE_META] = record.to_json()
        return ir.passes.PassResult(model, modified=True)


def insertion_pass(method, params: dict, layer: int | None, formulation: str | None, head=None) -> InsertPruningPass:
    """The insertion for a method as compiled: progressive under --schedule, else the one-site pass."""
    if params.get("schedule") is not None:
        return InsertProgressivePruningPass(schedule.wrap(method, params), params, layer, formulation, head)
    return InsertPruningPass(method, params, layer, formulation, head)
