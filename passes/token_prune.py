"""Insert visual-token pruning into a ViT graph with standard ONNX ops.

Why a pass and not a pruned PyTorch module: the same rewrite must apply to a tower
that was exported anywhere (an .onnx file), keep the main attention untouched
(SDPA/Flash kernels stay), and produce a subgraph that later fusion rules and
target legalizers can recognise. The semantics are shared/DESIGN.md's:

    A_i  = mean_h softmax(q_cls,h · K_hᵀ · scale)[1+i]      (recomputed [CLS] row, O(N·d))
    V_i  = variance of patch i of the normalized pixels      (only when λ > 0)
    S    = A / max(A, eps) + λ · V / max(V, eps)
    kept = sort_ascending(TopK(S, K))                          (ties -> lower index)
    out  = [CLS] ++ gather(X, kept) ++ mean(X[not kept])       [B, 1+N, D] -> [B, 1+K+1, D]

InsertTokenPrunePass rewrites block L's output; RetargetTokenCountPass then fixes
the shape constants downstream that an exporter baked for 1+N tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from vlmprune.compiler.errors import StructureError
from vlmprune.compiler.reference import SCORE_EPS
from vlmprune.passes.dataflow import consumers_downstream
from vlmprune.passes.structure import TowerStructure, const_ints, find_tower_structure, scale_operand, static_dim

KEPT_INDICES = "kept_indices"
# Set on the pruned value so that later passes find it without names.
TOKENS_META = "vlmprune.tokens"
_INT64_MAX = np.iinfo(np.int64).max


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """What to prune: keep K patch tokens after block `layer` (1-based; None = last block)."""

    keep: int
    layer: int | None = None
    lam: float = 0.0
    has_cls: bool | None = None  # None: inferred from the token count and the patch grid


@dataclasses.dataclass
class PruneSite:
    """What the insertion pass resolved, for the manifest and for later passes."""

    layer: int
    num_blocks: int
    tokens_in: int
    tokens_out: int
    num_patches: int
    has_cls: bool
    patch_size: int | None


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


class _Builder:
    """Appends standard-ONNX nodes, spelling version-dependent ops for the model's opset."""

    def __init__(self, graph: ir.Graph, opset: int, prefix: str):
        self.graph, self.opset, self.prefix = graph, opset, prefix
        self.nodes: list[ir.Node] = []

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=f"{self.prefix}/{name}", const_value=ir.tensor(array))
        value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value

    def ints(self, name: str, values: list[int]) -> ir.Value:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, inputs, name: str, num_outputs: int = 1, **attrs):
        node = ir.node(op_type, inputs, attributes=attrs or None, num_outputs=num_outputs, name=f"{self.prefix}/{name}")
        for i, out in enumerate(node.outputs):
            out.name = f"{self.prefix}/{name}" + (f":{i}" if num_outputs > 1 else "")
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def reduce(self, op_type: str, x: ir.Value, axes: list[int], keepdims: int, name: str) -> ir.Value:
        if self.opset >= 18:
            return self.op(op_type, [x, self.ints(f"{name}_axes", axes)], name, keepdims=keepdims)
        return self.op(op_type, [x], name, axes=axes, keepdims=keepdims)

    def slice(self, x: ir.Value, start: int, end: int, axis: int, name: str) -> ir.Value:
        return self.op(
            "Slice",
            [x, self.ints(f"{name}_starts", [start]), self.ints(f"{name}_ends", [end]), self.ints(f"{name}_axes", [axis])],
            name,
        )

    def unsqueeze(self, x: ir.Value, axes: list[int], name: str) -> ir.Value:
        return self.op("Unsqueeze", [x, self.ints(f"{name}_axes", axes)], name)


