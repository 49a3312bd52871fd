"""`vlmprune eval --dataset`: accuracy kept under pruning, measured on compiled bundles.

For every method x K x layer, and beside them dense (a --no-prune bundle), random keep and a
uniform grid at the same K and layers: one bundle, compiled once (through the product
cache; kept under $VLMPRUNE_CACHE/quality/bundles/ by the key of its setting) and run by its
target's runner here. Its tower gives the image tokens, the checkpoint's own language model
answers greedily, and the answer is scored by exact match against the sample's accepted
answers. So an accuracy here is the bundle's, not the method reference's.

Layers: an integer L prunes after block L (the methods that prune inside the tower: cls,
visionzip, and the baselines with --site block); `end` prunes at the tower's end (those
methods at the feature layer; divprune and dart, which only prune there; the baselines on
the projector output). A method that only prunes at the end is run once however many
layers are asked for. A progressive place, blocks joined by `/` (`--layer 2/4/6`), prunes in
steps after each (--schedule, passes.methods.schedule; the last step keeps K, the counts
before it geometric from N to K), labelled "progressive 2→4→6"; the baselines stand beside it
after its last block. `-m cls:schedule=2/4/6` is the same place given as the method's option. A
method that merges inside the blocks (Method.in_blocks: tome) has its block range (`tome:blocks=1-4`)
as its place, "in blocks 1-4" or "in every block": it is run once whatever layers are asked for,
and no random keep stands at that place (compare it by its tower speedup).

A dataset of clips (its rows name a `video`: a folder of frames or a video file) is swept on video bundles:
every bundle compiled for clips of `--video-frames F` (the family's own option, as `compile` takes it), each
clip sampled to F frames as `run --video` samples it (Family.load_video), the dense row the same clip unpruned.
The methods must be ones a video bundle takes (evs, dycoke, ...; `compile` refuses the others in one line).

A prompt-aware bundle (a `text_embeds` input: cdpruner, dart --text-pivots, --prompt-weight)
gets each sample's question as its prompt, the question's non-image token rows of the
checkpoint's embedding table, as `generate` feeds it (compiler.prompt.bundle_feed); its
tower then runs once per question rather than once per image.

The cells (setting x sample) live in a store (quality.store, SQLite, default
$VLMPRUNE_CACHE/quality/results.sqlite) keyed by the model's content hash, the method and
its version, its parameters, K, the layer, the target and --max-new-tokens, and for a
prompt-aware bundle by how the prompt is fed (compiler.prompt.FEED); a sample's digest
holds its image, question and answers, so each question is its own cell: an interrupted
sweep computes only what is missing, and a changed model or method never reads old rows.
The cells run in this process, or on a Ray cluster (`--ray`), each worker holding one
loaded bundle and model.

Every row is scored overall and, where the dataset's samples carry a `type`, per type, each
with the majority-answer baseline of those samples; and against random keep at the same K and
place, as a paired difference with its bootstrap interval (DESIGN: a difference counts only
where that interval excludes 0). Retained is null, not NaN, where dense answers nothing right
(nothing to retain): the report is strict JSON, and the table and page say why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from pathlib import Path

from vlmprune.compiler.bundle import Resumable, record_complete, summarised
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.quality import stats
from vlmprune.compiler.quality.dataset import read_dataset
from vlmprune.compiler.quality.store import Store
from vlmprune.compiler.quality.sweep import Setting, run_sweep, setting_key, stored

END = "end"
IN_BLOCKS = "blocks"  # the place of a method that merges inside the blocks (Method.in_blocks): its block range
UNTYPED = "(no type)"  # the per-type group of a typed dataset's samples that carry none
NO_RETAINED = "dense accuracy is 0 on these samples: nothing to retain"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One bundle of the sweep: what `compile` is asked for, and how the table names it."""

    method: str | None  # None: dense
    keep: int | None
    layer: int | str | None  # an int L (after block L), END, IN_BLOCKS, or None (dense)
    method_options: dict

    @property
    def label(self) -> str:
        """The table's name: the method, and its options as given (`cls budget=adaptive`)."""
        if self.method is None:
            return "dense"
        # the baselines' site and a --schedule: the place column
        given = {k: v for k, v in self.method_options.items() if k not in ("site", "schedule")}
        return " ".join([self.method, *(f"{k.replace('_', '-')}={v}" for k, v in sorted(given.items()))])

    @property
    def spread(self) -> bool:
        """Whether it reduces in several blocks (its place is a block range or a schedule), not at one place."""
        return self.layer == IN_BLOCKS or self.method_options.get("schedule") is not None

    @property
    def where(self) -> str:
        if self.method is None:
            return "-"
        if self.method_options.get("schedule") is not None:
            from vlmprune.passes.methods import schedule

            return "progressive " + "→".join(str(layer) for layer in schedule.layers(self.method_options))
        if self.layer == IN_BLOCKS:
            blocks = self.method_options.get("blocks")
            return f"in blocks {blocks}" if blocks else "in every block"
        return "tower end" if self.layer == END else f"after block {self.layer}"


