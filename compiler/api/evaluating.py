"""`vlmprune eval` as a call: pruned against dense on the model's own LLM, on images and prompts (first-token KL,
greedy agreement) or on a dataset (exact-match accuracy on compiled bundles)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from vlmprune.compiler.api.options import Progress, reporter
from vlmprune.compiler.bundle.output_files import check_output_file, write_file
from vlmprune.compiler.errors import InputError, option
from vlmprune.passes.methods import DEFAULT_METHOD
from vlmprune.targets import HOST_TARGET, get_target

EVAL_KEEP = 64  # eval's K where neither --keep nor --bundle gives one


@dataclasses.dataclass
class EvalResult:
    """`vlmprune eval`'s report: per method and K (and per bundle), first-token KL and answer agreement."""

    data: dict  # the report as --json prints it: rows, and what they were measured over (images and prompts, or a dataset)
    report: Path | None = None

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def to_json(self) -> dict:
        return self.data


def eval(model: str, *, images: str | Path | None = None, prompts: str | Path | None = None,
         methods: Iterable[str] | None = None, keeps: Iterable[int] | None = None, bundles: Iterable[str | Path] = (),
         max_new_tokens: int | None = None, image_size: int | None = None, grid: str | None = None,
         report: str | Path | None = None, force: bool = False, progress: Progress = None,
         dataset: str | Path | None = None, limit: int | None = None, layers: Iterable = (),
         target: str | None = None, target_options: dict | None = None, ray: str | None = None,
         ray_workers: int | None = None, store: str | Path | None = None, bar: bool | None = None,
         reference: bool = False, video: Iterable[str | Path] = (), prompt: Iterable[str] = (),
         video_frames: int | None = None) -> EvalResult:
    """Pruned against dense on MODEL's own LLM (`vlmprune eval`).

    MODEL may be a compiled bundle instead (images, prompts or clips): its source model answers, the bundle is a
    bundles row (`eval BUNDLE --video PATH --prompt TEXT`).
    video (clips: folders of frames or video files) in place of images, for video bundles (compile --video-frames
    F); prompt (texts, each a prompt) in place of prompts. A dataset whose rows name videos needs video_frames: its
    bundles are compiled for clips of that many frames.

    Two modes. images (a directory) and prompts (a text file, one prompt a line): per method and K,
    first-token KL and greedy agreement against dense; methods and keeps (each item a value or a comma
    list, as the CLI's options) default to cls and 64 unless bundles (compiled from MODEL) are given.
    dataset (JSON Lines of image, question, answers; the first `limit`): exact-match accuracy per
    method x K x layer (ints, or "end") beside dense, random keep and a uniform grid, each compiled once
    for target and run as a bundle; cells kept in store (default under $VLMPRUNE_CACHE/quality/), run
    here or on the Ray cluster at `ray` ("auto" or an address) with at most ray_workers actors.
    target_options (dataset only): the target's own options, as `compile` takes them (ort: precision,
    calibration), so that e.g. an int8 sweep's bundles are the int8 ones a user deploys.
    report: also write the report as .json or .html. Returns an EvalResult. Raises InputError for bad input.
    reference (images and prompts): a bundle compiled --with-llm answers with the checkpoint's language model in
    transformers, not its own LLM graphs (each row's `llm` says which answered).
    """
    if report:
        check_output_file(report, force, (".json", ".html", ".htm"), option("--report"))
    if dataset is not None and reference:
        raise InputError(f"{option('--reference', 'reference')} applies to eval --bundle rows (--images, --prompts): "
                         "the --dataset sweep's bundles hold no language model")
    video, prompt = [Path(v) for v in video or ()], [str(p) for p in prompt or ()]
    if dataset is not None:
        clash = [option(*names) for names, value in ((("--video", "video"), video), (("--prompt", "prompt"), prompt))
                 if value]
        if clash:
            raise InputError(f"{option('--dataset')} takes its clips and questions from its rows; drop "
                             f"{', '.join(clash)}")
        if _bundle_dir(model):
            raise InputError(f"{option('--dataset')} measures accuracy on bundles it compiles itself: pass the MODEL "
                             f"they are compiled from, not the bundle {model}")
        data = _eval_dataset(model, dataset, methods, keeps, bundles, images, prompts, max_new_tokens, limit, layers,
                             target, target_options, ray, ray_workers, store, progress, bar, image_size, grid,
                             video_frames)
    else:
        from vlmprune.compiler.evaluate import evaluate
        from vlmprune.compiler.bundle import load_manifest as load_bundle_manifest
        from vlmprune.compiler.generate import default_model

        given = [option(*names) for names, value in ((("--limit",), limit), (("--layer", "layers"), layers or None),
                                                     (("--ray",), ray), (("--ray-workers",), ray_workers),
                                                     (("--store",), store),
                                                     (("--video-frames", "video_frames"), video_frames)) if value]
        given += [option(f"--{name.replace('_', '-')}", f"target_options[{name!r}]") for name in target_options or {}]
        if given or target is not None:
            raise InputError(f"{', '.join(given) or option('--target')} applies to eval {option('--dataset')} only"
                             + (" (a clip's frames are its bundle's)" if video_frames else ""))
        for first, second in (((images, "--images", "images"), (video, "--video", "video")),
                              ((prompts, "--prompts", "prompts"), (prompt, "--prompt", "prompt"))):
            if first[0] and second[0]:
                raise InputError(f"{option(*first[1:])} and {option(*second[1:])}: give one of them")
        if (images is None and not video) or (prompts is None and not prompt):
            raise InputError(f"eval needs {option('--dataset FILE.jsonl', 'dataset')}, or "
                             f"{option('--images DIR', 'images')} (or {option('--video PATH', 'video')}) and "
                             f"{option('--prompts FILE', 'prompts')} (or {option('--prompt TEXT', 'prompt')})")
        bundles = [Path(b) for b in bundles]
        if _bundle_dir(model):  # eval BUNDLE: its source model answers, the bundle is a row
            bundles = [Path(model), *bundles]
            model = default_model(load_bundle_manifest(model, verify=True))
        if not bundles:
            methods, keeps = methods or (DEFAULT_METHOD,), keeps or (EVAL_KEEP,)
        methods, keeps = _comma_list(methods or ()), _comma_list(keeps or (), int, option("--keep", "keeps"))
        data = evaluate(model, None if images is None else Path(images), None if prompts is None else Path(prompts),
                        methods, keeps, max_new_tokens or 8, reporter(progress), bundles, image_size, grid, reference,
                        video, prompt)
    if report and Path(report).suffix.lower() == ".json":
        write_file(report, (json.dumps(data, indent=2) + "\n").encode(), force)
    elif report:
        from vlmprune.compiler.report import eval_html, quality_html

        write_file(report, (quality_html(data) if dataset is not None else eval_html(data)).encode(), force)
    return EvalResult(data, Path(report) if report else None)


