"""The family interface: what a model family declares and answers, beside Method and Target.

The pipeline asks a loaded source's family, never tests the family itself: which options it
takes (like Method.options), how they fix the source at load, whether a target can run its
input, the dense model (export or load), the parity images, the token layout pruning runs
over, its bundle README section, and, from a finished bundle's manifest, how `vlmprune run`
feeds and draws it. The LLM side reads `positions` (the kind of `llm.positions` its
bundles hand over: "indices" the patch index of each kept token, "thw" Qwen2-VL's (t, h, w),
"cyx" LLaVA-NeXT's (crop, row, col)), `language_model` (the transformers class of its full
VLM per model_type, whose language model `generate` runs; empty for a bare tower),
`vision_span` and the llm_*/hf_* hooks below.

A family says what it has (`has`: capabilities, below), a method what it needs; the CLI
joins the two for `vlmprune methods`. Adding a family is one module (its adapter and its
family object), its tests, and one line in frontend/__init__.py's FAMILIES, for `compile`,
`check` and `run`; generate and eval ask it too (its prompt: `chat` and image_prompt; its
language model: language_model, vision_span and the llm_*/hf_* hooks), and their
`--image-size` and `--grid` flags pass the family options of those names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import numpy as np

# The capabilities families and methods share live in the contract (methods import them from there): re-exported.
from vlmprune.compiler.contract import (CLS_TOKEN, CROPS, FEATURE_LAYER, FRAME_TOWER, FRAMES_META,  # noqa: F401
                                         MERGED_TOKENS, PATCH_TOKENS, POOLING_HEAD, VIDEO, Capability, Manifest)
from vlmprune.compiler.contract import QuantizationNeeds
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.export import export_onnx
from vlmprune.compiler.frontend.images import UPSCALE_WARNING, load_image_file, parity_inputs
from vlmprune.compiler.frontend.source import Source
from vlmprune.compiler.frontend.tower import BLOCK


def image_positions(offset: int, dense_tokens: int, prefix: int, kept: np.ndarray | None, extra: int,
                    ) -> tuple[np.ndarray, int]:
    """(position of every image row, the text position after the image) under the original-positions rule.

    kept: the kept patch indices of one image ([K]), or None for a dense image (N = dense - prefix rows).
    """
    patches = np.arange(dense_tokens - prefix) if kept is None else np.asarray(kept, dtype=np.int64)
    rows = [offset + np.arange(prefix), offset + prefix + patches, offset + dense_tokens + np.arange(extra)]
    return np.concatenate(rows).astype(np.int64), offset + dense_tokens + extra


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """The text a family's processor writes around one image's rows, in place of the image mark its chat template
    writes, where the image tokens alone are not what the LLM reads (Gemma 3: its boi token becomes "\\n\\n<boi>" +
    the image tokens + "<eoi>\\n\\n"; SmolVLM: <image> becomes <fake_token_around_image><global-img> + the image
    tokens + <fake_token_around_image>). generate's build_prompt reproduces it around the kept rows."""

    before: str  # what the processor puts in place of the mark before the image rows
    after: str  # ... and after them
    mark: str | None = None  # what its chat template writes for an image (None: the image token, as its tokenizer
    # names it)
    convention: str | None = None  # the chat convention where the checkpoint has no template ({mark} and
    # {prompt}; None: LLaVA-1.5's)
    specials: tuple[tuple[str, str], ...] = ()  # (marker text, config key of its id), for prompts as UTF-8 bytes
    # What the processor writes between two tiles' rows where one image is several tiles (Family.source_image_prompt:
    # SmolVLM's row / column markers), one entry per tile but the last; () where the rows run end to end.
    between: tuple[str, ...] = ()
    # The rows of each tile where they differ (MiniCPM-V's source image and its slices); (): the source's num_patches
    # each, as equal tiles have.
    tile_rows: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """How a family's checkpoints write one image and a prompt, where the checkpoint's chat template does not say it
    all: generate's build_prompt reads it (Family.chat), so that it names no family. Formats take {mark} (the image
    placeholder as the prompt holds it) and {prompt}."""

    mark: str  # the image placeholder its processor writes (a tokenizer's own name for the image token wins)
    content: str  # the user turn given as text to a chat template that takes text only
    convention: str  # the whole prompt of a checkpoint with no chat template
    how: str  # what generate says it used
    # The markers around the image (with vision_span's config keys: their token ids), kept as their own ids in a
    # prompt given as UTF-8 bytes; () where there are none.
    span: tuple[str, ...] = ()
    # A clip (a video source) is written as its processor writes a video: the template's {"type": "video"} content,
    # the config's video_token_id its placeholder; False: as an image (the image token), the frames its rows.
    video: bool = False


