"""LLaVA-NeXT-Video (llava_next_video, the llava_next family) video: --video-frames F.

The tiny checkpoint (tiny_models.tiny_llava_next_video) at 56 px: 4x4 patches per frame, pooled 2x2 into 2x2 = 4
tokens per frame by the resampler; 2 of its 3 CLIP blocks run (feature layer -2). The dense clip path equals
transformers' get_video_features for the same frames; evs prunes the pooled rows with parity on ort.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny_models import tiny_llava_next_video
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend import family_for, load_source
from vlmprune.compiler.frontend.images import preprocess
from vlmprune.compiler.frontend.video import clip_made_here
from vlmprune.compiler.pipeline import CompileOptions, compile_model

SIZE, FRAMES, PER_FRAME = 56, 6, 4


@pytest.fixture(scope="module")
def lnv_dir(tmp_path_factory):
    return tiny_llava_next_video(tmp_path_factory.mktemp("tiny_llava_next_video"), seed=21)


@pytest.fixture(scope="module")
def hf_model(lnv_dir):
    from transformers import LlavaNextVideoForConditionalGeneration

    return LlavaNextVideoForConditionalGeneration.from_pretrained(lnv_dir, attn_implementation="sdpa").eval()


def video_source(path, frames: int = FRAMES):
    source = load_source(str(path))
    family_for(source).fix(source, {"video_frames": frames}, prune=False, batch=None, cls=None)
    return source


def hf_video_features(model, clip: torch.Tensor) -> torch.Tensor:
    config = model.config
    with torch.inference_mode():
        return model.model.get_video_features(
            pixel_values_videos=clip[None], vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output


def test_clip_path_is_hf_get_video_features(lnv_dir, hf_model):
    source = video_source(lnv_dir)
    assert source.family == "llava_next" and source.frames == FRAMES and source.num_patches == FRAMES * PER_FRAME
    clip = torch.randn(FRAMES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = source.pipeline(clip)
    expected = hf_video_features(hf_model, clip)
    assert got.shape == expected.shape == (1, FRAMES * PER_FRAME, 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    reversed_ = hf_video_features(hf_model, clip.flip(0))  # the frames' order is the rows' order
    assert (reversed_ - got).abs().max() > 1e-3


def test_refusals(lnv_dir, tmp_path):
    source = load_source(str(lnv_dir))
    family = family_for(source)
    with pytest.raises(InputError, match="at least 2"):
        family.fix(source, {"video_frames": 1}, prune=True, batch=None, cls=None)
    with pytest.raises(InputError, match="one clip per call"):
        family.fix(load_source(str(lnv_dir)), {"video_frames": 4}, prune=True, batch=2, cls=None)
    with pytest.raises(InputError, match="not to a clip"):
        family.fix(load_source(str(lnv_dir)), {"video_frames": 4, "grid": "1x1"}, prune=True, batch=None, cls=None)
    with pytest.raises(InputError, match="rk3588 cannot run this video bundle"):
        compile_model(str(lnv_dir), tmp_path / "rk", CompileOptions(
            method="evs", keep=12, target="rk3588", family_options={"video_frames": 4}))


def test_evs_bundle_passes_parity_on_the_pooled_rows(lnv_dir, tmp_path):
    from vlmprune.passes.methods.evs import retained_tokens
    from vlmprune.targets.runtime import ort_session, run_session

    result = compile_model(str(lnv_dir), tmp_path / "evs", CompileOptions(
        method="evs", keep=8, method_options={"video_pruning_rate": 0.5}, target="ort",
        family_options={"video_frames": FRAMES}, cache=False))
    assert result.report.passed and result.manifest.method.keep == retained_tokens(PER_FRAME, FRAMES, 0.5) == 12
    for stage in json.loads((result.bundle / "parity.json").read_text())["stages"][1:]:  # kept sets agree, no ties
        assert stage["indices"]["agreement"] == 1.0 and stage["indices"]["boundary_ties"] == [0], stage["indices"]
    assert result.manifest.llm["positions"]["kind"] == "indices"
    source = video_source(lnv_dir)
    clip = np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(FRAMES, SIZE)])
    out = run_session(ort_session(str(result.bundle / "model.onnx")), clip)
    with torch.inference_mode():
        dense = source.pipeline(torch.from_numpy(clip))[0].numpy()
    kept = out["kept_indices"][0]
    assert set(range(PER_FRAME)) <= set(kept.tolist())  # the first frame always
    np.testing.assert_allclose(out["image_features"][0], dense[kept], rtol=1e-4, atol=1e-4 * np.abs(dense).max())


def parity_clip(source, frames: int = FRAMES) -> np.ndarray:
    return np.stack([preprocess(f, SIZE, source.mean, source.std) for f in clip_made_here(frames, SIZE)])


def test_features_reference_ranks_the_whole_clip(lnv_dir):
    """The reference parity runs (prune_features on the dense rows, and forward) is told the clip's F frames: evs's
    kept rows are vLLM's retention mask over F frames of M rows, not the first K of one F·M-row frame (every score
    255, a tie that parity would then resolve in the graph's favour)."""
    from video_references import vllm_mask

    from vlmprune.compiler.parity.reference import MethodPruner
    from vlmprune.passes.methods.evs import EvsMethod

    source = video_source(lnv_dir)
    clip = torch.from_numpy(parity_clip(source))
    pipeline = source.pipeline.with_pruner(MethodPruner(EvsMethod(), {"keep": 12}, "features", None))
    with torch.inference_mode():
        dense = source.pipeline(clip)
        _, kept_features = pipeline.prune_features(dense, clip)
        _, kept_forward = pipeline(clip)
    expected = np.flatnonzero(vllm_mask(dense[0].numpy(), FRAMES, 12))
    assert kept_features[0].tolist() == kept_forward[0].tolist() == expected.tolist()
    assert expected.tolist() != list(range(12))  # the clip made here: not the first three frames


