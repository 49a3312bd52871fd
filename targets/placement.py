"""Op placement tables: which processor runs each op of a target artifact.

One row per op the toolchain reports: {"op", "type", "device", "dtype"?, "source"?}
("device" is the accelerator's name, NPU / HTP, or CPU; "source" the ONNX node an op came
from when the toolchain says so). The manifest keeps the rows per artifact under
target.placement and a summary under target.placement_summary; `vlmprune compile` prints
the summary and `vlmprune inspect` the rows.
"""

from __future__ import annotations

from collections import Counter

CPU = "CPU"


def summarize(rows: list[dict]) -> dict:
    """Ops per device, and the op types that run on the CPU (each one a round trip off the accelerator)."""
    devices = Counter(r["device"] for r in rows)
    cpu_types = Counter(r["type"] for r in rows if r["device"] == CPU)
    return {"ops": len(rows), "devices": dict(sorted(devices.items())), "cpu_ops": dict(sorted(cpu_types.items()))}


def summary_line(name: str, summary: dict) -> str:
    devices = ", ".join(f"{n} on {d}" for d, n in summary["devices"].items())
    cpu = ", ".join(f"{t}×{n}" if n > 1 else t for t, n in summary["cpu_ops"].items()) or "none"
    return f"placement {name}: {summary['ops']} ops: {devices}; CPU ops: {cpu}"


def table(rows: list[dict]) -> list[str]:
    """Rows as aligned text lines: source node, op type, device, dtype, and the emulated cycles where known."""
    cycles = any("cycles" in r for r in rows)
    lines = [(f"  {'node':<44} {'op':<18} {'device':<7} {'dtype':<8}" + (f" {'cycles':>10}" if cycles else "")).rstrip()]
    for r in rows:
        node = r.get("source") or r["op"]
        node = node if len(node) <= 44 else "…" + node[-43:]
        line = f"  {node:<44} {r['type'][:18]:<18} {r['device']:<7} {r.get('dtype') or '':<8}"
        lines.append((line + (f" {r['cycles']:>10}" if "cycles" in r else "")).rstrip())
    return lines
