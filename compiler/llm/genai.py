"""The dense language model through onnxruntime-genai's model builder: the graph its users build and run.

Why a second exporter: compiler.llm.torch_exporter spells the decoder out in standard ops so that it
runs on any ONNX runtime and can hold FastV; users of onnxruntime-genai instead run what its
model builder (`python -m onnxruntime_genai.models.builder`) makes of the same checkpoint:
fused com.microsoft ops (GroupQueryAttention with the rotary embedding inside,
SkipSimplifiedLayerNormalization, packed QKV). This module runs that builder on the bundle's
language model, so the bundle can ship the graph those users load, checked against the same
Hugging Face reference.

What the builder's graph lacks, against compiler.llm.torch_exporter's:

- No position_ids input. GroupQueryAttention derives every token's position from the attention
  mask (the sequence's length so far), so positions are contiguous 0..T-1 over the prompt as
  fed: a tower-pruned image's kept tokens are renumbered (they do not keep their patches'
  original positions, compiler.llm.handoff), and the text after the image continues from the
  pruned count.
- No FastV: the layers' caches all have the prompt's length (one graph, one
  `past_sequence_length`), so dropping tokens after layer K cannot be compiled in. The export
  is the DENSE decoder only.
- One graph for prefill and decode (empty past for the prompt), in ONNX Runtime's ops: besides
  the com.microsoft contrib ops, SimplifiedLayerNormalization (layer 0's input norm) sits in the
  default ONNX domain, where ONNX defines no such op, so onnx.checker refuses the model
  (manifest `onnx_checker`: its error, and the rest of the graph checked with that op moved to
  com.microsoft). It runs in ONNX Runtime (CPU here), not on every ONNX runtime.
- Its own tokenizer files and genai_config.json: the builder loads a tokenizer from the
  checkpoint and refuses to run without one (a Llama without tokenizer files fails; for a Qwen2
  transformers invents an empty one). language_model() hands over the model without its
  tokenizer: pass the checkpoint's directory (`tokenizer=`) where it holds one; when none is
  given, a placeholder (one token per id, `<id_N>`) is handed to the
  builder only so that it runs, and the tokenizer files it copies into the output are deleted,
  so nothing in the folder passes for the model's tokenizer (manifest `tokenizer: null`).

The files: model.onnx (+ model.onnx.data), genai_config.json.
    in:  inputs_embeds [batch, sequence, hidden], attention_mask [batch, total_sequence] (int64,
         ones: no padding), past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim]
         (past 0 for the prompt)
    out: logits [batch, sequence, vocab] (every token's; [batch, 1, vocab] with
         last_logits_only, the builder's prune_lm_head), present.{i}.key / .value

The onnxruntime-genai runtime itself (og.Generator) does not take inputs_embeds from the user
for a decoder-only model in 0.18: creating the generator asks for `input_ids`
(microsoft/onnxruntime-genai issues #1163, #1325, #1644). genai_parity records that attempt;
the parity proper runs model.onnx in plain ONNX Runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from vlmprune.compiler.contract import LLM_MODEL, Manifest
from vlmprune.compiler.errors import InputError, ParityError, ToolchainError, failure_cause
from vlmprune.compiler.llm import lm_source
from vlmprune.compiler.llm.exporter import LLM_DIR, LlmExporter, tokens_note
from vlmprune.compiler.llm.lm_source import check_family, decoder_of
from vlmprune.compiler.parity import figure_text

EXPORTER = "onnxruntime-genai"
MODEL, CONFIG = LLM_MODEL, "genai_config.json"
FAMILIES = ("llama", "qwen2", "qwen3")  # checked here with the builder's LlamaModel / QwenModel / Qwen3Model (1-D RoPE)
PRECISIONS = ("fp32",)  # what the parity check below holds to PARITY_ATOL on the CPU
PARITY_ATOL = 1e-4  # fp32 logits, as compiler.llm.torch_exporter's: the bound's absolute floor
# The contract's fp32 bound is that floor plus a term relative to the output's scale (1e-5 · max|want|): the builder's
# graph runs ONNX Runtime's own GroupQueryAttention and norm kernels, whose fp32 rounding grows with the logits.
PARITY_RTOL_SCALE = 1e-5
GQA_HEAD_MULTIPLE = 16  # ONNX Runtime 1.32's CPU GroupQueryAttention refuses other head sizes when it runs
DECODE_STEPS = 3
PROMPT_TOKENS = 12
LOG = "genai_builder.log"  # in the temporary directory, kept (and named) only on failure


def logits_bound(scale: float) -> float:
    """The contract's fp32 bound on the logits' max-abs, for reference logits whose largest magnitude is scale."""
    return PARITY_ATOL + PARITY_RTOL_SCALE * scale
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json")


def genai_version() -> str:
    """The installed onnxruntime-genai's version; one line where it is not installed."""
    try:
        import onnxruntime_genai
    except ImportError as exc:
        raise ToolchainError("the onnxruntime-genai exporter needs the onnxruntime-genai package: "
                             "pip install onnxruntime-genai==0.18.0") from exc
    return onnxruntime_genai.__version__


