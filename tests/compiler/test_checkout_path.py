"""vlmprune.compiler's import drops a source checkout's root from sys.path, so the checkout's kernels/ folder
never shadows the PyPI `kernels` package that transformers imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _spec_in_checkout(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_python_c_in_the_checkout_root_does_not_see_kernels_as_top_level():
    # `python -c` in the root puts the root first on sys.path; before the import it shadows `kernels`.
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    assert _spec_in_checkout(probe) == str(ROOT / "kernels" / "__init__.py")
    after = _spec_in_checkout("import vlmprune.compiler\n" + probe)
    assert after != str(ROOT / "kernels" / "__init__.py")  # None, or the PyPI package where it is installed


def test_the_package_still_imports_its_own_kernels():
    out = _spec_in_checkout("import vlmprune.compiler, vlmprune.kernels.build as b; print(b.__file__)")
    assert out == str(ROOT / "kernels" / "build.py")
