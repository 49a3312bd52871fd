"""Shared fixtures: tiny Hugging Face models saved offline, and compiled demo bundles."""

from __future__ import annotations

import os
from pathlib import Path

# oneMKL reads MKL_CBWR at its first call, and tools/train_easyvqa.py sets it on import: set here too, before any
# test's first matmul, so that its weights-do-not-depend-on-the-thread-count test holds in a full run (where another
# module may reach MKL first), not only when its file runs alone.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import toolchain  # noqa: E402
import torch  # noqa: E402

import vlmprune.compiler  # noqa: F401


def _tiny_vision(kind: str, image_size: int = 112):
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  image_size=image_size, patch_size=14)
    return CLIPVisionConfig(**common) if kind == "clip" else SiglipVisionConfig(**common)


@pytest.fixture(scope="session")
def ort_library() -> Path:
    """The ONNX Runtime custom-op library every fused-op test runs on; without g++ or npm it skips, under CI it fails
    (tests/toolchain.py)."""
    return toolchain.ort_library()


def _shared_root(tmp_path_factory) -> Path:
    """A folder every process of this run sees: the session's own temporary root, or under pytest-xdist
    (`-n auto`, as the README runs the suite) the root its workers' temporary folders share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _session_products(tmp_path_factory):
    """One product cache (compiler.pipeline.cache) per run, shared by its workers: compiles of one export share it,
    as a user's do (the cache is safe for concurrent compiles), and the user's own cache is neither read nor grown
    (the venvs and the op library stay in VLMPRUNE_CACHE)."""
    patch = pytest.MonkeyPatch()
    products = _shared_root(tmp_path_factory) / "products"
    products.mkdir(exist_ok=True)
    patch.setenv("VLMPRUNE_PRODUCTS", str(products))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory):
    """A LlavaForConditionalGeneration checkpoint (safetensors) with a 3-block CLIP tower, 64 patches."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(1)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=128)
    config = LlavaConfig(vision_config=_tiny_vision("clip"), text_config=text, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_token_index=100)
    path = tmp_path_factory.mktemp("tiny_llava")
    LlavaForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    return path


