#!/usr/bin/env python
"""Every pruning method on one tower, side by side in one run: its selection alone and the whole pruned tower.

    python tools/bench_methods.py [--model clip-l-336] [--keep 192] [--repeats 5]

ONNX Runtime CPU, batch 1, the graphs the `ort` target compiles (the method inserted at its
default site, fused where the target fuses it). For each method:

- selection: the method's own subgraph alone, on tensors of the tower's shapes (block L's
  hidden states, Q and K for cls / visionzip; the projector output for divprune / dart),
  exactly as the ort target emits and fuses it;
- tower: the whole pruned tower, pixels to image_features.

Both are printed in ms, as ratios to cls, and the selection as a share of the dense
tower's time (the goal: below 5% for every method). Runs are interleaved across the
sessions so that machine noise hits all alike; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from machine_load import CpuMeter, busy_line, interleaved, physical_cores
from vlmprune.compiler.contract import KEPT, WEIGHTS
from vlmprune.compiler.frontend import export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.passes.methods import METHODS, get_method
from vlmprune.passes.methods.base import BLOCK, GraphInputs
from vlmprune.passes.methods.builder import Builder
from vlmprune.targets.base import PruneConfig
from vlmprune.targets.ort import OrtTarget, library
from vlmprune.targets.runtime import ort_session, run_session


def site_graph(method, params, tokens: int, width: int, heads: int, head_dim: int, has_cls: bool) -> ir.Model:
    """The method's subgraph alone: inputs the site's tensors, outputs (tokens, kept_indices)."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    hidden = ir.Value(name="hidden", type=f32, shape=ir.Shape([1, tokens, width]))
    inputs = [hidden]
    block = None
    if method.needs(params).site == BLOCK:
        q = ir.Value(name="q", type=f32, shape=ir.Shape([1, heads, tokens, head_dim]))
        k = ir.Value(name="k", type=f32, shape=ir.Shape([1, heads, tokens, head_dim]))
        inputs += [q, k]
        # What passes.graph.structure gives the emission for an ONNX Attention block: Q, K, the scale.
        block = types.SimpleNamespace(q=q, k=k, k_transposed=False, scale_ops=[], softmax=None,
                                      scale=head_dim ** -0.5)
    graph = ir.Graph(inputs, [], nodes=[], name=method.name, opset_imports={"": 18})
    b = Builder(graph, 18, f"vlmprune/{method.name}")
    out, kept = method.emit(b, params, GraphInputs(hidden, has_cls, tokens - has_cls, block),
                            OrtTarget().formulation(method))
    graph.extend(b.nodes)
    out.name, kept.name = "tokens", KEPT
    graph.outputs.extend([out, kept])
    model = ir.Model(graph, ir_version=10)
    ShapeInferencePass()(model)
    fusion = OrtTarget().fusion(PruneConfig(method, params), CompileOptions(method=method.name))
    if fusion is not None:
        fusion(model)
    return model


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
    pipe = source.pipeline
    config = pipe.vision_model.config
    n = source.num_patches
    width, heads = config.hidden_size, config.num_attention_heads
    out_width = pipe.projector.linear_2.out_features if pipe.projector is not None else width
    x, _ = parity_inputs(1, source.image_size, source.mean, source.std)
    rng = np.random.default_rng(0)
    lib = (library(),)

    selections, towers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dense = export_onnx(pipe, source.image_size, 1, 18)
        ir.external_data.unload_from_model(dense, folder, WEIGHTS, size_threshold_bytes=1024)
        ir.save(dense, folder / "dense.onnx")
        dense_session = ort_session(folder / "dense.onnx")
        towers["dense"] = lambda s=dense_session: run_session(s, x)
        for name in METHODS:
            method = get_method(name)
            params = method.parse(args.keep, {})
            block_site = method.needs(params).site == BLOCK
            tokens = n + 1 if block_site else n
            site = site_graph(method, params, tokens, width if block_site else out_width, heads, width // heads,
                              has_cls=block_site)
            feeds = {"hidden": rng.standard_normal((1, tokens, width if block_site else out_width)).astype(np.float32)}
            if block_site:
                for key in ("q", "k"):
                    feeds[key] = (rng.standard_normal((1, heads, tokens, width // heads)) * 0.125).astype(np.float32)
            session = ort_session(ir.to_proto(site).SerializeToString(), lib)
            selections[name] = lambda s=session, f=feeds: s.run(None, f)
            options = CompileOptions(method=name, keep=args.keep)
            model = ir.load(folder / "dense.onnx")
            model = OrtTarget().pipeline(PruneConfig(method, params), options)(model).model
            fusion = OrtTarget().fusion(PruneConfig(method, params), options)
            if fusion is not None:
                fusion(model)
            path = folder / f"{name}.onnx"
            ir.save(model, path)
            tower = ort_session(path, lib)
            towers[name] = lambda s=tower: run_session(s, x)
        meter = CpuMeter()
        selection_ms = _interleaved_medians(selections, args.repeats * 10, 0.01)
        tower_ms = _interleaved_medians(towers, args.repeats, 0.2)
        load = meter.report()

    dense_ms = tower_ms["dense"]
    print(f"{args.model}, ONNX Runtime CPU ({os.environ['VLMPRUNE_ORT_THREADS']} intra-op threads), batch 1, "
          f"keep {args.keep} of {n}, default site per method; "
          f"medians of {args.repeats * 10} (selection) and {args.repeats} (tower) interleaved runs")
    print(f"dense tower: {dense_ms:.1f} ms")
    print(f"{'method':<10} {'site':<9} {'selection ms':>13} {'x cls':>7} {'% of dense':>11} "
          f"{'tower ms':>10} {'x cls':>7} {'vs dense':>9}")
    for name in METHODS:
        site = get_method(name).needs(get_method(name).parse(args.keep, {})).site
        sel, tow = selection_ms[name], tower_ms[name]
        print(f"{name:<10} {site:<9} {sel:>13.3f} {sel / selection_ms['cls']:>6.2f}x {100 * sel / dense_ms:>10.2f}% "
              f"{tow:>10.1f} {tow / tower_ms['cls']:>6.2f}x {dense_ms / tow:>8.2f}x")
    if busy_line(load):
        print(busy_line(load))
    worst = max(selection_ms, key=selection_ms.get)
    print(f"max_selection_share_of_dense_tower: {100 * selection_ms[worst] / dense_ms:.2f}% ({worst}; goal < 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
