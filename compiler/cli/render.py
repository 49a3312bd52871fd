"""The lines the CLI prints of the API's results: the CLI's own business, so that the API returns data.

One function per result (compile_lines, run_lines, ...); each is what its command prints on stdout without --json.
The tests hold the CLI's output to these (tests/compiler/test_api.py) and these to their figures.
"""

from __future__ import annotations

from vlmprune.compiler import benchmark as bench
from vlmprune.compiler.api import (CompareResult, CompileResult, EvalResult, InspectResult, Manifest, MethodInfo,
                                   RunResult, TargetInfo, TargetListing)
from vlmprune.compiler.api.running import is_small
from vlmprune.compiler.bundle.manifest import MethodSection
from vlmprune.compiler.contract import FEATURES, KEPT
from vlmprune.compiler.parity import (DEFAULT_TOLERANCES, ParityReport, StageResult, figure_text, stage_summary,
                                      summary_bounds)
from vlmprune.targets import placement

# ---------------------------------------------------------------------- compile


def compile_lines(result: CompileResult) -> list[str]:
    """The summary `vlmprune compile` prints: tokens in and out, each parity stage's figures, placement."""
    manifest, method = result.manifest, result.manifest.method
    out = []
    counts = manifest.model.token_counts
    if counts:  # a merging tower: its patches are not the tokens the LLM sees
        out.append(_counts_line(counts, manifest.model.merged_grid_thw, manifest.model.video_frames))
    if not method.pruned:
        out.append("tokens: dense (no pruning)")
    elif method.site == "block":
        where = (f"at the tower's end, after block {method.layer}/{method.num_blocks}"
                 if method.layer == method.num_blocks else
                 f"after block {method.layer}/{method.num_blocks}; " + _later(method))
        steps = method.steps
        if steps:  # --schedule: every step
            where = ("progressive, " + ", ".join(f"{s['keep']} after block {s['layer']}" for s in steps)
                     + f" of {method.num_blocks}" + ("" if method.layer == method.num_blocks else
                                                     "; " + _later(method)))
        out.append(f"tokens: {_tokens_in(method, 'patch tokens')} -> {_own_summary(method)} ({where})")
    else:
        out.append(f"tokens: {_tokens_in(method, 'tokens')} -> {_own_summary(method)} "
                   "(on the projector output)")
    out += [manifest_stage_line(name, stage) for name, stage in manifest.parity.stages.items()]
    if manifest.llm_graphs:
        out.append(llm_parity_line(manifest.llm_graphs))
    out += placement_summary(manifest)
    out.append(f"bundle: {result.bundle} ({result.seconds:.1f}s)")
    return out


def _counts_line(counts: dict, grid_thw: list[int], frames: int | None) -> str:
    """A merging tower's grids: an image's patches merged into tokens; a clip's per frame (a tower that pools each
    frame, LLaVA-NeXT-Video: t = F) or per temporal patch (Qwen's, two frames in one token: t = F/2)."""
    t, h, w = grid_thw
    merge, how = counts["spatial_merge"], "pooled" if counts.get("pool") else "merged"
    line = (f"image {counts['image_size']}x{counts['image_size']}: {counts['patch_grid'][0]}x"
            f"{counts['patch_grid'][1]} = {counts['patches']} patches, {how} {merge}x{merge} into {h}x{w}")
    if counts.get("slices"):  # a sliced image (MiniCPM-V --grid): the slices' grid, then the source image's tokens
        return line + (f" = {counts['tokens']} tokens per slice, {counts['slices']} slices + the source image's "
                       f"{counts['source_tokens']}: {counts['image_tokens']} tokens")
    if not frames:
        return line + f" = {counts['tokens']} tokens"
    if t == frames:
        return line + f" per frame: a clip of {frames} frames, {counts['tokens']} tokens"
    return line + f" per temporal patch: a clip of {frames} frames, {t} temporal patches, {counts['tokens']} tokens"


def timing_lines(result: CompileResult) -> list[str]:
    """`compile --timings`: seconds, share and peak RSS per stage of this compile (compiler.pipeline.timings)."""
    from vlmprune.compiler.pipeline.timings import table

    return table(result.timings)


def _later(method: MethodSection) -> str:
    n = method.num_blocks - method.layer
    return (f"the {n} later blocks run on {method.tokens_out} tokens" if n > 1 else
            f"the last block runs on {method.tokens_out} tokens")


def _own_summary(method: MethodSection) -> str:
    """The method's own line, without the " (where, N patch tokens)" the pipeline appends to it: the last
    parenthesis only, as the method's line may hold its own ("random keep (baseline): 32 patches ...")."""
    return method.summary.rsplit(" (", 1)[0]


def _tokens_in(method: MethodSection, noun: str) -> str:
    """The tokens the method ranks: N, or an anyres image's C crops of N each (num_patches is per crop)."""
    n, crops = method.num_patches, method.params.get("crops")
    return f"{crops['count'] * n} {noun} ({crops['count']} crops x {n})" if crops else f"{n} {noun}"


