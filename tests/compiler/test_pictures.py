"""`run --show` and `compare`: the pictures are read back by their pixels, patch by patch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmprune.compiler import pictures
from vlmprune.compiler.frontend.images import load_image_file
from cli_helpers import one_line_error as _one_line_error, run_cli as _run


@pytest.fixture(scope="module")
def bundles(tiny_llava_dir, compiled):
    """The tiny LLaVA (64 patches) compiled twice: visionzip (12 dominant + 4 contextual) and cls, K = 16.

    The same two bundles as test_report's and test_benchmark's: `compiled` makes each once a session."""
    vz = compiled(tiny_llava_dir, method="visionzip", keep=16, method_options={"contextual": 4})
    cls = compiled(tiny_llava_dir, keep=16)
    return vz.bundle, cls.bundle


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    from skimage import data

    path = tmp_path_factory.mktemp("photo") / "coffee.png"
    Image.fromarray(data.coffee()).save(path)
    return path


def _cells(picture: np.ndarray, grid: int):
    cell_px = picture.shape[1] // grid
    for i in range(grid * grid):
        t, l, b, r = pictures.cell(i, grid, cell_px)
        yield i, (t, l, b, r), cell_px


def _interior(a: np.ndarray, box, margin: int) -> np.ndarray:
    t, l, b, r = box
    return a[t + margin: b - margin, l + margin: r - margin].astype(np.float64)


def test_draw_dims_outlines_tints_and_hatches_by_pixel():
    rng = np.random.default_rng(0)
    image = rng.integers(40, 220, size=(112, 112, 3)).astype(np.uint8)  # 8 x 8 patches of 14 px, shown x3
    kept, merges, forced = np.array([0, 9, 63]), {9: np.array([10, 17])}, np.zeros(64, bool)
    forced[0] = True
    out = pictures.draw(pictures.Selection(image, 8, kept, merges, forced))
    big = np.repeat(np.repeat(image, 3, 0), 3, 1).astype(np.float64)
    assert out.shape == (336, 336, 3)
    w = pictures.outline_width(42)
    for i, box, _ in _cells(out, 8):
        got, want = _interior(out, box, 2 * w), _interior(big, box, 2 * w)
        if i == 63:  # kept: untouched inside, yellow outline
            assert np.array_equal(got, want)
            assert tuple(out[box[0], box[1] + 20]) == pictures.KEPT_RGB
        elif i == 9:  # a merge target: untouched inside, its own colour as outline
            assert np.array_equal(got, want)
            assert tuple(out[box[0], box[1] + 20]) == pictures.MERGE_RGB[0]
        elif i in (10, 17):  # merged into 9: dimmed less, tinted in 9's colour
            tint = (1 - pictures.TINT) * pictures.MERGED_DIM * want + pictures.TINT * np.array(pictures.MERGE_RGB[0])
            assert np.abs(got - tint).max() <= 0.51
        elif i == 0:  # kept and forced: hatched pixels are white, the others untouched
            hatched = (got == 255).all(axis=-1)
            assert 0.1 < hatched.mean() < 0.6 and np.array_equal(got[~hatched], want[~hatched])
        else:  # pruned
            assert np.abs(got - pictures.DIM * want).max() <= 0.51


def test_run_show_draws_the_bundle_kept_set_and_the_merges(bundles, photo, tmp_path):
    vz, _ = bundles
    show = tmp_path / "kept.png"
    result = _run("run", vz, "--image", photo, "--show", show, "--json")
    assert result.exit_code == 0, result.output
    kept = json.loads(result.stdout)["kept_indices"][0]
    assert len(kept) == 16 and json.loads(result.stdout)["show"] == str(show)
    picture = np.asarray(Image.open(show).convert("RGB"))
    from vlmprune.compiler.bundle import load_manifest

    m = load_manifest(vz)
    pre = m["preprocess"]
    pixel, _, _ = load_image_file(str(photo), pre["size"], pre["mean"], pre["std"])
    seen = np.repeat(np.repeat(pictures.model_view(pixel[0], pre["mean"], pre["std"]), 3, 0), 3, 1).astype(np.float64)
    assert picture.shape[1] == 336 and picture.shape[0] > 336  # the picture, then its caption strip
    targets, colours = set(kept[12:]), set()
    for i, box, cell_px in _cells(picture[:336], 8):
        margin = 2 * 2 * pictures.outline_width(cell_px)
        got, want = _interior(picture, box, margin), _interior(seen, box, margin)
        edge = tuple(picture[box[0], box[1] + cell_px // 2])
        if i in targets:
            assert np.array_equal(got, want) and edge in pictures.MERGE_RGB
            colours.add(edge)
        elif i in kept:
            assert np.array_equal(got, want) and edge == pictures.KEPT_RGB
        else:  # visionzip merges every other patch into a target: tinted in one of the targets' colours
            colour = (got - (1 - pictures.TINT) * pictures.MERGED_DIM * want) / pictures.TINT
            dist = [np.abs(colour - np.array(c)).max() for c in colours | set(pictures.MERGE_RGB)]
            assert min(dist) <= 2.0 / pictures.TINT, i
    assert len(colours) == 4  # one colour per contextual token


def test_show_refuses_an_existing_file_without_force(bundles, photo, tmp_path):
    vz, _ = bundles
    show = tmp_path / "kept.png"
    show.write_bytes(b"keep me")
    _one_line_error(_run("run", vz, "--image", photo, "--show", show), "already exists (use --force")
    assert show.read_bytes() == b"keep me"
    _one_line_error(_run("run", vz, "--image", photo, "--show", tmp_path / "kept.jpg"), "must end in .png")
    assert _run("run", vz, "--image", photo, "--show", show, "--force").exit_code == 0
    assert Image.open(show).size[0] == 336
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_compare_puts_each_bundle_picture_side_by_side(bundles, photo, tmp_path):
    vz, cls = bundles
    grid = tmp_path / "grid.png"
    result = _run("compare", vz, cls, "--image", photo, "-o", grid)
    assert result.exit_code == 0, result.output
    for bundle, name in ((vz, "a.png"), (cls, "b.png")):
        assert _run("run", bundle, "--image", photo, "--show", tmp_path / name).exit_code == 0
    a, b = (np.asarray(Image.open(tmp_path / n).convert("RGB")) for n in ("a.png", "b.png"))
    g = np.asarray(Image.open(grid).convert("RGB"))
    gap = 8
    assert np.array_equal(g[gap: gap + a.shape[0], gap: gap + a.shape[1]], a)  # each tile is that bundle's picture
    left = gap + max(a.shape[1], b.shape[1]) + gap
    assert np.array_equal(g[gap: gap + b.shape[0], left: left + b.shape[1]], b)
    assert not np.array_equal(a[:336], b[:336])  # two methods, two selections


def test_images_are_read_after_the_core_install(bundles, photo):
    """Pillow is a core dependency (README's first command), so `run --image` needs no extra."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"pillow\s*>=\s*10", d, re.I) for d in project["dependencies"]), project["dependencies"]
    _, cls = bundles
    result = _run("run", cls, "--image", photo)
    assert result.exit_code == 0, result.output
    assert f"{photo}: 600x400 image: short side downscaled" in result.stderr


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    from vlmprune.compiler.frontend.images import load_image_crops

    ramp = np.round(np.linspace(0, 65535, 112)).astype(np.uint16)
    Image.fromarray(np.tile(ramp, (112, 1))).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    eight = np.round(ramp / 257).astype(np.uint8)  # the same gradient in 8 bits (65535 / 255 = 257)
    Image.fromarray(np.stack([np.tile(eight, (112, 1))] * 3, -1)).save(tmp_path / "g8.png")
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    p16, described, _ = load_image_file(str(tmp_path / "g16.png"), 112, mean, std)
    p8, _, _ = load_image_file(str(tmp_path / "g8.png"), 112, mean, std)
    assert p16.max() - p16.min() > 1.9 and abs(p16.mean()) < 0.05  # black to white, not clipped to white
    assert np.abs(p16 - p8).max() <= (1 / 255) / 0.5 + 1e-6  # within one 8-bit level
    assert described.startswith("112x112 image (16-bit grayscale, scaled to 8 bits): short side kept at")
    crops = {"grid": [1, 1], "count": 2, "resolution": [112, 112]}
    c16, described = load_image_crops(str(tmp_path / "g16.png"), crops, 112, mean, std)
    c8, _ = load_image_crops(str(tmp_path / "g8.png"), crops, 112, mean, std)
    assert c16.max() - c16.min() > 1.9 and np.abs(c16 - c8).max() <= (1 / 255) / 0.5 + 1e-5
    assert described.startswith("112x112 image (16-bit grayscale, scaled to 8 bits): LlavaNextImageProcessor")


def test_compare_says_the_preprocessing_once_and_names_the_bundle_that_fails(bundles, photo, tmp_path, compiled,
                                                                             tiny_llava_dir):
    vz, cls = bundles
    result = _run("compare", vz, cls, "--image", photo, "-o", tmp_path / "two.png")
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith(f"{photo}: ")]
    assert len(said) == 1, result.stderr  # the same image, preprocessed alike for both bundles: one line
    # A bundle whose runtime is not here (an engine built on the device) fails: the line says which bundle.
    engine = compiled(tiny_llava_dir, keep=16, target="orin").bundle
    failed = _run("compare", cls, engine, "--image", photo, "-o", tmp_path / "three.png")
    _one_line_error(failed, f"{engine}")
    assert not (tmp_path / "three.png").exists()


