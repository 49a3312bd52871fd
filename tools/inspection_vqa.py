#!/usr/bin/env python
"""Inspection-style VQA scenes: small parts on large backgrounds, questions about small regions.

    python tools/inspection_vqa.py --split {train,test} [--seed S] [--count N] -o DIR [--force]

The benchmark at the pruning papers' own scale: 448 x 448 images, which a DINOv2-S/14 tower at 448 px
sees as 32 x 32 = 1024 patches. Each scene is what an inspection camera sees: most of the image is
background (plain, a gradient, a conveyor belt with slats, a shelf with boards, or a mottled surface),
with 1-6 small parts (a circle, square, triangle or cross in one of five colours), each covering
0.3-3 % of the image, i.e. a handful of patches. Some parts carry a defect (a scratch, a spot or a
missing corner); some carry a short label. The answer to every question lives in a few patches, which
is the case a pruning method must not lose.

Question types (`type` in questions.jsonl) and their one-word answers:
- `defect`: is there a defect? (yes / no)
- `defect_color`, `defect_shape`: the colour / shape of the one defective part
- `count`: how many parts are there? (1-6)
- `region`: where is the <colour> <shape>? (one of 3 x 3 regions: topleft, top, topright, left, center,
  right, bottomleft, bottom, bottomright; the part's centre decides)
- `label`: what does the label say? (the one labelled part's label)
- `presence`: is there a <colour> <shape>? (yes / no)

Answers are balanced per type by construction: each image is built for two questions of different
types whose answers are drawn uniformly first, and the scene is made to satisfy both. Parts have
distinct (colour, shape) pairs, so `region` and `presence` name one part.

Determinism: image i of a split is drawn from its own generator, seeded by (seed, split, i), so the
same seed gives the same bytes, and `--count` takes a prefix of the same sequence. The test split
(stream 1) never repeats a training scene (stream 0). DIR gets the PNGs, `questions.jsonl` in the
format `vlmprune eval --dataset` reads (`id`, `image` relative to DIR, `question`, `answers`, `type`),
and `summary.json` with each type's count and majority answer. DIR is written to a temporary folder
and renamed into place.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

SIZE = 448
SPLITS = {"train": 0, "test": 1}
DEFAULT_COUNT = {"train": 4000, "test": 1000}  # images; two questions each
QUESTIONS_PER_IMAGE = 2

COLORS = {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 220), "yellow": (240, 200, 20),
          "purple": (148, 60, 189)}
SHAPES = ("circle", "square", "triangle", "cross")
DEFECTS = ("scratch", "spot", "corner")
LABELS = ("a", "b", "x", "7", "ok", "ng")  # shown upper-case on the part; answered lower-case
REGIONS = ("topleft", "top", "topright", "left", "center", "right", "bottomleft", "bottom", "bottomright")
BACKGROUNDS = ("plain", "gradient", "conveyor", "shelf", "mottled")
AREA = (0.003, 0.03)  # a part's bounding box, as a share of the image
LABEL_MIN_SIDE = 44  # px: a labelled part is at least this wide, so its characters are legible

ANSWERS = {
    "defect": ("yes", "no"),
    "defect_color": tuple(COLORS),
    "defect_shape": SHAPES,
    "count": tuple(str(n) for n in range(1, 7)),
    "region": REGIONS,
    "label": LABELS,
    "presence": ("yes", "no"),
}
TYPES = tuple(ANSWERS)
# Types whose constraints fight over the same part: never asked of one image together.
_EXCLUSIVE = [{"defect", "defect_color", "defect_shape"}]


@dataclasses.dataclass
class Part:
    color: str
    shape: str
    defect: str | None = None
    label: str | None = None
    side: int = 0  # bounding-box side in px
    x: int = 0  # top-left corner
    y: int = 0

    @property
    def center(self) -> tuple[float, float]:
        return self.x + self.side / 2, self.y + self.side / 2


def region_of(cx: float, cy: float) -> str:
    col, row = min(2, int(cx * 3 // SIZE)), min(2, int(cy * 3 // SIZE))
    return REGIONS[row * 3 + col]


def _compatible(a: str, b: str) -> bool:
    return a != b and not any(a in g and b in g for g in _EXCLUSIVE)


def _pick_types(rng: np.random.Generator) -> list[str]:
    first = TYPES[rng.integers(len(TYPES))]
    rest = [t for t in TYPES if _compatible(first, t)]
    return [first, rest[rng.integers(len(rest))]]


def _unused_combo(rng, parts: list[Part], color: str | None = None, shape: str | None = None, skip=None):
    """A (colour, shape) pair no other part has, with the given colour or shape fixed where one is."""
    used = {(p.color, p.shape) for p in parts if p is not skip}
    options = [(c, s) for c in COLORS for s in SHAPES
               if (color is None or c == color) and (shape is None or s == shape) and (c, s) not in used]
    if not options:  # the other parts took every pair of that colour (or shape): scene() draws again
        raise _Redraw
    return options[rng.integers(len(options))]


class _Redraw(Exception):
    """A drawn scene cannot meet its targets; the next draw from the same generator is taken."""


def plan_scene(rng: np.random.Generator, targets: dict[str, str]) -> tuple[list[Part], dict]:
    """Parts satisfying every target answer, and what each question refers to (the queried pair)."""
    n = int(targets["count"]) if "count" in targets else int(rng.integers(1, 7))
    combos = [(c, s) for c in COLORS for s in SHAPES]
    chosen = rng.choice(len(combos), size=n, replace=False)
    parts = [Part(*combos[i]) for i in chosen]
    refs: dict = {}
    # Defects: exactly one defective part where its colour or shape is asked; otherwise none or some.
    if "defect_color" in targets or "defect_shape" in targets:
        part = parts[rng.integers(n)]
        part.color, part.shape = _unused_combo(rng, parts, targets.get("defect_color"), targets.get("defect_shape"),
                                               skip=part)
        part.defect = DEFECTS[rng.integers(len(DEFECTS))]
    else:
        want = targets.get("defect")
        has = (rng.random() < 0.5) if want is None else want == "yes"
        if has:
            for i in rng.choice(n, size=int(rng.integers(1, min(n, 2) + 1)), replace=False):
                parts[i].defect = DEFECTS[rng.integers(len(DEFECTS))]
    # Labels: exactly one labelled part where the label is asked; else one part in three carries one.
    label = targets.get("label") or (LABELS[rng.integers(len(LABELS))] if rng.random() < 1 / 3 else None)
    if label:  # on a part without a defect where there is one; a scratch or spot would hide the characters
        clean = [p for p in parts if not p.defect] or parts
        part = clean[rng.integers(len(clean))]
        part.label = label
        if part.defect:
            part.defect = "corner"
    if "presence" in targets:
        if targets["presence"] == "yes":
            p = parts[rng.integers(n)]
            refs["presence"] = (p.color, p.shape)
        else:
            refs["presence"] = _unused_combo(rng, parts)
    if "region" in targets:
        refs["region"] = parts[rng.integers(n)]
    _place(rng, parts, refs.get("region"), targets.get("region"))
    return parts, refs


def _place(rng: np.random.Generator, parts: list[Part], anchored: Part | None, region: str | None) -> None:
    """Sizes and non-overlapping positions (a 6 px gap); the anchored part's centre in its region's cell."""
    order = ([anchored] if anchored is not None else []) + [p for p in parts if p is not anchored]
    placed: list[Part] = []
    cell = SIZE / 3
    for p in order:
        lo = max(math.sqrt(AREA[0]) * SIZE, LABEL_MIN_SIDE if p.label else 0)
        hi = math.sqrt(AREA[1]) * SIZE
        for _ in range(2000):
            p.side = int(rng.integers(int(lo), int(hi) + 1))
            if p is anchored:
                r = REGIONS.index(region)
                cx0, cy0 = (r % 3) * cell, (r // 3) * cell
                cx = rng.uniform(cx0 + 4, cx0 + cell - 4)
                cy = rng.uniform(cy0 + 4, cy0 + cell - 4)
                p.x, p.y = int(round(cx - p.side / 2)), int(round(cy - p.side / 2))
                if not (4 <= p.x and p.x + p.side <= SIZE - 4 and 4 <= p.y and p.y + p.side <= SIZE - 4):
                    continue
                if region_of(*p.center) != region:
                    continue
            else:
                p.x = int(rng.integers(4, SIZE - p.side - 4))
                p.y = int(rng.integers(4, SIZE - p.side - 4))
            if all(p.x + p.side + 6 <= q.x or q.x + q.side + 6 <= p.x or p.y + p.side + 6 <= q.y
                   or q.y + q.side + 6 <= p.y for q in placed):
                placed.append(p)
                break
        else:  # cannot happen with at most 6 parts of <= 78 px on 448 px; say so if it ever does
            raise RuntimeError("could not place the parts without overlap")


def _background(rng: np.random.Generator) -> np.ndarray:
    """A neutral background: grey, beige or dark belt tones, so the saturated parts stand out."""
    kind = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    base = rng.uniform(90, 215, size=3).astype(np.float32)
    base = base.mean() + 0.25 * (base - base.mean())  # nearly grey
    if kind == "plain":
        img = np.broadcast_to(base, (SIZE, SIZE, 3)).copy()
    elif kind == "gradient":
        other = np.clip(base + rng.uniform(-60, 60), 40, 235)
        angle = rng.uniform(0, 2 * np.pi)
        t = np.clip((xx * np.cos(angle) + yy * np.sin(angle)) / (SIZE * 1.42) + 0.5, 0, 1)
        img = base + (other - base) * t[..., None]
    elif kind == "conveyor":
        belt = np.full(3, rng.uniform(45, 80), np.float32)
        period = int(rng.integers(28, 64))
        slat = ((yy if rng.random() < 0.5 else xx) % period) < 3
        img = np.where(slat[..., None], belt + 35, belt).astype(np.float32)
        img = img + rng.normal(0, 4, size=(SIZE, SIZE, 1)).astype(np.float32)
    elif kind == "shelf":
        wood = np.array([190, 160, 120], np.float32) * rng.uniform(0.8, 1.1)
        period = int(rng.integers(90, 150))
        board = (yy % period) < 8
        grain = 6 * np.sin(xx / rng.uniform(5, 15) + rng.uniform(0, 6))
        img = np.where(board[..., None], wood * 0.6, wood + grain[..., None]).astype(np.float32)
    else:  # mottled: smooth low-amplitude noise
        coarse = rng.normal(0, 18, size=(SIZE // 16 + 1, SIZE // 16 + 1)).astype(np.float32)
        smooth = np.kron(coarse, np.ones((16, 16), np.float32))[:SIZE, :SIZE]
        img = base + smooth[..., None]
    return np.clip(img, 0, 255).astype(np.uint8)


def _mask(shape: str, side: int) -> np.ndarray:
    """The part's silhouette in its side x side box (bool)."""
    yy, xx = (np.mgrid[0:side, 0:side].astype(np.float32) + 0.5) / side
    if shape == "circle":
        return (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "triangle":  # apex up
        return (yy >= 0.05) & (np.abs(xx - 0.5) <= yy * 0.5)
    bar = 0.34  # cross
    return (np.abs(xx - 0.5) <= bar / 2) | (np.abs(yy - 0.5) <= bar / 2)


def render(rng: np.random.Generator, parts: list[Part]) -> np.ndarray:
    from PIL import Image, ImageDraw

    img = _background(rng)
    bg = img.copy()
    for p in parts:
        box = img[p.y:p.y + p.side, p.x:p.x + p.side]
        m = _mask(p.shape, p.side)
        box[m] = COLORS[p.color]
        if p.defect == "corner":  # a missing corner: the background shows through a quarter-side triangle
            yy, xx = np.mgrid[0:p.side, 0:p.side]
            cut = int(p.side * 0.45)
            corner = rng.integers(4)
            fx = xx if corner in (0, 2) else p.side - 1 - xx
            fy = yy if corner in (0, 1) else p.side - 1 - yy
            gone = m & (fx + fy < cut) if p.shape in ("square", "cross") else m & (fy < cut * 0.8)
            box[gone] = bg[p.y:p.y + p.side, p.x:p.x + p.side][gone]
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    for p in parts:
        s = p.side
        if p.defect == "scratch":
            a = rng.uniform(0, np.pi)
            dx, dy = math.cos(a) * s * 0.4, math.sin(a) * s * 0.4
            cx, cy = p.center
            draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=(25, 25, 25), width=max(2, s // 14))
        elif p.defect == "spot":
            r = max(3, s // 7)
            cx, cy = p.center
            cx += rng.uniform(-s * 0.12, s * 0.12)
            cy += rng.uniform(-s * 0.08, s * 0.12)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(20, 20, 20))
        if p.label:
            text, font, at = _label_text(p)
            ink = (0, 0, 0) if p.color in ("yellow", "green") else (255, 255, 255)
            draw.text(at, text, fill=ink, font=font, anchor="mm")
    return np.asarray(pil)


def _label_text(p: Part):
    """How a part's label is drawn: the text, its font and the point its middle is anchored at."""
    from PIL import ImageFont

    text, s = p.label.upper(), p.side
    font = ImageFont.load_default(size=max(12, int(s * (0.42 if len(text) == 2 else 0.55))))
    cx, cy = p.center
    return text, font, (cx, cy + s * 0.1 if p.shape == "triangle" else cy)


def label_box(p: Part) -> tuple[float, float, float, float]:
    """The image box (x0, y0, x1, y1) the label's characters take: render draws them there."""
    text, font, (x, y) = _label_text(p)
    x0, y0, x1, y1 = font.getbbox(text, anchor="mm")
    return x + x0, y + y0, x + x1, y + y1


def question(kind: str, refs: dict, parts: list[Part]) -> tuple[str, str]:
    """The question text and its one answer, read from the scene (not from the target drawn)."""
    if kind == "defect":
        return "is there a defect?", "yes" if any(p.defect for p in parts) else "no"
    if kind in ("defect_color", "defect_shape"):
        (p,) = [p for p in parts if p.defect]
        return (f"what {'color' if kind == 'defect_color' else 'shape'} is the defective part?",
                p.color if kind == "defect_color" else p.shape)
    if kind == "count":
        return "how many parts are there?", str(len(parts))
    if kind == "region":
        p = refs["region"]
        return f"where is the {p.color} {p.shape}?", region_of(*p.center)
    if kind == "label":
        (p,) = [p for p in parts if p.label]
        return "what does the label say?", p.label
    color, shape = refs["presence"]
    return f"is there a {color} {shape}?", "yes" if any((p.color, p.shape) == (color, shape) for p in parts) else "no"


def image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SPLITS[split], index])))


