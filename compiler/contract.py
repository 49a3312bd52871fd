"""The bundle's names, in one place: graph inputs and outputs, file names, IR metadata keys, node roles,
pruning sites, and the prune record (the one type the insertion hands every later reader); and the vocabulary
the frontend and the methods share: what a family has (capabilities), what a pruner gets at its site
(SiteTensors), how --crop-budget splits K.

Every layer may import this module (it imports nothing of vlmprune, like compiler.errors):
the frontend names its export's outputs with it, the passes mark the IR with its keys, the
targets write its file names and the readers (parity, the CLI, the LLM side) look for the
same. Two scripts run outside vlmprune's Python (targets/trt_engine.py on JetPack,
targets/rknn_worker.py in the rknn venv) spell the values they need themselves; a test
holds them equal to these.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# --- graph inputs and outputs -------------------------------------------------------------
PIXELS = "pixel_values"  # the tower's image input [B, 3, S, S]
FEATURES = "image_features"  # the tokens the LLM takes [B, T or K, D]
KEPT = "kept_indices"  # [B, K] int64: which patch tokens the pruning kept, in order
NUM_TOKENS = "num_tokens"  # [B] int64: valid leading rows of image_features where K varies per image (zeros after)
KEPT_POSITIONS = "kept_positions"  # [B, K, P] int64: the kept tokens' LLM positions, where an index is not enough
TEXT = "text_embeds"  # [B, T, D_llm] float: the prompt's rows of the LLM's embedding table (prompt-aware methods)
ROI_MASK = "roi_mask"  # [B, H, W] float: --roi mask, the forced-keep region at the pixel input's resolution
ROI_BOXES = "roi_boxes"  # [B, M, 4] float: --roi boxes, (x0, y0, x1, y1) in pixels of the tower's input
ROI_COUNT = "roi_count"  # [B] int64: --roi boxes, the valid leading boxes of roi_boxes
ROI_INPUTS = (ROI_MASK, ROI_BOXES, ROI_COUNT)  # an --roi graph's inputs: the mask, or the boxes and their count
DEEPSTACK = "deepstack_embeds"  # LLM prefill input [L, B, S, D_llm] (Qwen3-VL): level l's rows, added after layer l
IMAGE_ROWS = "image_rows"  # LLM prefill input [B, S, 1] float (Gemma 3): 1 at an image's rows (seen both ways), else 0
# LLM prefill and decode input [B, S, layers, width] float (Gemma 4's PLE): the tokens' own per-layer embeddings, as
# transformers' get_per_layer_inputs gives them from the ids (an image row: the pad token's)
PER_LAYER_INPUTS = "per_layer_inputs"

# --- files of a bundle ---------------------------------------------------------------------
MODEL = "model.onnx"  # the target's graph (what a runtime loads)
DECOMPOSED = "model.decomposed.onnx"  # the pruned graph in standard ONNX ops, before any fusion
WEIGHTS = "weights.bin"  # external data shared by every graph in the bundle
DENSE = ".dense.onnx"  # the unpruned export, kept only while parity runs (never published)
MANIFEST = "manifest.json"  # what was compiled, how, every file's sha256 (compiler.bundle.manifest)
PARITY = "parity.json"  # the parity report, per stage and output
README = "README.md"  # how to run the bundle, written by the target, the handoff, the family and the LLM side
LLM_DIR = "llm"  # the folder of the language model's graphs, whatever the exporter
LLM_MODEL = "model.onnx"  # the language model's graph in llm/ (onnxruntime-genai and Edge-LLM load that name)
QDQ_MODEL = "model.qdq.onnx"  # a quantized (QDQ) graph, for targets that build from one
QDQ_WEIGHTS = "weights.qdq.bin"  # the QDQ graph's external data
QNN_CONTEXT = "model_ctx.onnx"  # QNN: the EP context model wrapping the compiled context binary
ENGINE = "model.engine"  # TensorRT: the engine built on the device (trt_engine.py)
RKNN = "model.rknn"  # rk3588: the RKNN model (rknn_worker.py)
OPENVINO_IR = "model.xml"  # openvino: the fp32 IR (its weights in model.bin beside it)
OPENVINO_INT8_IR = "model.int8.xml"  # openvino --precision int8: the NNCF-quantized IR (+ model.int8.bin)

# --- IR metadata keys ----------------------------------------------------------------------
PRUNE_META = "vlmprune.prune"  # model.metadata_props: what InsertPruningPass inserted (JSON)
TOKENS_META = "vlmprune.tokens"  # value.metadata_props of the new tokens: "tokens before,tokens after"
FUSED_META = "vlmprune.fused"  # model.metadata_props: what the fusion pass replaced (JSON)
# A value a method hands the blocks after its site in a layout of its own, whose batch differs from the site's:
# "old,new" (the in-encoder temporal drop: a clip's F frames flattened into one sequence, "F,1"); RetargetTokenCountPass
# rewrites the leading batch of the shape constants it retargets downstream of it.
BATCH_META = "vlmprune.batch"
# The value where such a method gives the tower's tail the dense layout back ("tokens,dense tokens"): the token
# counts retargeted downstream of its site stop there (the tail runs on the dense layout again).
RESTORED_META = "vlmprune.restored"
FRAMES_META = "vlmprune.frames"  # model.metadata_props: a video tower's frames of tokens at the features (absent: 1)
POSITIONS_META = "vlmprune.positions"  # model.metadata_props: {"layout": ..., "tokens": T}
HAS_CLS_META = "vlmprune.has_cls"  # value.meta of the features: whether they start with the [CLS] token
ROLE = "vlmprune.role"  # node.metadata_props: the node's part in the selection (one of ROLES)

# --- node roles (the values of ROLE) -------------------------------------------------------
SCORE = "score"  # computes what the selection ranks (may be quantized)
SELECT = "select"  # computes the kept indices (discrete: stays in floating point)
TOKENS = "tokens"  # builds the output tokens from the kept indices
ROLES = (SCORE, SELECT, TOKENS)

# --- defaults ------------------------------------------------------------------------------
DEFAULT_KEEP = 192  # compile's K (--keep)
DEFAULT_OPSET = 18  # the ONNX opset of the exports, the tower's and the language model's (--opset)
PROBE_KEEP = 64  # the K a method is parsed with where only its declarations are asked (needs, fused ops)
DENSE_METHOD = "none"  # the manifest's method name of a dense bundle (--no-prune; passes.methods.dense.Dense)

# --- numeric floors the methods share (their references and their graphs alike) ---------------
NORM_EPS = 1e-12  # a row's L2 norm floor (torch.nn.functional.normalize's eps)
SCORE_EPS = 1e-6  # a score maximum's floor: S / max(S) stays finite on an all-zero image
COSINE_EPS = 1e-8  # a cosine's denominator floor (torch.nn.functional.cosine_similarity's eps)

# --- pruning sites (where a method acts) ----------------------------------------------------
SITE_BLOCK = "block"  # block L's output, the residual stream [B, (1)+N, D]
SITE_FEATURES = "features"  # the graph's token output (after the projector)

# --- --crop-budget: how K is split over an anyres model's crops (passes.methods.crops; LLaVA-NeXT takes it) ------
CROP_PROPORTIONAL = "proportional"  # by each crop's score mass
CROP_EQUAL = "equal"  # K / crops each
CROP_BUDGETS = (CROP_PROPORTIONAL, CROP_EQUAL)


# --- capabilities: what a family's models have, what a method needs ------------------------------
@dataclasses.dataclass(frozen=True)
class Capability:
    """Something a family's models have that a method may need; `phrase` names the models that have it."""

    name: str
    phrase: str  # formatted with the families' own names for them