def test_compare_of_one_bundle_says_one_picture(bundles, photo, tmp_path):
    _, cls = bundles
    result = _run("compare", cls, "--image", photo, "-o", tmp_path / "one.png")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"1 picture written to {tmp_path / 'one.png'}"]


def test_a_bundle_without_a_patch_size_is_drawn_from_its_patch_count():
    """Bundles compiled before .onnx sources recorded their patch size: the grid is the patch count's side."""
    from vlmprune.compiler.errors import InputError
    from vlmprune.compiler.bundle.manifest import Manifest

    manifest = Manifest({"model": {"patch_size": None}, "preprocess": {"size": 112}, "method": {"num_patches": 64}})
    assert pictures.token_grid(manifest) == 8
    manifest["method"]["num_patches"] = 60
    with pytest.raises(InputError, match="^this bundle records neither a patch size nor a square patch count"):
        pictures.token_grid(manifest)


def test_a_camera_photo_is_read_upright_by_its_exif_orientation(tmp_path):
    """A portrait photo stored sideways (landscape pixels, EXIF orientation 6) is fed upright, as viewers show it."""
    from vlmprune.compiler.frontend.images import read_rgb

    upright = np.zeros((120, 80, 3), np.uint8)
    upright[:20] = (255, 0, 0)  # red at the top of the picture
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # as a camera held upright stores it
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to show"
    stored.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    rgb, note = read_rgb(str(tmp_path / "portrait.jpg"))
    assert rgb.shape == (120, 80, 3) and rgb[:15, :, 0].mean() > 200 and rgb[30:, :, 0].mean() < 30
    assert note == " (EXIF orientation 6 applied: rotated 90° clockwise)"
    _, described, _ = load_image_file(str(tmp_path / "portrait.jpg"), 56, (0.5,) * 3, (0.5,) * 3)
    assert described.startswith("80x120 image (EXIF orientation 6 applied: rotated 90° clockwise): short side")


