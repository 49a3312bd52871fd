"""`vlmprune generate`: a bundle's tokens fed to its checkpoint's language model in transformers, on the CPU.

The bundle's tower runs under its own runner (the target's runtime here); its
`image_features` rows replace the image placeholder in the prompt's embeddings, and every
row gets its original position (handoff.image_positions): the LLM sees the pruned image
where the dense one was, with gaps where the pruned patches were. `--dense` feeds the
Hugging Face model's own image-feature path instead (consecutive positions), which is
exactly what LlavaForConditionalGeneration.generate computes.

Decoding is greedy, with a KV cache, one token at a time, positions continuing from the
prompt's last position + 1 (so the pruned prompt's shorter length does not shift the
answer's positions). Checkpoints: LLaVA (LlavaForConditionalGeneration) directories and
the `demo` preset (its LLM is seeded, so its answers are token ids, not language).

The prompt: the checkpoint's processor chat template, else its tokenizer's, else
LLaVA-1.5's `USER: <image>\\n{prompt} ASSISTANT:`. A checkpoint without a tokenizer
(the demo, tiny test models) is given the prompt's UTF-8 bytes as token ids (a vocabulary
of at least 256 is needed), and its answer is printed as token ids.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm import handoff

LLAVA_PROMPT = "USER: <image>\n{prompt} ASSISTANT:"
IMAGE_MARK = "<image>"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_PROCESSOR_FILES = ("processor_config.json", "chat_template.json", "chat_template.jinja")


@dataclasses.dataclass
class Vlm:
    """A full LLaVA model (tower, projector, LLM), its tokenizer where it has one, and its vision Source."""

    model: torch.nn.Module
    tokenizer: object | None
    chat_template: object | None  # a processor or tokenizer with a chat template, or None
    source: object  # compiler.frontend.Source of the same weights (hash, preprocessing, dense pipeline)
    spec: str


@dataclasses.dataclass
class Prompt:
    """Token ids around the image placeholder, the text they came from, and how it was built."""

    before: list[int]
    after: list[int]
    text: str
    how: str


@dataclasses.dataclass
class Answer:
    """What the LLM made of one image and prompt: greedy tokens, first-token logits, and what it was fed."""

    tokens: list[int]
    first_logits: torch.Tensor  # [V] float32, the distribution of the first answer token
    position_ids: list[int]  # every prompt position fed to the LLM
    image_tokens: int
    text: str | None = None


def load_vlm(spec: str) -> Vlm:
    """`demo`, or a local LlavaForConditionalGeneration directory; anything else is one line."""
    from vlmprune.compiler.frontend.adapter import Checkpoint
    from vlmprune.compiler.frontend.llava import LlavaAdapter
    from vlmprune.compiler.frontend.presets import demo_model
    from vlmprune.compiler.frontend.source import from_pretrained, quiet_transformers

    quiet_transformers()
    if spec == "demo":
        model = demo_model()
        return Vlm(model, None, None, LlavaAdapter.from_model("demo", model), "demo")
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"{spec}: not a LLaVA checkpoint directory (nor `demo`)")
    checkpoint = Checkpoint(path)
    if checkpoint.model_type != "llava":
        raise InputError(f"{spec}: generate and eval run LLaVA checkpoints (LlavaForConditionalGeneration); "
                         f"this one is {checkpoint.model_type!r}")
    from transformers import LlavaForConditionalGeneration

    source = LlavaAdapter().load(checkpoint, None)
    model = from_pretrained(LlavaForConditionalGeneration, checkpoint, "LLaVA checkpoint")
    tokenizer = _tokenizer(path)
    return Vlm(model, tokenizer, _chat_template(path, tokenizer), source, str(path))


def _tokenizer(path: Path):
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer
        raise InputError(f"{path}: its tokenizer cannot be loaded ({_first_line(exc)})") from None


def _chat_template(path: Path, tokenizer):
    if any((path / f).is_file() for f in _PROCESSOR_FILES):
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
        except Exception:  # no usable processor: the tokenizer's template (or the convention) still works
            processor = None
        if getattr(processor, "chat_template", None):
            return processor
    return tokenizer if getattr(tokenizer, "chat_template", None) else None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------------------------- prompt


def build_prompt(vlm: Vlm, prompt: str) -> Prompt:
    """The prompt's token ids before and after the image placeholder (see the module docstring)."""
    if not prompt.strip():
        raise InputError("--prompt is empty")
    image_token = vlm.model.config.image_token_index
    mark = IMAGE_MARK
    if vlm.tokenizer is not None:
        try:
            mark = vlm.tokenizer.convert_ids_to_tokens(image_token) or IMAGE_MARK
        except (IndexError, KeyError, TypeError):  # an id the tokenizer does not know: the processor's mark
            mark = IMAGE_MARK
    if vlm.chat_template is not None:
        text, how = None, "the checkpoint's chat template"
        for content in ([{"type": "image"}, {"type": "text", "text": prompt}], f"{mark}\n{prompt}"):
            try:  # a processor's template takes typed content; a tokenizer's often only text
                text = vlm.chat_template.apply_chat_template([{"role": "user", "content": content}],
                                                             add_generation_prompt=True, tokenize=False)
            except Exception:  # noqa: BLE001 - templates raise whatever jinja raises
                continue
            if isinstance(text, str) and text.count(mark) == 1:
                break
        if not isinstance(text, str):
            raise InputError(f"{vlm.spec}: its chat template cannot render an image and a prompt")
    else:
        text, how = LLAVA_PROMPT.format(prompt=prompt), "LLaVA-1.5's USER/ASSISTANT convention"
    if text.count(mark) != 1:
        raise InputError(f"the prompt template gives {text.count(mark)} image placeholders ({mark}); one is needed")
    if vlm.tokenizer is None:
        vocab = vlm.model.config.text_config.vocab_size
        if vocab < 256:
            raise InputError(f"{vlm.spec} has no tokenizer, and its vocabulary ({vocab}) is too small to take the "
                             "prompt as UTF-8 bytes; add a tokenizer to the checkpoint")
        before, after = (list(part.encode("utf-8")) for part in text.split(mark))
        return Prompt(before, after, text, how + "; no tokenizer: UTF-8 bytes as token ids")
    # A template that writes the BOS token itself must not get a second one from the tokenizer.
    special = not (vlm.tokenizer.bos_token and text.startswith(vlm.tokenizer.bos_token))
    ids = vlm.tokenizer(text, add_special_tokens=special)["input_ids"]
    if ids.count(image_token) == 1:  # the tokenizer knows the placeholder: split exactly where the processor would
        at = ids.index(image_token)
        return Prompt(ids[:at], ids[at + 1:], text, how)
    head, tail = text.split(mark)
    return Prompt(vlm.tokenizer(head, add_special_tokens=special)["input_ids"],
                  vlm.tokenizer(tail, add_special_tokens=False)["input_ids"],
                  text, how)


