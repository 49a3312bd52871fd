#!/usr/bin/env python
"""The language model's prefill graph alone, as each fusion leaves it, beside onnxruntime-genai's builder graph.

    python tools/bench_llm_fusion.py [--tokens 640] [--rounds 10] [--workdir DIR] [--no-genai]

tools/bench_e2e.py times whole rows (tower + prefill) block by block; at a Qwen2-0.5B shape the tower and the
projections dominate every row, and one block's sessions are freed before the next is built, so a few per cent
between two LLM graphs drowns in the machine's own spread. This times the prefill graphs only, on the same
`--tokens` input embeddings, each in its own ONNX Runtime session (CPU, 2 intra-op threads), all sessions built
first and then run interleaved, round after round, alternating the order (a neighbour's load that rises or falls
lands on every graph alike):

- `unfused`: the torch.onnx prefill as exported (compiler.llm.torch_exporter.export_prefill): standard ops, a causal
  mask per layer built as a Where over [1, heads, S, S];
- `attention`: each layer's attention fused into com.microsoft.MultiHeadAttention (passes.llm_attention_fusion);
- `attention+norms`: that and each residual Add + RMSNorm fused into SkipSimplifiedLayerNormalization
  (passes.llm_norm_fusion);
- `gqa+norms`: as `attention+norms`, with each causal attention GroupQueryAttention (passes.llm_gqa_fusion) instead
  of the shared key/value heads' expansion and MultiHeadAttention;
- `shipped`: what target ort ships as prefill.onnx (torch_exporter.fuse_attention): `gqa+norms` with each rotation
  of q and K one RotaryEmbedding (passes.llm_rotary_fusion);
- `genai builder`: onnxruntime-genai's model builder graph of the same model (compiler.llm.genai.export_genai: fp32
  CPU, the head on the last token), where onnxruntime-genai is installed.

The model is bench_e2e's Qwen2-0.5B-shaped decoder with seeded weights. Printed per graph: min and median ms over the
rounds, and each median's ratio to `unfused`'s and to the builder's; then the CPU share other processes took while
timing. The min is the figure least moved by other load (noise only adds time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

import bench_e2e
from machine_load import CpuMeter, busy_line

SETTLE_S = 0.2
WARMUP = 2
UNFUSED, ATTENTION, NORMS, GQA, SHIPPED, GENAI = ("unfused", "attention", "attention+norms", "gqa+norms",
                                                 "shipped (gqa+rotary+norms)", "genai builder")


def graphs(folder: Path, log, genai: bool = True, lm=None) -> dict[str, Path]:
    """The prefill graphs of lm (default: the Qwen2-0.5B-shaped model) in folder (made once, reused), by row name."""
    from vlmprune.compiler.llm.torch_exporter import export_prefill, fuse_attention
    from vlmprune.passes.llm_attention_fusion import LlmAttentionFusionPass
    from vlmprune.passes.llm_gqa_fusion import LlmGroupQueryAttentionPass
    from vlmprune.passes.llm_norm_fusion import LlmNormFusionPass

    lm = bench_e2e.qwen2_05b_shaped() if lm is None else lm
    layers = lm.config.num_hidden_layers
    out = {UNFUSED: folder / "unfused.onnx", ATTENTION: folder / "attention.onnx", NORMS: folder / "norms.onnx",
           GQA: folder / "gqa.onnx", SHIPPED: folder / "shipped.onnx"}
    if not out[UNFUSED].is_file():
        log("export the prefill graph (torch.onnx)")
        bench_e2e.save_graph(export_prefill(lm, None), folder, "unfused")
    if not out[ATTENTION].is_file():
        ir.save(LlmAttentionFusionPass(layers)(ir.load(out[UNFUSED])).model, out[ATTENTION])
    if not out[NORMS].is_file():
        ir.save(LlmNormFusionPass()(ir.load(out[ATTENTION])).model, out[NORMS])
    if not out[GQA].is_file():
        ir.save(LlmNormFusionPass()(LlmGroupQueryAttentionPass()(ir.load(out[ATTENTION])).model).model, out[GQA])
    if not out[SHIPPED].is_file():
        ir.save(fuse_attention(ir.load(out[UNFUSED]), layers), out[SHIPPED])
    if genai:
        path = bench_e2e.genai_graph(lm, folder, log)
        if path is not None:
            out[GENAI] = path
    return out


def _feeds(session, embeds: np.ndarray, heads: int) -> dict[str, np.ndarray]:
    """inputs_embeds and, by what the graph takes, position_ids or an attention mask and an empty past (its head
    count read off the graph's own past input; its head size too, or the width over the query heads where the
    builder leaves that axis named)."""
    tokens, width = embeds.shape[1], embeds.shape[2]
    feeds = {}
    for spec in session.get_inputs():
        if spec.name == "inputs_embeds":
            feeds[spec.name] = embeds
        elif spec.name == "position_ids":
            feeds[spec.name] = np.arange(tokens, dtype=np.int64)[None]
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones((1, tokens), dtype=np.int64)
        elif spec.name.startswith("past_key_values."):  # [batch, kv heads, 0, head size]
            size = spec.shape[3] if isinstance(spec.shape[3], int) else width // heads  # the builder names it
            feeds[spec.name] = np.zeros((1, spec.shape[1], 0, size), dtype=np.float32)
    return feeds


def time_graphs(paths: dict[str, Path], tokens: int, rounds: int, log, heads: int,
                outputs: dict | None = None) -> tuple[dict[str, list[float]], tuple | None]:
    """ms per run of each graph, interleaved round by round; the load other processes put on the CPUs meanwhile.
    heads: the model's query heads. outputs: where given, each graph's first output (the last token's logits) of its
    last run, by name."""
    from vlmprune.targets.runtime import ort_session

    runs = {}
    for name, path in paths.items():
        session = ort_session(path)
        width = next(i for i in session.get_inputs() if i.name == "inputs_embeds").shape[2]  # [batch, sequence, hidden]
        embeds = (np.random.default_rng(0).standard_normal((1, tokens, width)) * 0.02).astype(np.float32)
        feeds = _feeds(session, embeds, heads)
        for _ in range(WARMUP):
            session.run(None, feeds)
        runs[name] = (session, feeds)
    times: dict[str, list[float]] = {name: [] for name in runs}
    meter = CpuMeter()
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            session, feeds = runs[name]
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            result = session.run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
            if outputs is not None:
                outputs[name] = result[0]
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.0f}" for n, t in times.items()) + " ms")
    return times, meter.report()


def table(times: dict[str, list[float]], tokens: int) -> list[str]:
    base = statistics.median(times[UNFUSED])
    builder = statistics.median(times[GENAI]) if GENAI in times else None
    lines = [f"prefill of {tokens} tokens, Qwen2-0.5B shape, ONNX Runtime CPU (2 threads), {len(times[UNFUSED])} "
             "interleaved rounds", "",
             "| graph | min ms | median ms | speedup over unfused (median) | builder's median / this one's |",
             "|---|---|---|---|---|"]
    for name, values in times.items():
        median = statistics.median(values)
        versus = f"{builder / median:.3f}x" if builder is not None else "—"
        lines.append(f"| {name} | {min(values):.1f} | {median:.1f} | {base / median:.3f}x | {versus} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=640, help="prompt length (bench_e2e's dense row: 576 + 64)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the graphs here (reused when present)")
    parser.add_argument("--no-genai", action="store_true", help="leave out onnxruntime-genai's builder graph")
    args = parser.parse_args(argv)
    for flag in ("tokens", "rounds"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="vlmprune-llm-fusion-") as tmp:
        folder = args.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        times, load = time_graphs(graphs(folder, log, genai=not args.no_genai), args.tokens, args.rounds, log,
                                  heads=bench_e2e.QWEN2_05B["num_attention_heads"])
    print("\n".join(table(times, args.tokens)))
    if busy_line(load):
        print(busy_line(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
