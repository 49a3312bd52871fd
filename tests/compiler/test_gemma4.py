"""Family `gemma4`: Gemma 4's own vision tower (2-D RoPE, 3x3 pooling, embedder), pruned after the embedder, against
transformers.

A tiny Gemma 4 built offline from a config (tiny_models.tiny_gemma4: 3 blocks 32 wide, grouped key/value heads, a
processor budget of 70 soft tokens: a square image is 96 px, 24x24 patches of 4 pooled 3x3 into 8x8 = 64 tokens,
standardised; a 2-layer Gemma 4 LLM with per-layer embeddings and the bidirectional image block). What is checked
against Hugging Face itself:
- the dense pipeline's rows are get_image_features' (the processor's patches in [0, 1] and their positions), and
  the tower's ONNX export alone is exact against them at a fixed seed;
- a pruned bundle's rows are HF's rows at kept_indices, on ort (both graphs, the ONNX checker, standard ops);
- parity on orin, xavier (host), openvino (CPU), rk3588 (simulator) and qnn (HTP emulator, int16 with the family's
  quantization needs: Gemma4Family.quantization), each gated on its toolchain as the other families' tests are;
- block-site and attention-scored methods are refused in one line before any work; `vlmprune methods` lists Gemma 4
  (--with-llm: test_gemma4_llm.py);
- the gemma4-e2b-768 preset has Gemma 4 E2B's vision shapes;
- the LLM side: generate's dense splice gives HF's own forward's logits (mm_token_type_ids at the image, per-layer
  embeddings of the pad token there), a pruned bundle's rows spliced by generate give the logits of HF's forward
  given its own tower's rows of the same kept tokens at their original 1-D positions; `generate` and eval run
  through it.
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import one_line_error, run_cli
from merged_checks import (OTHER_METHODS, QNN_RK3588_CASES, TENSORRT_CASES, assert_close, cat_image,
                           check_dense_splice, check_eval, check_methods_listing, check_openvino, check_other_method,
                           check_pruned_splice, check_qnn_or_rk3588, check_rows_on_ort, check_tensorrt,
                           refused_methods)
from tiny_models import tiny_gemma4
from vlmprune.compiler.frontend import load_source
from vlmprune.compiler.frontend.gemma4 import grid_positions, hf_patches
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, PATCH, TOKENS, WIDTH = 96, 4, 64, 48
VOCAB, IMAGE, BOI, EOI = 320, 300, 301, 302  # the LLM-side model: a vocabulary wide enough for UTF-8 bytes as ids


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    return tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4"), 3)


@pytest.fixture(scope="module")
def hf_model(gemma4_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(gemma4_dir).eval()


def _hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [B, T, D] of a bundle's pixels, fed as Gemma 4's processor feeds them."""
    positions = grid_positions(SIZE // PATCH).expand(len(pixel), -1, -1)
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=hf_patches(pixel, PATCH), image_position_ids=positions)
    return torch.stack(out.pooler_output)


def test_dense_path_is_hf_image_features(gemma4_dir, hf_model):
    source = load_source(str(gemma4_dir))
    assert source.family == "gemma4" and not source.has_cls and source.num_patches == TOKENS
    assert source.spatial_merge == 3 and source.num_blocks == 3 and source.image_size == SIZE
    assert source.details["token_counts"]["merged_grid_thw"] == [1, 8, 8]
    assert source.mean == source.std == (0.5, 0.5, 0.5)
    for batch in (1, 3):
        x = torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            got = source.pipeline(x)
        assert got.shape == (batch, TOKENS, WIDTH)
        assert_close(got, _hf_rows(hf_model, x))