def parse_layers(values) -> list[int | str]:
    """--layer values: integers >= 1, `end`, or a progressive place of blocks joined by `/` (2/4/6), each a value
    or a comma list; default: the tower's end."""
    from vlmprune.passes.methods import schedule

    out: list[int | str] = []
    for value in values or ():
        for part in str(value).split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part == END:
                out.append(END)
                continue
            if "/" in part:  # a progressive place: checked as --schedule is, its form kept (`/`: no comma here)
                steps = schedule.split(part)
                if len(steps) < 2 or any(a[0] >= b[0] for a, b in zip(steps, steps[1:])) or steps[0][0] < 1:
                    raise InputError(f"--layer {part!r}: a progressive place is two or more increasing blocks "
                                     "joined by / (e.g. 2/4/6)")
                out.append(part)
                continue
            try:
                layer = int(part)
            except ValueError:
                raise InputError(f"--layer {part!r} is not an integer or `end`") from None
            if layer < 1:
                raise InputError(f"--layer must be >= 1 (blocks count from 1) or `end`, got {layer}")
            out.append(layer)
    return list(dict.fromkeys(out)) or [END]


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """A --method value of eval --dataset: NAME, or NAME:OPTION=VALUE[:OPTION=VALUE...] (the method's compile
    options, spelled as their flags without the dashes: `cls:budget=adaptive`, `cls:merge=local:width=3`), so that
    one sweep holds a method with and without an option. Values read as int, then float, else text; a colon
    inside a value is kept where what follows it is no OPTION=VALUE (`cls:schedule=2:512/4:320/6:192`)."""
    name, *pieces = spec.strip().split(":")
    parts: list[str] = []
    for piece in pieces:  # a piece without `=` continues the value before it (cls:schedule=2:512/4:320/6:192)
        if parts and "=" not in piece:
            parts[-1] += ":" + piece
        else:
            parts.append(piece)
    options: dict = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise InputError(f"--method {spec!r}: options are OPTION=VALUE after a colon (e.g. cls:budget=adaptive)")
        options[key.strip().replace("-", "_")] = _option_value(value.strip())
    return name.strip(), options


