"""Handing a bundle's tokens to a language model: the manifest's `llm` section, the positions rule, the README.

A bundle outputs `image_features` [B, T, D]: the rows an LLM takes in place of its image
placeholder. What a runtime needs to splice them is written into the manifest by the
pipeline (llm_section), from the bundle's own outputs and what the insertion recorded:

- T, the image-token count (an int; the dimension's name where the graph leaves it
  symbolic, e.g. `num_tokens` for a variable K), D (the LLM's hidden size) and the dtype;
- the row layout: `prefix` rows ([CLS] and registers, when the features keep them), then
  `kept` rows, row j being patch kept_indices[:, j], then `extra` rows the method merged
  (`cls`'s summary token);
- the positions output(s) and their meaning (`indices`: kept_indices; families with
  mRoPE or crops add `kept_positions` [B, K, 3]).

Original positions (image_positions): with the image placeholder at text position
`offset` and Nd = prefix + N the dense count (what the processor expands the placeholder
to without pruning), prefix row r sits at offset + r, kept row j at offset + prefix +
kept_indices[j], extra row e right after the last patch, at offset + Nd + e, and the text
after the image continues at offset + Nd + extra. A dense bundle gets offset, offset + 1,
... as the unpruned model does; a pruned one leaves gaps where the pruned patches were,
as TensorRT Edge-LLM keeps pruned visual tokens' positions.
"""

from __future__ import annotations

import numpy as np

from vlmprune.compiler.frontend.llava_next import parse_grid
from vlmprune.compiler.reference import FEATURES, KEPT, KEPT_POSITIONS  # [B, K, 3]: (t, h, w) or (crop, row, col)


_MEANING = {
    "indices": "kept_indices[b, j] is the patch index (raster order, 0..N-1) of row prefix + j of image_features",
    "thw": "kept_positions[b, j] is the (t, h, w) grid position of row prefix + j (mRoPE's three position axes)",
    "crops": "kept_positions[b, j] is the (crop, row, col) of row prefix + j",
    "cyx": "kept_positions[b, j] is the (crop, row, col) of row prefix + j (crop 0: the base image, then the tiles)",
}
POSITIONS_RULE = ("prefix row r at offset + r; kept row j at offset + prefix + kept_indices[j]; extra row e at "
                  "offset + dense_image_tokens + e; text after the image from offset + dense_image_tokens + extra")
_RULES = {"indices": POSITIONS_RULE,
          "thw": "row prefix + j at offset + kept_positions[j] on each mRoPE axis (t, h, w); text after the image "
                 "from offset + max(t, h, w) of the dense merged grid",
          "cyx": "assemble the sequence as the anyres section of the bundle README says (base tokens, then the "
                 "tiles' tokens by global row and column with image_newline after each row that keeps one); "
                 "positions are consecutive over that assembled sequence, as LLaVA-NeXT's are"}


def llm_section(manifest: dict) -> dict:
    """The manifest's `llm` section, from its outputs, method and model fields (see the module docstring)."""
    outputs = {o["name"]: o for o in manifest["outputs"]}
    features = outputs.get(FEATURES) or manifest["outputs"][0]
    shape = features.get("shape") or [None, None, None]
    tokens, hidden = shape[1], shape[-1]
    method, model = manifest["method"], manifest["model"]
    patches = method.get("num_patches") or _patches(model)
    if method["name"] == "none":
        kept, extra = patches, 0
        prefix = tokens - patches if isinstance(tokens, int) and patches else 0
    else:
        kept = method.get("kept_count", method.get("keep"))
        site_prefix = method.get("prefix", int(bool(method.get("has_cls"))))
        prefix = site_prefix if manifest.get("cls", {}).get("in_features") else 0
        out = tokens if isinstance(tokens, int) else method.get("tokens_out", 0) - site_prefix + prefix
        extra = out - prefix - kept if isinstance(out, int) and isinstance(kept, int) else 0
    kind = model.get("positions", "indices")
    dense = prefix + patches if patches else None
    resumes = None if dense is None else dense + extra
    grid = (model.get("token_counts") or {}).get("merged_grid_thw")
    if kind == "thw":  # mRoPE: the text resumes after the dense grid's largest axis (thw_positions)
        resumes = max(grid) if grid else None
    if kind == "cyx" and model.get("grid"):  # anyres: HF's packed sequence of one image at the grid's resolution
        dense = _anyres_dense(model)
        resumes = None  # consecutive after the assembly (the bundle README's anyres section), not a fixed offset
    return {
        "features_output": features["name"],
        "image_tokens": tokens,  # an int, or the dimension's name where it is symbolic (a variable K)
        "dense_image_tokens": dense,
        "hidden_size": hidden,
        "dtype": _DTYPES.get(features.get("dtype"), features.get("dtype")),
        "rows": {"prefix": prefix, "kept": kept, "extra": extra},
        "positions": {"kind": kind, "outputs": [n for n in (KEPT, KEPT_POSITIONS) if n in outputs],
                      "meaning": _MEANING.get(kind, kind), "rule": _RULES.get(kind)},
        "text_resumes_at": resumes,  # relative to the placeholder's position
    }


