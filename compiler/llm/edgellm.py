"""The language model for target orin, exported with NVIDIA TensorRT Edge-LLM's own exporter (0.11.0).

Orin users build LLM engines with TensorRT Edge-LLM: its exporter (`tensorrt-edgellm-export`,
run here in a virtual environment of its own, compiler.llm.edgellm_env) writes an ONNX graph
built around its TensorRT plugins, and its C++ builder (`llm_build`) and runtime
(`llm_inference`) on the device take that graph. So for orin the bundle's llm/ is what that
exporter writes, not the plain-ONNX prefill/decode pair of compiler.llm.torch_exporter.

What goes in:
- `demo` or a LLaVA checkpoint: the language model (Llama or Qwen2 family) is written as a
  standalone Hugging Face causal-LM checkpoint (fp16 safetensors, config.json, tokenizer
  files when the checkpoint has them, a chat template) into a temporary folder, which the
  exporter takes as an "LLM-only" model. A checkpoint without a chat template gets a minimal
  one (role: content lines), and the manifest says so.
- a Qwen2.5-VL checkpoint: the exporter knows the family itself; it gets the checkpoint
  (cast to fp16 when stored in fp32) with --skip-visual, so only its language model is
  exported (the bundle's tower replaces Edge-LLM's visual engine).

What comes out (folder/llm/): model.onnx + model.onnx.data (the decoder: one graph for
prefill and decode, paged KV cache, one trt_edgellm::AttentionPlugin per layer that fuses
RoPE, the cache write and attention), embedding.safetensors (the token embedding table: the
lookup happens outside the engine, so inputs_embeds is where the image features go),
config.json (Edge-LLM's runtime config), chat_template.jinja, tokenizer files, and the
exporter's log.

Checked here, without TensorRT (export_edgellm's "checks"): the graph loads with onnx and
passes onnx.checker (custom-op schemas are not checked); every weight in the graph equals the
checkpoint's in fp16 (found by content, max-abs difference reported); and everything in the
graph except the plugins (the norms, projections, MLPs, residuals and the head) runs in ONNX
Runtime on the graph cut at the plugins, against the same math in PyTorch. The plugins (the
attention itself, RoPE, the KV cache) need TensorRT with Edge-LLM's plugin library: the
device.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vlmprune.compiler.errors import InputError, failure_cause
from vlmprune.compiler.contract import LLM_MODEL, Manifest
from vlmprune.compiler.frontend import FAMILIES
from vlmprune.compiler.llm import edgellm_env
from vlmprune.compiler.llm.exporter import LLM_DIR, LlmExporter
from vlmprune.compiler.llm.lm_source import check_family, check_width, language_model
from vlmprune.targets.venvs import clean_env

ONNX_NAME = LLM_MODEL  # what tensorrt-edgellm-export writes and its runtime loads
LOG_NAME = "edgellm_export.log"
EXPORTER = f"TensorRT Edge-LLM {edgellm_env.EDGELLM_VERSION} (tensorrt-edgellm-export)"
TEXT_FAMILIES = ("llama", "qwen2")  # language models of LLaVA checkpoints that go through Edge-LLM's default LLM path
# Language models TensorRT Edge-LLM itself lists that this exporter refuses, with the reason: what vlmprune checks of
# Edge-LLM's graph without TensorRT (the weight map, _expected; the graph cut at the plugins, standard_ops_parity) is
# Llama's and Qwen2's layer, so a layer with more weights than those would ship with them unchecked.
TEXT_REFUSED = {"qwen3": "TensorRT Edge-LLM lists Qwen3, but the checks vlmprune runs on its graph here (the weight "
                         "map, and the graph cut at the plugins against the PyTorch math) have no per-head "
                         "q_norm/k_norm, so Qwen3's layer would ship unchecked; use target ort"}
# Checkpoints Edge-LLM's exporter knows as VLMs (their LLM goes through --skip-visual): what the families declare.
VLM_FAMILIES = tuple(t for family in FAMILIES for t in family.whole_vlm_llm)
PLUGIN_DOMAIN = "trt_edgellm"
PARITY_ATOL = 2e-2  # fp16 graph vs fp32 math on fp16 weights (activations ~N(0, 1), hidden <= 4096)
ORT_CHECK_MAX_BYTES = 3 << 29  # 1.5 GiB: the CPU check loads every weight into one ModelProto (< 2 GiB)
# What the 0.11.0 wheel's native payloads are qualified against (tensorrt_edgellm/_native: variants.json and
# dependencies.py): x86_64 only, CUDA 13, TensorRT 10.16 (or 11); no aarch64/Jetson payload ships in the wheel.
DEVICE_REQUIREMENTS = (f"the Edge-LLM {edgellm_env.EDGELLM_VERSION} C++ tree (llm_build, llm_inference, "
                       "libNvInfer_edgellm_plugin.so) built on the Orin itself; the {v} wheel's own native payloads are x86 "
                       "builds qualified against CUDA 13 and TensorRT 10.16, and Edge-LLM's supported Orin path is "
                       "JetPack 7.2 (CUDA 13.2). JetPack 6.2 (CUDA 12.6, TensorRT 10.3) is not "
                       "what it targets: Edge-LLM's JetPack 6.2 compatibility is its v0.6.0 release, and ONNX from "
                       "one Edge-LLM release is not portable to another's builder").replace(
                           "{v}", edgellm_env.EDGELLM_VERSION)
MINIMAL_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


class _Weights:
    """The language model's weights by canonical name (embed, lm_head, norm, layers.{i}.{part}), fp16, on demand."""

    def __init__(self, get, config):
        self._get = get  # canonical name -> torch tensor or None
        self.config = config

    def __call__(self, name: str) -> torch.Tensor | None:
        tensor = self._get(name)
        return None if tensor is None else tensor.detach().to(torch.float16).contiguous()

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers


_PARTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
          "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}


def _canonical_key(name: str) -> str:
    """Canonical name -> the Hugging Face key suffix (after the decoder's prefix)."""
    if name == "embed":
        return "embed_tokens.weight"
    if name == "norm":
        return "norm.weight"
    _layers, i, part, kind = name.split(".")
    return f"layers.{i}.{_PARTS[part]}.{kind}"


def _module_weights(lm) -> _Weights:
    state = dict(lm.named_parameters())
    state.update(dict(lm.named_buffers()))

    def get(name):
        if name == "lm_head":
            return lm.lm_head.weight
        return state.get(f"model.{_canonical_key(name)}")

    return _Weights(get, lm.config)


def _checkpoint_weights(path: Path, config) -> _Weights:
    """A VLM checkpoint's language-model tensors, read from its safetensors by key (no model built)."""
    from safetensors import safe_open

    index = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                index[key] = file
    prefixes = ("model.language_model.", "model.", "language_model.model.")

    def get(name):
        keys = (["lm_head.weight", "language_model.lm_head.weight"] if name == "lm_head"
                else [p + _canonical_key(name) for p in prefixes])
        for key in keys:
            if key in index:
                with safe_open(str(index[key]), framework="pt") as handle:
                    return handle.get_tensor(key)
        if name == "lm_head" and getattr(config, "tie_word_embeddings", False):
            return get("embed")
        return None

    return _Weights(get, config)


# ------------------------------------------------------------------------------ what goes in


def _resolve(model):
    """(kind, causal LM or None, checkpoint dir or None, text config): one line for anything Edge-LLM is not given."""
    if not isinstance(model, (str, os.PathLike)):
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) in TEXT_REFUSED:
            raise InputError(f"TensorRT Edge-LLM export: language model type {config.model_type!r} is not supported: "
                             f"{TEXT_REFUSED[config.model_type]}")
        if getattr(config, "model_type", None) not in TEXT_FAMILIES:
            raise InputError(f"TensorRT Edge-LLM export: language model type "
                             f"{getattr(config, 'model_type', None)!r} is not supported here "
                             f"(supported: {', '.join(TEXT_FAMILIES)} causal LMs)")
        check_family(config)
        return "lm", model, None, config
    spec = str(model)
    path = Path(spec)
    if checkpoint_kind(spec) == "vlm":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        text = getattr(config, "text_config", None) or config
        return "vlm", None, path, text
    lm = language_model(spec)  # one line for anything else; it checks the family (check_family) too
    return "lm", lm, (path if spec != "demo" and path.is_dir() else None), lm.config


def checkpoint_kind(spec: str) -> str | None:
    """From MODEL's config.json alone (no weights): "vlm" for a checkpoint Edge-LLM's exporter takes whole, "llava" for
    a LLaVA one, None for `demo` or what is not a checkpoint directory (language_model says); one line for anything
    else, so that the refusal comes before the tower's export."""
    path = Path(spec)
    if spec == "demo" or not path.is_dir() or not (path / "config.json").is_file():
        return None
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    text_type = (raw.get("text_config") or {}).get("model_type", "llama")
    if text_type in TEXT_REFUSED:  # InternVL3.5's Qwen3: the reason, not only the checkpoint's family
        raise InputError(f"--with-llm for orin (TensorRT Edge-LLM): {spec}'s language model type {text_type!r} "
                         f"is not supported: {TEXT_REFUSED[text_type]}")
    if model_type in VLM_FAMILIES:
        return "vlm"
    if model_type != "llava":
        raise InputError(f"--with-llm for orin (TensorRT Edge-LLM) takes `demo`, a LLaVA checkpoint (Llama or "
                         f"Qwen2 language model) or a Qwen2.5-VL checkpoint; {spec} is model type {model_type!r}")
    if text_type not in TEXT_FAMILIES:
        raise InputError(f"--with-llm for orin (TensorRT Edge-LLM): {spec}'s language model type {text_type!r} "
                         f"is not supported (supported: {', '.join(TEXT_FAMILIES)})")
    return "llava"