def _option_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plans_for(methods: list[str], keeps: list[int], layers: list[int | str]) -> list[Plan]:
    """Dense, then every method (and the baselines) x K x layer, each checked as `compile` parses it.

    methods: names, or NAME:OPTION=VALUE specs (parse_method_spec)."""
    from vlmprune.passes.methods import BASELINES, get_method
    from vlmprune.compiler.contract import SITE_FEATURES

    if not keeps:
        raise InputError("eval --dataset needs at least one --keep")
    plans, seen = [Plan(None, None, None, {})], set()
    for spec in list(dict.fromkeys([*methods, *BASELINES])):
        name, given = parse_method_spec(spec)
        method = get_method(name)
        for keep in keeps:
            for layer in layers:
                progressive = isinstance(layer, str) and layer != END  # a place of blocks joined by /
                if method.baseline:
                    layer = last_block(layer) if progressive else layer  # beside it, after its last block
                    options = {**given, "site": "features" if layer == END else "block"}
                elif method.needs(method.parse(keep, given)).site == SITE_FEATURES:
                    layer, options = END, dict(given)
                elif method.in_blocks:  # it spans the blocks (--blocks), whatever --layer: run once
                    layer, options = IN_BLOCKS, dict(given)
                elif given.get("schedule") is not None:  # the method's own schedule is its place
                    layer, options = last_block(str(given["schedule"])), dict(given)
                elif progressive:
                    layer, options = last_block(layer), {**given, "schedule": layer}
                else:
                    options = dict(given)
                method.parse(keep, options)  # one line for a bad K or option, before any work
                plan = Plan(name, keep, layer, options)
                if (plan.label, keep, layer, plan.where) not in seen:
                    seen.add((plan.label, keep, layer, plan.where))
                    plans.append(plan)
    return plans


def last_block(place: str) -> int:
    """A progressive place's (or --schedule's) last block: the layer its bundle is compiled with."""
    from vlmprune.passes.methods import schedule

    return schedule.split(place)[-1][0]


def describe(plan: Plan, model_hash: str, target: str, max_new_tokens: int, target_options: dict,
             family_options: dict | None = None) -> dict:
    """What decides a plan's answers: the store key hashes exactly this (the family's options only where given, so
    that an image sweep's keys are what they were before clips were swept)."""
    from vlmprune.passes.methods import get_method

    out = {"model": model_hash, "target": target, "target_options": target_options, "max_new_tokens": max_new_tokens,
           "method": plan.label}
    if family_options:
        out["family_options"] = dict(sorted(family_options.items()))
    if plan.method is not None:
        method = get_method(plan.method)
        params = method.parse(plan.keep, plan.method_options)
        out.update(version=method.version, params=params, layer=plan.layer)
        if method.needs(params).text:  # a prompt-aware bundle: its answers depend on how each question is fed too
            from vlmprune.compiler.prompt import FEED

            out["text_embeds"] = FEED
    return out


def bundle_for(model: str, plan: Plan, key: str, target: str, target_options: dict, folder: Path,
               progress, family_options: dict | None = None) -> tuple[Path, bool]:
    """The plan's bundle under folder/<key>: reused when it is whole and of this model, else compiled
    (through the product cache). Returns the bundle and whether its parity passed."""
    from vlmprune.compiler.bundle import load_manifest
    from vlmprune.compiler.pipeline import CompileOptions, compile_model
    from vlmprune.passes.methods import DEFAULT_METHOD

    out = folder / key
    if (out / "manifest.json").is_file():
        try:
            manifest = load_manifest(out, verify=True)
            return out, manifest.parity.passed if manifest.parity is not None else True
        except Exception:  # a bundle that fails its own digests is rebuilt, never trusted
            shutil.rmtree(out)
    elif out.exists():
        shutil.rmtree(out)
    options = CompileOptions(target=target, prune=plan.method is not None, method=plan.method or DEFAULT_METHOD,
                             keep=plan.keep or 1, layer=plan.layer if isinstance(plan.layer, int) else None,
                             method_options=dict(plan.method_options), target_options=dict(target_options),
                             family_options=dict(family_options or {}))
    progress(f"compiling {plan.label}" + (f" K={plan.keep} ({plan.where})" if plan.method else "") + f" for {target}")
    folder.mkdir(parents=True, exist_ok=True)
    result = compile_model(model, out, options, lambda _m: None)
    return out, result.report.passed


