"""Checkpoints as they are published: bfloat16 or float16 weights, sharded, with an index.

Published VLMs (llava-hf, Qwen) store bfloat16 or float16 in several safetensors shards and say so in
config.json. The PyTorch reference every stage is held to is float32, as the exported graphs are, so the
frontend loads any stored dtype as float32. Before that, a bfloat16 checkpoint compiled with --with-llm
ended in "internal error" (a dtype mismatch between the float32 tower features and the bfloat16 LLM).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.compiler.test_generate import PROMPT, tiny_vlm


def _published(tmp_path, dtype: torch.dtype):
    """tiny_vlm saved the way hubs ship models: `dtype` weights in shards of at most 40 kB, plus the index."""
    from transformers import LlavaForConditionalGeneration

    source = tiny_vlm(tmp_path / "fp32")
    model = LlavaForConditionalGeneration.from_pretrained(source, dtype=dtype)
    out = tmp_path / str(dtype).removeprefix("torch.")
    model.save_pretrained(out, safe_serialization=True, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    return source, out


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    from PIL import Image
    from skimage import data

    path = tmp_path_factory.mktemp("photo") / "cat.png"
    Image.fromarray(data.chelsea()).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_sharded_checkpoint_compiles_with_its_llm_and_answers(tmp_path, photo, dtype):
    from vlmprune.compiler.frontend import load_source
    from vlmprune.compiler.generate import generate, load_vlm
    from vlmprune.compiler.pipeline import CompileOptions, compile_model

    _, published = _published(tmp_path, dtype)
    index = json.loads((published / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really sharded
    assert json.loads((published / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")

    # The references run in float32 whatever the checkpoint stores: the tower's and the language model's.
    assert {p.dtype for p in load_source(str(published)).pipeline.parameters()} == {torch.float32}
    assert {p.dtype for p in load_vlm(str(published)).model.parameters()} == {torch.float32}

    result = compile_model(str(published), tmp_path / "bundle", CompileOptions(keep=32, with_llm=True))
    assert result.report.passed, result.report
    assert (result.bundle / "llm" / "prefill.onnx").exists()

    graph = generate(result.bundle, None, photo, PROMPT, max_new_tokens=6)
    reference = generate(result.bundle, None, photo, PROMPT, max_new_tokens=6, reference=True)
    assert graph.llm.startswith("the bundle's LLM graphs") and reference.llm.startswith("transformers")
    assert graph.answer.tokens == reference.answer.tokens and len(graph.answer.tokens) == 6


def test_the_stored_dtype_is_kept_on_disk_and_only_the_reference_is_float32(tmp_path):
    """The float32 load is the frontend's choice, not a rewrite of the user's files."""
    from safetensors import safe_open

    from vlmprune.compiler.frontend import load_source

    _, published = _published(tmp_path, torch.bfloat16)
    before = {p.name: p.read_bytes() for p in published.iterdir()}
    load_source(str(published))
    assert {p.name: p.read_bytes() for p in published.iterdir()} == before
    shard = next(published.glob("model-*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