# The vocabulary families (compiler.frontend: `has`) and methods (passes.methods: `needs`) share.
PATCH_TOKENS = Capability("tokens", "every family (no [CLS] needed: {})")  # what every method needs
CLS_TOKEN = Capability("cls", "towers with a [CLS] token ({})")
POOLING_HEAD = Capability("head", "{}")  # an attention-pooling head (SigLIP's): --score probe
MERGED_TOKENS = Capability("merged", "{} merged tokens")  # features that merge patches (Qwen2-VL's 2x2)
VIDEO = Capability("video", "{} video (compile --video-frames F)")  # several frames' tokens, frame by frame
# A video tower that runs each frame alone, as a still image (the frames its batch): a method can act inside it
# per frame (evs-encoder); Qwen's temporal patches mix two frames in one token and are not this.
FRAME_TOWER = Capability("frame_tower", "{} video, its tower run frame by frame (compile --video-frames F)")
CROPS = Capability("crops", "{}'s crops")  # several crops of one image, pruned under one budget
# One grid of patches whose feature layer's tokens map one to one onto the projector output (no patch merging, no
# crops): what a method that reads both needs (cdpruner's similarity and relevance).
FEATURE_LAYER = Capability("feature_layer", "single-grid towers whose feature layer is one to one with the features "
                                            "({})")