class BundleWorker:
    """Answers chunks of samples with one bundle and its model, both loaded once (in this process or a Ray actor)."""

    def __init__(self, model: str, bundle: str, max_new_tokens: int):
        from vlmprune.compiler import generate as gen
        from vlmprune.compiler.bundle import load_manifest
        from vlmprune.compiler.prompt import text_input_dim

        self.bundle = Path(bundle)
        self.manifest = load_manifest(self.bundle, verify=True)
        self.vlm = gen.load_vlm(model, bundle=self.manifest)
        self.max_new_tokens = max_new_tokens
        self.prompted = text_input_dim(self.manifest) is not None  # a text_embeds input: each question its prompt

    def pixels(self, sample):
        """A sample's input as the bundle takes it: an image preprocessed, or a clip sampled to the bundle's frames
        (the family's load_video, as `run --video` reads one)."""
        from vlmprune.compiler import generate as gen
        from vlmprune.compiler.frontend import family_of

        family = family_of(self.manifest)
        if sample.video != family.takes_video(self.manifest):
            raise InputError(f"{sample.image}: a {'clip' if sample.video else 'still image'}, and the bundle "
                             f"{self.bundle} takes {'clips' if family.takes_video(self.manifest) else 'images'}")
        if sample.video:
            return family.load_video(self.manifest, Path(sample.image))[0]
        return gen.load_pixels(self.vlm, Path(sample.image))[0]

    def __call__(self, chunk: list) -> list[dict]:
        from vlmprune.compiler import generate as gen
        from vlmprune.compiler.prompt import bundle_feed

        out, pixel_of, tokens_of = [], {}, {}
        for sample in chunk:
            prompt = gen.build_prompt(self.vlm, sample.question)
            if sample.image not in pixel_of:  # each image (or clip) of the chunk loaded once
                pixel_of = {sample.image: self.pixels(sample)}
            # The tower once per image, or, for a prompt-aware bundle, once per question: its tokens depend on it.
            at = (sample.image, sample.question if self.prompted else None)
            if at not in tokens_of:
                feeds = bundle_feed(self.manifest, self.vlm, prompt)  # {}: a bundle without text_embeds
                tokens_of = {at: gen.bundle_tokens(self.bundle, self.manifest, pixel_of[sample.image], self.vlm,
                                                   feeds)}
            tokens = tokens_of[at]
            positions, text_start = gen.bundle_positions(tokens, len(prompt.before))
            a = gen.answer(self.vlm, prompt, tokens.features, positions, text_start, self.max_new_tokens)
            text = a.text if a.text is not None else " ".join(map(str, a.tokens))
            extra = {"image_tokens": a.image_tokens}
            if tokens.kept is not None:
                extra["kept"] = [int(i) for i in tokens.kept.reshape(-1)]
            out.append({"sample": sample.digest, "answer": text, "correct": stats.exact_match(text, sample.answers),
                        "extra": extra})
        return out


def default_store() -> Path:
    from vlmprune.kernels.build import cache_dir

    return cache_dir() / "quality" / "results.sqlite"


