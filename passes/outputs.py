"""The bundle's output contract for towers exported elsewhere: one `image_features` output, [CLS] as asked.

Why: a Hugging Face source is exported by vlmprune itself, with outputs named
`image_features` (and `kept_indices`) and [CLS] dropped or kept by the model's select
strategy. An .onnx tower exported elsewhere has its own names (`last_hidden_state`,
`pooler_output`, ...), keeps [CLS], and its exporter's dimension names. Every bundle
must look the same to the code that consumes it, so the tower's token output is
renamed, [CLS] is sliced off unless the user keeps it, other outputs are dropped, and
the batch dimension is called `batch` on every input and output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import FEATURES, HAS_CLS_META
from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import fresh_initializer
from vlmprune.passes.graph.structure import provably_zero

BATCH_DIM = "batch"
_INT64_MAX = np.iinfo(np.int64).max


def token_output(graph: ir.Graph) -> ir.Value:
    """The tower's token output: the first rank-3 graph output [B, T, D]."""
    for value in graph.outputs:
        if value.shape is not None and len(value.shape) == 3:
            return value
    names = ", ".join(f"{v.name} {None if v.shape is None else list(v.shape)}" for v in graph.outputs)
    raise StructureError(f"the tower has no token output [B, T, D] (outputs: {names})")


