"""holov equals HoloV's official algorithm on a tiny LLaVA's real tensors.

The oracle is the official code's logic (obananas/HoloV, llava/model/utils.py `HoloV` on what
llava/model/multimodal_encoder/clip_encoder.py hands it: the projector output of
hidden_states[select_layer][:, 1:] and attentions[select_layer][:, :, 0, 1:] averaged over heads),
rewritten here in plain torch, one image at a time as the official code runs it, taking its
tensors from the Hugging Face model itself (eager attention, output_attentions) and sharing no
code with vlmprune. It differs from the official code only where vlmprune's contract says so:
an over-full crop's surplus goes to the other crops by weight (no zero tokens), ties go to the
lower index, kept tokens come in raster order, and the pruned tokens' mean follows them.
The bundle (model.decomposed.onnx, ONNX Runtime) must keep the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmprune.compiler.contract import DECOMPOSED
from vlmprune.compiler.pipeline import CompileOptions, compile_model
from vlmprune.targets.runtime import ort_session

KEEP = 16


def official_holov(tokens: torch.Tensor, attn: torch.Tensor, num_patches: int, keep: int, esp: float = 1e-6):
    """One image: tokens [N, D], attn [N] -> (kept ascending, context token)."""
    n = tokens.shape[0]
    patch_size, remainder = n // num_patches, n % num_patches
    patches, start = [], 0
    for p in range(num_patches):
        size = patch_size + (1 if p < remainder else 0)
        if size > 0:
            patches.append(torch.arange(start, start + size))
        start += size
    scores = []
    for idx in patches:
        patch_tokens, patch_attn = tokens[idx], attn[idx]
        if len(idx) <= 1:
            scores.append(patch_attn.mean())
            continue
        normalised = patch_tokens / (patch_tokens.norm(dim=1, keepdim=True) + esp)
        sim = (normalised @ normalised.T) * (1 - torch.eye(len(idx), dtype=tokens.dtype))
        mean_sim = sim.sum(dim=1) / (len(idx) - 1)
        var_sim = ((sim - mean_sim.unsqueeze(1)) ** 2).sum(dim=1) / (len(idx) - 1)
        scaled = patch_attn * 1e3
        var_scaled = var_sim * (scaled.abs().mean() / (var_sim.abs().mean() + esp))
        scores.append((scaled + 0.09 * var_scaled).mean())
    scores = torch.stack(scores)
    weights = scores / (scores.sum() + esp)
    allocated = (weights * keep).floor().long()
    order = sorted(range(len(patches)), key=lambda c: (-weights[c].item(), c))  # ties: the lower crop
    for c in order[: keep - int(allocated.sum())]:
        allocated[c] += 1
    sizes = [len(idx) for idx in patches]
    surplus = sum(max(0, int(allocated[c]) - sizes[c]) for c in range(len(patches)))
    allocated = [min(int(allocated[c]), sizes[c]) for c in range(len(patches))]
    for c in order:  # vlmprune's deviation: the surplus to the other crops, largest weight first
        give = min(surplus, sizes[c] - allocated[c])
        allocated[c] += give
        surplus -= give
    kept = []
    for c, idx in enumerate(patches):
        ranked = sorted(idx.tolist(), key=lambda i: (-attn[i].item(), i))  # top by attention, ties: lower
        kept += ranked[: allocated[c]]
    kept.sort()
    pruned = [i for i in range(n) if i not in kept]
    return kept, tokens[pruned].mean(dim=0)


@pytest.mark.parametrize("partitions", [None, 3])
def test_holov_equals_the_official_algorithm_on_a_tiny_llava(tiny_llava_dir, tmp_path, partitions):
    from transformers import LlavaForConditionalGeneration

    options = {} if partitions is None else {"partitions": partitions}
    result = compile_model(str(tiny_llava_dir), tmp_path / "b", CompileOptions(
        target="ort", method="holov", keep=KEEP, batch=3, method_options=options))
    assert result.report.passed, result.manifest["parity"]
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, attn_implementation="eager").eval()
    size = model.config.vision_config.image_size
    pixel = np.random.default_rng(4).standard_normal((3, 3, size, size)).astype(np.float32)
    with torch.no_grad():
        out = model.model.vision_tower(torch.from_numpy(pixel), output_hidden_states=True, output_attentions=True)
        features = model.model.multi_modal_projector(out.hidden_states[-2][:, 1:]).double()
        attn = out.attentions[-2][:, :, 0, 1:].mean(dim=1).double()
    n = features.shape[1]
    num_patches = partitions or max(1, int(((1024 / 576) * n) / KEEP))  # the official Qwen code's default
    session = ort_session(str(tmp_path / "b" / DECOMPOSED))
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"pixel_values": pixel})))
    assert got["image_features"].shape == (3, KEEP + 1, features.shape[2])  # K real tokens + 1 context token
    for i in range(3):
        kept, context = official_holov(features[i], attn[i], num_patches, KEEP)
        assert got["kept_indices"][i].tolist() == kept
        np.testing.assert_allclose(got["image_features"][i, :KEEP], features[i, kept].numpy(), atol=1e-4)
        np.testing.assert_allclose(got["image_features"][i, KEEP], context.numpy(), atol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_llava_dir", "tiny_dinov2_registers_dir"])
def test_holov_with_cls_kept_passes_the_prefix_through(request, tmp_path, fixture):
    """--cls keep: [CLS] (and registers) stay in the features and pass through in front of the kept tokens."""
    result = compile_model(str(request.getfixturevalue(fixture)), tmp_path / "b",
                           CompileOptions(target="ort", method="holov", keep=KEEP, batch=3, cls="keep"))
    assert result.report.passed, result.manifest["parity"]
    method = result.manifest["method"]
    assert method["prefix"] >= 1 and method["tokens_out"] == method["prefix"] + KEEP + 1


def test_holov_on_an_onnx_tower(tiny_dense_path, tmp_path):
    """An .onnx source: the parity reference reads the last block's Q and K from the graph itself."""
    result = compile_model(str(tiny_dense_path), tmp_path / "b", CompileOptions(target="ort", method="holov",
                                                                                keep=KEEP))
    assert result.report.passed, result.manifest["parity"]
    assert result.manifest["method"]["tokens_out"] == KEEP + 1
    rewritten = next(s for s in result.report.stages if s.stage == "rewritten")
    assert rewritten.indices["agreement"] == 1.0