class InsertTokenPrunePass(ir.passes.InPlacePass):
    """Insert score -> TopK -> sort -> Gather -> summary after block L, and output the kept indices.

    Finds block L by structure (passes.structure), recomputes only the [CLS] row of
    its attention from the operands of its own Q·Kᵀ MatMul, and rewires every
    consumer of the block output to the pruned tokens. Adds a graph output
    `kept_indices` [B, K] (int64, ascending). After it, run RetargetTokenCountPass.
    """

    def __init__(self, config: PruneConfig):
        super().__init__()
        self.config = config
        self.site: PruneSite | None = None
        self._structure: TowerStructure | None = None

    def requires(self, model: ir.Model) -> None:
        cfg = self.config
        if _opset(model) < 13:
            raise StructureError(f"opset {_opset(model)} is too old: vlmprune needs opset >= 13")
        structure = find_tower_structure(model.graph)
        n_blocks = len(structure.blocks)
        layer = n_blocks if cfg.layer is None else cfg.layer
        if not 1 <= layer <= n_blocks:
            raise StructureError(f"--layer {layer} is out of range: this tower has {n_blocks} blocks (1..{n_blocks})")
        tokens = static_dim(structure.blocks[layer - 1].output, 1)
        if tokens is None:
            raise StructureError(
                "block output has no static token count (the graph computes it at run time, e.g. by "
                "interpolating position embeddings); export the tower with static shapes")
        has_cls = cfg.has_cls
        if has_cls is None:
            if structure.num_patches is None:
                raise StructureError("cannot tell whether the tower has a [CLS] token: no patch-embedding Conv found")
            if tokens not in (structure.num_patches, structure.num_patches + 1):
                raise StructureError(
                    f"block output has {tokens} tokens but the patch grid has {structure.num_patches}: "
                    "extra tokens (registers?) are not supported"
                )
            has_cls = tokens == structure.num_patches + 1
        if not has_cls:
            raise StructureError("the tower has no [CLS] token, and the [CLS]-attention method needs one")
        n = tokens - 1
        if not 1 <= cfg.keep < n:
            raise StructureError(f"--keep must satisfy 1 <= keep < {n} (the tower has {n} patch tokens), got {cfg.keep}")
        if cfg.lam < 0:
            raise StructureError(f"--lambda must be >= 0, got {cfg.lam}")
        if cfg.lam > 0 and (structure.pixel_input is None or structure.grid is None):
            raise StructureError("lambda > 0 needs the pixel input and the patch size: no patch-embedding Conv found")
        if cfg.lam > 0 and structure.num_patches != n:
            raise StructureError(f"patch grid {structure.grid} does not match {n} patch tokens")
        self._structure = structure
        self.site = PruneSite(layer, n_blocks, tokens, 1 + cfg.keep + 1, n, True, structure.patch_size)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        cfg, site, structure = self.config, self.site, self._structure
        assert site is not None and structure is not None
        block = structure.blocks[site.layer - 1]
        graph = model.graph
        hidden = block.output
        consumers = list(hidden.uses())
        b = _Builder(graph, _opset(model), f"vlmprune/prune_L{site.layer}")

        scores = self._scores(b, block, structure, cfg.lam, site.num_patches)
        pruned, kept = emit_selection(b, hidden, scores, cfg.keep, site.num_patches)
        graph.insert_after(hidden.producer(), b.nodes)

        for use in consumers:
            use.node.replace_input_with(use.idx, pruned)
        if hidden.is_graph_output():  # the output keeps its name: consumers go by it
            name = hidden.name
            hidden.name = f"{name}.dense"
            graph.outputs[graph.outputs.index(hidden)] = pruned
            pruned.name = name
        pruned.meta[TOKENS_META] = (site.tokens_in, site.tokens_out)
        kept.name = KEPT_INDICES
        kept.type = ir.TensorType(ir.DataType.INT64)
        graph.outputs.append(kept)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _scores(b: _Builder, block, structure: TowerStructure, lam: float, n: int) -> ir.Value:
        q_cls = b.slice(block.q, 0, 1, 2, "q_cls")  # [B, H, 1, dh]
        kt = block.k if block.k_transposed else b.op("Transpose", [block.k], "k_t", perm=[0, 1, 3, 2])
        logits = b.op("MatMul", [q_cls, kt], "cls_logits")  # [B, H, 1, 1+N]
        for i, scale in enumerate(block.scale_ops):  # the block's own scaling ops, replayed
            operands = [logits, scale_operand(scale)]
            logits = b.op(scale.op_type, operands, f"cls_scale{i}")
        if block.softmax is None:  # the Attention op's scale attribute
            logits = b.op("Mul", [logits, b.const("scale", np.array(block.scale, dtype=np.float32))], "cls_scale")
        probs = b.op("Softmax", [logits], "cls_probs", axis=-1)
        attn = b.reduce("ReduceMean", probs, [1, 2], 0, "cls_attn")  # [B, 1+N]
        attn = b.slice(attn, 1, _INT64_MAX, 1, "patch_attn")  # [B, N]
        eps = b.const("eps", np.array(SCORE_EPS, dtype=np.float32))
        scores = b.op("Div", [attn, b.op("Max", [b.reduce("ReduceMax", attn, [1], 1, "attn_max"), eps], "attn_den")], "attn_norm")
        if lam > 0:
            variance = _patch_variance(b, structure, n)
            var_den = b.op("Max", [b.reduce("ReduceMax", variance, [1], 1, "var_max"), eps], "var_den")
            var_norm = b.op("Div", [variance, var_den], "var_norm")
            weighted = b.op("Mul", [var_norm, b.const("lambda", np.array(lam, dtype=np.float32))], "var_weighted")
            scores = b.op("Add", [scores, weighted], "scores")
        return scores


