"""Real images for parity and calibration, preprocessed like the model's image processor."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

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


def _real(name: str) -> np.ndarray | None:
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
        raw = _real(name)
        if raw is None:
            raw, name = _synthetic(seed + i, size), f"synthetic(seed={seed + i})"
        images.append(preprocess(raw, size, mean, std))
        names.append(f"skimage.data.{name}" if not name.startswith("synthetic") else name)
    return np.stack(images), {"images": names, "seed": seed, "size": size, "mean": list(mean), "std": list(std)}


UPSCALE_WARNING = 4.0  # a short side upscaled more than this is mostly interpolation, not picture


def describe_preprocess(width: int, height: int, size: int, mean, std) -> tuple[str, float]:
    """What preprocess() does to a width x height image, in words, and the factor it scales the short side by."""
    scale = size / min(width, height)
    resized = (max(size, round(width * scale)), max(size, round(height * scale)))
    mean_s = ", ".join(f"{m:.3f}" for m in mean)
    std_s = ", ".join(f"{s:.3f}" for s in std)
    verb = "upscaled" if scale > 1 else "downscaled" if scale < 1 else "kept at"
    text = (f"{width}x{height} image: short side {verb} x{scale:.3g} to {resized[0]}x{resized[1]} "
            f"(bilinear, antialiased), centre crop {size}x{size}, scaled to [0, 1], "
            f"normalised with mean ({mean_s}) and std ({std_s})")
    return text, scale


def load_image_file(path: str, size: int, mean, std) -> tuple[np.ndarray, str, float]:
    """An image file -> ([1, 3, size, size] float32, a description of the preprocessing, the upscale factor)."""
    from PIL import Image

    with Image.open(path) as img:
        rgb = np.asarray(img.convert("RGB"))
    text, scale = describe_preprocess(rgb.shape[1], rgb.shape[0], size, mean, std)
    return preprocess(rgb, size, mean, std)[None], text, scale
