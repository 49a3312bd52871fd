"""Find a ViT's attention blocks in an ONNX graph by structure, never by names.

The pruning pass needs, for block L, the two operands of its Q·Kᵀ MatMul (to
recompute the [CLS] row), the elementwise scaling between that MatMul and the
Softmax, and the residual-stream value that leaves the block. Exporters name
nodes arbitrarily, so everything here is derived from the dataflow:

- an attention Softmax is a Softmax over the last axis whose input is a MatMul
  of two rank-4 runtime tensors, possibly through Mul/Div by constant scalars;
- the block's first residual Add takes one operand downstream of that Softmax and
  one upstream of it (the block input);
- the block output is the Add that takes the first residual's output directly
  and, as its other operand, something computed from it (the MLP branch).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from vlmprune.compiler.errors import StructureError
from vlmprune.passes.graph.dataflow import consumers_downstream, producers_upstream

# Elementwise ops that may sit between the Q·Kᵀ MatMul and the Softmax with a
# constant scalar operand (scaling by 1/sqrt(d), or a temperature).
_SCALE_OPS = ("Mul", "Div")


@dataclasses.dataclass
class AttentionBlock:
    """One transformer block as the pruning pass needs it.

    Decomposed attention (Softmax over a Q·Kᵀ MatMul): q and k are that MatMul's
    operands (k already transposed, [B, H, dh, T]) and scale_ops the elementwise
    scaling between it and the Softmax. The ONNX `Attention` op (opset 23): q and k
    are its [B, H, T, dh] inputs and `scale` its scale.
    """

    index: int  # 1-based, in execution order
    attention: ir.Node  # the Softmax, or the Attention op
    q: ir.Value
    k: ir.Value
    k_transposed: bool
    scale_ops: list[ir.Node]
    scale: float
    output: ir.Value  # residual stream after the block
    # The residual stream between the attention and the MLP (the first residual Add's output): where a method
    # that works inside the blocks (token merging) acts.
    middle: ir.Value | None = None

    @property
    def softmax(self) -> ir.Node | None:
        return self.attention if self.attention.op_type == "Softmax" else None


@dataclasses.dataclass
class TowerStructure:
    blocks: list[AttentionBlock]
    pixel_input: ir.Value | None
    patch_size: int | None
    grid: tuple[int, int] | None  # patches along H and W

    @property
    def num_patches(self) -> int | None:
        return None if self.grid is None else self.grid[0] * self.grid[1]


def _scalar_const(value: ir.Value | None) -> bool:
    """A constant scalar, possibly behind Cast/CastLike (exporters cast the scale to Q's dtype)."""
    if value is None:
        return False
    producer = value.producer()
    if producer is not None and producer.op_type in ("Cast", "CastLike"):
        return _scalar_const(producer.inputs[0])
    tensor = ir.convenience.get_const_tensor(value)
    return tensor is not None and tensor.size == 1


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _attention_softmax(node: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
    """(qk_matmul, scale_ops) when node is an attention Softmax, else None."""
    if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return None
    axis = node.attributes.get_int("axis", -1)
    rank = _rank(node.inputs[0])
    if axis != -1 and (rank is None or axis != rank - 1):
        return None
    scale_ops: list[ir.Node] = []
    producer = node.inputs[0].producer()
    while producer is not None and (producer.op_type in _SCALE_OPS or _zero_mask(producer) is not None):
        if producer.op_type == "Add":  # an all-zero attention mask (torch.export of SDPA): changes nothing
            producer = _zero_mask(producer).producer()
            continue
        data, other = producer.inputs[0], producer.inputs[1]
        if producer.op_type == "Mul" and _scalar_const(data):
            data, other = other, data  # Mul(c, x)
        if not _scalar_const(other):
            return None
        scale_ops.insert(0, producer)
        producer = data.producer()
    if producer is None or producer.op_type != "MatMul":
        return None
    q, kt = producer.inputs
    if ir.convenience.get_const_tensor(q) is not None or ir.convenience.get_const_tensor(kt) is not None:
        return None  # a weight MatMul, not Q·Kᵀ
    if _rank(q) not in (None, 4) or _rank(kt) not in (None, 4):
        return None
    return producer, scale_ops


def _zero_mask(node: ir.Node) -> ir.Value | None:
    """The data operand of Add(x, mask) when mask is provably all zeros (an attention mask that masks nothing).

    torch.export writes SDPA without a mask as logits + zeros, or, with a dynamic batch,
    logits + Where(Expand(all-true, shape), 0, -inf); a mask with any non-zero entry would
    change the [CLS] row, and is not taken for one.
    """
    if node.op_type != "Add" or len(node.inputs) != 2:
        return None
    for data, mask in (node.inputs, node.inputs[::-1]):
        if data is not None and provably_zero(mask):
            return data
    return None


def provably_zero(value: ir.Value | None) -> bool:
    """Whether value is all zeros whatever the input: a constant, or Expand / Cast / Where of ones that are."""
    if value is None:
        return False
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        return not tensor.numpy().any()
    node = value.producer()
    if node is None:
        return False
    if node.op_type in ("Expand", "Cast", "Identity"):
        return provably_zero(node.inputs[0])
    if node.op_type == "Where":
        cond = _constant_through_expand(node.inputs[0])
        if cond is not None and cond.all():
            return provably_zero(node.inputs[1])
        if cond is not None and not cond.any():
            return provably_zero(node.inputs[2])
    return False


def _constant_through_expand(value: ir.Value | None):
    """The constant behind Expand(...)s of value, as an array, else None."""
    while value is not None:
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None:
            return tensor.numpy()
        node = value.producer()
        if node is None or node.op_type != "Expand":
            return None
        value = node.inputs[0]
    return None


def _attention_op(node: ir.Node) -> tuple[ir.Value, ir.Value, float] | None:
    """(q, k, scale) of an opset-23 Attention node that a [CLS]-row recompute can reproduce."""
    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    q, k = node.inputs[0], node.inputs[1]
    if any(v is not None for v in node.inputs[3:]):
        return None  # a mask or a KV cache: not a ViT encoder block
    if node.attributes.get_int("is_causal", 0) or node.attributes.get_float("softcap", 0.0):
        return None
    if _rank(q) != 4 or _rank(k) != 4:
        return None
    scale = node.attributes.get_float("scale", None)
    if scale is None:
        dh = q.shape[-1]
        if not isinstance(dh, int):
            return None
        scale = dh ** -0.5
    return q, k, float(scale)


def _scalar_value(value: ir.Value) -> float:
    producer = value.producer()
    if producer is not None and producer.op_type in ("Cast", "CastLike"):
        return _scalar_value(producer.inputs[0])
    return float(ir.convenience.get_const_tensor(value).numpy().reshape(-1)[0])


def _scale_of(scale_ops: list[ir.Node]) -> float:
    """The factor the elementwise ops between Q·Kᵀ and Softmax apply."""
    factor = 1.0
    for node in scale_ops:
        c = _scalar_value(scale_operand(node))
        factor = factor * c if node.op_type == "Mul" else factor / c
    return factor


def _block_output(graph: ir.Graph, softmax: ir.Node,
                  order: dict[ir.Node, int]) -> tuple[ir.Value, ir.Value] | None:
    """(the residual stream after the attention, the block output), or None."""
    down = {softmax, *consumers_downstream(*softmax.outputs)}
    up = {softmax, *producers_upstream(*softmax.inputs)}
    first = None
    for node in sorted(down, key=order.__getitem__):
        if node.op_type != "Add" or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        for branch, residual in ((a, b), (b, a)):
            if branch.producer() in down and (residual.producer() in up or residual.is_graph_input()):
                first = node
                break
        if first is not None:
            break
    if first is None:
        return None
    mid = first.outputs[0]
    after_mid = consumers_downstream(mid)
    for use in sorted(mid.uses(), key=lambda u: order[u.node]):
        node = use.node
        if node.op_type == "Add" and node is not first and len(node.inputs) == 2:
            other = node.inputs[1 - use.idx]
            if other is not None and other.producer() in after_mid:
                return mid, node.outputs[0]
    return None


def patch_conv(graph: ir.Graph) -> tuple[ir.Value | None, int | None, tuple[int, int] | None]:
    """The pixel input, patch size and grid, from the Conv that embeds patches (an .onnx source's patch size too)."""
    # The pixels may pass through a Cast or Identity on the way to the patch Conv.
    pixel_users = [(value, use) for value in graph.inputs for use in value.uses()]
    pixel_users += [(value, inner) for value, use in list(pixel_users) if use.node.op_type in ("Cast", "Identity")
                    for inner in use.node.outputs[0].uses()]
    for value, use in pixel_users:
        node = use.node
        if node.op_type != "Conv" or use.idx != 0:
            continue
        kernel = node.attributes.get_ints("kernel_shape")
        strides = node.attributes.get_ints("strides")
        if kernel is None:
            weight = ir.convenience.get_const_tensor(node.inputs[1])
            kernel = tuple(weight.shape[2:]) if weight is not None else None
        if not kernel or len(kernel) != 2 or kernel[0] != kernel[1] or tuple(strides or ()) != tuple(kernel):
            continue
        patch = int(kernel[0])
        grid = None
        shape = value.shape
        if shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape[2:]):
            grid = (shape[2] // patch, shape[3] // patch)
        return value, patch, grid
    return None, None, None


def find_tower_structure(graph: ir.Graph) -> TowerStructure:
    """Locate every attention block; raise StructureError saying what was missing.

    Softmax over Q·Kᵀ may have, between the two, Mul/Div by constant scalars (the scale)
    and Add of an all-zero constant (an empty attention mask).
    """
    order = {node: i for i, node in enumerate(graph)}
    blocks: list[AttentionBlock] = []
    for node in graph:
        found = _attention_softmax(node)
        fused = None if found is not None else _attention_op(node)
        if found is None and fused is None:
            continue
        found_output = _block_output(graph, node, order)
        if found_output is None:
            raise StructureError(
                f"found attention block {len(blocks) + 1} ({node.op_type}) but not its residual Adds: "
                "vlmprune handles pre-norm blocks x + Attn(LN(x)), then + MLP(LN(.))"
            )
        middle, output = found_output
        if found is not None:
            matmul, scale_ops = found
            q, kt = matmul.inputs
            blocks.append(AttentionBlock(len(blocks) + 1, node, q, kt, True, scale_ops, _scale_of(scale_ops), output,
                                         middle))
        else:
            q, k, scale = fused
            blocks.append(AttentionBlock(len(blocks) + 1, node, q, k, False, [], scale, output, middle))
    if not blocks:
        raise StructureError(
            "no attention block found: looked for Softmax(MatMul(Q, Kᵀ)) over rank-4 runtime tensors and for "
            "the ONNX Attention op without mask or cache (vendor-fused attention ops are not supported)"
        )
    pixel, patch, grid = patch_conv(graph)
    return TowerStructure(blocks, pixel, patch, grid)


def static_dim(value: ir.Value, axis: int) -> int | None:
    shape = value.shape
    if shape is None or len(shape) <= abs(axis):
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


def scale_operand(node: ir.Node) -> ir.Value:
    """The constant scalar operand of a Mul/Div found between Q·Kᵀ and Softmax."""
    if node.op_type == "Mul" and _scalar_const(node.inputs[0]):
        return node.inputs[0]
    return node.inputs[1]
