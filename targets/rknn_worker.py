"""Build and simulate one ONNX model with rknn-toolkit2, inside the rknn virtual environment.

This file runs under the rknn venv's interpreter (numpy 1.26, onnx 1.18, rknn.api), never in
the vlmprune environment, so it imports nothing from vlmprune. `targets.rknn_env.run_worker`
starts it as::

    <rknn python> rknn_worker.py request.json response.json

Request (JSON):
    onnx             absolute path of the model
    out_dir          folder for the .rknn, output .npy files, build files and the log
    target_platform  e.g. "rk3588"
    mode             "fp16" (no quantization), "hybrid" (w8a8, score path kept in float16)
                     or "int8" (plain w8a8, for comparison: it breaks TopK agreement)
    inputs           optional input names; input_shapes: optional shapes (both or neither)
    dataset          hybrid/int8: calibration samples, each a list of .npy paths (one per input)
    kept_outputs     hybrid only: the graph outputs holding the kept indices (what feeds them stays
                     float16, see float_tensors)
    float_scope      hybrid only: "ancestors" (everything feeding the kept indices, default) or "score"
                     (only what feeds nothing else)
    run_inputs       optional .npy paths (one per input) to run in the simulator
    run_samples      optional list of such lists: several samples, one simulator session
    rknn_name        file name of the exported model in out_dir (default model.rknn)

Response (JSON): ok, toolkit, rknn, outputs [{name, path}] (the first sample's), runs (one
outputs list per sample), placement [{op, type, device, dtype, source}], float16_tensors,
log, seconds; or ok=false with a one-line error.
The toolkit's C++ core prints to file descriptor 1, so both descriptors go to the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import traceback

import numpy as np

RKNN = "model.rknn"  # vlmprune.compiler.contract.RKNN (spelled here: this file runs in the rknn venv)
TABLE_HEADER = re.compile(r"ID\s+OpType\s+DataType\s+Target\b")
LOG_PREFIX = re.compile(r"^[A-Z] RKNN: \[[^\]]*\] ?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
IO_OPS = {"InputOperator", "OutputOperator"}
# Inputs that carry indices: keeping the chain that feeds them in float keeps
# integer values exact (int8 cannot represent patch indices up to N).
INDEX_INPUTS = {"Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "ScatterElements": (1,),
                "ScatterND": (1,), "OneHot": (0,), "TopK": (0,), "Equal": (0, 1)}


class StageError(RuntimeError):
    """An rknn API call failed; the message names the stage."""


@contextlib.contextmanager
def redirect_fds(log_path: str):
    """Send fds 1 and 2 (Python and the C++ core) to the log while rknn runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def check(ret, stage: str):
    if ret != 0:
        raise StageError(f"{stage} returned {ret}")


def parse_placement(log_text: str, onnx_nodes: set[str]) -> list[dict]:
    """Rows of the last op table the build printed (verbose=True): one per RKNN layer.

    `source` is the ONNX node the layer came from when its name still shows it
    (RKNN appends '#n' to rewritten nodes); fused or inserted layers have None.
    """
    tables, rows, inside = [], [], False
    for raw in log_text.splitlines():
        line = LOG_PREFIX.sub("", raw)
        if TABLE_HEADER.search(line):
            rows, inside = [], True
            tables.append(rows)
            continue
        if not inside:
            continue
        cols = line.split()
        if len(cols) >= 6 and cols[0].isdigit():
            rows.append(cols)
        elif rows:
            inside = False
    placement = []
    for cols in tables[-1] if tables else []:
        op_type, dtype, device, full = cols[1], cols[2], cols[3], cols[-1]
        if op_type in IO_OPS:
            continue
        name = full.split(":", 1)[1] if ":" in full else full
        base = name.split("#", 1)[0]
        placement.append({"op": name, "type": op_type, "device": device, "dtype": dtype,
                          "source": base if base in onnx_nodes else None})
    return placement


def _graph_maps(nodes):
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return producer, consumers


def _ancestors(tensors, producer, stop_edge=None) -> set[int]:
    """Ids of nodes reachable backwards from `tensors` (stop_edge(node, i) skips input i)."""
    seen: set[int] = set()
    stack = [producer[t] for t in tensors if t in producer]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for i, name in enumerate(node.input):
            if stop_edge and stop_edge(node, i):
                continue
            if name in producer:
                stack.append(producer[name])
    return seen


def _descendants(tensors, consumers) -> set[int]:
    seen: set[int] = set()
    stack = [n for t in tensors for n in consumers.get(t, [])]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for o in node.output:
            stack.extend(consumers.get(o, []))
    return seen