def test_cli_compiles_clips_of_two_lengths_from_one_cache(lnv_dir, tmp_path, monkeypatch):
    """`vlmprune compile --video-frames F` prints its summary (the counts line names the clip's frames), and the
    product cache keys the dense export by F: a compile at F = 4 after F = 6 exports its own batch of 4 (reusing
    F = 6's fails every parity stage on the input's shape), and F = 6 again hits F = 6's entry."""
    from cli_helpers import run_cli

    monkeypatch.setenv("VLMPRUNE_PRODUCTS", str(tmp_path / "products"))
    outputs = {}
    for frames, name in ((FRAMES, "first"), (4, "four"), (FRAMES, "again")):
        ran = run_cli("compile", lnv_dir, "-m", "evs", "-k", frames * 2, "--video-frames", frames, "-o", tmp_path / name)
        assert ran.exit_code == 0, ran.output
        outputs[name] = ran.output
    assert (f"image {SIZE}x{SIZE}: 4x4 = 16 patches, pooled 2x2 into 2x2 per frame: a clip of {FRAMES} frames, "
            f"{FRAMES * PER_FRAME} tokens") in outputs["first"]
    assert "a clip of 4 frames, 16 tokens" in outputs["four"] and "parity export     PASS" in outputs["four"]
    assert "export (cached" not in outputs["four"] and "export (cached" in outputs["again"]


def test_dense_export_key_names_the_frames(lnv_dir):
    """The product cache's key parts name a clip's frame count itself (the export's batch), not only through a
    pipeline setting that a family might not keep."""
    from vlmprune.compiler.pipeline.cache import export_parts

    four, six = (export_parts(video_source(lnv_dir, f), "llava_next", None, 18, None) for f in (4, FRAMES))
    assert (four["frames"], six["frames"]) == (4, FRAMES)
    still = load_source(str(lnv_dir))
    assert export_parts(still, "llava_next", None, 18, None)["frames"] == 1


# ---------------------------------------------------------------------- image methods over a clip's rows

def clip_nearly_still() -> np.ndarray:
    """Random frames, frames 3-4 frame 2 with a little noise: near-repeats, not exact ones (an exact repeat makes every
    cosine 1, a tie the official code breaks arbitrarily and the graph's fp32 rounding breaks its own way)."""
    rng = np.random.default_rng(5)
    clip = rng.standard_normal((FRAMES, 3, SIZE, SIZE)).astype(np.float32)
    clip[3:5] = clip[2] + 0.1 * rng.standard_normal((2, 3, SIZE, SIZE)).astype(np.float32)
    return clip


