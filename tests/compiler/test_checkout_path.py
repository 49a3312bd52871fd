"""A checkout's root is safe to start Python in: its kernels/ folder (no __init__.py, the vlmprune.kernels namespace
package) never shadows the PyPI `kernels` package that transformers imports, whatever is imported first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _in_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_transformers_imports_in_the_checkout_root_before_vlmprune():
    done = _in_root("from transformers import CLIPVisionModel; print(CLIPVisionModel.__name__)")
    assert done.returncode == 0 and done.stdout.strip() == "CLIPVisionModel", done.stderr[-2000:]


def test_the_root_kernels_folder_is_no_regular_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    done = _in_root("import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)")
    assert done.returncode == 0 and not done.stdout.strip().startswith(str(ROOT)), done.stdout


def test_the_package_still_imports_its_own_kernels():
    done = _in_root("import vlmprune.kernels.build as b; print(b.__file__)")
    assert done.returncode == 0 and done.stdout.strip() == str(ROOT / "kernels" / "build.py"), done.stderr[-2000:]