def float_tensors(graph, kept_outputs: list[str], scope: str) -> list[str]:
    """Tensor names of the rknn-optimized graph to keep in float16 under hybrid quantization.

    kept_outputs: the graph outputs that hold the kept indices (the host names them from the
    record vlmprune's insertion writes; output names survive the toolkit's optimisation,
    inner tensor names do not). Everything those indices depend on decides which tokens are
    kept ("ancestors", the default: in a tower, blocks 1..L and the score); "score" keeps
    only the part that feeds nothing but the indices (the score recompute and the TopKs),
    found by cutting the index inputs through which the tokens output reads the indices.
    The chain from the indices to the index inputs of Gather*/Scatter*/OneHot/Equal/TopK
    stays float16 too: int8 cannot represent patch indices up to N. A layer's precision
    follows its outputs, so the producers of those tensors are what stays float16. Limit
    (2.5.0): a Cast from a float index copy back to int64 still reads int8, because the cfg
    rejects non-quantizable names; so sort the int64 indices with TopK directly, not via Cast.
    """
    nodes = list(graph.node)  # one list, so the id()-keyed sets below see stable objects
    producer, consumers = _graph_maps(nodes)
    keep = _ancestors(kept_outputs, producer)
    index_edge = lambda node, i: i in INDEX_INPUTS.get(node.op_type, ())  # noqa: E731
    if scope == "score":
        others = [o.name for o in graph.output if o.name not in kept_outputs]
        keep -= _ancestors(others, producer, stop_edge=index_edge)
    elif scope != "ancestors":
        raise ValueError(f"float_scope must be 'ancestors' or 'score', not {scope!r}")
    index_sinks = [n.input[i] for n in nodes for i in INDEX_INPUTS.get(n.op_type, ()) if i < len(n.input)]
    sources = [o for n in nodes if id(n) in keep for o in n.output]
    keep |= _descendants(sources, consumers) & _ancestors(index_sinks, producer)
    return [o for n in nodes if id(n) in keep for o in n.output]


def set_custom_layers(cfg_text: str, names: list[str]) -> str:
    """Replace the cfg's custom_quantize_layers block, leaving quantize_parameters untouched.

    step2 refuses a cfg whose recorded ranges changed, and a YAML round trip reformats
    the floats, so only the leading block is rewritten as text.
    """
    head, sep, rest = cfg_text.partition("\nquantize_parameters:")
    if not sep or not head.lstrip().startswith("custom_quantize_layers:"):
        raise StageError("unexpected hybrid quantization cfg layout")
    block = "custom_quantize_layers:" + ("".join(f"\n    {n}: float16" for n in names) if names else " {}")
    return block + sep + rest


def write_dataset(samples: list[list[str]], path: str) -> str:
    with open(path, "w") as f:
        for sample in samples:
            f.write(" ".join(os.path.abspath(p) for p in sample) + "\n")
    return path


def hybrid_build(rknn, req: dict, out_dir: str, log_path: str):
    """Hybrid quantization: step1 writes model/data/cfg, we mark float16 tensors, step2 builds.

    The tensor names exist only in the optimized graph that step1 writes, so the
    float16 set is computed there rather than on the input ONNX. Step2 refuses an object
    that has loaded a model, so it runs on a fresh one, which is returned.
    """
    import onnx
    from ruamel.yaml import YAML

    work = os.path.join(out_dir, "hybrid")
    os.makedirs(work, exist_ok=True)
    dataset = write_dataset(req["dataset"], os.path.join(work, "dataset.txt"))
    stem = os.path.splitext(os.path.basename(req["onnx"]))[0]
    cwd = os.getcwd()
    os.chdir(work)  # step1 writes its files into the working directory
    try:
        with redirect_fds(log_path):
            check(rknn.hybrid_quantization_step1(dataset=dataset), "hybrid_quantization_step1")
        model, data, cfg = (os.path.join(work, f"{stem}.{ext}") for ext in ("model", "data", "quantization.cfg"))
        graph = onnx.load(model).graph
        with open(cfg) as f:
            text = f.read()
        quantizable = set(YAML(typ="safe").load(text).get("quantize_parameters") or {})
        names = [n for n in float_tensors(graph, req["kept_outputs"], req.get("float_scope", "ancestors"))
                 if n in quantizable]
        with open(cfg, "w") as f:
            f.write(set_custom_layers(text, names))
        with redirect_fds(log_path):
            rknn.release()
            rknn = new_rknn(req)
            check(rknn.hybrid_quantization_step2(model_input=model, data_input=data,
                                                 model_quantization_cfg=cfg), "hybrid_quantization_step2")
    finally:
        os.chdir(cwd)
    return rknn, names


def new_rknn(req: dict):
    from rknn.api import RKNN

    rknn = RKNN(verbose=True)
    check(rknn.config(target_platform=req.get("target_platform", "rk3588")), "config")
    return rknn


