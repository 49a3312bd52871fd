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
from typing import TYPE_CHECKING

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
