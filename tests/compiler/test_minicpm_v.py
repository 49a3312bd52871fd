"""Family `minicpm_v`: MiniCPM-V 4.6's SigLIP tower with its window merger, and its merger, pruned after the
connector, against transformers.

A tiny MiniCPM-V 4.6 built offline from a config (tiny_models.tiny_minicpm_v: 4 SigLIP blocks 32 wide, patch 8, a
16x16 position table: 128 px by default, 16x16 patches, the window merger after block 2 into 8x8, the merger's 2x2
into 4x4 = 16 tokens; a Qwen3.5 LLM of one linear-attention and one full-attention layer). What is checked against
Hugging Face itself:
- the dense pipeline's rows are get_image_features' (patch embedding, nearest-bucket positions, blocks, window merger,
  blocks, post_layernorm, merger), at the default size and at static --image-size 64 and 96, with the pixels packed
  as transformers' image processor packs them, and at downsample_mode "4x" (no window merger, 2x2 groups);
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator), each gated on its
  toolchain as the other families' tests are;
- block-site and attention-scored methods, bad --image-size values, --feature-layer and a merge kernel other than
  2x2 are refused in one line; `vlmprune methods` lists it;
- the minicpm-v-4.6-448 preset has MiniCPM-V 4.6's tower, window merger and merger shapes;
- the LLM side: the prompt is the processor's (the chat template, the image rows as transformers' own
  replace_image_token writes one unsliced image, its image id first), generate's dense splice gives HF's own forward's
  logits, a pruned bundle's rows spliced by generate give the logits of HF's forward given its own tower's rows of the
  same kept tokens (1-D original positions), and `generate` and eval run through the bundle (--with-llm, Qwen3.5's
  hybrid decoder exported with its delta-nets' convolution and recurrent states: test_minicpm_v_llm).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (QNN_RK3588_CASES, TENSORRT_CASES, assert_close, check_dense_rows, check_dense_splice,
                           check_eval, check_generate_cli, check_methods_listing, check_openvino, check_other_method,
                           check_pruned_splice, check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt, hf_rows_of,
                           llm_side_fixtures)
from minicpm_fixtures import IMAGE, PROMPT, VOCAB, hf_model, minicpm_dir  # noqa: F401
from tiny_models import edited_copy, tiny_minicpm_v
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, TOKENS, WIDTH, PATCH = 128, 16, 48, 8


def _hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [B, T, D] for B square images, packed as its processor packs them."""
    from vlmprune.compiler.frontend.minicpm_v import MiniCPMVFamily

    return hf_rows_of(MiniCPMVFamily(), model, pixel, PATCH)


@pytest.mark.parametrize("size, tokens", [(SIZE, TOKENS), (64, 4), (96, 9)])
def test_dense_path_is_hf_image_features(minicpm_dir, hf_model, size, tokens):
    source = load_source(str(minicpm_dir), image_size=None if size == SIZE else size)
    assert source.family == "minicpm_v" and source.spatial_merge == 4 and source.mean == (0.5, 0.5, 0.5)
    check_dense_rows(source, lambda x: _hf_rows(hf_model, x), size=size, tokens=tokens, width=WIDTH)


def test_4x_mode_skips_the_window_merger(minicpm_dir, tmp_path):
    """downsample_mode "4x": no window merger, every block on the full grid, the merger's 2x2 groups: 8x8 tokens."""
    from transformers import AutoModelForImageTextToText

    four = edited_copy(minicpm_dir, tmp_path / "4x", lambda c: c.update(downsample_mode="4x"))
    source = load_source(str(four))
    assert source.spatial_merge == 2 and source.num_patches == 64 and source.num_blocks == 4
    model = AutoModelForImageTextToText.from_pretrained(four).eval()
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = source.pipeline(x)
    assert_close(got, _hf_rows(model, x))


