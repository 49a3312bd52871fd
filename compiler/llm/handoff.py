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
as TensorRT Edge-LLM keeps pruned visual tokens' positions. The same rule for the two
families whose tokens carry `kept_positions`, one function each (what `vlmprune generate`
and `vlmprune eval` feed, and what the manifest and README say):

- mRoPE (Qwen2-VL, thw_positions): kept row j at offset + (t, h, w)_j on the three axes,
  the text resuming at offset + max(t, h, w) of the dense merged grid (get_rope_index:
  the dense image's largest position + 1), after the method's extra rows;
- anyres crops (LLaVA-NeXT, anyres_positions): the rows assembled as
  frontend.llava_next.assemble_llm_input packs them (base tokens, grid tokens by row,
  image_newline after each row that keeps one), each at its position in the dense packed
  sequence (base, tiles, newlines, as transformers' pack_image_features lays them out for
  an image of the grid's resolution), the text resuming after the dense packed length.
"""

from __future__ import annotations

import numpy as np

from vlmprune.compiler.frontend.llava_next import packed_length, parse_grid
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
          "thw": "row prefix + j at offset + kept_positions[j] on each mRoPE axis (t, h, w); extra row e at "
                 "offset + max(t, h, w) of the dense merged grid + e on every axis; text after the image from "
                 "offset + max(t, h, w) + extra",
          "cyx": "assemble the sequence as the anyres section of the bundle README says (base tokens, then the "
                 "tiles' tokens by global row and column with image_newline after each row that keeps one); each "
                 "assembled row (newlines included) at offset + its position in the dense packed sequence (base "
                 "r * s + x; grid N + Y * (cols * s + 1) + X; row Y's newline N + Y * (cols * s + 1) + cols * s); "
                 "extra row e at offset + dense_image_tokens + e; text from offset + dense_image_tokens + extra"}


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
        resumes = max(grid) + extra if grid else None
    if kind == "cyx" and model.get("grid"):  # anyres: HF's packed sequence of one image at the grid's resolution
        dense = _anyres_dense(model)
        resumes = None if dense is None else dense + extra  # anyres_positions
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
    return packed_length(parse_grid(model["grid"]), size // patch)


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


def thw_positions(offset: int, kept_positions: np.ndarray, grid_thw: tuple[int, int, int], extra: int = 0,
                  ) -> tuple[np.ndarray, int]:
    """mRoPE (Qwen2-VL): ([3, K + extra] (t, h, w) positions of the rows, the text position after the image).

    As Qwen2-VL's get_rope_index places an image: each axis starts at the placeholder's position,
    and the text resumes one past the largest position of the dense grid, offset + max(t, h, w).
    Extra rows (a method's summary token) sit there, equal on every axis, and the text after them.
    A dense image is kept_positions = the whole position table (Source.position_table).
    """
    kept_positions = np.asarray(kept_positions, dtype=np.int64).reshape(-1, 3)
    after = offset + max(grid_thw)
    tail = np.broadcast_to(after + np.arange(extra, dtype=np.int64), (3, extra))
    return np.concatenate([offset + kept_positions.T, tail], axis=1).astype(np.int64), after + extra


def anyres_positions(offset: int, kept_positions: np.ndarray, grid: tuple[int, int], side: int, extra: int = 0,
                     ) -> tuple[np.ndarray, int]:
    """Anyres crops (LLaVA-NeXT): (1-D position of every row of the assembled sequence, the text position after it).

    The assembled sequence is frontend.llava_next.assemble_llm_input's (image at the grid's
    resolution, nothing unpadded): the base tokens (crop 0) in the order given, the grid tokens
    by (row Y, column X), image_newline after each grid row that keeps a token; then `extra`
    rows. Each row sits where it sits in the dense packed sequence (pack_image_features):
    base token (r, x) at r * side + x, grid token (Y, X) at N + Y * (W + 1) + X and row Y's
    newline at N + Y * (W + 1) + W (N = side², W = cols * side); extra row e at dense + e,
    the text at dense + extra, all from offset. With every token kept: offset, offset + 1, ...
    """
    rows, cols = grid
    n, width = side * side, cols * side
    kept_positions = np.asarray(kept_positions, dtype=np.int64).reshape(-1, 3)
    crop, r, x = kept_positions.T
    base = crop == 0
    tile = np.maximum(crop - 1, 0)
    y, xg = (tile // cols * side + r)[~base], (tile % cols * side + x)[~base]
    grid_positions = np.sort(n + y * (width + 1) + xg, kind="stable")  # by (Y, X), as the assembly orders them
    grid_rows = (grid_positions - n) // (width + 1)
    out = [r[base] * side + x[base]]
    for row in np.unique(grid_rows):
        out += [grid_positions[grid_rows == row], np.array([n + row * (width + 1) + width])]
    dense = packed_length(grid, side)
    out.append(dense + np.arange(extra))
    return (offset + np.concatenate(out)).astype(np.int64), offset + dense + extra


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
                      f"- merged row e: offset + {after - rows['extra'] if isinstance(after, int) else after} + e "
                      "on every axis\n"
                      f"- the text after the image: from offset + {after}")
        if llm["positions"]["kind"] == "cyx":
            places = ("- the rows are assembled as the anyres section below says; each assembled row (image_newline "
                      f"included) takes offset + its position in the dense packed sequence of {dense} rows\n"
                      f"- merged row e: offset + {dense} + e\n- the text after the image: from offset + {after}")
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