def evaluate_dataset(model: str, dataset: Path, methods: list[str], keeps: list[int], layers=(), *, limit=None,
                     target: str | None = None, target_options: dict | None = None, max_new_tokens: int = 4,
                     store: Path | None = None, executor=None, progress=lambda _m: None, bar: bool | None = None,
                     on_chunk=None, video_frames: int | None = None, family_options: dict | None = None) -> dict:
    """The accuracy report: dense, then per method x K x layer (and the baselines) exact match, retained, intervals.

    target: None, the host runtime (targets.HOST_TARGET), whose runner runs every bundle here.
    video_frames: a dataset of clips: the frames each bundle takes per clip (compile --video-frames F); needed
    there, refused for a dataset of images. family_options: the family's other options its bundles are compiled
    with, as `compile` takes them (--image-size, --grid)."""
    from vlmprune.compiler import generate as gen
    from vlmprune.compiler.quality.executors import InProcess
    from vlmprune.targets import HOST_TARGET

    target = target or HOST_TARGET

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    target_options = dict(target_options or {})
    samples = read_dataset(dataset, limit)
    video = samples[0].video
    family_options = {**{k: v for k, v in (family_options or {}).items() if v is not None},
                      **clip_options(samples, video_frames, dataset)}
    plans = plans_for(methods, keeps, parse_layers(layers))
    executor = executor or InProcess()
    store = Store(store or default_store())
    try:
        # the content hash keys every cell; one line for a model eval cannot run (or one that takes no clips)
        source = gen.load_vlm(model, options=family_options).source
        for keep in keeps if not video else ():  # before any compile (a clip's K: compile checks it)
            if not keep < source.num_patches:
                raise InputError(f"--keep must satisfy 1 <= keep < {source.num_patches} (the tower has "
                                 f"{source.num_patches} patch tokens), got {keep}")
        folder = store.path.parent / "bundles"
        settings, bundles = [], {}
        spec = str(Path(model).resolve()) if Path(model).exists() else model  # what every worker loads
        with summarised(lambda made: made[0] if len(made) == 1 else
                        f"{len(made)} bundles under {folder}"):
            for plan in plans:
                description = describe(plan, source.content_hash, target, max_new_tokens, target_options,
                                       family_options)
                key = setting_key(description)
                bundles[key] = bundle_for(model, plan, key, target, target_options, folder, progress, family_options)
                settings.append(Setting(key, description, functools.partial(BundleWorker, spec, str(bundles[key][0]),
                                                                            max_new_tokens),
                                        plan.label + (f" K={plan.keep} ({plan.where})" if plan.method else "")))
        progress(f"{len(samples)} samples x {len(settings)} bundles ({executor.name})")
        try:
            result = run_sweep(settings, samples, store, executor, progress=bar, on_chunk=on_chunk, log=progress)
        except KeyboardInterrupt:
            held = stored(settings, samples, store)
            if held:
                record_complete(Resumable(f"{held} of {len(settings) * len(samples)} cells are stored in "
                                          f"{store.path}: a rerun resumes from them"))
            raise
    finally:
        store.close()
    report = report_of(model, source.content_hash, dataset, samples, plans, settings, bundles, result, target,
                       max_new_tokens, executor.name, store.path)
    if video:
        report["video_frames"] = family_options["video_frames"]
    return report


def clip_options(samples: list, video_frames: int | None, dataset) -> dict:
    """The family options a dataset's bundles are compiled with: {"video_frames": F} for a dataset of clips, {} for
    one of images; one line where --video-frames is missing for clips or given for images."""
    video = samples[0].video  # read_dataset: all images or all clips
    if video_frames is not None and (isinstance(video_frames, bool) or not isinstance(video_frames, int)
                                     or video_frames < 1):
        raise InputError(f"--video-frames must be an integer >= 1, got {video_frames!r}")
    if video and video_frames is None:
        raise InputError(f"--dataset {dataset}: its rows name videos: pass --video-frames F (the frames of a clip "
                         "each compiled bundle takes)")
    if not video and video_frames is not None:
        raise InputError(f"--video-frames applies to a dataset of videos; the rows of {dataset} name images")
    return {"video_frames": video_frames} if video else {}


def _baseline(name: str | None) -> bool:
    """Whether the row is a baseline (Method.baseline: random keep, a grid), as its method declares; dense is not."""
    from vlmprune.passes.methods import get_method

    return name is not None and get_method(name).baseline


def paired_baseline() -> str | None:
    """The method every other row is compared with at the same K and place (Method.paired: random keep), as the
    method registry declares it; None where no method does."""
    from vlmprune.passes.methods import METHODS

    return next((name for name, method in METHODS.items() if method.paired), None)


def random_partners(plans: list[Plan]) -> dict[int, int]:
    """Plan index -> the index of the plain random-keep plan it is compared with (none for dense and that plan):
    at its K and place; for a plan spread over blocks (ToMe's block range, a progressive schedule), which random keep
    cannot share, at its K after the earliest block the sweep prunes random keep at, the cheapest tower a K gives,
    so a reduction that spends more blocks is held to the simplest one it must beat (the speedup column says what
    each costs)."""
    paired = paired_baseline()
    at = {(p.keep, p.layer): i for i, p in enumerate(plans) if p.method == paired and p.label == paired}
    earliest: dict[int, int] = {}  # K -> random keep after the lowest block
    for (keep, layer), i in at.items():
        if isinstance(layer, int) and (keep not in earliest or layer < plans[earliest[keep]].layer):
            earliest[keep] = i
    out = {}
    for i, p in enumerate(plans):
        j = earliest.get(p.keep) if p.spread else at.get((p.keep, p.layer))
        if p.method is not None and j is not None and j != i:
            out[i] = j
    return out


