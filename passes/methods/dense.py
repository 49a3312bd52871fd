"""The method of a dense bundle (--no-prune): it prunes nothing.

A compile without pruning records this method instead of leaving the method out, so a reader
asks it (`prunes`, `summary`) like any other method instead of testing for a sentinel name.
It is no entry of METHODS: `--method` never chooses it, `--no-prune` does.
"""

from __future__ import annotations

from typing import ClassVar

from vlmprune.compiler.contract import DENSE_METHOD


class Dense:
    name: ClassVar[str] = DENSE_METHOD  # the manifest's method name of a dense bundle (the contract's)
    summary: ClassVar[str] = "dense (no pruning)"
    prunes: ClassVar[bool] = False

    def record(self) -> dict:
        """The manifest's method section of a dense bundle."""
        return {"name": self.name, "summary": self.summary}