def emit_selection(b: _Builder, hidden: ir.Value, scores: ir.Value, keep: int, n: int) -> tuple[ir.Value, ir.Value]:
    """TopK -> indices in raster order -> GatherND + summary mean -> Concat, in standard ops.

    hidden [B, 1+N, D], scores [B, N] -> (tokens [B, 1+K+1, D], kept [B, K] int64).
    This is the subgraph that passes.fusion recognises.
    """
    k = b.ints("k", [keep])
    _, top = b.op("TopK", [scores, k], "topk", num_outputs=2, axis=-1, largest=1, sorted=1)
    # TopK on the indices themselves, smallest first: the kept set in raster order.
    kept, _ = b.op("TopK", [top, k], "sort_kept", num_outputs=2, axis=-1, largest=0, sorted=1)
    patches = b.slice(hidden, 1, _INT64_MAX, 1, "patches")  # [B, N, D]
    gathered = b.op("GatherND", [patches, b.unsqueeze(kept, [-1], "kept_nd")], "gather_kept", batch_dims=1)
    dtype = hidden.dtype or ir.DataType.FLOAT
    np_dtype = dtype.numpy()
    ones = b.op("ConstantOfShape", [b.op("Shape", [scores], "scores_shape")], "ones",
                value=ir.tensor(np.ones([1], dtype=np_dtype)))
    zeros = b.op("ConstantOfShape", [b.op("Shape", [kept], "kept_shape")], "zeros",
                 value=ir.tensor(np.zeros([1], dtype=np_dtype)))
    pruned_mask = b.op("ScatterElements", [ones, kept, zeros], "pruned_mask", axis=1)
    weights = b.op("Mul", [pruned_mask, b.const("inv_pruned", np.array(1.0 / (n - keep), dtype=np_dtype))], "summary_w")
    summary = b.op("MatMul", [b.unsqueeze(weights, [1], "summary_w3"), patches], "summary")  # [B, 1, D]
    cls = b.slice(hidden, 0, 1, 1, "cls")
    pruned = b.op("Concat", [cls, gathered, summary], "tokens", axis=1)
    return pruned, kept


def _patch_variance(b: _Builder, structure: TowerStructure, n: int) -> ir.Value:
    """Per-patch variance of the pixel input: [B, C, H, W] -> [B, N], raster order."""
    pixel, p = structure.pixel_input, structure.patch_size
    gh, gw = structure.grid
    channels = static_dim(pixel, 1)
    if channels is None:
        raise StructureError("pixel input has no static channel count")
    x = b.op("Reshape", [pixel, b.ints("pix6_shape", [-1, channels, gh, p, gw, p])], "pix6")
    x = b.op("Transpose", [x], "pix_patches", perm=[0, 2, 4, 1, 3, 5])
    x = b.op("Reshape", [x, b.ints("pix3_shape", [-1, n, channels * p * p])], "pix3")
    mean = b.reduce("ReduceMean", x, [2], 1, "pix_mean")
    centered = b.op("Sub", [x, mean], "pix_centered")
    return b.reduce("ReduceMean", b.op("Mul", [centered, centered], "pix_sq"), [2], 0, "pix_var")


