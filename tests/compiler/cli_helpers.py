"""What the CLI tests share: invoking `vlmprune` in-process, the one-line-error promise, eval's inputs.

The promise (README): bad input is exactly one `error:` line, exit code 2, no traceback.
"""

from __future__ import annotations

from click.testing import CliRunner

from vlmprune.compiler.cli import main


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, needle: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output


def eval_inputs(root, images: dict, prompts: list[str]):
    """(images folder, prompts file) under root for `generate`/`eval`: name -> HxWx3 uint8 array, one prompt a line."""
    from PIL import Image

    folder = root / "images"
    folder.mkdir()
    for name, array in images.items():
        Image.fromarray(array).save(folder / name)
    path = root / "prompts.txt"
    path.write_text("".join(f"{line}\n" for line in prompts))
    return folder, path

