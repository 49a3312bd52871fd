"""Pictures of a selection: the image as the model saw it, with what the bundle kept.

Drawn on the preprocessed image (after the model's resize and centre crop, un-normalised),
one cell per patch of the grid: pruned patches dimmed, kept patches outlined, merge
targets (a kept token that other patches were merged into, e.g. VisionZip's contextual
tokens) outlined in their own colour with the patches merged into them tinted in it, and
forced-keep regions hatched. The colours are fixed constants so that tests (and people)
can read a picture by its pixels.

What is kept comes from the bundle's own `kept_indices` output. Which patches were merged
where is not a bundle output (adding one would change the bundle's output contract), so it
is traced from the parity reference instead: the method's plain-torch reference run again
on the same image, and each merged token's weight on every input patch read off by
autograd (a merged token is linear in the site's hidden states once the selection is made,
so its gradient is exactly that weight). It is generic: any method whose kept tokens are
not plain copies (Method.copied_rows) gets its merges drawn, and no method is named here.

Forced-keep regions (`--roi` bundles, compiler.roi): `run --roi-box / --roi-mask` passes the
forced set it fed (compiler.roi.forced_for_run), and those patches are hatched.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from vlmprune.compiler.bundle.manifest import KeepAutoSection, Manifest

DIM = 0.3  # pruned patches keep this fraction of their brightness
KEPT_RGB = (255, 214, 0)  # outline of a kept patch
HATCH_RGB = (255, 255, 255)  # forced-keep hatching
TINT = 0.3  # weight of a merge target's colour over the patches merged into it
MERGED_DIM = 0.6  # merged patches are dimmed less than pruned ones: their content lives on in the target
# Merge targets' colours: distinct from the kept outline and from each other (Okabe-Ito, without yellow).
MERGE_RGB = ((0, 158, 255), (230, 60, 200), (0, 200, 120), (255, 110, 40), (150, 110, 255), (0, 220, 230),
             (240, 40, 60), (150, 200, 0))
CAPTION_BG = (24, 28, 34)
CAPTION_FG = (235, 235, 235)


@dataclasses.dataclass
class Selection:
    """One image's selection, in patch indices of a `grid` x `grid` patch grid (raster order)."""

    image: np.ndarray  # uint8 [S, S, 3], as the model saw it
    grid: int
    kept: np.ndarray  # [K] patch indices the bundle kept
    merges: dict[int, np.ndarray] | None = None  # merge target patch -> patches merged into it
    forced: np.ndarray | None = None  # bool [N]: forced-keep patches (hatched; --roi bundles, compiler.roi)
    title: str = ""
    legend: str = ""


def require_pillow() -> None:
    """Pictures are drawn with Pillow, a core dependency; one line, before any work, where it was uninstalled."""
    import importlib.util

    if importlib.util.find_spec("PIL") is None:
        from vlmprune.compiler.errors import ToolchainError

        raise ToolchainError("drawing pictures needs Pillow, which vlmprune depends on: pip install 'pillow>=10'")


def model_view(pixel: np.ndarray, mean, std) -> np.ndarray:
    """[3, S, S] normalised float -> uint8 [S, S, 3]: the pixels the model saw, back in [0, 255]."""
    x = pixel.astype(np.float64) * np.asarray(std).reshape(3, 1, 1) + np.asarray(mean).reshape(3, 1, 1)
    return np.round(np.clip(x, 0.0, 1.0) * 255.0).transpose(1, 2, 0).astype(np.uint8)


