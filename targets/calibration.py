"""Calibration images for the quantized precisions (ort and orin/xavier int8, rk3588 hybrid int8, qnn QDQ).

Real photographs from scikit-image, preprocessed like the model's image processor, and
disjoint from the parity images (compiler.frontend.images.REAL_IMAGES): a quantizer calibrated on
the images it is then checked on would flatter its own parity figures. Without
scikit-image, seeded synthetic images stand in (their names say so). How a model's images are
preprocessed is the frontend's to say: the caller hands it over (`images`: the emit context's
"images", compiler.frontend.images), so that this module reads no model. (rk3588's simulator
stage, which rebuilds the .rknn from a bundle, gets the same context from the pipeline: Target.stages.)
"""

from __future__ import annotations

import numpy as np

# skimage.data images stored in the wheel (no download): photographs and micrographs
# with the edges and textures a ViT's [CLS] attention reacts to.
CALIBRATION_IMAGES = ("camera", "coins", "hubble_deep_field", "immunohistochemistry", "motorcycle", "retina",
                      "clock", "brick")
SYNTHETIC_SEED = 100  # far from the parity images' seeds


def _load(name: str) -> np.ndarray:
    from skimage import data

    image = data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(data, name)()
    return np.stack([image] * 3, -1) if image.ndim == 2 else image[..., :3]


def calibration_inputs(count: int, size: int, mean, std, images) -> tuple[np.ndarray, list[str]]:
    """count preprocessed images [count, 3, size, size] and where each came from.

    images: the frontend's preprocessing (its preprocess and parity_inputs), as the emit context carries it.
    """
    if count > len(CALIBRATION_IMAGES):
        raise ValueError(f"at most {len(CALIBRATION_IMAGES)} calibration images, asked for {count}")
    try:
        import skimage  # noqa: F401
    except ImportError:
        pixel, described = images.parity_inputs(count, size, mean, std, seed=SYNTHETIC_SEED)
        return pixel, described["images"]
    names = list(CALIBRATION_IMAGES[:count])
    pixel = np.stack([images.preprocess(_load(name), size, mean, std) for name in names])
    return pixel, [f"skimage.data.{name}" for name in names]