def scores(correct: list[bool], dense: list[bool], random: list[bool] | None) -> dict:
    """One row's figures over some samples: accuracy, retained (None where dense has no hit), and the paired
    difference to random keep (None without a random row to pair with), each with its 95 % interval."""
    acc, lo, hi = stats.accuracy_interval(correct)
    ret, rlo, rhi = stats.retained_interval(correct, dense)
    return {"samples": len(correct), "accuracy": acc, "accuracy_ci": [lo, hi],
            "retained": None if math.isnan(ret) else ret,
            "retained_ci": None if math.isnan(ret) else [rlo, rhi], "vs_random": versus_random(correct, random)}


def versus_random(values: list, random: list | None) -> dict | None:
    """The paired difference of a row's 0/1 values to random keep's on the same samples, with its 95 % interval;
    it counts where the interval excludes 0. None without a random row to pair with."""
    if random is None:
        return None
    d, dlo, dhi = stats.difference_interval(values, random)
    return {"difference": d, "ci": [dlo, dhi], "counts": bool(dlo > 0 or dhi < 0)}


def report_of(model, model_hash, dataset, samples, plans, settings, bundles, result, target, max_new_tokens,
              executor_name, store_path) -> dict:
    """The report: per row its answers and scores, overall and per question type."""
    typed = any(s.type is not None for s in samples)
    groups: dict[str, list[int]] = {}
    if typed:
        for i, s in enumerate(samples):
            groups.setdefault(s.type or UNTYPED, []).append(i)
        groups = dict(sorted(groups.items()))
    correct_of = [[result.cells[st.key][s.digest]["correct"] for s in samples] for st in settings]
    answers_of = [[result.cells[st.key][s.digest]["answer"] for s in samples] for st in settings]
    agree_of = [stats.agreement(answers, answers_of[0]) for answers in answers_of]
    partners = random_partners(plans)
    dense = correct_of[0]
    rows = []
    for i, (plan, setting) in enumerate(zip(plans, settings)):
        cells = result.cells[setting.key]
        random = correct_of[partners[i]] if i in partners else None
        pick = lambda values, idx: None if values is None else [values[j] for j in idx]  # noqa: E731
        rows.append({"method": plan.label, "name": plan.method, "options": plan.method_options, "keep": plan.keep,
                     "layer": plan.layer, "where": plan.where, "baseline": _baseline(plan.method),
                     "random_where": plans[partners[i]].where if i in partners else None,
                     **scores(correct_of[i], dense, random),
                     "agreement": agreement_scores(agree_of[i], agree_of[partners[i]] if i in partners else None),
                     "by_type": {t: scores(pick(correct_of[i], idx), pick(dense, idx), pick(random, idx))
                                 for t, idx in groups.items()},
                     "bundle": str(bundles[setting.key][0]), "parity_passed": bundles[setting.key][1],
                     "key": setting.key, "answers": {s.digest: cells[s.digest] for s in samples}})
    majority, majority_accuracy = stats.majority(s.answers for s in samples)
    types = {}
    for t, idx in groups.items():
        answer, acc = stats.majority(samples[j].answers for j in idx)
        types[t] = {"samples": len(idx), "majority_answer": answer, "majority_accuracy": acc}
    return {"model": model, "model_sha256": model_hash, "dataset": str(dataset), "samples": len(samples),
            "sample_digests": [s.digest for s in samples], "images": [s.image for s in samples],
            "sample_types": [s.type for s in samples] if typed else None,
            "target": target, "max_new_tokens": max_new_tokens, "executor": executor_name,
            "store": str(store_path), "computed": result.computed, "reused": result.reused,
            "dense_image_tokens": rows[0]["answers"][samples[0].digest]["extra"].get("image_tokens"),
            "majority_answer": majority, "majority_accuracy": majority_accuracy, "types": types,
            "retained_null": NO_RETAINED if any(r["retained"] is None for r in rows) else None,
            "rows": rows}