def manifest_stage_line(name: str, stage: dict) -> str:
    """One parity stage of the manifest in figures, each held to its precision's defaults (as compile holds it)."""
    figures = []
    default = DEFAULT_TOLERANCES.get(stage.get("precision"))
    bounds = summary_bounds(default) if default else {}
    if "cosine_min" in stage:
        figures.append(f"cosine {figure_text(stage['cosine_min'], 7, **bounds.get('cosine_min', {}))}")
    if "max_abs" in stage:
        bound = stage.get("max_abs_bound")  # the stage's own (scale-relative) bound; absent in older manifests
        held = {"at_most": bound} if bound is not None else bounds.get("max_abs", {})
        figures.append(f"max-abs {figure_text(stage['max_abs'], 3, **held)}"
                       + (f" (≤ {bound:.3g})" if bound is not None else ""))
    if "index_agreement" in stage:
        figures.append(f"kept-index agreement "
                       f"{figure_text(stage['index_agreement'], 4, **bounds.get('index_agreement', {}))}")
        if stage.get("tie_resolved_images"):
            images = ", ".join(map(str, stage["tie_resolved_images"]))
            why = ("it diverges at a greedy step whose two best candidates tie" if "first_divergent_step" in stage
                   else "every differing index lies in the K-th boundary tie band")
            many = len(stage["tie_resolved_images"]) > 1
            why = why.replace("it diverges", "they diverge") if many else why
            figures.append(f"image{'s' if many else ''} {images}: {why}")
    if compared_text(stage):
        figures.append(compared_text(stage))
    status = "PASS" if stage["passed"] else "FAIL"
    return f"parity {name:<10} {status}  {', '.join(figures)}" + (f"  {stage['error']}" if "error" in stage else "")


def llm_parity_line(llm: dict) -> str:
    """The language model's compile-time check, in its exporter's figures (`check` repeats it as stage llm)."""
    from vlmprune.compiler.llm.export import parity_figures

    passed, figures = parity_figures(llm)
    return f"parity {'llm':<10} {'PASS' if passed else 'FAIL'}  {', '.join(figures)}"


def placement_summary(manifest: Manifest) -> list[str]:
    """Per graph, how much of it the target placed where (targets that report placement), one line each."""
    return [placement.summary_line(name, summary)
            for name, summary in manifest.target.get("placement_summary", {}).items()]


# ---------------------------------------------------------------------- check


def check_lines(report: ParityReport) -> list[str]:
    """What `vlmprune check` prints: one line per stage, its verdict and figures against their bounds (the report
    is the parity package's data; -q leaves only these lines)."""
    return [stage_line(stage) for stage in report.stages]


def summary_figures(summary: dict, bounds: dict, digits: int = 6, names: dict | None = None) -> list[str]:
    """stage_summary()'s figures as text, each failing one reading as failing, max-abs with the bound it was held
    to (an absolute floor plus a term of the output's scale, so the bound differs per output and stage)."""
    figures = []
    for key, value in summary.items():
        if not isinstance(value, float) or key == "max_abs_bound":
            continue
        text = f"{(names or {}).get(key, key)} {figure_text(value, digits, **bounds.get(key, {}))}"
        if key == "max_abs" and summary.get("max_abs_bound") is not None:
            text += f" (≤ {summary['max_abs_bound']:.4g})"
        figures.append(text)
    return figures


def compared_text(summary: dict) -> str:
    """What image_features' figures were taken over, where the kept sets differ: the tokens both sides kept."""
    images = summary.get("images_on_common_tokens")
    if not images:
        return ""
    return (f"features over {summary.get('rows_compared', '?')} rows; image{'s' if len(images) > 1 else ''} "
            f"{', '.join(map(str, images))} on the tokens both sides kept")


def stage_line(stage: StageResult, width: int = 10) -> str:
    """One stage's record in a line: its verdict, its figures against their bounds, and what failed (`check`'s lines,
    and the progress lines of `compile` and `check`)."""
    s = stage_summary(stage)
    bounds = summary_bounds(stage.tolerance, stage.outputs.get(FEATURES))
    line = f"{stage.stage:<{width}} {'PASS' if stage.passed else 'FAIL'}  {', '.join(summary_figures(s, bounds))}"
    compared = compared_text(s)
    if compared:
        line += f" ({compared})"
    if stage.error:
        return line.rstrip() + f"  ({stage.error})"
    failing = [name for name, out in stage.outputs.items() if not out.get("passed", True)]
    if stage.indices and not stage.indices.get("passed", True):
        failing.insert(0, KEPT)
    if not stage.passed and failing:
        line = line.rstrip() + f"  (failing: {', '.join(failing)})"
    return line.rstrip()


# ---------------------------------------------------------------------- progress