def official_kept(method: str, dense: np.ndarray, keep: int) -> list[int]:
    """The kept rows of one clip [F·M, D] by the method's plain restatement (method_references, video_references):
    the image methods rank the clip's F·M rows as one sequence; dycoke keeps per frame."""
    from method_references import dart_straightforward, divprune_official, random_draw
    from video_references import dycoke_official

    x = dense.astype(np.float64)
    if method == "divprune":
        return sorted(divprune_official(x, keep))
    if method == "dart":
        return dart_straightforward(x, keep, 4)
    if method == "random":
        return random_draw(len(x), keep, 0)
    frames = dycoke_official(torch.from_numpy(x), PER_FRAME)
    return [j * PER_FRAME + i for j, ids in enumerate(frames) for i in sorted(ids)]


PER_CLIP = [("divprune", 10, {}), ("dart", 10, {}), ("random", 10, {"site": "features"}), ("dycoke", 1, {})]


@pytest.mark.parametrize("method,keep,options", PER_CLIP, ids=[m for m, _, _ in PER_CLIP])
def test_image_methods_prune_the_clip_as_their_references_do(lnv_dir, tmp_path, method, keep, options):
    """divprune, dart, random --site features and dycoke on a clip's pooled rows [1, F·M, D]: parity on ort with the
    kept sets agreeing exactly, and the bundle's kept rows, on two clips, the restated algorithm's on the dense rows."""
    from vlmprune.compiler import api

    result = compile_model(str(lnv_dir), tmp_path / method, CompileOptions(
        method=method, keep=keep, method_options=options, target="ort", family_options={"video_frames": FRAMES}))
    assert result.report.passed, result.manifest["parity"]
    for stage in json.loads((result.bundle / "parity.json").read_text())["stages"][1:]:
        assert stage["indices"]["agreement"] == 1.0, stage["indices"]
    k = result.manifest.method.keep
    assert k == (4 + 1 + 1 + 1 + 4 + 1 if method == "dycoke" else keep)  # dycoke: frames 1, 2, 3, 5 keep int(0.3·4)
    source = video_source(lnv_dir)
    for clip in (parity_clip(source), clip_nearly_still()):
        out = api.run(result.bundle, inputs=clip).outputs  # the bundle's runtime (divprune: its fused op's library)
        with torch.inference_mode():
            dense = source.pipeline(torch.from_numpy(clip))[0].numpy()
        expected = official_kept(method, dense, k)
        assert out["kept_indices"][0].tolist() == expected
        np.testing.assert_allclose(out["image_features"][0], dense[expected], rtol=1e-4,
                                   atol=1e-4 * np.abs(dense).max())


REFUSED = [
    (["-m", "cls", "-k", "10", "-l", "1"], "method cls with these options reads block L's hidden states"),
    (["-m", "visionzip", "-k", "10", "-l", "1"], "method visionzip with these options reads"),
    (["-m", "tome", "-k", "10", "-l", "1"], "method tome with these options reads"),
    (["-m", "prumerge+", "-k", "10", "-l", "1"], "method prumerge+ with these options reads"),
    (["-m", "cdpruner", "-k", "10"], "method cdpruner with these options reads"),
    (["-m", "holov", "-k", "10"], "method holov with these options reads"),
    (["-m", "dart", "-k", "10", "--text-pivots", "2"], "method dart with these options reads"),
    (["-m", "random", "-k", "10", "-l", "1"], "use --site features"),
    (["-m", "divprune", "-k", "10", "--merge", "local"], "--merge local needs one patch grid, and a clip's tokens are 6 "
                                                         "frames' grids"),
    (["-m", "dycoke", "--video-frames", "5"], "an even number of frames, at least 4"),
]


@pytest.mark.parametrize("args,needle", REFUSED, ids=[" ".join(a[:2]) + (" " + a[-2] if len(a) > 4 else "")
                                                      for a, _ in REFUSED])
