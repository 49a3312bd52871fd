"""`vlmprune generate`: a bundle's tokens fed to its language model, on the CPU.

Which language model answers (bundle_llm, and the output says which): a bundle compiled
--with-llm answers with its own exported LLM graphs (llm/prefill.onnx + llm/decode.onnx under
ONNX Runtime: FastV and all, what the user deploys) when its exporter can run them here;
`--reference`, `--dense` and bundles without an LLM answer with the checkpoint's language
model in transformers.

The bundle's tower runs under its own runner (the target's runtime here); its
`image_features` rows replace the image placeholder in the prompt's embeddings, and every
row gets its original position, by its family's positions rule (Family.positions): the LLM
sees the pruned image where the dense one was, with gaps where the pruned tokens were.

- LLaVA-1.5 (LlavaForConditionalGeneration, and the `demo` preset): 1-D positions from
  kept_indices (frontend.family.image_positions).
- Qwen2-VL / Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
  the merged tokens at their dense mRoPE (t, h, w) positions from kept_positions, 3 x seq
  position ids, the text resuming at the dense image's largest position + 1
  (frontend.qwen2_vl.thw_positions). The checkpoint is loaded at the bundle's --image-size, and an
  image is resized and centre-cropped to it, as `vlmprune run` feeds the bundle.
- LLaVA-NeXT (LlavaNextForConditionalGeneration): the kept rows assembled as the bundle
  README's anyres rule packs them (frontend.llava_next.assemble_llm_input: base tokens,
  grid tokens, image_newline after each row that keeps one), each at its position in the
  dense packed sequence (frontend.llava_next.anyres_positions). The image is centre-cropped to the
  bundle grid's aspect and resized to its resolution (as parity feeds it), so that nothing
  is padded: the dense sequence is then the static one the manifest counts
  (dense_image_tokens), and transformers' own path selects the same grid for it.
- Gemma 3 (Gemma3ForConditionalGeneration): 1-D positions from kept_indices, the rows one image block
  that attends to itself both ways (Family.llm_forward_args: token_type_ids 1 there, as its processor
  marks them), between the "\\n\\n<boi>" and "<eoi>\\n\\n" its processor writes for the template's boi
  token (Family.image_prompt).
- Gemma 4 (Gemma4ForConditionalGeneration): 1-D positions from kept_indices, the rows one image block between boi
  and eoi (mm_token_type_ids 1 there: bidirectional in its sliding layers where its config asks), and the first
  forward given its per-layer embeddings (Family.llm_embeds_args), the image rows taking the pad token's.
- InternVL3 (InternVLForConditionalGeneration): 1-D positions from kept_indices, the rows between the <img> and
  </img> its processor writes for the template's <IMG_CONTEXT> (Family.image_prompt).
- LLaVA-OneVision clips (LlavaOnevisionForConditionalGeneration): the kept rows at their dense index, then the
  checkpoint's image_newline once at the dense clip's end (offset + F·M), the text after F·M + 1; the prompt written
  as its processor writes a video (ChatPrompt.video: the template's video turn, video_token_id).
- SmolVLM (SmolVLMForConditionalGeneration): 1-D positions from kept_indices, the rows between the
  <fake_token_around_image><global-img> and <fake_token_around_image> its processor writes around
  one unsplit image (Family.image_prompt); over `--grid` tiles its split-image prompt, the
  <fake_token_around_image><row_r_col_c> markers and newlines between the tiles' rows
  (Family.source_image_prompt: Prompt.between), each kept row and marker at its dense position
  (between_tiles).

`--dense` feeds the Hugging Face model's own image-feature path instead (get_image_features
with image_sizes / image_grid_thw; consecutive positions, or the full mRoPE grid), which is
exactly what the model's own forward on pixel_values computes (eval's harness check).

Decoding is greedy, with a KV cache, one token at a time, positions continuing from the
prompt's largest position + 1 (so the pruned prompt's shorter length does not shift the
answer's positions; on every mRoPE axis alike, as Qwen's rope_deltas continue).

The prompt: the checkpoint's processor chat template, else its tokenizer's, else the
family's convention (Family.chat: LLaVA's `USER: <image>\\n{prompt} ASSISTANT:` by default; Qwen's
im_start/im_end turns with `<|vision_start|><|image_pad|><|vision_end|>`; Family.image_prompt's). The
placeholder is expanded to the image rows fed (for Qwen: as many <|image_pad|> as rows, between
vision_start and vision_end), with the text the family's processor writes around them
(Family.image_prompt: InternVL's <img> and </img>, SmolVLM's fake-token and global-image markers, Gemma 3's boi and
eoi).
A checkpoint without a tokenizer (the demo, tiny test models) is given the prompt's UTF-8
bytes as token ids (a vocabulary of at least 256 is needed; Qwen's vision_start/vision_end
keep their own ids), and its answer is printed as token ids.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError, option
from vlmprune.compiler.frontend import family_of
from vlmprune.compiler.frontend.family import PATCH_TOKENS, image_positions
from vlmprune.compiler.frontend.images import require_image_files
from vlmprune.compiler.llm import handoff
from vlmprune.compiler.llm.lm_source import has_tokenizer
from vlmprune.compiler.prompt_rows import bundle_feed

_PROCESSOR_FILES = ("processor_config.json", "chat_template.json", "chat_template.jinja")


@dataclasses.dataclass
class Vlm:
    """A full VLM (tower, projector, LLM), its tokenizer where it has one, and its vision Source."""

    model: torch.nn.Module
    tokenizer: object | None
    chat_template: object | None  # a processor or tokenizer with a chat template, or None
    source: object  # compiler.frontend.Source of the same weights (hash, preprocessing, dense pipeline)
    spec: str
    family: str  # the family's id (frontend FAMILIES); `rules` is its object

    @property
    def rules(self):
        from vlmprune.compiler.frontend import family_by_id

        return family_by_id(self.family)


@dataclasses.dataclass
class Prompt:
    """Token ids around the image placeholder, the text they came from, and how it was built."""

    before: list[int]
    after: list[int]
    text: str
    how: str
    # The ids its processor writes between two tiles' rows (ImagePrompt.between; one list per tile but the last),
    # and the rows of each tile: spliced among the image rows at their dense places (between_tiles). [] for most.
    between: list[list[int]] = dataclasses.field(default_factory=list)
    tile_rows: tuple[int, ...] = ()


@dataclasses.dataclass
class Answer:
    """What the LLM made of one image and prompt: greedy tokens, first-token logits, and what it was fed."""

    tokens: list[int]
    first_logits: torch.Tensor  # [V] float32, the distribution of the first answer token
    position_ids: list  # every prompt position fed to the LLM ([L]; mRoPE: [3][L], (t, h, w))
    image_tokens: int
    text: str | None = None


@dataclasses.dataclass
class ImageRows:
    """What replaces the placeholder: the rows in sequence order, and their positions given the placeholder's."""

    rows: torch.Tensor  # [T, D]
    place: Callable[[int], tuple[np.ndarray, int]]  # offset -> (positions [T] or [3, T], text start)
    kept: list[int] | None = None