def check_genai_options(lm, precision: str = "fp32", execution_provider: str = "cpu", tokenizer=None) -> None:
    """One line, before any work, for what export_genai cannot serve."""
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise InputError(f"language model type {model_type!r} is not supported by the onnxruntime-genai exporter "
                         f"(supported: {', '.join(FAMILIES)})")
    check_family(config)
    if tokenizer is None and _eos(config) is None:
        raise InputError("--llm-exporter genai: onnxruntime-genai's builder needs an end-of-sequence token id; the "
                         "language model's config has none (eos_token_id) and no tokenizer was given")
    if head_dim_of(config) % GQA_HEAD_MULTIPLE:
        raise InputError(f"--llm-exporter genai: head size {head_dim_of(config)} is not a multiple of "
                         f"{GQA_HEAD_MULTIPLE}, which ONNX Runtime's GroupQueryAttention (the builder's attention) "
                         f"needs on the CPU; use --llm-exporter torch")
    if precision not in PRECISIONS:
        raise InputError(f"--llm-exporter genai: precision {precision!r} is not supported "
                         f"(supported: {', '.join(PRECISIONS)}; the parity check runs fp32 on the CPU)")
    if execution_provider != "cpu":
        raise InputError(f"--llm-exporter genai: execution provider {execution_provider!r} is not supported "
                         f"(supported: cpu)")


