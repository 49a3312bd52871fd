"""A loaded model (Source) and the checkpoint reading every family adapter shares.

Weights come from safetensors only (nothing is unpickled); a truncated file, a tensor
whose shape disagrees with config.json, an integer tensor where the model wants floats,
or a missing weight is one line naming it.
"""

from __future__ import annotations

import contextlib

import dataclasses
import hashlib
import itertools
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.tower import VisionPipeline

# Weights below this size are not worth a full garbage collection after release_weights: a tiny checkpoint's tower
# frees kilobytes, a real one hundreds of megabytes.
COLLECT_FROM_BYTES = 64 << 20

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass
class Source:
    """A loaded model: a torch pipeline (presets, HF directories) or an ONNX file, and what its adapter says of it.

    family: the adapter that loaded it; has_cls: a [CLS] token precedes the patch tokens
    in the tower (None: not known until the graph is read); positions: what an LLM needs
    to place the kept tokens ("indices": the patch index of each kept token).
    """

    spec: str
    kind: str  # "preset" | "hf" | "onnx"
    family: str
    content_hash: str
    image_size: int
    patch_size: int | None
    has_cls: bool | None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    pipeline: VisionPipeline | None = None
    onnx_path: Path | None = None
    positions: str = "indices"
    details: dict = dataclasses.field(default_factory=dict)
    # Anyres models (llava_next): the crops of one image the input holds ({"grid": [rows, cols], "count": C,
    # "side": s, "resolution": [H, W]}), and how to fix another of the model's grids (--grid).
    crops: dict | None = None
    regrid: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)
    # Towers that merge patches into tokens (Qwen2-VL's 2x2 merger): patches merged along each side, and the
    # (t, h, w) of each output token in the LLM's grid ([T, 3] int64) for the `kept_positions` output.
    spatial_merge: int = 1
    position_table: object | None = dataclasses.field(default=None, repr=False)
    # A video source (--video-frames): the features are this many frames of tokens, frame by frame (1: an image).
    frames: int = 1
    # Where a frame's tokens are not its patch grid floor-divided by spatial_merge (a resize to ceil(s/2), say): them.
    tokens_per_frame: int | None = None

    def release_weights(self) -> None:
        """Free the torch weights once the reference has run. The parity stages after it run the bundle's graphs
        in ONNX Runtime sessions, which hold their own copy; the two together were a big tower's peak (6.4 GB of
        qwen2.5-vl-3b-448's compile). The module stays, on the meta device, so what it says of its shape still
        answers, and a forward after this fails loudly instead of computing.

        The weights go with their last reference; the full garbage collection after it only finds what a cycle
        still holds, and costs a fraction of a second in a process holding many objects (a notebook, a sweep, the
        test suite) whatever the tower's size, so it runs only where what was freed is worth it
        (COLLECT_FROM_BYTES)."""
        if self.pipeline is not None:
            import ctypes
            import gc

            held = sum(t.numel() * t.element_size() for t in itertools.chain(self.pipeline.parameters(),
                                                                             self.pipeline.buffers()))
            self.pipeline.to("meta")
            if held >= COLLECT_FROM_BYTES:
                gc.collect()
            with contextlib.suppress(OSError, AttributeError):  # glibc: hand the freed heap back to the system
                ctypes.CDLL("libc.so.6").malloc_trim(0)

    @property
    def num_blocks(self) -> int | None:
        return None if self.pipeline is None else self.pipeline.num_blocks

    @property
    def head(self):
        """The tower's attention-pooling head (tower.PoolingHead: SigLIP's), or None: what --score probe reads.

        Only pre-norm ViT towers (VisionPipeline's TowerParts) can have one; other pipelines
        (Qwen2-VL's) have none and need not pretend to.
        """
        return getattr(getattr(self.pipeline, "tower", None), "head", None)

    @property
    def num_patches(self) -> int | None:
        """The tokens pruning runs over: every frame's, for a video."""
        if self.patch_size is None:
            return None
        if self.tokens_per_frame is not None:
            return self.frames * self.tokens_per_frame
        return self.frames * (self.image_size // (self.patch_size * self.spatial_merge)) ** 2


def sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def sha256_state(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def quiet_transformers() -> None:
    """transformers' progress bars, load reports and advice are not the user's business here."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


class Tensors(dict):
    """Tensors by name, and where each was read ({name: (file name, key in the file)}), for messages that name it."""

    def __init__(self, items=(), origin: dict[str, tuple[str, str]] | None = None):
        super().__init__(items)
        self.origin = origin or {}


def read_safetensors(files: list[Path], prefixes: tuple[str, ...]) -> Tensors:
    """Tensors whose key starts with one of prefixes, the prefix stripped; never unpickles.

    A truncated or corrupt file is refused in one line naming it.
    """
    from safetensors import SafetensorError, safe_open

    out = Tensors()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    for prefix in prefixes:
                        if key.startswith(prefix):
                            out[key[len(prefix):]] = f.get_tensor(key)
                            out.origin[key[len(prefix):]] = (path.name, key)
                            break
        except (SafetensorError, OSError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(f"{path}: not a readable safetensors file ({reason}); truncated or corrupt?") from None
    return out


def check_floating(state: dict[str, torch.Tensor], key: str, what: str) -> None:
    """A weight the model computes with in floating point must be stored so; integers would be cast silently."""
    if not state[key].is_floating_point():
        where, name = getattr(state, "origin", {}).get(key, (what, key))
        raise not_floating(where, name, str(state[key].dtype).removeprefix("torch."))


def not_floating(where: str, name: str, dtype: str) -> InputError:
    return InputError(f"{where}: tensor {name} has dtype {dtype}; the model expects floating point "
                      "(a quantized checkpoint without its scales?)")


def load_state(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load weights by name; a missing weight, a shape that disagrees with config.json or an integer weight is one line."""
    expected = module.state_dict()
    for key, tensor in state.items():
        if key in expected and expected[key].is_floating_point():
            check_floating(state, key, what)
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise InputError(f"{what}: weight {key} has shape {list(tensor.shape)} in the checkpoint but "
                             f"{list(expected[key].shape)} from config.json; the checkpoint and config disagree")
    missing, _unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing:
        raise InputError(f"{what}: {len(missing)} weights missing from the checkpoint, e.g. {missing[0]}")


def strip_prefix(state: Tensors, prefix: str) -> Tensors:
    return Tensors({k.removeprefix(prefix): v for k, v in state.items()},
                   {k.removeprefix(prefix): v for k, v in state.origin.items()})


def inner_tower(tower: nn.Module) -> nn.Module:
    """The transformer inside a HF vision model (transformers nests it as .vision_model)."""
    return getattr(tower, "vision_model", tower)


def feature_layer_of(config, feature_layer: int | None) -> int:
    """The one block whose hidden states feed the projector: --feature-layer, else config.json's
    vision_feature_layer; a list of layers (concatenated features) has no single block to prune after."""
    fl = config.vision_feature_layer if feature_layer is None else feature_layer
    if not isinstance(fl, int):
        raise InputError(f"multi-layer vision_feature_layer {fl} is not supported; pass --feature-layer")
    return fl


def feature_blocks(feature_layer: int, n_layers: int) -> int:
    """LLaVA's vision_feature_layer indexes hidden_states (0 = embeddings) -> blocks to run."""
    blocks = feature_layer if feature_layer >= 0 else n_layers + 1 + feature_layer
    if not 1 <= blocks <= n_layers:
        raise InputError(f"vision_feature_layer {feature_layer} is out of range for {n_layers} layers")
    return blocks


def no_init_weights():
    """transformers' context that skips its (slow, per-module) weight init."""
    try:
        from transformers.initialization import no_init_weights as context
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights as context
    return context()


def built(cls, config, attention: str | None = None) -> nn.Module:
    """cls(config) in eval mode with transformers' slow per-module init skipped: every family's tower and connector
    get their weights from the checkpoint or a seeded init right after. attention: the implementation the export
    traces (sdpa), set on the config first."""
    if attention is not None:
        config._attn_implementation = attention
    with no_init_weights():
        return cls(config).eval()


def seeded_init(module: nn.Module, seed: int, std: float = 0.02) -> None:
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


def from_pretrained(model_class, checkpoint, what: str, **kwargs):
    """model_class.from_pretrained over a local directory, safetensors only, failures as one line.

    For families whose checkpoints transformers renames on load (ViT and DINOv2 are saved in
    their legacy key layout), transformers' own loader is the one that knows the mapping.
    Nothing is unpickled (use_safetensors), nothing is downloaded (local_files_only). The model computes in
    float32 whatever the checkpoint stores (published VLMs are bfloat16 or float16, and transformers would keep
    config.json's dtype): the PyTorch reference every stage is held to is float32, as the exported graphs are.
    """
    from safetensors import SafetensorError

    kwargs.setdefault("dtype", torch.float32)
    try:
        model = model_class.from_pretrained(str(checkpoint.path), config=checkpoint.config, local_files_only=True,
                                            use_safetensors=True, attn_implementation="sdpa", **kwargs).eval()
        _check_stored_floating(checkpoint.weights, model)
        return model
    except SafetensorError as exc:
        raise InputError(f"{checkpoint.path}: not a readable safetensors file ({str(exc).splitlines()[0]}); "
                         "truncated or corrupt?") from None
    except (RuntimeError, ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "size mismatch" in str(exc) or "ignore_mismatched_sizes" in str(exc):
            first = "a weight's shape in the checkpoint differs from config.json: the checkpoint and config disagree"
        raise InputError(f"{what} in {checkpoint.path}: {first}") from None


def _check_stored_floating(files: list[Path], model: nn.Module) -> None:
    """transformers casts an integer tensor into a floating parameter without a word: refuse it, by the header.

    transformers renames legacy keys on load, so a stored key is matched to the model by its
    last part only, and only to let the model's own integer buffers (position_ids) through.
    """
    from safetensors import safe_open

    integer = {name.rsplit(".", 1)[-1] for name, b in model.named_buffers() if not b.is_floating_point()}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if not dtype.startswith(("F", "BF")) and key.rsplit(".", 1)[-1] not in integer:
                    raise not_floating(path.name, key, _SAFETENSORS_DTYPES.get(dtype, dtype.lower()))


_SAFETENSORS_DTYPES = {"BOOL": "bool", "I8": "int8", "U8": "uint8", "I16": "int16", "U16": "uint16", "I32": "int32",
                       "U32": "uint32", "I64": "int64", "U64": "uint64"}
