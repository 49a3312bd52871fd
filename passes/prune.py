"""Insert a pruning method into a tower graph, in standard ONNX ops, and record what was inserted.

Why a pass and not a pruned PyTorch module: the same rewrite must apply to a tower that
was exported anywhere (an .onnx file), keep the main attention untouched (SDPA/Flash
kernels stay), and produce a subgraph that fusion rules and target legalizers can
recognise. The method decides what to compute (passes.methods); this pass finds where:

- a BLOCK site is block L's output, the residual stream [B, (1)+N, D], found by
  structure (passes.graph.structure); every consumer of it is rewired to the new tokens and
  RetargetTokenCountPass then fixes the token counts the exporter baked downstream;
- a FEATURES site is the graph's token output `image_features` (after the projector).

Results travel in the IR, not in pass attributes: the model's metadata_props hold
`vlmprune.prune`, the PruneRecord of the method, its parameters and the site (compiler.contract:
what the manifest reports and what later passes read), every inserted node holds its role
(passes.methods.builder), and the new token value holds `vlmprune.tokens` ("old,new").
The graph gains the output `kept_indices` [B, K'] (int64): the patch position of every
kept token. A method whose K varies per image (Method.variable_k) also gives `num_tokens`
[B] (int64): its tokens are padded to K' = K_max, kept_indices with -1 there, and
ZeroPaddingPass (passes.outputs) zeroes the padded rows of the final token output.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.contract import KEPT as KEPT_INDICES  # the bundle's names: compiler.contract
from vlmprune.compiler.contract import FRAMES_META, NUM_TOKENS, PRUNE_META, TEXT, TOKENS_META, PruneRecord
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import consumers_downstream, opset
from vlmprune.passes.methods import coverage, roi
from vlmprune.passes.methods.base import BLOCK, GraphInputs, Method, SiteSpec
from vlmprune.passes.methods.builder import Builder
from vlmprune.passes.graph.structure import TowerStructure, find_tower_structure, static_dim


def prune_record(model: ir.Model) -> PruneRecord | None:
    """What InsertPruningPass recorded in the model, or None for a graph it has not pruned."""
    text = model.metadata_props.get(PRUNE_META)
    return None if text is None else PruneRecord.from_json(text)


def summary(method: Method, params: dict, num_patches: int | None = None) -> str:
    """The record's one line: the method's own, and what --coverage adds to any method that takes it. Given the
    site's patch count, a count the method derives from N and K (holov's P) is said as its number."""
    if num_patches is not None:
        params = method.summary_params(params, num_patches)
    return method.describe(params) + coverage.describe(params)


def _token_output(graph: ir.Graph) -> ir.Value:
    for value in graph.outputs:
        if value.shape is not None and len(value.shape) == 3:
            return value
    raise StructureError("the graph has no token output [B, T, D] to prune")


class InsertPruningPass(ir.passes.InPlacePass):
    """Insert `method` with `params` at its site; output the kept indices; record it all in the IR.

    layer: the 1-based block of a BLOCK site (None: the last block the graph runs).
    formulation: the method's graph form (one of method.formulations; the target chooses).
    head: the tower's attention-pooling head (compiler.frontend.tower.PoolingHead), which the
    source knows and the graph does not show; methods that score with it read it from GraphInputs.
    A second run over a graph it already pruned the same way changes nothing.
    """

    def __init__(self, method: Method, params: dict, layer: int | None = None, formulation: str | None = None,
                 head=None):
        super().__init__()
        self.method, self.params, self.layer, self.head = method, dict(params), layer, head
        self.formulation = method.check_formulation(formulation or method.formulations[0])

    def _wanted(self) -> tuple:
        return self.method.name, self.params, self.formulation

    def requires(self, model: ir.Model) -> None:
        if opset(model) < 13:
            raise StructureError(f"opset {opset(model)} is too old: vlmprune needs opset >= 13")
        record = prune_record(model)
        if record is not None and (record.method, record.params, record.formulation) != self._wanted():
            raise StructureError(f"the graph is already pruned ({record.method}); prune the dense graph")

    def ensures(self, model: ir.Model) -> None:
        """What the passes after it rely on: the record, the kept output [B, keep] int64, and the new tokens
        holding the record's tokens_out (at a FEATURES site they are the graph's token output; at a BLOCK site
        RetargetTokenCountPass carries the count down to it). A failure is a vlmprune bug, not bad input."""
        record = prune_record(model)
        if record is None:
            raise ir.passes.PostconditionError("the insertion left no vlmprune.prune record")
        kept = next((v for v in model.graph.outputs if v.name == record.kept), None)
        if kept is None or kept.dtype != ir.DataType.INT64 or kept.shape is None \
                or list(kept.shape)[1:] != [record.kept_count]:
            raise ir.passes.PostconditionError(f"no graph output {record.kept} [B, {record.kept_count}] int64 "
                                               f"(outputs: {_outputs(model.graph)})")
        tokens = [v for n in model.graph.all_nodes() for v in n.outputs if TOKENS_META in v.metadata_props]
        if record.site != BLOCK:
            tokens.append(_token_output(model.graph))
        for value in tokens:
            # A method acting inside earlier blocks (token merging) marks its intermediate counts there too.
            meta = value.metadata_props.get(TOKENS_META)
            want = int(meta.split(",")[1]) if meta is not None else record.tokens_out
            if static_dim(value, 1) != want:
                raise ir.passes.PostconditionError(f"{value.name} holds {static_dim(value, 1)} tokens, the record "
                                                   f"{want}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if prune_record(model) is not None:  # the same pruning, already in place
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        structure = find_tower_structure(graph) if self.method.needs(self.params).site == BLOCK else _structure(graph)
        frames = int(model.metadata_props.get(FRAMES_META, 1))
        hidden, spec, block = self._site(graph, structure, frames)
        spec = dataclasses.replace(spec, frames=frames)
        self.method.check(self.params, spec)
        where = f"L{spec.layer}" if block is not None else "features"
        b = Builder(graph, opset(model), f"vlmprune/{self.method.name}_{where}")
        inputs = GraphInputs(hidden, spec.has_cls, spec.num_patches, block, structure, spec.prefix, self.head,
                             frames=spec.frames)
        text = _prompt_inputs(graph, self.method, self.params, inputs, structure)
        # --roi: the forced-keep inputs beside the pixels and F [B, N] from them (passes.methods.roi)
        pixel = structure.pixel_input if structure is not None else None
        forced = roi.add_inputs(graph, b, self.params, structure,
                                pixel.shape[0] if pixel is not None and pixel.shape is not None else None)
        if forced is not None:
            inputs.forced = forced[0]
        inputs.forced = coverage.emit_forced(b, self.params, spec.num_patches, inputs.forced)  # --coverage: the grid
        consumers = list(hidden.uses())
        tokens, kept, *count = self.method.emit(b, self.params, inputs, self.formulation)  # count: variable K
        anchor = hidden.producer()
        if anchor is None:
            raise StructureError("the tokens to prune are a graph input, not computed by the tower")
        graph.insert_after(anchor, b.nodes)
        for use in consumers:
            use.node.replace_input_with(use.idx, tokens)
        rerouted = _apply_placements(graph, b)
        if hidden.is_graph_output():  # the output keeps its name: consumers go by it
            name = hidden.name
            hidden.name = f"{name}.dense"
            graph.outputs[graph.outputs.index(hidden)] = tokens
            tokens.name = name
        tokens_in = static_dim(hidden, 1)
        tokens_out = self.method.site_tokens(self.params, spec)
        batch = hidden.shape[0] if hidden.shape is not None else None
        batch = self.method.output_batch(self.params, batch)
        tokens.shape = ir.Shape([batch, tokens_out, hidden.shape[2]]) if hidden.shape is not None else None
        tokens.type = hidden.type
        tokens.metadata_props[TOKENS_META] = f"{tokens_in},{tokens_out}"
        kept.name = KEPT_INDICES
        kept.type = ir.TensorType(ir.DataType.INT64)
        kept.shape = ir.Shape([batch, self.params["keep"]])
        graph.outputs.append(kept)
        if count:  # K varies per image: tokens padded to K_max, the valid count as an output (passes.outputs)
            count[0].name = NUM_TOKENS
            count[0].type, count[0].shape = ir.TensorType(ir.DataType.INT64), ir.Shape([batch])
            graph.outputs.append(count[0])
        if block is None:
            ShapeInferencePass()(model)
        else:  # shapes downstream are stale until RetargetTokenCountPass rewrites the baked token counts
            own = set(b.all_nodes())
            for node in consumers_downstream(tokens, *rerouted):
                if node not in own:  # the method set the shapes of its own token values
                    for out in node.outputs:
                        out.shape = None
        record = PruneRecord(
            self.method.name, self.params, self.method.needs(self.params).site, spec.layer, self.formulation,
            spec.num_blocks, tokens_in, tokens_out, spec.num_patches, spec.has_cls, spec.prefix, KEPT_INDICES,
            self.params["keep"], summary(self.method, self.params, spec.num_patches),
            # the graph input the prompt-aware method added (compiler.prompt feeds it)
            text={"name": TEXT, "dim": text} if text is not None else None,
            roi=forced[1] if forced is not None else None,  # the ROI inputs (compiler.roi feeds them)
            num_tokens=NUM_TOKENS if count else None)
        model.metadata_props[PRUNE_META] = record.to_json()
        return ir.passes.PassResult(model, modified=True)

    def _site(self, graph: ir.Graph, structure: TowerStructure | None, frames: int = 1):
        """(the value to prune, what it offers, the attention block or None).

        A clip's features (frames > 1) are its frames' pooled or merged tokens end to end, no prefix: the patch
        grid the graph shows is one frame's, before pooling, and says nothing of their count."""
        needs = self.method.needs(self.params)
        n_grid = structure.num_patches if structure is not None else None
        if frames > 1 and needs.site != BLOCK:
            n_grid = None
        if needs.site == BLOCK:
            n_blocks = len(structure.blocks)
            layer = n_blocks if self.layer is None else self.layer
            if not 1 <= layer <= n_blocks:
                raise StructureError(f"--layer {layer} is out of range: this tower has {n_blocks} blocks (1..{n_blocks})")
            block = structure.blocks[layer - 1]
            hidden = block.output
        else:
            if self.layer is not None:
                raise StructureError(f"method {self.method.name} prunes the projector output (the tower's end); "
                                     "--layer does not apply to it")
            block, layer, n_blocks = None, None, len(structure.blocks) if structure is not None else None
            hidden = _token_output(graph)
        tokens = static_dim(hidden, 1)
        if tokens is None:
            raise StructureError(
                "the tokens to prune have no static count (the graph computes it at run time, e.g. by "
                "interpolating position embeddings); export the tower with static shapes")
        if n_grid is not None and tokens < n_grid:
            raise StructureError(f"the site has {tokens} tokens but the patch grid has {n_grid}")
        # Tokens before the patches: [CLS], then register tokens (DINOv2 with registers); never pruned.
        prefix = tokens - n_grid if n_grid is not None else 0
        has_cls = prefix > 0
        num_patches = tokens - prefix
        has_pixels = structure is not None and structure.pixel_input is not None and structure.grid is not None
        # Whether the last block's tokens start with [CLS] ahead of the grid's patches (the features may drop it).
        last = static_dim(structure.blocks[-1].output, 1) if structure is not None and structure.blocks else None
        tower_cls = has_cls if needs.site == BLOCK else isinstance(last, int) and n_grid is not None and last > n_grid
        spec = SiteSpec(num_patches, has_cls, layer, n_blocks, has_pixels, prefix, self.head is not None,
                        tower_cls=tower_cls)
        return hidden, spec, block