def supported() -> str:
    """The checkpoints generate and eval run: every family that declares a language model, in its own words."""
    from vlmprune.compiler.frontend import FAMILIES

    names = [f.has[PATCH_TOKENS] for f in FAMILIES if f.language_model]
    return f"{', '.join(names[:-1])} and {names[-1]} checkpoints (their ...ForConditionalGeneration)"


def load_vlm(spec: str, image_size: int | None = None, grid: str | None = None, bundle=None,
             options: dict | None = None) -> Vlm:
    """`demo`, or a local LLaVA / LLaVA-NeXT / Qwen2-VL directory; anything else is one line.

    image_size: Qwen2-VL's static size (default 448); grid: LLaVA-NeXT's crops grid (default its largest).
    bundle: a manifest the model must be the source of: its family is checked before any weight is read,
    and its --image-size / --grid are the defaults.
    options: other options the families declare, as `compile` takes them (eval --dataset's --video-frames: the
    source of the bundles it compiles), refused in one line for a family that does not declare them.
    """
    from vlmprune.compiler.frontend.adapter import Checkpoint
    from vlmprune.compiler.frontend.llava import LlavaAdapter
    from vlmprune.compiler.frontend.presets import demo_model
    from vlmprune.compiler.frontend.source import from_pretrained, quiet_transformers

    quiet_transformers()
    family = None if bundle is None or not family_of(bundle).identifies_model else bundle.model.family
    if spec == "demo":
        _bundle_family(spec, LlavaAdapter.family, bundle)
        if image_size is not None or grid is not None:
            raise InputError("--image-size and --grid do not apply to `demo` (a LLaVA-1.5 model)")
        for name, value in (options or {}).items():
            if value is not None:
                raise InputError(f"--{name.replace('_', '-')} does not apply to `demo` (a LLaVA-1.5 model)")
        model = demo_model()
        source = LlavaAdapter.from_model("demo", model)
        return Vlm(model, None, None, source, "demo", source.family)
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"{spec}: not a checkpoint directory (nor `demo`); generate and eval run {supported()}")
    checkpoint = Checkpoint(path)
    import transformers

    from vlmprune.compiler.frontend import FAMILIES

    owner = next((f for f in FAMILIES if checkpoint.model_type in f.language_model and f.adapter.claims(checkpoint)),
                 None)  # the family whose adapter loads it (a LLaVA on DINOv2 before the general LLaVA)
    if owner is None:
        raise InputError(f"{spec}: generate and eval run {supported()}; this one is {checkpoint.model_type!r}")
    mine = owner.id
    _bundle_family(spec, mine, bundle, checkpoint.model_type)
    # the flags given, and every option the family declares (--video-frames), the bundle's own values their defaults
    given = {**{name: None for name in owner.options}, **(options or {}), "image_size": image_size, "grid": grid}
    for name in given:  # the bundle's own --image-size / --grid are the defaults
        if family is not None and given[name] is None and name in owner.options:
            given[name] = bundle.model.get(name)
    for name, value in given.items():
        if value is not None and name not in owner.options:
            theirs = next(f for f in FAMILIES if name in f.options and f.language_model)
            raise InputError(f"--{name.replace('_', '-')} applies to {theirs.has[PATCH_TOKENS]} checkpoints, "
                             f"not to {spec} ({mine})")
    source = owner.llm_source(checkpoint, {k: v for k, v in given.items() if v is not None})
    model_class = getattr(transformers, owner.language_model[checkpoint.model_type])
    model = from_pretrained(model_class, checkpoint, f"{mine} checkpoint")
    tokenizer = _tokenizer(path)
    return Vlm(model, tokenizer, _chat_template(path, tokenizer), source, str(path), mine)