def _save_tower(factory, name: str, seed: int):
    """A tiny vision tower saved as transformers saves a user's (ViT and DINOv2 in their legacy key layout)."""
    from transformers import (CLIPVisionModel, Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig,
                              Dinov2WithRegistersModel, SiglipVisionModel, ViTConfig, ViTModel)

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=112,
                  patch_size=14)
    build = {
        "clip": lambda: CLIPVisionModel(_tiny_vision("clip")),
        "siglip": lambda: SiglipVisionModel(_tiny_vision("siglip")),
        "vit": lambda: ViTModel(ViTConfig(**common), add_pooling_layer=False),
        "dinov2": lambda: Dinov2Model(Dinov2Config(**common, layerscale_value=0.5)),
        "dinov2_registers": lambda: Dinov2WithRegistersModel(
            Dinov2WithRegistersConfig(**common, num_register_tokens=4, layerscale_value=0.5)),
    }
    torch.manual_seed(seed)
    path = factory.mktemp(f"tiny_{name}")
    build[name]().eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A CLIPVisionModel checkpoint: 3 blocks with [CLS], 64 patches, no projector."""
    return _save_tower(tmp_path_factory, "clip", 2)


@pytest.fixture(scope="session")
def tiny_siglip_dir(tmp_path_factory):
    """A SiglipVisionModel checkpoint: no [CLS] token."""
    return _save_tower(tmp_path_factory, "siglip", 3)


@pytest.fixture(scope="session")
def tiny_vit_dir(tmp_path_factory):
    """A ViTModel checkpoint: [CLS] + 64 patches, a final layernorm."""
    return _save_tower(tmp_path_factory, "vit", 5)


@pytest.fixture(scope="session")
def tiny_dinov2_dir(tmp_path_factory):
    """A Dinov2Model checkpoint: layer scales, run-time interpolated position embeddings."""
    return _save_tower(tmp_path_factory, "dinov2", 6)


@pytest.fixture(scope="session")
def tiny_dinov2_registers_dir(tmp_path_factory):
    """A Dinov2WithRegistersModel checkpoint: [CLS] + 4 register tokens + 64 patches."""
    return _save_tower(tmp_path_factory, "dinov2_registers", 7)


@pytest.fixture(scope="session")
def tiny_source(tiny_clip_dir):
    from vlmprune.compiler.frontend import load_source

    return load_source(str(tiny_clip_dir))


@pytest.fixture(scope="session")
def tiny_dense_path(tiny_source, tmp_path_factory):
    """The tiny CLIP tower exported (dynamic batch) to an .onnx file."""
    import onnx_ir as ir

    from vlmprune.compiler.frontend import export_onnx

    path = tmp_path_factory.mktemp("tiny_onnx") / "tower.onnx"
    ir.save(export_onnx(tiny_source.pipeline, tiny_source.image_size, None, 18), path)
    return path


def _content(model: Path) -> str:
    """A preset's name, or the sha256 of a checkpoint folder's (or an .onnx file's) bytes."""
    import hashlib

    if not model.exists():
        return str(model)
    digest = hashlib.sha256()
    for path in sorted(model.rglob("*")) if model.is_dir() else [model]:
        if path.is_file():
            digest.update(f"{path.relative_to(model) if model.is_dir() else path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """compiled(model, **options): model (a preset or a checkpoint path) compiled with CompileOptions(**options).

    A compile is the suite's dearest step, so each (model, options) is compiled once a run and its
    CompileResult shared by every test that asks for it, in every worker: the first worker to ask compiles under a
    file lock, and the others wait and load its result. The bundle is shared: a test that edits one (a tampered
    file, a --force rewrite) edits a copy (shutil.copytree) instead. Checkpoints are made per worker, at a
    fixed seed, so the key names a checkpoint by its content, not its path.
    """
    made = {}
    root = _shared_root(tmp_path_factory) / "compiled"
    root.mkdir(exist_ok=True)
    def compile_once(model, **options):
        return compile_shared(root, made, model, options)

    compile_once.root, compile_once.shared = root, compile_shared  # for the test that plays another worker
    return compile_once


def compile_shared(root: Path, made: dict, model, options: dict):
    """compiled()'s body: made holds this process's results, root the run's (a file lock and a pickle per key)."""
    import fcntl
    import hashlib
    import json
    import pickle

    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    key = (str(model), json.dumps(options, sort_keys=True))
    if key not in made:
        digest = hashlib.sha256(json.dumps([_content(Path(str(model))), key[1]]).encode()).hexdigest()[:16]
        done = root / f"{digest}.pickle"
        with open(root / f"{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if done.is_file():
                made[key] = pickle.loads(done.read_bytes())
            else:
                made[key] = compile_model(str(model), root / digest / "bundle", CompileOptions(**options))
                done.write_bytes(pickle.dumps(made[key]))
    return made[key]


@pytest.fixture(scope="session")
def demo_bundle(compiled):
    """`demo` compiled for ort with dynamic batch, pruning inside the tower (after block 2)."""
    return compiled("demo", keep=192, layer=2, method_options={"lambda": 0.3})


@pytest.fixture(scope="session")
def elsewhere_onnx(tmp_path_factory):
    """A tiny CLIP tower exported the way edge users export one: Hugging Face's CLIPVisionModel through
    torch.onnx's TorchScript exporter, static batch 1, outputs last_hidden_state and pooler_output,
    [CLS] kept, token positions computed with Shape ops at run time."""
    import warnings

    from transformers import CLIPVisionModel

    torch.manual_seed(4)
    config = _tiny_vision("clip")
    config._attn_implementation = "eager"
    model = CLIPVisionModel(config).eval()
    path = tmp_path_factory.mktemp("elsewhere") / "clip_ts.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 3, 112, 112),), str(path), dynamo=False, opset_version=17,
                          input_names=["pixel_values"], output_names=["last_hidden_state", "pooler_output"])
    return path


# The fixtures that make or find a pinned toolchain: a test that asks for one (itself or through its fixtures)
# is marked `toolchain`, so `-m 'not toolchain'` leaves it out.
TOOLCHAIN_FIXTURES = {"rknn_ready", "edgellm_ready", "qnn_ready"}


def pytest_collection_modifyitems(items):
    for item in items:
        if TOOLCHAIN_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.toolchain)


@pytest.fixture(scope="session")
def qnn_ready():
    """onnxruntime-qnn's HTP emulator registered (it installs nothing), or a skip that says why."""
    from vlmprune.targets import qnn_tools

    ok, why = qnn_tools.available()
    if not ok:
        pytest.skip(f"QNN toolchain unavailable: {why}")


@pytest.fixture(scope="session")
def rknn_ready():
    """rknn-toolkit2 2.5.0's venv: reused if ready, else created (~45 s, ~600 MB from the package index).

    Skips, saying why, when the platform has no toolkit wheel, when VLMPRUNE_RKNN_CREATE=0,
    or when the package index cannot be reached (an offline machine).
    """
    ok, reason = _rknn_env().available()
    if ok:
        return _rknn_env().rknn_python()
    ok, reason = _rknn_env().creatable()
    if not ok:
        pytest.skip(f"rk3588 toolchain unavailable: {reason}")
    if os.environ.get("VLMPRUNE_RKNN_CREATE", "1") == "0":
        pytest.skip("rknn venv not created and VLMPRUNE_RKNN_CREATE=0")
    reachable, why = _rknn_env().index_reachable()
    if not reachable:
        pytest.skip(f"rknn venv not created and cannot be: {why}")
    try:
        return _rknn_env().rknn_python()
    except _rknn_env().RknnError as exc:
        pytest.skip(f"rknn venv could not be created: {exc}")


def _rknn_env():
    from vlmprune.targets import rknn_env

    return rknn_env
