"""vlmprune.compiler: frontend, reference pruner, parity, bundles and the CLI."""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"


def _unshadow_checkout() -> None:
    """Drop a source checkout's root from sys.path.

    The checkout's folders are the vlmprune.* subpackages (the installed finder maps them), so
    nothing imports them from the root. But `python -m ...` or `python -c ...` started in the
    root puts it first on sys.path, and there its `kernels/` folder shadows the PyPI `kernels`
    package that transformers (>= 5.25) imports at load time ("cannot import name
    'CUDAProperties' from 'kernels'"). In an installed wheel the parent of this folder is never a
    sys.path root, so this does nothing.
    """
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return
    keep = []
    for entry in sys.path:
        try:
            same = Path(entry or os.getcwd()).resolve() == root
        except OSError:
            same = False
        if not same:
            keep.append(entry)
    sys.path[:] = keep


_unshadow_checkout()