# Inputs that carry shapes or token positions, by op type: a constant there that
# equals the old token count is the token count.
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Slice": (1, 2), "Tile": (1,), "Range": (1,)}


class RetargetTokenCountPass(ir.passes.InPlacePass):
    """Rewrite shape constants downstream of the pruned tokens from 1+N to K+2 tokens.

    Exporters bake the token count into Reshape targets ([-1, 577, H, dh]) and
    sometimes share one constant between blocks before and after the pruning point,
    so matching constants are replaced by fresh ones on downstream consumers only.
    Stale shape annotations downstream are dropped and shapes inferred again.
    """

    def __init__(self):
        super().__init__()
        self.rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        sites = [v for node in graph for v in node.outputs if TOKENS_META in v.meta]
        if not sites:
            return ir.passes.PassResult(model, modified=False)
        for value in sites:
            old, new = value.meta[TOKENS_META]
            down = list(consumers_downstream(value))
            for node in down:
                self._retarget_node(graph, node, old, new)
            for node in down:
                for out in node.outputs:
                    out.shape = None
        ShapeInferencePass()(model)
        return ir.passes.PassResult(model, modified=True)

    def _retarget_node(self, graph: ir.Graph, node: ir.Node, old: int, new: int) -> None:
        for idx in _SHAPE_INPUTS.get(node.op_type, ()):
            if idx < len(node.inputs) and node.inputs[idx] is not None:
                fixed = self._retarget_value(graph, node.inputs[idx], node, old, new)
                if fixed is not node.inputs[idx]:
                    node.replace_input_with(idx, fixed)

    def _retarget_value(self, graph: ir.Graph, value: ir.Value, consumer: ir.Node, old: int, new: int) -> ir.Value:
        """value with `old` replaced by `new`: a fresh constant, or a fresh Concat of retargeted pieces.

        Shape vectors are often built as Concat(batch, 577, H, dh) from the pixel input's
        batch size, upstream of the pruning point and possibly shared with earlier blocks,
        so nothing existing is modified: the consumer gets its own copy.
        """
        values = const_ints(value)
        if values is not None:
            if values.ndim > 1 or old not in values.reshape(-1):
                return value
            name = f"{value.name}_retok{new}"
            if name not in graph.initializers:
                fixed = np.where(values == old, new, values).astype(values.dtype)
                replacement = ir.Value(name=name, const_value=ir.tensor(fixed))
                replacement.type = value.type
                replacement.shape = ir.Shape(fixed.shape)
                graph.register_initializer(replacement)
            self.rewritten += 1
            return graph.initializers[name]
        producer = value.producer()
        if producer is None or producer.op_type != "Concat":
            return value
        pieces = [self._retarget_value(graph, v, consumer, old, new) for v in producer.inputs]
        if all(p is v for p, v in zip(pieces, producer.inputs)):
            return value
        concat = ir.node("Concat", pieces, attributes={"axis": producer.attributes.get_int("axis", 0)},
                         name=f"{producer.name}_retok{new}")
        concat.outputs[0].name = f"{value.name}_retok{new}_{consumer.name}"
        concat.outputs[0].type = value.type
        graph.insert_before(consumer, concat)
        return concat.outputs[0]


def selection_model(batch: int | str, n: int, d: int, keep: int, dtype=np.float32, opset: int = 18) -> ir.Model:
    """A standalone model of just the selection subgraph: (hidden [B, 1+N, D], scores [B, N]) -> (tokens, kept).

    For the fusion tests and tools/bench_fused_op.py: the same nodes the pass emits.
    """
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    hidden = ir.Value(name="hidden", type=ir.TensorType(elem), shape=ir.Shape([batch, n + 1, d]))
    scores = ir.Value(name="scores", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch, n]))
    graph = ir.Graph([hidden, scores], [], nodes=[], name="selection", opset_imports={"": opset})
    b = _Builder(graph, opset, "vlmprune/select")
    tokens, kept = emit_selection(b, hidden, scores, keep, n)
    graph.extend(b.nodes)
    tokens.name, kept.name = "tokens", KEPT_INDICES
    graph.outputs.extend([tokens, kept])
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    return model