def export_genai(lm, folder: Path, precision: str = "fp32", execution_provider: str = "cpu",
                 tokenizer=None, last_logits_only: bool = False, parity: bool = True,
                 progress=lambda _m: None) -> dict:
    """Build lm (a Llama/Qwen2 causal LM) with onnxruntime-genai's builder into folder; manifest fields.

    tokenizer: the model's tokenizer (a transformers tokenizer, or a directory holding its
    files), copied by the builder into folder; None: a placeholder for the builder only (see
    the module docstring), no tokenizer in folder. last_logits_only: the builder's
    prune_lm_head (logits of the last token only, as compiler.llm.torch_exporter's prefill gives).
    parity: run genai_parity and raise ParityError when it fails.
    """
    check_genai_options(lm, precision, execution_provider, tokenizer)
    version = genai_version()
    _inner, config = decoder_of(lm)
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise InputError(f"--llm-exporter genai: output folder {folder} is not empty")
    progress(f"export LLM ({config.model_type}, {config.num_hidden_layers} layers, dense) with "
             f"onnxruntime-genai {version}'s model builder ({precision}, {execution_provider})")
    with tempfile.TemporaryDirectory(prefix="vlmprune-genai-") as tmp:
        tmp = Path(tmp)
        checkpoint = tmp / "hf"
        _save_checkpoint(lm, checkpoint, tokenizer)
        options = ["exclude_embeds=true", *(["prune_lm_head=true"] if last_logits_only else [])]
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                   "-o", str(folder.resolve()), "-p", precision, "-e", execution_provider,
                   "-c", str(tmp / "cache"), "--extra_options", *options]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
        with open(tmp / LOG, "w") as log:
            code = subprocess.run(command, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0 or not (folder / MODEL).is_file():
            kept = Path(tempfile.mkdtemp(prefix="vlmprune-genai-log-")) / LOG
            kept.write_bytes((tmp / LOG).read_bytes())
            raise ToolchainError(f"onnxruntime-genai's model builder failed (exit {code}): "
                                 f"{failure_cause(kept.read_text(errors='replace'))}; log: {kept}")
    if tokenizer is None:
        for name in _TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    eos = read_genai_config(folder)["model"].get("eos_token_id")
    if any(not 0 <= i < config.vocab_size for i in (eos if isinstance(eos, list) else [eos]) if i is not None):
        raise ToolchainError(f"onnxruntime-genai's builder wrote eos_token_id {eos} to {folder / CONFIG}, outside the "
                             f"vocabulary ({config.vocab_size}): pass the model's tokenizer")
    info = {
        "exporter": f"{EXPORTER} {version} (onnxruntime_genai.models.builder, {precision}, {execution_provider}, "
                    f"exclude_embeds{', prune_lm_head' if last_logits_only else ''})",
        "runtime": "ONNX Runtime with its com.microsoft contrib ops (GroupQueryAttention); "
                   "onnxruntime-genai's generator does not take inputs_embeds (0.18)",
        "family": config.model_type, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
        "files": sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()),
        "model": MODEL,
        "genai_config": (folder / CONFIG).is_file(),
        "tokenizer": "the model's (copied by the builder)" if tokenizer is not None else None,
        "eos_token_id": eos,
        "io": graph_io(folder / MODEL),
        "ops": sorted(_op_types(folder / MODEL)),
        "onnx_checker": checker_report(folder / MODEL),
        "positions": "contiguous: 0..T-1 from the attention mask (no position_ids input); pruned image tokens "
                     "are renumbered, and FastV cannot be compiled in",
        "fastv": None,
        "last_logits_only": last_logits_only,
    }
    if parity:
        info["parity"] = genai_parity(lm, folder)
        p = info["parity"]
        gap = figure_text(p["logits_max_abs"], 3, at_most=p["tolerance"])  # a failing figure must read as failing
        progress(f"  llm (genai) {'PASS' if p['passed'] else 'FAIL'}  logits max-abs {gap}, "
                 f"greedy tokens {'identical' if p['tokens_identical'] else 'DIFFER'} (batch 1 and 2)")
        if not p["passed"]:
            per_batch = ", ".join(f"{b}: {r['logits_max_abs']:.3g}" for b, r in p["per_batch"].items())
            raise ParityError(f"onnxruntime-genai's graph of the language model disagrees with its PyTorch "
                              f"reference (logits max-abs {gap}, tolerance {p['tolerance']:.3g} at max |logit| "
                              f"{p['logits_scale']:.3g}, per batch "
                              f"{per_batch}, "
                              f"greedy tokens {'identical' if p['tokens_identical'] else 'differ'})")
    return info


