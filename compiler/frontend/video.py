"""Video input: a folder of frames or a short video file, sampled to the F frames a bundle was compiled for.

A video bundle has a static frame count F (`compile --video-frames F`): the graph's input is
the F frames of one clip [F, 3, S, S], each preprocessed as a still image is
(images.preprocess: short side resized, centre crop, normalised). A longer clip is sampled
to F frames evenly over its length (frame round(i·(n - 1)/(F - 1)), the first and the last
included), a shorter one is refused: repeating frames would show the model a still scene.

The clip made here (`clip_made_here`): a still photograph with a small bright square moving
across it, then a scene cut to another photograph with the square still moving: what temporal
pruning should do is visible on it (the still background goes, the moving square and the cut stay).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.images import preprocess, read_rgb, real_image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def sample_indices(available: int, frames: int) -> list[int]:
    """F frame indices spread evenly over `available` frames, the first and the last included."""
    if frames == 1:
        return [0]
    return [round(i * (available - 1) / (frames - 1)) for i in range(frames)]


def read_frames(path: str | Path, frames: int) -> tuple[list[np.ndarray], str]:
    """uint8 HxWx3 frames of a folder of images (in name order) or a video file (imageio), sampled to F, and a line
    saying what was read."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise InputError(f"--video {path}: a folder with no image files ({', '.join(FRAME_SUFFIXES)})")
        chosen = sample_indices(len(files), frames) if len(files) >= frames else None
        if chosen is None:
            raise InputError(f"--video {path}: {len(files)} frames, and this bundle takes {frames}")
        return [read_rgb(str(files[i]))[0] for i in chosen], f"{path}: {len(files)} frames, sampled to {frames}"
    if not path.is_file():
        raise InputError(f"--video {path}: no such file or folder")
    try:
        import imageio.v3 as iio

        clip = iio.imread(path, index=None)
    except Exception as exc:
        raise InputError(f"--video {path}: cannot read the video ({type(exc).__name__}: {exc})") from None
    clip = np.asarray(clip)
    if clip.ndim == 3:  # one frame, or grey frames
        clip = clip[None] if clip.shape[-1] in (3, 4) else clip[..., None].repeat(3, -1)
    if clip.ndim != 4 or len(clip) < frames:
        raise InputError(f"--video {path}: {len(clip) if clip.ndim == 4 else 1} frames, and this bundle takes {frames}")
    rgb = [np.repeat(f, 3, -1) if f.shape[-1] == 1 else f[..., :3] for f in clip]
    return [rgb[i] for i in sample_indices(len(rgb), frames)], f"{path}: {len(rgb)} frames, sampled to {frames}"


def load_clip(path: str | Path, frames: int, size: int, mean, std) -> tuple[np.ndarray, str]:
    """[F, 3, S, S] float32: the clip's F sampled frames preprocessed as still images are."""
    rgb, described = read_frames(path, frames)
    return np.stack([preprocess(f, size, mean, std) for f in rgb]), described


SQUARE_COLORS = {"yellow": (255, 220, 0), "red": (230, 30, 30), "blue": (30, 60, 230), "green": (30, 200, 60)}


def clip_made_here(frames: int, size: int = 224, cut: int | None = None, square: int | None = None,
                   color: tuple[int, int, int] = SQUARE_COLORS["yellow"], leftward: bool = False) -> np.ndarray:
    """uint8 [F, size, size, 3]: a still photograph with a bright square moving left to right (right to left where
    leftward), and from frame `cut` (default F // 2) another photograph: a still scene, a small moving object, and a
    scene cut."""
    import torch
    import torch.nn.functional as F

    cut = frames // 2 if cut is None else cut
    square = max(4, size // 8) if square is None else square
    scenes = []
    for name, fallback in (("astronaut", 0), ("coffee", 1)):
        image = real_image(name)
        if image is None:  # no scikit-image: a seeded texture stands in
            image = (np.random.default_rng(fallback).random((size, size, 3)) * 255).astype(np.uint8)
        x = torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1)[None].float()
        scenes.append(F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
                      .permute(1, 2, 0).clamp(0, 255).round().byte().numpy())
    out = []
    for i in range(frames):
        frame = scenes[0 if i < cut else 1].copy()
        x = round(i * (size - square) / max(1, frames - 1))
        x = size - square - x if leftward else x
        y = size // 2 - square // 2
        frame[y:y + square, x:x + square] = color
        out.append(frame)
    return np.stack(out)


