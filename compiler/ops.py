"""The op listing of a bundle's graph (`vlmprune inspect --ops`, `--json`), with placement where reported.

One row per node of model.onnx, in graph order: its name, op type and domain, the role
vlmprune gave it when it inserted the method (score / select / tokens; empty for the
model's own nodes), and where the target's toolchain reports placement (rk3588's NPU/CPU
table, keyed by the ONNX node each op came from) the device(s) its ops run on.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.contract import MODEL, ROLE, Manifest


def op_rows(bundle_dir: Path, manifest: Manifest, graph: str = MODEL) -> list[dict]:
    import onnx

    model = onnx.load(str(Path(bundle_dir) / graph), load_external_data=False)
    devices: dict[str, set] = {}
    placement = manifest.target.get("placement", {})
    for artifact, rows in placement.items():
        for r in rows:
            if r.get("source"):
                devices.setdefault(r["source"], set()).add(f"{r['device']}" + (f" ({artifact})" if len(
                    placement) > 1 else ""))
    out = []
    for node in model.graph.node:
        role = next((p.value for p in node.metadata_props if p.key == ROLE), "")
        row = {"name": node.name, "op": node.op_type, "domain": node.domain or "ai.onnx", "role": role}
        if node.name in devices:
            row["placement"] = sorted(devices[node.name])
        out.append(row)
    return out


def op_lines(rows: list[dict], placed: bool) -> list[str]:
    lines = [(f"  {'node':<48} {'op':<20} {'domain':<10} {'role':<7}" + (" placement" if placed else "")).rstrip()]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 48 else "…" + r["name"][-47:]
        line = f"  {name:<48} {r['op'][:20]:<20} {r['domain'][:10]:<10} {r['role']:<7}"
        if placed:
            line += " " + (", ".join(r.get("placement", [])) or "-")
        lines.append(line.rstrip())
    return lines