def _save_checkpoint(lm, directory: Path, tokenizer) -> None:
    """lm as a Hugging Face directory (safetensors, config.json) with a tokenizer the builder can load."""
    import contextlib
    import io

    from transformers import PreTrainedTokenizerBase

    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
        lm.save_pretrained(directory)
    if tokenizer is None:
        tokenizer = placeholder_tokenizer(lm.config.vocab_size, _eos(lm.config))
    elif not isinstance(tokenizer, PreTrainedTokenizerBase):
        from transformers import AutoTokenizer

        path = Path(tokenizer)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise InputError(f"--llm-exporter genai: no tokenizer loads from {path}: "
                             f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from exc
    tokenizer.save_pretrained(directory)


def _eos(config):
    eos = getattr(config, "eos_token_id", None)
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos if isinstance(eos, int) else None


def placeholder_tokenizer(vocab_size: int, eos: int | None = None):
    """A tokenizer of one token per id (`<id_N>`): only for the builder, which will not run without one.

    Its one special token is the model's own end-of-sequence id (eos), so that the builder's
    genai_config.json names the model's, not one the tokenizer class would add past the vocabulary.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({f"<id_{i}>": i for i in range(vocab_size)}, unk_token="<id_0>"))
    backend.pre_tokenizer = WhitespaceSplit()
    special = {"eos_token": f"<id_{eos}>", "pad_token": f"<id_{eos}>"} if eos is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<id_0>", **special)


def graph_io(path: Path) -> dict:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)

    def one(v):
        dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        return {"name": v.name, "shape": dims,
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name}
    return {"inputs": [one(v) for v in proto.graph.input], "outputs": [one(v) for v in proto.graph.output]}


def _op_types(path: Path) -> set[str]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in proto.graph.node}


def checker_report(path: Path) -> dict:
    """onnx.checker on model.onnx; where it fails on ops the builder puts in the default domain that ONNX does not
    define (SimplifiedLayerNormalization: an ONNX Runtime op), the rest of the graph checked with those moved to
    com.microsoft (a copy beside the model, deleted), so the manifest says exactly what is not standard."""
    import onnx
    import onnx.defs

    path = Path(path)
    try:
        onnx.checker.check_model(str(path))
        return {"passed": True, "error": None, "non_onnx_default_domain_ops": []}
    except onnx.checker.ValidationError as exc:
        error = (str(exc).splitlines() or [type(exc).__name__])[0]
    proto = onnx.load(str(path), load_external_data=False)
    foreign = sorted({n.op_type for n in proto.graph.node
                      if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)})
    report = {"passed": False, "error": error, "non_onnx_default_domain_ops": foreign}
    if foreign:
        for node in proto.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in foreign:
                node.domain = "com.microsoft"
        copy = path.with_name(f".checker-{path.name}")
        try:
            onnx.save(proto, str(copy))
            onnx.checker.check_model(str(copy))
            report["rest_passed"] = True
        except onnx.checker.ValidationError as exc:
            report["rest_passed"], report["rest_error"] = False, (str(exc).splitlines() or ["?"])[0]
        finally:
            copy.unlink(missing_ok=True)
    return report


def genai_session(folder: Path, threads: int | None = None):
    """model.onnx in plain ONNX Runtime CPU, all graph optimisations on."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = int(os.environ.get("VLMPRUNE_ORT_THREADS", "0")) if threads is None else threads
    return ort.InferenceSession(str(Path(folder) / MODEL), options, providers=["CPUExecutionProvider"])


def empty_past(session, batch: int, head_dim: int) -> dict[str, np.ndarray]:
    """Every past_key_values input at length 0 (the prompt's step); kv heads from the graph (head_dim is symbolic)."""
    feed = {}
    for meta in session.get_inputs():
        if meta.name.startswith("past_key_values."):
            heads = meta.shape[1]
            feed[meta.name] = np.zeros((batch, heads, 0, head_dim), dtype=np.float32)
    return feed


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def run_genai(session, embeds: np.ndarray, past: dict | None = None, head_dim: int | None = None,
              ) -> dict[str, np.ndarray]:
    """One step: embeds [B, T, D] after past (None: the prompt, head_dim needed); all-ones attention mask."""
    b, t, _ = embeds.shape
    past = empty_past(session, b, head_dim) if past is None else past
    length = next(iter(past.values())).shape[2] + t
    feed = {"inputs_embeds": embeds.astype(np.float32), "attention_mask": np.ones((b, length), dtype=np.int64),
            **past}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed)))


def presents_to_past(outs: dict) -> dict:
    return {f"past_key_values.{k.split('.', 1)[1]}": v for k, v in outs.items() if k.startswith("present.")}