def _planned(rng: np.random.Generator) -> tuple[list[str], dict, list[Part], dict]:
    """The scene's draws before rendering: its two question types, their target answers, the parts, the refs."""
    kinds = _pick_types(rng)
    targets = {k: ANSWERS[k][rng.integers(len(ANSWERS[k]))] for k in kinds}
    while True:
        try:
            parts, refs = plan_scene(rng, targets)
            return kinds, targets, parts, refs
        except _Redraw:
            continue


def scene(seed: int, split: str, index: int) -> tuple[np.ndarray, list[dict]]:
    """Image `index` of the split: its pixels and its questions (question, answer, type)."""
    rng = image_rng(seed, split, index)
    kinds, targets, parts, refs = _planned(rng)
    pixels = render(rng, parts)
    rows = []
    for k in kinds:
        text, answer = question(k, refs, parts)
        if answer != targets[k]:  # the construction guarantees it; a mismatch is a bug, not data
            raise AssertionError(f"{split} {index}: {k} answer {answer!r} != target {targets[k]!r}")
        rows.append({"question": text, "answers": [answer], "type": k})
    return pixels, rows


def more_questions(seed: int, split: str, index: int, count: int) -> list[dict]:
    """Up to `count` further questions about image `index` of the split, read from its scene, for training only.

    A scene holds more answers than its two balanced questions: the region of every part, the presence of every
    part and of absent ones, the count, the defect. Asking them costs no new image (the tower's features are the
    expensive part of training at 1024 patches), so the training split can teach the language model to look at
    every part. The types take turns in a drawn order, one question each, and `presence` alternates yes and no, so
    no type and no presence answer dominates. The draws come from their own generator, so the
    image and its two questions stay the bytes write_split wrote; the test split never gets them."""
    kinds, _, parts, refs = _planned(image_rng(seed, split, index))
    asked = {question(k, refs, parts)[0] for k in kinds}
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SPLITS[split], index, 1])))
    defect = question("defect", {}, parts)
    candidates: dict[str, list[tuple[str, str]]] = {
        # Most scenes hold a defect (every scene asked for a defect's colour or shape does): a "yes" is kept one
        # time in four, which brings the extra defect questions near an even split of yes and no.
        "defect": [defect] if defect[1] == "no" or rng.random() < 0.25 else [],
        "count": [question("count", {}, parts)],
        "region": [question("region", {"region": p}, parts) for p in parts],
        "presence": [question("presence", {"presence": (c, s)}, parts) for c in COLORS for s in SHAPES]}
    for kind, attr in (("defect_color", "defect"), ("defect_shape", "defect"), ("label", "label")):
        if sum(1 for p in parts if getattr(p, attr)) == 1:
            candidates[kind] = [question(kind, {}, parts)]
    pools = {}
    for kind in sorted(candidates):
        pool = [q for q in candidates[kind] if q[0] not in asked]
        pool = [pool[i] for i in rng.permutation(len(pool))]
        if kind == "presence":  # yes and no alternate, as many of each (a scene has few parts and many absent pairs)
            yes, no = [q for q in pool if q[1] == "yes"], [q for q in pool if q[1] == "no"]
            pairs = list(zip(yes, no) if rng.integers(2) else zip(no, yes))
            pool = [q for pair in pairs for q in pair]
        if pool:
            pools[kind] = pool
    order = [sorted(pools)[i] for i in rng.permutation(len(pools))]
    out: list[dict] = []
    while len(out) < count and any(pools.values()):  # one question a type in turn, in a drawn order of types
        for kind in order:
            if pools[kind] and len(out) < count:
                text, answer = pools[kind].pop(0)
                out.append({"question": text, "answers": [answer], "type": kind})
    return out