def _bundle_family(spec: str, family: str, bundle, model_type: str | None = None) -> None:
    """A checkpoint of another family than the bundle's model, in one line (an .onnx tower's bundle: any LLaVA).

    Named by model_type where known: one family (qwen2_vl) holds two model types.
    """
    if bundle is not None and family_of(bundle).identifies_model and bundle.model.family != family:
        theirs = bundle.model.get("model_type") or bundle.model.family
        raise InputError(f"{spec} is not the model this bundle was compiled from ({bundle.model.source}): it is "
                         f"a {model_type or family} checkpoint, the bundle's model a {theirs} one")


def _tokenizer(path: Path):
    if not has_tokenizer(path):
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


def image_token_id(vlm: Vlm) -> int:
    return vlm.model.config.image_token_id  # LLaVA's image_token_index too (its config maps the name)


# ---------------------------------------------------------------------------------- prompt


def require_prompt(prompt: str) -> str:
    """One line for an empty prompt; callers check it before any work (loading, preprocessing)."""
    if not str(prompt).strip():
        raise InputError(f"{option('--prompt')} is empty")
    return prompt


def build_prompt(vlm: Vlm, prompt: str) -> Prompt:
    """The prompt's token ids before and after the image placeholder (see the module docstring)."""
    require_prompt(prompt)
    chat = vlm.rules.chat  # the family's mark, text-only turn and convention
    # the text its processor writes around the image rows (and between its tiles' rows), if any
    wrap = vlm.rules.source_image_prompt(vlm.tokenizer, vlm.source)
    tiles = {"tile_rows": wrap.tile_rows or (vlm.source.num_patches,) * (len(wrap.between) + 1)} \
        if wrap is not None and wrap.between else {}
    clip = chat.video and vlm.source.frames > 1  # written as its processor writes a video
    image_token = vlm.model.config.video_token_id if clip else image_token_id(vlm)
    own_mark = wrap is not None and wrap.mark is not None  # the template writes a mark other than the image token
    default_mark = wrap.mark if own_mark else chat.mark
    mark = default_mark
    if vlm.tokenizer is not None and not own_mark:
        try:
            mark = vlm.tokenizer.convert_ids_to_tokens(image_token) or default_mark
        except (IndexError, KeyError, TypeError):  # an id the tokenizer does not know: the processor's mark
            mark = default_mark
    if vlm.chat_template is not None:
        text, how = None, "the checkpoint's chat template"
        wrapped = chat.content.format(mark=mark, prompt=prompt)
        for content in ([{"type": "video" if clip else "image"}, {"type": "text", "text": prompt}], wrapped):
            try:  # a processor's template takes typed content; a tokenizer's often only text
                text = vlm.chat_template.apply_chat_template([{"role": "user", "content": content}],
                                                             add_generation_prompt=True, tokenize=False)
            except Exception:  # noqa: BLE001 - templates raise whatever jinja raises
                continue
            if isinstance(text, str) and text.count(mark) == 1:
                break
        if not isinstance(text, str):
            raise InputError(f"{vlm.spec}: its chat template cannot render an image and a prompt")
    elif wrap is not None and wrap.convention is not None:
        text = wrap.convention.format(mark=mark, prompt=prompt)
        how = f"{vlm.rules.has[PATCH_TOKENS]}'s chat convention"
    else:
        text, how = chat.convention.format(mark=mark, prompt=prompt), chat.how
    if text.count(mark) != 1:
        raise InputError(f"the prompt template gives {text.count(mark)} image placeholders ({mark}); one is needed")
    if vlm.tokenizer is None:
        vocab = vlm.model.config.text_config.vocab_size
        if vocab < 256:
            raise InputError(f"{vlm.spec} has no tokenizer, and its vocabulary ({vocab}) is too small to take the "
                             "prompt as UTF-8 bytes; add a tokenizer to the checkpoint")
        specials = {}
        if wrap is not None:  # the processor's text around the image rows, its markers by their ids
            config = vlm.model.config
            head, tail = text.split(mark)
            specials = {m: getattr(config, key) for m, key in wrap.specials}
            return Prompt(_bytes(head + wrap.before, specials), _bytes(wrap.after + tail, specials), text,
                          how + "; no tokenizer: UTF-8 bytes as token ids",
                          [_bytes(piece, specials) for piece in wrap.between], **tiles)
        if chat.span:  # the markers around the image (Qwen's vision_start/end) as their own ids
            config = vlm.model.config
            specials = {mark: getattr(config, key) for mark, key in zip(chat.span, vlm.rules.vision_span)}
        before, after = (_bytes(part, specials) for part in text.split(mark))
        return Prompt(before, after, text, how + "; no tokenizer: UTF-8 bytes as token ids")
    # A template that writes the BOS token itself must not get a second one from the tokenizer.
    special = not (vlm.tokenizer.bos_token and text.startswith(vlm.tokenizer.bos_token))
    if wrap is not None:  # split at the template's mark, the processor's expansion of it on either side
        head, tail = text.split(mark)
        return Prompt(vlm.tokenizer(head + wrap.before, add_special_tokens=special)["input_ids"],
                      vlm.tokenizer(wrap.after + tail, add_special_tokens=False)["input_ids"], text, how,
                      [vlm.tokenizer(piece, add_special_tokens=False)["input_ids"] for piece in wrap.between], **tiles)
    ids = vlm.tokenizer(text, add_special_tokens=special)["input_ids"]
    if ids.count(image_token) == 1:  # the tokenizer knows the placeholder: split exactly where the processor would
        at = ids.index(image_token)
        return Prompt(ids[:at], ids[at + 1:], text, how)
    head, tail = text.split(mark)
    return Prompt(vlm.tokenizer(head, add_special_tokens=special)["input_ids"],
                  vlm.tokenizer(tail, add_special_tokens=False)["input_ids"],
                  text, how)


