#!/usr/bin/env python
"""A LLaVA on a real DINOv2 tower, trained here on easy-vqa: the model issue 19 measures pruning with.

    python tools/train_easyvqa.py [-o DIR] [--tower TOWER_DIR] [--train N] [--epochs E] [--test M] [--seed S] [--force]

A LlavaForConditionalGeneration (family `llava_dinov2`): the tower (a Dinov2Model directory, e.g. from
tools/dinov2_from_onnx.py; frozen), LLaVA's 2-layer MLP projector and a small Llama trained from
scratch, with a word-level tokenizer over easy-vqa's vocabulary and LLaVA-1.5's chat template
(`USER: <image>\\n{question} ASSISTANT:`). vision_feature_layer -1, strategy `default` (no [CLS]).

- The tower's features are computed once per image, from the saved image processor's pixels (the
  64x64 PNGs resized to the tower's size, bilinear; vlmprune's own preprocessing agrees to one 8-bit
  level), so training, `generate` and the bundles see the same image.
- The loss is on the answer tokens and eos only. Deterministic at a seed: torch.manual_seed, one
  seeded shuffle per epoch, a fixed thread count.
- Defaults (--train 10000 --epochs 4, 1,035 images at 224 px): about 11 minutes on 2 cores, dense
  accuracy 0.808 on the first 500 test questions against 0.354 for the majority answer ("yes").
- Training data: the first N training questions (easy-vqa's order, grouped by image, so N/10 images);
  test: the first M test questions, as `vlmprune eval --dataset test.jsonl --limit M` takes them
  (tools/easyvqa_jsonl.py). Dense accuracy is the exact match of the saved model's own greedy
  generate(), beside the majority training answer's accuracy; both go to DIR/training.json.
- DIR (default $VLMPRUNE_CACHE/models/easyvqa-llava-dinov2) is written to a temporary folder and
  renamed into place, its marker last; a complete one is reused unless --force.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from easyvqa_jsonl import records  # noqa: E402

from vlmprune.kernels.build import cache_dir  # noqa: E402

MARKER = "training.json"  # written last: its presence means the directory is complete
PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
TEMPLATE_WORDS = ("user", ":", "assistant", "?")
# LLaVA-1.5's template; content as typed parts (the processor's way) or as one string.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
LM = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}


def default_output() -> Path:
    return cache_dir() / "models" / "easyvqa-llava-dinov2"


def build_tokenizer(texts: list[str]):
    """A WordLevel tokenizer over the words of texts and the template, lower-cased, adding bos in front."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK, IMAGE]
    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t.lower())} | set(TEMPLATE_WORDS))
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, extra_special_tokens={"image_token": IMAGE},
                                   padding_side="left")


def build_processor(tokenizer, vision_config):
    """LlavaProcessor: the image resized (short side, bilinear) and centre-cropped to the tower's size, ImageNet
    mean/std; <image> expanded to the patch count ([CLS] counted, then dropped by `default`)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from vlmprune.compiler.frontend.dinov2 import IMAGENET_MEAN, IMAGENET_STD

    size = vision_config.image_size
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                   resample=2, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=vision_config.patch_size,
                          vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE, num_additional_image_tokens=1)


def build_model(tower_dir: Path, tokenizer, lm: dict):
    """The LLaVA: the tower's weights as loaded, projector and language model freshly initialised (seed first)."""
    from transformers import Dinov2Model, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tower = Dinov2Model.from_pretrained(str(tower_dir)).eval()
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("pad", PAD), ("bos", BOS), ("eos", EOS))}
    text = LlamaConfig(**lm, num_key_value_heads=lm["num_attention_heads"], vocab_size=len(tokenizer),
                       max_position_embeddings=1024, pad_token_id=ids["pad"], bos_token_id=ids["bos"],
                       eos_token_id=ids["eos"], tie_word_embeddings=False)
    config = LlavaConfig(vision_config=tower.config, text_config=text, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu",
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
                         image_seq_length=(tower.config.image_size // tower.config.patch_size) ** 2)
    model = LlavaForConditionalGeneration(config)
    model.model.vision_tower.load_state_dict(tower.state_dict())
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = ids["pad"], ids["eos"]
    model.generation_config.bos_token_id = ids["bos"]
    model.model.vision_tower.requires_grad_(False)
    return model


def prompt_text(processor, question: str) -> str:
    return processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": question}]}],
                                         add_generation_prompt=True, tokenize=False)


@torch.inference_mode()
def tower_features(model, processor, paths: list[str], batch: int = 16) -> dict[str, torch.Tensor]:
    """Each image's tower output as LLaVA selects it (hidden_states[-1], [CLS] dropped), once per image."""
    from PIL import Image

    tower, out = model.model.vision_tower.eval(), {}
    for at in range(0, len(paths), batch):
        chunk = paths[at: at + batch]
        images = [Image.open(p).convert("RGB") for p in chunk]
        pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        hidden = tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]
        out.update(zip(chunk, hidden.clone()))
    return out


