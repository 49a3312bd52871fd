"""`vlmprune check --report report.html --junit junit.xml`: the parity report for people and for CI.

The HTML file is self-contained (styles inline, pictures as data: URIs, no script, nothing
fetched), so it can be attached to a CI run or mailed and still open. It holds every
stage's figures against its tolerances, why an index mismatch passed or failed (the tie
band of a ranked selection, the greedy step and margin), per parity image the reference's
kept set beside each stage's with the differing patches highlighted, and the reference's
score heat map where the selection ranks scores (a greedy selection has no per-patch score).

The JUnit file has one test case per stage and output (classname vlmprune.parity.STAGE),
the shape Jenkins, GitLab and GitHub test reporters read (tests/compiler/junit-10.xsd).

`vlmprune eval --report e.html` is one page in the same styles: the eval table and every sample.
"""

from __future__ import annotations

import base64
import datetime
import html
import platform
from xml.etree import ElementTree as ET

import numpy as np

from vlmprune.compiler import pictures
from vlmprune.compiler.bundle.manifest import KeepAutoSection, Manifest
from vlmprune.compiler.parity import ParityReport, StageResult, Tolerance, figure_text
from vlmprune.compiler.parity.reference import KEPT
from vlmprune.compiler.quality import stats

EXTRA_RGB = (255, 0, 255)  # kept by the stage, not by the reference
MISSING_RGB = (0, 255, 255)  # kept by the reference, not by the stage
# A perceptually ordered colour map (viridis' anchors), low -> high score.
HEAT_ANCHORS = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], np.float64)
HEAT_ALPHA = 0.7


# ------------------------------------------------------------------ figures against tolerances


def _fmt(value, bound: dict | None = None) -> str:
    return html.escape(_plain(value, bound))


def _limit(value: float) -> str:
    """A tolerance as given (--cosine 0.9999999 must not read 1)."""
    return f"{value:.15g}"


def figure_rows(stage: StageResult) -> list[dict]:
    """One row per figure of a stage: output, figure, value, the tolerance it is held to, and its verdict.

    bound: what the value is checked against (figure_text's at_least / at_most), so that it is shown
    with the digits that make a failing figure read as failing."""
    tol = stage.tolerance
    rows = []
    if stage.error:
        rows.append({"output": "(stage)", "figure": "error", "value": stage.error, "tolerance": "runs",
                     "passed": False})
    idx = stage.indices
    if idx:
        agree = idx.get("agreement")
        rows.append({"output": KEPT, "figure": "kept-index agreement", "value": agree,
                     "tolerance": f"≥ {_limit(tol.index_agreement_min)} (tie-resolved images excepted)",
                     "passed": idx.get("passed", False), "bound": {"at_least": tol.index_agreement_min}})
        if idx.get("boundary_ties") is not None:
            rows.append({"output": KEPT, "figure": "near-ties at the K-th boundary", "value": idx["boundary_ties"],
                         "tolerance": f"scores within {tol.tie_rel_tol:g} (relative)", "passed": None})
        if any(step is not None for step in idx.get("first_divergent_step") or []):
            rows.append({"output": KEPT, "figure": "first divergent greedy step", "value": idx["first_divergent_step"],
                         "tolerance": f"margin ≤ {tol.tie_rel_tol:g} is a tie", "passed": None})
        if idx.get("tie_resolved_images"):
            rows.append({"output": KEPT, "figure": "images resolved differently by a tie",
                         "value": idx["tie_resolved_images"], "tolerance": "reported, passes", "passed": None})
        if idx.get("error"):
            rows.append({"output": KEPT, "figure": "error", "value": idx["error"], "tolerance": "", "passed": False})
    for name, out in stage.outputs.items():
        t = Tolerance(**out["tolerance"]) if "tolerance" in out else tol  # an output check overrode
        if "error" in out:
            rows.append({"output": name, "figure": "error", "value": out["error"], "tolerance": "", "passed": False})
            continue
        if "note" in out:
            rows.append({"output": name, "figure": "note", "value": out["note"], "tolerance": "",
                         "passed": out["passed"]})
            continue
        if out.get("exact"):  # an integer output (positions): exact where the kept index agrees
            rows.append({"output": name, "figure": f"rows wrong (of {out['rows_compared']} compared)",
                         "value": out["rows_wrong"], "tolerance": "0 (exact)", "passed": out["passed"]})
            continue
        rows.append({"output": name, "figure": "min cosine over tokens", "value": out["cosine_min"],
                     "tolerance": f"≥ {_limit(t.cosine_min)}", "passed": out["cosine_min"] >= t.cosine_min,
                     "bound": {"at_least": t.cosine_min}})
        if t.rtol is None:
            bound = out.get("max_abs_bound", t.max_abs)  # a parity.json of before the scale term: max_abs
            rows.append({"output": name, "figure": "max-abs", "value": out["max_abs"],
                         "tolerance": _max_abs_tolerance(t, out) if bound is not None else "not checked",
                         "passed": None if bound is None else out["max_abs"] <= bound,
                         "bound": {"at_most": bound}})
        else:
            rows.append({"output": name, "figure": "elements outside atol + rtol·|ref|",
                         "value": out.get("allclose_violations"),
                         "tolerance": f"0 (atol {_limit(t.max_abs or 0)}, rtol {_limit(t.rtol)})",
                         "passed": out.get("allclose_violations") == 0})
            rows.append({"output": name, "figure": "max-abs", "value": out["max_abs"], "tolerance": "", "passed": None})
        rows.append({"output": name, "figure": "mean-abs", "value": out["mean_abs"], "tolerance": "", "passed": None})
        if out.get("images_compared_on_common_tokens"):
            rows.append({"output": name, "figure": "images whose kept set differs, compared on the tokens both kept",
                         "value": ", ".join(f"image {i}: {n} rows" for i, n in
                                            out["images_compared_on_common_tokens"].items()),
                         "tolerance": "as every row", "passed": None})
        if out.get("images_not_compared"):
            rows.append({"output": name, "figure": "images not compared by value", "value": out["images_not_compared"],
                         "tolerance": "reported", "passed": None})
        for key, text in (("rows_not_compared", "rows the reference does not define"),
                          ("rows_in_tie_band", "merged rows whose merge sat in the tie band")):
            if key in out:
                rows.append({"output": name, "figure": text, "value": out[key], "tolerance": "left out, counted",
                             "passed": None})
    return rows