# LLaVA-1.5's: every family's unless it declares its own (Family.chat).
USER_ASSISTANT = ChatPrompt("<image>", "{mark}\n{prompt}", "USER: {mark}\n{prompt} ASSISTANT:",
                            "LLaVA-1.5's USER/ASSISTANT convention")


Place = Callable[[int], tuple[np.ndarray, int]]  # the placeholder's offset -> (row positions, text start)


class IndicesPositions:
    """The positions rule of a family's bundles (the manifest's llm.positions), and how `vlmprune generate` places
    their rows. This default (LLaVA-1.5, every tower): 1-D original positions from kept_indices (image_positions).

    Why an object: handoff and generate ask it, so neither names a family or a kind; a family with positions of
    its own (mRoPE, crops) declares a subclass in its module.
    """

    kind: ClassVar[str] = "indices"
    meaning: ClassVar[str] = ("kept_indices[b, j] is the patch index (raster order, 0..N-1) of row prefix + j of "
                              "image_features")
    rule: ClassVar[str] = ("prefix row r at offset + r; kept row j at offset + prefix + kept_indices[j]; extra row e "
                           "at offset + dense_image_tokens + e; text after the image from offset + dense_image_tokens "
                           "+ extra")
    needs_model: ClassVar[bool] = False  # placing needs the bundle's own model (its grid, table): generate's Vlm
    repeats_batch: ClassVar[bool] = True  # a static batch takes the image in every slot

    def dense_image_tokens(self, model: dict, dense: int | None) -> int | None:
        """What the processor expands the placeholder to without pruning (dense: prefix + N, None: unknown)."""
        return dense

    def text_resumes_at(self, model: dict, dense: int | None, extra: int) -> int | None:
        """The text position after the image, relative to the placeholder's (dense: dense_image_tokens)."""
        return None if dense is None else dense + extra

    def readme_places(self, rows: dict, dense, after) -> str:
        """The bundle README's lines placing the rows of a pruned bundle."""
        return (f"- prefix row r: offset + r\n- kept row j: offset + {rows['prefix']} + kept_indices[j]\n"
                f"- merged row e: offset + {dense} + e\n- the text after the image: from offset + {after}")

    def dense_rows(self, source: Source, features) -> tuple[object, Place]:
        """A dense bundle's rows (`features` [T, D], as its graph gives them) in the order the LLM takes them, and
        their positions: the rows themselves, consecutive (place_dense)."""
        return features, self.place_dense(source, len(features))

    def place_dense(self, source: Source, tokens: int) -> Place:
        """Positions of a dense image of `tokens` rows: consecutive."""
        return lambda offset: image_positions(offset, tokens, 0, None, 0)

    def place_pruned(self, source: Source, features, kept: np.ndarray, kept_positions: np.ndarray | None,
                     prefix: int, extra: int) -> tuple[object, Place]:
        """A pruned image's rows (prefix, K kept, extra) in the order the LLM takes them, and their positions.

        kept: the kept indices [K]; kept_positions [K, P] (a bundle's output; None: the source's position table).
        """
        dense = prefix + source.num_patches
        return features, lambda offset: image_positions(offset, dense, prefix, kept, extra)

    @staticmethod
    def kept_table(source: Source, kept: np.ndarray, kept_positions: np.ndarray | None, prefix: int) -> np.ndarray:
        """The kept rows' positions [K, P] for a family whose features have no prefix rows."""
        if prefix:
            raise ValueError(f"{source.family} features have no prefix rows")
        table = np.asarray(source.position_table)[kept] if kept_positions is None else kept_positions
        return np.asarray(table, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class DenseRequest:
    """What the dense-model hook is given: the compile's batch, opset and --cls, a progress step, and the
    passes that give an .onnx tower the bundle's output contract (built above the frontend: passes.outputs)."""

    batch: int | None
    opset: int
    cls: str | None
    step: Callable[[str], None]
    onnx_contract: Callable[..., object] | None = None


def _families() -> list[type]:
    """Every family class loaded (the registry imports them all): read by walking Family's subclasses, since the
    registry package imports this module and this module must not import it back."""
    found, todo = [], list(Family.__subclasses__())
    while todo:
        cls = todo.pop(0)
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if "id" in vars(cls)]


