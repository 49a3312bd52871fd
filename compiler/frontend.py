"""Frontend: load a LLaVA-style vision tower (+ projector) and export it with torch.onnx (dynamo).

Sources:
- presets that work offline with seeded weights: `demo` (a small LLaVA model) and
  `clip-l-336` (LLaVA-1.5's tower and projector shapes, for benchmarks);
- a local Hugging Face directory (config.json + safetensors) of a
  LlavaForConditionalGeneration, or of a CLIP/SigLIP vision model, optionally with
  an `mm_projector.safetensors` beside it. Only the tower and projector weights are
  read (the LLM's are not), and nothing is unpickled;
- an .onnx vision tower exported elsewhere (the passes find its blocks by structure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants
from torch import nn

from vlmprune.compiler import reference
from vlmprune.compiler.errors import InputError

PRESETS = ("demo", "clip-l-336")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass
class PruneSpec:
    """The reference pruner's parameters (the same as the pass's PruneConfig)."""

    keep: int
    layer: int  # 1-based block after which to prune
    lam: float = 0.0


class Projector(nn.Module):
    """LLaVA's MLP projector (linear -> GELU -> linear); same parameter names as transformers'."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, bias: bool = True):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_hidden, bias=bias)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(d_hidden, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionPipeline(nn.Module):
    """pixel_values -> [blocks 1..F] -> feature select -> projector, with optional reference pruning.

    F is the LLaVA feature layer (blocks after it are never run). With `prune`,
    the reference pruner runs after block L on that block's own Q and K (captured
    from its projections), and forward returns (features, kept_indices).
    """

    def __init__(self, vision_model: nn.Module, projector: nn.Module | None, num_blocks: int,
                 drop_cls: bool, has_cls: bool, patch_size: int, prune: PruneSpec | None = None):
        super().__init__()
        self.vision_model = vision_model
        self.projector = projector
        self.num_blocks = num_blocks
        self.drop_cls = drop_cls
        self.has_cls = has_cls
        self.patch_size = patch_size
        self.prune = prune
        self._captured: dict[str, torch.Tensor] = {}
        self.last_scores: torch.Tensor | None = None  # the reference scores of the last pruned call

    def _capture_qk(self, attn: nn.Module) -> list:
        """Hooks that keep block L's own Q and K projections (no recompute of the big matmuls)."""
        def keep(key: str):
            def hook(_module, _inputs, output):
                self._captured[key] = output
            return hook
        return [attn.q_proj.register_forward_hook(keep("q")), attn.k_proj.register_forward_hook(keep("k"))]

    def forward(self, pixel_values: torch.Tensor):
        vm = self.vision_model
        h = vm.embeddings(pixel_values)
        pre = getattr(vm, "pre_layrnorm", None)
        if pre is not None:
            h = pre(h)
        kept = None
        for i, layer in enumerate(vm.encoder.layers[: self.num_blocks], start=1):
            pruning_here = self.prune is not None and i == self.prune.layer
            hooks = self._capture_qk(layer.self_attn) if pruning_here else []
            try:
                h = layer(h, None)
            finally:
                for handle in hooks:
                    handle.remove()
            if isinstance(h, tuple):  # older transformers return (hidden_states,)
                h = h[0]
            if pruning_here:
                h, kept = self._prune(layer.self_attn, h, pixel_values)
        if self.drop_cls and self.has_cls:
            h = h[:, 1:]
        if self.projector is not None:
            h = self.projector(h)
        return h if self.prune is None else (h, kept)

    def _prune(self, attn: nn.Module, h: torch.Tensor, pixel_values: torch.Tensor):
        b, t, _ = h.shape
        q = self._captured.pop("q").view(b, t, -1, attn.head_dim).transpose(1, 2)
        k = self._captured.pop("k").view(b, t, -1, attn.head_dim).transpose(1, 2)
        pruned, kept, self.last_scores = reference.prune_tokens(
            h, q, k, attn.scale, self.prune.keep, has_cls=self.has_cls, lam=self.prune.lam,
            pixel_values=pixel_values, patch=self.patch_size)
        return pruned, kept

    def with_prune(self, prune: PruneSpec | None) -> VisionPipeline:
        """The same weights, pruning (or not) as given."""
        return VisionPipeline(self.vision_model, self.projector, self.num_blocks, self.drop_cls,
                              self.has_cls, self.patch_size, prune)


