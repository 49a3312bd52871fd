#!/usr/bin/env python
"""Every pruning method on one tower, side by side in one run: its selection alone and the whole pruned tower.

    python tools/bench_methods.py [--model clip-l-336] [--keep 192] [--repeats 5]

ONNX Runtime CPU, batch 1, the graphs the `ort` target compiles (the method inserted at its
default site, fused where the target fuses it). For each method:

- selection: the method's own nodes alone, cut out of that compiled tower: every node the
  insertion emitted (each carries its `vlmprune.role`, and the fused custom ops that replace
  some of them inherit it), with a Loop's body. Its inputs are the tower values those nodes
  read (block L's hidden states, Q and K, the feature layer's output, the projector output:
  whatever the method's emission reads, found in the graph and not assumed) and the graph
  inputs they read (text_embeds); its outputs are what the tower reads back (the new tokens)
  and the method's outputs (kept_indices, num_tokens). The inputs hold the real values of one
  run of the pruned tower on the parity image (and, for a prompt-aware method, 8 fixed-seed
  text rows: compiler.frontend.prompt_input.parity_text), and the cut-out graph is checked to give the
  tower's own outputs back on them. The tower's nodes are never in it, including the blocks
  after L that RetargetTokenCountPass rewired to the new token count, and the zeroing of
  padded rows on the token output (ZeroPaddingPass, a variable-K method's output contract);
- tower: the whole pruned tower, pixels to image_features.

Both are printed in ms, as ratios to cls, and the selection as a share of the dense
tower's time (the goal: below 5% for every method), with the timed selection's op count
(nodes inside Loop bodies counted apart) and inputs. Runs are interleaved across the
sessions so that machine noise hits all alike; medians are reported.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from machine_load import CpuMeter, busy_line, interleaved, physical_cores
from onnx_ir.passes.common import NameFixPass
from vlmprune.compiler.contract import TEXT, WEIGHTS
from vlmprune.compiler.frontend import export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.passes.methods import METHODS, get_method
from vlmprune.passes.methods.builder import role_of
from vlmprune.passes.prune import prune_record
from vlmprune.targets.base import PruneConfig
from vlmprune.targets.ort import OrtTarget, library
from vlmprune.compiler.frontend.prompt_input import parity_text
from vlmprune.targets.runtime import ort_session

TEXT_ROWS = 8  # prompt rows fed to a prompt-aware method (parity's count)


def compile_ort(dense_path: Path, method, params: dict, options: CompileOptions, layer: int | None = None) -> ir.Model:
    """The graph the ort target ships as model.onnx: its pipeline, then its fusion given the insertion's record."""
    config = PruneConfig(method, params, layer)
    model = OrtTarget().pipeline(config, options)(ir.load(dense_path)).model
    fusion = OrtTarget().fusion(config, options, prune_record(model))
    if fusion is not None:
        fusion(model)
    return model


def _subgraphs(node: ir.Node):
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def _with_bodies(node: ir.Node) -> list[ir.Node]:
    """node and every node of its subgraphs (a Loop's body), recursively."""
    nodes = [node]
    for graph in _subgraphs(node):
        for inner in graph:
            nodes.extend(_with_bodies(inner))
    return nodes


@dataclasses.dataclass
class Selection:
    """The method's nodes cut out of a compiled tower: a standalone graph and what it reads and gives."""

    model: onnx.ModelProto
    tower_values: list[str]  # its inputs computed by the tower: captured from one tower run
    graph_inputs: list[str]  # its inputs that are the tower's graph inputs too (text_embeds): fed as given
    outputs: list[str]
    ops: int  # top-level nodes
    body_ops: int  # nodes inside Loop bodies
    op_types: collections.Counter


