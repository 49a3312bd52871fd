"""The target adapter contract.

A target says which passes legalize a graph for it (an explicit list, in order),
which nodes it can run, how it writes its artifacts into a bundle, and how a
bundle's artifact is run for parity. Vendor SDKs are imported inside methods only,
so one missing SDK never breaks the CLI or the other targets.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

Runner = Callable[[np.ndarray], dict[str, np.ndarray]]


@dataclasses.dataclass
class StageSpec:
    """One parity stage a target contributes: how to run a bundle file, at what precision."""

    stage: str
    runtime: str
    precision: str
    run: Runner


class Target(abc.ABC):
    name: str
    summary: str

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """Whether this machine can emit and check this target, and why not. Installs nothing."""

    @abc.abstractmethod
    def toolchain(self) -> dict[str, str]:
        """Versions recorded in the manifest (the device toolchain and the host tools used)."""

    @abc.abstractmethod
    def pipeline(self, config) -> list[ir.passes.PassBase]:
        """The passes from the dense export to this target's decomposed graph, in order."""

    def check_options(self, options) -> None:
        """Refuse, in one line and before any work, options this target does not take or values it cannot use.

        The default takes neither --precision nor --soc; targets that do override this.
        """
        from vlmprune.compiler.errors import InputError

        if getattr(options, "precision", None) is not None:
            raise InputError(f"target {self.name} has no --precision (it runs fp32)")
        if getattr(options, "soc", None) is not None:
            raise InputError(f"--soc is a qnn option; target {self.name} has no SoC to choose")

    def supports(self, node: ir.Node) -> tuple[bool, str]:
        """Whether the target runtime can run node; standard ONNX by default."""
        if node.domain in ("", "ai.onnx"):
            return True, ""
        return False, f"custom domain {node.domain!r}"

    @abc.abstractmethod
    def emit(self, decomposed: ir.Model, out_dir: Path, context: dict) -> dict:
        """Write model.onnx and the target's extras into out_dir; return manifest fields."""

    @abc.abstractmethod
    def stages(self, bundle_dir: Path, manifest: dict) -> list[StageSpec]:
        """Parity stages over the bundle's own files (after the shared export/rewritten stages)."""

    @abc.abstractmethod
    def readme(self, manifest: dict) -> str:
        """The bundle README: exact commands to build and run it on the device."""