# --- what a pruner gets at its site ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizationNeeds:
    """What a family's graph needs of a quantizing target beyond the target's default recipe, each by measurement
    (the family's docstring gives the figures); the default needs nothing. A target applies what it runs (qnn: all
    of it, on HTP).

    wide_weights: why 8-bit weights lose the family's parity ("" where they do not): its weights take 16 bits. The
    HTP runs 16-bit weights in MatMuls without a bias (Gemma 4's tower: RMSNorms, no biases); a LayerNormalization or a
    MatMul + bias (which ONNX Runtime fuses into Gemm) has no such kernel, and the QNN EP refuses the graph (measured on
    the tiny ViT of tests/targets/test_qnn.py), so only a family whose graph has neither declares it.
    float_attention: why its attention loses parity with one side of q.k^T and probs.v read in 8 bits, as a 16-bit
    target must read two activations ("" where not): the attention core (q.k^T, its Softmax, probs.v) stays float.
    headroom: each 16-bit activation range is the calibrated one times this (1: as calibrated), where images past
    the calibration set's extremes clip; 16 bits have steps to spare for it.
    """

    wide_weights: str = ""
    float_attention: str = ""
    headroom: float = 1.0


@dataclasses.dataclass
class SiteTensors:
    """What a pruner gets at its site, all torch tensors of one batch: the frontend's tower builds it
    (compiler.frontend.tower), a method's reference reads it (passes.methods).

    prefix: the leading tokens that are not patches ([CLS], then DINOv2's register tokens):
    never pruned, never counted in K, passed through in front of the kept tokens.
    """

    hidden: torch.Tensor  # [B, prefix + N, D]
    has_cls: bool
    q: torch.Tensor | None = None  # [B, H, T, dh], block L's projected queries
    k: torch.Tensor | None = None  # [B, H, T, dh]
    scale: float | None = None  # the block's attention scale
    pixel_values: torch.Tensor | None = None  # [B, C, H, W], normalised
    patch_size: int | None = None
    prefix: int | None = None  # None: 1 with a [CLS] token, else 0
    # the tower's attention-pooling head (compiler.frontend.tower.PoolingHead), where it has one (SITE_BLOCK sites)
    head: object | None = None
    layer: int | None = None  # the block after which the site is (SITE_BLOCK sites)
    # The original patch index of each patch token present, where an earlier call of the same pruner (a pruner with
    # several `layers`) has pruned some: [B, N_s] int64; None: all N patches, in order.
    patch_ids: torch.Tensor | None = None
    frames: int = 1  # a video's frames: the N patches are frames x tokens per frame, frame by frame

    def __post_init__(self):
        if self.prefix is None:
            self.prefix = int(self.has_cls)