def test_padded_processor_input_gives_the_same_rows(gemma4_dir, hf_model):
    """The processor pads each image's patch list to its budget (positions -1): the real patches' rows are the
    unpadded grid's, which is what the bundle computes."""
    x = torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    values, positions = hf_patches(x, PATCH), grid_positions(SIZE // PATCH)
    pad = 70 * 9 - values.shape[1]
    values = torch.cat([values, torch.zeros(1, pad, values.shape[2])], dim=1)
    positions = torch.cat([positions, torch.full((1, pad, 2), -1)], dim=1)
    with torch.inference_mode():
        padded = hf_model.model.get_image_features(pixel_values=values, image_position_ids=positions).pooler_output
        ours = load_source(str(gemma4_dir)).pipeline(x)
    assert padded[0].shape == (TOKENS, WIDTH)
    assert_close(ours[0], padded[0])


def test_the_check_has_teeth(gemma4_dir, hf_model):
    """Transposed RoPE axes, or the pooled groups taken from a transposed grid, are not Gemma 4."""
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    expected = _hf_rows(hf_model, x)
    pipe = load_source(str(gemma4_dir)).pipeline
    with torch.inference_mode():
        swapped = pipe.positions.flip(-1)
        cos, sin = pipe.vision_model.encoder.rotary_emb(torch.zeros(1), swapped)
        pipe.cos, pipe.sin = cos, sin
        wrong_rope = pipe(x)
        pipe = load_source(str(gemma4_dir)).pipeline
        pipe.xs, pipe.ys = pipe.ys.clone(), pipe.xs.clone()
        wrong_table = pipe(x)
    for wrong in (wrong_rope, wrong_table):
        assert (wrong - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


def test_tower_export_alone_is_exact(gemma4_dir, hf_model, tmp_path):
    """The dense tower (RoPE, attention, pooling, embedder) exported by itself, standard ops only, under ONNX
    Runtime: HF's rows at a fixed seed."""
    import onnx
    import onnx_ir

    from vlmprune.compiler.frontend import export_onnx
    from vlmprune.targets.runtime import ort_session, run_session

    source = load_source(str(gemma4_dir))
    path = tmp_path / "tower.onnx"
    onnx_ir.save(export_onnx(source.pipeline, SIZE, None, 18), path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert "Conv" not in {n.op_type for n in proto.graph.node}
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(11))
    got = next(iter(run_session(ort_session(path, ()), x.numpy()).values()))
    assert_close(got, _hf_rows(hf_model, x))


@pytest.fixture(scope="module")
def divprune_bundle(gemma4_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_bundles") / "divprune"
    return compile_model(str(gemma4_dir), out, CompileOptions(method="divprune", keep=8))


def test_divprune_on_ort_rows_are_hf_rows_at_the_kept_indices(divprune_bundle, gemma4_dir, hf_model):
    check_rows_on_ort(divprune_bundle, gemma4_dir, lambda pixel: _hf_rows(hf_model, pixel), size=SIZE, keep=8,
                      tokens=TOKENS, width=WIDTH, family="gemma4", readme="Gemma 4 tokens")


@pytest.mark.parametrize(*OTHER_METHODS)
def test_other_methods_on_ort(gemma4_dir, tmp_path, method, options):
    check_other_method(gemma4_dir, tmp_path / "b", method, options, keep=6, width=WIDTH)


@pytest.mark.parametrize(*TENSORRT_CASES)
def test_tensorrt_targets(gemma4_dir, tmp_path, target, method, batch, options):
    check_tensorrt(gemma4_dir, tmp_path / "b", target, method, batch, options)


def test_openvino(gemma4_dir, tmp_path):
    check_openvino(gemma4_dir, tmp_path / "b")


@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.parametrize(*QNN_RK3588_CASES)
def test_qnn_and_rk3588(request, gemma4_dir, tmp_path, target, method):
    """The whole Gemma 4 graph, RoPE and pooling too, on the HTP emulator (int16, with the family's quantization
    needs: 16-bit weights, widened ranges, the attention cores in fp16) and the RKNN simulator (fp16)."""
    check_qnn_or_rk3588(request, gemma4_dir, tmp_path / "b", target, method)


@pytest.mark.parametrize("args, message", [
    *refused_methods("averages each 3x3 group", "not over the pooled tokens"),
    (["--image-size", "192"], "has a fixed image size"),
    (["--feature-layer", "-2"], "--feature-layer does not apply to gemma4"),
])
def test_refusals_are_one_line(gemma4_dir, tmp_path, args, message):
    one_line_error(run_cli("compile", gemma4_dir, "-o", tmp_path / "b", "--keep", "6", *args), message)
    assert not (tmp_path / "b").exists()


def test_methods_lists_gemma4_from_its_declarations():
    check_methods_listing("Gemma 4")


def test_preset_has_gemma4_e2b_vision_shapes():
    source = load_source("gemma4-e2b-768")
    pipe = source.pipeline
    assert source.family == "gemma4" and source.image_size == 768 and source.patch_size == 16
    assert source.num_patches == 256 and source.num_blocks == 16 and not source.has_cls
    assert source.details["token_counts"] == {"image_size": 768, "patch_grid": [48, 48], "patches": 2304,
                                              "spatial_merge": 3, "merged_grid_thw": [1, 16, 16], "tokens": 256}
    tower = pipe.vision_model
    assert tower.config.hidden_size == 768 and tower.config.intermediate_size == 3072
    assert tower.config.num_attention_heads == 12 and tower.config.head_dim == 64
    assert tower.patch_embedder.position_embedding_table.shape == (2, 10240, 768)
    assert pipe.projector.embedding_projection.weight.shape == (2304, 768)
    assert pipe.cos.shape == (1, 2304, 64)
    # the pooling and embedder on the tower's token count (a full forward at 768 px takes long on 2 cores)
    with torch.inference_mode():
        out = pipe.projector(pipe.pool(torch.randn(1, 2304, 768)))
    assert out.shape == (1, 256, 2304) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ the LLM side


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4_llm"), 5, image_token_id=IMAGE, boi=BOI, eoi=EOI,
                       vocab_size=VOCAB)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    return cat_image(tmp_path_factory)


@pytest.fixture(scope="module")
def llm_bundle(llm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_llm") / "divprune"
    return compile_model(str(llm_dir), out, CompileOptions(method="divprune", keep=8))


def test_prompt_is_gemma4s_image_sequence(llm_dir):
    """The image sits where Gemma 4's processor puts it: boi before, eoi after."""
    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    prompt = gen.build_prompt(vlm, "what is in the image?")
    assert prompt.before[-1] == BOI and prompt.after[0] == EOI
    assert "Gemma 4's chat convention" in prompt.how


def test_generate_dense_splice_is_the_hf_forward(llm_dir, cat):
    """generate's dense splice is HF's forward with the image tokens marked (mm_token_type_ids 1): bidirectional among
    the image rows in the sliding layer; the causal-only forward gives other logits."""
    from vlmprune.compiler import generate as gen

    vlm, prompt, pixel, hf = check_dense_splice(llm_dir, cat, "what is in the image?", TOKENS, WIDTH)
    ids = gen.hf_forward_ids(vlm, prompt, TOKENS)
    assert ids["mm_token_type_ids"].sum() == TOKENS
    with torch.inference_mode():
        causal = vlm.model(input_ids=ids["input_ids"], **gen.hf_image_inputs(vlm, pixel),
                           logits_to_keep=1).logits[0, -1]
    assert (causal - hf).abs().max() > 1e-4  # the bidirectional image block counts


def test_spliced_rows_need_their_per_layer_inputs(llm_dir):
    """Why generate hands Gemma 4 its per-layer embeddings (Family.llm_embeds_args): transformers recovers them from
    inputs_embeds by reversing the embedding, which image rows defeat."""
    from vlmprune.compiler import generate as gen

    vlm = gen.load_vlm(str(llm_dir))
    embed = vlm.model.get_input_embeddings()
    embeds = torch.cat([embed(torch.tensor([[2, 10]])), torch.randn(1, 3, WIDTH)], dim=1)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="exactly match"):
        vlm.model(inputs_embeds=embeds)
    args = vlm.rules.llm_embeds_args(vlm.model, [2, 10], 3, [])
    assert args["per_layer_inputs"].shape[:2] == (1, 5)
    with torch.inference_mode():
        assert torch.isfinite(vlm.model(inputs_embeds=embeds, **args).logits).all()


def test_pruned_llm_input_is_hf_forward_on_the_same_kept_tokens(llm_bundle, llm_dir, cat):
    """The bundle's 8 kept rows, spliced by generate at their original positions as one image block, give the logits
    of HF's own forward given its own tower's rows of those 8 tokens, token types 1 there, at those positions."""
    def rows(model, pixel):
        with torch.inference_mode():
            positions = grid_positions(SIZE // PATCH).expand(len(pixel), -1, -1)
            out = model.get_image_features(pixel_values=hf_patches(pixel, PATCH), image_position_ids=positions)
        return torch.stack(out.pooler_output)

    check_pruned_splice(llm_bundle, llm_dir, cat, "what is in the image?", TOKENS, IMAGE, rows,
                        pooled=lambda r: (r,),
                        extra=lambda ids: {"mm_token_type_ids": (ids == IMAGE).long(),
                                           "attention_mask": torch.ones_like(ids)})


def test_generate_cli_and_eval(llm_bundle, llm_dir, cat, tmp_path):
    """`vlmprune generate` answers through Gemma 4's LLM (transformers); eval's harness holds (its dense splice is
    HF's forward) and the bundle's rows give its reference's figures."""
    result = run_cli("generate", llm_bundle.bundle, "--model", llm_dir, "--image", cat,
                     "--prompt", "what is in the image?", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "pruned: 8 image tokens" in result.output and "Gemma 4's chat convention" in result.output
    check_eval(llm_bundle, llm_dir, tmp_path, ["what is in the image?"], TOKENS)


def test_a_gemma4_without_vision_is_one_line(gemma4_dir, tmp_path):
    """A text-only Gemma 4 (no vision_config) is refused in one line, nothing written."""
    from tiny_models import edited_copy

    copy = edited_copy(gemma4_dir, tmp_path / "text_only", lambda config: config.update(vision_config=None))
    one_line_error(run_cli("compile", copy, "-o", tmp_path / "b", "--keep", "6"), "has no vision tower")
    assert not (tmp_path / "b").exists()