# --------------------------------------------------------------------------------- decoding


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


@torch.inference_mode()
def answer(vlm: Vlm, prompt: Prompt, features: torch.Tensor, image_positions: np.ndarray, text_start: int,
           max_new_tokens: int) -> Answer:
    """Greedy decoding: `features` [T, D] in place of the placeholder, at image_positions; the text after it
    from text_start."""
    model = vlm.model
    embed = model.get_input_embeddings()
    ids = lambda values: torch.tensor([values], dtype=torch.long)  # noqa: E731
    embeds = torch.cat([embed(ids(prompt.before)), features[None].to(embed.weight.dtype), embed(ids(prompt.after))],
                       dim=1)
    offset = len(prompt.before)
    if image_positions.size and image_positions.min() < offset:
        raise ValueError("image positions must start at the placeholder's position")
    positions = np.concatenate([np.arange(offset), image_positions, text_start + np.arange(len(prompt.after))])
    out = model(inputs_embeds=embeds, position_ids=torch.from_numpy(positions)[None], use_cache=True,
                logits_to_keep=1)
    logits = out.logits[0, -1].float()
    first, cache, position, tokens, stop = logits.clone(), out.cache, int(positions[-1]) + 1, [], eos_ids(model)
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in stop or step == max_new_tokens - 1:
            break
        out = model(inputs_embeds=embed(ids([token])), position_ids=torch.tensor([[position]]), cache=cache,
                    use_cache=True)
        cache, position, logits = out.cache, position + 1, out.logits[0, -1].float()
    text = vlm.tokenizer.decode(tokens, skip_special_tokens=True) if vlm.tokenizer is not None else None
    return Answer(tokens, first, positions.tolist(), len(features), text)