_DTYPES = {"float": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _anyres_dense(model: dict) -> int | None:
    """Tokens HF's pack_image_features gives one image of the grid's own resolution: the base crop's N, then
    the tiles' (rows·side) x (cols·side) grid with one image_newline per row (no unpadding at that size)."""
    size, patch = model.get("image_size"), model.get("patch_size")
    if not (size and patch):
        return None
    side = size // patch
    rows, cols = parse_grid(model["grid"])
    return side * side + rows * side * (cols * side + 1)


def _patches(model: dict) -> int | None:
    size, patch = model.get("image_size"), model.get("patch_size")
    return (size // patch) ** 2 if size and patch else None


def image_positions(offset: int, dense_tokens: int, prefix: int, kept: np.ndarray | None, extra: int,
                    ) -> tuple[np.ndarray, int]:
    """(position of every image row, the text position after the image) under the original-positions rule.

    kept: the kept patch indices of one image ([K]), or None for a dense image (N = dense - prefix rows).
    """
    patches = np.arange(dense_tokens - prefix) if kept is None else np.asarray(kept, dtype=np.int64)
    rows = [offset + np.arange(prefix), offset + prefix + patches, offset + dense_tokens + np.arange(extra)]
    return np.concatenate(rows).astype(np.int64), offset + dense_tokens + extra


def thw_positions(offset: int, kept_positions: np.ndarray, grid_thw: tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """mRoPE (Qwen2-VL): ([3, K] (t, h, w) positions of the kept rows, the text position after the image).

    As Qwen2-VL's get_rope_index places an image: each axis starts at the placeholder's position,
    and the text resumes one past the largest position of the dense grid, offset + max(t, h, w).
    Ready for bundles with a `kept_positions` output; generate itself runs 1-D positions only.
    """
    kept_positions = np.asarray(kept_positions, dtype=np.int64)
    return (offset + kept_positions.T).astype(np.int64), offset + max(grid_thw)


def readme_section(manifest: dict) -> str:
    """The bundle README's hand-off section: the exact calls per LLM runtime, with this bundle's token counts."""
    llm = manifest.get("llm") or llm_section(manifest)
    t, d, dtype = llm["image_tokens"], llm["hidden_size"], llm["dtype"]
    dense, rows, after = llm["dense_image_tokens"], llm["rows"], llm["text_resumes_at"]
    size = manifest["preprocess"]["size"]
    if handoff_kept := KEPT in llm["positions"]["outputs"]:
        layout = (f"{rows['prefix']} prefix rows, {rows['kept']} kept rows (row {rows['prefix']} + j is patch "
                  f"`kept_indices[:, j]`), {rows['extra']} merged rows")
        places = (f"- prefix row r: offset + r\n- kept row j: offset + {rows['prefix']} + kept_indices[j]\n"
                  f"- merged row e: offset + {dense} + e\n- the text after the image: from offset + {after}")
        if llm["positions"]["kind"] == "thw":
            places = (f"- row {rows['prefix']} + j: offset + kept_positions[j] on each mRoPE axis (t, h, w)\n"
                      f"- the text after the image: from offset + {after}")
        if llm["positions"]["kind"] == "cyx":
            places = ("- the rows are assembled as the anyres section below says, and take consecutive positions "
                      "from offset over the assembled sequence")
    else:
        layout = "every patch, in raster order (a dense bundle)"
        places = f"- row r: offset + r\n- the text after the image: from offset + {after}"
    pos_note = " (`kept_indices` carries them)" if handoff_kept else ""
    return f"""
## Handing the tokens to the language model

`image_features` holds **{t} image tokens** per image, of the LLM's hidden size **{d}**, {dtype}: {layout}.
They replace the prompt's image placeholder, which the unpruned model expands to {dense} tokens.
Original positions{pos_note}, as `vlmprune generate` feeds them, with the placeholder at position `offset`:

{places}

`manifest.json` holds these figures (`llm`). `vlmprune generate . --model CHECKPOINT --image IMG --prompt TEXT`
answers with them in transformers on the CPU; `--dense` runs the unpruned path beside it.

How each runtime takes the rows (from each runtime's own API and examples; vlmprune runs none of them here).
Where a runtime assigns consecutive positions itself, the original positions are lost there (noted):

- **TensorRT-LLM** (prompt table): the table is `image_features` flattened to `[B*{t}, {d}]`; in `input_ids`
  the placeholder becomes the fake ids `torch.arange(vocab_size, vocab_size + {t})` (its
  `examples/multimodal` runner, `setup_fake_prompts`); build the LLM with `--max_multimodal_len` (its
  `max_prompt_embedding_table_size`) >= B*{t}; then `ModelRunner.generate(input_ids, prompt_table=table,
  prompt_tasks="0", ...)` (executor API: `PromptTuningConfig(embedding_table)`). Positions: consecutive.
- **TensorRT Edge-LLM**: its multimodal runners give image token j the id `vocab_size + j` (the image-token
  range `[vocab_size, vocab_size + {t})`) and read row j of the visual engine's output for it;
  `visual_build --minImageTokens {t} --maxImageTokens {t} --maxImageTokensPerImage {t}` sets the range an
  engine takes, `llm_build --maxInputLen` the prompt length. Outline: the stock runners run their own
  visual ONNX, so feeding this bundle's rows (and its positions) takes a runner of your own.
- **llama.cpp** (embedding input): `llama_batch b = llama_batch_init({t}, {d}, 1); b.n_tokens = {t};` copy the
  rows into `b.embd`, set `b.pos[i] = n_past + ` the offsets above, `b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
  b.logits[i] = 0;`, `llama_decode(ctx, b)`, and continue the text at `n_past + {after}`. mtmd's
  `mtmd_helper_decode_image_chunk(mtmd, ctx, chunk, embd, n_past, 0, n_batch, &new_n_past)` also decodes
  precomputed rows, but as many as its image chunk holds (the dense {dense}): a `--no-prune` bundle only.
- **RKLLM** (RK3588): `RKLLMInput in; in.input_type = RKLLM_INPUT_MULTIMODAL; in.multimodal_input.prompt =
  "<image>...";` `.image_embed = rows, .n_image_tokens = {t}, .n_image = 1, .image_width = {size},
  .image_height = {size}`; `rkllm_run(handle, &in, &infer_params, NULL);` (RKLLMParam's `img_start`,
  `img_end`, `img_content` name the placeholder). Positions: consecutive.
- **onnxruntime-genai**: `genai_config.json`'s `"vision"` entry can name this bundle's `model.onnx`
  (`"inputs": {{"pixel_values": "pixel_values"}}, "outputs": {{"image_features": "image_features"}}`); its
  embedding model takes `input_ids` and `image_features` and gives `inputs_embeds`. Outline: the stock
  processors expand the placeholder to the dense count ({dense}), not {t}. Positions: consecutive.
"""