@torch.no_grad()
def genai_parity(lm, folder: Path, batches=(1, 2), steps: int = DECODE_STEPS, length: int = PROMPT_TOKENS,
                 seed: int = 0) -> dict:
    """model.onnx in plain ONNX Runtime vs the Hugging Face model at contiguous positions, per batch size.

    First-token logits (the last prompt token's) max-abs against lm(inputs_embeds=...,
    attention_mask=ones), then steps greedy tokens through the KV cache against lm's own greedy
    decoding (the cache of lm's forward, positions continuing at T). Also tries the
    onnxruntime-genai generator itself on the first batch (`genai_runtime`): where it runs, its
    greedy tokens count towards `passed`; where it refuses, the refusal is recorded.
    """
    _inner, config = decoder_of(lm)
    session = genai_session(folder)
    table = lm.get_input_embeddings().weight.detach().float().numpy()
    per_batch, worst, scale, same, runtime = {}, 0.0, 0.0, True, None
    for batch in batches:
        embeds = torch.randn(batch, length, config.hidden_size, generator=torch.Generator().manual_seed(seed + batch))
        mask = torch.ones(batch, length, dtype=torch.long)
        ref = lm(inputs_embeds=embeds, attention_mask=mask, use_cache=True)
        expected = [ref.logits[:, -1].argmax(-1)]
        cache = ref.cache
        for _ in range(steps - 1):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            step = lm(inputs_embeds=lm.get_input_embeddings()(expected[-1])[:, None], attention_mask=mask,
                      cache=cache, use_cache=True)
            cache = step.cache
            expected.append(step.logits[:, -1].argmax(-1))
        expected = torch.stack(expected, dim=1).numpy()
        outs = run_genai(session, embeds.numpy(), head_dim=head_dim_of(config))
        want = ref.logits[:, -1].float().numpy()
        gap, scale = float(np.abs(outs["logits"][:, -1] - want).max()), max(scale, float(np.abs(want).max()))
        tokens = [outs["logits"][:, -1].argmax(-1)]
        for _ in range(steps - 1):
            outs = run_genai(session, table[tokens[-1]][:, None], presents_to_past(outs))
            tokens.append(outs["logits"][:, -1].argmax(-1))
        tokens = np.stack(tokens, axis=1)
        ok = bool(np.array_equal(tokens, expected))
        per_batch[str(batch)] = {"logits_max_abs": gap, "tokens": tokens.tolist(), "tokens_identical": ok}
        worst, same = max(worst, gap), same and ok
        if runtime is None:
            runtime = genai_runtime_check(folder, embeds.numpy(), expected)
    bound = logits_bound(scale)
    return {"runtime": "onnxruntime (plain InferenceSession, CPU, ORT_ENABLE_ALL)", "batches": list(batches),
            "prompt_tokens": length, "seed": seed, "positions": "contiguous 0..T-1",
            "logits_max_abs": worst, "logits_scale": scale, "tolerance": bound, "decode_steps": steps,
            "tokens_identical": same, "per_batch": per_batch, "genai_runtime": runtime,
            "passed": worst <= bound and same and (not runtime["works"] or runtime["tokens_identical"])}


def genai_runtime_check(folder: Path, embeds: np.ndarray, expected: np.ndarray) -> dict:
    """onnxruntime-genai's own generator on user-given inputs_embeds (set_model_input), greedy, vs expected tokens."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return {"works": False, "reason": "onnxruntime_genai is not importable"}
    batch, length, _ = embeds.shape
    steps = expected.shape[1]
    api = "og.Model / og.GeneratorParams / og.Generator + set_model_input('inputs_embeds')"
    try:
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length + steps, min_length=length + steps, do_sample=False,
                                  batch_size=batch)
        generator = og.Generator(model, params)
        generator.set_model_input("inputs_embeds", np.ascontiguousarray(embeds, dtype=np.float32))
        tokens = []
        for _ in range(steps):
            generator.generate_next_token()
            tokens.append(np.array(generator.get_next_tokens()).reshape(batch))
    except Exception as exc:  # the runtime's own refusal is the finding
        return {"works": False, "api": api, "reason": (str(exc).splitlines() or [type(exc).__name__])[0],
                "upstream": "microsoft/onnxruntime-genai issues #1163, #1325, #1644 "
                            "(a decoder-only model's inputs_embeds is not a user input)"}
    tokens = np.stack(tokens, axis=1)
    return {"works": True, "api": api, "tokens": tokens.tolist(),
            "tokens_identical": bool(np.array_equal(tokens, expected))}


def read_genai_config(folder: Path) -> dict:
    return json.loads((Path(folder) / CONFIG).read_text())


def readme_section(manifest: Manifest) -> str:
    """The bundle README's language-model section for a genai export."""
    llm = manifest.llm_graphs
    files, parity = llm["files"], llm["parity"]
    runtime = parity.get("genai_runtime") or {}
    generator = ("onnxruntime-genai's generator ran it on the same embeddings, greedy tokens "
                 + ("identical" if runtime.get("tokens_identical") else "DIFFERENT")
                 if runtime.get("works") else
                 f"onnxruntime-genai's own generator does not take `inputs_embeds` here ({runtime.get('reason')}), "
                 "so feed the graph through ONNX Runtime as below")
    tokenizer = ("the model's tokenizer files beside it" if llm.get("tokenizer")
                 else "no tokenizer (the checkpoint has none): add the model's tokenizer files before using "
                      "onnxruntime-genai's tokenizer")
    return f"""
## The language model (`--with-llm --llm-exporter genai`)

`{files['model']}` ({llm['family']}, {llm['layers']} layers, dense) and `{files['config']}` were written by
{llm['exporter']}, with {tokenizer}. Its ops are ONNX Runtime's fused ones (GroupQueryAttention with the
rotary embedding inside): it runs in ONNX Runtime, and {generator}.

Positions are **contiguous**: the graph has no `position_ids` input (GroupQueryAttention counts positions
from `attention_mask`), so a pruned image's rows are renumbered 0..K-1 from the image's place and the text
continues right after them; the original positions and FastV need the default exporter (`--llm-exporter
torch`).

- inputs: `inputs_embeds` [batch, sequence, {llm['hidden_size']}] (text embeddings with `image_features` in the
  image's place), `attention_mask` [batch, past + sequence] (int64 ones), `past_key_values.{{i}}.key` / `.value`
  [batch, {llm['kv_heads']}, past, head_dim] (past 0 for the prompt)
- outputs: `logits` [batch, 1, {llm['vocab_size']}] (the last token's) and `present.{{i}}.key` / `.value`

Checked at compile time against the Hugging Face model (plain ONNX Runtime, batch
{' and '.join(map(str, parity['batches']))}, seed {parity['seed']}): logits max-abs {parity['logits_max_abs']:.2g},
greedy tokens over {parity['decode_steps']} steps {'identical' if parity['tokens_identical'] else 'DIFFERENT'}.
"""


