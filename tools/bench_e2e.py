#!/usr/bin/env python
"""Time to first token and KV-cache bytes per image, dense vs tower pruning vs FastV vs both, side by side in one run.

    python tools/bench_e2e.py [--repeats 3] [--layer 2] [--fastv-layer 2] [--fastv-keep 0.5] [--text 64]
        [--warmup 3] [--profile] [--workdir DIR]

(For a clip instead of an image, the same measurement at 8, 16 and 32 frames: tools/bench_e2e_video.py.)

ONNX Runtime CPU, batch 1, one process, seeded weights of realistic shape: the clip-l-336
tower (LLaVA-1.5's CLIP ViT-L/14-336, 24 blocks, features from block 23) with a projector to
896 wide (1024 -> 896 -> 896), and a Qwen2-0.5B-shaped decoder (24 layers, 896 wide, 14 query
/ 2 key-value heads, MLP 4864, vocabulary 151936, tied head). The prompt is `--text` text
tokens, half before the image and half after it.

TTFT = tower graph (pixels -> image features) + the prompt's embeddings assembled on the host
+ the LLM prefill graph (-> the last token's logits) + argmax. The graphs are the ones
`vlmprune compile` emits: the tower through the ort target's pass pipeline (the cls method
after block --layer, before fusion), the LLM through compiler.llm.torch_exporter (FastV in the graph
for the FastV rows, its image span compiled in).

Each row runs twice, with the LLM prefill graph as exported (standard ops: per layer a causal
mask built as a Where over [1, heads, S, S], MatMul/Softmax/MatMul; `LLM unfused`) and as target
ort ships it (compiler.llm.torch_exporter.fuse_attention: each layer's causal attention one
com.microsoft.GroupQueryAttention over the shared key/value heads, each rotation of q and K one RotaryEmbedding,
each residual Add + RMSNorm one SkipSimplifiedLayerNormalization; `LLM fused`), the same tower; the fused row's
ratio to the unfused
is printed per row. The dense row also runs with onnxruntime-genai's model builder graph
(compiler.llm.genai.export_genai, fp32 CPU, prune_lm_head: the head on the last token as the
torch.onnx graphs do; fed inputs_embeds, attention_mask and an empty past) where
onnxruntime-genai is installed: `--no-genai` leaves it out.

KV-cache bytes per image: the bytes of the image's tokens in every layer's present key and
value, read from the prefill outputs' shapes (lengths per layer minus the text tokens).

FLOP limit: FLOPs counted analytically as the graphs compute them (2 per multiply-add):
patch embedding; per tower block on T tokens 8·T·D² (Q, K, V, O) + 4·T²·D (Q·Kᵀ and A·V)
+ 4·T·D·F (MLP); the cls score row (2·T·D per block L head set, negligible) ; projector;
per LLM layer on T tokens 2·T·D·(2·H·d + 2·Hkv·d) (projections) + 4·T²·H·d (full T×T scores:
the graph masks, it does not skip) + 6·T·D·F (gated MLP); FastV's recomputed row 4·T·H·d;
the head on the last token only, 2·D·V. Elementwise ops, norms and softmax are left out (a
few % of the total). speedup limit = FLOPs(dense) / FLOPs(row); share = measured speedup /
speedup limit (goal: >= 95% for every pruned row).

The head is the one part of every row that FLOPs misprice. It runs on one token, so it is a
matrix-vector product that streams the whole V x D fp32 matrix (519 MiB for Qwen2-0.5B) at the
memory's speed: --profile measured it at ~20 ms and 14 GFLOP/s, where every other MatMul ran at
230-300 GFLOP/s. It is the same in every row, so it is the fixed cost that weighs most where the
image tokens are fewest. The run therefore also times the head alone (a graph of that one
MatMul over the same weights, its own block) and prints a second limit that counts the head at
its measured time, converted to the FLOPs the dense row does in that time at its own rate.

Warm-up: each block runs WARMUP (3) untimed calls after building its sessions. With one, the
first timed call of every block was 100-300 ms slower than the next (arena and page state after
the previous row's sessions were freed), a fixed cost that weighed most on the smallest rows:
tower K=64 measured 89 % of its limit that way, against 99 % for the same row's profiled runs.

--profile adds ONNX Runtime's per-op breakdown of every row (tools/ort_profile.py), from
separate untimed runs.

Why rows run in blocks, forwards then backwards (A B C D E, then E D C B A), instead of
interleaved run by run as tools/bench_tower.py does: one row's sessions hold ~2x its weights
(ONNX Runtime prepacks constant matrices per session), so the five rows' sessions together
(~20 GB) do not fit beside other work on a small machine; one row's (~6 GB) does. The two
passes in opposite order cancel a neighbour's load that rises or falls during the run, and
the run reports how much CPU other processes took meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

import ort_profile
from machine_load import CpuMeter, busy_line, physical_cores
from vlmprune.compiler.contract import FEATURES, PIXELS
from vlmprune.compiler.frontend import export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.frontend.source import no_init_weights, quiet_transformers, seeded_init
from vlmprune.compiler.frontend.tower import Projector
from vlmprune.compiler.llm.torch_exporter import export_prefill, fuse_attention
from vlmprune.compiler.llm.fastv import FastVSpec
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.passes.methods import get_method
from vlmprune.targets.base import PruneConfig
from vlmprune.targets.ort import OrtTarget
from vlmprune.targets.runtime import ort_session

CLS = get_method("cls")
SETTLE_S = 0.2
HEAD_ROW = "LM head alone"
WARMUP = 3  # untimed runs per block: see "Warm-up" in the docstring
HEAD_VOCAB = 151936
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=HEAD_VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)


def qwen2_05b_shaped(seed: int = 0):
    """Qwen2-0.5B's shapes with seeded weights: N(0, 0.02) matrices, unit RMSNorm gains, zero biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with no_init_weights():
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B))
    seeded_init(model, seed=seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(1.0)
    model.tie_weights()
    return model.eval()


def tower_source(width: int):
    """clip-l-336 with its projector resized to the decoder's width (LLaVA-OneVision-0.5B-like)."""
    source = load_source("clip-l-336")
    with no_init_weights():
        projector = Projector(1024, width, width)
    seeded_init(projector, seed=1)
    source.pipeline.projector = projector.eval()
    return source


# ----------------------------------------------------------------------------------------- FLOPs


def tower_flops(n: int, blocks: int, layer: int | None, keep: int | None, d=1024, f=4096, width=896,
                patch=14) -> tuple[float, int]:
    """(FLOPs, tokens out) of the tower + projector; pruning after block `layer` leaves [CLS] + keep + 1 summary."""
    flops = 2.0 * n * 3 * patch * patch * d
    tokens = n + 1
    for block in range(1, blocks + 1):
        flops += 8 * tokens * d * d + 4 * tokens * tokens * d + 4 * tokens * d * f
        if keep is not None and block == layer:
            flops += 4 * tokens * d  # the [CLS] row recomputed
            tokens = 1 + keep + 1
    out = tokens - 1  # [CLS] dropped (LLaVA's default select strategy)
    flops += 2 * out * (d * width + width * width)
    return flops, out


def llm_flops(length: int, fastv: FastVSpec | None, cfg=QWEN2_05B) -> float:
    d, f, h, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // h
    flops, tokens = 0.0, length
    for i in range(cfg["num_hidden_layers"]):
        flops += 2 * tokens * d * (2 * h * hd + 2 * kv * hd) + 4 * tokens * tokens * h * hd + 6 * tokens * d * f
        if fastv is not None and i == fastv.layer - 1:
            flops += 4 * tokens * h * hd
            tokens = length - fastv.image_len + fastv.kept
    return flops + 2 * d * cfg["vocab_size"]


# -------------------------------------------------------------------------------------- graphs


def save_graph(model: ir.Model, folder: Path, name: str) -> Path:
    """model as folder/name.onnx, its weights in folder/name.weights.bin beside it (shared with tools/bench_llm_fusion)."""
    ir.external_data.unload_from_model(model, folder, f"{name}.weights.bin", size_threshold_bytes=1024)
    ir.save(model, folder / f"{name}.onnx")
    return folder / f"{name}.onnx"


def _head_graph(embed: np.ndarray) -> ir.Model:
    """The LM head alone as the prefill graph runs it: [1, 1, D] @ the tied embedding's [D, V]."""
    import onnx
    from onnx import TensorProto, helper

    vocab, width = embed.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, vocab])],
                              [onnx.numpy_helper.from_array(np.ascontiguousarray(embed.T), "w")])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _pruned_tower(dense: Path, folder: Path, keep: int, layer: int, name: str) -> Path:
    config = PruneConfig(CLS, CLS.parse(keep, {}), layer)
    model = OrtTarget().pipeline(config, CompileOptions(keep=keep, layer=layer))(ir.load(dense)).model
    ir.save(model, folder / f"{name}.onnx")  # shares dense's weights file
    return folder / f"{name}.onnx"