def _bytes(text: str, specials: dict[str, int]) -> list[int]:
    """UTF-8 bytes as token ids, the family's special markers (Qwen's vision_start/end) as their own ids."""
    for mark, token in specials.items():
        if mark in text:
            parts = [_bytes(part, specials) for part in text.split(mark)]
            out = parts[0]
            for part in parts[1:]:
                out = out + [token] + part
            return out
    return list(text.encode("utf-8"))


# ------------------------------------------------------------------------------ image input


def load_pixels(vlm: Vlm, image: Path, preprocess: dict | None = None) -> tuple[np.ndarray, str]:
    """An image file preprocessed for the source's tower, as its family's processor does ([1, 3, S, S], or
    LLaVA-NeXT's crops [C, 3, S, S]), and the line that says how.

    preprocess: a bundle manifest's size, mean and std (one image, not crops), else the source's.
    """
    try:
        return vlm.rules.llm_pixels(vlm.source, str(image), preprocess)
    except Exception as exc:
        raise InputError(f"{image}: cannot read the image ({_first_line(exc)})") from None


def hf_image_inputs(vlm: Vlm, pixel: np.ndarray) -> dict:
    """The model's own forward's image arguments for one preprocessed image (pixel: load_pixels' array)."""
    return vlm.rules.hf_image_inputs(vlm.model.config, vlm.source, pixel)


def hf_forward_ids(vlm: Vlm, prompt: Prompt, tokens: int) -> dict:
    """input_ids (the placeholder expanded to `tokens`, as the family's processor expands it) for the model's own
    forward, with Qwen's mm_token_type_ids."""
    video = vlm.source.frames > 1  # a video source: Qwen's video placeholder, token type 2
    token = vlm.model.config.video_token_id if video else image_token_id(vlm)
    span = [token] * tokens
    if prompt.between:  # the tiles' rows, the processor's text between them (each tile's rows: tile_rows)
        if tokens != sum(prompt.tile_rows):
            raise ValueError(f"{tokens} image tokens are not the tiles' {sum(prompt.tile_rows)}")
        span = [token] * prompt.tile_rows[0]
        for piece, rows in zip(prompt.between, prompt.tile_rows[1:]):
            span = span + piece + [token] * rows
    ids = torch.tensor([prompt.before + span + prompt.after])
    out = {"input_ids": ids}
    if vlm.rules.vision_span is not None:  # Qwen's forward marks the image (1) and video (2) tokens
        out["mm_token_type_ids"] = (ids == token).int() * (2 if video else 1)
    at = len(prompt.before)
    out.update(vlm.rules.llm_forward_args(ids.shape[1], slice(at, at + len(span))))
    return out