def progress_line(item: str | StageResult) -> str:
    """What the CLI prints on stderr of one progress item: a line as it is; a parity stage's record (run_parity sends
    one as each stage ends) as its stage_line, indented under "parity"."""
    return item if isinstance(item, str) else "  " + stage_line(item)


# ---------------------------------------------------------------------- run, compare, inspect


def run_lines(result: RunResult) -> list[str]:
    """What `vlmprune run` prints: the runtime, each output's shape, image 0's kept indices, the figures."""
    out = [f"({result.runtime})"]
    out += [f"{name}: shape {list(value.shape)} dtype {value.dtype}"
            + (f", value {value.tolist()}" if is_small(value) else "") for name, value in result.outputs.items()]
    if result.kept is not None:
        out.append("kept (image 0): " + " ".join(map(str, result.kept[0].tolist())))
    if result.benchmark is not None:
        out += bench.format_benchmark(result.benchmark, result.runtime)
    if result.saved_outputs:
        out.append(f"outputs written to {result.saved_outputs}")
    if result.show:
        out.append(f"picture written to {result.show}")
    return out


def compare_lines(result: CompareResult) -> list[str]:
    return [f"{result.pictures} picture{'' if result.pictures == 1 else 's'} written to {result.output}"]


def inspect_lines(result: InspectResult) -> list[str]:
    """The manifest readably: target, toolchain, model, method, inputs and outputs, parity, files, placement."""
    from vlmprune.compiler.ops import op_lines

    m, t = result.manifest, result.manifest.target
    out = [f"vlmprune {m.version} bundle: {result.bundle}",
           f"target:   {t.name} — {t.summary}",
           "toolchain: " + ", ".join(f"{k} {v}" for k, v in t.toolchain.items()),
           f"model:    {m.model.source} ({m.model.kind}, sha256 {m.model.sha256[:16]}…)",
           f"method:   {m.method.summary}"]
    for kind, tensors in (("input", m.inputs), ("output", m.outputs)):
        out += [f"{kind:<9} {io.name} {io.shape} {io.dtype}" for io in tensors]
    out.append(f"parity:   {'PASS' if m.parity.passed else 'FAIL'} ({', '.join(m.parity.stages)})")
    out.append("files:")
    out += [f"  {name:<28} {digest[:16]}…" for name, digest in m.files.items()]
    for name, rows in result.placement.items():
        out.append(f"placement of {name} ({len(rows)} ops):")
        out += placement.table(rows)
    out += placement_summary(m)
    if result.ops is not None:
        out.append(f"ops of model.onnx ({len(result.ops)}):")
        out += op_lines(result.ops, bool(t.get("placement")))
    return out


# ---------------------------------------------------------------------- eval


def eval_lines(result: EvalResult) -> list[str]:
    """The table `vlmprune eval` prints, and what it was measured over."""
    from vlmprune.compiler.evaluate import table

    data = result.data
    if "dataset" in data:
        from vlmprune.compiler.accuracy import table as accuracy_table

        return accuracy_table(data)
    starts = sorted(set(data["image_start"]))
    inputs = f"clips of {data['video_frames']} frames" if data.get("video_frames") else "images"
    return [*table(data),
            f"({len(data['images'])} {inputs} x {len(data['prompts'])} prompts; dense: "
            f"{data['dense_image_tokens']} image tokens; harness check KL {data['harness_kl_max']:.2g})",
            f"(the image starts at prompt token {', '.join(map(str, starts))}: FastV's --image-start for "
            f"{'these prompts' if len(starts) == 1 else 'the prompts, in order of value'})"]


# ---------------------------------------------------------------------- listings


def method_lines(info: MethodInfo) -> list[str]:
    """One method of `vlmprune methods`: its summary, needs, families, options, and each target's way with it."""
    out = [f"{info.name}: {info.summary}", f"  needs:    {info.needs}", f"  serves:   {info.serves}"]
    out += [f"  --{option.replace('_', '-')}: {text}" for option, text in info.options.items()]
    out.append("  targets:  " + ", ".join(info.targets))
    if info.official:
        out.append(f"  official: {info.official}")
    return out


def unavailable_lines(unavailable: dict[str, str]) -> list[str]:
    """The lines `vlmprune methods` ends with: the trained networks refused by name, and why."""
    return ["not available (trained weights that do not exist here):",
            *(f"  {name}: {why}" for name, why in unavailable.items())]


def target_line(info: TargetInfo) -> str:
    state = ("planned (not in this version)" if info.available is None else
             "available" if info.available else "unavailable: " + info.why)
    return f"{info.name:<8} {state:<40} {info.summary}"


def targets_lines(listing: TargetListing) -> list[str]:
    """`vlmprune targets`: the table, the targets' own lines, the --with-llm exporters."""
    return [*(target_line(t) for t in listing.targets), *listing.notes, "--with-llm (the language model):",
            *listing.llm]