def dense_features(vlm: Vlm, pixel: np.ndarray, feature_layer: int | None = None) -> torch.Tensor:
    """The Hugging Face model's own image features for one image ([T, D]): LLaVA's get_image_features."""
    config = vlm.model.config
    with torch.inference_mode():
        out = vlm.model.model.get_image_features(
            pixel_values=torch.from_numpy(pixel), vision_feature_layer=config.vision_feature_layer
            if feature_layer is None else feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    return features[0]


# ----------------------------------------------------------------------------------- bundle


@dataclasses.dataclass
class BundleTokens:
    """One image's rows from a bundle, their kept indices (None: dense), the llm section and the runtime used."""

    features: torch.Tensor
    kept: np.ndarray | None
    llm: dict
    runtime: str


def bundle_tokens(bundle_dir: Path, manifest: dict, pixel: np.ndarray) -> BundleTokens:
    """Run the bundle's tower on one preprocessed image ([1, 3, S, S]) with its target's runner here."""
    from vlmprune.targets import get_target

    llm = manifest.get("llm") or handoff.llm_section(manifest)
    kind = llm["positions"]["kind"]
    if kind != "indices":
        raise InputError(f"this bundle's positions are {kind!r} (mRoPE or crops); generate places 1-D "
                         "positions (`indices`) only")
    static = manifest["inputs"][0]["shape"][0]
    if isinstance(static, int) and static > 1:  # a static batch: fill it with the one image, read slot 0
        pixel = np.repeat(pixel, static, axis=0)
    runner, runtime = get_target(manifest["target"]["name"]).runner(Path(bundle_dir), manifest)
    outputs = runner(pixel)
    kept = outputs[handoff.KEPT][0] if handoff.KEPT in outputs else None
    return BundleTokens(torch.from_numpy(np.ascontiguousarray(outputs[llm["features_output"]][0])), kept, llm,
                        runtime)


def bundle_positions(tokens: BundleTokens, offset: int) -> tuple[np.ndarray, int]:
    rows = tokens.llm["rows"]
    if tokens.kept is None:
        return handoff.image_positions(offset, len(tokens.features), 0, None, 0)
    return handoff.image_positions(offset, tokens.llm["dense_image_tokens"], rows["prefix"], tokens.kept,
                                   rows["extra"])


def default_model(manifest: dict) -> str:
    """The bundle's own source, when it is a full LLaVA model (the demo preset or a LLaVA directory)."""
    model = manifest["model"]
    if model["family"] == "llava" and (model["kind"] == "hf" or model["source"] == "demo"):
        return model["source"]
    raise InputError(f"--model is needed: the bundle was compiled from {model['source']} ({model['kind']}, "
                     f"family {model['family']}), which holds no language model")


@dataclasses.dataclass
class GenerateResult:
    answer: Answer
    prompt: Prompt
    runtime: str
    path: str  # "pruned" | "dense"
    kept: list[int] | None


def generate(bundle_dir: Path, model: str | None, image: Path, prompt: str, dense: bool = False,
             max_new_tokens: int = 32, progress=lambda _m: None) -> GenerateResult:
    """The library call behind `vlmprune generate` (see the module docstring)."""
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.frontend.images import load_image_file

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    manifest = load_manifest(bundle_dir, verify=True)
    image = Path(image)
    if not image.is_file():
        raise InputError(f"{image}: no such image file")
    spec = model or default_model(manifest)
    vlm = load_vlm(spec)
    if manifest["model"]["kind"] != "onnx" and vlm.source.content_hash != manifest["model"]["sha256"]:
        raise InputError(f"{spec} is not the model this bundle was compiled from ({manifest['model']['source']}): "
                         "its content hash differs, and its LLM expects its own tower's features")
    hidden = vlm.model.config.text_config.hidden_size
    width = (manifest.get("llm") or handoff.llm_section(manifest))["hidden_size"]
    if width != hidden:
        raise InputError(f"the bundle's image_features are {width} wide, but the LLM of {spec} takes {hidden}")
    pre = manifest["preprocess"]
    try:
        pixel, described, _scale = load_image_file(str(image), pre["size"], pre["mean"], pre["std"])
    except Exception as exc:
        raise InputError(f"{image}: cannot read the image ({_first_line(exc)})") from None
    progress(f"{image}: {described}")
    built = build_prompt(vlm, prompt)
    progress(f"prompt ({built.how}): {built.text!r}")
    offset = len(built.before)
    if dense:
        features = dense_features(vlm, pixel, manifest["model"].get("feature_layer_override"))
        positions, text_start = handoff.image_positions(offset, len(features), 0, None, 0)
        result = answer(vlm, built, features, positions, text_start, max_new_tokens)
        return GenerateResult(result, built, "transformers (the model's own image features, dense)", "dense", None)
    tokens = bundle_tokens(bundle_dir, manifest, pixel)
    positions, text_start = bundle_positions(tokens, offset)
    result = answer(vlm, built, tokens.features, positions, text_start, max_new_tokens)
    kept = None if tokens.kept is None else tokens.kept.tolist()
    return GenerateResult(result, built, tokens.runtime, "pruned" if kept is not None else "dense bundle", kept)
