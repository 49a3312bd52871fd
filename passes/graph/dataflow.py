"""Dataflow queries and graph edits that every pass needs: reachability and fresh constants."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def producers_upstream(*values: ir.Value | None) -> dict[ir.Node, None]:
    """Every node that (transitively) computes one of values, as an insertion-ordered set."""
    seen: dict[ir.Node, None] = {}
    stack = list(values)
    while stack:
        value = stack.pop()
        producer = value.producer() if value is not None else None
        if producer is None or producer in seen:
            continue
        seen[producer] = None
        stack.extend(producer.inputs)
    return seen


def consumers_downstream(*values: ir.Value) -> dict[ir.Node, None]:
    """Every node that (transitively) reads one of values, as an insertion-ordered set."""
    seen: dict[ir.Node, None] = {}
    stack = [use.node for value in values for use in value.uses()]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        for out in node.outputs:
            stack.extend(use.node for use in out.uses())
    return seen


def fresh_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register array as a new initializer; the name gets a suffix if it is taken."""
    array = np.asarray(array)
    base, i = name, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    value = ir.Value(name=name, const_value=ir.tensor(array))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    value.shape = ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def opset(model: ir.Model) -> int:
    """The model's default-domain opset."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant a value holds (initializer or Constant), else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def const_scalar(value: ir.Value | None) -> float | None:
    """A constant holding exactly one element, as a float, else None."""
    array = const_array(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def const_ints(value: ir.Value | None) -> list[int] | None:
    """A constant integer tensor as a flat list, else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


def is_default_domain(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")