def seeded_clip(seed: int, frames: int, size: int = 224) -> tuple[np.ndarray, dict]:
    """A clip made here whose square's colour, direction and scene cut a seed draws, and those facts
    ({"color", "direction", "cut"}): clips that differ in what a question about them can ask (eval's video datasets,
    whose answers are then known, not guessed)."""
    rng = np.random.default_rng(seed)
    color = list(SQUARE_COLORS)[int(rng.integers(len(SQUARE_COLORS)))]
    direction = "left" if rng.integers(2) else "right"
    cut = int(rng.integers(1, frames)) if frames > 1 else 1
    clip = clip_made_here(frames, size, cut, color=SQUARE_COLORS[color], leftward=direction == "left")
    return clip, {"color": color, "direction": direction, "cut": cut}


def write_frames(clip: np.ndarray, folder: str | Path) -> Path:
    """The frames of a uint8 clip as PNG files frame_000.png, ... in folder (a `--video` folder)."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(clip):
        Image.fromarray(frame).save(folder / f"frame_{i:03d}.png")
    return folder


class ClipInput:
    """What every family that takes video (compile --video-frames F) does alike, as a mixin before Family.

    A video source records its frames in details["video_frames"] (and its manifest in
    model.token_counts.video_frames); the clip's frames are the graph's batch, one clip per call.
    Written once so that the families differ only in how their towers take the frames
    (Qwen's temporal patches, LLaVA-NeXT-Video's per-frame tower and pooling).
    """

    @staticmethod
    def clip_frames(source) -> int | None:
        """The frames of one clip this source is compiled for, or None for a still-image source."""
        return source.details.get("video_frames")

    def refuse_video_reads(self, source, config) -> None:
        """A video bundle hands its methods the clip's tokens only: refuse a method that reads more."""
        needs = config.method.needs(config.params)
        if source.frames > 1 and (needs.attention or needs.pixels or needs.tower_features or needs.text):
            raise InputError(f"method {config.method.name} with these options reads {needs.describe()}, and a video "
                             "bundle hands its methods the clip's tokens only (evs, dycoke, divprune, dart, random and grid "
                             "--site features)")

    def check_target(self, source, target: str, check_batch) -> None:
        """A clip's frames are the graph's batch: refuse, before the export, a target that cannot run it."""
        frames = self.clip_frames(source)
        if not frames:
            return super().check_target(source, target, check_batch)
        try:
            check_batch(frames)
        except InputError as exc:
            raise InputError(f"target {target} cannot run this video bundle: its input is the {frames} "
                             f"frames of one clip as a batch, and {str(exc).split(': ')[0]}") from None

    def export_batch(self, source, batch: int | None) -> int | None:
        return self.clip_frames(source) or super().export_batch(source, batch)  # video: one clip's frames

    def parity_pixels(self, source, images: int):
        """Video: the clip made here (a still photograph, a moving square, a scene cut), preprocessed frame by frame."""
        frames = self.clip_frames(source)
        if not frames:
            return super().parity_pixels(source, images)
        clip = clip_made_here(frames, source.image_size)
        pixels = np.stack([preprocess(f, source.image_size, source.mean, source.std) for f in clip])
        return pixels, {"images": [f"clip made here: {frames} frames (astronaut, a moving square, a cut to coffee)"],
                        "seed": 0, "size": source.image_size, "mean": list(source.mean), "std": list(source.std)}

    def takes_video(self, manifest: Manifest) -> bool:
        return bool(manifest.model.video_frames)

    def load_video(self, manifest: Manifest, path):
        if not self.takes_video(manifest):
            return super().load_video(manifest, path)
        pre, frames = manifest.preprocess, manifest.model.video_frames
        pixel, described = load_clip(path, frames, pre.size, pre.mean, pre.std)
        return pixel, [described]

    def load_images(self, manifest: Manifest, image_files, static):
        if self.takes_video(manifest):
            frames = manifest.model.video_frames
            raise InputError(f"this bundle takes one clip of {frames} frames: pass --video PATH (a folder of frames "
                             "or a video file)")
        return super().load_images(manifest, image_files, static)

    @staticmethod
    def check_frames(given: dict) -> None:
        frames = given.get("video_frames")
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
            raise InputError(f"--video-frames must be an integer >= 1, got {frames!r}")
