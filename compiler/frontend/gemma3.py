"""Family `gemma3`: Gemma 3 (Gemma3ForConditionalGeneration, transformers' native `gemma3` model_type).

Its vision tower is SigLIP (SiglipVisionModel without its attention-pooling head: no [CLS], learned absolute
positions, pre-norm blocks, post_layernorm), run through VisionPipeline as CLIP's is; the connector is
Gemma3MultiModalProjector: 4x4 average pooling of the patch grid, an RMSNorm, and one matrix into the Gemma 3
LLM's width. At Gemma 3 4B's 896 px, patch 14: 64x64 = 4096 patches pooled into 16x16 = 256 tokens, raster order.

What the graph computes, image by image equal to the model's own get_image_features (tested against
transformers, fp32): the tower's last_hidden_state (post_layernorm included; Gemma 3 has no feature-layer
choice), the connector as transformers' own module (its weights, its AvgPool2d). A bundle takes one image at the
tower's size: Gemma 3's pan-and-scan crops (off by default in its processor) are not compiled; each crop is an image
of the batch.

Where pruning goes: after the connector, on the pooled tokens (the features site; Source.spatial_merge 4):
divprune, dart, and random / grid with --site features. Refused in one line before any work: block-site methods
(cls, visionzip, tome, ...), since the 4x4 pooling needs the full patch grid and a method there keeps single
patches (keeping whole 4x4 groups inside the tower would need a group-wise selection and a pooling over the kept
groups, which the methods do not have); and methods that score by the tower's attention or its feature layer
(holov, cls --score attention, cdpruner), since that runs over single patches (and the received-attention score
pools consecutive patches, Qwen's group order, not a raster grid's 4x4 squares). The patch Conv is spelled as one
MatMul (as InternVL's and Qwen2-VL's are), so the site finder counts the pooled tokens at the features site.
Kept tokens carry their index in the 16x16 pooled grid (`positions` "indices"): the Gemma 3 LLM's 1-D positions,
original-positions rule.

The LLM side: Gemma 3's LLM attends bidirectionally among the tokens of one image (transformers builds that mask
from token_type_ids, 1 at the image tokens) and causally elsewhere; its chat template writes the image as its
boi token, which the processor expands to "\\n\\n<boi>" + the image tokens + "<eoi>\\n\\n". `generate` and `eval`
run it so (llm_forward_args, image_prompt): the K kept rows are the one image block, at their original positions.
`--with-llm` exports its language model (compiler.llm.torch_exporter: Gemma 3's layer, sliding-window layers masked
in the graph); the prefill graph takes the image block as its `image_rows` input (llm_graph_image_rows: 1 at the K
kept rows), and the manifest's llm section says so (llm_handoff). FastV is refused for it (compiler.llm.lm_source).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler import contract
from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.merged import (MergedTokensFamily, conv_as_matmul, load_tower_and_connector,
                                               siglip_block, token_counts)
from vlmprune.compiler.frontend.source import Source, inner_tower, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tower import TowerParts, VisionPipeline

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's defaults
MODEL_TYPES = ("gemma3",)
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Gemma 3's processor: its chat template's boi token becomes "\n\n<boi>" + the image tokens + "<eoi>\n\n"; without a
# template, its chat turns (the tokenizer's chat template's, with the tokenizer's <bos> left to the tokenizer).
BOI, EOI = "<start_of_image>", "<end_of_image>"
IMAGE_PROMPT = ImagePrompt(f"\n\n{BOI}", f"{EOI}\n\n", mark=BOI,
                           convention="<start_of_turn>user\n{mark}{prompt}<end_of_turn>\n<start_of_turn>model\n",
                           specials=((BOI, "boi_token_index"), (EOI, "eoi_token_index")))


def build_tower(vision_config) -> nn.Module:
    """The SiglipVisionModel of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers import SiglipVisionModel

    return built(SiglipVisionModel, vision_config, "sdpa")


def build_projector(config) -> nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    return built(Gemma3MultiModalProjector, config)


def tower_parts(tower) -> TowerParts:
    """How VisionPipeline runs Gemma 3's SigLIP: CLIP's block layout, post_layernorm last, the Conv as a MatMul."""
    vm = inner_tower(tower)
    return TowerParts(vm, lambda pixel_values: embed(vm.embeddings, pixel_values), list(vm.encoder.layers),
                      siglip_block, vm.post_layernorm)


def embed(embeddings, pixel_values: torch.Tensor) -> torch.Tensor:
    """[B, 3, S, S] -> patch embeddings + positions [B, N, D], as SiglipVisionEmbeddings at its own size.

    The patch Conv is spelled as one MatMul over the flattened patches: the site finder then reads the token count
    at the features site as the pooled tokens', not the Conv's patch grid.
    """
    return conv_as_matmul(embeddings.patch_embedding, pixel_values) + embeddings.position_embedding.weight