def _apply_placements(graph: ir.Graph, b: Builder) -> list[ir.Value]:
    """Place the nodes a method put inside the graph upstream of its site (Builder.after) and apply its reroutes
    (Builder.reroute); returns the values rerouted to."""
    for anchor, nodes in b.placements:
        graph.insert_after(anchor, nodes)
    own = set(b.all_nodes())
    for old, new in b.reroutes:
        for use in list(old.uses()):
            if use.node not in own:
                use.node.replace_input_with(use.idx, new)
    for old, new in b.outputs:
        name = old.name
        old.name = f"{name}.dense"
        graph.outputs[graph.outputs.index(old)] = new
        new.name = name
    return [new for _, new in b.reroutes]


def _prompt_inputs(graph: ir.Graph, method: Method, params: dict, inputs: GraphInputs,
                   structure: TowerStructure | None) -> int | None:
    """Give a method what Needs.tower_features and Needs.text ask for: the last block's output, and the new graph
    input text_embeds [B, T, D] (D: the site's width, the LLM's). Returns D where the input was added."""
    needs = method.needs(params)
    if needs.tower_features:
        if structure is None or not structure.blocks:
            raise StructureError(f"method {method.name} needs the tower features at the feature layer, and this "
                                 "graph's transformer blocks were not found")
        features = structure.blocks[-1].output
        tokens = static_dim(features, 1)
        if tokens is None or not 0 <= tokens - inputs.num_patches <= 16:  # at most a [CLS] and register prefix
            raise StructureError(f"method {method.name} needs the feature layer's tokens one to one with the "
                                 f"projector output's, and this tower's last block has {tokens} tokens for "
                                 f"{inputs.num_patches} outputs (its projector merges patches)")
        inputs.features = features
    if not needs.text:
        return None
    dim = static_dim(inputs.hidden, 2)
    if dim is None:
        raise StructureError(f"method {method.name} needs a static token width for its text_embeds input")
    batch = inputs.hidden.shape[0] if inputs.hidden.shape is not None else None
    inputs.text = ir.Value(name=TEXT, type=ir.TensorType(ir.DataType.FLOAT),
                           shape=ir.Shape([batch, "text_tokens", dim]))
    graph.inputs.append(inputs.text)
    return dim


def _outputs(graph: ir.Graph) -> str:
    return ", ".join(f"{v.name} {None if v.shape is None else list(v.shape)}" for v in graph.outputs)


def _structure(graph: ir.Graph) -> TowerStructure | None:
    """The tower's structure where it can be found (a FEATURES site needs only the patch grid)."""
    try:
        return find_tower_structure(graph)
    except StructureError:
        return None
