"""Family `gemma4`: Gemma 4 (Gemma4ForConditionalGeneration, transformers' native `gemma4` model_type).

Its vision tower is Gemma 4's own encoder (Gemma4VisionModel, not SigLIP): a bias-free Linear over each patch's
(row, column, channel) pixels, a learned 2-D position table (one row per column x plus one per row y), blocks with
RMSNorms before and after the attention and the gated MLP, q/k RMSNorms (v one without scale), attention scale 1 and
a 2-D axial RoPE over the patch grid (half of each head rotated by the patch's column, half by its row), then the
pooler: k x k average pooling of the patch grid (pooling_kernel_size, 3) scaled by sqrt(width), an optional
standardisation, and the connector Gemma4MultimodalEmbedder (an RMSNorm without scale and one matrix into the Gemma 4
LLM's width). At Gemma 4's default processor budget (280 soft tokens), patch 16: a square image is 768 px, 48x48 =
2304 patches pooled 3x3 into 16x16 = 256 tokens, raster order.

Variable aspect and resolution fixed at compile time: the model takes any aspect, its processor resizing each image
to fit its soft-token budget and padding the patch list. A bundle takes one square image at the size that budget
gives a square image (the processor's own rule: 768 px at 280 tokens), so the patch grid, the position rows, the
RoPE tables (transformers' own rotary module, run once) and the pooling are constants of the graph; no padding, so
the tower's attention mask is all ones and is left out. Its processor feeds pixels in [0, 1] and the patch embedder
takes 2(x - 0.5): the bundle's preprocessing is that composition (mean = std = 0.5 for Gemma 4's identity processor).

What the graph computes, image by image equal to the model's own get_image_features (tested against transformers,
fp32): the blocks spelled out over the checkpoint's own modules (norms, projections, MLP; transformers' own
apply_multidimensional_rope), SDPA attention, the pooling as one AvgPool over the grid (4-D, as Gemma 3's connector
is), the scale, the standardisation where the checkpoint has one and transformers' own embedder. Standard ONNX ops
only: the RoPE is Slice/Neg/Concat/Mul/Add over constant tables.

Where pruning goes: after the embedder, on the pooled tokens (the features site; Source.spatial_merge 3): divprune,
dart, and random / grid with --site features. Refused in one line before any work (frontend.merged): block-site
methods (the pooling needs whole 3x3 groups of the full grid) and methods that score by the tower's attention, a
[CLS], a head or the feature layer (none of which reads the pooled tokens). Kept tokens carry their index in the
pooled grid (`positions` "indices"): the Gemma 4 LLM's 1-D positions, original-positions rule.

The LLM side: Gemma 4's processor expands the image token its chat template writes into boi + the image tokens +
eoi; where the text config says use_bidirectional_attention "vision", its sliding-window layers let one image's
tokens attend to each other both ways (mm_token_type_ids 1 there), its global layers stay causal. Its per-layer
embeddings (PLE) read each row's token id, the image rows taking the pad token's: transformers recovers them from
inputs_embeds by reversing the embedding, which spliced image rows defeat, so generate's first forward is given them
(llm_embeds_args). `generate` and `eval` run it so: the K kept rows are the one image block, at their original
positions. `--with-llm` (target ort, the torch exporter; compiler.llm.lm_source declares what Gemma 4's decoder adds):
the graphs take the same per-layer embeddings (`per_layer_inputs`, generate's llm_embeds_args for the prompt, then
for each token) and, where the config asks, the image block as `image_rows` (llm_graph_image_rows).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprune.compiler import contract
from vlmprune.compiler.contract import Manifest, QuantizationNeeds
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.adapter import Checkpoint, ModelAdapter
from vlmprune.compiler.frontend.family import PATCH_TOKENS, ImagePrompt
from vlmprune.compiler.frontend.merged import MergedTokensFamily, load_tower_and_connector, patches, token_counts
from vlmprune.compiler.frontend.source import Source, built, sha256_files, sha256_state
from vlmprune.compiler.frontend.tower import FEATURES, Pruner, SiteTensors

GEMMA4_MEAN = GEMMA4_STD = (0.5, 0.5, 0.5)  # rescale to [0, 1] (its processor), then 2(x - 0.5) (its embedder)
MODEL_TYPES = ("gemma4",)
SOFT_TOKENS = 280  # Gemma4ImageProcessor's default max_soft_tokens
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
EMBEDDER_PREFIXES = ("model.embed_vision.", "embed_vision.")
# Without a tokenizer (tiny models): the processor's marks as text, each mapped to its id in the config; Gemma 4's
# turns as its chat template writes them are the checkpoint's own (its template), not written here.
BOI, EOI, IMAGE = "<boi>", "<eoi>", "<image>"
IMAGE_PROMPT = ImagePrompt(BOI, EOI, mark=IMAGE, convention="<start_of_turn>user\n{mark}{prompt}<end_of_turn>\n"
                                                             "<start_of_turn>model\n",
                           specials=((BOI, "boi_token_id"), (EOI, "eoi_token_id")))


def build_tower(vision_config) -> nn.Module:
    """The Gemma4VisionModel of the config, its weights left to the caller (transformers' slow init skipped)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    return built(Gemma4VisionModel, vision_config, "sdpa")


def build_embedder(config) -> nn.Module:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    from vlmprune.compiler.frontend.source import no_init_weights

    with no_init_weights():
        return Gemma4MultimodalEmbedder(config.vision_config, config.text_config).eval()


def square_size(vision_config, soft_tokens: int) -> int:
    """The side a square image is resized to under the processor's soft-token budget (its own rule)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    p, k = int(vision_config.patch_size), int(vision_config.pooling_kernel_size)
    side, _ = get_aspect_ratio_preserving_size(4096, 4096, p, soft_tokens * k * k, k)
    return side


def grid_positions(side: int) -> torch.Tensor:
    """[1, N, 2] the (x, y) of each patch of a side x side grid, raster order, as Gemma 4's processor gives them."""
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)[None]