def _max_abs_tolerance(tol: Tolerance, out: dict) -> str:
    """"≤ 0.0001 + 1e-05 × 108.2 (max|ref|) = 0.001182": the bound as computed for this output."""
    if "max_abs_bound" not in out or not tol.scale_rel:
        return f"≤ {_limit(out.get('max_abs_bound', tol.max_abs))}"
    return (f"≤ {_limit(tol.max_abs)} + {_limit(tol.scale_rel)} × {out['reference_max_abs']:.4g} (max|ref|) "
            f"= {out['max_abs_bound']:.4g}")


def mismatch_explanations(report: ParityReport) -> list[str]:
    """Why each image whose kept set differs from the reference's passed or failed, in sentences."""
    ref = report.reference or {}
    lines = []
    for stage in report.stages:
        idx = stage.indices or {}
        tol = stage.tolerance
        for i, agree in enumerate(idx.get("per_image", [])):
            if agree >= 1.0:
                continue
            where = f"stage {stage.stage}, image {i}"
            if "first_divergent_step" in idx:
                step, margin = idx["first_divergent_step"][i], idx["margin_at_divergence"][i]
                tied = i in idx["tie_resolved_images"]
                lines.append(f"{where}: agreement {_agreement(agree, tol)}; the greedy selection first diverged at "
                             f"step {step}, where the two best candidates were "
                             f"{_plain(margin, {'at_most': tol.tie_rel_tol})} apart (relative); "
                             + (f"within the tie band ({tol.tie_rel_tol:g}): a tie resolved differently, passes"
                                if tied else f"outside the tie band ({tol.tie_rel_tol:g}): a real divergence"))
                continue
            scores = ref.get("scores")
            kept_ref, kept_c = ref.get("kept"), idx.get("kept")
            if scores is None or kept_ref is None or kept_c is None:
                lines.append(f"{where}: agreement {_agreement(agree, tol)} "
                             "(no reference scores recorded to explain it)")
                continue
            boundary = ref.get("boundary") or len(kept_ref[i])
            s = np.asarray(scores[i], np.float64)
            r, c = np.asarray(kept_ref[i][:boundary]), np.asarray(kept_c[i][:boundary])
            ordered = np.sort(s)[::-1]
            cut = 0.5 * (ordered[boundary - 1] + ordered[boundary])
            from vlmprune.passes.methods.selection import tie_band

            band = float(tie_band(s, tol.tie_rel_tol, boundary, tol.tie_share_max))
            parts = []
            for label, idxs in (("kept only by the reference", np.setdiff1d(r, c)),
                                ("kept only by this stage", np.setdiff1d(c, r))):
                for p in idxs[:8]:
                    parts.append(f"patch {int(p)} ({label}) scores {s[p]:.7g}, "
                                 f"{figure_text(abs(s[p] - cut), 3, at_most=band)} from the K-th boundary {cut:.7g}")
            tied = i in idx.get("tie_resolved_images", [])
            verdict = (f"every differing patch lies within the tie band ±{band:.3g}: a boundary tie resolved "
                       "differently, passes" if tied else
                       f"some differing patch lies outside the tie band ±{band:.3g}: a real mismatch")
            lines.append(f"{where}: agreement {_agreement(agree, tol)}; " + "; ".join(parts) + f"; {verdict}")
    return lines


def _agreement(agree: float, tol: Tolerance) -> str:
    return figure_text(agree, 4, at_least=tol.index_agreement_min)


# ------------------------------------------------------------------ pictures


