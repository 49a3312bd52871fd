"""`vlmprune check` as a call: a bundle's parity re-run against a freshly loaded PyTorch reference.

A failing stage is data (the ParityReport's `passed`), not an exception: a CI script reads the figures, the CLI
prints them and exits 1; the --report / --junit files are written here so that a script gets them too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vlmprune.compiler import pictures
from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.bundle.output_files import check_output_file, write_file
from vlmprune.compiler.contract import KEPT
from vlmprune.compiler.errors import InputError, option
from vlmprune.compiler.parity import ParityReport, parse_overrides
from vlmprune.compiler.pipeline import check_bundle
from vlmprune.targets import require_engine


def _tolerance_specs(value) -> tuple[str, ...]:
    """A tolerance keyword as check's repeated option: VALUE or OUTPUT:VALUE strings (a number is VALUE)."""
    if value is None:
        return ()
    values = [value] if isinstance(value, (str, int, float)) else list(value)
    return tuple(str(v) for v in values)


def check(bundle: str | Path, *, batch: int | None = None, atol=(), rtol=(), cosine=(), engine: bool = False,
          model: str | None = None, cache: bool = True, report: str | Path | None = None,
          junit: str | Path | None = None, force: bool = False, progress: Progress = None) -> ParityReport:
    """Re-run BUNDLE's parity against a freshly loaded PyTorch reference (`vlmprune check`).

    atol / rtol / cosine: a number for every value output, or "OUTPUT:VALUE" strings (repeatable, as
    the CLI's options). report: also write an .html page or .json data there; junit: a JUnit .xml.
    engine: require the target's device-engine stage. Returns the ParityReport (report.passed, its
    stages, report.to_json() as --json prints it); a failing stage is data, not an exception.
    Raises InputError for bad options, a modified bundle or a moved/changed source.
    """
    atol, rtol, cosine = _tolerance_specs(atol), _tolerance_specs(rtol), _tolerance_specs(cosine)
    if report:
        check_output_file(report, force, (".html", ".htm", ".json"), option("--report"))
        if Path(report).suffix.lower() != ".json":
            pictures.require_pillow()
    if junit:
        check_output_file(junit, force, (".xml",), option("--junit"))
    if report and junit and Path(report).resolve() == Path(junit).resolve():
        raise InputError(f"{option('--report')} and {option('--junit')} name the same file")
    tolerances = None
    if atol or rtol or cosine:
        outputs = Manifest.load(bundle, verify=False).output_names
        tolerances = parse_overrides({"atol": atol, "rtol": rtol, "cosine": cosine},
                                     [o for o in outputs if o != KEPT], [KEPT])
    required = None  # engine: the stage the bundle's target names for its device engine
    if engine:
        required = require_engine(Manifest.load(bundle, verify=False).target.name, bundle)
    started = time.perf_counter()
    result = check_bundle(bundle, batch, reporter(progress), tolerances, model, cache=cache)
    seconds = time.perf_counter() - started
    if required and required not in [s.stage for s in result.stages]:
        raise InputError(f"the {required} stage did not run (see the progress lines above)")
    if report or junit:
        from vlmprune.compiler import report as reports

        data = result.to_json()
        manifest = Manifest.load(bundle, verify=False)  # check_bundle verified it
        name = Path(bundle).resolve().name
        if report and Path(report).suffix.lower() == ".json":
            write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
        elif report:
            write_file(report, reports.html_report(result, manifest, name, reports.parity_images(result))
                       .encode(), force)
        if junit:
            write_file(junit, reports.junit_xml(result, manifest, name, seconds), force)
    return result