def gemma3_source(spec: str, kind: str, config, tower: nn.Module, projector: nn.Module, content_hash: str | None,
                  mean=SIGLIP_MEAN, std=SIGLIP_STD) -> Source:
    """The Source of a loaded Gemma 3 tower and connector (checkpoints and presets alike)."""
    vcfg = config.vision_config
    image_size, patch = int(vcfg.image_size), int(vcfg.patch_size)
    side = image_size // patch
    tokens = int(config.mm_tokens_per_image)
    per_side = round(tokens ** 0.5)
    if per_side * per_side != tokens or side % per_side:
        raise InputError(f"Gemma 3 mm_tokens_per_image {tokens} must be a square whose side divides the {side}-patch "
                         "grid")
    pool = side // per_side
    pipeline = VisionPipeline(tower_parts(tower), projector, vcfg.num_hidden_layers, True, False, patch,
                              final_norm=True).eval()
    counts = token_counts(image_size, patch, pool)
    details = {"model_type": "gemma3", "feature_layer": -1, "select_strategy": "full (no [CLS])",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": counts,
               "connector": f"average pooling {pool}x{pool} + RMSNorm + linear (Gemma3MultiModalProjector)",
               "input": "one image at the tower's size (Gemma 3's pan-and-scan crops are not compiled: each crop is "
                        "an image)"}
    return Source(spec, kind, Gemma3Adapter.family, content_hash or sha256_state(pipeline), image_size, patch,
                  False, tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=pool, details=details)


class Gemma3Adapter(ModelAdapter):
    family = "gemma3"
    model_types = MODEL_TYPES
    summary = "Gemma 3 (Gemma3ForConditionalGeneration): SigLIP tower + 4x4 average pooling + RMSNorm + linear"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        if feature_layer is not None:
            raise InputError("--feature-layer does not apply to gemma3: its image features are the SigLIP tower's "
                             "last_hidden_state, pooled by its connector")
        config = checkpoint.config
        if getattr(config.vision_config, "model_type", None) != "siglip_vision_model":
            raise InputError(f"Gemma 3 vision tower type {config.vision_config.model_type!r} is not supported "
                             "(SigLIP)")
        tower = build_tower(config.vision_config)
        projector = build_projector(config)
        load_tower_and_connector(checkpoint, inner_tower(tower), TOWER_PREFIXES, projector, PROJECTOR_PREFIXES)
        mean, std = checkpoint.preprocessing(SIGLIP_MEAN, SIGLIP_STD)
        return gemma3_source(str(checkpoint.path.resolve()), "hf", config, tower, projector,
                             sha256_files(checkpoint.files()), mean, std)


class Gemma3Family(MergedTokensFamily):
    """A SigLIP tower whose connector pools 4x4 patch groups: pruned on the pooled tokens, after the connector."""

    id = "gemma3"
    adapter = Gemma3Adapter
    has = {PATCH_TOKENS: "Gemma 3"}
    language_model = {"gemma3": "Gemma3ForConditionalGeneration"}
    why_not_block = ("Gemma 3's connector average-pools each 4x4 group of the full patch grid into one token after "
                     "the tower, so pruning single patches inside it breaks the pooling")
    why_not_scored = ("scores the pooled tokens by the tower's attention or patches, and Gemma 3's SigLIP attention "
                      "runs over single patches, not over the pooled tokens")

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """The processor's expansion of its template's boi token (fixed text: nothing read from the tokenizer)."""
        return IMAGE_PROMPT

    def llm_forward_args(self, length: int, image: slice) -> dict:
        """token_type_ids (1 at the image rows): transformers' Gemma 3 then lets the image rows attend to each other
        both ways (its bidirectional image block), the rest causally. And an attention mask of ones: without one, its
        mask builder (run before any cache exists) reads position ids that jump (the pruned tokens' gaps) as packed
        sequences (transformers 5.25 then fails on the gaps)."""
        types = torch.zeros(1, length, dtype=torch.long)
        types[0, image] = 1
        return {"token_type_ids": types, "attention_mask": torch.ones(1, length, dtype=torch.long)}

    def llm_graph_image_rows(self, model, features):
        """The rows themselves, and the exported prefill's image_rows input at them (1: the kept rows are one image
        block, seen both ways, as token_type_ids 1 makes them in transformers); generate gives 0 at the text rows."""
        return features, {contract.IMAGE_ROWS: torch.ones(1, len(features), 1)}

    def llm_handoff(self, model: dict) -> dict:
        """The manifest's llm section: the image rows are one bidirectional block (what a runtime must mask so)."""
        return {"image_block": {
            "rows": "every image_features row of one image (prefix, kept and extra rows alike), consecutive",
            "transformers": "token_type_ids 1 at those rows (and an attention_mask of ones: the kept rows' positions "
                            "have gaps)",
            "llm_graph_input": contract.IMAGE_ROWS,
            "rule": "the image rows attend to each other both ways (Gemma 3's bidirectional image block), every other "
                    "row causally; sliding-window layers see the last sliding_window rows (token indices)"}}

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m, p = manifest.model.merged_grid_thw[1:], counts["patch_grid"]
        return ("\n## Gemma 3 tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} pooled grid (each the average of a "
                f"{counts['spatial_merge']}x{counts['spatial_merge']} group of the {p[0]}x{p[1]} patches, then "
                "RMSNorm and the projection), raster order; kept_indices index that grid. Gemma 3's LLM attends "
                "bidirectionally among one image's tokens: give the K kept rows as one image block (token type 1) "
                "at their original positions, between the boi and eoi tokens.\n")