def agreement_scores(agree: list[int], random: list[int] | None) -> dict:
    """Agreement with dense's answers, its 95 % interval, and the paired difference to random keep's agreement."""
    value, lo, hi = stats.accuracy_interval(agree)
    return {"value": value, "ci": [lo, hi], "vs_random": versus_random(agree, random)}


def interval_text(ci) -> str:
    if ci is None or not all(v is not None and math.isfinite(v) for v in ci):
        return "-"
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def versus_text(vs: dict | None) -> str:
    """A paired difference to random keep: +0.042 [0.010, 0.074]*, the star where the interval excludes 0."""
    if vs is None:
        return "-"
    return f"{vs['difference']:+.3f} {interval_text(vs['ci'])}{'*' if vs['counts'] else ' '}"


def table(report: dict) -> list[str]:
    """The accuracy table, one line per bundle; then, for a typed dataset, accuracy per question type."""
    lines = [f"{'method':<10} {'K':>4} {'where':<14} {'accuracy':>8} {'95% CI':>15} {'retained':>8} {'95% CI':>15} "
             f"{'vs random (95% CI)':>26} {'agrees':>6} {'agreement vs random':>26}"]
    for r in report["rows"]:
        keep = "" if r["keep"] is None else str(r["keep"])
        retained = "-" if r["retained"] is None else f"{r['retained']:.3f}"
        lines.append(f"{r['method']:<10} {keep:>4} {r['where']:<14} {r['accuracy']:>8.3f} "
                     f"{interval_text(r['accuracy_ci']):>15} {retained:>8} {interval_text(r['retained_ci']):>15} "
                     f"{versus_text(r['vs_random']):>26} {r['agreement']['value']:>6.3f} "
                     f"{versus_text(r['agreement']['vs_random']):>26}"
                     + ("" if r["parity_passed"] else "  (bundle parity FAILED)"))
    lines.append(f"({report['samples']} samples, exact match of {report['max_new_tokens']} greedy tokens at most; "
                 f"majority answer {report['majority_answer']!r}: {report['majority_accuracy']:.3f}; "
                 f"{report['target']} bundles; {report['computed']} cells computed, {report['reused']} reused "
                 f"from {report['store']})")
    lines.append(f"(vs random: {stats.VERSUS_RANDOM}; * where it excludes 0. agrees: {stats.AGREES})")
    if report.get("retained_null"):
        lines.append(f"(retained -: {report['retained_null']})")
    types = report.get("types") or {}
    if types:
        names = list(types)
        width = max(9, *(len(t) for t in names))
        lines += ["", "accuracy per question type:",
                  f"{'method':<10} {'K':>4} {'where':<14} " + " ".join(f"{t:>{width}}" for t in names)]
        lines.append(f"{'samples':<30} " + " ".join(f"{types[t]['samples']:>{width}}" for t in names))
        lines.append(f"{'majority answer':<30} " + " ".join(f"{types[t]['majority_accuracy']:>{width}.3f}"
                                                          for t in names))
        for r in report["rows"]:
            keep = "" if r["keep"] is None else str(r["keep"])
            cells = []
            for t in names:
                vs = r["by_type"][t]["vs_random"]
                cells.append(f"{r['by_type'][t]['accuracy']:.3f}" + ("*" if vs and vs["counts"] else ""))
            lines.append(f"{r['method']:<10} {keep:>4} {r['where']:<14} " + " ".join(f"{c:>{width}}" for c in cells))
        lines.append("(* where the paired difference to random keep (paired as above) excludes 0; "
                     "every interval is in the JSON report)")
    return lines
