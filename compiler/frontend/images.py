"""Real images for parity and calibration, preprocessed like the model's image processor."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vlmprune.compiler.errors import InputError

# skimage.data images: real photographs with structure the [CLS] attention reacts to.
REAL_IMAGES = ("astronaut", "chelsea", "coffee", "rocket")


def preprocess(image: np.ndarray, size: int, mean, std) -> np.ndarray:
    """uint8 HxWx3 -> float32 3xSxS: resize the short side, centre crop, scale to [0, 1], normalise."""
    x = torch.from_numpy(np.array(image[..., :3])).permute(2, 0, 1).float().unsqueeze(0) / 255.0
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    x = F.interpolate(x, size=(max(size, round(h * scale)), max(size, round(w * scale))), mode="bilinear",
                      antialias=True, align_corners=False)
    top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
    x = x[..., top: top + size, left: left + size]
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    return x[0].numpy().astype(np.float32)


def real_image(name: str) -> np.ndarray | None:
    """skimage.data's photo `name` as uint8 HxWx3 (a copy the caller may change), or None without scikit-image."""
    image = _decoded(name)
    return None if image is None else image.copy()


@functools.lru_cache(maxsize=len(REAL_IMAGES) + 2)
def _decoded(name: str) -> np.ndarray | None:
    """Each photo is decoded once a process: every compile's parity and calibration batch reads the same few."""
    try:
        from skimage import data
    except ImportError:
        return None
    image = getattr(data, name)()
    return np.stack([image] * 3, -1) if image.ndim == 2 else image


def _synthetic(seed: int, size: int) -> np.ndarray:
    """Smooth seeded noise with edges, for machines without scikit-image."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(1, 3, 12, 12)).astype(np.float32)
    img = F.interpolate(torch.from_numpy(coarse), size=(size, size), mode="bicubic", align_corners=False)
    return img[0].permute(1, 2, 0).clamp(0, 255).numpy().astype(np.uint8)


def parity_inputs(batch: int, size: int, mean, std, seed: int = 0) -> tuple[np.ndarray, dict]:
    """A batch of preprocessed images and a description of where each came from."""
    images, names = [], []
    for i in range(batch):
        name = REAL_IMAGES[i % len(REAL_IMAGES)]
        raw = real_image(name)
        if raw is None:
            raw, name = _synthetic(seed + i, size), f"synthetic(seed={seed + i})"
        images.append(preprocess(raw, size, mean, std))
        names.append(f"skimage.data.{name}" if not name.startswith("synthetic") else name)
    return np.stack(images), {"images": names, "seed": seed, "size": size, "mean": list(mean), "std": list(std)}


def parse_grid(text: str) -> tuple[int, int]:
    """`RxC` (--grid: the crops' or tiles' grid, rows x cols) -> (rows, cols); one line for anything else."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"--grid is ROWSxCOLS (e.g. 2x2), got {text!r}")
    return int(parts[0]), int(parts[1])


UPSCALE_WARNING = 4.0  # a short side upscaled more than this is mostly interpolation, not picture


def require_image_files(paths, flag: str) -> list[Path]:
    """paths, each an existing file, checked before any work: the one wording of a missing image for every command
    that reads one (run, compare, generate). flag: the option that named them (compiler.errors.option)."""
    paths = [Path(p) for p in paths]
    for path in paths:
        if path.is_dir():
            raise InputError(f"{flag} {path}: a directory, not an image file")
        if not path.is_file():
            raise InputError(f"{flag} {path}: no such image file")
    return paths


def describe_preprocess(width: int, height: int, size: int, mean, std, depth: str = "") -> tuple[str, float]:
    """What preprocess() does to a width x height image, in words, and the factor it scales the short side by.

    depth: read_rgb's note of how the file's pixels were scaled to 8 bits, if they were."""
    scale = size / min(width, height)
    resized = (max(size, round(width * scale)), max(size, round(height * scale)))
    mean_s = ", ".join(f"{m:.3f}" for m in mean)
    std_s = ", ".join(f"{s:.3f}" for s in std)
    verb = "upscaled" if scale > 1 else "downscaled" if scale < 1 else "kept at"
    text = (f"{width}x{height} image{depth}: short side {verb} x{scale:.3g} to {resized[0]}x{resized[1]} "
            f"(bilinear, antialiased), centre crop {size}x{size}, scaled to [0, 1], "
            f"normalised with mean ({mean_s}) and std ({std_s})")
    return text, scale


def load_image_file(path: str, size: int, mean, std) -> tuple[np.ndarray, str, float]:
    """An image file -> ([1, 3, size, size] float32, a description of the preprocessing, the upscale factor)."""
    rgb, depth = read_rgb(path)
    text, scale = describe_preprocess(rgb.shape[1], rgb.shape[0], size, mean, std, depth)
    return preprocess(rgb, size, mean, std)[None], text, scale