DESCRIBE = "describe the parts."


def describe(seed: int, split: str, index: int) -> dict:
    """One training question about image `index` whose answer names every part: the count, then each part's
    colour, shape and 3x3 region, its defect and its label where it has one, in reading order (region by region,
    then top to bottom, left to right), e.g. `2 parts : red circle topleft , blue cross center scratch`.

    LLaVA's own training has such data beside its short answers (detailed descriptions): a one-word answer
    supervises one look at one part, a description supervises a look at every part of the scene, for the price
    of a few dozen answer tokens beside the 1,024 image tokens the step pays for anyway. Read from the scene the
    image was rendered from, like more_questions; the test split never gets it."""
    _, _, parts, _ = _planned(image_rng(seed, split, index))
    cell = SIZE / 3

    def order(p: Part):
        cx, cy = p.center
        return min(2, int(cy // cell)), min(2, int(cx // cell)), cy, cx

    words = []
    for p in sorted(parts, key=order):
        words.append(" ".join([p.color, p.shape, region_of(*p.center)] + ([p.defect] if p.defect else [])
                              + (["label", p.label] if p.label else [])))
    return {"question": DESCRIBE, "answers": [f"{len(parts)} parts : " + " , ".join(words)], "type": "describe"}


def patch_words(seed: int, split: str, index: int, grid: int, label_on_text: bool = True) -> list[str | None]:
    """What lies under each of the grid x grid patches of image `index` (row-major, as the tower orders them): for
    a patch whose centre falls on a part's silhouette, one word about that part: its label on every patch that
    overlaps the label's characters (label_box), and elsewhere its colour, shape, region and defect (where it has
    one) in turn by the patch's index, so a part of a few patches names each; None on the background. A decoder
    cannot tell which turn a patch is on from the patch alone, so what it learns is every word of the part at each
    of its patches; the label is named where it can be read, not by turn (label_on_text=False: the earlier targets,
    where it took a turn like the other words and landed on the characters only by chance).

    Training-time grounding for tools/train_easyvqa.py --ground: a per-patch target is 1,024 supervised rows an
    image where an answer is one, and the answer's attention must otherwise find the few rows a part covers among
    1,024 by the answers' gradient alone."""
    _, _, parts, _ = _planned(image_rng(seed, split, index))
    step = SIZE / grid
    out: list[str | None] = [None] * (grid * grid)
    for p in parts:
        mask = _mask(p.shape, p.side)
        text = p.label and label_on_text
        words = [p.color, p.shape, region_of(*p.center)] + [w for w in (p.defect, None if text else p.label) if w]
        box = label_box(p) if text else None
        for r in range(grid):
            for c in range(grid):
                y, x = int((r + 0.5) * step) - p.y, int((c + 0.5) * step) - p.x
                if 0 <= y < p.side and 0 <= x < p.side and mask[y, x]:
                    t = r * grid + c
                    on_text = box and box[0] < (c + 1) * step and c * step < box[2] and box[1] < (r + 1) * step \
                        and r * step < box[3]
                    out[t] = p.label if on_text else words[t % len(words)]
    return out


def summary(rows: list[dict]) -> dict:
    """Per type: questions, the answer counts, the majority answer (as eval's stats.majority picks it) and its share."""
    from vlmprune.compiler.quality import stats

    out = {}
    for kind in TYPES:
        answers = collections.Counter(r["answers"][0] for r in rows if r["type"] == kind)
        if not answers:
            continue
        top = stats.majority([r["answers"] for r in rows if r["type"] == kind])[0]
        out[kind] = {"questions": sum(answers.values()), "answers": dict(sorted(answers.items())),
                     "majority_answer": top, "majority_share": answers[top] / sum(answers.values())}
    total = len(rows)
    out["all"] = {"questions": total, "majority_share": sum(v["majority_share"] * v["questions"]
                                                            for v in out.values()) / max(1, total)}
    return out


def write_split(split: str, out: Path, seed: int = 0, count: int | None = None, force: bool = False,
                log=lambda line: None) -> dict:
    """Write the split's images, questions.jsonl and summary.json to out; the summary."""
    from PIL import Image

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    count = DEFAULT_COUNT[split] if count is None else count
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "images").mkdir()
        rows = []
        for i in range(count):
            pixels, questions = scene(seed, split, i)
            name = f"images/{split}-{i:05d}.png"
            Image.fromarray(pixels).save(tmp / name, optimize=False)
            rows += [{"id": f"{split}-{i:05d}-{j}", "image": name, **q} for j, q in enumerate(questions)]
            if (i + 1) % 500 == 0:
                log(f"{split}: {i + 1}/{count} images")
        with open(tmp / "questions.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        info = {"split": split, "seed": seed, "images": count, "size": SIZE, "types": summary(rows)}
        (tmp / "summary.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def cached_split(split: str, seed: int = 0, count: int | None = None, log=lambda line: None) -> Path:
    """The split's folder under $VLMPRUNE_CACHE/datasets, generated on first use: the one copy that training
    (tools/train_easyvqa.py) and the quality table (tools/eval_quality.py) share."""
    from vlmprune.kernels.build import cache_dir

    count = DEFAULT_COUNT[split] if count is None else count
    folder = cache_dir() / "datasets" / f"inspection-{split}-s{seed}-n{count}"
    if not (folder / "questions.jsonl").is_file():
        log(f"generating the inspection {split} split into {folder}")
        write_split(split, folder, seed, count, force=True, log=log)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=tuple(SPLITS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=None,
                        help=f"images (two questions each); default {DEFAULT_COUNT['train']} for train, "
                             f"{DEFAULT_COUNT['test']} for test")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    try:
        info = write_split(args.split, args.output, args.seed, args.count, args.force,
                           log=lambda line: print(line, flush=True))
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    types = info["types"]
    print(f"wrote {args.output}: {info['images']} images, {types['all']['questions']} questions")
    for kind in TYPES:
        if kind in types:
            t = types[kind]
            print(f"  {kind:13s} {t['questions']:5d} questions, majority {t['majority_answer']!r} "
                  f"{t['majority_share']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
