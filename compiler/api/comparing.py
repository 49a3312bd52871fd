"""`vlmprune compare` as a call: what each bundle keeps of the same image, drawn side by side into one PNG."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from vlmprune.compiler import pictures
from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.api.running import load_images, run_text, static_batch
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.bundle.output_files import check_output_file, write_file
from vlmprune.compiler.contract import KEPT, TEXT
from vlmprune.compiler.errors import InputError, VlmpruneError, option
from vlmprune.compiler.frontend import family_of
from vlmprune.compiler.frontend.images import require_image_files
from vlmprune.targets import get_target


@dataclasses.dataclass
class CompareResult:
    """The picture `vlmprune compare` wrote, and how many bundles it shows."""

    output: Path
    pictures: int  # one per bundle


def compare(bundles: Iterable[str | Path], *, image: str | Path, output: str | Path, columns: int | None = None,
            force: bool = False, progress: Progress = None) -> CompareResult:
    """Draw what each bundle keeps on the same image, side by side, into the PNG output (`vlmprune compare`).

    Returns a CompareResult; raises InputError for a dense bundle, a bundle that cannot be drawn, or bad options.
    """
    say = reporter(progress)
    bundles = [Path(b) for b in bundles]
    image, = require_image_files([image], option("--image", "image"))
    pictures.require_pillow()
    check_output_file(output, force, (".png",), option("-o", "output"))
    if columns is not None and (columns < 1):
        raise InputError(f"{option('--columns')} must be >= 1, got {columns}")
    manifests = [Manifest.load(b, verify=True) for b in bundles]  # every bundle checked before any run
    for b, m in zip(bundles, manifests):
        if not m.method.pruned:
            raise InputError(f"{b}: a dense bundle (--no-prune) keeps every patch; nothing to compare")
        if family_of(m).cannot_draw(m):
            raise InputError(f"{b}: {family_of(m).cannot_draw(m)} cannot be drawn yet")
    tiles, said = [], set()

    def once(line: str) -> None:  # the same image preprocessed the same way for several bundles: said once
        if line not in said:
            said.add(line)
            say(line)

    for b, m in zip(bundles, manifests):
        with _naming(b):  # several bundles: a refusal says which one
            pixel = load_images(m, [image], once)
            static = static_batch(m)
            if isinstance(static, int) and static > 1:  # a static batch: the same image in every slot
                pixel = np.repeat(pixel, static, axis=0)
            runner, runtime = get_target(m.target.name).runner(b, m)
            say(f"{b}: {runtime}")
            text = run_text(m, None, None, say)  # a prompt-aware bundle: no prompt (compiler.prompt)
            kept = runner(pixel, {} if text is None else {TEXT: text})[KEPT][:1]
            sels, note = pictures.selections_for_run(m, pixel[:1], kept, b.resolve().name)
        if note:
            say(f"warning: {b}: {note}")
        tiles.append(pictures.picture(sels[0]))
    write_file(output, pictures.png_bytes(pictures.grid_of(tiles, columns)), force)
    return CompareResult(Path(output), len(tiles))


@contextlib.contextmanager
def _naming(bundle: Path):
    """A VlmpruneError raised inside, prefixed with the bundle it concerns (unless it names it already)."""
    try:
        yield
    except VlmpruneError as exc:
        text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        if text.startswith(str(bundle)):
            raise
        raise type(exc)(f"{bundle}: {text}") from exc