def model_io(onnx_path: str):
    import onnx

    graph = onnx.load(onnx_path, load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in inits]
    return inputs, [o.name for o in graph.output], {n.name for n in graph.node}


def run(req: dict) -> dict:
    out_dir = os.path.abspath(req["out_dir"])
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)  # the toolkit drops check*.onnx files into the working directory
    log_path = os.path.join(out_dir, "rknn_build.log")
    open(log_path, "w").close()
    input_names, output_names, onnx_nodes = model_io(req["onnx"])
    mode = req.get("mode", "fp16")
    if mode not in ("fp16", "hybrid", "int8"):
        raise ValueError(f"mode must be 'fp16', 'hybrid' or 'int8', not {mode!r}")
    seconds, kept_float = {}, []
    with redirect_fds(log_path):
        rknn = new_rknn(req)
    try:
        t0 = time.perf_counter()
        with redirect_fds(log_path):
            load_kwargs = {}
            if req.get("inputs"):
                load_kwargs = {"inputs": req["inputs"], "input_size_list": req["input_shapes"]}
            check(rknn.load_onnx(req["onnx"], **load_kwargs), "load_onnx")
            if mode == "fp16":
                check(rknn.build(do_quantization=False), "build")
            elif mode == "int8":
                dataset = write_dataset(req["dataset"], os.path.join(out_dir, "dataset.txt"))
                check(rknn.build(do_quantization=True, dataset=dataset), "build")
        if mode == "hybrid":
            rknn, kept_float = hybrid_build(rknn, req, out_dir, log_path)
        seconds["build"] = time.perf_counter() - t0
        rknn_path = os.path.join(out_dir, req.get("rknn_name", RKNN))
        with redirect_fds(log_path):
            check(rknn.export_rknn(rknn_path), "export_rknn")
        samples = req.get("run_samples") or ([req["run_inputs"]] if req.get("run_inputs") else [])
        runs = []
        if samples:
            t0 = time.perf_counter()
            with redirect_fds(log_path):
                check(rknn.init_runtime(target=None), "init_runtime")
            for k, sample in enumerate(samples):
                arrays = [np.load(p) for p in sample]
                formats = ["nchw" if a.ndim == 4 else None for a in arrays]
                with redirect_fds(log_path):
                    results = rknn.inference(inputs=arrays, data_format=formats if any(formats) else None)
                if results is None:
                    raise StageError(f"inference returned no outputs for sample {k}")
                outputs = []
                for i, (name, arr) in enumerate(zip(output_names, results)):
                    path = os.path.join(out_dir, f"output_{i}.npy" if k == 0 else f"output_{k}_{i}.npy")
                    np.save(path, arr)
                    outputs.append({"name": name, "path": path})
                runs.append(outputs)
            seconds["simulate"] = time.perf_counter() - t0
    finally:
        with redirect_fds(log_path):
            rknn.release()
    with open(log_path, errors="replace") as f:
        placement = parse_placement(f.read(), onnx_nodes)
    return {"ok": True, "toolkit": _toolkit_version(), "rknn": rknn_path, "inputs": input_names,
            "outputs": runs[0] if runs else [], "runs": runs, "placement": placement, "float16_tensors": kept_float,
            "log": log_path, "seconds": seconds}


def _toolkit_version() -> str:
    from importlib.metadata import version

    return version("rknn-toolkit2")


def _one_line(exc: BaseException, log_path: str) -> str:
    """One line for the parent: the failing stage and the toolkit's reason.

    rknn either returns -1 after printing 'E <api>: <reason>' (ANSI-coloured) to the log,
    or raises ValueError wrapping a whole traceback whose last line is the reason.
    """
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    message = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    if not isinstance(exc, StageError):
        return message
    try:
        with open(log_path, errors="replace") as f:
            errors = [ANSI.sub("", ln).strip()[2:] for ln in f if ANSI.sub("", ln).startswith("E ")]
    except OSError:
        errors = []
    api_errors = [e for e in errors if not e.startswith("RKNN:")]  # the C++ core is noisier
    reason = (api_errors or errors or [""])[-1]
    return f"{message}: {reason}" if reason else message


def main(argv: list[str]) -> int:
    req_path, resp_path = argv[1], argv[2]
    with open(req_path) as f:
        req = json.load(f)
    try:
        resp = run(req)
        code = 0
    except Exception as exc:  # reported to the parent as data, with the log to read
        log = os.path.join(os.path.abspath(req.get("out_dir", ".")), "rknn_build.log")
        with open(log, "a") as f:
            traceback.print_exc(file=f)
        resp = {"ok": False, "error": _one_line(exc, log), "log": log}
        code = 1
    with open(resp_path, "w") as f:
        json.dump(resp, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