def _data_uri(image) -> str:
    """A PNG data: URI; a 256-colour palette keeps a report of many photographs small enough to mail."""
    return "data:image/png;base64," + base64.b64encode(pictures.png_bytes(image.quantize(256))).decode()


def diff_picture(view: np.ndarray, grid: int, kept: list[int], reference: list[int]):
    """A stage's kept set drawn like `vlmprune run --show`, patches it disagrees on with the reference highlighted."""
    from PIL import Image

    sel = pictures.Selection(view, grid, np.asarray(kept))
    img = pictures.draw(sel)
    cell_px = img.shape[0] // grid
    width = max(2, pictures.outline_width(cell_px) * 2)
    for patches, color in ((np.setdiff1d(kept, reference), EXTRA_RGB), (np.setdiff1d(reference, kept), MISSING_RGB)):
        for p in patches:
            box = pictures.cell(p, grid, cell_px)
            t, l, b, r = box
            img[t:b, l:r] = np.round(0.5 * img[t:b, l:r] + 0.5 * np.asarray(color)).astype(np.uint8)
            pictures.outline(img, box, color, width)
    return Image.fromarray(img)


def heat_colors(values: np.ndarray) -> np.ndarray:
    """values in [0, 1] -> RGB float [.., 3] along HEAT_ANCHORS."""
    x = np.clip(values, 0, 1) * (len(HEAT_ANCHORS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(HEAT_ANCHORS) - 2)
    frac = (x - lo)[..., None]
    return HEAT_ANCHORS[lo] * (1 - frac) + HEAT_ANCHORS[lo + 1] * frac


def heat_map(view: np.ndarray, grid: int, scores: np.ndarray):
    """The reference's scores per patch, min..max over the image, blended over the image the model saw."""
    from PIL import Image

    f = pictures.display_scale(view.shape[0])
    img = np.repeat(np.repeat(view, f, 0), f, 1).astype(np.float64)
    cell_px = img.shape[0] // grid
    s = np.asarray(scores, np.float64)
    norm = (s - s.min()) / max(s.max() - s.min(), 1e-30)
    colors = heat_colors(norm).reshape(grid, grid, 3)
    overlay = np.repeat(np.repeat(colors, cell_px, 0), cell_px, 1)
    out = (1 - HEAT_ALPHA) * img + HEAT_ALPHA * overlay
    return Image.fromarray(np.round(out).astype(np.uint8))


def _colorbar() -> str:
    stops = ", ".join(f"rgb{tuple(int(v) for v in c)}" for c in HEAT_ANCHORS)
    return f'<span class="bar" style="background: linear-gradient(to right, {stops})"></span>'


# ------------------------------------------------------------------ HTML


_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #1b1f24; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.badge { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 600; }
.pass { background: #1a7f37; } .fail { background: #cf222e; } .info { color: #57606a; }
table.figures { border-collapse: collapse; margin: 8px 0; }
table.figures th { background: #1f3b57; color: #fff; text-align: left; padding: 5px 9px; }
table.figures td { border-bottom: 1px solid #d0d7de; padding: 4px 9px; vertical-align: top; }
td.ok { color: #1a7f37; font-weight: 600; } td.bad { color: #cf222e; font-weight: 600; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; } dt { font-weight: 600; }
figure { display: inline-block; margin: 0 12px 12px 0; vertical-align: top; }
figcaption { font-size: 12px; color: #57606a; max-width: 340px; }
.bar { width: 240px; height: 12px; border: 1px solid #888; display: inline-block; vertical-align: middle; }
.key span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: middle; }
"""


def html_report(report: ParityReport, manifest: Manifest, bundle_name: str, images: np.ndarray | None) -> str:
    """The whole report as one HTML document (images: the parity inputs, [B, 3, S, S], or None to skip pictures)."""
    e = html.escape
    method = manifest.method
    ok = report.passed
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>vlmprune check: {e(bundle_name)} {'PASS' if ok else 'FAIL'}</title>",
           f"<style>{_STYLE}</style></head><body>",
           f'<h1>vlmprune check: {e(bundle_name)} <span class="badge {"pass" if ok else "fail"}">'
           f'{"PASS" if ok else "FAIL"}</span></h1>', "<dl>",
           f"<dt>target</dt><dd>{e(manifest.target.name)}: {e(manifest.target.summary)}</dd>",
           f"<dt>method</dt><dd>{e(method.summary)}</dd>",
           f"<dt>model</dt><dd>{e(str(manifest.model.source))} ({e(manifest.model.kind)})</dd>",
           f"<dt>parity images</dt><dd>{e(', '.join(report.inputs.get('images', [])))}</dd>",
           f"<dt>vlmprune</dt><dd>{e(manifest.version)}, checked "
           f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</dd></dl>"]
    out.append("<h2>Figures against tolerances</h2>")
    out.append('<table class="figures"><thead><tr><th>stage</th><th>runtime</th><th>precision</th><th>output</th>'
               "<th>figure</th><th>value</th><th>tolerance</th><th>result</th></tr></thead><tbody>")
    for stage in report.stages:
        for row in figure_rows(stage):
            verdict = {True: ('ok', 'PASS'), False: ('bad', 'FAIL'), None: ('info', '')}[row["passed"]]
            out.append(f"<tr><td>{e(stage.stage)}</td><td>{e(stage.runtime)}</td><td>{e(stage.precision)}</td>"
                       f"<td>{e(row['output'])}</td><td>{e(row['figure'])}</td>"
                       f"<td>{_fmt(row['value'], row.get('bound'))}</td>"
                       f"<td>{e(row['tolerance'])}</td><td class=\"{verdict[0]}\">{verdict[1]}</td></tr>")
    out.append("</tbody></table>")
    out.append("<h2>Index mismatches</h2>")
    explained = mismatch_explanations(report)
    if explained:
        out.append("<ul>" + "".join(f"<li>{e(line)}</li>" for line in explained) + "</ul>")
    else:
        out.append('<p class="info">Every stage kept exactly the reference\'s patches on every parity image.</p>')
    out += _keep_auto_section(manifest.keep_auto)
    out += _pictures_section(report, manifest, images)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _keep_auto_section(section: KeepAutoSection | None) -> list[str]:
    """--keep auto: the K -> latency curve K was chosen on (the manifest's keep_auto), as a picture and its figures."""
    if not section:
        return []
    e = html.escape
    loaded = "" if section.load is None else f"; other processes used {section.load:.0%} of the CPUs meanwhile"
    rows = "".join(f"<tr><td>{k}</td><td>{ms:.3f}</td></tr>" for k, ms in section.curve)
    return ["<h2>K chosen by latency (--keep auto)</h2>",
            f'<p>K = {section.chosen}: the largest timed K within {section.budget_ms:g} ms, timed on '
            f'{e(section.timed_on)}{e(loaded)}.</p>',
            f'<figure><img alt="latency vs K" src="{_data_uri(pictures.latency_curve(section))}"></figure>',
            f'<table class="figures"><thead><tr><th>K</th><th>ms</th></tr></thead><tbody>{rows}</tbody></table>']


def _pictures_section(report: ParityReport, manifest: Manifest, images: np.ndarray | None) -> list[str]:
    e = html.escape
    ref = report.reference
    out = ["<h2>Kept patches per parity image</h2>"]
    if ref is None:
        return out + ['<p class="info">A dense bundle selects nothing: no kept sets to draw.</p>']
    if images is None:
        return out + ['<p class="info">The parity images cannot be recreated here, so they are not drawn.</p>']
    pre = manifest.preprocess
    from vlmprune.compiler.errors import InputError

    try:
        grid = pictures.token_grid(manifest)
    except InputError as exc:
        return out + [f'<p class="info">Not drawn: {e(str(exc))}.</p>']
    kept_all = [ref["kept"]] + [(s.indices or {}).get("kept") or [] for s in report.stages]
    if any(max(row, default=0) >= grid * grid for k in kept_all for row in k) or len(images) != len(ref["kept"]):
        return out + ['<p class="info">The kept indices span more than one patch grid per image (several crops): '
                      "not drawn.</p>"]
    out.append('<p class="key">Dimmed: pruned; yellow outline: kept; <span style="background: rgb(255,0,255)">'
               '</span>kept by the stage, not the reference; <span style="background: rgb(0,255,255)"></span>'
               "kept by the reference, not the stage.</p>")
    views = [pictures.model_view(p, pre.mean, pre.std) for p in images]
    names = report.inputs.get("images", [])
    for i, view in enumerate(views):
        out.append(f"<h3>image {i}: {e(names[i] if i < len(names) else '')}</h3><div>")
        reference = ref["kept"][i]
        ref_pic = pictures.draw(pictures.Selection(view, grid, np.asarray(reference)))
        from PIL import Image

        out.append(f'<figure><img alt="reference kept set, image {i}" src="{_data_uri(Image.fromarray(ref_pic))}">'
                   f"<figcaption>reference (PyTorch fp32): {len(reference)} kept</figcaption></figure>")
        for stage in report.stages:
            kept = (stage.indices or {}).get("kept")
            if kept is None or i >= len(kept):
                continue
            differ = len(np.setdiff1d(kept[i], reference))
            caption = "same kept set as the reference" if not differ else f"{differ} patches differ from the reference"
            out.append(f'<figure><img alt="{e(stage.stage)} kept set, image {i}" '
                       f'src="{_data_uri(diff_picture(view, grid, kept[i], reference))}">'
                       f"<figcaption>{e(stage.stage)} ({e(stage.runtime)}): {caption}</figcaption></figure>")
        out.append("</div>")
    out.append("<h2>Reference score heat map</h2>")
    if ref.get("scores") is None:
        why = ("its selection is greedy: each pick depends on the ones before it, so no per-patch score ranks them"
               if ref.get("selection") == "greedy" else "the reference recorded no scores")
        out.append(f'<p class="info">No heat map for {e(manifest.method.name)}: {why}.</p>')
        return out
    out.append(f'<p class="key">Scores the reference ranked, per image, low {_colorbar()} high '
               "(min to max of that image).</p><div>")
    if any(len(row) != grid * grid for row in ref["scores"]):
        out.append('<p class="info">The scores do not form one patch grid per image: no heat map.</p>')
        return out
    for i, view in enumerate(views):
        s = np.asarray(ref["scores"][i])
        out.append(f'<figure><img alt="score heat map, image {i}" src="{_data_uri(heat_map(view, grid, s))}">'
                   f"<figcaption>image {i}: scores {s.min():.4g} … {s.max():.4g}</figcaption></figure>")
    out.append("</div>")
    return out


def parity_images(report: ParityReport) -> np.ndarray | None:
    """The parity inputs again (deterministic from what the report recorded: the images are named, seeded and
    preprocessed there, so the manifest adds nothing), or None if they differ here."""
    from vlmprune.compiler.frontend.images import parity_inputs

    inputs = report.inputs
    names = inputs.get("images", [])
    if not names:
        return None
    pixel, described = parity_inputs(len(names), inputs["size"], inputs["mean"], inputs["std"], inputs.get("seed", 0))
    return pixel if described["images"] == names else None


# ------------------------------------------------------------------ JUnit


def junit_xml(report: ParityReport, manifest: Manifest, bundle_name: str, seconds: float) -> bytes:
    """One <testcase> per stage and output; failures carry the failing figures, errors a stage that could not run."""
    cases = []
    for stage in report.stages:
        classname = f"vlmprune.parity.{stage.stage}"
        rows = figure_rows(stage)
        names = [KEPT] if stage.indices else []
        names += list(stage.outputs)
        if stage.error or not names:
            cases.append((classname, "stage", "error", stage.error or "no output was compared", rows))
            continue
        for name in names:
            mine = [r for r in rows if r["output"] == name]
            failed = [r for r in mine if r["passed"] is False]
            message = "; ".join(f"{r['figure']} {_plain(r['value'], r.get('bound'))} (needs {r['tolerance']})"
                                for r in failed)
            cases.append((classname, name, "failure" if failed else None, message, mine))
    failures = sum(1 for c in cases if c[2] == "failure")
    errors = sum(1 for c in cases if c[2] == "error")
    root = ET.Element("testsuites", name="vlmprune check", tests=str(len(cases)), failures=str(failures),
                      errors=str(errors), time=f"{seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"vlmprune check {bundle_name}", tests=str(len(cases)),
                          failures=str(failures), errors=str(errors), skipped="0", time=f"{seconds:.3f}",
                          timestamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
                          hostname=platform.node() or "localhost")
    props = ET.SubElement(suite, "properties")
    for key, value in (("target", manifest.target.name), ("method", manifest.method.summary),
                       ("model", str(manifest.model.source)), ("vlmprune", manifest.version)):
        ET.SubElement(props, "property", name=key, value=value)
    for classname, name, kind, message, rows in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
        if kind:
            ET.SubElement(case, kind, message=message, type="parity" if kind == "failure" else "stage").text = message
        ET.SubElement(case, "system-out").text = "\n".join(
            f"{r['figure']}: {_plain(r['value'], r.get('bound'))}"
            + (f" (tolerance {r['tolerance']})" if r["tolerance"] else "")
            for r in rows) or "no figures"
    ET.indent(root)
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8") + b"\n"


def _plain(value, bound: dict | None = None) -> str:
    """A figure as text: 7 significant digits, more where they decide the verdict against its bound."""
    if value is None:
        return "—"
    return figure_text(value, 7, **(bound or {})) if isinstance(value, float) else str(value)


# ------------------------------------------------------------------ eval


def eval_html(data: dict) -> str:
    """`vlmprune eval --report e.html`: the eval table, then every sample, as one self-contained page
    (the parity report's styles; data: the report evaluate() returns, as --json prints it)."""
    e = html.escape
    m = data["max_new_tokens"]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>vlmprune eval: {e(str(data['model']))}</title>", f"<style>{_STYLE}</style></head><body>",
           f"<h1>vlmprune eval: {e(str(data['model']))}</h1>", "<dl>",
           f"<dt>images</dt><dd>{e(', '.join(data['images']))}</dd>",
           f"<dt>prompts</dt><dd>{len(data['prompts'])}</dd>",
           f"<dt>answers</dt><dd>{m} greedy tokens; dense: {data['dense_image_tokens']} image tokens</dd>",
           f"<dt>harness check</dt><dd>max KL {_fmt(data['harness_kl_max'])} against transformers' own forward</dd>",
           f"<dt>pruned with</dt><dd>{e(data['pruned_with'])}</dd></dl>", "<h2>Per method and K</h2>"]
    summary = ("method", "K", "tokens", "KL mean", "KL max", "top-1", f"exact@{m}", "prefix", "from")
    keys = ("method", "keep", "image_tokens", "kl_mean", "kl_max", "first_token_agreement", "exact_match",
            "prefix_agreement", "from")
    out.append(_html_table(summary, [[r[k] for k in keys] for r in data["results"]]))
    out.append("<h2>Samples</h2>")
    columns = ("method", "K", "from", "image", "prompt", "KL", "first token agrees", "exact", "prefix share")
    rows = [[r["method"], r["keep"], r["from"], s["image"], s["prompt"], s["kl"], s["first_token_agrees"],
             s["exact"], s["prefix_share"]] for r in data["results"] for s in r["samples"]]
    out.append(_html_table(columns, rows))
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_table(columns, rows) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="figures"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# ------------------------------------------------------------------ eval --dataset

CURVE_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


class _Chart:
    """A plot area in a PIL image for the eval pictures: a frame, ticks, axis names, a title, and a legend column
    on the right; x and y map data to pixels (either axis linear or log2)."""

    def __init__(self, size, x_range, y_range, title, x_name, y_name="", x_log=False):
        from PIL import Image, ImageDraw, ImageFont

        self.font = ImageFont.load_default()
        self.w, self.h = size
        self.left, self.right, self.top, self.bottom = 56, 150, 28, 44
        self.image = Image.new("RGB", size, "white")
        self.draw = ImageDraw.Draw(self.image)
        self.x_log = x_log
        f = np.log2 if x_log else (lambda v: v)
        self._x0, self._x1 = float(f(x_range[0])), float(f(x_range[1]))
        self._y0, self._y1 = y_range
        self._f = f
        d = self.draw
        d.rectangle([self.left, self.top, self.w - self.right, self.h - self.bottom], outline=(0, 0, 0))
        d.text((self.left, 8), title, fill=(0, 0, 0), font=self.font)
        d.text(((self.w - self.right + self.left) / 2 - 40, self.h - 16), x_name, fill=(0, 0, 0), font=self.font)
        if y_name:
            d.text((4, self.top - 22), y_name, fill=(0, 0, 0), font=self.font)
        self.legend_rows = 0

    def x(self, v):
        span = self._x1 - self._x0
        return self.left + (0.5 if span == 0 else (self._f(v) - self._x0) / span) * (self.w - self.left - self.right)

    def y(self, v):
        span = self._y1 - self._y0
        return self.top + (0.5 if span == 0 else 1 - (v - self._y0) / span) * (self.h - self.top - self.bottom)

    def y_ticks(self, values, fmt="{:.2f}"):
        for v in values:
            self.draw.line([self.left - 4, self.y(v), self.left, self.y(v)], fill=(0, 0, 0))
            self.draw.text((self.left - 34, self.y(v) - 6), fmt.format(v), fill=(0, 0, 0), font=self.font)

    def x_ticks(self, values, fmt="{}"):
        for v in values:
            self.draw.line([self.x(v), self.h - self.bottom, self.x(v), self.h - self.bottom + 4], fill=(0, 0, 0))
            self.draw.text((self.x(v) - 8, self.h - self.bottom + 8), fmt.format(v), fill=(0, 0, 0), font=self.font)

    def dashed(self, value, label, horizontal=True):
        d = self.draw
        if horizontal:
            for start in range(self.left, self.w - self.right, 12):
                d.line([start, self.y(value), min(start + 6, self.w - self.right), self.y(value)], fill=(0, 0, 0))
            if label:
                d.text((self.w - self.right + 8, self.y(value) - 6), label, fill=(0, 0, 0), font=self.font)
        else:
            for start in range(self.top, self.h - self.bottom, 12):
                d.line([self.x(value), start, self.x(value), min(start + 6, self.h - self.bottom)],
                       fill=(160, 160, 160))

    def legend(self, text, color, marker=None):
        text = text.replace("→", "->")  # the picture's bitmap font has no arrow ("progressive 2→4→6")
        y = self.top + 14 * self.legend_rows
        self.legend_rows += 1
        if marker is not None:
            _marker(self.draw, marker, self.w - self.right + 12, y + 6, color, filled=True)
        self.draw.text((self.w - self.right + (22 if marker else 8), y), text, fill=color, font=self.font)


def _marker(d, shape: str, px: float, py: float, color, filled: bool, r: int = 3) -> None:
    """A point: square, circle, triangle or diamond; hollow for the baselines."""
    fill = color if filled else "white"
    if shape == "circle":
        d.ellipse([px - r, py - r, px + r, py + r], fill=fill, outline=color)
    elif shape == "triangle":
        d.polygon([(px, py - r - 1), (px - r - 1, py + r), (px + r + 1, py + r)], fill=fill, outline=color)
    elif shape == "diamond":
        d.polygon([(px, py - r - 2), (px + r + 2, py), (px, py + r + 2), (px - r - 2, py)], fill=fill, outline=color)
    else:
        d.rectangle([px - r, py - r, px + r, py + r], fill=fill, outline=color)


def accuracy_curves(rows: list[dict], dense: dict, where: str, size=(640, 400)):
    """Accuracy against K for each method at one pruning place, with 95 % intervals as bars and dense as a dashed
    line: a PIL image (K on a log2 axis; the baselines drawn thinner)."""
    keeps = sorted({r["keep"] for r in rows})
    chart = _Chart(size, (keeps[0], keeps[-1]), (0.0, 1.0), f"accuracy vs K, pruned {where}", "K (kept patches)",
                   x_log=True)
    chart.y_ticks((0, 0.25, 0.5, 0.75, 1.0))
    chart.x_ticks(keeps)
    chart.dashed(dense["accuracy"], "dense")
    d = chart.draw
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        color = CURVE_COLORS[i % len(CURVE_COLORS)]
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["keep"])
        points = [(chart.x(r["keep"]), chart.y(r["accuracy"])) for r in mine]
        if len(points) > 1:
            d.line(points, fill=color, width=1 if mine[0]["baseline"] else 2)
        for r, (px, py) in zip(mine, points):
            lo, hi = r["accuracy_ci"]
            d.line([px, chart.y(lo), px, chart.y(hi)], fill=color)
            d.rectangle([px - 2, py - 2, px + 2, py + 2], fill=color)
        chart.legend(method + (" (baseline)" if mine[0]["baseline"] else ""), color)
    return chart.image


def place_markers(rows: list[dict]) -> dict[str, str]:
    """A marker shape per pruning place, in order of appearance: square, circle, triangle, then squares again."""
    shapes = ("square", "circle", "triangle")
    return {w: shapes[i] if i < len(shapes) else "square"
            for i, w in enumerate(dict.fromkeys(r["where"] for r in rows if r["keep"] is not None))}


def speedup_picture(rows: list[dict], size=(720, 440)):
    """Accuracy retained against the tower's speedup over dense: a point per (method, K, place) with its 95 %
    interval as a bar, a colour per method, a marker shape per place, the baselines hollow, dense a black diamond
    at (1, 1); K written beside each point. rows: the report's rows with `tower_speedup` (eval_quality's latency);
    a row without a speedup or a retained figure is left out. None when no row has both."""
    pruned = [r for r in rows if r["keep"] is not None and r.get("tower_speedup") and r.get("retained") is not None]
    if not pruned:
        return None
    xs = [r["tower_speedup"] for r in pruned] + [1.0]
    ys = [v for r in pruned for v in (r["retained_ci"] or [r["retained"]] * 2)] + [1.0]
    pad = 0.05 * max(max(ys) - min(ys), 0.05)
    x_hi = max(xs) * 1.05
    chart = _Chart(size, (min(1.0, min(xs)) * 0.95, x_hi), (min(ys) - pad, max(ys) + pad),
                   "accuracy retained vs tower speedup (ONNX Runtime, this machine)", "tower speedup over dense (x)",
                   "retained")
    step = 0.05 if max(ys) - min(ys) <= 0.3 else 0.1
    chart.y_ticks([v for v in np.arange(np.floor((min(ys) - pad) / step) * step, max(ys) + pad + 1e-9, step)
                   if min(ys) - pad <= v <= max(ys) + pad])
    chart.x_ticks([v for v in range(1, int(x_hi) + 1)] if x_hi < 12 else [1, *range(2, int(x_hi) + 1, 2)], "{}x")
    chart.dashed(1.0, "")  # dense's accuracy, and its speed: the legend names dense
    chart.dashed(1.0, "", horizontal=False)
    d = chart.draw
    markers = place_markers(pruned)
    methods = list(dict.fromkeys(r["method"] for r in pruned))
    for i, method in enumerate(methods):
        color = CURVE_COLORS[i % len(CURVE_COLORS)]
        mine = [r for r in pruned if r["method"] == method]
        for r in mine:
            px, py = chart.x(r["tower_speedup"]), chart.y(r["retained"])
            if r["retained_ci"] is not None:
                d.line([px, chart.y(r["retained_ci"][0]), px, chart.y(r["retained_ci"][1])], fill=color)
            _marker(d, markers[r["where"]], px, py, color, filled=not r["baseline"])
            d.text((px + 5, py - 12), str(r["keep"]), fill=color, font=chart.font)
        chart.legend(method + (" (baseline, hollow)" if mine[0]["baseline"] else ""), color)
    _marker(d, "diamond", chart.x(1.0), chart.y(1.0), (0, 0, 0), filled=True)
    chart.legend("dense (dashed: its level)", (0, 0, 0), "diamond")
    for where, shape in markers.items():
        chart.legend(where, (90, 90, 90), shape)
    return chart.image


def _ci(v) -> str:
    return "—" if v is None or not all(x is not None and np.isfinite(x) for x in v) else f"[{v[0]:.3f}, {v[1]:.3f}]"


def _versus(vs) -> str:
    return "—" if vs is None else f"{vs['difference']:+.3f} {_ci(vs['ci'])}" + (" *" if vs["counts"] else "")


def quality_html(data: dict) -> str:
    """`vlmprune eval --dataset D --report q.html`: the accuracy table (overall, then per question type where the
    dataset has types), accuracy-vs-K curves per pruning place, accuracy retained against tower speedup where the
    rows carry latency (tools/eval_quality.py), and every sample's answers, as one self-contained page
    (data: accuracy.evaluate_dataset's report)."""
    e = html.escape
    rows = data["rows"]
    dense = rows[0]
    types = data.get("types") or {}
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>vlmprune eval: {e(str(data['model']))}</title>", f"<style>{_STYLE}</style></head><body>",
           f"<h1>vlmprune eval --dataset: {e(str(data['model']))}</h1>", "<dl>",
           f"<dt>dataset</dt><dd>{e(data['dataset'])}: {data['samples']} samples"
           + (f", {len(types)} question types" if types else "") + "</dd>",
           f"<dt>answers</dt><dd>exact match of at most {data['max_new_tokens']} greedy tokens; majority answer "
           f"{e(data['majority_answer'])!s}: {data['majority_accuracy']:.3f}</dd>",
           f"<dt>bundles</dt><dd>{len(rows)}, compiled for {e(data['target'])} and run by its runner here "
           f"({e(data['executor'])})</dd>",
           f"<dt>store</dt><dd>{e(data['store'])}: {data['computed']} cells computed, {data['reused']} reused</dd>"]
    if data.get("latency"):
        out.append(f"<dt>latency</dt><dd>{e(data['latency']['summary'])}</dd>")
    out += ["</dl>", "<h2>Accuracy</h2>"]
    latency = any(r.get("tower_ms") is not None for r in rows)
    columns = ["method", "K", "where", "accuracy", "95% CI", "retained", "95% CI", "vs random (95% CI)",
               "agrees with dense", "agreement vs random"]
    if latency:
        columns += ["tower ms", "speedup"]
    table_rows = []
    for r in rows:
        row = [r["method"], "" if r["keep"] is None else r["keep"], r["where"], f"{r['accuracy']:.3f}",
               _ci(r["accuracy_ci"]), "—" if r["retained"] is None else f"{r['retained']:.3f}", _ci(r["retained_ci"]),
               _versus(r.get("vs_random"))]
        agreement = r.get("agreement")  # reports written before agreement was measured have none
        row += ["—", "—"] if agreement is None else [f"{agreement['value']:.3f} {_ci(agreement['ci'])}",
                                                      _versus(agreement["vs_random"])]
        if latency:
            row += ["—" if r.get("tower_ms") is None else f"{r['tower_ms']:.1f}",
                    "—" if r.get("tower_speedup") is None else f"{r['tower_speedup']:.2f}x"]
        table_rows.append(row + ["pass" if r["parity_passed"] else "FAIL"])
    out.append(_html_table((*columns, "bundle parity"), table_rows))
    out.append(f'<p class="key">vs random: {e(stats.VERSUS_RANDOM)}; * where the interval excludes 0 (only there '
               f"does the difference count). Agrees with dense: {e(stats.AGREES)}.</p>")
    if data.get("retained_null"):
        out.append(f'<p class="info">Retained — : {e(data["retained_null"])}.</p>')
    if types:
        out.append("<h2>Accuracy per question type</h2>")
        names = list(types)
        head = ("method", "K", "where", *names)
        body = [["samples", "", "", *(types[t]["samples"] for t in names)],
                ["majority answer", "", "", *(f"{types[t]['majority_accuracy']:.3f} ({types[t]['majority_answer']})"
                                              for t in names)]]
        for r in rows:
            body.append([r["method"], "" if r["keep"] is None else r["keep"], r["where"],
                         *(f"{r['by_type'][t]['accuracy']:.3f} {_ci(r['by_type'][t]['accuracy_ci'])}"
                           + (f"; vs random {_versus(r['by_type'][t]['vs_random'])}"
                              if r["by_type"][t]["vs_random"] else "") for t in names)])
        out.append(_html_table(head, body))
    picture = speedup_picture(rows)
    if picture is not None:
        out.append('<h2>Accuracy retained vs tower speedup</h2><img alt="accuracy retained vs tower speedup" '
                   f'src="{_data_uri(picture)}">')
    pruned = [r for r in rows if r["keep"] is not None]
    for where in dict.fromkeys(r["where"] for r in pruned):
        picture = accuracy_curves([r for r in pruned if r["where"] == where], dense, where)
        out.append(f'<h2>Pruned {e(where)}</h2><img alt="accuracy vs K, pruned {e(where)}" '
                   f'src="{_data_uri(picture)}">')
    out.append("<h2>Samples</h2>")
    sample_types = dict(zip(data["sample_digests"], data.get("sample_types") or []))
    columns = ("method", "K", "where", "sample", *(("type",) if types else ()), "answer", "correct")
    out.append(_html_table(columns, [[r["method"], r["keep"], r["where"], digest[:12],
                                      *((sample_types.get(digest) or "",) if types else ()), cell["answer"],
                                      cell["correct"]] for r in rows for digest, cell in r["answers"].items()]))
    out.append("</body></html>")
    return "\n".join(out) + "\n"