def test_methods_that_cannot_take_a_clip_refuse_in_one_line(lnv_dir, tmp_path, args, needle):
    from cli_helpers import one_line_error, run_cli

    frames = [] if "--video-frames" in args else ["--video-frames", FRAMES]
    one_line_error(run_cli("compile", lnv_dir, *args, *frames, "-o", tmp_path / "b"), needle)


# ---------------------------------------------------------------------- evs-encoder: the drop inside the tower

STANDARD = {"Add", "Concat", "ConstantOfShape", "Div", "Equal", "Erf", "Expand", "Gather", "MatMul", "Max", "Mod",
            "Mul", "ReduceL2", "ReduceMean", "ReduceSum", "Reshape", "ScatterND", "Shape", "Slice", "Softmax", "Sub",
            "TopK", "Transpose", "Unsqueeze", "Where", "Conv", "AveragePool", "LayerNormalization", "Sigmoid",
            "Pow", "Sqrt", "Tanh", "Cast", "CastLike", "Neg", "Squeeze", "Identity"}


def encoder_bundle(path, out, target="ort", keep=12, layer=1, frames=FRAMES, **options):
    return compile_model(str(path), out, CompileOptions(
        method="evs-encoder", keep=keep, layer=layer, target=target, family_options={"video_frames": frames},
        cache=False, **options))


@pytest.fixture(scope="module")
def encoder_result(lnv_dir, tmp_path_factory):
    return encoder_bundle(lnv_dir, tmp_path_factory.mktemp("evs_encoder") / "b")


def pruned_reference(source, clip: np.ndarray, keep=12, layer=1):
    from vlmprune.compiler.parity.reference import MethodPruner
    from vlmprune.passes.methods.evs_encoder import EvsEncoderMethod

    params = {"keep": keep, "frames": FRAMES, "stride": 2}
    pipeline = source.pipeline.with_pruner(MethodPruner(EvsEncoderMethod(), params, "block", layer))
    with torch.inference_mode():
        return pipeline(torch.from_numpy(clip))


def test_encoder_graph_is_standard_ops_and_the_later_block_runs_on_the_kept_tokens(encoder_result):
    import onnx

    assert encoder_result.report.passed
    method = encoder_result.manifest.method
    assert (method.name, method.layer, method.keep, method.tokens_in, method.tokens_out) == \
        ("evs-encoder", 1, 12, 17, FRAMES + 12 * 4)  # the 6 frames' [CLS], then 12 windows of 2x2 patches
    model = onnx.load(str(encoder_result.bundle / "model.decomposed.onnx"))  # before ort's own attention fusion
    onnx.checker.check_model(model, full_check=True)
    ops = {n.op_type for n in model.graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node) and ops <= STANDARD, ops - STANDARD
    outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert outputs["image_features"] == [1, 12, 48] and outputs["kept_indices"] == [1, 12]
    # block 2's attention logits: one sequence of 54 tokens, not 6 frames of 17
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    softmax = [n for n in inferred.graph.node if n.op_type == "Softmax"]
    assert [shapes.get(s.output[0]) for s in softmax] == [[FRAMES, 2, 17, 17], [1, 2, 54, 54]]


def test_encoder_bundle_numbers_are_the_reference(encoder_result, lnv_dir):
    from vlmprune.targets.runtime import ort_session, run_session

    source = video_source(lnv_dir)
    rng = np.random.default_rng(5)  # a fixed seed: random frames, then a still stretch (frames 3-4 equal to 2)
    clip = rng.standard_normal((FRAMES, 3, SIZE, SIZE)).astype(np.float32)
    clip[3:5] = clip[2]
    out = run_session(ort_session(str(encoder_result.bundle / "model.onnx")), clip)
    features, kept = pruned_reference(source, clip)
    np.testing.assert_array_equal(out["kept_indices"], kept.numpy())
    assert not set(range(3 * PER_FRAME, 5 * PER_FRAME)) & set(kept[0].tolist())  # the repeated frames: dropped
    assert set(range(PER_FRAME)) <= set(kept[0].tolist())
    np.testing.assert_allclose(out["image_features"], features.numpy(), rtol=1e-4,
                               atol=1e-4 * float(features.abs().max()))
    from vlmprune.compiler.pipeline import check_bundle

    assert check_bundle(encoder_result.bundle).passed  # `vlmprune check`: the model reloaded as a clip, parity again


