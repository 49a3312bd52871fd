"""`check --report report.html --junit junit.xml`: the page rendered by a real browser, the XML by its schema."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmprune.compiler import pictures, report
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.parity import ParityReport, StageResult, Tolerance
from cli_helpers import one_line_error as _one_line_error, run_cli as _run

XSD = Path(__file__).with_name("junit-10.xsd")


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium, or a skip that says how to get it (.ci/run installs it when it runs as root)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and Path("/usr/bin/chromium").exists():
        path = "/usr/bin/chromium"
    if path is None:
        pytest.skip("chromium is not installed: `apt-get update && apt-get install -y chromium` (Debian) renders "
                    "the HTML report in this test")
    return path


def _headless(chromium: str, profile: Path, *args) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={profile}"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checked(tiny_llava_dir, compiled, tmp_path_factory):
    """A visionzip bundle of the tiny LLaVA, checked twice: as compiled (passes) and with --atol 0 (fails)."""
    root = tmp_path_factory.mktemp("report")
    bundle = compiled(tiny_llava_dir, method="visionzip", keep=16, method_options={"contextual": 4}).bundle
    ok = _run("check", bundle, "--report", root / "ok.html", "--junit", root / "ok.xml", "--json")
    bad = _run("check", bundle, "-q", "--report", root / "bad.html", "--junit", root / "bad.xml",
               "--atol", "image_features:0")
    assert ok.exit_code == 0, ok.output
    assert bad.exit_code == 1 and "error: parity failed" in bad.output, bad.output
    return bundle, root, json.loads(ok.stdout)


def test_junit_validates_and_has_one_case_per_stage_and_output(checked):
    import xmlschema

    _, root, data = checked
    schema = xmlschema.XMLSchema(str(XSD))
    for name in ("ok.xml", "bad.xml"):
        schema.validate(str(root / name))
    from xml.etree import ElementTree as ET

    suite = ET.parse(root / "ok.xml").getroot().find("testsuite")
    cases = {(c.get("classname"), c.get("name")) for c in suite.findall("testcase")}
    expected = {(f"vlmprune.parity.{s['stage']}", o) for s in data["stages"]
                for o in (["kept_indices"] if s["indices"] else []) + list(s["outputs"])}
    assert cases == expected and len(expected) == 5  # export: features; rewritten and target: kept + features
    assert suite.get("failures") == "0" and suite.find("testcase/failure") is None
    bad = ET.parse(root / "bad.xml").getroot().find("testsuite")
    failed = [c for c in bad.findall("testcase") if c.find("failure") is not None]
    assert {c.get("name") for c in failed} == {"image_features"} and bad.get("failures") == str(len(failed)) == "3"
    assert "max-abs" in failed[0].find("failure").get("message") and "≤ 0" in failed[0].find("failure").get("message")


def test_html_is_self_contained_and_says_what_failed(checked):
    _, root, data = checked
    page = (root / "ok.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\(\s*["']?(https?:|//)|<script|<link""", page)
    srcs = re.findall(r'<img[^>]+src="([^"]+)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert len(srcs) == 2 * (1 + 2) + 2  # per parity image: reference + the 2 stages that select; 2 heat maps
    assert 'class="badge pass">PASS' in page and "Every stage kept exactly" in page
    bad = (root / "bad.html").read_text()
    assert 'class="badge fail">FAIL' in bad and "≤ 0</td><td class=\"bad\">FAIL" in bad


def test_chromium_renders_the_table_and_the_pictures(checked, chromium, tmp_path):
    _, root, _ = checked
    page = (root / "ok.html").read_text()
    # A probe added to a copy only: the report itself has no script.
    probe = ("<script>window.addEventListener('load', () => { const i = [...document.images]; "
             "const rows = document.querySelectorAll('table.figures tbody tr').length; "
             "document.body.setAttribute('data-probe', `rows=${rows} "
             "images=${i.length} decoded=${i.filter(x => x.complete && x.naturalWidth > 0).length}`); });</script>")
    (tmp_path / "probe.html").write_text(page.replace("</body>", probe + "</body>"))
    dom = _headless(chromium, tmp_path / "p1", "--virtual-time-budget=5000", "--dump-dom",
                    (tmp_path / "probe.html").as_uri())
    rows = len(re.findall(r"<tr><td>", page))
    found = re.search(r'data-probe="rows=(\d+) images=(\d+) decoded=(\d+)"', dom.stdout)
    assert found, dom.stdout[-2000:] + dom.stderr[-2000:]
    assert int(found[1]) == rows > 0 and int(found[2]) == int(found[3]) == 8
    shot = tmp_path / "shot.png"
    result = _headless(chromium, tmp_path / "p2", "--window-size=1400,2400", f"--screenshot={shot}",
                       (root / "ok.html").as_uri())
    assert shot.is_file(), result.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    header = (np.abs(pixels - np.array([0x1F, 0x3B, 0x57])).max(axis=-1) <= 2).sum()
    assert header > 5000  # the table's header row, drawn with its inline style
    yellow = (np.abs(pixels - np.array(pictures.KEPT_RGB)).max(axis=-1) <= 24).sum()
    assert yellow > 2000  # the kept patches' outlines inside the decoded pictures


def test_tie_band_explanation_and_heat_map_by_pixel():
    scores = [[0.9, 0.5, 0.5 - 1e-6, 0.1]]
    fp16 = Tolerance(cosine_min=0.999, index_agreement_min=1.0, tie_rel_tol=1e-3, tie_share_max=1.0)
    stage = StageResult("fused", "ort", "fp16", fp16, False,
                        indices={"per_image": [0.5], "kept": [[0, 2]], "tie_resolved_images": [0]})
    data = ParityReport({}, [stage], {"kept": [[0, 1]], "scores": scores, "boundary": 2, "selection": "score"})
    (line,) = report.mismatch_explanations(data)
    assert "patch 1 (kept only by the reference)" in line and "patch 2 (kept only by this stage)" in line
    assert "within the tie band" in line and "passes" in line
    stage.indices["tie_resolved_images"] = []
    assert "a real mismatch" in report.mismatch_explanations(data)[0]
    view = np.full((28, 28, 3), 100, np.uint8)  # 2 x 2 patches of 14 px, shown x12
    heat = np.asarray(report.heat_map(view, 2, np.array([0.0, 1.0, 0.5, 0.25]))).astype(float)
    top = (1 - report.HEAT_ALPHA) * 100 + report.HEAT_ALPHA * report.HEAT_ANCHORS[-1]
    low = (1 - report.HEAT_ALPHA) * 100 + report.HEAT_ALPHA * report.HEAT_ANCHORS[0]
    cell = heat.shape[0] // 2
    assert np.abs(heat[cell // 2, cell + cell // 2] - top).max() <= 0.51  # patch 1 has the highest score
    assert np.abs(heat[cell // 2, cell // 2] - low).max() <= 0.51


def test_greedy_methods_get_no_heat_map_and_say_why():
    manifest = Manifest({"method": {"name": "divprune", "summary": "DivPrune"},
                         "target": {"name": "ort", "summary": "x"},
                         "model": {"source": "demo", "kind": "preset", "patch_size": 14}, "vlmprune_version": "0",
                         "preprocess": {"size": 28, "mean": [0.5] * 3, "std": [0.5] * 3}})
    data = ParityReport({"images": ["a"]}, [],
                        {"kept": [[0, 3]], "scores": None, "boundary": None, "selection": "greedy"})
    page = report.html_report(data, manifest, "b", np.zeros((1, 3, 28, 28), np.float32))
    assert "No heat map for divprune: its selection is greedy" in page


def test_check_flags_are_refused_in_one_line(checked, tmp_path):
    bundle, _, _ = checked
    _one_line_error(_run("check", bundle, "--report", tmp_path / "r.txt"), "must end in .html or .htm or .json")
    _one_line_error(_run("check", bundle, "--cosine", "kept_indices:0.9"), "compared by kept-index agreement")
    _one_line_error(_run("check", bundle, "--atol", "image_features:x"), "not a number")
    _one_line_error(_run("check", bundle, "--rtol", "nope:1e-3"), "has no output 'nope'")
    existing = tmp_path / "r.html"
    existing.write_text("mine")
    _one_line_error(_run("check", bundle, "--report", existing), "already exists (use --force")
    assert existing.read_text() == "mine"


def test_tolerance_overrides_per_output_and_rtol():
    from vlmprune.compiler import parity
    from vlmprune.compiler.parity.reference import Reference

    got = parity.parse_overrides({"atol": ("1e-3", "image_features:0"), "rtol": (), "cosine": ("b:0.5",)},
                                 ["image_features", "b"], ["kept_indices"])
    assert got == {"image_features": {"max_abs": 0.0, "scale_rel": None},  # --atol is the whole bound
                   "b": {"max_abs": 1e-3, "scale_rel": None, "cosine_min": 0.5}}
    ref = np.ones((1, 2, 4))
    cand = ref * 1.001  # max-abs 1e-3, relative 1e-3, cosine 1
    fp32 = parity.tolerance_for("fp32")
    assert not parity.compare_tokens(ref, cand, fp32)["passed"]  # max-abs 1e-3 > 1e-4
    loose = parity.compare_tokens(ref, cand, parity.tolerance_for("fp32", {"rtol": 2e-3}))
    assert loose["passed"] and loose["allclose_violations"] == 0 and loose["max_rel"] == pytest.approx(1e-3)
    tight = parity.compare_tokens(ref, cand, parity.tolerance_for("fp32", {"rtol": 5e-4}))
    assert not tight["passed"] and tight["allclose_violations"] == 8
    stage = parity.run_stage("s", "numpy", "fp32", lambda x: {"image_features": cand}, np.zeros(1),
                             Reference({"image_features": ref}), output_overrides={"image_features": {"max_abs": 2e-3}})
    assert stage.passed and stage.outputs["image_features"]["tolerance"]["max_abs"] == 2e-3
    assert not parity.run_stage("s", "numpy", "fp32", lambda x: {"image_features": cand}, np.zeros(1),
                                Reference({"image_features": ref})).passed  # the default stays


def test_a_failing_figure_never_reads_as_passing():
    from vlmprune.compiler import parity
    from vlmprune.compiler.cli.render import progress_line

    assert parity.figure_text(0.99999994, 6, at_least=1.0) == "0.9999999"  # 6 digits would read "1"
    assert parity.figure_text(0.99999997, 7, at_least=1.0) == "0.99999997"
    assert parity.figure_text(1.00004e-4, 3, at_most=1e-4) == "0.000100004"
    assert parity.figure_text(0.9999923, 7, at_least=0.99999) == "0.9999923"  # passing: no extra digits
    assert parity.figure_text(1.0 + 2e-16, 6, at_least=1.0) == "1"  # passes either way
    tol = parity.tolerance_for("fp32", {"cosine_min": 1.0})
    stage = parity.StageResult("rewritten", "ort", "fp32", tol, False, outputs={
        "image_features": {"cosine_min": 0.99999997, "max_abs": 2e-7, "mean_abs": 1e-8, "passed": False}})
    assert progress_line(stage) == ("  rewritten  FAIL  cosine_min 0.99999997, max_abs 2e-07  "
                                   "(failing: image_features)")  # the progress line
    rows = report.figure_rows(stage)
    page = report.html_report(ParityReport({}, [stage]),
                              Manifest({"method": {"summary": "cls", "name": "cls"},
                                        "target": {"name": "ort", "summary": "s"},
                                        "model": {"source": "m", "kind": "hf"}, "vlmprune_version": "0"}), "b", None)
    assert "<td>min cosine over tokens</td><td>0.99999997</td><td>≥ 1</td><td class=\"bad\">FAIL" in page
    assert [r["value"] for r in rows if r["figure"] == "min cosine over tokens"] == [0.99999997]
    xml = report.junit_xml(ParityReport({}, [stage]),
                           Manifest({"target": {"name": "ort"}, "method": {"summary": "cls"}, "model": {"source": "m"},
                                     "vlmprune_version": "0"}), "b", 1.0)
    assert b"min cosine over tokens 0.99999997 (needs \xe2\x89\xa5 1)" in xml


def test_the_compile_summary_shows_a_failing_cosine_as_failing():
    from vlmprune.compiler.api import CompileResult
    from vlmprune.compiler.cli.render import compile_lines
    from vlmprune.compiler.bundle.manifest import Manifest

    manifest = Manifest({"model": {}, "method": {"name": "none"}, "target": {},
                         "parity": {"stages": {"export": {"passed": False, "runtime": "ort", "precision": "fp32",
                                                          "cosine_min": 0.999989996, "max_abs": 1.00004e-4}}}})
    lines = compile_lines(CompileResult("b", manifest, None, 1.0))
    assert "parity export     FAIL  cosine 0.999989996, max-abs 0.000100004" in lines


def test_check_says_where_its_files_went_and_json_stays_alone(checked, tmp_path):
    bundle, _, _ = checked
    html, xml = tmp_path / "r.html", tmp_path / "j.xml"
    result = _run("check", bundle, "--report", html, "--junit", xml, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"]  # stdout: the JSON only
    assert result.stderr.splitlines()[-2:] == [f"report written to {html}", f"JUnit written to {xml}"]
    assert html.is_file() and xml.is_file()


def test_an_internal_error_exits_3_not_parity_failed_1(capsys):
    from vlmprune.compiler.cli.boundary import one_line_errors

    def broken():
        return 1 // None

    with pytest.raises(SystemExit) as exited:
        one_line_errors(broken)()
    assert exited.value.code == 3
    assert capsys.readouterr().err.startswith("error: internal error (TypeError: unsupported operand type(s) for //")


def test_reports_print_the_scale_relative_max_abs_bound():
    """A trained model's features (largest magnitude 108): 1.08e-4 passes 1e-4 + 1e-5 x 108, and every report says
    what bound it was held to."""
    from vlmprune.compiler import parity
    from vlmprune.compiler.api import CompileResult
    from vlmprune.compiler.cli.render import compile_lines, stage_line

    ref = np.zeros((1, 2, 4))
    ref[0, 0, 0] = 108.0
    cand = ref.copy()
    cand[0, 1, 1] = 1.08e-4
    stage = parity.run_stage("export", "ort", "fp32", lambda x: {"image_features": cand}, np.zeros(1),
                             parity.reference.Reference({"image_features": ref}))
    assert stage.passed
    data = stage.to_json()
    assert data["outputs"]["image_features"]["max_abs_bound"] == pytest.approx(1.18e-3)
    assert data["tolerance"]["scale_rel"] == 1e-5
    row = [r for r in report.figure_rows(stage) if r["figure"] == "max-abs"][0]
    assert row["tolerance"] == "≤ 0.0001 + 1e-05 × 108 (max|ref|) = 0.00118" and row["passed"]
    xml = report.junit_xml(ParityReport({}, [stage]), Manifest({"target": {"name": "ort"}, "method": {"summary": "cls"},
                                                         "model": {"source": "m"}, "vlmprune_version": "0"}), "b", 1.0)
    assert "1e-05 × 108 (max|ref|)".encode() in xml
    assert stage_line(stage) == "export     PASS  cosine_min 1, max_abs 0.000108 (≤ 0.00118)"
    manifest = Manifest({"model": {}, "method": {"name": "none"}, "target": {},
                         "parity": {"stages": {"export": parity.stage_summary(stage)}}})
    assert "parity export     PASS  cosine 1, max-abs 0.000108 (≤ 0.00118)" in compile_lines(CompileResult("b", manifest, None, 1))


def test_check_quiet_failure_names_its_figure_and_bound(checked):
    bundle, _, _ = checked
    bad = _run("check", bundle, "-q", "--atol", "image_features:0")
    assert bad.exit_code == 1
    line = next(s for s in bad.stdout.splitlines() if s.startswith("rewritten"))
    assert re.fullmatch(r"rewritten  FAIL  cosine_min \S+, max_abs \S+ \(≤ 0\), index_agreement 1"
                        r"  \(failing: image_features\)", line), bad.stdout


@pytest.mark.parametrize("own", ["random keep (baseline): 32 patches drawn at seed 0",
                                 "uniform grid (baseline): 32 patches",
                                 "probe attention (pooling head): top 32 + 1 summary"])
def test_the_compile_summary_keeps_a_methods_own_parenthesis_and_its_k(own):
    """The summaries of random, grid and SigLIP's probe once said no K (`576 patch tokens -> random keep (at the
    tower's end, after block 5/5)`): the line was cut at the method's own first parenthesis, not at the one the
    pipeline adds."""
    from vlmprune.compiler.api import CompileResult
    from vlmprune.compiler.cli.render import compile_lines
    from vlmprune.compiler.bundle.manifest import Manifest

    method = {"name": "random", "summary": f"{own} (after block 5/5, 576 patch tokens)", "site": "block",
              "layer": 5, "num_blocks": 5, "num_patches": 576, "params": {"keep": 32}}
    manifest = Manifest({"model": {}, "method": method, "target": {}, "parity": {"stages": {}}})
    lines = compile_lines(CompileResult("b", manifest, None, 1.0))
    assert lines[0] == f"tokens: 576 patch tokens -> {own} (at the tower's end, after block 5/5)", lines


@pytest.mark.parametrize("name", ["random", "grid"])
def test_the_baselines_say_their_k_and_leave_where_to_the_pipeline(name):
    """Their line said `after block L`, a letter, beside the pipeline's own `(after block 5/5, ...)`."""
    from vlmprune.passes.methods import get_method

    method = get_method(name)
    said = method.describe(method.parse(32, {}))
    assert "32 patches" in said and "block L" not in said, said