class Family:
    """One model family. The defaults are a torch tower's; a family overrides what differs."""

    id: ClassVar[str]
    adapter: ClassVar[type | None] = None  # the ModelAdapter that loads its Hugging Face directories
    options: ClassVar[dict[str, tuple[type, str]]] = {}  # family options (--grid, ...) -> (type, help)
    has: ClassVar[dict[Capability, str]] = {}  # capability -> how `vlmprune methods` names its models with it
    positions: ClassVar[IndicesPositions] = IndicesPositions()  # the LLM positions rule of its bundles
    language_model: ClassVar[dict[str, str]] = {}  # model_type -> transformers class of the full VLM
    # model_types of its checkpoints whose language model an exporter takes from the whole VLM checkpoint, skipping the
    # tower itself (TensorRT Edge-LLM's exporter knows Qwen2.5-VL so: --skip-visual), not as the causal LM vlmprune
    # extracts (compiler.llm.lm_source); the exporter reads them here, so a new family declares its own.
    whole_vlm_llm: ClassVar[tuple[str, ...]] = ()
    vision_span: ClassVar[tuple[str, str] | None] = None  # config keys of the ids around its image (Qwen's)
    chat: ClassVar[ChatPrompt] = USER_ASSISTANT  # how generate writes an image and a prompt (ChatPrompt)
    torch_reference: ClassVar[bool] = True  # parity's reference is its torch pipeline (False: the graph itself)
    # Its bundles name the checkpoint they came from (content hash, family), so generate and eval can hold a
    # checkpoint to it; False: a graph exported elsewhere (.onnx), which any checkpoint with that tower may run.
    identifies_model: ClassVar[bool] = True
    # What its graph needs of a quantizing target beyond the target's default recipe, by measurement (none by default)
    quantization: ClassVar[QuantizationNeeds] = QuantizationNeeds()

    def positions_of(self, model: dict) -> IndicesPositions:
        """The positions rule of one bundle (its manifest's model section): the family's, unless its bundles differ
        by input (LLaVA-NeXT-Video's clips beside LLaVA-NeXT's anyres crops)."""
        return self.positions

    def check_options(self, given: dict) -> None:
        """Check the values of this family's own options, before any work (one line for a bad one)."""

    def refuse_elsewhere(self, name: str, source: Source) -> str:
        """The line for this family's option `name` given with a source of another family."""
        what = source.details.get("model_type", source.family)
        return f"--{name.replace('_', '-')} applies to {self.id} models, not to this {what} model"

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        """Fix the loaded source for this compile: --cls (the select strategy) and the family's options."""
        if cls is not None:
            source.pipeline.drop_cls = cls == "drop"
            source.details["select_strategy"] = f"{source.details.get('select_strategy')} (--cls {cls})"

    def why_not_fastv(self, source: Source) -> str | None:
        """Why FastV (--fastv-layer) cannot be compiled for this source, or None. FastV's graph prunes one run of
        image rows from --image-start on, so a prompt that writes text among an image's rows cannot take it."""
        return None

    crop_noun: ClassVar[str] = "crops"  # what check_crops_batch calls one image's crops

    def check_target(self, source: Source, target: str, check_batch: Callable[[int], None]) -> None:
        """Refuse, before the export, a target that cannot run this source's input (check_batch: the target's
        check of a static batch). Every batch a compile may choose is the target's own to check, by default."""

    def check_crops_batch(self, source: Source, target: str, check_batch: Callable[[int], None], what: str) -> None:
        """For families whose crops (or tiles) of one image are the graph's batch: the target's refusal of that batch,
        said as what the input is (what: "an anyres model", "--grid tiles"...)."""
        count = source.crops["count"]
        try:
            check_batch(count)
        except InputError as exc:
            why = str(exc).split(": ")[0]
            raise InputError(f"target {target} cannot run {what}: {'its' if what.startswith('an ') else 'the'} input "
                             f"is the {count} {self.crop_noun} of one image as a batch of {count}, and {why}") from None

    def token_layout(self, source: Source, options: dict) -> dict | None:
        """The layout pruning runs over when it is not one image's patch tokens (passes.methods.crops), or None."""
        return None

    def crops_layout(self, source: Source, options: dict) -> dict:
        """token_layout for a family whose crops (or tiles) of one image are the graph's batch: the crops, the
        --crop-budget split, and how the compiled method's line names them (crop_noun, crops_order)."""
        return {"crops": source.crops, "budget": options.get("crop_budget"), "noun": self.crop_noun,
                "order": self.crops_order(source.crops)}

    def crops_order(self, crops: dict) -> str:
        """How one image's crops lie in the batch, in the method's line and record: the family's own words, since
        the whole image comes first in one family's crops and last in another's tiles."""
        rows, cols = crops["grid"]
        return f"{rows}x{cols} grid"

    def check_method(self, source: Source, config, site_spec: type) -> None:
        """Catch what the insertion would reject before the export (site_spec: the methods' SiteSpec)."""
        method, params = config.method, config.params
        if getattr(method, "later_blocks", False) and FRAME_TOWER not in self.has:
            holders = ", ".join(sorted({f.has[FRAME_TOWER] for f in _families() if FRAME_TOWER in f.has}))
            raise InputError(f"method {method.name} acts inside a video tower that runs each frame alone ({holders}), "
                             f"and this {source.details.get('model_type', source.family)} tower does not")
        blocks = source.num_blocks
        if config.layer is not None and not 1 <= config.layer <= blocks:
            raise InputError(f"--layer {config.layer} is out of range: this tower runs {blocks} blocks "
                             f"(1..{blocks})")
        method.check(params, self.site(source, config, site_spec))

    def fit_params(self, source: Source, config, site_spec: type):
        """The config with the method's parameters as it runs them at this source's site (Method.at_site: an option
        relative to the site, such as evs's --video-pruning-rate, becomes K)."""
        return dataclasses.replace(config, params=config.method.at_site(config.params,
                                                                         self.site(source, config, site_spec)))

    def site(self, source: Source, config, site_spec: type):
        """The site the method will meet in this source's graph, as the insertion will see it (a SiteSpec)."""
        pipe = source.pipeline
        site = config.method.needs(config.params).site
        prefix = pipe.prefix if site == BLOCK or not pipe.drop_cls else 0
        return site_spec(source.num_patches, bool(source.has_cls and prefix), config.layer or source.num_blocks,
                         source.num_blocks, prefix=prefix, head=config.head is not None, merge=source.spatial_merge,
                         tower_cls=bool(source.has_cls), frames=source.frames)

    def dense_model(self, source: Source, request: DenseRequest):
        """The dense tower as an onnx_ir model: the torch pipeline's export (at the batch the input needs)."""
        batch = self.export_batch(source, request.batch)
        request.step(f"export (torch.onnx dynamo, opset {request.opset}, batch {batch or 'dynamic'})")
        model = export_onnx(source.pipeline, source.image_size, batch, request.opset)
        if source.frames > 1:  # the insertion reads how the features divide into frames (video methods)
            model.metadata_props[FRAMES_META] = str(source.frames)
        return model

    def export_batch(self, source: Source, batch: int | None) -> int | None:
        return batch

    def parity_pixels(self, source: Source, images: int) -> tuple[np.ndarray, dict]:
        """The parity photos, preprocessed as the model's processor does."""
        return parity_inputs(images, source.image_size, source.mean, source.std)

    def readme_section(self, manifest: Manifest) -> str:
        """This family's section of the bundle README ("" when it has none)."""
        return ""

    def llm_handoff(self, model: dict) -> dict:
        """What the manifest's llm section says beyond the rows and positions, from the manifest's model section
        (keys it overrides or adds: Qwen3-VL's DeepStack planes and the LLM's width); {} for most families."""
        return {}

    # ------------------------------------------------------------------ its language model (generate, eval)

    def llm_source(self, checkpoint, options: dict) -> Source:
        """The vision Source of a full VLM checkpoint of this family, at the given options (--image-size, --grid)."""
        return self.adapter().load(checkpoint, None)

    def other_input(self, model: dict, source: Source) -> str | None:
        """How a bundle (its manifest's model) takes other pixels than this source (another option value), or None:
        the compile-time options a family declares (--image-size, --grid) must be the ones the source runs."""
        if "image_size" in self.options and model["image_size"] != source.image_size:
            return (f"compiled at --image-size {model['image_size']}, eval runs at {source.image_size} "
                    f"(pass --image-size {model['image_size']})")
        if "grid" in self.options and model.get("grid") != source.details.get("grid"):
            return (f"compiled for --grid {model.get('grid')}, eval runs {source.details.get('grid')} "
                    f"(pass --grid {model.get('grid')})")
        return None

    def llm_pixels(self, source: Source, image: str, preprocess: dict | None) -> tuple[np.ndarray, str]:
        """An image file preprocessed for the LLM side's tower ([1, 3, S, S]) and its preprocessing line.

        preprocess: a bundle manifest's size, mean and std, else the source's.
        """
        pre = preprocess or {"size": source.image_size, "mean": source.mean, "std": source.std}
        pixel, described, _scale = load_image_file(image, pre["size"], pre["mean"], pre["std"])
        return pixel, described

    def hf_image_inputs(self, config, source: Source, pixel: np.ndarray) -> dict:
        """The transformers model's own forward's image arguments for one preprocessed image."""
        import torch

        return {"pixel_values": torch.from_numpy(pixel)}

    def image_prompt(self, tokenizer) -> ImagePrompt | None:
        """The text its processor writes around one image's rows (`tokenizer`: the checkpoint's, or None, where the
        processor reads its markers from it); None where the image tokens alone are the image (most families)."""
        return None

    def source_image_prompt(self, tokenizer, source: Source) -> ImagePrompt | None:
        """image_prompt for this source's input: where one image is several tiles, the text its processor writes
        between them too (ImagePrompt.between); image_prompt's by default."""
        return self.image_prompt(tokenizer)

    def hf_image_features(self, out):
        """One image's rows, as this family's bundles give them, from the transformers model's get_image_features
        output (its pooler_output where it has one)."""
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        return features[0]

    def llm_image_rows(self, model, features) -> tuple[object, dict]:
        """(the rows that go into the LLM's inputs_embeds for an image's rows `features` [T, D], the extra arguments
        of the model's first forward): the features themselves and nothing, unless the family's LLM takes more of
        each image row than one embedding (Qwen3-VL's DeepStack planes)."""
        return features, {}

    def llm_forward_args(self, length: int, image: slice) -> dict:
        """The further arguments of the transformers model's first forward over a prompt of `length` rows whose image
        rows are `image` (generate's splice and the model's own forward alike): {} for most families (Gemma 3: the
        token types of its bidirectional image mask)."""
        return {}

    def llm_embeds_args(self, model, before: list[int], rows: int, after: list[int]) -> dict:
        """The further arguments of generate's first forward over inputs_embeds (the prompt's ids before and after
        `rows` spliced image rows) that the model derives from input_ids on its own forward: {} for most families
        (Gemma 4: its per-layer embeddings, which transformers cannot recover from spliced rows)."""
        return {}

    def llm_graph_image_rows(self, model, features) -> tuple[object, dict]:
        """(the rows of an exported LLM graph's inputs_embeds for an image's rows `features` [T, D], the graph's
        further prefill inputs given at those rows, each [..., T, hidden]: generate puts them at the image span
        and zeros at the text rows): the features themselves and nothing, unless the family's LLM graph takes more
        of each image row than one embedding (Qwen3-VL's deepstack_embeds)."""
        return features, {}

    # ------------------------------------------------------------------ finished bundles

    def cannot_draw(self, manifest: Manifest) -> str | None:
        """What of this bundle `--show` and `compare` cannot draw (one patch grid per image), or None."""
        return None

    def takes_video(self, manifest: Manifest) -> bool:
        """Whether the bundle's input is one clip's frames (compile --video-frames)."""
        return False

    def load_video(self, manifest: Manifest, path) -> tuple[np.ndarray, list[str]]:
        """The bundle's input for a clip (a folder of frames or a video file), sampled to its frames."""
        raise InputError("--video takes a video bundle (compile --video-frames F); this bundle takes images (--image)")

    def load_images(self, manifest: Manifest, image_files, static) -> tuple[np.ndarray, list[str]]:
        """The bundle's input for these images, preprocessed as its model does, and the lines saying how
        (with a warning for heavy upscaling). static: the bundle's static batch, checked against the images."""
        if isinstance(static, int) and static != len(image_files):
            raise InputError(f"this bundle has a static batch of {static}: pass --image {static} times "
                             f"(got {len(image_files)}), or recompile with --batch {len(image_files)}")
        pre, batch, notes = manifest.preprocess, [], []
        for image in image_files:
            try:
                pixel, described, scale = load_image_file(image, pre.size, pre.mean, pre.std)
            except Exception as exc:
                raise InputError(f"{image}: cannot read the image ({exc})") from None
            notes.append(f"{image}: {described}")
            if scale > UPSCALE_WARNING:
                notes.append(f"warning: {image} is upscaled x{scale:.3g}: the model sees mostly interpolated pixels, "
                             "and the kept patches say little about the picture")
            batch.append(pixel)
        return np.concatenate(batch), notes