# --- the prune record -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PruneRecord:
    """What the insertion pass (passes.prune) put into a graph: the method, its parameters and the site's counts.

    One type from the pass to every reader (the later passes, the targets' fusion, parity's
    reference, the manifest), so that a field has one spelling and a typo is an AttributeError
    rather than a KeyError three layers away. It travels in two forms, each with one
    reader and one writer here: the IR's `vlmprune.prune` metadata (to_json / from_json)
    and the manifest's method section (manifest_section / from_manifest).

    Only method, params, site and layer are required: what a reference needs to run a method.
    The counts are always set by the insertion; None (or the defaults) only in records
    read from a bundle made before the field, or built by hand for a reference.
    """

    method: str
    params: dict
    site: str
    layer: int | None  # the 1-based block of a SITE_BLOCK site (the schedule's last); None at SITE_FEATURES
    formulation: str | None = None  # the method's graph form (the target chose it)
    num_blocks: int | None = None
    tokens_in: int | None = None  # tokens at the site before the pruning, the prefix included
    tokens_out: int | None = None  # and after it
    num_patches: int | None = None  # N: the patch tokens at the site
    has_cls: bool = False
    prefix: int = 0  # tokens before the patches ([CLS], registers): never pruned
    kept: str = KEPT  # the graph output of the kept indices
    kept_count: int | None = None  # its K
    summary: str = ""  # the method's one line (passes.prune.summary)
    text: dict | None = None  # prompt-aware: the graph input added, {"name": TEXT, "dim": D}
    roi: dict | None = None  # --roi: the layout of its inputs (passes.methods.roi)
    num_tokens: str | None = None  # K varies per image: the graph output of the valid counts
    steps: tuple[dict, ...] | None = None  # --schedule: each step's layer, keep, tokens_in, tokens_out

    # The keys the IR record always holds; the others only where they apply (absent, not null).
    _ALWAYS = ("method", "params", "formulation", "site", "layer", "num_blocks", "tokens_in", "tokens_out",
               "num_patches", "has_cls", "prefix", "kept", "kept_count", "summary")
    _OPTIONAL = ("text", "roi", "num_tokens", "steps")

    def __post_init__(self):
        if self.steps is not None and not isinstance(self.steps, tuple):
            object.__setattr__(self, "steps", tuple(self.steps))

    def as_dict(self) -> dict:
        """The record as the IR's JSON holds it."""
        out = {k: getattr(self, k) for k in self._ALWAYS}
        out.update({k: getattr(self, k) for k in self._OPTIONAL if getattr(self, k) is not None})
        if self.steps is not None:
            out["steps"] = list(self.steps)
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PruneRecord:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    @property
    def where(self) -> str:
        """Where it pruned, in words: the block (or the schedule's blocks) or the projector output."""
        if self.steps is not None:
            return "progressive, after blocks " + "→".join(str(s["layer"]) for s in self.steps) + \
                f"/{self.num_blocks}"
        if self.site == SITE_BLOCK:
            return f"after block {self.layer}/{self.num_blocks}"
        return "on the projector output"

    def _summary_suffix(self) -> str:
        return f" ({self.where}, {self.num_patches} patch tokens)"

    def manifest_section(self) -> dict:
        """The manifest's method section (its key order is the file's: the manifest is not written sorted)."""
        return {"name": self.method, "params": self.params, "keep": self.params["keep"], "site": self.site,
                "layer": self.layer, "num_blocks": self.num_blocks, "formulation": self.formulation,
                "tokens_in": self.tokens_in, "tokens_out": self.tokens_out, "num_patches": self.num_patches,
                "has_cls": self.has_cls, "prefix": self.prefix, "kept_count": self.kept_count,
                "summary": self.summary + self._summary_suffix(),
                **({"roi": self.roi} if self.roi is not None else {}),
                **({"steps": list(self.steps)} if self.steps is not None else {})}

    @staticmethod
    def prefix_of(section) -> int:
        """A pruned bundle's prefix from its method section; bundles made before the field have the [CLS] token
        or nothing before the patches."""
        return section.get("prefix", int(bool(section.get("has_cls"))))

    @classmethod
    def from_manifest(cls, section, text: dict | None = None, num_tokens: str | None = None) -> PruneRecord:
        """The record back from a pruned bundle's method section. The section does not list the graph's extra
        inputs and outputs: the manifest's input and output lists give them (text, num_tokens)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"method", "kept", "text", "num_tokens", "summary",
                                                               "prefix"}
        record = cls(method=section["name"], text=text, num_tokens=num_tokens, prefix=cls.prefix_of(section),
                     **{k: section[k] for k in fields if k in section})
        summary, suffix = section.get("summary", ""), record._summary_suffix()
        return dataclasses.replace(record, summary=summary[:-len(suffix)] if summary.endswith(suffix) else summary)


# --- the manifest (manifest.json) as read-only typed views ------------------------------------
# The manifest's JSON object itself (a dict subclass), so what is written to disk and what bundles on disk hold do
# not change; the views only name the fields a reader uses (`m.target.name`, `m.method.pruned`,
# `m.inputs[0].shape`) so that no reader spells a key twice. A view is also a read-only Mapping of its section: a
# target's own fields (what its emit recorded) are read as `m.target.get("qdq_model")`. They live here, the lowest
# layer, so that every step (the targets and passes too) takes a typed Manifest; loading a bundle's manifest and
# verifying its digests is compiler.bundle.manifest's (its Manifest subclasses this one).

class Section(Mapping):
    """A read-only view of one manifest section; subclasses name its fields."""

    def __init__(self, data: Mapping):
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


class TargetSection(Section):
    """What the target recorded: its name, options, toolchain, and its emit's own fields (get them by key)."""

    name = property(lambda self: self._data["name"])
    summary = property(lambda self: self._data["summary"])
    options = property(lambda self: self._data.get("options", {}))
    toolchain = property(lambda self: self._data.get("toolchain", {}))
    fused = property(lambda self: self._data.get("fused", False))  # the selection runs as one custom op
    fused_ops = property(lambda self: self._data.get("fused_ops", []))
    precision = property(lambda self: self._data.get("precision"))


