"""`vlmprune inspect` as a call: a bundle's manifest after checking every file's sha256, and model.onnx's ops."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vlmprune.compiler.bundle.manifest import Manifest


@dataclasses.dataclass
class InspectResult:
    """A verified bundle as `vlmprune inspect` shows it: the manifest, its placement tables, model.onnx's ops."""

    bundle: Path
    manifest: Manifest
    ops: list[dict] | None = None  # model.onnx's ops (name, op type, role, placement), where asked for

    @property
    def placement(self) -> dict[str, list[dict]]:
        """Per graph, where the target placed each op (targets that report it: qnn, rk3588)."""
        return self.manifest.target.get("placement", {})

    def to_json(self) -> dict:
        """`vlmprune inspect --json`: the verified manifest and the op listing."""
        return {"bundle": str(self.bundle), "manifest": self.manifest, "ops": self.ops}


def inspect(bundle: str | Path, *, ops: bool = True) -> InspectResult:
    """BUNDLE's manifest after checking every file's sha256, with model.onnx's ops where ops (`vlmprune inspect`).

    Raises InputError for a missing, foreign or modified bundle.
    """
    from vlmprune.compiler.ops import op_rows

    m = Manifest.load(bundle, verify=True)
    return InspectResult(Path(bundle), m, op_rows(bundle, m) if ops else None)
