#!/usr/bin/env python
"""Time to first token of the dense LLM prefill: onnxruntime-genai's builder graph vs torch.onnx's, one run.

    python tools/bench_llm_exporters.py [--repeats 5] [--image 193] [--text 64] [--workdir DIR]

ONNX Runtime CPU, batch 1, one process, fp32, a Qwen2-0.5B-shaped decoder with seeded weights
(24 layers, 896 wide, 14 query / 2 key-value heads, MLP 4864, vocabulary 151936, tied head;
tools/bench_e2e.py's qwen2_05b_shaped). The prompt: `--image` image tokens (seeded N(0, 1)
features) between `--text` text tokens (embeddings of seeded ids, half before the image, half
after), 257 tokens by default.

Rows (each the configuration its user would run fastest: ORT_ENABLE_ALL graph optimisations,
the same intra-op threads, one per physical core):
- torch.onnx unfused: compiler.llm.torch_exporter.export_decoder(lm, None, folder)'s prefill.decomposed.onnx
  (standard ops, MatMul/Softmax attention with GQA heads expanded, the causal mask a Where per layer;
  logits of the last token only), fed inputs_embeds and position_ids 0..T-1: the ratios' base.
- torch.onnx fused: the same export's prefill.onnx, what target ort ships: each layer's attention
  com.microsoft.MultiHeadAttention with unidirectional=1 (passes.llm_attention_fusion), same feed.
- genai: onnxruntime-genai's model builder (compiler.llm.genai.export_genai, exclude_embeds:
  what `python -m onnxruntime_genai.models.builder -p fp32 -e cpu` makes), fed inputs_embeds,
  attention_mask and an empty past; its logits cover every prompt token (T x vocab from the
  head: ~2·T·D·V FLOPs more than the last token's).
- genai last-logits: the same with the builder's prune_lm_head=true (the head on the last token
  only, as the torch.onnx graph), the like-for-like row.

TTFT = one prefill run (-> the last token's logits and every present) + argmax; median of
--repeats after one warm-up run per session. By default rows run interleaved, run by run (A B C,
A B C, ...), all three sessions alive (each holds ~2x the 2 GB of weights, ~12 GB together), so
a neighbour's load on a shared machine falls on every row alike; the table also gives the
median of the per-round ratios. --schedule blocks runs one row's session at a time, forwards
then backwards, as tools/bench_e2e.py does, for a machine without the memory. The run reports
how much CPU other processes took meanwhile.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_e2e import SETTLE_S, WARMUP, _blocks, qwen2_05b_shaped
from machine_load import CpuMeter, busy_line, interleaved, physical_cores
from vlmprune.compiler.frontend.source import quiet_transformers
from vlmprune.compiler.llm.torch_exporter import PREFILL, PREFILL_DECOMPOSED, export_decoder
from vlmprune.compiler.llm.genai import MODEL, export_genai, genai_version


BASE, FUSED = "torch.onnx unfused", "torch.onnx fused"


def session(path: Path, threads: int):
    """The fastest CPU setting for either graph: every graph optimisation, one intra-op thread per core."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _rounds(rows: dict, repeats: int, log) -> dict[str, list[float]]:
    """ms per run of every row, run by run (A B C, A B C, ...): all sessions alive, each warmed up once."""
    return interleaved({name: build() for name, build in rows.items()}, repeats, SETTLE_S, log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--image", type=int, default=193, help="image tokens in the prompt")
    parser.add_argument("--text", type=int, default=64, help="text tokens in the prompt (half before the image)")
    parser.add_argument("--schedule", choices=("interleaved", "blocks"), default="interleaved",
                        help="interleaved: every row once per round, all sessions alive (~12 GB); blocks: one "
                             "row's session at a time, forwards then backwards (~4 GB)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the graphs here and reuse those already there (default: a temp dir)")
    args = parser.parse_args()

    quiet_transformers()
    cores = physical_cores()
    torch.set_num_threads(cores)
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:6.0f}s] {m}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-llm-exporters-") as tmp:
        folder = args.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        lm = qwen2_05b_shaped()
        config = lm.config
        config.bos_token_id = config.eos_token_id = 151643  # Qwen2-0.5B's <|endoftext|>: the builder needs an eos
        embed = lm.get_input_embeddings().weight.detach().numpy()
        rng = np.random.default_rng(0)
        ids = rng.integers(0, embed.shape[0], size=args.text)
        before = args.text // 2
        image = rng.standard_normal((1, args.image, config.hidden_size)).astype(np.float32)
        embeds = np.ascontiguousarray(np.concatenate([embed[ids[:before]][None], image, embed[ids[before:]][None]],
                                                     axis=1).astype(np.float32))
        length = embeds.shape[1]
        graphs = {}
        if not (folder / "torch" / PREFILL_DECOMPOSED).is_file():
            log("export with torch.onnx (compiler.llm.torch_exporter.export_decoder, dense)")
            shutil.rmtree(folder / "torch", ignore_errors=True)
            export_decoder(lm, None, folder / "torch")
        graphs[BASE] = folder / "torch" / PREFILL_DECOMPOSED
        graphs[FUSED] = folder / "torch" / PREFILL
        for name, last in (("genai", False), ("genai last-logits", True)):
            sub = folder / ("genai_last" if last else "genai")
            if not (sub / MODEL).is_file():
                shutil.rmtree(sub, ignore_errors=True)
                log(f"export with onnxruntime-genai's builder ({'prune_lm_head' if last else 'default head'})")
                export_genai(lm, sub, last_logits_only=last, parity=False, progress=log)
            graphs[name] = sub / MODEL
        lm = embed = None  # the torch weights (2 GB) are not needed for timing

        first, logits = {}, {}

        def make(name):
            def build():
                s = session(graphs[name], cores)
                if name in (BASE, FUSED):
                    feed = {"inputs_embeds": embeds, "position_ids": np.arange(length, dtype=np.int64)[None]}
                else:
                    feed = {"inputs_embeds": embeds, "attention_mask": np.ones((1, length), dtype=np.int64)}
                    for meta in s.get_inputs():
                        if meta.name.startswith("past_key_values."):
                            feed[meta.name] = np.zeros((1, meta.shape[1], 0, config.hidden_size
                                                        // config.num_attention_heads), dtype=np.float32)

                def ttft():
                    out = s.run(None, feed)  # logits and every present, as a user's next step needs
                    return int(out[0][0, -1].argmax()), out[0][0, -1]

                first[name], logits[name] = ttft()  # warm-up
                return ttft
            return build

        rows = {name: make(name) for name in graphs}
        log(f"timing: {args.schedule}, {args.repeats} runs each, {cores} intra-op threads")
        meter = CpuMeter()
        times = (_blocks(rows, args.repeats, WARMUP, log) if args.schedule == "blocks"
                 else _rounds(rows, args.repeats, log))
        load = meter.report()

    med = {row: statistics.median(t) for row, t in times.items()}
    base = med[BASE]
    # interleaved: the ratio within each round (same neighbour load for every row), then its median
    paired = {row: statistics.median(t / b for t, b in zip(times[row], times[BASE])) for row in rows}
    print(f"Qwen2-0.5B-shaped decoder (24 layers, 896 wide, 14/2 heads, vocab 151936), seeded, fp32; prefill of "
          f"{args.image} image + {args.text} text tokens ({length}), batch 1; ONNX Runtime CPU (onnxruntime "
          f"{__import__('onnxruntime').__version__}), ORT_ENABLE_ALL, {cores} intra-op threads; onnxruntime-genai "
          f"{genai_version()}; median of {args.repeats}, "
          + ("rows interleaved run by run" if args.schedule == "interleaved" else
             "rows in blocks forwards then backwards"))
    print(f"| exporter | TTFT ms median (min-max) | time vs {BASE}: ratio of medians | median of per-round "
          f"ratios | ratio of minimums | first token | last-token logits max-abs vs {BASE} |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        gap = float(np.abs(logits[row] - logits[BASE]).max())
        print(f"| {row} | {med[row]:.0f} ({min(times[row]):.0f}-{max(times[row]):.0f}) | "
              f"{med[row] / base:.2f}x | {paired[row]:.2f}x | {min(times[row]) / min(times[BASE]):.2f}x | "
              f"{first[row]} | {gap:.2g} |")
    if busy_line(load):
        print(busy_line(load))
    print(f"fused_speedup_over_unfused: {base / med[FUSED]:.3f}")
    print("genai_over_torch_fused_ttft_ratio: " + ", ".join(f"{row}: {med[row] / med[FUSED]:.3f}" for row in rows
                                                           if row.startswith("genai")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