def _tokenizer_dir(model_spec: str) -> Path | None:
    """The checkpoint directory when it holds tokenizer files (the genai builder copies them), else None."""
    from vlmprune.compiler.llm.lm_source import has_tokenizer

    path = Path(model_spec)
    return path if model_spec != "demo" and path.is_dir() and has_tokenizer(path) else None


class GenaiExporter(LlmExporter):
    """onnxruntime-genai's model builder: the dense LLM as its users run it (contiguous positions, no FastV)."""

    id = "genai"
    name = EXPORTER
    summary = "onnxruntime-genai's model builder"
    features = "dense, contiguous positions"
    fastv_refusal = ("--fastv-layer: FastV cannot be compiled into onnxruntime-genai's graph (one cache length "
                     "for every layer); use --llm-exporter torch for FastV")
    families = FAMILIES
    runtime = "onnxruntime (onnxruntime-genai's graph)"
    atol = PARITY_ATOL

    def available(self) -> tuple[bool, str]:
        try:
            return True, f"{EXPORTER} {genai_version()}"
        except ToolchainError as exc:
            return False, str(exc)

    def export(self, model_spec: str, manifest: Manifest, options, folder: Path, progress, fastv) -> dict:
        """The dense LLM through the builder (last-token logits: prune_lm_head, as the torch prefill graph)."""
        lm = lm_source.language_model(model_spec)
        lm_source.check_width(manifest, lm.config)
        info = export_genai(lm, folder / LLM_DIR, tokenizer=_tokenizer_dir(model_spec), last_logits_only=True,
                            progress=progress)
        info["files"] = {"model": f"{LLM_DIR}/{MODEL}", "config": f"{LLM_DIR}/{CONFIG}",
                         "all": [f"{LLM_DIR}/{name}" for name in info["files"]]}
        return info

    def parity(self, model_spec: str, bundle_dir: Path, manifest: Manifest) -> tuple[bool, dict]:
        """The graph's parity again (plain ONNX Runtime vs Hugging Face at contiguous positions, batch 1 and 2)."""
        got = genai_parity(lm_source.language_model(model_spec), bundle_dir / LLM_DIR)
        outputs = {"logits": {"note": f"max-abs {got['logits_max_abs']:.3g} (≤ {got['tolerance']:.3g}), batch "
                                      f"{' and '.join(map(str, got['batches']))}, {got['prompt_tokens']} prompt "
                                      f"tokens, contiguous positions",
                              "passed": got["logits_max_abs"] <= got["tolerance"]},
                   "greedy tokens": tokens_note(got)}
        return got["passed"], outputs

    def readme_section(self, manifest: Manifest) -> str:
        return readme_section(manifest)