def test_the_check_has_teeth(minicpm_dir):
    """The pixels are packed as transformers' image processor packs them; the merger's groups taken transposed, or
    the window merger's windows taken as consecutive rows, are not MiniCPM-V."""
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    from vlmprune.compiler.frontend.minicpm_v import MiniCPMVFamily, fold

    source = load_source(str(minicpm_dir))
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    packed = MiniCPMVFamily().hf_image_inputs(None, source, x.numpy())
    cut = np.concatenate([MiniCPMV4_6ImageProcessorPil.reshape_by_patch(None, x[i].numpy(), PATCH) for i in range(2)],
                         axis=-1)[None]
    np.testing.assert_array_equal(packed["pixel_values"].numpy(), cut)
    assert packed["target_sizes"].tolist() == [[16, 16]] * 2
    h = torch.arange(16.0).reshape(1, 16, 1)
    assert fold(h, 4)[0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]  # a 2x2 group: (row, column), not 4 consecutive rows
    projector = source.pipeline.projector
    with torch.inference_mode():
        h = torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(8))
        transposed = h.reshape(2, 16, 16, 32).transpose(1, 2).reshape(2, 256, 32)
        assert (projector(h) - projector(transposed)).abs().max() > 1e-3


@pytest.fixture(scope="module")
def divprune_bundle(minicpm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("minicpm_v_bundles") / "divprune"
    return compile_model(str(minicpm_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, minicpm_dir, hf_model):
    check_rows_on_ort(divprune_bundle, minicpm_dir, lambda pixel: _hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="minicpm_v", readme="MiniCPM-V tokens")


@pytest.mark.parametrize("method, options, size", [("dart", {"pivots": 2}, None),
                                                   ("random", {"site": "features"}, None),
                                                   ("grid", {"site": "features"}, None), ("divprune", {}, 96)])
def test_other_methods_and_sizes_on_ort(minicpm_dir, tmp_path, method, options, size):
    keep = 6
    result = check_other_method(minicpm_dir, tmp_path / "b", method, options, keep=keep, width=WIDTH,
                                family_options={"image_size": size} if size else {})
    assert result.manifest["method"]["num_patches"] == (TOKENS if size is None else 9)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(minicpm_dir, tmp_path, target, method, batch, options):
    check_tensorrt(minicpm_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(minicpm_dir, tmp_path):
    check_openvino(minicpm_dir, tmp_path / "b")


@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, minicpm_dir, tmp_path, target, method):
    """The whole MiniCPM-V graph, window merger and merger too, on the HTP emulator (int16) and the RKNN simulator
    (fp16)."""
    check_qnn_or_rk3588(request, minicpm_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    (["--method", "cls"], "fold 2x2 groups of the full patch grid"),
    (["--method", "visionzip"], "fold 2x2 groups of the full patch grid"),
    (["--method", "tome"], "fold 2x2 groups of the full patch grid"),
    (["--method", "random"], "fold 2x2 groups of the full patch grid"),
    (["--method", "cls", "--score", "attention"], "not the merged tokens"),
    (["--method", "holov"], "not the merged tokens"),
    (["--method", "cdpruner"], "not the merged tokens"),
    (["--method", "divprune", "--image-size", "100"], "must be a multiple of 32 (patch x its merges) from 32 to 128"),
    (["--method", "divprune", "--image-size", "160"], "must be a multiple of 32 (patch x its merges) from 32 to 128"),
    (["--method", "divprune", "--feature-layer", "-2"], "reads the tower's last normed output only"),
])
def test_refusals_are_one_line(minicpm_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", minicpm_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)
    assert not (tmp_path / "b").exists()


def test_another_merge_kernel_is_refused_in_one_line(minicpm_dir, tmp_path):
    """transformers' merger folds 2x2 groups; a checkpoint with another kernel is not one vlmprune compiles."""
    bad = edited_copy(minicpm_dir, tmp_path / "bad", lambda c: c.update(merge_kernel_size=[3, 3]))
    one_line_error(run_cli("compile", bad, "-o", tmp_path / "b", "--method", "divprune", "--keep", "6"),
                   "merge_kernel_size [3, 3]")


def test_methods_lists_minicpm_v_from_its_declarations():
    check_methods_listing("MiniCPM-V")


def test_preset_has_minicpm_v_4_6_tower_shapes():
    source = load_source("minicpm-v-4.6-448")
    pipe = source.pipeline
    assert source.family == "minicpm_v" and source.image_size == 448 and source.patch_size == 14
    assert source.num_patches == 64 and source.num_blocks == 7 and not source.has_cls
    assert source.details["token_counts"] == {"image_size": 448, "patch_grid": [32, 32], "patches": 1024,
                                              "spatial_merge": 4, "merged_grid_thw": [1, 8, 8], "tokens": 64}
    assert source.details["vision_layers"] == 27 and len(pipe.projector.rest) == 20
    tower = pipe.vision_model
    assert tower.config.hidden_size == 1152 and tower.embeddings.position_embedding.weight.shape == (4900, 1152)
    assert tower.vit_merger.linear_1.weight.shape == (4 * 4304, 4 * 1152)
    mlp = pipe.projector.merger.mlp
    assert len(mlp) == 1 and mlp[0].linear_1.weight.shape == (4608, 4608) and mlp[0].linear_2.weight.shape == (1024,
                                                                                                              4608)
    params = sum(p.numel() for p in tower.parameters())
    assert 515e6 < params < 530e6  # SigLIP-So400m/14 (417M, a 70x70 position table) and its window merger (105M)
    with torch.inference_mode():
        out = pipe(torch.zeros(1, 3, 448, 448))
    assert out.shape == (1, 64, 1024) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- the LLM side


llm_dir, cat, llm_bundle = llm_side_fixtures(
    lambda path: tiny_minicpm_v(path, 5, image_token_id=IMAGE, tokenizer=True, vocab_size=VOCAB), "minicpm_v")


def test_prompt_is_the_processors(llm_dir):
    """The prompt's ids are the chat template's text with the image token expanded as MiniCPM-V's processor expands
    one unsliced image (transformers' own replace_image_token and its image id), tokenized."""
    from transformers import AutoTokenizer
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    prompt = gen.build_prompt(vlm, PROMPT)
    assert prompt.how == "the checkpoint's chat template"
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": PROMPT}]}],
                                         add_generation_prompt=True, tokenize=False)
    marks = types.SimpleNamespace(image_start_token="<image>", image_end_token="</image>", image_token="<|image_pad|>",
                                  slice_mode=True, image_id_start_token="<image_id>", image_id_end_token="</image_id>")
    inputs = {"grids": [[0, 0]], "num_patches_per_image": [1], "target_sizes": np.array([[SIZE // PATCH] * 2])}
    expanded = MiniCPMV4_6Processor.replace_image_token(marks, inputs, 0, image_token_divisor=16)
    expanded = MiniCPMV4_6Processor._prepend_local_ids(marks, [text], [expanded], "<|image_pad|>")[0]
    ids = tokenizer(text.replace("<|image_pad|>", expanded), add_special_tokens=False)["input_ids"]
    assert prompt.before + [IMAGE] * TOKENS + prompt.after == ids


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    check_dense_splice(llm_dir, cat, PROMPT, TOKENS, WIDTH)


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions, give the logits of HF's own
    forward given its own tower's rows of those 8 tokens at those positions; other positions give others."""
    check_pruned_splice(llm_bundle, llm_dir, cat, PROMPT, TOKENS, IMAGE, _hf_rows, pooled=lambda rows: [rows])


def test_generate_cli_and_eval(llm_bundle, llm_dir, cat, tmp_path):
    """`vlmprune generate` answers through Qwen3.5's LLM (transformers); eval's harness holds (its dense splice is
    HF's forward) and the bundle's rows give its reference's figures."""
    check_generate_cli(llm_bundle, llm_dir, cat, PROMPT)
    check_eval(llm_bundle, llm_dir, tmp_path, [PROMPT, "describe it."], TOKENS)