def hf_patches(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """A bundle's pixels [B, 3, S, S] (normalised by mean = std = 0.5) -> Gemma 4's processor's [B, N, p·p·3] in
    [0, 1]: what transformers' model takes."""
    return patches(pixel_values * 0.5 + 0.5, patch, channels_last=True)


class Gemma4VisionPipeline(nn.Module):
    """pixel_values [B, 3, S, S] -> pooled, embedded image features [B, L, D'], with an optional FEATURES pruner.

    The interface compiler code asks of a pipeline (VisionPipeline's): with_pruner, num_blocks, prefix, has_cls,
    drop_cls, patch_size, last_trace, prune_features. Buffers (constants of the export, never in the state dict):
    the grid's position indices and RoPE tables.
    """

    def __init__(self, tower: nn.Module, embedder: nn.Module, side: int, pruner: Pruner | None = None):
        super().__init__()
        if pruner is not None and pruner.site != FEATURES:
            raise InputError("gemma4 towers are pruned on the pooled tokens (the features site) only")
        cfg = tower.config
        self.vision_model, self.projector, self.side, self.pruner = tower, embedder, side, pruner
        self.patch_size, self.kernel = int(cfg.patch_size), int(cfg.pooling_kernel_size)
        self.num_blocks = len(tower.encoder.layers)
        self.has_cls, self.prefix, self.drop_cls = False, 0, True
        self.last_trace: dict | None = None
        positions = grid_positions(side)
        self.register_buffer("positions", positions, persistent=False)
        self.register_buffer("xs", positions[0, :, 0].clone(), persistent=False)
        self.register_buffer("ys", positions[0, :, 1].clone(), persistent=False)
        with torch.no_grad():  # transformers' own rotary module on the fixed grid: [1, N, head_dim]
            cos, sin = tower.encoder.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def with_pruner(self, pruner: Pruner | None) -> Gemma4VisionPipeline:
        return Gemma4VisionPipeline(self.vision_model, self.projector, self.side, pruner)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, N, D]: the patches (row, column, channel) through input_proj, plus the x and y rows of
        the position table (the 2(x - 0.5) is the bundle's normalisation)."""
        embedder = self.vision_model.patch_embedder
        table = embedder.position_embedding_table
        positions = torch.index_select(table[0], 0, self.xs) + torch.index_select(table[1], 0, self.ys)
        return embedder.input_proj(patches(pixel_values, self.patch_size, channels_last=True)) + positions

    def block(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One Gemma4VisionEncoderLayer, spelled out: sandwich norms, q/k/v norms, 2-D RoPE, SDPA at scale 1."""
        from transformers.models.gemma4.modeling_gemma4 import apply_multidimensional_rope, repeat_kv

        attn = layer.self_attn
        b, n, _ = h.shape
        x = layer.input_layernorm(h)
        shape = (b, n, -1, attn.head_dim)
        q = apply_multidimensional_rope(attn.q_norm(attn.q_proj(x).view(shape)), self.cos, self.sin, self.positions)
        k = apply_multidimensional_rope(attn.k_norm(attn.k_proj(x).view(shape)), self.cos, self.sin, self.positions)
        v = attn.v_norm(attn.v_proj(x).view(shape))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
        a = attn.o_proj(a.transpose(1, 2).reshape(b, n, -1))
        h = h + layer.post_attention_layernorm(a)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        """Gemma4VisionPooler on a full grid: k x k averages, raster order, times sqrt(width); then the checkpoint's
        standardisation where it has one."""
        tower = self.vision_model
        b, _, d = h.shape
        grid = h.transpose(1, 2).reshape(b, d, self.side, self.side)
        pooled = torch.nn.functional.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        pooled = pooled * tower.pooler.root_hidden_size
        if tower.config.standardize:
            pooled = (pooled - tower.std_bias) * tower.std_scale
        return pooled

    def forward(self, pixel_values: torch.Tensor):
        h = self.embed(pixel_values)
        for layer in self.vision_model.encoder.layers:
            h = self.block(layer, h)
        h = self.projector(self.pool(h))
        if self.pruner is None:
            return h
        return self.prune_features(h, pixel_values)

    def prune_features(self, features: torch.Tensor, pixel_values: torch.Tensor, qk: tuple | None = None):
        """The pruner on features the dense forward gave: (tokens, kept)."""
        tokens, kept, self.last_trace = self.pruner(SiteTensors(features, False, pixel_values=pixel_values,
                                                                patch_size=self.patch_size, prefix=0))
        return tokens, kept


def gemma4_source(spec: str, kind: str, config, tower: nn.Module, embedder: nn.Module, content_hash: str | None,
                  soft_tokens: int = SOFT_TOKENS, mean=GEMMA4_MEAN, std=GEMMA4_STD) -> Source:
    """The Source of a loaded Gemma 4 tower and embedder at the square size of its processor's budget."""
    vcfg = config.vision_config
    patch, k = int(vcfg.patch_size), int(vcfg.pooling_kernel_size)
    size = square_size(vcfg, soft_tokens)
    side = size // patch
    if side > int(vcfg.position_embedding_size):
        raise InputError(f"Gemma 4's {side}x{side} patch grid exceeds its position table "
                         f"({vcfg.position_embedding_size} rows per axis)")
    pipeline = Gemma4VisionPipeline(tower, embedder, side).eval()
    counts = token_counts(size, patch, k)
    standardize = " + standardisation" if vcfg.standardize else ""
    details = {"model_type": "gemma4", "feature_layer": -1, "select_strategy": "full (no [CLS])",
               "vision_layers": vcfg.num_hidden_layers, "projector": True, "token_counts": counts,
               "connector": f"average pooling {k}x{k} x sqrt(width){standardize} + RMSNorm + linear "
                            "(Gemma4VisionPooler, Gemma4MultimodalEmbedder)",
               "input": f"one square image at {size} px (its processor's {soft_tokens}-token budget for a square "
                        "image; variable aspect and resolution fixed at compile time)"}
    return Source(spec, kind, Gemma4Adapter.family, content_hash or sha256_state(pipeline), size, patch, False,
                  tuple(mean), tuple(std), pipeline=pipeline, spatial_merge=k, details=details)


def preprocessing(checkpoint: Checkpoint) -> tuple[int, tuple, tuple]:
    """(soft-token budget, mean, std) from its preprocessor_config.json: the processor's normalisation (identity by
    default) composed with the embedder's 2(x - 0.5): mean m + s/2, std s/2."""
    import json

    pre = checkpoint.path / "preprocessor_config.json"
    prep = json.loads(pre.read_text()) if pre.is_file() else {}
    mean, std = (0.0,) * 3, (1.0,) * 3
    if prep.get("do_normalize", False):
        mean, std = tuple(prep.get("image_mean", mean)), tuple(prep.get("image_std", std))
    return (int(prep.get("max_soft_tokens", SOFT_TOKENS)), tuple(m + s / 2 for m, s in zip(mean, std)),
            tuple(s / 2 for s in std))


class Gemma4Adapter(ModelAdapter):
    family = "gemma4"
    model_types = MODEL_TYPES
    summary = "Gemma 4 (Gemma4ForConditionalGeneration): its own 2-D RoPE tower + 3x3 average pooling + embedder"

    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        if feature_layer is not None:
            raise InputError("--feature-layer does not apply to gemma4: its image features are the tower's last "
                             "output, pooled and embedded")
        config = checkpoint.config
        if getattr(config, "vision_config", None) is None:
            raise InputError(f"{checkpoint.path}: this Gemma 4 has no vision tower (no vision_config)")
        if getattr(config.vision_config, "model_type", None) != "gemma4_vision":
            raise InputError(f"Gemma 4 vision tower type {config.vision_config.model_type!r} is not supported "
                             "(gemma4_vision)")
        soft_tokens, mean, std = preprocessing(checkpoint)
        tower, embedder = build_tower(config.vision_config), build_embedder(config)
        load_tower_and_connector(checkpoint, tower, TOWER_PREFIXES, embedder, EMBEDDER_PREFIXES, "embedder")
        return gemma4_source(str(checkpoint.path.resolve()), "hf", config, tower, embedder,
                             sha256_files(checkpoint.files()), soft_tokens, mean, std)


class Gemma4Family(MergedTokensFamily):
    """Gemma 4's own tower, whose pooler averages 3x3 patch groups: pruned on the pooled tokens, after the embedder."""

    id = "gemma4"
    adapter = Gemma4Adapter
    has = {PATCH_TOKENS: "Gemma 4"}
    language_model = {"gemma4": "Gemma4ForConditionalGeneration"}
    why_not_block = ("Gemma 4's pooler averages each 3x3 group of the full patch grid into one token after the "
                     "tower, so pruning single patches inside it breaks the pooling")
    why_not_scored = ("scores the pooled tokens by the tower's attention or patches, and Gemma 4's tower has no [CLS] "
                      "nor head and attends over single patches, not over the pooled tokens")
    # Measured on qnn (int16: uint16 activations, uint8 weights, k and v read in 8 bits by attention's MatMuls; the
    # tiny Gemma 4 of tests/compiler, weight seeds 0-3, divprune -k 6; the QDQ graph under ONNX Runtime's CPU and on
    # the HTP emulator alike): the dense features' worst-token cosine 0.982-0.995 and kept-index agreement down to
    # 0.33. Taken one group at a time, three losses add up: the uint8 weights (every MatMul's, none dominating; with
    # the weights alone quantized, seeds 0, 1, 3 keep 0.9945, 0.998, 0.996), 16-bit ranges clipped on images past
    # the calibration set's extremes (66 of 413 activations clip on the parity images; the MLP's gate x up product
    # alone costs 0.993 against 0.9995 with the rest in 16 bits), and k and v in 8 bits, which the attention at
    # scale 1 over RMS-normed q and k amplifies through its large logits (fp32 attention once the rest is 16-bit:
    # 0.9986 with them, 0.99999 without). With 16-bit weights, ranges widened 4x and the attention cores float (fp16
    # on HTP), the emulator keeps 0.9990-0.9999 and agreement 1.0 on the parity images of seeds 1-3 (seed 0: one
    # image diverges the same way with fp32 attention).
    quantization = QuantizationNeeds(
        wide_weights="Gemma 4's tower loses int16 parity with 8-bit weights (worst-token cosine 0.994-0.998 from "
                     "them alone)",
        float_attention="its attention at scale 1 over RMS-normed q and k amplifies k and v read in 8 bits",
        headroom=4.0)

    def hf_image_inputs(self, config, source: Source, pixel) -> dict:
        """Gemma4Model takes the processor's patches [1, N, p·p·3] in [0, 1] and their (x, y) on the grid."""
        values = hf_patches(torch.from_numpy(pixel), source.patch_size)
        side = source.image_size // source.patch_size
        return {"pixel_values": values, "image_position_ids": grid_positions(side).expand(len(values), -1, -1)}

    def image_prompt(self, tokenizer) -> ImagePrompt:
        """boi + the image tokens + eoi (Gemma4Processor.replace_image_token), the marks as its tokenizer names
        them; without one, IMAGE_PROMPT's (their ids from the config)."""
        if tokenizer is None or not getattr(tokenizer, "boi_token", None):
            return IMAGE_PROMPT
        return ImagePrompt(tokenizer.boi_token, tokenizer.eoi_token, mark=getattr(tokenizer, "image_token", None))

    def llm_forward_args(self, length: int, image: slice) -> dict:
        """mm_token_type_ids (1 at the image rows): with use_bidirectional_attention "vision", transformers' Gemma 4
        lets them attend both ways in its sliding-window layers. And an attention mask of ones, so that position
        ids that jump (the pruned tokens' gaps) are not read as packed sequences."""
        types = torch.zeros(1, length, dtype=torch.long)
        types[0, image] = 1
        return {"mm_token_type_ids": types, "attention_mask": torch.ones(1, length, dtype=torch.long)}

    def llm_graph_image_rows(self, model, features):
        """The rows themselves, and, where the text config asks for the bidirectional image block
        (use_bidirectional_attention "vision"), the exported prefill's image_rows input at them (1: one image block,
        seen both ways in the sliding-window layers, as mm_token_type_ids 1 makes them in transformers)."""
        if getattr(model.config.get_text_config(), "use_bidirectional_attention", None) != "vision":
            return features, {}
        return features, {contract.IMAGE_ROWS: torch.ones(1, len(features), 1)}

    def llm_embeds_args(self, model, before: list[int], rows: int, after: list[int]) -> dict:
        """per_layer_inputs of the spliced prompt, as Gemma4Model computes them from input_ids (the image rows as the
        pad token): transformers cannot recover them from spliced rows. {} without PLE."""
        text = model.config.get_text_config()
        if not getattr(text, "hidden_size_per_layer_input", 0):
            return {}
        ids = torch.tensor([before + [text.pad_token_id] * rows + after])
        return {"per_layer_inputs": model.model.language_model.get_per_layer_inputs(ids)}

    def readme_section(self, manifest: Manifest) -> str:
        counts = manifest.model.token_counts
        if not counts:
            return ""
        m, p, s = manifest.model.merged_grid_thw[1:], counts["patch_grid"], counts["spatial_merge"]
        return ("\n## Gemma 4 tokens\n\n"
                f"`image_features` rows are tokens of the {m[0]}x{m[1]} pooled grid (each the average of a {s}x{s} "
                f"group of the {p[0]}x{p[1]} patches, then the embedder), raster order; kept_indices index that grid. "
                f"One square image at {counts['image_size']} px. Give the K kept rows to Gemma 4's LLM between boi "
                "and eoi at their original positions, token type 1 (one bidirectional image block where the model "
                "uses one).\n")