def encode(processor, samples: list[dict], image_tokens: int) -> list[tuple[list[int], int]]:
    """Each sample's token ids (the placeholder expanded, answer and eos appended) and where its answer starts."""
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE)
    out = []
    for s in samples:
        ids = tok(prompt_text(processor, s["question"]))["input_ids"]
        at = ids.index(image_id)
        ids = ids[:at] + [image_id] * image_tokens + ids[at + 1:]
        answer = tok(s["answers"][0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((ids + answer, len(ids)))
    return out


def train(model, processor, samples: list[dict], features: dict, epochs: int, seed: int, batch: int = 32,
          lr: float = 2e-3, log=print) -> list[float]:
    """Projector and language model by AdamW on the answers' cross-entropy; the tower's features precomputed."""
    tok = processor.tokenizer
    image_tokens = next(iter(features.values())).shape[0]
    encoded = encode(processor, samples, image_tokens)
    image_id, pad_id = tok.convert_tokens_to_ids(IMAGE), tok.pad_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    steps = epochs * -(-len(samples) // batch)
    warm = max(1, steps // 10)  # linear warm-up, then linear decay to zero
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min((k + 1) / warm, (steps - k) / max(1, steps - warm)))
    order_gen = torch.Generator().manual_seed(seed)
    embed, projector = model.get_input_embeddings(), model.model.multi_modal_projector
    model.train()
    model.model.vision_tower.eval()
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(samples), generator=order_gen).tolist()
        for at in range(0, len(order), batch):
            rows = order[at: at + batch]
            width = max(len(encoded[r][0]) for r in rows)
            ids = torch.full((len(rows), width), pad_id)
            labels = torch.full((len(rows), width), -100)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, r in enumerate(rows):  # right padding: positions stay those of the unpadded prompt
                seq, start = encoded[r]
                ids[j, :len(seq)] = torch.tensor(seq)
                labels[j, start:len(seq)] = torch.tensor(seq[start:])
                mask[j, :len(seq)] = 1
            feats = projector(torch.stack([features[samples[r]["image"]] for r in rows]))
            embeds = embed(ids).masked_scatter((ids == image_id)[..., None], feats.to(embed.weight.dtype))
            loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        log(f"epoch {epoch + 1}/{epochs}: mean loss {sum(losses[-(len(order) // batch or 1):]) / (len(order) // batch or 1):.4f}")
    model.eval()
    return losses


@torch.inference_mode()
def answers(model, processor, samples: list[dict], batch: int = 16) -> list[str]:
    """The model's own greedy generate() on each sample's image and question, decoded, as a user would call it."""
    from PIL import Image

    out = []
    for at in range(0, len(samples), batch):
        chunk = samples[at: at + batch]
        inputs = processor(images=[Image.open(s["image"]).convert("RGB") for s in chunk],
                           text=[prompt_text(processor, s["question"]) for s in chunk], padding=True,
                           return_tensors="pt")
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        out += [t.strip() for t in processor.batch_decode(tokens[:, inputs["input_ids"].shape[1]:],
                                                          skip_special_tokens=True)]
    return out


def train_easyvqa(out: Path, tower: Path, train_n: int = 10000, epochs: int = 4, test_n: int = 500, seed: int = 0,
                  lm: dict | None = None, threads: int = 2, force: bool = False, log=print) -> dict:
    """Train, evaluate and publish the checkpoint at out; its training.json record (the existing one if reused)."""
    out = Path(out)
    if (out / MARKER).is_file() and not force:
        log(f"{out}: already trained (reused; --force retrains)")
        return json.loads((out / MARKER).read_text())
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists but is not a finished easy-vqa model; pass --force to replace it")
    if not (Path(tower) / "config.json").is_file():
        raise FileNotFoundError(f"{tower}: not a Dinov2Model directory (no config.json); "
                                "make one with tools/dinov2_from_onnx.py")
    started = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    train_all, test_all = records("train"), records("test")
    train_rows, test_rows = train_all[:train_n], test_all[:test_n]
    everything = train_all + test_all
    tokenizer = build_tokenizer([r["question"] for r in everything] + [r["answers"][0] for r in everything])
    model = build_model(Path(tower), tokenizer, {**LM, **(lm or {})})
    processor = build_processor(tokenizer, model.config.vision_config)
    images = sorted({r["image"] for r in train_rows})
    log(f"tower features of {len(images)} training images")
    features = tower_features(model, processor, images)
    featured = time.perf_counter()
    log(f"training on {len(train_rows)} questions, {epochs} epochs")
    losses = train(model, processor, train_rows, features, epochs, seed, log=log)
    trained = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        saved = LlavaForConditionalGeneration.from_pretrained(tmp).eval()  # the accuracy is the saved model's
        got = answers(saved, AutoProcessor.from_pretrained(tmp), test_rows)
        truth = [r["answers"][0] for r in test_rows]
        majority = collections.Counter(r["answers"][0] for r in train_all).most_common(1)[0][0]  # whole split
        record = {
            "dense_accuracy": sum(g == t for g, t in zip(got, truth)) / len(truth),
            "majority_answer": majority,
            "majority_accuracy": sum(t == majority for t in truth) / len(truth),
            "test_questions": len(truth), "train_questions": len(train_rows), "train_images": len(images),
            "epochs": epochs, "seed": seed, "threads": threads, "language_model": {**LM, **(lm or {})},
            "tower": str(Path(tower).resolve()), "final_loss": losses[-1] if losses else None,
            "seconds": {"features": round(featured - started, 1), "training": round(trained - featured, 1),
                        "evaluation": round(time.perf_counter() - trained, 1),
                        "total": round(time.perf_counter() - started, 1)},
        }
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():  # --force: the old one goes only once the new one is complete
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=None, help="default: $VLMPRUNE_CACHE/models/"
                        "easyvqa-llava-dinov2")
    parser.add_argument("--tower", type=Path, default=None,
                        help="a Dinov2Model directory; default: $VLMPRUNE_CACHE/models/dinov2-s14-imgfocus")
    parser.add_argument("--train", type=int, default=10000, help="training questions (the first N)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--test", type=int, default=500, help="test questions for the dense accuracy (the first M)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="retrain and replace an existing model")
    args = parser.parse_args(argv)
    tower = args.tower or cache_dir() / "models" / "dinov2-s14-imgfocus"
    if min(args.train, args.epochs, args.test) < 1:
        print("error: --train, --epochs and --test must be at least 1", file=sys.stderr)
        return 2
    try:
        record = train_easyvqa(args.output or default_output(), tower, args.train, args.epochs, args.test,
                               args.seed, force=args.force, log=lambda line: print(line, flush=True))
    except (FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"dense accuracy {record['dense_accuracy']:.4f} on {record['test_questions']} test questions; "
          f"majority answer {record['majority_answer']!r}: {record['majority_accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
