"""The bundle's names, in one place: graph inputs and outputs, file names, IR metadata keys, node roles.

Every layer may import this module (it imports nothing of vlmprune, like compiler.errors):
the frontend names its export's outputs with it, the passes mark the IR with its keys, the
targets write its file names and the readers (parity, the CLI, the LLM side) look for the
same. Two scripts run outside vlmprune's Python (targets/trt_engine.py on JetPack,
targets/rknn_worker.py in the rknn venv) spell the values they need themselves; a test
holds them equal to these.
"""

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
DEEPSTACK = "deepstack_embeds"  # LLM prefill input [L, B, S, D_llm] (Qwen3-VL): level l's rows, added after layer l

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
FRAMES_META = "vlmprune.frames"  # model.metadata_props: a video tower's frames of tokens at the features (absent: 1)
POSITIONS_META = "vlmprune.positions"  # model.metadata_props: {"layout": ..., "tokens": T}
HAS_CLS_META = "vlmprune.has_cls"  # value.meta of the features: whether they start with the [CLS] token
ROLE = "vlmprune.role"  # node.metadata_props: the node's part in the selection (one of ROLES)

# --- node roles (the values of ROLE) -------------------------------------------------------
SCORE = "score"  # computes what the selection ranks (may be quantized)
SELECT = "select"  # computes the kept indices (discrete: stays in floating point)
TOKENS = "tokens"  # builds the output tokens from the kept indices
ROLES = (SCORE, SELECT, TOKENS)
