"""Handing a bundle's tokens to a language model: the manifest's `llm` section, the positions rule, the README.

A bundle outputs `image_features` [B, T, D]: the rows an LLM takes in place of its image
placeholder. What a runtime needs to splice them is written into the manifest by the
pipeline (llm_section), from the bundle's own outputs and what the insertion recorded:

- T, the image-token count (an int; the dimension's name where the graph leaves it
  symbolic, e.g. `num_tokens` for a variable K), D (the LLM's hidden size) and the dtype;
- the row layout: `prefix` rows ([CLS] and registers, when the features keep them), then
  `kept` rows, row j being patch kept_indices[:, j], then `extra` rows the method merged
  (`cls`'s summary token, `prumerge+`'s extra token);
- the positions output(s) and their meaning (`indices`: kept_indices; families with
  mRoPE or crops add `kept_positions` [B, K, 3]).

Original positions: with the image placeholder at text position `offset` and Nd = prefix + N
the dense count (what the processor expands the placeholder to without pruning), prefix row r
sits at offset + r, kept row j at offset + prefix + kept_indices[j], extra row e right after
the last patch, at offset + Nd + e, and the text after the image continues at offset + Nd +
extra. A dense bundle gets offset, offset + 1, ... as the unpruned model does; a pruned one
leaves gaps where the pruned patches were, as TensorRT Edge-LLM keeps pruned visual tokens'
positions. The rule is the family's (Family.positions, from frontend.family_of(manifest)):
this default (frontend.family.image_positions), mRoPE's (t, h, w) (frontend.qwen2_vl) or
anyres crops' packed sequence (frontend.llava_next); its rule text, dense count and text
position are what the manifest and README say, and what `vlmprune generate` and `eval` feed.
"""

from __future__ import annotations

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.frontend import family_of
from vlmprune.compiler.parity.reference import FEATURES, KEPT, KEPT_POSITIONS  # [B, K, 3]: (t, h, w) or (crop, row, col)
from vlmprune.compiler.parity.reference import NUM_TOKENS  # [B]: valid rows where K varies per image


def llm_section(manifest: Manifest) -> dict:
    """The manifest's `llm` section, from its outputs, method and model fields (see the module docstring)."""
    outputs = {o.name: o for o in manifest.outputs}
    features = outputs.get(FEATURES) or manifest.outputs[0]
    shape = features.shape or [None, None, None]
    tokens, hidden = shape[1], shape[-1]
    method, model = manifest.method, manifest.model
    patches = method.num_patches or _patches(model)
    if not method.pruned:
        kept, extra = patches, 0
        prefix = tokens - patches if isinstance(tokens, int) and patches else 0
    else:
        kept = method.kept_count if "kept_count" in method else method.keep
        site_prefix = method.prefix
        prefix = site_prefix if manifest.cls_section.get("in_features") else 0
        out = tokens if isinstance(tokens, int) else (method.tokens_out or 0) - site_prefix + prefix
        extra = out - prefix - kept if isinstance(out, int) and isinstance(kept, int) else 0
    rule = family_of(manifest).positions_of(model)
    dense = rule.dense_image_tokens(model, prefix + patches if patches else None)
    section = {
        "features_output": features.name,
        "image_tokens": tokens,  # an int, or the dimension's name where it is symbolic (a variable K)
        "dense_image_tokens": dense,
        "hidden_size": hidden,
        "dtype": _DTYPES.get(features.dtype, features.dtype),
        "rows": {"prefix": prefix, "kept": kept, "extra": extra},
        "positions": {"kind": rule.kind, "outputs": [n for n in (KEPT, KEPT_POSITIONS) if n in outputs],
                      "meaning": rule.meaning, "rule": rule.rule},
        "text_resumes_at": rule.text_resumes_at(model, dense, extra),  # relative to the placeholder's position
    }
    section.update(family_of(manifest).llm_handoff(model))  # what the family's LLM takes beyond rows (DeepStack)
    if NUM_TOKENS in outputs:  # K varies per image (docs/design.md, "Variable K")
        section["num_tokens"] = {
            "output": NUM_TOKENS, "max_rows": tokens, "padding": "zero rows after each image's num_tokens rows",
            "kept_padding": -1,
            "rule": (f"image b: take rows [0, num_tokens[b]) of image_features, drop the rest: {prefix} prefix "
                     f"rows, then num_tokens[b] - {prefix + extra} kept rows (kept_indices[b, j] for those j; -1 "
                     f"after them), then the {extra} extra row(s); positions as below for those rows only")}
    return section


_DTYPES = {"float": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _patches(model: dict) -> int | None:
    size, patch = model.get("image_size"), model.get("patch_size")
    return (size // patch) ** 2 if size and patch else None


def readme_section(manifest: Manifest) -> str:
    """The bundle README's hand-off section: the exact calls per LLM runtime, with this bundle's token counts."""
    llm = manifest.llm or llm_section(manifest)
    t, d, dtype = llm["image_tokens"], llm["hidden_size"], llm["dtype"]
    dense, rows, after = llm["dense_image_tokens"], llm["rows"], llm["text_resumes_at"]
    size = manifest.preprocess.size
    if handoff_kept := KEPT in llm["positions"]["outputs"]:
        layout = (f"{rows['prefix']} prefix rows, {rows['kept']} kept rows (row {rows['prefix']} + j is patch "
                  f"`kept_indices[:, j]`), {rows['extra']} merged rows")
        places = family_of(manifest).positions_of(manifest.model).readme_places(rows, dense, after)
    else:
        layout = "every patch, in raster order (a dense bundle)"
        places = f"- row r: offset + r\n- the text after the image: from offset + {after}"
    pos_note = " (`kept_indices` carries them)" if handoff_kept else ""
    if "num_tokens" in llm:  # K varies per image: the counts above are each image's most
        variable = llm["num_tokens"]
        layout += (f". **K varies per image**: the output `num_tokens` [B] (int64) says how many leading rows of "
                   f"image b are its tokens ({variable['rule']}); the {t} rows are the most an image can have, "
                   f"and every row after num_tokens[b] is zero and must not reach the LLM. Splice "
                   f"`image_features[b, :num_tokens[b]]`, expand the placeholder to num_tokens[b] tokens, and use "
                   f"num_tokens[b] wherever a runtime below takes {t} (TensorRT-LLM's fake ids and table rows, "
                   f"Edge-LLM's token range up to {t}, llama.cpp's n_tokens, RKLLM's n_image_tokens). "
                   f"`vlmprune generate` and `eval` drop the padding so")
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
