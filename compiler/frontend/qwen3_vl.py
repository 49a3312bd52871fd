"""Family `qwen3_vl`: Qwen3-VL (Qwen3VLForConditionalGeneration), its vision tower with DeepStack.

Like Qwen2-VL (compiler.frontend.qwen2_vl, whose grid, blocks and mRoPE positions this module
reuses), a bundle is compiled for one static image size S (`--image-size`, a multiple of
patch x merge = 32; default 512: 32x32 = 1024 patches merged 2x2 into 256 tokens), the input
stays `pixel_values` [B, 3, S, S], and the graph is image by image equal to the model's own
get_image_features on the patches Qwen2VLImageProcessor makes (tested against transformers).
What Qwen3-VL adds:
- a patch embedding with a bias, and a learned position table resampled bilinearly to the
  grid: transformers' own interpolation indices and weights on the static grid are constants,
  the table stays a weight (one Gather and a weighted sum in the graph);
- every block attends over the whole image (no windows);
- DeepStack: the outputs of blocks `deepstack_visual_indexes` each go through their own merger
  (its norm after the 2x2 shuffle) and are added into the first LLM layers' hidden states at the
  image rows. Why they travel in `image_features`: a kept token must take every level's row with
  it, so the bundle's features are the L+1 planes side by side, [B, M, (L+1)·D]: plane 0 is the
  merger's output (what replaces the placeholder), plane l the DeepStack row added after LLM
  layer l-1. Pruning keeps rows, so `kept_indices` applies to every plane by construction, on
  every target, with no output of its own to keep in step; the manifest's `llm.deepstack` and the
  bundle README say how to split them. Methods that read the features (divprune's cosine, dart's
  norms) read the whole row, every plane; cls --score attention reads the last block's Q and K.

There is no [CLS]: cls by [CLS] and visionzip are refused in one line (as for Qwen2-VL).
Kept tokens carry their mRoPE positions (t, h, w) (`positions` "thw"): Qwen3-VL's get_rope_index
places a still image as Qwen2-VL's does. Only the vision weights are read (model.visual.*).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from vlmprune.compiler import contract
from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import MERGED_TOKENS, PATCH_TOKENS
from vlmprune.compiler.frontend.qwen2_vl import (QwenGrid, QwenVisionPipeline, Qwen2VLFamily, ThwPositions,
                                                 check_image_size, check_mrope)
from vlmprune.compiler.frontend.source import (CLIP_MEAN, CLIP_STD, Source, load_state, built,
                                               read_safetensors, sha256_files)
from vlmprune.compiler.frontend.tower import Pruner, SiteTensors

DEFAULT_IMAGE_SIZE = 512
MODEL_TYPES = ("qwen3_vl",)
QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)  # Qwen3-VL's preprocessor_config.json


def build_visual(vision_config) -> nn.Module:
    """The Qwen3-VL vision tower of the config, its weights left to the caller."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return built(Qwen3VLVisionModel, vision_config, "sdpa")


class Qwen3Grid(QwenGrid):
    """QwenGrid without windows, plus the position table's bilinear resampling to the static grid.

    interp_index, interp_weight [N, 4]: transformers' own taps (get_vision_interpolation_indices_and_weights)
    in the tower's token order.
    """

    def __init__(self, visual: nn.Module, image_size: int):
        super().__init__(visual, image_size, windowed=False)
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        grid = torch.tensor([[1, self.side, self.side]])
        index, weight = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=self.merge)
        self.register_buffer("interp_index", index.long(), persistent=False)
        self.register_buffer("interp_weight", weight.float(), persistent=False)


