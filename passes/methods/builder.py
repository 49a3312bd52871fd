"""Appending standard-ONNX nodes for a method, with every node's role recorded in the IR.

Methods write their graph through this builder so that (1) version-dependent ops are
spelled for the model's opset, (2) every constant is a fresh initializer, and (3) every
node carries `vlmprune.role` in its metadata_props: "score" (computes what the selection
ranks), "select" (computes indices) or "tokens" (builds the output tokens from them).
Targets read the roles, never op types or tensor shapes, to know what must stay in
floating point (the selection is discrete: a lower precision there moves the K-th
boundary) and what may be quantized.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnx_ir as ir

from vlmprune.compiler.contract import NORM_EPS, ROLE, ROLES, SCORE, SELECT, TOKENS  # noqa: F401  (their home)
from vlmprune.passes.graph.dataflow import fresh_initializer, producers_upstream

INT64_MAX = np.iinfo(np.int64).max


class Builder:
    """Collects nodes for one insertion; `graph.insert_after(anchor, b.nodes)` places them."""

    def __init__(self, graph: ir.Graph, opset: int, prefix: str):
        self.graph, self.opset, self.prefix = graph, opset, prefix
        self.nodes: list[ir.Node] = []
        # Nodes a method places inside the graph upstream of its site (Builder.after), and the values it
        # substitutes there (Builder.reroute): the insertion pass applies both after placing `nodes`.
        self.placements: list[tuple[ir.Node, list[ir.Node]]] = []
        self.reroutes: list[tuple[ir.Value, ir.Value]] = []
        # Graph outputs a method replaces (Method.later_blocks: the kept rows of the tower's own output).
        self.outputs: list[tuple[ir.Value, ir.Value]] = []
        self._role = SCORE
        self._names: set[str] = set()

    @contextlib.contextmanager
    def role(self, role: str):
        """Nodes created inside the block get this role."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        previous, self._role = self._role, role
        try:
            yield self
        finally:
            self._role = previous

    @contextlib.contextmanager
    def after(self, anchor: ir.Node):
        """Nodes created inside the block go right after `anchor`, a node of the graph upstream of the site (a
        method that acts inside earlier blocks, as token merging does), instead of after the site."""
        previous, self.nodes = self.nodes, []
        try:
            yield self
        finally:
            self.placements.append((anchor, self.nodes))
            self.nodes = previous

    def reroute(self, old: ir.Value, new: ir.Value) -> None:
        """Every consumer of `old` in the graph, except this builder's own nodes, reads `new` instead."""
        self.reroutes.append((old, new))

    def replace_output(self, old: ir.Value, new: ir.Value) -> None:
        """The graph output `old` becomes `new`, under old's name (old is renamed NAME.dense)."""
        self.outputs.append((old, new))

    def all_nodes(self) -> list[ir.Node]:
        """Every node this builder made: after the site, and placed inside the graph."""
        return [*self.nodes, *(n for _, nodes in self.placements for n in nodes)]

    def _unique(self, name: str) -> str:
        base, i = f"{self.prefix}/{name}", 0
        full = base
        while full in self._names:
            i += 1
            full = f"{base}_{i}"
        self._names.add(full)
        return full

    def const(self, name: str, array) -> ir.Value:
        return fresh_initializer(self.graph, f"{self.prefix}/{name}", np.asarray(array))

    def ints(self, name: str, values) -> ir.Value:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def scalar(self, name: str, value, dtype=np.float32) -> ir.Value:
        return self.const(name, np.array(value, dtype=dtype))

    def op(self, op_type: str, inputs, name: str, num_outputs: int = 1, **attrs):
        full = self._unique(name)
        node = ir.node(op_type, inputs, attributes=attrs or None, num_outputs=num_outputs, name=full)
        node.metadata_props[ROLE] = self._role
        for i, out in enumerate(node.outputs):
            out.name = full + (f":{i}" if num_outputs > 1 else "")
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def add_node(self, node: ir.Node) -> ir.Node:
        """A node built elsewhere (e.g. a Loop with its body), given this builder's role."""
        node.metadata_props[ROLE] = self._role
        self.nodes.append(node)
        return node

    # -- spellings that depend on the opset

    def reduce(self, op_type: str, x: ir.Value, axes: list[int], keepdims: int, name: str) -> ir.Value:
        if self.opset >= 18 or op_type == "ReduceSum" and self.opset >= 13:
            return self.op(op_type, [x, self.ints(f"{name}_axes", axes)], name, keepdims=keepdims)
        return self.op(op_type, [x], name, axes=axes, keepdims=keepdims)

    def slice(self, x: ir.Value, start: int, end: int, axis: int, name: str) -> ir.Value:
        return self.op("Slice", [x, self.ints(f"{name}_starts", [start]), self.ints(f"{name}_ends", [end]),
                                 self.ints(f"{name}_axes", [axis])], name)

    def unsqueeze(self, x: ir.Value, axes: list[int], name: str) -> ir.Value:
        return self.op("Unsqueeze", [x, self.ints(f"{name}_axes", axes)], name)

    def squeeze(self, x: ir.Value, axes: list[int], name: str) -> ir.Value:
        return self.op("Squeeze", [x, self.ints(f"{name}_axes", axes)], name)

    # -- small compositions several methods use

    def sort_ascending(self, indices: ir.Value, k: int, name: str) -> ir.Value:
        """Indices [B, k] in ascending order: TopK of the indices themselves, smallest first."""
        kept, _ = self.op("TopK", [indices, self.ints(f"{name}_k", [k])], name, num_outputs=2, axis=-1, largest=0,
                          sorted=1)
        return kept

    def gather_rows(self, tokens: ir.Value, indices: ir.Value, name: str) -> ir.Value:
        """tokens [B, N, D], indices [B, k] -> [B, k, D]: a per-image row gather (GatherND, batch_dims=1)."""
        return self.op("GatherND", [tokens, self.unsqueeze(indices, [-1], f"{name}_nd")], name, batch_dims=1)

    def l2_normalize(self, x: ir.Value, name: str, eps: float = NORM_EPS) -> ir.Value:
        """x / max(||x||_2, eps) over the last axis."""
        norm = self.reduce("ReduceL2", x, [-1], 1, f"{name}_norm")
        return self.op("Div", [x, self.op("Max", [norm, self.scalar(f"{name}_eps", eps)], f"{name}_den")], name)