@dataclasses.dataclass
class Source:
    """A loaded model: a torch pipeline (presets, HF dirs) or an ONNX file."""

    spec: str
    kind: str  # "preset" | "hf" | "onnx"
    content_hash: str
    image_size: int
    patch_size: int | None
    has_cls: bool | None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    pipeline: VisionPipeline | None = None
    onnx_path: Path | None = None
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def num_blocks(self) -> int | None:
        return None if self.pipeline is None else self.pipeline.num_blocks


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _sha256_state(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _inner(tower: nn.Module) -> nn.Module:
    """The transformer inside a HF vision model (transformers < 5 nests it as .vision_model)."""
    return getattr(tower, "vision_model", tower)


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _feature_blocks(feature_layer: int, n_layers: int) -> int:
    """LLaVA's vision_feature_layer indexes hidden_states (0 = embeddings) -> blocks to run."""
    blocks = feature_layer if feature_layer >= 0 else n_layers + 1 + feature_layer
    if not 1 <= blocks <= n_layers:
        raise InputError(f"vision_feature_layer {feature_layer} is out of range for {n_layers} layers")
    return blocks


def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


def _preset(name: str) -> Source:
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(0)
    if name == "demo":
        vision = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                                  image_size=336, patch_size=14, projection_dim=128)
        text = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=1024)
        config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                             vision_feature_select_strategy="default", image_token_index=1000)
        config.vision_config._attn_implementation = "sdpa"
        llava = LlavaForConditionalGeneration(config).eval()
        inner = getattr(llava, "model", llava)
        tower, projector = inner.vision_tower, inner.multi_modal_projector
        feature_layer, strategy = -2, "default"
    else:  # clip-l-336: LLaVA-1.5's tower and projector, seeded
        vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                  image_size=336, patch_size=14, hidden_act="quick_gelu")
        vision._attn_implementation = "sdpa"
        with _no_init_weights():
            tower = CLIPVisionModel(vision).eval()
            projector = Projector(1024, 4096, 4096).eval()
        _seeded_init(nn.ModuleList([tower, projector]), seed=0)
        feature_layer, strategy = -2, "default"
    cfg = tower.config
    blocks = _feature_blocks(feature_layer, cfg.num_hidden_layers)
    pipeline = VisionPipeline(_inner(tower), projector, blocks, strategy == "default", True, cfg.patch_size).eval()
    return Source(name, "preset", _sha256_state(pipeline), cfg.image_size, cfg.patch_size, True, pipeline=pipeline,
                  details={"feature_layer": feature_layer, "select_strategy": strategy,
                           "vision_layers": cfg.num_hidden_layers})