def between_tiles(prompt: Prompt, embed, rows: torch.Tensor, image_positions: np.ndarray, text_start: int,
                  ) -> tuple[torch.Tensor, np.ndarray, int]:
    """The processor's text between an image's tiles (Prompt.between: SmolVLM's row / column markers) spliced among
    its rows at their dense places: (the image span's rows, their positions, the text start after it).

    image_positions place the rows as the tiles' rows end to end (offset + c·N + i for token i of tile c, the
    family's positions rule; offset + the rows of the tiles before c + i where tiles differ, Prompt.tile_rows): each
    row moves past the text written before its tile, each piece of text takes the positions right after its tile's
    rows, and the span is in position order (a tile's kept rows, then its text)."""
    if image_positions.ndim != 1:
        raise ValueError("text between tiles takes 1-D positions")
    offset = len(prompt.before)
    ends = np.cumsum(prompt.tile_rows).astype(np.int64)  # the image rows up to the end of tile c
    lengths = [len(piece) for piece in prompt.between]
    before_tile = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # text tokens before tile c
    tile = np.clip(np.searchsorted(ends, image_positions - offset, side="right"), 0, len(lengths))
    moved = image_positions + before_tile[tile]
    text = [offset + ends[c] + before_tile[c] + np.arange(k) for c, k in enumerate(lengths)]
    ids = torch.tensor([[t for piece in prompt.between for t in piece]], dtype=torch.long)
    positions = np.concatenate([moved, *text]).astype(np.int64)
    span = torch.cat([rows, embed(ids)[0].to(rows.dtype)])
    order = np.argsort(positions, kind="stable")
    return span[torch.from_numpy(order)], positions[order], text_start + int(before_tile[-1])


# --------------------------------------------------------------------------------- decoding


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


@torch.inference_mode()
def answer(vlm: Vlm, prompt: Prompt, features: torch.Tensor, image_positions: np.ndarray, text_start: int,
           max_new_tokens: int, graphs=None) -> Answer:
    """Greedy decoding: `features` [T, D] in place of the placeholder, at image_positions ([T], or [3, T] for
    mRoPE); the text after it from text_start.

    graphs: a bundle's exported LLM (compiler.llm.exporter.LlmGraphRunner) to decode with, fed the same
    embeddings and positions; None: the checkpoint's language model in transformers.
    """
    model = vlm.model
    embed = model.get_input_embeddings()
    ids = lambda values: torch.tensor([values], dtype=torch.long)  # noqa: E731
    if graphs is None:  # Qwen3-VL: plane 0, DeepStack beside it
        rows, first_call = vlm.rules.llm_image_rows(model, features)
    else:
        rows, at_image = vlm.rules.llm_graph_image_rows(model, features)
    offset = len(prompt.before)
    image_positions = np.asarray(image_positions, dtype=np.int64)
    if image_positions.size and image_positions.min() < offset:
        raise ValueError("image positions must start at the placeholder's position")
    if image_positions.shape[-1] != len(features):
        raise ValueError(f"{image_positions.shape[-1]} image positions for {len(features)} rows")
    if prompt.between:  # the processor's text between the tiles' rows, at its dense places
        if graphs is not None and at_image:
            raise ValueError("text between tiles and further image-row inputs of the LLM graphs")
        rows, image_positions, text_start = between_tiles(prompt, embed, rows, image_positions, text_start)
    embeds = torch.cat([embed(ids(prompt.before)), rows[None].to(embed.weight.dtype), embed(ids(prompt.after))],
                       dim=1)
    if graphs is None:  # what the family's model takes beside the rows (Gemma 3: its image mask's token types)
        span = slice(offset, offset + len(rows))
        first_call = {**first_call, **vlm.rules.llm_forward_args(embeds.shape[1], span),
                      **vlm.rules.llm_embeds_args(model, prompt.before, len(rows), prompt.after)}
    text = [np.arange(offset), image_positions, text_start + np.arange(len(prompt.after))]
    if image_positions.ndim == 2:  # mRoPE: the text takes the same position on each axis
        text[0], text[2] = (np.broadcast_to(t, (len(image_positions), len(t))) for t in (text[0], text[2]))
        positions = np.concatenate(text, axis=1)
        position_ids = torch.from_numpy(positions)[:, None]  # [3, 1, L]
        step_ids = lambda p: torch.full((len(positions), 1, 1), p, dtype=torch.long)  # noqa: E731
        position = int(positions.max()) + 1
    else:
        positions = np.concatenate(text)
        position_ids = torch.from_numpy(positions)[None]
        step_ids = lambda p: torch.tensor([[p]])  # noqa: E731
        position = int(positions[-1]) + 1
    if graphs is not None:  # the bundle's graphs: same feed, numpy in and out
        extra = {}
        for name, value in at_image.items():  # the image span's rows, zero at the text rows
            full = np.zeros((*value.shape[:-2], embeds.shape[1], value.shape[-1]), dtype=np.float32)
            full[..., offset:offset + len(rows), :] = value.detach().float().numpy()
            extra[name] = full

        def graph_args(before: list[int], count: int, after: list[int]) -> dict:
            """What the family's graphs take beside the embeddings, derived from the ids (Gemma 4's per-layer
            embeddings), as the graphs' float32 feeds."""
            args = vlm.rules.llm_embeds_args(model, before, count, after)
            return {k: v.detach().float().numpy() for k, v in args.items()}

        extra.update(graph_args(prompt.before, len(rows), prompt.after))

        def forward(embeds, position_ids, cache=None, token=None):
            if cache is None:
                logits, cache = graphs.prefill(embeds.numpy(), position_ids.numpy(), extra)
            else:
                logits, cache = graphs.step(embeds.numpy(), position_ids.numpy(), cache, graph_args([token], 0, []))
            return torch.from_numpy(np.asarray(logits, dtype=np.float32)), cache
    else:
        def forward(embeds, position_ids, cache=None, token=None):
            out = (model(inputs_embeds=embeds, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **first_call)
                   if cache is None else
                   model(inputs_embeds=embeds, position_ids=position_ids, cache=cache, use_cache=True))
            return out.logits[0, -1].float(), out.cache
    logits, cache = forward(embeds, position_ids)
    first, tokens, stop = logits.clone(), [], eos_ids(model)
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in stop or step == max_new_tokens - 1:
            break
        logits, cache = forward(embed(ids([token])), step_ids(position), cache, token)
        position += 1
    text = vlm.tokenizer.decode(tokens, skip_special_tokens=True) if vlm.tokenizer is not None else None
    return Answer(tokens, first, positions.tolist(), len(features), text)