def role_of(node: ir.Node) -> str | None:
    """The role the insertion recorded on node, or None for a node it did not emit."""
    return node.metadata_props.get(ROLE)


def selection_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The emitted nodes whose results decide which tokens are kept ("score" and "select"), in graph order."""
    return [n for n in graph if role_of(n) in (SCORE, SELECT)]


def feeding_selection(graph: ir.Graph) -> list[ir.Node]:
    """The selection's nodes and everything upstream of them, in graph order.

    In a tower pruned after block L that is blocks 1..L, the [CLS]-row recompute and the
    TopKs: what a quantizer must leave in floating point for the kept set not to move.
    """
    chosen = selection_nodes(graph)
    upstream = producers_upstream(*[v for n in chosen for v in n.inputs])
    wanted = set(chosen) | set(upstream)
    return [n for n in graph if n in wanted]


# ---------------------------------------------------------------------------- Loop bodies


class LoopBody:
    """A second builder writing into a Loop body graph (the outer builder's naming, under `loop/`; the Loop node
    carries the role, so body nodes get none). Its `op` has Builder.op's signature, so a step function written
    against a builder `w` emits the same nodes unrolled (w = the outer builder) or inside a Loop (w = a LoopBody)."""

    def __init__(self, outer: Builder, graph: ir.Graph):
        self.outer, self.graph, self.nodes = outer, graph, []

    def op(self, op_type, inputs, name, num_outputs=1, **attrs):
        node = ir.node(op_type, inputs, attributes=attrs or None, num_outputs=num_outputs,
                       name=f"{self.outer.prefix}/loop/{name}")
        for i, out in enumerate(node.outputs):
            out.name = node.name + (f":{i}" if num_outputs > 1 else "")
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)


def loop_body(b: Builder, name: str, carried: dict[str, list]) -> tuple[LoopBody, ir.Value, ir.Value, list[ir.Value]]:
    """An empty Loop body graph `name` with its inputs: (writer, iteration i, cond_in, the carried float inputs).

    carried: body input name (under `loop/`) -> its shape (dims or symbolic names), in Loop input order."""
    iteration = ir.Value(name=f"{b.prefix}/loop/i", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond_in = ir.Value(name=f"{b.prefix}/loop/cond_in", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    state = [ir.Value(name=f"{b.prefix}/loop/{key}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape))
             for key, shape in carried.items()]
    body = ir.Graph([iteration, cond_in, *state], [], nodes=[], name=name)
    return LoopBody(b, body), iteration, cond_in, state


def add_loop(b: Builder, w: LoopBody, outputs: list[ir.Value], trips: int, initial: list[ir.Value],
             name: str) -> ir.Node:
    """Close the body `w` with `outputs` (cond, carried..., scanned...) and add Loop(trips, true, *initial) `name`."""
    w.graph.extend(w.nodes)
    w.graph.outputs.extend(outputs)
    trip_count = b.const("trips", np.array(trips, dtype=np.int64))
    keep_going = b.const("cond", np.array(True))
    loop = ir.node("Loop", [trip_count, keep_going, *initial], attributes={"body": w.graph},
                   num_outputs=len(outputs) - 1, name=f"{b.prefix}/{name}")
    for i, out in enumerate(loop.outputs):
        out.name = f"{b.prefix}/{name}:{i}"
    b.add_node(loop)
    return loop
