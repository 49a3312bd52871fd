"""Report on the rknn toolchain: venv install time and size, and op placement of the probe graph.

    python tools/rknn_env_report.py                 # venv record + placement table (fp16, hybrid)
    python tools/rknn_env_report.py --matrix        # every selection/mask/sort formulation on
                                                    # RKNN (fp16, hybrid, int8) and QNN HTP (QDQ)
    python tools/rknn_env_report.py --selection     # Gather vs one-hot MatMul on the demo tower: rk3588
                                                    # (fp16, hybrid) and qnn, placement and parity
    python tools/rknn_env_report.py --json out.json # the same figures as data

Creates the rknn venv if it is missing (VLMPRUNE_CACHE chooses where). The probe graph is
tools/probe_graph.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from vlmprune.compiler.contract import FEATURES
from vlmprune.targets import qnn_tools, rknn_env

CALIB_SEEDS = range(100, 116)


def load_probe_lib():
    import probe_graph  # tools/, beside this script

    return probe_graph


def venv_report() -> dict:
    rknn_env.rknn_python()
    info = rknn_env.venv_info()
    print(f"rknn-toolkit2 {info.get('rknn_toolkit2')} venv: {rknn_env.venv_dir()}")
    print(f"  install {info.get('install_seconds')} s (fresh), size {info.get('size_bytes', 0) / 2**20:.0f} MiB "
          f"(torch {info.get('torch')})")
    return info


def rknn_case(lib, root: Path, name: str, model: onnx.ModelProto, mode: str, seeds) -> dict:
    src = root / f"{name}.onnx"
    onnx.save(model, src)
    dataset = []
    for seed in CALIB_SEEDS:
        np.save(root / f"calib{seed}.npy", lib.probe_input(seed))
        dataset.append([str(root / f"calib{seed}.npy")])
    results = []
    for seed, salient in seeds:
        x = lib.probe_input(seed, salient=salient)
        np.save(root / "x.npy", x)
        response = rknn_env.run_worker({"onnx": str(src), "out_dir": str(root / f"{name}_{mode}"), "mode": mode,
                                        "dataset": dataset, "run_inputs": [str(root / "x.npy")]})
        tokens, idx = (np.load(o["path"]) for o in response["outputs"])
        results.append(_metrics(lib, model, x, tokens, idx, seed, salient))
    return {"placement": response["placement"], "runs": results}


def qnn_case(lib, root: Path, name: str, model: onnx.ModelProto, seeds) -> dict:
    src = root / f"{name}.onnx"
    onnx.save(model, src)
    qdq = qnn_tools.quantize_qdq(src, root / f"{name}.qdq.onnx", [{"x": lib.probe_input(s)} for s in CALIB_SEEDS])
    rows = qnn_tools.placement(qdq)
    results = []
    for seed, salient in seeds:
        x = lib.probe_input(seed, salient=salient)
        try:
            out = qnn_tools.run_qnn(qdq, {"x": x})
        except qnn_tools.QnnError:
            out = _run_with_fallback(qdq, x)
        results.append(_metrics(lib, model, x, out["tokens"], out["kept_idx"], seed, salient))
    return {"placement": rows, "runs": results}


def _run_with_fallback(path, x):
    session = qnn_tools.htp_session(path, cpu_fallback=True)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))


def _metrics(lib, model, x, tokens, idx, seed, salient) -> dict:
    ref = lib.reference_run(model, x)
    cos = lib.token_cosines(ref, tokens, idx)
    return {"seed": seed, "salient": salient, "agreement": lib.kept_agreement(ref["kept_idx"], idx),
            "near_ties": lib.near_ties(ref["score"], lib.K), "cos_min_tokens": float(cos[:-1].min()),
            "cos_summary": float(cos[-1])}


def print_placement(title: str, rows: list[dict], device_key: str) -> None:
    print(f"\n{title}")
    print(f"  {'node':28s} {'type':16s} {'device':24s} dtype")
    for r in rows:
        print(f"  {(r.get('source') or r['op'])[:28]:28s} {r['type'][:16]:16s} {r[device_key]:24s} {r.get('dtype', '')}")


def cpu_ops(rows: list[dict], device_key: str) -> str:
    cpu = sorted({r["type"] for r in rows if r[device_key] in ("CPU", "CPUExecutionProvider")})
    return " ".join(cpu) or "-"


def summary_line(label: str, case: dict, device_key: str) -> str:
    runs = " ".join(f"{r['agreement']:.3f}" for r in case["runs"])
    cos = min(r["cos_min_tokens"] for r in case["runs"])
    return f"  {label:44s} agreement [{runs}]  cos(tokens) {cos:.4f}  CPU: {cpu_ops(case['placement'], device_key)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", action="store_true", help="all formulations on both toolchains")
    parser.add_argument("--selection", action="store_true", help="Gather vs one-hot on the demo tower")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    lib = load_probe_lib()
    report = {"venv": venv_report()}
    if args.selection:
        report["selection"] = selection_report()
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        return 0
    seeds = [(1, 2.0), (2, 2.0), (3, 0.0), (4, 0.0)]  # two with a score margin, two plain noise
    with tempfile.TemporaryDirectory(prefix="vlmprune-rknn-report-") as tmp:
        root = Path(tmp)
        model = lib.build_probe_model()
        for mode in ("fp16", "hybrid"):
            case = rknn_case(lib, root, "probe", model, mode, seeds)
            print_placement(f"RKNN rk3588 {mode}: placement of the probe graph (gather / scatter_elements / int sort)",
                            case["placement"], "device")
            print(summary_line(f"{mode}", case, "device"))
            report[f"rknn_{mode}"] = case
        if args.matrix:
            report["matrix"] = run_matrix(lib, root, [seeds[0], seeds[2]])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


def run_matrix(lib, root: Path, seeds) -> dict:
    qnn_ok, qnn_reason = qnn_tools.available()
    matrix = {}
    print("\nFormulation matrix: agreement per input [salient seed 1, noise seed 3]")
    for select in lib.SELECTIONS:
        for mask in lib.MASKS:
            if mask == "onehot_sum" and not select.startswith("onehot"):
                continue
            for sort in lib.SORTS:
                name = f"{select}-{mask}-{sort}"
                model = lib.build_probe_model(select=select, mask=mask, sort=sort)
                for mode in ("fp16", "hybrid", "int8"):
                    case = rknn_case(lib, root, name, model, mode, seeds)
                    matrix[f"rknn {mode} {name}"] = case
                    print(summary_line(f"rknn {mode:6s} {name}", case, "device"), flush=True)
                if qnn_ok:
                    case = qnn_case(lib, root, name, model, seeds)
                    matrix[f"qnn qdq16 {name}"] = case
                    print(summary_line(f"qnn qdq16 {name}", case, "provider"), flush=True)
    if not qnn_ok:
        print(f"  (QNN skipped: {qnn_reason})")
    return matrix


def selection_report(layers=(2, None)) -> dict:
    """Compile `demo` for rk3588 and qnn with each selection formulation; placement and parity per variant."""
    import functools

    from vlmprune import targets
    from vlmprune.compiler.pipeline import CompileOptions, compile_model
    from vlmprune.targets.qnn import QnnTarget
    from vlmprune.targets.rk3588 import Rk3588Target

    adapters = {"rk3588": Rk3588Target, "qnn": QnnTarget}
    results = {}
    print("\nSelection formulation on the demo tower (keep 192; parity images: skimage astronaut, chelsea)")
    with tempfile.TemporaryDirectory(prefix="vlmprune-selection-") as tmp:
        for target, cls in adapters.items():
            for layer in layers:
                for selection in ("gather", "onehot"):
                    saved = targets.TARGETS[target]
                    targets.TARGETS[target] = functools.partial(cls, selection=selection)
                    try:
                        out = Path(tmp) / f"{target}-{selection}-{layer}"
                        result = compile_model("demo", out, CompileOptions(target=target, keep=192, layer=layer,
                                                                           method_options={"lambda": 0.3} if layer else 0.0))
                    finally:
                        targets.TARGETS[target] = saved
                    fields = result.manifest.target
                    for variant, rows in fields["placement"].items():
                        devices = [r["device"] for r in rows]
                        islands = sum(1 for i, d in enumerate(devices) if d == "CPU" and (i == 0 or devices[i - 1] != "CPU"))
                        stages = {s.stage: s for s in result.report.stages if s.stage.startswith(("rknn", "qnn"))}
                        key = f"{target} {variant} layer={layer or 'last'} {selection}"
                        figures = {name: {"agreement": s.indices["per_image"] if s.indices else None,
                                          "cosine_min": s.outputs.get(FEATURES, {}).get("cosine_min"),
                                          "passed": s.passed} for name, s in stages.items()}
                        results[key] = {"layers": len(rows), "cpu_layers": devices.count("CPU"), "cpu_islands": islands,
                                        "cycles": fields.get("op_trace", {}).get("cycles"), "parity": figures}
                        print(f"  {key:34s} layers {len(rows):4d}  CPU {devices.count('CPU'):2d}  CPU islands {islands}  "
                              + "  ".join(f"{n}: agreement {f['agreement']} cos {f['cosine_min']}" for n, f in figures.items()),
                              flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