def test_encoder_later_blocks_are_each_frame_alone(lnv_dir, hf_model):
    """The per-frame mask is per-frame attention: each frame's [CLS] and kept patches through HF's own CLIP layer 2,
    alone, then HF's resampler and projector over the frame's windows, give the kept rows."""
    from vlmprune.passes.methods.evs_encoder import window_order, window_scores
    from vlmprune.passes.methods.selection import topk_lower_index

    source = video_source(lnv_dir)
    clip = torch.from_numpy(np.stack([preprocess(f, SIZE, source.mean, source.std)
                                      for f in clip_made_here(FRAMES, SIZE)]))
    features, kept = pruned_reference(source, clip.numpy())
    tower, model = hf_model.model.vision_tower, hf_model.model
    with torch.inference_mode():
        h = tower.encoder.layers[0](tower.pre_layrnorm(tower.embeddings(clip)), None)
        expected_kept = topk_lower_index(window_scores(h[:, 1:], FRAMES, 2), 12).sort(dim=-1).values
        assert kept.tolist() == expected_kept.tolist()
        order = torch.from_numpy(window_order(4, 2))
        rows = []
        for j in kept[0].tolist():
            f, m = divmod(j, PER_FRAME)
            frame_windows = [k % PER_FRAME for k in kept[0].tolist() if k // PER_FRAME == f]
            patches = torch.cat([order[w * 4:(w + 1) * 4] for w in frame_windows])
            x = torch.cat([h[f:f + 1, :1], h[f:f + 1, 1 + patches]], dim=1)
            x = tower.encoder.layers[1](x, None)
            window = x[0, 1 + 4 * frame_windows.index(m): 1 + 4 * frame_windows.index(m) + 4]  # its 2x2, raster
            pooled = model.vision_resampler(window.reshape(1, 4, -1))  # one 2x2 window: AvgPool over it
            rows.append(model.multi_modal_projector(pooled)[0, 0])
    expected = torch.stack(rows)[None]
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("target", ["orin", "xavier"])
def test_encoder_tensorrt_targets_host_parity(lnv_dir, tmp_path, target):
    result = encoder_bundle(lnv_dir, tmp_path / target, target=target)
    assert result.report.passed, result.manifest["parity"]


def test_encoder_refusals(lnv_dir, tmp_path):
    with pytest.raises(InputError, match="no block after it"):
        encoder_bundle(lnv_dir, tmp_path / "last", layer=2)
    with pytest.raises(InputError, match=r"4 <= keep < 24"):
        encoder_bundle(lnv_dir, tmp_path / "keep", keep=3)
    with pytest.raises(InputError, match="not available for anyres crops"):  # images: the crops, no clip
        compile_model(str(lnv_dir), tmp_path / "image", CompileOptions(method="evs-encoder", keep=12, layer=1,
                                                                      target="ort", cache=False))
    with pytest.raises(InputError, match="cannot take --schedule"):
        encoder_bundle(lnv_dir, tmp_path / "schedule", method_options={"schedule": "1,2"})
    for target in ("rk3588", "qnn"):
        with pytest.raises(InputError, match=f"{target} cannot run this video bundle"):
            encoder_bundle(lnv_dir, tmp_path / target, target=target)


def test_encoder_needs_a_clip_and_a_tiling_stride():
    from vlmprune.passes.methods.base import SiteSpec
    from vlmprune.passes.methods.evs_encoder import EvsEncoderMethod

    method = EvsEncoderMethod()
    with pytest.raises(InputError, match="needs a clip"):
        method.check({"keep": 4}, SiteSpec(16, True, 1, 2, merge=2))
    with pytest.raises(InputError, match="not a square grid they tile"):
        method.check({"keep": 9}, SiteSpec(25, True, 1, 2, merge=2, frames=4))


# ---------------------------------------------------------------------- generate: the LLM answers about a clip

VOCAB, VIDEO_TOKEN, PROMPT = 320, 301, "what moves?"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A byte-sized vocabulary (generate's prompt without a tokenizer), the video token above the bytes."""
    return tiny_llava_next_video(tmp_path_factory.mktemp("lnv_chat"), seed=22, video_token_id=VIDEO_TOKEN,
                                 vocab_size=VOCAB)


@pytest.fixture(scope="module")
def chat_bundle(chat_dir, tmp_path_factory):
    return encoder_bundle(chat_dir, tmp_path_factory.mktemp("lnv_chat_bundle") / "b")


def test_dense_clip_splice_is_the_hf_forward(chat_bundle):
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.evaluate import hf_first_logits

    vlm = gen.load_vlm(str(chat_bundle.manifest.model.source), bundle=load_manifest(chat_bundle.bundle))
    assert vlm.source.frames == FRAMES
    pixel = np.stack([preprocess(f, SIZE, vlm.source.mean, vlm.source.std) for f in clip_made_here(FRAMES, SIZE)])
    prompt = gen.build_prompt(vlm, PROMPT)
    image = gen.dense_image(vlm, pixel)
    assert image.rows.shape == (FRAMES * PER_FRAME, 48)
    positions, text_start = image.place(len(prompt.before))
    ours = gen.answer(vlm, prompt, image.rows, positions, text_start, 1)
    hf = hf_first_logits(vlm, prompt, pixel, FRAMES * PER_FRAME)
    torch.testing.assert_close(ours.first_logits, hf, rtol=0, atol=1e-4)


def test_generate_answers_through_the_encoder_pruned_clip(chat_bundle, tmp_path):
    from vlmprune.compiler import api
    from vlmprune.compiler.frontend.video import write_frames

    folder = write_frames(clip_made_here(FRAMES, SIZE), tmp_path / "frames")
    result = api.generate(chat_bundle.bundle, video=folder, prompt=PROMPT, max_new_tokens=3)
    assert result.path == "pruned" and len(result.kept) == 12 and len(result.answer.tokens) >= 1
    assert set(range(PER_FRAME)) <= set(result.kept)
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    show = tmp_path / "kept.png"
    ran = CliRunner().invoke(main, ["run", str(chat_bundle.bundle), "--video", str(folder), "--show", str(show)])
    assert ran.exit_code == 0, ran.output
    assert "kept_indices: shape [1, 12]" in ran.output and show.exists()  # one picture per frame, kept outlined
    with pytest.raises(InputError, match="pass --video PATH"):
        from PIL import Image

        image = tmp_path / "frame.png"
        Image.fromarray(clip_made_here(2, SIZE)[0]).save(image)
        api.generate(chat_bundle.bundle, image=image, prompt=PROMPT)


def test_encoder_rows_comparable_across_a_tie_are_the_agreeing_frames():
    """A boundary tie that keeps another window of frame 1 changes frame 1's rows (its tokens attend to each other),
    never frame 0's or 2's: parity compares those."""
    from vlmprune.passes.methods.evs_encoder import EvsEncoderMethod

    params = {"keep": 7, "frames": 3, "stride": 2, "rows_per_frame": 4}
    ref, cand = np.array([0, 1, 2, 3, 5, 6, 9]), np.array([0, 1, 2, 3, 5, 7, 9])
    assert EvsEncoderMethod().comparable_rows(params, ref, cand).tolist() == [0, 1, 2, 3, 9]


def test_encoder_pruning_rate_is_vllms_count_over_pooled_rows():
    from vlmprune.passes.methods.base import SiteSpec
    from vlmprune.passes.methods.evs_encoder import EvsEncoderMethod

    method = EvsEncoderMethod()
    params = method.parse(1, {"video_pruning_rate": 0.5})
    fitted = method.at_site(params, SiteSpec(16, True, 1, 2, merge=2, frames=6))  # 4 pooled rows per frame
    assert (fitted["keep"], fitted["frames"], fitted["stride"], fitted["rows_per_frame"]) == (12, 6, 2, 4)
    with pytest.raises(InputError, match="must be < 1"):
        method.parse(1, {"video_pruning_rate": 1.0})