def dense_features(vlm: Vlm, pixel: np.ndarray, feature_layer: int | None = None) -> torch.Tensor:
    """The Hugging Face model's own image features for one image ([T, D]): its get_image_features (LLaVA-NeXT:
    packed with image_newline, as pack_image_features does; Qwen: the merger's output on the processor's patches)."""
    config = vlm.model.config
    kwargs = hf_image_inputs(vlm, pixel)
    # LLaVA's get_image_features takes the feature layer (Qwen's merger, SmolVLM's connector, Gemma 3's pooling:
    # none)
    if vlm.rules.vision_span is None and hasattr(config, "vision_feature_layer"):
        kwargs["vision_feature_layer"] = config.vision_feature_layer if feature_layer is None else feature_layer
        kwargs["vision_feature_select_strategy"] = config.vision_feature_select_strategy
    with torch.inference_mode():
        if vlm.source.frames > 1:  # a clip: the model's own video path
            out = vlm.model.model.get_video_features(**kwargs)
        else:
            out = vlm.model.model.get_image_features(**kwargs)
    return vlm.rules.hf_image_features(out)


def dense_place(vlm: Vlm, tokens: int) -> Callable[[int], tuple[np.ndarray, int]]:
    """Positions of a dense image of `tokens` rows, by the family's rule (consecutive; mRoPE: the whole grid)."""
    return vlm.rules.positions.place_dense(vlm.source, tokens)


def dense_image(vlm: Vlm, pixel: np.ndarray, feature_layer: int | None = None) -> ImageRows:
    """The model's own dense image (`--dense`): its features and their positions."""
    features = dense_features(vlm, pixel, feature_layer)
    return ImageRows(features, dense_place(vlm, len(features)))


def pruned_image(vlm: Vlm, features: torch.Tensor, kept: np.ndarray, kept_positions: np.ndarray | None,
                 prefix: int, extra: int) -> ImageRows:
    """A pruned image's rows (prefix, K kept, extra, as a bundle or a method reference gives them) in the order and
    at the positions the family's rule says (handoff; LLaVA-NeXT: assembled by assemble_llm_input).

    kept: the kept indices [K]; kept_positions [K, 3] (the bundle's output; None: the source's position table).
    """
    kept = np.asarray(kept, dtype=np.int64)
    rows, place = vlm.rules.positions.place_pruned(vlm.source, features, kept, kept_positions, prefix, extra)
    return ImageRows(rows, place, kept.tolist())


# ----------------------------------------------------------------------------------- bundle


@dataclasses.dataclass
class BundleTokens:
    """One image's rows from a bundle (in the order the LLM takes them), their kept indices (None: dense), the llm
    section, the runtime used and, for the families with kept_positions, their placement."""

    features: torch.Tensor
    kept: np.ndarray | None
    llm: dict
    runtime: str
    place: Callable[[int], tuple[np.ndarray, int]] | None = None