# EXIF orientation -> what showing the stored pixels upright takes (ImageOps.exif_transpose does it)
ORIENTATIONS = {2: "mirrored left-right", 3: "rotated 180°", 4: "mirrored top-bottom",
                5: "mirrored left-right and rotated 90° counter-clockwise", 6: "rotated 90° clockwise",
                7: "mirrored left-right and rotated 90° clockwise", 8: "rotated 90° counter-clockwise"}
ALPHA_BACKGROUND = (255, 255, 255)  # white, as Hugging Face image processors composite (convert_to_rgb)


def read_rgb(path: str) -> tuple[np.ndarray, str]:
    """An image file -> (uint8 HxWx3, "" or a note of what was done to its pixels, for its description).

    As image viewers show it: the EXIF orientation tag is applied (a camera's portrait photo
    is stored sideways with a tag saying so), and transparency is composited on white
    (ALPHA_BACKGROUND) rather than dropped, which would show whatever colour the transparent
    pixels happen to hold. Pillow's convert("RGB") clips 16-bit, 32-bit integer and float
    pixels at 255 rather than scaling them (a 16-bit gradient would turn flat white), so
    those are scaled here by their full scale. 16-bit RGB files need nothing: Pillow opens
    them as 8-bit RGB, scaled.
    """
    from PIL import Image, ImageOps

    notes = []
    with Image.open(path) as stored:
        orientation = stored.getexif().get(0x0112, 1)
        img = ImageOps.exif_transpose(stored)
        if orientation in ORIENTATIONS:
            notes.append(f"EXIF orientation {orientation} applied: {ORIENTATIONS[orientation]}")
        if img.mode not in ("I", "F") and not img.mode.startswith("I;16"):
            if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
                rgba = img.convert("RGBA")
                if rgba.getextrema()[3][0] < 255:  # some pixel is not opaque
                    img = Image.alpha_composite(Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,)), rgba)
                    notes.append(f"transparency composited on white {ALPHA_BACKGROUND}")
            return np.asarray(img.convert("RGB")), _note(notes)
        values = np.asarray(img, dtype=np.float64)
        mode = img.mode
    top = float(values.max()) if values.size else 0.0
    if mode.startswith("I;16"):
        full, depth = 65535.0, "16-bit grayscale"
    elif mode == "F" and top <= 1.0:
        full, depth = 1.0, "float grayscale in [0, 1]"
    elif top <= 255:  # 8-bit values in a wider container
        full, depth = 255.0, None
    elif top <= 65535:  # how Pillow gives some 16-bit files ("I")
        full, depth = 65535.0, "16-bit grayscale"
    elif mode == "I":
        full, depth = 2.0 ** 31 - 1, "32-bit integer grayscale"
    else:
        full, depth = top, "float grayscale, by its maximum"
    gray = np.round(np.clip(values / full, 0.0, 1.0) * 255.0).astype(np.uint8)
    if depth:
        notes.append(f"{depth}, scaled to 8 bits")
    return np.stack([gray] * 3, axis=-1), _note(notes)


def _note(notes: list[str]) -> str:
    return f" ({'; '.join(notes)})" if notes else ""


def anyres_crops(image: np.ndarray, crops: dict, size: int, mean, std, fill: bool = True) -> np.ndarray:
    """uint8 HxWx3 -> [C, 3, size, size]: LlavaNextImageProcessor's crops for the bundle's one grid.

    The processor (transformers' own, PIL backend) is given the bundle's grid as its only
    pinpoint: the base image resized to size x size, then the grid's tiles in raster order.
    fill (parity): the photo is first centre-cropped to the grid's aspect and resized to its
    resolution, so that nothing is padded (the dense output then needs no unpadding); without
    it the processor resizes keeping the aspect and pads, as it does for a user's image.
    """
    from PIL import Image
    from transformers import LlavaNextImageProcessorPil

    height, width = crops["resolution"]
    pil = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    if fill:
        h, w = image.shape[:2]
        scale = max(height / h, width / w)
        ch, cw = round(height / scale), round(width / scale)
        top, left = (h - ch) // 2, (w - cw) // 2
        pil = Image.fromarray(np.ascontiguousarray(image[top: top + ch, left: left + cw, :3]))
        pil = pil.resize((width, height), Image.BICUBIC)
    processor = LlavaNextImageProcessorPil(image_grid_pinpoints=[[height, width]], size={"shortest_edge": size},
                                           crop_size={"height": size, "width": size}, image_mean=list(mean),
                                           image_std=list(std))
    pixel = processor(images=pil, return_tensors="np")["pixel_values"][0]
    if pixel.shape[0] != crops["count"]:
        raise AssertionError(f"the processor gave {pixel.shape[0]} crops, the grid has {crops['count']}")
    return pixel.astype(np.float32)