def _bundle_dir(model) -> bool:
    """Whether eval's MODEL names a compiled bundle (a folder with its manifest) rather than a checkpoint."""
    from vlmprune.compiler.contract import MANIFEST

    return Path(str(model)).is_dir() and (Path(str(model)) / MANIFEST).is_file()


def _eval_dataset(model, dataset, methods, keeps, bundles, images, prompts, max_new_tokens, limit, layers, target,
                  target_options, ray, ray_workers, store, progress, bar, image_size, grid, video_frames) -> dict:
    from vlmprune.compiler.accuracy import evaluate_dataset
    from vlmprune.compiler.quality.executors import InProcess, RayExecutor

    clash = [option(*names) for names, value in ((("--images",), images), (("--prompts",), prompts),
                                                 (("--bundle", "bundles"), list(bundles))) if value]
    if clash:
        raise InputError(f"{option('--dataset')} measures accuracy on bundles it compiles itself; drop "
                         f"{', '.join(clash)}")
    if ray_workers is not None and ray is None:
        raise InputError(f"{option('--ray-workers')} needs {option('--ray auto|ADDRESS', 'ray')}")
    target = target or HOST_TARGET
    get_target(target)  # one line for an unknown target, before any work
    executor = RayExecutor(ray, ray_workers) if ray is not None else InProcess()
    return evaluate_dataset(model, Path(dataset), _comma_list(methods or (DEFAULT_METHOD,)),
                            _comma_list(keeps or (EVAL_KEEP,), int, option("--keep", "keeps")), list(layers or ()), limit=limit,
                            target=target, target_options=target_options, max_new_tokens=max_new_tokens or 4,
                            store=Path(store) if store else None, executor=executor, progress=reporter(progress), bar=bar,
                            video_frames=video_frames, family_options={"image_size": image_size, "grid": grid})


def _comma_list(values, kind=str, what="value") -> list:
    """Values as eval's repeatable options take them: each one a value or a comma list of values."""
    out = []
    for value in values:
        for part in str(value).split(","):
            if part.strip():
                try:
                    out.append(kind(part.strip()))
                except ValueError:
                    raise InputError(f"{what} {part.strip()!r} is not an integer") from None
    return out