def _chat_template(source: Path | None) -> tuple[str | None, str]:
    """(template text to write, or None when the source has one the exporter finds itself; where it came from)."""
    if source is None:
        return MINIMAL_CHAT_TEMPLATE, "minimal (role: content lines): the model has no chat template"
    if (source / "chat_template.jinja").is_file():
        return (source / "chat_template.jinja").read_text(), f"{source.name}/chat_template.jinja"
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        file = source / name
        if file.is_file():
            try:
                value = json.loads(file.read_text()).get("chat_template")
            except (json.JSONDecodeError, AttributeError):
                value = None
            if isinstance(value, str) and value.strip():
                return value, f"{source.name}/{name}"
    return MINIMAL_CHAT_TEMPLATE, f"minimal (role: content lines): {source.name} has no chat template"


def write_lm_checkpoint(lm, out: Path, source: Path | None = None) -> dict:
    """The causal LM as a standalone Hugging Face checkpoint in out: fp16 safetensors, config, tokenizer, chat template.

    lm is not changed (its tensors are cast into new ones). Returns what was written.
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in lm.state_dict().items():
        if torch.is_floating_point(tensor):
            tensors[name] = tensor.detach().to(torch.float16).contiguous().clone()
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    if tied:
        tensors.pop("lm_head.weight", None)  # transformers re-ties it on load
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = lm.config.to_dict()
    config.update({"architectures": [type(lm).__name__], "model_type": lm.config.model_type, "dtype": "float16",
                   "torch_dtype": "float16", "use_cache": True})
    for key in ("sliding_window", "max_window_layers") if not config.get("use_sliding_window") else ():
        config.pop(key, None)  # qwen2: absent sliding window fields are the plain model
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer = []
    if source is not None:
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
                tokenizer.append(name)
    tokenizer = [name for name in tokenizer if name != "generation_config.json"]
    template, origin = _chat_template(source)
    (out / "chat_template.jinja").write_text(template)
    return {"tensors": len(tensors), "tied_embeddings": tied, "tokenizer_files": tokenizer,
            "chat_template": origin, "minimal_chat_template": template == MINIMAL_CHAT_TEMPLATE}


def _stage_vlm_checkpoint(path: Path, out: Path) -> dict:
    """The Qwen2.5-VL checkpoint as the exporter wants it: fp16/bf16 weights and a chat template."""
    raw = json.loads((path / "config.json").read_text())
    dtype = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    out.mkdir(parents=True, exist_ok=True)
    if dtype in ("float16", "bfloat16"):
        for item in path.iterdir():  # links, not copies: the exporter only reads
            (out / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
        cast = None
    else:
        from transformers import AutoModelForImageTextToText

        from vlmprune.compiler.frontend.source import quiet_transformers

        quiet_transformers()
        model = AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True, use_safetensors=True,
                                                            dtype=torch.float16)
        model.save_pretrained(str(out), safe_serialization=True)
        del model
        for name in _TOKENIZER_FILES + ("preprocessor_config.json", "chat_template.json", "chat_template.jinja"):
            if (path / name).is_file() and not (out / name).exists():
                shutil.copy2(path / name, out / name)
        cast = f"{dtype} -> float16"
    template, origin = _chat_template(path)
    if template == MINIMAL_CHAT_TEMPLATE:
        (out / "chat_template.jinja").write_text(template)
    tokenizer = [name for name in _TOKENIZER_FILES if (path / name).is_file() and name != "generation_config.json"]
    return {"cast": cast, "tokenizer_files": tokenizer, "chat_template": origin,
            "minimal_chat_template": template == MINIMAL_CHAT_TEMPLATE}


# ------------------------------------------------------------------------------ running the exporter


def run_exporter(checkpoint: Path, out: Path, log: Path, extra: tuple[str, ...] = (), timeout: float = 7200) -> float:
    """tensorrt-edgellm-export CHECKPOINT OUT in its venv; its output goes to log. Returns seconds; one line on failure."""
    cmd = [*edgellm_env.export_command(), str(checkpoint), str(out), "--dtype", "float16", *extra]
    env = clean_env()
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as sink:
        try:
            proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env,
                                  cwd=str(out.parent))
        except subprocess.TimeoutExpired:
            raise edgellm_env.EdgeLlmError(f"tensorrt-edgellm-export timed out after {timeout:.0f} s "
                                           f"(log: {log})") from None
    if proc.returncode != 0 or not (out / LLM_DIR / ONNX_NAME).is_file():
        raise edgellm_env.EdgeLlmError(f"tensorrt-edgellm-export failed (exit {proc.returncode}): "
                                       f"{failure_cause(log.read_text(errors='replace'))} (log: {log})")
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------ what comes out


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def inspect_graph(onnx_path: Path) -> dict:
    """Inputs, outputs, op types and domains, opsets, the plugins' attributes, and onnx.checker's verdict."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    graph = proto.graph
    elem = lambda v: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
    ops = collections.Counter(f"{n.domain + '::' if n.domain not in ('', 'ai.onnx') else ''}{n.op_type}"
                              for n in graph.node)
    plugins = [n for n in graph.node if n.domain == PLUGIN_DOMAIN]
    first = {}
    if plugins:
        for a in plugins[0].attribute:
            value = onnx.helper.get_attribute_value(a)
            first[a.name] = value.decode() if isinstance(value, bytes) else value
    try:
        onnx.checker.check_model(str(onnx_path))
        checker = "passed (onnx.checker on the graph's structure; the trt_edgellm ops' schemas are not onnx's)"
    except onnx.checker.ValidationError as exc:
        checker = f"FAILED: {str(exc).splitlines()[0]}"
    return {
        "inputs": [{"name": v.name, "shape": _dims(v), "dtype": elem(v)} for v in graph.input],
        "outputs": [{"name": v.name, "shape": _dims(v), "dtype": elem(v)} for v in graph.output],
        "opsets": {(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
        "domains": sorted({n.domain or "ai.onnx" for n in graph.node}),
        "custom_ops": sorted({f"{n.domain}::{n.op_type}" for n in graph.node if n.domain not in ("", "ai.onnx")}),
        "op_types": dict(sorted(ops.items())),
        "nodes": len(graph.node),
        "attention_plugins": len(plugins),
        "attention_plugin_attributes": first,
        "checker": checker,
    }


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def _initializer_array(tensor, base: Path, count: int | None = None) -> np.ndarray:
    """An initializer's values (the first `count` only, read from its external file without loading the rest)."""
    import onnx

    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    total = int(np.prod(shape)) if shape else 1
    n = total if count is None else min(count, total)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = _external(tensor)
        with open(base / info["location"], "rb") as handle:
            handle.seek(int(info.get("offset", 0)))
            flat = np.frombuffer(handle.read(n * dtype.itemsize), dtype=dtype)
    else:
        flat = onnx.numpy_helper.to_array(tensor).reshape(-1)[:n]
    return flat.reshape(shape) if count is None else flat


def _expected(weights: _Weights, i: int | None) -> dict[str, list[np.ndarray]]:
    """The forms a checkpoint tensor may take in the graph (as stored, transposed, Q/K/V or gate/up fused)."""
    def arr(name):
        tensor = weights(name)
        return None if tensor is None else tensor.numpy()

    forms: dict[str, list[np.ndarray]] = {}
    if i is None:
        for name in ("lm_head", "norm"):
            a = arr(name)
            if a is not None:
                forms[name] = [a, a.T] if a.ndim == 2 else [a]
        return forms
    p = f"layers.{i}."
    q, k, v = (arr(p + f"{x}.weight") for x in "qkv")
    forms[p + "qkv.weight"] = [np.concatenate([q, k, v], 0).T, np.concatenate([q, k, v], 0), q.T, q]
    bias = [arr(p + f"{x}.bias") for x in "qkv"]
    if all(b is not None for b in bias):
        forms[p + "qkv.bias"] = [np.concatenate(bias)]
    if any(b is not None for b in bias) and not all(b is not None for b in bias):
        forms[p + "q.bias"] = [bias[0]]
    for part in ("o", "down"):
        a = arr(p + f"{part}.weight")
        forms[p + f"{part}.weight"] = [a.T, a]
    gate, up = arr(p + "gate.weight"), arr(p + "up.weight")
    forms[p + "gate.weight"] = [gate.T, gate, np.concatenate([gate, up], 0).T, np.concatenate([gate, up], 0)]
    forms[p + "up.weight"] = [up.T, up, np.concatenate([gate, up], 0).T, np.concatenate([gate, up], 0)]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        forms[p + f"{norm}.weight"] = [arr(p + f"{norm}.weight")]
    return forms


def weight_parity(folder: Path, weights: _Weights, layers: list[int] | None = None) -> dict:
    """Every checked checkpoint tensor (fp16) found in the graph's initializers by content; max-abs difference.

    Candidates are the initializers of the same shape whose first values agree (a few bytes
    read each), then the whole tensor is compared. The token embedding is checked in
    embedding.safetensors (the graph starts at inputs_embeds).
    """
    import onnx
    from safetensors.numpy import load_file

    proto = onnx.load(str(folder / ONNX_NAME), load_external_data=False)
    by_shape = collections.defaultdict(list)
    for tensor in proto.graph.initializer:
        by_shape[tuple(tensor.dims)].append(tensor)
    layers = list(range(weights.layers)) if layers is None else layers
    checked, missing, worst = {}, [], 0.0
    for i in [None, *layers]:
        for name, forms in _expected(weights, i).items():
            found = None
            for form in forms:
                for tensor in by_shape.get(form.shape, ()):
                    head = _initializer_array(tensor, folder, 16)
                    if np.abs(head.astype(np.float32) - form.reshape(-1)[:16].astype(np.float32)).max() > 1e-3:
                        continue
                    diff = float(np.abs(_initializer_array(tensor, folder).astype(np.float32)
                                        - form.astype(np.float32)).max())
                    if found is None or diff < found[1]:
                        found = (tensor.name, diff)
                if found is not None:
                    break
            if found is None:
                missing.append(name)
            else:
                checked[name] = {"initializer": found[0], "max_abs": found[1]}
                worst = max(worst, found[1])
    embedding = load_file(str(folder / "embedding.safetensors"))
    table = next(iter(embedding.values()))
    embed = weights("embed").numpy()
    if table.shape == embed.shape:
        diff = float(np.abs(table.astype(np.float32) - embed.astype(np.float32)).max())
        checked["embed"] = {"initializer": "embedding.safetensors", "max_abs": diff}
        worst = max(worst, diff)
    else:
        missing.append(f"embed (embedding.safetensors is {list(table.shape)}, the checkpoint's {list(embed.shape)})")
    return {"tensors_checked": len(checked), "missing": missing, "max_abs": worst, "layers": layers,
            "passed": not missing and worst == 0.0, "details": checked}


# ------------------------------------------------------------------------------ the standard-op part in ONNX Runtime


def standard_ops_parity(folder: Path, weights: _Weights, tokens: int = 7, seed: int = 0) -> dict:
    """The graph cut at its plugins, run in ONNX Runtime, against the same math in PyTorch on the checkpoint's weights.

    The cut graph takes inputs_embeds and each layer's attention output (the plugin's output,
    random here) and gives each layer's packed QKV (the plugin's input) and the logits: every
    norm, projection, MLP, residual and the head. Reference: Hugging Face Llama/Qwen2 decoder
    math (RMSNorm in fp32, SiLU-gated MLP) in fp32 on the fp16 weights.
    """
    import onnx
    import onnxruntime as ort
    from onnx.utils import Extractor
    from transformers.activations import ACT2FN

    proto = onnx.load(str(folder / ONNX_NAME))  # with its weights
    plugins = [n for n in proto.graph.node if n.domain == PLUGIN_DOMAIN]
    config = weights.config
    if len(plugins) != config.num_hidden_layers:
        return {"ran": False, "reason": f"{len(plugins)} attention plugins for {config.num_hidden_layers} layers"}
    qkv_names, attn_names = [n.input[0] for n in plugins], [n.output[0] for n in plugins]
    index_name = next(v.name for v in proto.graph.input if v.name == "logits_indices")
    cut = Extractor(proto).extract_model(["inputs_embeds", *attn_names, index_name], [*qkv_names, "logits"])
    left = sorted({n.domain for n in cut.graph.node if n.domain not in ("", "ai.onnx")})
    if left:
        return {"ran": False, "reason": f"the cut graph still has custom ops ({', '.join(left)})"}
    del cut.opset_import[:]
    cut.opset_import.append(onnx.helper.make_opsetid("", next(o.version for o in proto.opset_import
                                                             if o.domain in ("", "ai.onnx"))))
    session = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(tokens, config.hidden_size, generator=g).half()
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in cut.graph.input}
    attn = [torch.randn(tokens, heads * head_dim, generator=g).half() for _ in plugins]
    shaped = [a.view(tokens, heads, head_dim) if ranks.get(name) == 3 else a for a, name in zip(attn, attn_names)]
    index = torch.tensor([tokens - 1, 0], dtype=torch.int64)
    feed = {"inputs_embeds": embeds.numpy(), index_name: index.numpy(),
            **{name: a.numpy() for name, a in zip(attn_names, shaped)}}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))

    eps = config.rms_norm_eps
    act = ACT2FN[config.hidden_act]
    w = lambda name: None if weights(name) is None else weights(name).float()

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, part, i):
        return torch.nn.functional.linear(x, w(f"layers.{i}.{part}.weight"), w(f"layers.{i}.{part}.bias"))

    worst_qkv, hidden = 0.0, embeds.float()
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            x = rms(hidden, w(f"layers.{i}.input_layernorm.weight"))
            qkv = torch.cat([linear(x, p, i) for p in ("q", "k", "v")], dim=-1)
            out = got[qkv_names[i]].astype(np.float32).reshape(tokens, -1)
            worst_qkv = max(worst_qkv, float(np.abs(out - qkv.numpy()).max()))
            hidden = hidden + linear(attn[i].float(), "o", i)
            x = rms(hidden, w(f"layers.{i}.post_attention_layernorm.weight"))
            hidden = hidden + linear(act(linear(x, "gate", i)) * linear(x, "up", i), "down", i)
        logits = torch.nn.functional.linear(rms(hidden, w("norm")), w("lm_head"))[index]
    scale = float(logits.abs().max())
    worst_logits = float(np.abs(got["logits"].astype(np.float32) - logits.numpy()).max())
    return {"ran": True, "runtime": f"onnxruntime {ort.__version__} CPU", "tokens": tokens, "seed": seed,
            "cut_nodes": len(cut.graph.node), "qkv_max_abs": worst_qkv, "logits_max_abs": worst_logits,
            "logits_scale": scale, "tolerance": PARITY_ATOL,
            "passed": worst_qkv <= PARITY_ATOL and worst_logits <= PARITY_ATOL * max(1.0, scale)}