def cut_selection(model: ir.Model) -> Selection:
    """The nodes the insertion emitted (those with a role: a fused op inherits its pattern's), as their own graph.

    Inputs: every value those nodes (their Loop bodies included) read that none of them computes and that is
    not a constant; outputs: every value they compute that the rest of the graph reads or that is a graph output.
    """
    NameFixPass()(model)  # every value named, so that the cut can refer to it by name
    graph = model.graph
    nodes = [n for n in graph if role_of(n) is not None]
    # the tower's own fused attention (com.microsoft MultiHeadAttention on ort) is the dense tower's, not the method's
    unowned = [f"{n.domain}.{n.op_type}" for n in graph
               if n.domain not in ("", "ai.onnx", "com.microsoft") and role_of(n) is None]
    if unowned or not nodes:
        raise RuntimeError(f"cannot tell the method's nodes apart: custom ops without a role {unowned}, "
                           f"{len(nodes)} nodes with one")
    inside = {inner: None for n in nodes for inner in _with_bodies(n)}  # graph order: inputs in a stable order
    reads: dict[str, ir.Value] = {}
    constants: set[str] = set()
    for inner in inside:
        for value in inner.inputs:
            if value is None:
                continue
            producer = value.producer()
            if producer is not None:
                if producer.graph is graph and producer not in inside:
                    reads[value.name] = value
            elif value.is_initializer() and value.graph is graph:
                constants.add(value.name)
            elif value.is_graph_input() and value.graph is graph:
                reads[value.name] = value
    outputs = [v for n in nodes for v in n.outputs
               if v.is_graph_output() or any(use.node not in inside for use in v.uses())]
    proto = ir.to_proto(model)
    by_node = dict(zip(graph, proto.graph.node, strict=True))
    cut = onnx.helper.make_graph(
        [by_node[n] for n in nodes], "selection",
        [ir.serde.serialize_value(v) for v in reads.values()],
        [ir.serde.serialize_value(v) for v in outputs],
        [t for t in proto.graph.initializer if t.name in constants])
    cut_model = onnx.helper.make_model(cut, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    return Selection(cut_model, [k for k, v in reads.items() if not v.is_graph_input()],
                     [k for k, v in reads.items() if v.is_graph_input()], [v.name for v in outputs], len(nodes),
                     len(inside) - len(nodes), collections.Counter(n.op_type for n in nodes))


def capture(model: ir.Model, names: list[str], path: Path, feed: dict, lib) -> dict[str, np.ndarray]:
    """The values `names` take in one run of model on feed (added as outputs to a copy saved at path)."""
    graph = model.graph
    values = {v.name: v for n in graph for v in n.outputs}
    added = [values[name] for name in names if not values[name].is_graph_output()]
    graph.outputs.extend(added)
    try:
        ir.save(model, path)
    finally:
        for value in added:
            graph.outputs.remove(value)
    session = ort_session(path, lib)
    wanted = [o.name for o in session.get_outputs() if o.name in names]
    return dict(zip(wanted, session.run(wanted, {i.name: feed[i.name] for i in session.get_inputs()}), strict=True))


def tower_feed(session, x: np.ndarray) -> dict[str, np.ndarray]:
    """The pixels, and parity's text rows where the tower takes text_embeds [B, T, D]."""
    feed = {}
    for meta in session.get_inputs():
        feed[meta.name] = parity_text(x, meta.shape[-1], TEXT_ROWS) if meta.name == TEXT else x
    return feed


def _interleaved_medians(runs: dict, repeats: int, settle_s: float) -> dict[str, float]:
    """Median ms of each run after one warm-up call each (machine_load.interleaved)."""
    for fn in runs.values():
        fn()  # warm-up
    return {name: statistics.median(t) for name, t in interleaved(runs, repeats, settle_s).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="clip-l-336")
    parser.add_argument("--keep", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    os.environ.setdefault("VLMPRUNE_ORT_THREADS", str(physical_cores()))  # ort_session's intra-op threads
    source = load_source(args.model)
    n = source.num_patches
    x, _ = parity_inputs(1, source.image_size, source.mean, source.std)
    lib = (library(),)

    selections, towers, cuts, shapes = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dense = export_onnx(source.pipeline, source.image_size, 1, 18)
        ir.external_data.unload_from_model(dense, folder, WEIGHTS, size_threshold_bytes=1024)
        ir.save(dense, folder / "dense.onnx")
        dense_session = ort_session(folder / "dense.onnx")
        dense_feed = tower_feed(dense_session, x)
        towers["dense"] = lambda s=dense_session, f=dense_feed: s.run(None, f)
        for name in METHODS:
            method = get_method(name)
            params = method.parse(args.keep, {})
            options = CompileOptions(method=name, keep=args.keep)
            model = compile_ort(folder / "dense.onnx", method, params, options)
            path = folder / f"{name}.onnx"  # the weights stay in folder/WEIGHTS, where every graph here finds them
            ir.save(model, path)
            tower = ort_session(path, lib)
            feed = tower_feed(tower, x)
            towers[name] = lambda s=tower, f=feed: s.run(None, f)
            cut = cuts[name] = cut_selection(model)
            seen = capture(model, cut.tower_values + cut.outputs, folder / f"{name}.capture.onnx", feed, lib)
            onnx.save(cut.model, folder / f"{name}.selection.onnx")  # beside WEIGHTS, should it read any
            onnx.checker.check_model(folder / f"{name}.selection.onnx", full_check=True)
            session = ort_session(folder / f"{name}.selection.onnx", lib)
            inputs = {**{k: seen[k] for k in cut.tower_values}, **{k: feed[k] for k in cut.graph_inputs}}
            _check_cut(name, session, inputs, {k: seen[k] for k in cut.outputs})
            shapes[name] = {k: v.shape for k, v in inputs.items()}
            selections[name] = lambda s=session, f=inputs: s.run(None, f)
        meter = CpuMeter()
        selection_ms = _interleaved_medians(selections, args.repeats * 10, 0.01)
        tower_ms = _interleaved_medians(towers, args.repeats, 0.2)
        load = meter.report()

    dense_ms = tower_ms["dense"]
    print(f"{args.model}, ONNX Runtime CPU ({os.environ['VLMPRUNE_ORT_THREADS']} intra-op threads), batch 1, "
          f"keep {args.keep} of {n}, default site per method; "
          f"medians of {args.repeats * 10} (selection) and {args.repeats} (tower) interleaved runs")
    print(f"dense tower: {dense_ms:.1f} ms")
    print(f"{'method':<10} {'site':<9} {'ops':>9} {'selection ms':>13} {'x cls':>7} {'% of dense':>11} "
          f"{'tower ms':>10} {'x cls':>7} {'vs dense':>9}")
    for name in METHODS:
        site = get_method(name).needs(get_method(name).parse(args.keep, {})).site
        sel, tow, cut = selection_ms[name], tower_ms[name], cuts[name]
        ops = f"{cut.ops}" + (f"+{cut.body_ops}" if cut.body_ops else "")
        print(f"{name:<10} {site:<9} {ops:>9} {sel:>13.3f} {sel / selection_ms['cls']:>6.2f}x "
              f"{100 * sel / dense_ms:>10.2f}% {tow:>10.1f} {tow / tower_ms['cls']:>6.2f}x {dense_ms / tow:>8.2f}x")
    print("timed selections (ops: the method's nodes in the compiled tower, +N: inside Loop bodies), fed the tower's "
          "own values at:")
    for name, cut in cuts.items():
        fused = sorted(op for op in cut.op_types if op in OrtTarget.spellings)
        print(f"  {name}: {', '.join(f'{k} {list(shapes[name][k])}' for k in cut.tower_values + cut.graph_inputs)}"
              + (f"; fused: {', '.join(fused)}" if fused else ""))
    if busy_line(load):
        print(busy_line(load))
    worst = max(selection_ms, key=selection_ms.get)
    print(f"max_selection_share_of_dense_tower: {100 * selection_ms[worst] / dense_ms:.2f}% ({worst}; goal < 5%)")
    return 0


def _check_cut(name: str, session, inputs: dict, expected: dict) -> None:
    """The cut-out selection gives the tower's own values back on the tower's inputs to it: what is timed is what
    the tower runs (kept indices exactly; tokens to float tolerance, a subgraph alone may be fused differently)."""
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))
    for key, want in expected.items():
        exact = np.issubdtype(want.dtype, np.integer)
        if got[key].shape != want.shape or not (np.array_equal(got[key], want) if exact
                                                 else np.allclose(got[key], want, rtol=1e-4, atol=1e-5)):
            raise RuntimeError(f"{name}: the cut-out selection's {key} differs from the tower's")


if __name__ == "__main__":
    sys.exit(main())