class FeatureOutputPass(ir.passes.InPlacePass):
    """Keep only the token output, drop [CLS] (and register tokens) from it if asked, and name it `image_features`.

    num_patches is the patch grid's size; the token count tells what precedes the patches:
    nothing (T = N), a [CLS] token (T = N + 1), or [CLS] and register tokens (T = N + 1 + R).
    "Dropping [CLS]" drops that whole prefix, as LLaVA's default select strategy keeps patches only.
    """

    def __init__(self, drop_cls: bool, num_patches: int | None):
        super().__init__()
        self.drop_cls = drop_cls
        self.num_patches = num_patches

    def requires(self, model: ir.Model) -> None:
        out = token_output(model.graph)
        tokens = out.shape[1]
        if self.drop_cls and not isinstance(tokens, int):
            raise StructureError(f"output {out.name} has no static token count: {list(out.shape)}")

    def ensures(self, model: ir.Model) -> None:
        """The contract every bundle's consumer reads: one output, `image_features` [B, T, D], and with [CLS]
        dropped, the patch tokens only (T = N)."""
        outputs = model.graph.outputs
        if len(outputs) != 1 or outputs[0].name != FEATURES or outputs[0].shape is None or len(outputs[0].shape) != 3:
            raise ir.passes.PostconditionError(f"the outputs are not one {FEATURES} [B, T, D]: "
                                               f"{[(v.name, v.shape) for v in outputs]}")
        tokens = outputs[0].shape[1]
        if self.drop_cls and self.num_patches is not None and tokens != self.num_patches:
            raise ir.passes.PostconditionError(f"{FEATURES} holds {tokens} tokens with [CLS] dropped, the patch grid "
                                               f"{self.num_patches}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        out = token_output(graph)
        modified = len(graph.outputs) != 1 or out.name != FEATURES
        tokens = out.shape[1]
        prefix = tokens - self.num_patches if isinstance(tokens, int) and self.num_patches is not None else 0
        has_cls = prefix > 0
        graph.outputs.clear()
        if self.drop_cls and has_cls:
            producer = out.producer()
            starts = fresh_initializer(graph, "vlmprune/drop_cls_starts", np.array([prefix], np.int64))
            ends = fresh_initializer(graph, "vlmprune/drop_cls_ends", np.array([_INT64_MAX], np.int64))
            axes = fresh_initializer(graph, "vlmprune/drop_cls_axes", np.array([1], np.int64))
            node = ir.node("Slice", [out, starts, ends, axes], name="vlmprune/drop_cls")
            if producer is not None:
                graph.insert_after(producer, node)
            else:
                graph.append(node)
            new = node.outputs[0]
            new.type, new.shape = out.type, ir.Shape([out.shape[0], tokens - prefix, out.shape[2]])
            out = new
            modified = True
        if out.name != FEATURES:
            if FEATURES in {v.name for v in graph.inputs}:
                raise StructureError(f"the tower has an input named {FEATURES}")
            for node in graph:  # a value of that name elsewhere in the graph keeps it unique
                for value in node.outputs:
                    if value.name == FEATURES and value is not out:
                        value.name = f"{FEATURES}.inner"
            out.name = FEATURES
        out.meta[HAS_CLS_META] = has_cls and not self.drop_cls
        graph.outputs.append(out)
        return ir.passes.PassResult(model, modified=modified)


class ZeroPaddingPass(ir.passes.InPlacePass):
    """Zero the padded rows of the token output where K varies per image, and count its valid rows.

    Why here and not in the method: at a BLOCK site the method's zero rows still pass the
    blocks after it and the projector, whose biases make them non-zero. The contract an LLM
    runtime reads (docs/design.md, "Variable K") is on the graph's token output: rows
    [0, num_tokens[b]) are the image's tokens, every row after them is zero. num_tokens
    counts rows of that output, so a prefix ([CLS]) the output keeps is counted in it.
    Runs after RetargetTokenCountPass (static token counts); a second run changes nothing.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from vlmprune.passes.prune import prune_record  # prune imports this module's neighbours

        record = prune_record(model)
        graph = model.graph
        count = next((v for v in graph.outputs if record and v.name == record.num_tokens), None)
        out = token_output(graph) if count is not None else None
        if out is None or out.metadata_props.get(_PADDED) == "1":
            return ir.passes.PassResult(model, modified=False)
        rows = out.shape[1] if out.shape is not None else None
        if not isinstance(rows, int):
            raise StructureError(f"{out.name} has no static token count to pad: {out.shape}")
        lead = rows - (record.tokens_out - record.prefix)  # the prefix the output keeps (0: [CLS] dropped)
        init = lambda name, a: fresh_initializer(graph, f"vlmprune/pad_{name}", np.asarray(a))  # noqa: E731
        nodes = []

        def op(op_type, inputs, name, **attrs):
            nodes.append(ir.node(op_type, inputs, attributes=attrs or None, name=f"vlmprune/pad_{name}"))
            return nodes[-1].outputs[0]

        valid_rows = op("Add", [count, init("lead", np.int64(lead))], "rows") if lead else count
        mask = op("Less", [init("row_ids", np.arange(rows, dtype=np.int64)[None]),
                           op("Unsqueeze", [valid_rows, init("axes", np.array([1], np.int64))], "rows_col")], "mask")
        mask = op("Unsqueeze", [op("Cast", [mask], "mask_f", to=out.dtype or ir.DataType.FLOAT),
                                init("axes_d", np.array([2], np.int64))], "mask_rows")
        padded = op("Mul", [out, mask], "zeroed")
        graph.extend(nodes)
        name = out.name
        out.name = f"{name}.unpadded"
        graph.outputs[graph.outputs.index(out)] = padded
        padded.name, padded.type, padded.shape = name, out.type, ir.Shape(list(out.shape))
        padded.metadata_props[_PADDED] = "1"
        if lead:
            graph.outputs[graph.outputs.index(count)] = valid_rows
            count.name, valid_rows.name = f"{count.name}.patches", count.name
            valid_rows.type, valid_rows.shape = count.type, count.shape
        return ir.passes.PassResult(model, modified=True)


_PADDED = "vlmprune.padded"  # value.metadata_props of a token output whose padded rows ZeroPaddingPass zeroed


class BatchDimNamePass(ir.passes.InPlacePass):
    """Name a dynamic leading dimension `batch` on every graph input and output.

    Shape inference invents names (`unk__29`, `s0`) for what is one batch dimension;
    a consumer reading the manifest should see one name for it everywhere.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for value in [*model.graph.inputs, *model.graph.outputs]:
            shape = value.shape
            if shape is None or len(shape) == 0 or isinstance(shape[0], int):
                continue
            if str(shape[0]) != BATCH_DIM:
                value.shape = ir.Shape([BATCH_DIM, *shape[1:]])
                modified = True
        return ir.passes.PassResult(model, modified=modified)


class DropZeroAddPass(ir.passes.InPlacePass):
    """Add(x, zeros) -> x, where the zeros are provable (passes.graph.structure.provably_zero) and do not broadcast x.

    Why: torch.export writes SDPA without a mask as `logits + zeros[1, 1, T, T]` (with a
    dynamic batch, an expanded Where that is zero everywhere). The zeros change nothing, but
    they carry the token count in their shape, so after pruning the blocks that follow would
    add a [T, T] mask to [K', K'] logits. Removing them first keeps every later block
    shape-agnostic.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, removed = model.graph, 0
        for node in list(graph):
            if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            for data, mask in (node.inputs, node.inputs[::-1]):
                out = node.outputs[0]
                if data is None or out.is_graph_output() or not provably_zero(mask):
                    continue
                if not _keeps_shape(data, mask, out):
                    continue  # the Add broadcasts: x alone would have another shape
                out.replace_all_uses_with(data)
                graph.remove(node, safe=True)
                removed += 1
                break
        return ir.passes.PassResult(model, modified=removed > 0)


def _keeps_shape(data: ir.Value, mask: ir.Value, out: ir.Value) -> bool:
    """Whether data + mask has data's shape: known equal shapes, or a mask that only broadcasts into data."""
    if data.shape is not None and out.shape is not None and list(data.shape) == list(out.shape):
        return True
    mask_shape = _mask_shape(mask)
    if data.shape is None or mask_shape is None or len(mask_shape) > len(data.shape):
        return False
    pairs = zip(reversed(list(mask_shape)), reversed(list(data.shape)))
    return all(m == 1 or (isinstance(m, int) and m == d) for m, d in pairs)


def _mask_shape(mask: ir.Value):
    """The mask's shape where it is fully static, else None."""
    if mask.shape is not None and all(isinstance(d, int) for d in mask.shape):
        return list(mask.shape)
    return None