class ModelSection(Section):
    """The source model: where it was loaded from, its family, content hash and geometry, and the family's details."""

    source = property(lambda self: self._data["source"])
    kind = property(lambda self: self._data["kind"])  # "preset", "hf" or "onnx"
    family = property(lambda self: self._data.get("family"))
    sha256 = property(lambda self: self._data["sha256"])
    image_size = property(lambda self: self._data.get("image_size"))
    patch_size = property(lambda self: self._data.get("patch_size"))
    positions = property(lambda self: self._data.get("positions"))
    # The families' own fields, for the readers that need one (details has them all).
    token_counts = property(lambda self: self._data.get("token_counts") or {})  # a merging tower's grids and counts
    video_frames = property(lambda self: self.token_counts.get("video_frames"))  # compile --video-frames F
    merged_grid_thw = property(lambda self: self.token_counts.get("merged_grid_thw"))  # the merged tokens' t, h, w
    deepstack = property(lambda self: self._data.get("deepstack"))  # Qwen3-VL's DeepStack planes
    grid = property(lambda self: self._data.get("grid"))  # anyres: the crops grid ("RxC"), its crop count
    crops = property(lambda self: self._data.get("crops"))
    resolution = property(lambda self: self._data.get("resolution"))  # anyres: [height, width] of the grid

    @property
    def details(self) -> dict:
        """The family's own fields (grid, crops, token_counts, ...), everything but the common ones."""
        common = {"source", "kind", "family", "sha256", "image_size", "patch_size", "positions",
                  "feature_layer_override"}
        return {k: v for k, v in self._data.items() if k not in common}


class MethodSection(Section):
    """The method that pruned the tower, or the dense record (name DENSE_METHOD) for a dense bundle; the method object
    is passes.methods.method_of(section)."""

    name = property(lambda self: self._data["name"])
    summary = property(lambda self: self._data["summary"])
    pruned = property(lambda self: self._data["name"] != DENSE_METHOD)  # False: a dense bundle (--no-prune)
    params = property(lambda self: self._data.get("params", {}))
    keep = property(lambda self: self._data.get("keep"))
    site = property(lambda self: self._data.get("site"))
    layer = property(lambda self: self._data.get("layer"))
    num_blocks = property(lambda self: self._data.get("num_blocks"))
    formulation = property(lambda self: self._data.get("formulation"))
    tokens_in = property(lambda self: self._data.get("tokens_in"))
    tokens_out = property(lambda self: self._data.get("tokens_out"))
    num_patches = property(lambda self: self._data.get("num_patches"))
    has_cls = property(lambda self: self._data.get("has_cls"))
    kept_count = property(lambda self: self._data.get("kept_count"))
    steps = property(lambda self: self._data.get("steps", []))  # --schedule: each step's layer, keep, token counts
    # --roi: its inputs' layout (passes.methods.roi.layout: kind, height, width, patch, grid, inputs, max_boxes)
    roi = property(lambda self: self._data.get("roi"))

    @property
    def prefix(self) -> int | None:
        """Tokens before the patch tokens (PruneRecord.prefix_of: older bundles too); None for a dense bundle."""
        if not self.pruned:
            return None
        return PruneRecord.prefix_of(self._data)