def parity_crops(images: int, crops: dict, size: int, mean, std, seed: int = 0, cut=anyres_crops,
                 ) -> tuple[np.ndarray, dict]:
    """parity_inputs for an anyres or tiled source: `images` photos, each as its C crops: [images·C, 3, size, size].

    cut: how the model's processor cuts a photo (anyres_crops: LLaVA-NeXT's; canvas_tiles: InternVL's)."""
    out, names = [], []
    height, width = crops["resolution"]
    for i in range(images):
        name = REAL_IMAGES[i % len(REAL_IMAGES)]
        raw = real_image(name)
        if raw is None:
            raw, name = _synthetic(seed + i, max(height, width)), f"synthetic(seed={seed + i})"
        out.append(cut(raw, crops, size, mean, std))
        names.append(f"skimage.data.{name}" if not name.startswith("synthetic") else name)
    return np.concatenate(out), {"images": names, "seed": seed, "size": size, "mean": list(mean), "std": list(std),
                                 "crops": crops["count"], "grid": crops["grid"], "resolution": [height, width]}


def load_image_crops(path: str, crops: dict, size: int, mean, std) -> tuple[np.ndarray, str]:
    """An image file -> ([C, 3, size, size] float32 crops for the bundle's grid, a description)."""
    rgb, depth = read_rgb(path)
    height, width = crops["resolution"]
    rows, cols = crops["grid"]
    text = (f"{rgb.shape[1]}x{rgb.shape[0]} image{depth}: LlavaNextImageProcessor for the {rows}x{cols} grid "
            f"({width}x{height}): resized keeping its aspect and padded, cut into {rows * cols} tiles of "
            f"{size}x{size} after the whole image resized to {size}x{size} ({crops['count']} crops); the LLM "
            f"runtime unpads by the original size {rgb.shape[0]}x{rgb.shape[1]} (README)")
    return anyres_crops(rgb, crops, size, mean, std, fill=False), text


def crop_to_grid(image: np.ndarray, rows: int, cols: int, within: bool = False) -> np.ndarray:
    """The centre crop of a uint8 HxWx3 image to a grid's aspect (cols : rows), so that any photo gives the bundle's
    grid, as a static graph needs (canvas_tiles, and the tiled families' own cuts).

    within: the crop's short side rounded down, never past the grid's aspect (for a processor that rounds the short
    side up to whole tiles, which a crop a pixel too tall would give a row more); else each side to the nearest."""
    h, w = image.shape[:2]
    if not within:
        scale = min(h / rows, w / cols)
        ch, cw = max(1, round(rows * scale)), max(1, round(cols * scale))
    elif cols >= rows:  # the width is the long side: the height follows it, rounded down
        cw = min(w, h * cols // rows)
        ch = max(1, min(h, cw * rows // cols))
    else:
        ch = min(h, w * rows // cols)
        cw = max(1, min(w, ch * cols // rows))
    top, left = (h - ch) // 2, (w - cw) // 2
    return image[top: top + ch, left: left + cw]


def canvas_tiles(image: np.ndarray, crops: dict, size: int, mean, std, fill: bool = True) -> np.ndarray:
    """uint8 HxWx3 -> [C, 3, size, size]: InternVL's processor tiles (GotOcr2ImageProcessor's crop_to_patches) for
    the bundle's one grid: the rows x cols tiles in raster order, then the thumbnail (the whole image resized to
    size x size) when there is more than one tile.

    The processor picks the grid closest to the image's aspect among those of min..max_patches tiles; asked for
    exactly rows·cols tiles, it picks the bundle's grid for an image of that grid's aspect. fill: the photo is
    first centre-cropped to the grid's aspect (cols : rows), so that any photo gives the bundle's grid, as a
    static graph needs; the processor then resizes it to the grid's resolution itself.
    """
    from PIL import Image
    from transformers import GotOcr2ImageProcessorPil

    rows, cols = crops["grid"]
    if fill:
        image = crop_to_grid(image, rows, cols)
    processor = GotOcr2ImageProcessorPil(size={"height": size, "width": size}, crop_to_patches=True,
                                         min_patches=rows * cols, max_patches=rows * cols, image_mean=list(mean),
                                         image_std=list(std))
    pil = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    pixel = processor(images=pil, return_tensors="np")["pixel_values"]
    if pixel.shape[0] != crops["count"]:
        raise AssertionError(f"the processor gave {pixel.shape[0]} tiles, the grid has {crops['count']}")
    return pixel.astype(np.float32)
