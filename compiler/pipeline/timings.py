"""Where a compile's time and memory go: one span per progress step, printed by `compile --timings`.

Why spans of the progress steps: the steps already name every stage a user waits on (load,
export or its cache hit, each pass pipeline, fusion, emit, the PyTorch reference, session
creation and each parity stage), so the table needs no second set of probes that could drift
from what the progress lines say. A span runs from its step to the next; its peak RSS is
the process's high-water mark at the span's end (ru_maxrss only grows, so the span that first
reaches the compile's peak is the one that set it), and the children's (the rknn-toolkit2
worker, the QNN tools, g++) is read the same way.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmprune.compiler.parity import StageResult

Progress = Callable[["str | StageResult"], None]  # a line, or a parity stage's record (pipeline.run_parity)


def _peak_mb(who: int) -> float:
    """ru_maxrss in MB (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(who).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


@dataclasses.dataclass
class Span:
    label: str
    seconds: float
    peak_rss_mb: float  # this process, at the span's end
    children_peak_rss_mb: float  # its largest finished child process, at the span's end

    def to_json(self) -> dict:
        return {"stage": self.label, "seconds": round(self.seconds, 3), "peak_rss_mb": round(self.peak_rss_mb, 1),
                "children_peak_rss_mb": round(self.children_peak_rss_mb, 1)}


class StageTimer:
    """The progress sink of one compile: prints `[   t s] step` as before and closes a Span per step."""

    def __init__(self, progress: Progress, clock: Callable[[], float] = time.perf_counter):
        self.progress, self.clock = progress, clock
        self.start = clock()
        self.spans: list[Span] = []
        self._open: tuple[str, float] | None = None

    def step(self, message: str | StageResult) -> None:
        """A new stage begins: its line, timed; an indented line, or a record (a parity stage's StageResult), is the
        result of the stage before, handed on as it is and timed with that stage."""
        if not isinstance(message, str) or message.startswith("  "):
            self.progress(message)
            return
        now = self.clock()
        self._close(now)
        self._open = (message, now)
        self.progress(f"[{now - self.start:6.1f}s] {message}")

    def finish(self) -> list[Span]:
        """Close the last span; the spans, in order."""
        self._close(self.clock())
        return self.spans

    def _close(self, now: float) -> None:
        if self._open is not None:
            label, began = self._open
            self.spans.append(Span(label, now - began, _peak_mb(resource.RUSAGE_SELF),
                                   _peak_mb(resource.RUSAGE_CHILDREN)))
            self._open = None


def table(spans: list[Span], width: int = 64) -> list[str]:
    """The --timings table: each span's seconds, its share of the total and the peak RSS at its end, then the
    total; labels cut to `width` characters (a pass pipeline's step names every pass)."""
    total = sum(s.seconds for s in spans) or 1e-9
    lines = [f"{'stage':<{width}} {'seconds':>8} {'share':>6} {'peak RSS MB':>11} {'children MB':>11}"]
    for s in spans:
        label = s.label if len(s.label) <= width else s.label[:width - 1] + "…"
        lines.append(f"{label:<{width}} {s.seconds:8.1f} {s.seconds / total:6.1%} {s.peak_rss_mb:11.0f} "
                     f"{s.children_peak_rss_mb:11.0f}")
    peak = max((s.peak_rss_mb for s in spans), default=0.0)
    lines.append(f"{'total':<{width}} {total:8.1f} {1:6.1%} {peak:11.0f}")
    return lines