def bundle_tokens(bundle_dir: Path, manifest: Manifest, pixel: np.ndarray, vlm: Vlm | None = None,
                  feeds: dict[str, np.ndarray] | None = None) -> BundleTokens:
    """Run the bundle's tower on one preprocessed image (load_pixels) with its target's runner here.

    vlm: the bundle's model, needed for mRoPE and anyres bundles (their grid, position table, image_newline).
    """
    from vlmprune.targets import get_target

    llm = manifest.llm or handoff.llm_section(manifest)
    rule = family_of(manifest).positions
    if rule.needs_model and (vlm is None or vlm.rules.positions.kind != rule.kind):
        raise ValueError(f"a {rule.kind!r} bundle needs its own model's Vlm to place its tokens")
    static = manifest.inputs[0].shape[0]
    # A static batch: the image in every slot, slot 0 read (one image; a video bundle's batch is its clip's frames).
    if rule.repeats_batch and len(pixel) == 1 and isinstance(static, int) and static > 1:
        pixel = np.repeat(pixel, static, axis=0)
    runner, runtime = get_target(manifest.target.name).runner(Path(bundle_dir), manifest)
    outputs = runner(pixel, feeds)
    kept = outputs[handoff.KEPT][0] if handoff.KEPT in outputs else None
    features = outputs[llm["features_output"]]
    # A dense bundle over one image's tiles (InternVL --grid) gives them tile by tile: the image is all its rows.
    features = features.reshape(-1, features.shape[-1]) if kept is None and manifest.model.crops else features[0]
    features = torch.from_numpy(np.ascontiguousarray(features))
    if handoff.NUM_TOKENS in outputs:  # K varies per image: its valid rows only, the zero padding dropped
        rows = int(outputs[handoff.NUM_TOKENS][0])
        features = features[:rows]
        if kept is not None:  # prefix, kept, extra rows; kept_indices is -1 after the kept ones
            kept = kept[: rows - llm["rows"]["prefix"] - llm["rows"]["extra"]]
    if not rule.needs_model:
        return BundleTokens(features, kept, llm, runtime)
    if kept is None:  # a dense bundle: its features are the dense sequence (a row the model adds, after them)
        rows, place = vlm.rules.positions.dense_rows(vlm.source, features)
        return BundleTokens(rows, None, llm, runtime, place)
    positions = outputs[handoff.KEPT_POSITIONS][0] if handoff.KEPT_POSITIONS in outputs else None
    image = pruned_image(vlm, features, kept, positions, llm["rows"]["prefix"], llm["rows"]["extra"])
    return BundleTokens(image.rows, kept, llm, runtime, image.place)


def bundle_positions(tokens: BundleTokens, offset: int) -> tuple[np.ndarray, int]:
    if tokens.place is not None:
        return tokens.place(offset)
    rows = tokens.llm["rows"]
    if tokens.kept is None:
        return image_positions(offset, len(tokens.features), 0, None, 0)
    return image_positions(offset, tokens.llm["dense_image_tokens"], rows["prefix"], tokens.kept,
                                   rows["extra"])


def default_model(manifest: Manifest) -> str:
    """The bundle's own source, when it is a full VLM (the demo preset, or a LLaVA / LLaVA-NeXT / Qwen2-VL
    directory)."""
    from vlmprune.compiler.bundle import source_of

    model = manifest.model
    if family_of(manifest).language_model and (model.kind == "hf" or model.source == "demo"):
        return source_of(manifest)
    raise InputError(f"--model is needed: the bundle was compiled from {model.source} ({model.kind}, "
                     f"family {model.family}), which holds no language model that generate runs")


@dataclasses.dataclass
class GenerateResult:
    answer: Answer
    prompt: Prompt
    runtime: str
    path: str  # "pruned" | "dense"
    kept: list[int] | None
    fastv_warning: str | None = None  # the bundle's FastV graph expects the image elsewhere (fastv_mismatch)
    llm: str = "transformers"  # which language model answered: the bundle's graphs (and where) or transformers (why)
    fastv_kept: list[int] | None = None  # the bundle's FastV graph: the image tokens its prefill kept

    @property
    def image_start(self) -> int:
        """Prompt tokens before the image: what FastV's `--image-start` must be for this chat template."""
        return len(self.prompt.before)


def fastv_mismatch(manifest: Manifest, image_start: int) -> str | None:
    """A warning when the bundle's FastV graph was compiled for another image start than this prompt's.

    FastV's image span is compiled into the prefill graph, so a prompt that puts the image elsewhere
    would score (and drop) the wrong tokens in that graph.
    """
    fastv = (manifest.llm_graphs or {}).get("fastv")
    if not fastv or fastv["image_start"] == image_start:
        return None
    return (f"this bundle's FastV prefill graph was compiled with --image-start {fastv['image_start']}, but this "
            f"prompt puts the image at token {image_start}: recompile with --image-start {image_start}")