def _no_init_weights():
    """transformers' context that skips its (slow, per-module) weight init."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _seeded_init(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seconds instead of minutes for 300M parameters: N(0, std) weights, unit norms, zero biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                if isinstance(sub, nn.LayerNorm):
                    param.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    param.zero_()
                else:
                    param.normal_(0.0, std, generator=generator)


def _read_safetensors(files: list[Path], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose key starts with one of prefixes, the prefix stripped; never unpickles.

    A truncated or corrupt file is refused in one line naming it.
    """
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    for prefix in prefixes:
                        if key.startswith(prefix):
                            out[key[len(prefix):]] = f.get_tensor(key)
                            break
        except (SafetensorError, OSError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(f"{path}: not a readable safetensors file ({reason}); truncated or corrupt?") from None
    return out


def _load_state(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load weights by name; a missing weight or a shape that disagrees with config.json is one line."""
    expected = module.state_dict()
    for key, tensor in state.items():
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise InputError(f"{what}: weight {key} has shape {list(tensor.shape)} in the checkpoint but "
                             f"{list(expected[key].shape)} from config.json; the checkpoint and config disagree")
    missing, _unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing:
        raise InputError(f"{what}: {len(missing)} weights missing from the checkpoint, e.g. {missing[0]}")


def _projector_from_file(path: Path, d_in: int) -> Projector:
    if path.suffix == ".safetensors":
        state = _read_safetensors([path], ("",))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    renames = {"0.": "linear_1.", "2.": "linear_2."}
    clean = {}
    for key, tensor in state.items():
        key = key.removeprefix("model.").removeprefix("mm_projector.").removeprefix("multi_modal_projector.")
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old):]
        clean[key] = tensor
    if "linear_1.weight" not in clean or "linear_2.weight" not in clean:
        raise InputError(f"{path.name}: expected a 2-layer MLP projector (linear_1/linear_2 or 0/2 weights)")
    w1, w2 = clean["linear_1.weight"], clean["linear_2.weight"]
    if w1.shape[1] != d_in:
        raise InputError(f"{path.name}: projector expects width {w1.shape[1]}, the tower has {d_in}")
    proj = Projector(w1.shape[1], w1.shape[0], w2.shape[0], bias="linear_1.bias" in clean)
    _load_state(proj, clean, path.name)
    return proj.eval()


def _hf_dir(path: Path, feature_layer: int | None) -> Source:
    from transformers import AutoConfig, CLIPVisionModel, SiglipVisionModel

    _quiet_transformers()
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InputError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    weights = sorted(path.glob("*.safetensors"))
    weights = [w for w in weights if w.name != "mm_projector.safetensors"]
    if not weights:
        raise InputError(f"{path}: no .safetensors weights (vlmprune never unpickles .bin checkpoints)")
    model_type = raw.get("model_type", "")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise InputError(f"{config_path}: cannot be read as a transformers config ({exc})") from None
    mean, std = CLIP_MEAN, CLIP_STD
    projector = None
    if model_type == "llava":
        vcfg = config.vision_config
        if vcfg.model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise InputError(f"LLaVA vision tower type {vcfg.model_type!r} is not supported (CLIP or SigLIP)")
        fl = config.vision_feature_layer if feature_layer is None else feature_layer
        if not isinstance(fl, int):
            raise InputError(f"multi-layer vision_feature_layer {fl} is not supported; pass --feature-layer")
        strategy = config.vision_feature_select_strategy
        tower_cls = CLIPVisionModel if vcfg.model_type == "clip_vision_model" else SiglipVisionModel
        vcfg._attn_implementation = "sdpa"
        tower = tower_cls(vcfg).eval()
        state = _read_safetensors(weights, ("model.vision_tower.", "vision_tower."))
        _load_state(_inner(tower), _strip(state, "vision_model."), "vision tower")
        pstate = _read_safetensors(weights, ("model.multi_modal_projector.", "multi_modal_projector."))
        text_hidden = config.text_config.hidden_size
        projector = Projector(vcfg.hidden_size * 1, text_hidden, text_hidden, bias=config.multimodal_projector_bias)
        if getattr(config, "projector_hidden_act", "gelu") != "gelu":
            projector.act = __import__("transformers.activations", fromlist=["ACT2FN"]).ACT2FN[config.projector_hidden_act]
        _load_state(projector, pstate, "projector")
        projector.eval()
    elif model_type in ("clip_vision_model", "clip", "siglip_vision_model", "siglip"):
        tower_cls = CLIPVisionModel if model_type.startswith("clip") else SiglipVisionModel
        vcfg = config.vision_config if hasattr(config, "vision_config") else config
        vcfg._attn_implementation = "sdpa"
        tower = tower_cls(vcfg).eval()
        state = _read_safetensors(weights, ("model.vision_model.", "vision_model.", ""))
        _load_state(_inner(tower), state, "vision tower")
        fl = -1 if feature_layer is None else feature_layer
        strategy = "default"
        for name in ("mm_projector.safetensors", "mm_projector.bin"):
            if (path / name).is_file():
                projector = _projector_from_file(path / name, vcfg.hidden_size)
                break
        if model_type.startswith("siglip"):
            mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    else:
        raise InputError(f"{path}: model_type {model_type!r} is not supported (llava, clip_vision_model, siglip_vision_model)")
    pre = path / "preprocessor_config.json"
    if pre.is_file():
        prep = json.loads(pre.read_text())
        mean = tuple(prep.get("image_mean", mean))
        std = tuple(prep.get("image_std", std))
    has_cls = vcfg.model_type == "clip_vision_model"
    blocks = _feature_blocks(fl, vcfg.num_hidden_layers)
    pipeline = VisionPipeline(_inner(tower), projector, blocks, strategy == "default", has_cls,
                              vcfg.patch_size).eval()
    files = [config_path, *weights] + [p for p in (path / "mm_projector.safetensors",) if p.is_file()]
    return Source(str(path.resolve()), "hf", _sha256_files(files), vcfg.image_size, vcfg.patch_size, has_cls, mean, std,
                  pipeline=pipeline, details={"model_type": model_type, "feature_layer": fl,
                                              "select_strategy": strategy, "vision_layers": vcfg.num_hidden_layers,
                                              "projector": projector is not None})


def _onnx_file(path: Path) -> Source:
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:
        raise InputError(f"{path}: not a readable ONNX model") from None
    if not proto.graph.input:
        raise InputError(f"{path}: the ONNX graph has no inputs")
    external = _check_external_data(path, proto)
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    image_size = dims[2] if len(dims) == 4 and dims[2] > 0 else 0
    if image_size == 0:
        raise InputError(f"{path}: the first input should be pixels [B, C, H, W] with static H and W")
    return Source(str(path.resolve()), "onnx", _sha256_files([path, *external]), image_size, None, None,
                  onnx_path=path, details={"static_batch": dims[0] if dims[0] > 0 else None})


def _check_external_data(path: Path, proto) -> list[Path]:
    """The external-data files the model names, each checked to exist and to hold the bytes it points at."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    files: dict[Path, int] = {}
    for tensor in proto.graph.initializer:
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = (path.parent / info.location).resolve()
        if path.parent.resolve() not in location.parents:
            raise InputError(f"{path}: initializer {tensor.name} points outside the model's folder ({info.location})")
        end = (info.offset or 0) + (info.length or 0)
        files[location] = max(files.get(location, 0), end)
    for location, end in files.items():
        if not location.is_file():
            raise InputError(f"{path}: its external data file {location.name} is missing (expected beside the model)")
        if location.stat().st_size < end:
            raise InputError(f"{path}: external data file {location.name} is truncated "
                             f"({location.stat().st_size} bytes, the model reads up to {end})")
    return sorted(files)


def load_source(spec: str, feature_layer: int | None = None) -> Source:
    """Resolve MODEL (a preset name, a Hugging Face directory or an .onnx file)."""
    if spec in PRESETS:
        return _preset(spec)
    path = Path(spec)
    if not path.exists():
        raise InputError(f"{spec}: no such file or directory (and not a preset: {', '.join(PRESETS)})")
    if path.is_dir():
        return _hf_dir(path, feature_layer)
    if path.suffix == ".onnx":
        return _onnx_file(path)
    raise InputError(f"{spec}: expected a preset, a Hugging Face directory or an .onnx file")


def export_onnx(pipeline: VisionPipeline, image_size: int, batch: int | None, opset: int):
    """torch.onnx.export(dynamo=True) of the dense pipeline -> onnx_ir.Model.

    batch=None exports a dynamic batch dimension (traced at batch 2 so that the
    exporter cannot specialise it to 1).
    """
    example = torch.zeros(batch or 2, 3, image_size, image_size)
    dynamic = None if batch else {"pixel_values": {0: torch.export.Dim("batch", min=1, max=4096)}}
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), torch.no_grad():
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        # The exporter's own optimizer spends most of its time in pattern rewrites we do not
        # need (minutes on ViT-L); constant folding is what the passes rely on.
        program = torch.onnx.export(
            _Exported(pipeline.with_prune(None)), (example,), dynamo=True, input_names=["pixel_values"],
            output_names=["image_features"], dynamic_shapes=dynamic, opset_version=opset, verbose=False,
            optimize=False)
    model = program.model
    fold_constants(model)
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    RemoveUnusedNodesPass()(model)
    return model


class _Exported(nn.Module):
    """Names the input `pixel_values` for the exporter's dynamic_shapes."""

    def __init__(self, pipeline: VisionPipeline):
        super().__init__()
        self.pipeline = pipeline

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pipeline(pixel_values)