class Qwen3VisionPipeline(QwenVisionPipeline):
    """pixel_values [B, 3, S, S] -> [B, M, (L+1)·D]: the merger's output and the L DeepStack planes side by side."""

    def __init__(self, visual: nn.Module, grid: Qwen3Grid, pruner: Pruner | None = None):
        super().__init__(visual, grid, pruner)
        self.deepstack = tuple(visual.deepstack_visual_indexes)

    def with_pruner(self, pruner: Pruner | None) -> Qwen3VisionPipeline:
        return Qwen3VisionPipeline(self.visual, self.grid, pruner)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Patch embedding (Conv3d over equal frames = one MatMul, its bias) plus the resampled position table."""
        h = super().embed(pixel_values) + self.visual.patch_embed.proj.bias
        table = self.visual.pos_embed.weight
        return h + (table[self.grid.interp_index] * self.grid.interp_weight[..., None]).sum(1)

    @staticmethod
    def _merged(merger: nn.Module, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        return merger(h.reshape(b * n, d)).reshape(b, -1, merger.linear_fc2.out_features)

    def forward_planes(self, pixel_values: torch.Tensor, capture: list | None = None) -> torch.Tensor:
        h = self.embed(pixel_values)
        planes, score_block = [], self.score_block() if capture is not None else -1
        for i in range(self.num_blocks):
            h = self.block(i, h, capture if i == score_block else None)
            if i in self.deepstack:
                planes.append(self._merged(self.visual.deepstack_merger_list[self.deepstack.index(i)], h))
        return torch.cat([self._merged(self.visual.merger, h), *planes], dim=-1)

    def forward(self, pixel_values: torch.Tensor):
        capture: list | None = [] if self.pruner is not None else None
        h = self.forward_planes(pixel_values, capture)
        if self.pruner is None:
            return h
        order = self.features_order()
        q, k, scale = capture[0][:, :, order], capture[1][:, :, order], capture[2]
        tokens, kept, self.last_trace = self.pruner(SiteTensors(h, False, q=q, k=k, scale=scale,
                                                                pixel_values=pixel_values,
                                                                patch_size=self.patch_size, prefix=0))
        return tokens, kept


def deepstack_layout(visual: nn.Module) -> dict:
    """What the manifest and README say of the planes of image_features."""
    cfg = visual.config
    levels = list(cfg.deepstack_visual_indexes)
    width = cfg.out_hidden_size
    return {"planes": 1 + len(levels), "plane_width": width, "levels": levels,
            "columns": [[0, width]] + [[width * (i + 1), width * (i + 2)] for i in range(len(levels))],
            "rule": (f"image_features[..., 0:{width}] replaces the image placeholder (inputs_embeds); plane l = "
                     f"image_features[..., {width}·l:{width}·(l+1)] for l = 1..{len(levels)} (the merger of vision "
                     f"block l-1 of {levels}, 0-based) is added to the image rows of the hidden states after LLM "
                     "layer l-1 (deepstack_visual_embeds); every plane's rows are the kept tokens of kept_indices")}


def qwen3_source(spec: str, kind: str, visual: nn.Module, image_size: int, content_hash: str,
                 mean=QWEN3_MEAN, std=QWEN3_STD) -> Source:
    """The Source of a loaded Qwen3-VL vision tower at a static image size (checkpoints and presets alike)."""
    cfg = visual.config
    check_image_size(image_size, cfg.patch_size * cfg.spatial_merge_size)
    grid = Qwen3Grid(visual, image_size)
    pipeline = Qwen3VisionPipeline(visual, grid).eval()
    m = grid.merged_side
    tokens = {"image_size": image_size, "patch_grid": [grid.side, grid.side], "patches": grid.num_patches,
              "spatial_merge": grid.merge, "merged_grid_thw": [1, m, m], "tokens": grid.num_tokens}
    details = {"model_type": "qwen3_vl", "feature_layer": -1,
               "select_strategy": "every merged token (no [CLS]), DeepStack planes beside each",
               "vision_layers": len(visual.blocks), "token_counts": tokens, "deepstack": deepstack_layout(visual),
               "positions_layout": "kept_positions [B, K, 3] = (t, h, w) in the merged grid; add the text offset "
                                   "(get_rope_index's start position) for the LLM's mRoPE"}
    return Source(spec, kind, Qwen3VLAdapter.family, content_hash, image_size, cfg.patch_size, False, tuple(mean),
                  tuple(std), pipeline=pipeline, positions="thw", spatial_merge=grid.merge,
                  position_table=grid.positions(), details=details)


class Qwen3VLAdapter(ModelAdapter):
    family = "qwen3_vl"
    model_types = MODEL_TYPES
    summary = "Qwen3-VL vision tower + merger + DeepStack mergers at a static --image-size; kept (t, h, w) positions"
    dynamic_resolution: ClassVar[bool] = True  # takes --image-size

    def load(self, checkpoint: Checkpoint, feature_layer: int | None, image_size: int | None = None) -> Source:
        if feature_layer is not None:
            raise InputError(f"--feature-layer does not apply to {checkpoint.model_type}: its image features are "
                             "the patch merger's output after the last block (and the DeepStack mergers')")
        check_mrope(checkpoint)
        vcfg = checkpoint.config.vision_config
        unit = vcfg.patch_size * vcfg.spatial_merge_size
        image_size = check_image_size(DEFAULT_IMAGE_SIZE if image_size is None else image_size, unit)
        visual = build_visual(vcfg)
        state = read_safetensors(checkpoint.weights, ("model.visual.", "visual."))
        if not state:
            raise InputError(f"{checkpoint.path}: no vision weights (model.visual.* or visual.*) in the safetensors")
        load_state(visual, state, "vision tower")
        mean, std = checkpoint.preprocessing(QWEN3_MEAN, QWEN3_STD)
        return qwen3_source(str(checkpoint.path.resolve()), "hf", visual, image_size,
                            sha256_files(checkpoint.files()), mean, std)


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen2-VL's static size and (t, h, w) positions; image_features carry the DeepStack planes beside each row."""

    id = "qwen3_vl"
    adapter = Qwen3VLAdapter
    options = {"image_size": (int, "Static image size S for qwen3_vl: a multiple of patch x merge (32). Default 512 "
                                   "(1024 patches, 256 merged tokens).")}
    has = {PATCH_TOKENS: "Qwen3-VL", MERGED_TOKENS: "Qwen3-VL"}
    positions = ThwPositions()
    language_model = {"qwen3_vl": "Qwen3VLForConditionalGeneration"}
    whole_vlm_llm = ()  # not Qwen2-VL's: no exporter here takes a Qwen3-VL checkpoint whole

    def hf_image_features(self, out):
        """The bundle's row layout from get_image_features: the merger's rows, then each DeepStack level's."""
        return torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1)

    def llm_image_rows(self, model, features):
        """Plane 0 through the model's own splice, the DeepStack planes as its own image encoder outputs.

        The model's forward takes encoder outputs (mm_encoder_outputs) and finds the image rows by the placeholder's
        embedding: so the rows of inputs_embeds are the placeholder's, and transformers itself scatters plane 0 into
        them and adds plane l after LLM layer l-1, exactly as for its own tower's output.
        """
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        planes = features.split(model.config.text_config.hidden_size, dim=-1)
        embed = model.get_input_embeddings()
        placeholder = embed(torch.tensor([model.config.image_token_id])).expand(len(features), -1)
        image = BaseModelOutputWithDeepstackFeatures(pooler_output=(planes[0],),
                                                     deepstack_features=[(p,) for p in planes[1:]])
        return placeholder, {"mm_encoder_outputs": {"image": image}}

    def llm_graph_image_rows(self, model, features):
        """Plane 0 as the graph's image rows, the DeepStack planes as its deepstack_embeds there (TorchExporter's
        prefill adds level l after layer l, as transformers does)."""
        planes = features.split(model.config.text_config.hidden_size, dim=-1)
        return planes[0], {contract.DEEPSTACK: torch.stack(planes[1:])[:, None]} if len(planes) > 1 else {}

    def llm_handoff(self, model: dict) -> dict:
        """The manifest's llm section: the LLM's width is one plane's, and where each DeepStack level's rows are."""
        deepstack = model.get("deepstack")
        if not deepstack:
            return {}
        width = deepstack["plane_width"]
        levels = [{"vision_block": block, "added_after_llm_layer": i, "output": contract.FEATURES,
                   "columns": deepstack["columns"][i + 1], "kept_indices": contract.KEPT}
                  for i, block in enumerate(deepstack["levels"])]
        return {"hidden_size": width,
                "deepstack": {"embeds_columns": deepstack["columns"][0], "levels": levels, "rule": deepstack["rule"]}}

    def readme_section(self, manifest: Manifest) -> str:
        deepstack = manifest.model.deepstack
        if not deepstack:
            return ""
        return ("\n## Qwen3-VL DeepStack planes\n\n"
                f"`image_features` holds {deepstack['planes']} planes of {deepstack['plane_width']} columns side by "
                f"side (DeepStack levels: vision blocks {deepstack['levels']}, 0-based). {deepstack['rule']}.\n")