def display_scale(size: int) -> int:
    """Integer upscaling (nearest) so a small tower's picture is still legible, and patches stay whole cells."""
    return max(1, 336 // size)


def cell(index: int, grid: int, cell_px: int) -> tuple[int, int, int, int]:
    """Pixel box (top, left, bottom, right) of patch `index` in a picture whose cells are cell_px wide."""
    row, col = divmod(int(index), grid)
    return row * cell_px, col * cell_px, (row + 1) * cell_px, (col + 1) * cell_px


def outline_width(cell_px: int) -> int:
    return max(1, cell_px // 12)


def draw(sel: Selection) -> np.ndarray:
    """The selection picture without caption: uint8 [S·f, S·f, 3] (f = display_scale)."""
    size = sel.image.shape[0]
    f = display_scale(size)
    img = np.repeat(np.repeat(sel.image, f, axis=0), f, axis=1).astype(np.float64)
    n = sel.grid * sel.grid
    cell_px = size * f // sel.grid
    kept = set(int(i) for i in sel.kept)
    out = img.copy()
    merged_into = {int(i): slot for slot, (_t, merged) in enumerate(sorted((sel.merges or {}).items())) for i in merged}
    for i in range(n):
        if i in kept:
            continue
        t, l, b, r = cell(i, sel.grid, cell_px)
        if i in merged_into:
            color = np.asarray(MERGE_RGB[merged_into[i] % len(MERGE_RGB)], dtype=np.float64)
            out[t:b, l:r] = (1 - TINT) * MERGED_DIM * img[t:b, l:r] + TINT * color
        else:
            out[t:b, l:r] = DIM * img[t:b, l:r]
    width = outline_width(cell_px)
    if sel.forced is not None:
        for i in np.flatnonzero(np.asarray(sel.forced).reshape(-1)):
            t, l, b, r = cell(i, sel.grid, cell_px)
            yy, xx = np.mgrid[t:b, l:r]
            out[t:b, l:r][((yy + xx) % max(4, cell_px // 3)) < max(1, width)] = HATCH_RGB
    out = np.round(out).astype(np.uint8)
    targets = {int(t): MERGE_RGB[s % len(MERGE_RGB)] for s, t in enumerate(sorted(sel.merges or {}))}
    for i in kept:
        outline(out, cell(i, sel.grid, cell_px), targets.get(i, KEPT_RGB), width * (2 if i in targets else 1))
    return out


def outline(img: np.ndarray, box, color, width: int) -> None:
    """A box's outline drawn on img in place, width pixels inside it (also report.py's boxes)."""
    t, l, b, r = box
    w = min(width, (b - t) // 2)
    img[t:t + w, l:r] = color
    img[b - w:b, l:r] = color
    img[t:b, l:l + w] = color
    img[t:b, r - w:r] = color


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _wrap(text: str, font, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}".strip()
            if line and font.getlength(candidate) > width:
                lines.append(line)
                line = word
            else:
                line = candidate
        lines.append(line)
    return lines


def with_caption(picture: np.ndarray, title: str, legend: str):
    """The picture above a dark strip holding its title and legend (a PIL image)."""
    from PIL import Image, ImageDraw

    width = picture.shape[1]
    title_font, text_font = _font(15), _font(12)
    lines = [(line, title_font) for line in _wrap(title, title_font, width - 12)] if title else []
    lines += [(line, text_font) for line in _wrap(legend, text_font, width - 12)] if legend else []
    heights = [(18 if font is title_font else 15) for _, font in lines]
    strip = sum(heights) + 10 if lines else 0
    canvas = Image.new("RGB", (width, picture.shape[0] + strip), CAPTION_BG)
    canvas.paste(Image.fromarray(picture), (0, 0))
    pen = ImageDraw.Draw(canvas)
    y = picture.shape[0] + 5
    for (line, font), h in zip(lines, heights):
        pen.text((6, y), line, fill=CAPTION_FG, font=font)
        y += h
    return canvas


def legend_for(manifest: Manifest, sel: Selection, note: str | None = None) -> str:
    """What the colours mean for this bundle, in one paragraph."""
    method = manifest.method
    n = sel.grid * sel.grid
    unit = "tokens" if manifest.model.token_counts else "patches"
    parts = [f"kept {len(sel.kept)} of {n} {unit} (yellow outline); pruned {unit} dimmed"]
    if sel.merges:
        merged = sum(len(v) for v in sel.merges.values())
        parts.append(f"{len(sel.merges)} merge targets (coloured outline), {merged} patches merged into them "
                     "(tinted in the target's colour)")
    extra = manifest.llm.extra_rows if manifest.llm is not None else None  # the hand-off's row count, where it has one
    if extra is None:
        kept = len(sel.kept) if method.kept_count is None else method.kept_count
        extra = (method.tokens_out or 0) - kept - int(bool(method.has_cls))
    if extra > 0:
        parts.append(f"+{extra} token{'s' if extra > 1 else ''} with no patch position (e.g. a summary of the "
                     "pruned patches)")
    if sel.forced is not None and np.any(sel.forced):
        parts.append("forced-keep regions hatched")
    if note:
        parts.append(note)
    return "; ".join(parts)


def title_for(name: str, manifest: Manifest) -> str:
    method = manifest.method
    if not method.pruned:
        return f"{name}: {method.summary}"
    return f"{name}: {method.name} K={method.keep} ({manifest.target.name})"


def picture(sel: Selection):
    """The full picture (PIL image): the selection drawn, with its title and legend."""
    return with_caption(draw(sel), sel.title, sel.legend)


def grid_of(pictures: list, columns: int | None = None):
    """Several pictures side by side (rows of `columns`), on a common cell size, as one PIL image."""
    from PIL import Image

    columns = columns or min(4, len(pictures))
    width = max(p.width for p in pictures)
    height = max(p.height for p in pictures)
    rows = -(-len(pictures) // columns)
    gap = 8
    size = (columns * width + (columns + 1) * gap, rows * height + (rows + 1) * gap)
    canvas = Image.new("RGB", size, (255, 255, 255))
    for k, p in enumerate(pictures):
        r, c = divmod(k, columns)
        canvas.paste(p, (gap + c * (width + gap), gap + r * (height + gap)))
    return canvas


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


# ------------------------------------------------------------------ merges, from the reference


Merges = list[dict[int, np.ndarray]]  # per image: merge target patch -> the patches merged into it


def reference_merges(manifest: Manifest, pixel: np.ndarray) -> tuple[Merges | None, np.ndarray | None, str | None]:
    """(per image {target patch: merged patches}, the reference's kept indices, a note) for pixel [B, 3, S, S].

    (None, None, None) when the method's kept tokens are plain copies (nothing was merged
    into a kept token); (None, None, why) when the merges cannot be traced here.
    """
    from vlmprune.passes.methods import method_of

    method = manifest.method
    if not method.pruned:
        return None, None, None
    copied = method_of(method).copied_rows(method.params)
    if copied >= method.kept_count:
        return None, None, None
    from vlmprune.compiler.errors import VlmpruneError
    from vlmprune.compiler.parity.reference import pruner_for
    from vlmprune.compiler.pipeline import load_bundle

    try:  # the bundle's source as `check` loads it: where it was compiled from, with the same content
        source = load_bundle(manifest, how="its reference is what traces the merges")[0].source
    except VlmpruneError as exc:
        return None, None, f"merges not shown: {exc}"
    if source.pipeline is None:
        return None, None, "merges not shown: an .onnx source has no torch reference to trace them from"
    tracer = _MergeTracer(pruner_for(manifest.record), copied)
    import torch

    with torch.no_grad():
        source.pipeline.with_pruner(tracer)(torch.from_numpy(pixel))
    weights, kept = tracer.weights, tracer.kept  # [B, kept - copied, N], [B, kept]
    merges = []
    for b in range(len(pixel)):
        per_image = {}
        for j in range(weights.shape[1]):
            target = int(kept[b, copied + j])
            if target < 0:  # a padded slot of a variable K (its row: zero, or prumerge+'s extra token, no patch)
                continue
            joined = np.flatnonzero(weights[b, j] > 1e-9)
            per_image[target] = joined[joined != target]
        merges.append(per_image)
    return merges, kept, None


class _MergeTracer:
    """A pruner that runs the method's reference with the site's hidden states tracked by autograd.

    Each merged output token is linear in the hidden states given the (discrete)
    selection, so the gradient of its sum with respect to patch i is its weight on i.
    """

    def __init__(self, pruner, copied: int):
        self.pruner, self.copied = pruner, copied
        self.site, self.layer = pruner.site, pruner.layer
        self.weights = self.kept = None

    def __call__(self, tensors):
        import torch

        # In the site's own dtype: every tensor the method reads (weights of a scoring head too) stays compatible,
        # and gathers and means have exact gradients (a patch not merged gets exactly 0).
        hidden = tensors.hidden.detach().clone().requires_grad_(True)
        traced = dataclasses.replace(tensors, hidden=hidden)
        with torch.enable_grad():
            result = self.pruner.method.reference(self.pruner.params, traced)
            prefix = traced.prefix
            rows = []
            for j in range(self.copied, result.kept.shape[1]):
                (grad,) = torch.autograd.grad(result.tokens[:, prefix + j].sum(), hidden, retain_graph=True)
                rows.append(grad[:, prefix:].mean(dim=-1))
        self.weights = torch.stack(rows, dim=1).numpy()
        self.kept = result.kept.numpy()
        return result.tokens.detach(), result.kept, result.trace


def token_grid(manifest: Manifest) -> int:
    """Side of the square grid the kept indices index: patches, or merged tokens for a merging tower."""
    size = manifest.preprocess.size
    if manifest.model.token_counts:  # e.g. Qwen2-VL: kept indices count merged tokens (spatial_merge² patches each)
        t, h, w = manifest.model.merged_grid_thw
        if t != 1 or h != w or size % h:
            from vlmprune.compiler.errors import InputError

            raise InputError(f"this bundle's tokens form a {t}x{h}x{w} grid: pictures draw one square grid")
        return h
    patch = manifest.model.patch_size
    if patch:
        return size // patch
    # No patch size recorded (an .onnx source whose patches are not embedded by a Conv): the patch count's side.
    count = manifest.method.num_patches or 0
    side = int(round(count ** 0.5))
    if count and side * side == count:
        return side
    from vlmprune.compiler.errors import InputError

    raise InputError("this bundle records neither a patch size nor a square patch count: pictures cannot place "
                     "its patches")


def check_one_grid(kept, grid: int) -> None:
    """One line for kept indices beyond one patch grid (several crops per image): not drawn, rather than drawn wrong."""
    top = int(np.max(kept)) if np.size(kept) else 0
    if top >= grid * grid:
        from vlmprune.compiler.errors import InputError

        raise InputError(f"this bundle keeps patch indices up to {top}, beyond one {grid}x{grid} patch grid "
                         "(several crops per image): pictures draw one grid and cannot show it yet")


def video_selections(manifest: Manifest, pixel: np.ndarray, kept: np.ndarray, name: str) -> list[Selection]:
    """A video bundle's run (one clip, [F, 3, S, S]): one Selection per temporal patch, drawn on its first frame,
    with the kept tokens of that patch (kept indices count the clip's tokens frame by frame)."""
    t, h, w = manifest.model.merged_grid_thw
    per_frame, frames = h * w, manifest.model.video_frames
    step = frames // t
    kept = np.asarray(kept).reshape(-1)
    sels = []
    for i in range(t):
        mine = kept[(kept >= i * per_frame) & (kept < (i + 1) * per_frame)] - i * per_frame
        sel = Selection(model_view(pixel[i * step], manifest.preprocess.mean, manifest.preprocess.std), h, mine,
                        title=f"{name}: frames {i * step}-{(i + 1) * step - 1}")
        sel.legend = legend_for(manifest, sel) + f" ({len(kept)} of {t * per_frame} over the clip)"
        sels.append(sel)
    return sels


def selections_for_run(manifest: Manifest, pixel: np.ndarray, kept: np.ndarray, name: str,
                       forced: np.ndarray | None = None) -> tuple[list[Selection], str | None]:
    """One Selection per image of a `vlmprune run`: the bundle's kept indices, merges traced from the reference;
    forced: bool [B, N], the ROI's forced patches (hatched), where the run fed one."""
    pre = manifest.preprocess
    grid = token_grid(manifest)
    check_one_grid(kept, grid)
    merges, ref_kept, note = reference_merges(manifest, pixel)
    sels = []
    for b in range(len(pixel)):
        per_image = None
        image_note = note
        if merges is not None:
            per_image = {t: v for t, v in merges[b].items() if t in set(kept[b].tolist())}
            if set(ref_kept[b].tolist()) != set(kept[b].tolist()):
                differ = len(np.setxor1d(ref_kept[b], kept[b])) // 2
                image_note = (f"the reference kept {differ} other patch{'es' if differ > 1 else ''}; merges shown "
                              "for the targets both kept")
            image_note = (image_note + "; " if image_note else "") + "merges traced from the parity reference"
        valid = np.asarray(kept[b])[np.asarray(kept[b]) >= 0]  # -1: the padded slots of a variable K
        sel = Selection(model_view(pixel[b], pre.mean, pre.std), grid, valid, per_image,
                        forced=None if forced is None else np.asarray(forced[b]), title=title_for(name, manifest))
        sel.legend = legend_for(manifest, sel, image_note)
        sels.append(sel)
    return sels, note


BUDGET_RGB = (207, 34, 46)  # --keep auto: the latency budget line
CURVE_RGB = (31, 119, 180)  # --keep auto: the measured K -> latency points
CHOSEN_RGB = (26, 127, 55)  # --keep auto: the K chosen


def latency_curve(section: KeepAutoSection, size: tuple[int, int] = (600, 360)):
    """The K -> latency curve `--keep auto` measured (the manifest's keep_auto), as a PIL image: every timed K as a
    point (K on a log2 axis, as the ladder spaces them), the budget as a dashed line, the chosen K ringed."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    w, h = size
    left, right, top, bottom = 64, 24, 30, 46
    curve = sorted((int(k), float(ms)) for k, ms in section.curve)
    budget, chosen = float(section.budget_ms), int(section.chosen)
    ks = [k for k, _ in curve]
    lo_k, hi_k = np.log2(ks[0]), np.log2(ks[-1])
    top_ms = max(budget, *(ms for _, ms in curve)) * 1.1
    x = lambda k: left + (0.5 if hi_k == lo_k else (np.log2(k) - lo_k) / (hi_k - lo_k)) * (w - left - right)  # noqa
    y = lambda ms: top + (1 - ms / top_ms) * (h - top - bottom)  # noqa: E731
    image = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(image)
    d.rectangle([left, top, w - right, h - bottom], outline=(0, 0, 0))
    for i in range(5):
        ms = top_ms * i / 4
        d.line([left - 4, y(ms), left, y(ms)], fill=(0, 0, 0))
        d.text((4, y(ms) - 6), f"{ms:.3g}", fill=(0, 0, 0), font=font)
    for k in ks:
        d.line([x(k), h - bottom, x(k), h - bottom + 4], fill=(0, 0, 0))
    for k in dict.fromkeys([ks[0], *[k for k in ks if k & (k - 1) == 0], chosen, ks[-1]]):  # powers of 2, ends
        d.text((x(k) - 8, h - bottom + 8), str(k), fill=(0, 0, 0), font=font)
    for start in range(left, w - right, 12):
        d.line([start, y(budget), min(start + 6, w - right), y(budget)], fill=BUDGET_RGB, width=2)
    d.text((w - right - 110, y(budget) - 14), f"budget {budget:g} ms", fill=BUDGET_RGB, font=font)
    points = [(x(k), y(ms)) for k, ms in curve]
    if len(points) > 1:
        d.line(points, fill=CURVE_RGB, width=2)
    for px, py in points:
        d.rectangle([px - 3, py - 3, px + 3, py + 3], fill=CURVE_RGB)
    cx, cy = x(chosen), y(dict(curve)[chosen])
    d.ellipse([cx - 7, cy - 7, cx + 7, cy + 7], outline=CHOSEN_RGB, width=2)
    d.text((left, 8), f"latency vs K (--keep auto): K={chosen} chosen", fill=(0, 0, 0), font=font)
    d.text(((w - right + left) / 2 - 50, h - 16), "K (kept tokens)", fill=(0, 0, 0), font=font)
    return image