UNFUSED, FUSED, GENAI = "LLM unfused", "LLM fused", "LLM onnxruntime-genai builder"


def _fused(unfused: Path, folder: Path, name: str, layers: int) -> Path:
    """The prefill graph at `unfused` with each layer's attention fused (target ort's form), on the same weights."""
    model = fuse_attention(ir.load(unfused), layers)
    ir.save(model, folder / f"{name}.onnx")
    return folder / f"{name}.onnx"


def genai_graph(lm, folder: Path, log) -> Path | None:
    """onnxruntime-genai's builder graph of lm (fp32 CPU, head on the last token), or None where it is absent."""
    from vlmprune.compiler.llm.genai import MODEL, export_genai

    sub = folder / "genai_last"
    if (sub / MODEL).is_file():
        return sub / MODEL
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as exc:
        log(f"onnxruntime-genai's row left out: {exc}")
        return None
    config = lm.config
    if config.eos_token_id is None:
        config.bos_token_id = config.eos_token_id = 151643  # Qwen2-0.5B's <|endoftext|>: the builder needs one
    log("export with onnxruntime-genai's builder (prune_lm_head)")
    export_genai(lm, sub, last_logits_only=True, parity=False, progress=log)
    return sub / MODEL


def genai_ttft_call(features, llm, text_before: np.ndarray, text_after: np.ndarray):
    """ttft_call for the builder's graph: inputs_embeds, attention_mask and an empty past per layer."""
    # The builder names its dims (batch_size, past_sequence_length): the kv heads and head size from the model.
    past = {m.name: np.zeros((1, QWEN2_05B["num_key_value_heads"], 0,
                              QWEN2_05B["hidden_size"] // QWEN2_05B["num_attention_heads"]), dtype=np.float32)
            for m in llm.get_inputs() if m.name.startswith("past_key_values.")}

    def ttft():
        embeds = np.concatenate([text_before, features(), text_after], axis=1).astype(np.float32)
        feed = {"inputs_embeds": embeds, "attention_mask": np.ones(embeds.shape[:2], dtype=np.int64), **past}
        outs = llm.run(None, feed)
        return int(outs[0][0, -1].argmax()), outs

    return ttft


def ttft_call(features, llm, text_before: np.ndarray, text_after: np.ndarray):
    """One TTFT as this benchmark times it: the tower (features(): pixels -> image features [1, T, D]), the prompt's
    embeddings assembled on the host around them, the LLM prefill graph (-> the last token's logits) and argmax.
    Returns the call; it returns (first token, the prefill's outputs). Shared with tools/eval_quality.py."""

    def ttft():
        embeds = np.concatenate([text_before, features(), text_after], axis=1).astype(np.float32)
        # Positions 0..S-1: a tower-pruned image's original positions (handoff) cost the same.
        positions = np.arange(embeds.shape[1], dtype=np.int64)[None]
        outs = llm.run(None, {"inputs_embeds": embeds, "position_ids": positions})
        return int(outs[0][0, -1].argmax()), outs

    return ttft


def kv_image_bytes(llm, outs, text_tokens: int) -> int:
    """KV-cache bytes per image: the bytes of the image's tokens in every layer's present key and value, read from
    the prefill outputs' shapes (lengths per layer minus the text tokens)."""
    names = [o.name for o in llm.get_outputs()]
    return sum(int(np.prod(o.shape)) // o.shape[2] * (o.shape[2] - text_tokens) * o.dtype.itemsize
               for name, o in zip(names, outs) if name.startswith("present."))


def _blocks(rows: dict, repeats: int, warmup: int, log) -> dict[str, list[float]]:
    """ms per run of every row: forwards then backwards, each block with the row's own sessions, warmed up."""
    names = list(rows)
    times: dict[str, list[float]] = {name: [] for name in names}
    half = max(1, repeats // 2)
    for order, count in ((names, repeats - half), (names[::-1], half)):
        for name in order:
            run = rows[name]()  # sessions built; the first run is the first warm-up
            for _ in range(warmup - 1):
                run()
            for _ in range(count):
                time.sleep(SETTLE_S)
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
            log(f"  {name}: {', '.join(f'{t:.0f}' for t in times[name])} ms")
            del run
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer", type=int, default=2, help="tower pruning after this block (cls method)")
    parser.add_argument("--keeps", default="192,64", help="tower K values")
    parser.add_argument("--fastv-layer", type=int, default=2)
    parser.add_argument("--fastv-keep", type=float, default=0.5)
    parser.add_argument("--text", type=int, default=64, help="text tokens in the prompt (half before the image)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs per block before its timed ones")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed runs, profile every row with ONNX Runtime's profiler (where the time goes)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the graphs here and reuse those already there (default: a temp dir)")
    parser.add_argument("--no-genai", action="store_true", help="leave out the onnxruntime-genai builder's dense row")
    args = parser.parse_args()
    keeps = [int(k) for k in args.keeps.split(",")]

    quiet_transformers()
    cores = physical_cores()
    torch.set_num_threads(cores)
    os.environ.setdefault("VLMPRUNE_ORT_THREADS", str(cores))
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:6.0f}s] {m}", file=sys.stderr, flush=True)
    before, after = args.text // 2, args.text - args.text // 2

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        folder = args.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        lm = qwen2_05b_shaped()
        width = lm.config.hidden_size
        source = tower_source(width)
        n = source.num_patches
        blocks = source.num_blocks
        reuse = lambda name, make: folder / f"{name}.onnx" if (folder / f"{name}.onnx").is_file() else make()
        log("export tower (dense)")
        dense_tower = reuse("tower", lambda: save_graph(export_onnx(source.pipeline, source.image_size, 1, 18), folder,
                                                   "tower"))
        towers = {"dense": dense_tower}
        for k in keeps:
            log(f"tower pipeline K={k}")
            towers[f"K={k}"] = reuse(f"tower_k{k}", lambda k=k: _pruned_tower(dense_tower, folder, k, args.layer,
                                                                              f"tower_k{k}"))
        embed = lm.get_input_embeddings().weight.detach().numpy()
        rng = np.random.default_rng(0)
        ids = rng.integers(0, embed.shape[0], size=args.text)
        text_before, text_after = embed[ids[:before]][None], embed[ids[before:]][None]

        log("export LLM prefill (dense)")
        llms = {"dense": reuse("llm_dense", lambda: save_graph(export_prefill(lm, None), folder, "llm_dense"))}
        image_tokens = {"dense": n, **{f"K={k}": tower_flops(n, blocks, args.layer, k)[1] for k in keeps}}
        fastv_specs = {}
        for tower_name in ("dense", f"K={keeps[0]}"):
            spec = FastVSpec(before, image_tokens[tower_name], args.fastv_layer, args.fastv_keep)
            log(f"export LLM prefill (FastV over {spec.image_len} image tokens)")
            name = f"llm_fastv_{spec.image_len}"
            llms[f"fastv {tower_name}"] = reuse(name, lambda: save_graph(export_prefill(lm, spec), folder, name))
            fastv_specs[tower_name] = spec
        layers = lm.config.num_hidden_layers
        for name in list(llms):  # the fused form of each, on the same weights file
            log(f"fuse the LLM's attention ({name})")
            stem = llms[name].stem
            llms[f"{name} fused"] = reuse(f"{stem}_fused", lambda p=llms[name], stem=stem: _fused(p, folder,
                                                                                                  f"{stem}_fused",
                                                                                                  layers))
        genai = None if args.no_genai else genai_graph(lm, folder, log)
        head_path = reuse("head", lambda: save_graph(_head_graph(embed), folder, "head"))
        lm = embed = None  # the torch weights (2 GB) are not needed for timing

        plain = {"dense": ("dense", "dense", None),
                 **{f"tower K={k}": (f"K={k}", "dense", None) for k in keeps},
                 f"FastV L{args.fastv_layer} R{args.fastv_keep:g}": ("dense", "fastv dense", fastv_specs["dense"]),
                 f"tower K={keeps[0]} + FastV": (f"K={keeps[0]}", f"fastv K={keeps[0]}",
                                                 fastv_specs[f"K={keeps[0]}"])}
        rows = {}
        for row, (tower_name, llm_name, spec) in plain.items():
            rows[f"{row}, {UNFUSED}"] = (tower_name, llm_name, spec)
            rows[f"{row}, {FUSED}"] = (tower_name, f"{llm_name} fused", spec)
            if row == "dense" and genai is not None:
                llms[GENAI] = genai
                rows[f"dense, {GENAI}"] = ("dense", GENAI, None)
        pixel, _ = parity_inputs(1, source.image_size, source.mean, source.std)
        pixel = np.ascontiguousarray(pixel)

        def row_runner(tower_name, llm_name):
            """Build the row's two sessions, run it once (warm-up), return its timed call and what it produced."""
            tower, llm = ort_session(towers[tower_name]), ort_session(llms[llm_name])
            features = lambda: tower.run([FEATURES], {PIXELS: pixel})[0]  # noqa: E731
            ttft = (genai_ttft_call(features, llm, text_before, text_after) if llm_name == GENAI
                    else ttft_call(features, llm, text_before, text_after))
            token, outs = ttft()
            return ttft, token, kv_image_bytes(llm, outs, args.text)

        kv, flops, first = {}, {}, {}

        def make(row, tower_name, llm_name, spec):
            def build():
                run, token, kv[row] = row_runner(tower_name, llm_name)
                first[row] = token
                return run
            keep = None if tower_name == "dense" else int(tower_name.split("=")[1])
            flops[row] = tower_flops(n, blocks, args.layer, keep)[0] + llm_flops(
                before + image_tokens[tower_name] + after, spec)
            return build

        builders = {row: make(row, *how) for row, how in rows.items()}
        x_head = np.random.default_rng(1).standard_normal((1, 1, width)).astype(np.float32)

        def head_block():
            session = ort_session(head_path)
            run = lambda: session.run(None, {"x": x_head})  # noqa: E731
            run()
            return run

        builders[HEAD_ROW] = head_block
        log(f"timing: rows in blocks, forwards then backwards, {args.repeats} runs each")
        meter = CpuMeter()
        times = _blocks(builders, args.repeats, args.warmup, log)
        load = meter.report()
        profiles = {}
        if args.profile:
            log("profiling every row (not timed)")
            for row, (tower_name, llm_name, _spec) in rows.items():
                if llm_name == GENAI:
                    continue
                tower = ort_profile.profile(lambda o: ort_session(towers[tower_name], options=o), {PIXELS: pixel})
                features = tower["outputs"][FEATURES]
                embeds = np.concatenate([text_before, features, text_after], axis=1).astype(np.float32)
                positions = np.arange(embeds.shape[1], dtype=np.int64)[None]
                llm = ort_profile.profile(lambda o: ort_session(llms[llm_name], options=o),
                                          {"inputs_embeds": embeds, "position_ids": positions})
                profiles[f"{row}: tower"], profiles[f"{row}: LLM"] = tower, llm
                profiles[row] = ort_profile.merge(tower, llm)
                profiles[row]["host_ms"] = statistics.median(times[row]) - profiles[row]["run_ms"]

    med = {row: statistics.median(t) for row, t in times.items()}
    head_ms = med.pop(HEAD_ROW)
    times.pop(HEAD_ROW)
    base_row = f"dense, {UNFUSED}"
    base_ms, base_flops, base_kv = med[base_row], flops[base_row], kv[base_row]
    # The head streams V x D fp32 weights for one token: its time is the memory's, not its 2·D·V FLOPs'.
    # Counted as the FLOPs the dense row would do in that time (its own rate), for every row alike.
    head_flops = 2.0 * width * HEAD_VOCAB
    head_equiv = head_ms / 1e3 * (base_flops - head_flops) / ((base_ms - head_ms) / 1e3) - head_flops
    print(f"clip-l-336 tower (projector to {width}) + Qwen2-0.5B-shaped decoder, seeded; batch 1, {args.text} text "
          f"tokens; tower pruning: cls after block {args.layer}; FastV after LLM layer {args.fastv_layer}, "
          f"R = {args.fastv_keep:g}; ONNX Runtime CPU, {os.environ['VLMPRUNE_ORT_THREADS']} intra-op threads; "
          f"median of {args.repeats}, rows in blocks forwards then backwards")
    print("| configuration | image tokens (LLM in / after FastV) | TTFT ms (min-max) | speedup | GFLOP | FLOP "
          "speedup limit | share of limit | limit, head at its memory time | share of that limit | KV bytes per image "
          "| KV vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row, (tower_name, _llm, spec) in rows.items():
        tokens = f"{image_tokens[tower_name]}" + (f" / {spec.kept}" if spec is not None else "")
        speed, limit = base_ms / med[row], base_flops / flops[row]
        work = (base_flops + head_equiv) / (flops[row] + head_equiv)
        spread = f"{min(times[row]):.0f}-{max(times[row]):.0f}"
        print(f"| {row} | {tokens} | {med[row]:.0f} ({spread}) | {speed:.2f}x | {flops[row] / 1e9:.0f} | "
              f"{limit:.2f}x | {speed / limit:.0%} | {work:.2f}x | {speed / work:.0%} | {kv[row] / 2**20:.2f} MiB | "
              f"{kv[row] / base_kv:.2f} |")
    print(f"LM head alone (one token, {HEAD_VOCAB} x {width} fp32 weights, {4 * HEAD_VOCAB * width / 2**20:.0f} MiB "
          f"streamed): {head_ms:.1f} ms = {4 * HEAD_VOCAB * width / head_ms / 1e6:.1f} GB/s; at the dense row's FLOP "
          f"rate that time is {(head_equiv + head_flops) / 1e9:.1f} GFLOP, not its {head_flops / 1e9:.2f}")
    if busy_line(load):
        print(busy_line(load))
    print("fused vs unfused LLM, per row (TTFT of the unfused row / the fused row's): " + ", ".join(
        f"{row}: {med[f'{row}, {UNFUSED}'] / med[f'{row}, {FUSED}']:.2f}x" for row in plain))
    if f"dense, {GENAI}" in med:
        print(f"dense, fused LLM vs onnxruntime-genai's builder (TTFT of the builder's row / the fused row's): "
              f"{med[f'dense, {GENAI}'] / med[f'dense, {FUSED}']:.2f}x")
    shares = {row: (base_ms / med[row]) / (base_flops / flops[row]) for row in rows if row != base_row}
    work_shares = {row: (base_ms / med[row]) / ((base_flops + head_equiv) / (flops[row] + head_equiv))
                   for row in rows if row != base_row}
    if profiles:
        print("\nONNX Runtime profile (separate, untimed runs; counted ops are those the FLOP model counts):")
        print("\n".join(ort_profile.table(profiles)))
        print("outside the graphs, ms (TTFT median minus both graphs' profiled run time: the host's embeddings "
              "and argmax, and the timed runs' spread against the profiled ones): " + ", ".join(
            f"{row}: {p['host_ms']:.0f}" for row, p in profiles.items() if "host_ms" in p))
    print("first tokens: " + ", ".join(f"{row}: {t}" for row, t in first.items()))
    print("min_share_of_flop_limit: " + f"{min(shares.values()):.2f}" + f" ({min(shares, key=shares.get)})")
    print("min_share_of_limit_head_at_memory_time: " + f"{min(work_shares.values()):.2f}"
          + f" ({min(work_shares, key=work_shares.get)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