# ------------------------------------------------------------------------------ the entry point


def export_edgellm(model, manifest: Manifest, options=None, folder: Path | str = ".", progress=lambda _m: None,
                   timeout: float = 7200) -> dict:
    """The language model through TensorRT Edge-LLM's exporter into folder/llm; the manifest's `llm_graphs` fields.

    model: `demo`, a LLaVA checkpoint directory, a Qwen2.5-VL checkpoint directory, or a
    Llama/Qwen2 causal LM (transformers module). Raises InputError (one line) for anything
    else and for FastV options (FastV is not in Edge-LLM's graph), EdgeLlmError (one line with
    the log path) when the venv or the exporter fails, ParityError when a check fails.
    """
    from vlmprune.compiler.errors import ParityError

    if options is not None:
        EdgeLlmExporter().check_options(getattr(options, "fastv_layer", None))
    kind, lm, source, config = _resolve(model)
    check_width(manifest, config)
    folder = Path(folder)
    target = folder / LLM_DIR
    target.mkdir(parents=True, exist_ok=True)
    log = target / LOG_NAME
    progress(f"export LLM ({config.model_type}, {config.num_hidden_layers} layers) with {EXPORTER}")
    with tempfile.TemporaryDirectory(prefix="vlmprune-edgellm-") as tmp:
        tmp = Path(tmp)
        if kind == "lm":
            staged = write_lm_checkpoint(lm, tmp / "checkpoint", source)
            weights = _module_weights(lm)
            extra = ()
        else:
            staged = _stage_vlm_checkpoint(source, tmp / "checkpoint")
            weights = _checkpoint_weights(source, config)
            extra = ("--skip-visual",)
        seconds = run_exporter(tmp / "checkpoint", tmp / "out", log, extra, timeout)
        for item in sorted((tmp / "out" / LLM_DIR).iterdir()):
            destination = target / item.name
            if destination.exists():
                shutil.rmtree(destination) if destination.is_dir() else destination.unlink()
            shutil.move(str(item), str(destination))
    graph = inspect_graph(target / ONNX_NAME)
    weight_bytes = sum(p.stat().st_size for p in target.glob(f"{ONNX_NAME}*"))
    layers = list(range(config.num_hidden_layers)) if config.num_hidden_layers <= 4 else \
        [0, config.num_hidden_layers - 1]
    parity = weight_parity(target, weights, layers)
    progress(f"  weights    {'PASS' if parity['passed'] else 'FAIL'}  {parity['tensors_checked']} tensors equal the "
             f"checkpoint's in fp16 (max-abs {parity['max_abs']:.3g})"
             + (f", missing {', '.join(parity['missing'])}" if parity["missing"] else ""))
    if weight_bytes <= ORT_CHECK_MAX_BYTES:
        try:
            ops = standard_ops_parity(target, weights)
        except Exception as exc:  # cutting or loading the graph (a numeric disagreement is a result, not this)
            ops = {"ran": False, "reason": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
    else:
        ops = {"ran": False, "reason": f"the graph's weights ({weight_bytes / 2**30:.1f} GiB) exceed the CPU check's "
                                       f"{ORT_CHECK_MAX_BYTES / 2**30:.1f} GiB"}
    if ops.get("ran"):
        progress(f"  std ops    {'PASS' if ops['passed'] else 'FAIL'}  graph minus plugins in ONNX Runtime: QKV max-abs "
                 f"{ops['qkv_max_abs']:.3g}, logits max-abs {ops['logits_max_abs']:.3g}")
    if not parity["passed"] or (ops.get("ran") and not ops["passed"]):
        raise ParityError(f"the Edge-LLM graph disagrees with the checkpoint (weights max-abs {parity['max_abs']:.3g}, "
                          f"missing {len(parity['missing'])}; standard ops {ops.get('logits_max_abs', 'not run')})")
    runtime_config = json.loads((target / "config.json").read_text()) if (target / "config.json").is_file() else {}
    files = sorted(p.name for p in target.iterdir())
    tokens = manifest.llm.image_tokens if manifest is not None and manifest.llm is not None else None
    return {
        "exporter": EXPORTER,
        "runtime": "TensorRT Edge-LLM C++ runtime (llm_build / llm_inference) with its plugin library, on the device",
        "source": "the Qwen2.5-VL checkpoint's language model (--skip-visual)" if kind == "vlm"
        else "the VLM's language model, written as a standalone fp16 Hugging Face causal-LM checkpoint",
        "family": config.model_type, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "vocab_size": config.vocab_size, "image_tokens": tokens,
        "files": {"onnx": f"{LLM_DIR}/{ONNX_NAME}", "weights": f"{LLM_DIR}/{ONNX_NAME}.data",
                  "embedding": f"{LLM_DIR}/embedding.safetensors", "config": f"{LLM_DIR}/config.json",
                  "log": f"{LLM_DIR}/{LOG_NAME}", "all": [f"{LLM_DIR}/{name}" for name in files]},
        "chat_template": staged["chat_template"], "minimal_chat_template": staged["minimal_chat_template"],
        "tokenizer_files": staged["tokenizer_files"],
        "export_seconds": round(seconds, 1),
        "device_requirements": DEVICE_REQUIREMENTS,
        "edgellm_config": {k: runtime_config.get(k) for k in ("model", "edgellm_version", "kv_cache_dtype",
                                                              "rope_theta", "rope_scaling", "max_position_embeddings")
                           if k in runtime_config},
        "graph": graph,
        "positions": positions_note(kind),
        "checks": {
            "onnx_load_and_checker": graph["checker"],
            "weights": {k: v for k, v in parity.items() if k != "details"},
            "standard_ops_in_onnxruntime": ops,
            "needs_device": ["the trt_edgellm::AttentionPlugin ops (attention, RoPE from rope_rotary_cos_sin, the "
                             "paged KV cache): TensorRT with Edge-LLM's plugin library",
                             "engine build (llm_build) and end-to-end generation (llm_inference) on the Orin"],
        },
    }


def recheck(model, bundle_dir: Path, manifest: Manifest) -> dict:
    """`vlmprune check` for an Edge-LLM graph: the weight and standard-op checks again, on the bundle's own files.

    The source is resolved as at compile time (the LM for demo/LLaVA, the checkpoint's tensors
    for Qwen2.5-VL); what needs TensorRT stays listed, not run.
    """
    llm = manifest.llm_graphs
    kind, lm, source, config = _resolve(model)
    weights = _module_weights(lm) if kind == "lm" else _checkpoint_weights(source, config)
    folder = Path(bundle_dir) / LLM_DIR
    layers = list(range(config.num_hidden_layers)) if config.num_hidden_layers <= 4 else \
        [0, config.num_hidden_layers - 1]
    parity = weight_parity(folder, weights, layers)
    ran_before = llm["checks"]["standard_ops_in_onnxruntime"].get("ran")
    ops = standard_ops_parity(folder, weights) if ran_before else llm["checks"]["standard_ops_in_onnxruntime"]
    return {"weights": {k: v for k, v in parity.items() if k != "details"}, "standard_ops": ops,
            "passed": bool(parity["passed"] and (not ops.get("ran") or ops["passed"])),
            "needs_device": llm["checks"]["needs_device"]}


def positions_note(kind: str) -> str:
    """Where token positions live in Edge-LLM's graph, and what placing kept tokens at their original ones takes."""
    common = ("The graph takes RoPE as data: `rope_rotary_cos_sin` [tokens, rotary_dim] (fp32, one row per token) and "
              "`positions`, both computed by Edge-LLM's runtime; so the graph itself takes any position per token.")
    if kind == "vlm":
        return (common + " For Qwen2.5-VL the runtime derives the mRoPE rows from the image's dense (t, h, w) grid; "
                "placing a tower-pruned image's kept tokens at their original mRoPE positions (the bundle's "
                "kept_positions) needs the runtime to compute those rows from kept_positions instead: a change in "
                "Edge-LLM's C++ runtime (or a driver of your own that fills rope_rotary_cos_sin), not in the graph.")
    return (common + " For the 1-D RoPE of LLaVA's Llama/Qwen2 a kept image token at original position p needs the "
            "row of position p (the bundle README's positions rule). Edge-LLM's stock llm_inference builds these rows "
            "itself from the prompt it tokenizes (it takes chat JSON with text and image paths, and runs its own "
            "visual engine only for the VLM families it knows), so the bundle's image_features and their original "
            "positions reach this engine through a driver of your own on Edge-LLM's C++ runtime API that fills "
            "inputs_embeds and rope_rotary_cos_sin; a dense bundle's positions are the consecutive ones.")


def readme_section(manifest: Manifest) -> str:
    """The bundle README's language-model section for an Edge-LLM export."""
    llm = manifest.llm_graphs
    files, graph, checks = llm["files"], llm["graph"], llm["checks"]
    tokens = llm.get("image_tokens")
    image = tokens if isinstance(tokens, int) else 576
    max_input = max(1024, 2 ** int(np.ceil(np.log2(image + 256))))
    names = ", ".join(f"`{v['name']}`" for v in graph["inputs"])
    ops = checks["standard_ops_in_onnxruntime"]
    ops_line = (f"the graph cut at its plugins ran in ONNX Runtime against the PyTorch math on the same weights: "
                f"QKV max-abs {ops['qkv_max_abs']:.2g}, logits max-abs {ops['logits_max_abs']:.2g}"
                if ops.get("ran") else f"the standard-op check did not run ({ops.get('reason')})")
    template = ("a minimal chat template (`role: content` lines) was written because the checkpoint has none: "
                "replace `llm/chat_template.jinja` with the model's real one for chat use"
                if llm.get("minimal_chat_template") else f"chat template from {llm['chat_template']}")
    vlm_flags = (f" \\\n  --vlm --minImageTokens {image} --maxImageTokens {image}"
                 if "Qwen2.5-VL" in llm.get("source", "") else "")
    return f"""
## The language model (`--with-llm`, TensorRT Edge-LLM)

`{files['onnx']}` ({llm['family']}, {llm['layers']} layers, weights in `{files['weights']}`, token embeddings in
`{files['embedding']}`, Edge-LLM runtime config `{files['config']}`) was written by {llm['exporter']}; its log is
`{files['log']}`. It is Edge-LLM's graph: one graph for prefill and decode with a paged KV cache and one
`trt_edgellm::AttentionPlugin` per layer (attention, RoPE and the cache write fused), so it needs TensorRT with
Edge-LLM's plugin library and runs in Edge-LLM's runtime, not in ONNX Runtime. Inputs: {names}. The embedding
lookup happens outside the engine: the bundle's `image_features` rows go into `inputs_embeds` in the image's
place; text rows are rows of `embedding.safetensors`. {llm['positions']}
`llm_inference` below is the text-only smoke test of the engine. Tokenizer files:
{', '.join(llm['tokenizer_files']) or 'none (the source checkpoint has none: add tokenizer.json before llm_inference)'};
{template}.

Build and run on the Orin. Needs {llm['device_requirements']}. The C++ tree is configured there with
`cmake .. -DTRT_PACKAGE_DIR=/usr -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64_linux_toolchain.cmake
-DEMBEDDED_TARGET=jetson-orin` (then `make -j$(nproc)`); copy the bundle's `llm/` folder over and run:

```bash
./build/examples/llm/llm_build --onnxDir llm --engineDir engines/llm \\
  --maxBatchSize 1 --maxInputLen {max_input} --maxKVCacheCapacity {max_input + 1024}{vlm_flags}
./build/examples/llm/llm_inference --engineDir engines/llm --inputFile input.json --outputFile output.json
```

`--maxInputLen` must cover the prompt with its {image} image rows; `--maxKVCacheCapacity` the prompt plus the
tokens generated. Flag names are those of Edge-LLM's `examples/llm` tools: check `llm_build --help` of the
release you built.

Checked at compile time without TensorRT: `onnx.load` + `onnx.checker`: {graph['checker']}; weights: 
{checks['weights']['tensors_checked']} checkpoint tensors found in the graph, max-abs {checks['weights']['max_abs']:.2g}
in fp16; {ops_line}. Needs the device: {'; '.join(checks['needs_device'])}.
"""


class EdgeLlmExporter(LlmExporter):
    """TensorRT Edge-LLM's own exporter (its venv): the plugin graph Orin users build engines from; no FastV."""

    id = "edgellm"
    name = "TensorRT Edge-LLM"
    summary = f"TensorRT Edge-LLM {edgellm_env.EDGELLM_VERSION} exporter"
    features = "its plugin graph, dense"
    fastv_refusal = ("--fastv-layer: FastV is not part of TensorRT Edge-LLM's language-model graph (target "
                     "orin); prune in the tower instead, or use target ort for FastV")
    families = TEXT_FAMILIES + VLM_FAMILIES
    runtime = "onnx + onnxruntime (graph cut at the TensorRT Edge-LLM plugins)"
    precision = "fp16"
    atol = PARITY_ATOL

    def available(self) -> tuple[bool, str]:
        return edgellm_env.creatable()

    def check_model(self, spec: str, fastv) -> None:
        """MODEL's config alone against what the exporter takes (checkpoint_kind), before the tower's export; the
        language model itself is checked by _resolve, at export."""
        checkpoint_kind(spec)

    def export(self, model_spec: str, manifest: Manifest, options, folder: Path, progress, fastv) -> dict:
        from vlmprune.compiler.errors import ToolchainError

        try:
            return export_edgellm(model_spec, manifest, options, folder, progress)
        except edgellm_env.EdgeLlmError as exc:
            raise ToolchainError(str(exc)) from None

    def parity_figures(self, llm: dict) -> tuple[bool, list[str]]:
        """The graph's weights, and the graph minus its plugins where that runs here."""
        from vlmprune.compiler.parity import figure_text

        weights, ops = llm["checks"]["weights"], llm["checks"]["standard_ops_in_onnxruntime"]
        passed = weights["passed"] and (not ops.get("ran") or ops["passed"])
        logits = figure_text(ops["logits_max_abs"], 3, at_most=ops.get("tolerance")) if ops.get("ran") else None
        return passed, [f"weights max-abs {weights['max_abs']:.2e} over {weights['tensors_checked']} tensors",
                        "standard ops not run here" if logits is None else f"standard-ops logits max-abs {logits}"]

    def parity(self, model_spec: str, bundle_dir: Path, manifest: Manifest) -> tuple[bool, dict]:
        """The checks that run without TensorRT (fp16 weights; the plugins need the device)."""
        got = recheck(model_spec, bundle_dir, manifest)
        weights, ops = got["weights"], got["standard_ops"]
        outputs = {"weights": {"note": f"{weights['tensors_checked']} checkpoint tensors in the graph, max-abs "
                                       f"{weights['max_abs']:.3g} in fp16"
                                       + (f", missing {', '.join(weights['missing'])}" if weights["missing"] else ""),
                               "passed": bool(weights["passed"])}}
        if ops.get("ran"):
            outputs["standard ops"] = {"note": f"graph minus plugins in ONNX Runtime: QKV max-abs "
                                               f"{ops['qkv_max_abs']:.3g}, logits max-abs {ops['logits_max_abs']:.3g} "
                                               f"(≤ {PARITY_ATOL:g})",
                                       "passed": bool(ops["passed"])}
        else:
            outputs["standard ops"] = {"note": f"not run: {ops.get('reason')}", "passed": None}
        outputs["device"] = {"note": "not run here: " + "; ".join(got["needs_device"]), "passed": None}
        return got["passed"], outputs

    def readme_section(self, manifest: Manifest) -> str:
        return readme_section(manifest)