def test_transparency_is_composited_on_white_and_said(tmp_path):
    from vlmprune.compiler.frontend.images import read_rgb

    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[..., 2] = 255  # blue where transparent: what dropping alpha would show
    rgba[:8, ..., 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "logo.png")
    rgb, note = read_rgb(str(tmp_path / "logo.png"))
    assert rgb[:8].tolist() == [[[0, 0, 255]] * 16] * 8 and rgb[8:].tolist() == [[[255, 255, 255]] * 16] * 8
    assert note == " (transparency composited on white (255, 255, 255))"
    rgba[..., 3] = 255  # opaque: nothing to say
    Image.fromarray(rgba, "RGBA").save(tmp_path / "opaque.png")
    assert read_rgb(str(tmp_path / "opaque.png"))[1] == ""


def test_docs_pictures_commands_write_where_a_checkout_has_no_file():
    """docs/pictures.md's `run --show docs/images/cls-k64.png` refused in a checkout: the committed picture is there."""
    root = Path(__file__).parents[2]
    text = (root / "docs" / "pictures.md").read_text()
    written = re.findall(r"(?:--show|compare .* -o) (\S+\.png)", text)
    assert len(written) >= 2, written
    for path in written:
        for m in ("cls", "visionzip", "divprune", "dart"):
            resolved = root / path.replace("$m", m)
            assert not resolved.exists(), f"docs/pictures.md writes {path}, which a checkout holds already"