class Tensor(Section):
    """One graph input or output: name, shape (ints and symbolic names), dtype."""

    name = property(lambda self: self._data["name"])
    shape = property(lambda self: self._data["shape"])
    dtype = property(lambda self: self._data["dtype"])


class PreprocessSection(Section):
    mean = property(lambda self: self._data["mean"])
    std = property(lambda self: self._data["std"])
    size = property(lambda self: self._data["size"])


class LlmSection(Section):
    """The LLM hand-off (compiler.llm.handoff.llm_section): how the image rows splice into the language model."""

    features_output = property(lambda self: self._data["features_output"])
    image_tokens = property(lambda self: self._data.get("image_tokens"))  # an int, or a symbolic name (variable K)
    dense_image_tokens = property(lambda self: self._data.get("dense_image_tokens"))
    hidden_size = property(lambda self: self._data.get("hidden_size"))
    dtype = property(lambda self: self._data.get("dtype"))
    rows = property(lambda self: self._data["rows"])  # {"prefix", "kept", "extra"}
    positions = property(lambda self: self._data["positions"])
    text_resumes_at = property(lambda self: self._data.get("text_resumes_at"))
    num_tokens = property(lambda self: self._data.get("num_tokens"))  # K varies per image: how to read the rows
    extra_rows = property(lambda self: (self._data["rows"] or {}).get("extra"))  # rows with no patch position


class KeepAutoSection(Section):
    """--keep auto (compiler.pipeline.auto_keep): the K -> latency curve K was chosen on, and where it was timed."""

    chosen = property(lambda self: self._data["chosen"])
    budget_ms = property(lambda self: self._data["budget_ms"])
    curve = property(lambda self: self._data["curve"])  # [[K, ms], ...], every K timed
    timed_on = property(lambda self: self._data["timed_on"])
    load = property(lambda self: self._data.get("load"))  # other processes' CPU share while it was timed


class ParitySection(Section):
    passed = property(lambda self: self._data["passed"])
    stages = property(lambda self: self._data.get("stages", []))


class Manifest(dict):
    """manifest.json: the dict as written, with typed views of its sections (read-only; Manifest.load in
    compiler.bundle.manifest reads and verifies a bundle's)."""

    def extended(self, **sections) -> Manifest:
        """A new manifest with these sections added after the ones it has (the file keeps that order): how the
        compile adds what it learns in turn (the hand-off, the LLM graphs, parity) without writing into a dict."""
        return type(self)({**self, **sections})

    target = property(lambda self: TargetSection(self["target"]))
    model = property(lambda self: ModelSection(self["model"]))
    method = property(lambda self: MethodSection(self["method"]))
    inputs = property(lambda self: [Tensor(t) for t in self["inputs"]])
    outputs = property(lambda self: [Tensor(t) for t in self["outputs"]])
    output_names = property(lambda self: [t["name"] for t in self["outputs"]])
    preprocess = property(lambda self: PreprocessSection(self["preprocess"]))
    compile_options = property(lambda self: self["compile_options"])
    cls_section = property(lambda self: self.get("cls", {}))  # whether image_features starts with [CLS]
    llm = property(lambda self: LlmSection(self["llm"]) if self.get("llm") is not None else None)  # the handoff
    keep_auto = property(lambda self: KeepAutoSection(self["keep_auto"]) if self.get("keep_auto") else None)
    llm_graphs = property(lambda self: self.get("llm_graphs"))  # the language model's graphs, with --with-llm
    parity = property(lambda self: ParitySection(self["parity"]) if "parity" in self else None)

    @property
    def record(self) -> PruneRecord | None:
        """The prune record the bundle was compiled from (what its decomposed graph holds), None for a dense one."""
        if not self.method.pruned:
            return None
        text = next((t for t in self.inputs if t.name == TEXT), None)
        return PruneRecord.from_manifest(
            self["method"], text=None if text is None else {"name": TEXT, "dim": text.shape[2]},
            num_tokens=NUM_TOKENS if NUM_TOKENS in self.output_names else None)
    files = property(lambda self: self.get("files", {}))  # bundle-relative path -> sha256
    version = property(lambda self: self["vlmprune_version"])
