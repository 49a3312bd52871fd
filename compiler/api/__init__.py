"""vlmprune's Python API: each `vlmprune` command as one call that returns a typed result.

A CI script or a notebook calls these instead of shelling out, and the CLI (compiler/cli/)
is a thin layer over them: it parses options, calls one function here and prints the
result (its lines, compiler/cli/render.py, or its `to_json()` for --json). Options are keyword-only with the
CLI's defaults. Bad input raises vlmprune.compiler.errors.InputError (a VlmpruneError) with
the message the CLI prints after `error:`, the options in it named as this API's keywords
(`force=True` where the CLI says `--force`: compiler.errors.option); a failing parity figure is data (`passed`), not
an exception. `progress`, where taken, receives what a command sends while it works: the lines the CLI prints on
stderr (progress, notes and warnings) and, as each parity stage of `compile` and `check` ends, that stage's record
(a `StageResult`, data like the report's: the CLI prints it as render.stage_line); None drops them.

    from vlmprune.compiler import api
    bundle = api.compile("demo", "build/demo", keep=64)
    report = api.check(bundle.bundle)
    result = api.run(bundle.bundle, images=["photo.jpg"], benchmark=True)
    print(report.passed, result.kept[0][:8], result.benchmark["latency_ms"]["p50"])

(README.md's example; tests/compiler/test_api.py runs it.) One module per command (compiling,
checking, running, comparing, inspecting, generating, evaluating; listings: methods and targets;
contributed: the targets' own commands, build-engine), what they share in options; this package
re-exports their public names. The CLI's own error boundary (`tracking`, `interrupted_line`) is
re-exported here so that the CLI needs nothing else. Nothing here imports the CLI.
"""

from __future__ import annotations

from vlmprune.compiler.api.checking import check
from vlmprune.compiler.api.comparing import CompareResult, compare
from vlmprune.compiler.api.compiling import CompileResult, compile
from vlmprune.compiler.api.contributed import build_engine, target_command, target_commands
from vlmprune.compiler.api.evaluating import EVAL_KEEP, EvalResult, eval
from vlmprune.compiler.api.generating import generate, generate_json
from vlmprune.compiler.api.inspecting import InspectResult, inspect
from vlmprune.compiler.api.listings import MethodInfo, TargetInfo, TargetListing, methods, targets, unavailable_methods
from vlmprune.compiler.api.options import (QUIET_LOGGERS, Progress, declared_family_options, declared_options,
                                           declared_target_options, llm_option_texts, quiet_imports, split_options)
from vlmprune.compiler.api.running import RunResult, run
from vlmprune.compiler.bundle import interrupted_line, tracking  # noqa: F401 (the CLI's error boundary)
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.parity import ParityReport
from vlmprune.passes.methods import DEFAULT_METHOD
from vlmprune.targets import DEFAULT_TARGET

__all__ = ["CompileResult", "InspectResult", "Manifest", "ParityReport", "RunResult", "EvalResult", "CompareResult",
           "MethodInfo", "TargetInfo", "TargetListing", "compile", "check", "run", "inspect", "eval", "compare",
           "generate", "generate_json", "methods", "unavailable_methods", "targets", "build_engine", "target_command",
           "target_commands", "declared_options", "declared_target_options", "declared_family_options",
           "split_options", "llm_option_texts", "quiet_imports", "QUIET_LOGGERS", "Progress", "EVAL_KEEP",
           "DEFAULT_METHOD", "DEFAULT_TARGET", "interrupted_line", "tracking"]