def bundle_llm(bundle_dir: Path, manifest: Manifest, reference: bool = False, dense: bool = False):
    """(the bundle's LLM graphs to answer with, or None; the line saying which language model answers).

    A bundle compiled --with-llm answers with its own exported graphs when its exporter can run them here
    (compiler.llm.exporter.LlmExporter.graph_runner): the user sees what they deploy. --reference, --dense
    (the model's own features, a sequence the compiled FastV span does not describe) and bundles without an
    LLM answer with the checkpoint's language model in transformers.
    """
    if not manifest.llm_graphs:
        return None, "transformers (the bundle holds no language model: compile it --with-llm to run its graphs)"
    if reference:
        return None, "transformers (--reference; the bundle's own LLM graphs were not run)"
    if dense:
        return None, "transformers (--dense feeds the model's own features; the bundle's LLM graphs were not run)"
    from vlmprune.compiler.llm.export import exporter_of

    runner, what = exporter_of(manifest).graph_runner(Path(bundle_dir), manifest)
    if runner is None:
        return None, f"transformers (the bundle's LLM graphs cannot run here: {what})"
    return runner, f"the bundle's LLM graphs ({what})"


def generate(bundle_dir: Path, model: str | None, image: Path | None, prompt: str, dense: bool = False,
             max_new_tokens: int = 32, progress=lambda _m: None, reference: bool = False,
             video: Path | None = None) -> GenerateResult:
    """The library call behind `vlmprune generate` (see the module docstring).

    reference: answer with the checkpoint's language model in transformers even where the bundle holds its own
    exported LLM (bundle_llm says which ran: GenerateResult.llm).
    """
    from vlmprune.compiler.bundle import load_manifest

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    require_prompt(prompt)  # before the bundle, the image and the model are read
    if (image is None) == (video is None):
        raise InputError(f"give {option('--image', 'image')} or {option('--video', 'video')} (a video bundle), one "
                         "of them")
    if image is not None:
        image, = require_image_files([image], option("--image", "image"))
    manifest = load_manifest(bundle_dir, verify=True)
    if (video is not None) != family_of(manifest).takes_video(manifest):
        raise InputError(f"this bundle takes {'a clip: pass --video PATH' if video is None else 'images: pass --image'}")
    spec = model or default_model(manifest)
    vlm = load_vlm(spec, bundle=manifest)
    if family_of(manifest).identifies_model and vlm.source.content_hash != manifest.model.sha256:
        raise InputError(f"{spec} is not the model this bundle was compiled from ({manifest.model.source}): "
                         "its content hash differs, and its LLM expects its own tower's features")
    hidden = vlm.model.config.text_config.hidden_size
    width = (manifest.llm or handoff.llm_section(manifest))["hidden_size"]
    if width != hidden:
        raise InputError(f"the bundle's image_features are {width} wide, but the LLM of {spec} takes {hidden}")
    if video is not None:
        pixel, notes = family_of(manifest).load_video(manifest, video)
        described = "; ".join(notes)
        progress(described)
    else:
        pixel, described = load_pixels(vlm, image, manifest.preprocess)
        progress(f"{image}: {described}")
    built = build_prompt(vlm, prompt)
    progress(f"prompt ({built.how}): {built.text!r}")
    offset = len(built.before)
    progress(f"the image starts at prompt token {offset} (FastV's --image-start for this chat template)")
    warning = fastv_mismatch(manifest, offset)
    graphs, llm = bundle_llm(bundle_dir, manifest, reference, dense)
    progress(f"language model: {llm}")
    if dense:
        rows = dense_image(vlm, pixel, manifest.model.get("feature_layer_override"))
        result = answer(vlm, built, rows.rows, *rows.place(offset), max_new_tokens)
        return GenerateResult(result, built, "transformers (the model's own image features, dense)", "dense", None,
                              warning, llm)
    # a prompt-aware bundle: the prompt's embedding rows
    tokens = bundle_tokens(bundle_dir, manifest, pixel, vlm, bundle_feed(manifest, vlm, built))
    positions, text_start = bundle_positions(tokens, offset)
    result = answer(vlm, built, tokens.features, positions, text_start, max_new_tokens, graphs)
    kept = None if tokens.kept is None else tokens.kept.tolist()
    fastv_kept = getattr(graphs, "kept", None)
    return GenerateResult(result, built, tokens.runtime, "pruned" if kept is not None else "dense bundle", kept,
                          warning, llm, None if fastv_kept is None else np.asarray(fastv_kept)[0].tolist())
