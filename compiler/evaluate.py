"""`vlmprune eval`: how much a pruning method changes a user's own checkpoint's answers.

For every method and K, over every image and prompt: the first answer token's
distribution with the pruned image against the dense one (KL(dense || pruned), in nats),
whether the first greedy token agrees, and how much of the dense greedy answer (the first
--max-new-tokens tokens) the pruned one reproduces: exact (all tokens equal) and the common
prefix as a share of the dense answer's length.

What is pruned: each method's plain-torch reference on the checkpoint's own tower (the
parity reference; every compiled bundle matches it within the tolerances its parity.json
reports), with the pruned rows fed at their original positions as `vlmprune generate`
feeds a bundle's (generate.pruned_image: handoff's rule of the family; LLaVA-1.5 1-D
indices, Qwen2-VL mRoPE (t, h, w), LLaVA-NeXT rows assembled over the crops). Images
are preprocessed as generate does (Qwen2-VL at --image-size, default a bundle's or 448;
LLaVA-NeXT at one --grid, default a bundle's or the model's largest). The dense side is
the Hugging Face model's own image features. A harness check rides along: the dense path
fed through this splice against the model's own forward (Llava/LlavaNext/Qwen2VL
ForConditionalGeneration on input_ids + pixel_values, image_sizes / image_grid_thw); its
KL is reported (`harness_kl_max`, 0 up to float rounding) so a number is never trusted
that the splice itself would have moved.

`--bundle DIR` adds a row per compiled bundle of the same model: its own graph, run by its
target's runner here (the ort library, the QNN emulator), for the figures of what deploys
(a quantized target's selection may differ from the reference's; its parity.json says where).

Clips (`--video PATH`, repeatable: a folder of frames or a video file) take the images' place for a video bundle
(`compile --video-frames F`; `eval BUNDLE --video PATH --prompt TEXT`): each clip sampled to the bundle's F frames
by its family (Family.load_video, as `run --video` reads it), the dense side the model's own video features
(get_video_features) at their video positions, the bundle's kept rows at theirs, and the harness check the
model's own forward on pixel_values_videos. A clip's rows come from the bundle's graph, so clips need a bundle;
all bundles of one eval take the same F.

On a tiny random model the figures are only arithmetic; on a real checkpoint they say how
far the method moves the model's answers on those images and prompts: KL near 0 and
agreement near 1 mean the pruned model answers as the dense one does.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler import generate as gen
from vlmprune.compiler.frontend import family_of
from vlmprune.compiler.prompt import bundle_feed, rows_for_ids, text_input_dim

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One method at one K, resolved and checked against the tower before any work."""

    method: object
    params: dict
    site: str
    layer: int | None

    @property
    def name(self) -> str:
        return self.method.name


def list_images(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"--images {folder}: no such directory")
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise InputError(f"--images {folder}: no images there ({', '.join(IMAGE_SUFFIXES)})")
    return images


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--prompts {path}: no such file")
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise InputError(f"--prompts {path}: not UTF-8 text (one prompt per line)") from None
    if not prompts:
        raise InputError(f"--prompts {path}: no prompts in it (one per line)")
    return prompts


def prompt_lines(texts) -> list[str]:
    """--prompt TEXT values (repeatable), each a prompt: one line for none or an empty one."""
    prompts = [str(t) for t in texts]
    if not prompts or any(not t.strip() for t in prompts):
        raise InputError("--prompt is empty" if prompts else "eval needs a prompt: --prompt TEXT or --prompts FILE")
    return prompts


def clip_bundles(manifests: list, videos: list[Path]) -> int | None:
    """The frames of every bundle's clip when eval runs clips (None for images), each bundle checked: a clip's rows
    come from a video bundle's own graph, so clips need one, and all of them take the same F (one line otherwise)."""
    from vlmprune.compiler.frontend import family_of

    takes = [(path, family_of(m).takes_video(m), m.model.video_frames) for path, m in manifests]
    if not videos:
        clip = next((path for path, video, _ in takes if video), None)
        if clip is not None:
            raise InputError(f"--bundle {clip} takes a clip of {dict((p, f) for p, _, f in takes)[clip]} frames: "
                             "pass --video PATH (a folder of frames or a video file) in place of --images")
        return None
    if not manifests:
        raise InputError("eval --video compares a video bundle's answers with dense: pass the bundle (eval BUNDLE "
                         "--video PATH --prompt TEXT, or --bundle BUNDLE)")
    still = next((path for path, video, _ in takes if not video), None)
    if still is not None:
        raise InputError(f"--bundle {still} takes images, not clips: --video needs bundles compiled --video-frames F")
    frames = {f for _, _, f in takes}
    if len(frames) > 1:
        raise InputError(f"the bundles take clips of {' and '.join(map(str, sorted(frames)))} frames: one eval "
                         "compares bundles of one frame count")
    return frames.pop()


def settings_for(source, methods: list[str], keeps: list[int]) -> list[Setting]:
    """Every method x K, parsed and fitted to the tower by compile's own stages (pipeline.prune_config, fit_config:
    one line for one it cannot serve); over an anyres source's crops, under one global budget with the method's
    default split, as compile does."""
    from vlmprune.compiler.frontend import family_for
    from vlmprune.compiler.pipeline import CompileOptions, Loaded, fit_config, prune_config
    from vlmprune.passes.methods.base import BLOCK

    if not methods or not keeps:
        raise InputError("eval needs at least one --method and one --keep")
    loaded = Loaded(source, family_for(source))
    out = []
    for name in methods:
        for keep in keeps:
            config = fit_config(prune_config(CompileOptions(method=name, keep=keep)), loaded, {})
            site = config.method.needs(config.params).site
            out.append(Setting(config.method, config.params, site, source.num_blocks if site == BLOCK else None))
    return out


def kl_divergence(dense_logits: torch.Tensor, pruned_logits: torch.Tensor) -> float:
    """KL(P_dense || P_pruned) in nats, in float64 (0 for equal logits, exactly)."""
    p = torch.log_softmax(dense_logits.double(), -1)
    q = torch.log_softmax(pruned_logits.double(), -1)
    return max(0.0, float(torch.sum(p.exp() * (p - q))))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def evaluate(model: str, images_dir: Path | None, prompts_file: Path | None, methods: list[str], keeps: list[int],
             max_new_tokens: int = 8, progress=lambda _m: None, bundles: list[Path] = (),
             image_size: int | None = None, grid: str | None = None, reference: bool = False,
             videos: list[Path] = (), prompt_texts: list[str] = ()) -> dict:
    """The report behind `vlmprune eval`: per method and K, KL and agreement over every image x prompt.

    videos: clips in place of images_dir (video bundles only; see the module docstring); prompt_texts: prompts
    given one by one (--prompt) in place of prompts_file.

    bundles: compiled bundles of the same model, evaluated beside the references (their own
    tower run by their target's runner here), one row each.
    image_size (Qwen2-VL) and grid (LLaVA-NeXT): the static input, default the first bundle's, else the family's.
    A bundle compiled --with-llm answers with its own LLM graphs where they can run here (generate.bundle_llm),
    unless reference; its row's `llm` says which language model answered (and why, for such a bundle);
    references, dense and bundles without an LLM: "transformers".
    """
    from vlmprune.compiler.bundle import load_manifest, source_of

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    videos = [Path(v) for v in videos]
    prompts = read_prompts(prompts_file) if prompts_file is not None else prompt_lines(prompt_texts)
    images = videos or list_images(images_dir)
    manifests = [(Path(b), load_manifest(b, verify=True)) for b in bundles]
    frames = clip_bundles(manifests, videos)
    if videos and (methods or keeps):
        raise InputError("-m/-k run each method's reference on images; a clip's pruned rows come from its video "
                         "bundle (compile --video-frames F -m METHOD, then eval BUNDLE --video PATH)")
    for _, manifest in manifests:  # MODEL named as a bundle records it, but moved since
        source_of(manifest, model, "pass its new path as MODEL")
    vlm = gen.load_vlm(model, image_size, grid, bundle=manifests[0][1] if manifests else None)
    source = vlm.source
    settings = settings_for(source, methods, keeps) if methods or keeps or not bundles else []
    for path, manifest in manifests:
        if manifest.model.sha256 != source.content_hash or not manifest.method.pruned:
            raise InputError(f"--bundle {path}: " + ("a dense bundle has nothing to compare"
                                                     if not manifest.method.pruned else
                                                     f"not compiled from {model} (its content hash differs)"))
        _same_input(path, manifest, source)
    built = [gen.build_prompt(vlm, p) for p in prompts]
    if videos:  # each clip sampled to the bundles' frames, as the family reads one for `run --video`
        first = manifests[0][1]
        loaded = [family_of(first).load_video(first, clip) for clip in videos]
        pixels = [pixel for pixel, _ in loaded]
        for _, notes in loaded:
            progress("; ".join(notes))
    else:
        pixels = [gen.load_pixels(vlm, image)[0] for image in images]
    noun = f"clips of {frames} frames" if videos else "images"
    progress(f"{len(images)} {noun} x {len(prompts)} prompts, {len(settings) + len(manifests)} settings, "
             f"{max_new_tokens} greedy tokens each")
    dense_runs, harness = {}, []
    for i, pixel in enumerate(pixels):
        image = gen.dense_image(vlm, pixel)
        for j, prompt in enumerate(built):
            positions, text_start = image.place(len(prompt.before))
            dense_runs[i, j] = gen.answer(vlm, prompt, image.rows, positions, text_start, max_new_tokens)
            harness.append(kl_divergence(hf_first_logits(vlm, prompt, pixel, len(image.rows)),
                                         dense_runs[i, j].first_logits))
    rows = []
    runs = [(s.name, s.params["keep"], "reference", _reference_rows(vlm, s), (None, "transformers"))
            for s in settings]
    runs += [(m.method.name, m.method.keep, f"bundle {p.name} ({m.target.name})",
              _bundle_rows(p, m, vlm), gen.bundle_llm(p, m, reference) if m.llm_graphs else (None, "transformers"))
             for p, m in manifests]
    for name, keep, origin, rows_of, (graphs, llm) in runs:
        samples = []
        for i, pixel in enumerate(pixels):
            for j, prompt in enumerate(built):
                features, place = rows_of(pixel, prompt)  # per image; per prompt too for a prompt-aware method
                positions, text_start = place(len(prompt.before))
                pruned = gen.answer(vlm, prompt, features, positions, text_start, max_new_tokens, graphs)
                dense = dense_runs[i, j]
                samples.append({
                    "image": images[i].name, "prompt": prompts[j],
                    "kl": kl_divergence(dense.first_logits, pruned.first_logits),
                    "first_token_agrees": pruned.tokens[:1] == dense.tokens[:1],
                    "exact": pruned.tokens == dense.tokens,
                    "prefix_share": common_prefix(pruned.tokens, dense.tokens) / len(dense.tokens),
                    "dense_tokens": dense.tokens, "pruned_tokens": pruned.tokens,
                    "image_tokens": pruned.image_tokens})
        rows.append({**_summary(name, keep, origin, samples), "llm": llm})
        progress(f"  {name} K={keep} ({origin}): KL mean {rows[-1]['kl_mean']:.4g}"
                 + ("" if llm == "transformers" else f"; language model: {llm}"))
    return {"model": vlm.spec, "images": [p.name for p in images], "prompts": prompts,
            **({"videos": [str(p) for p in videos], "video_frames": frames} if videos else {}),
            "image_start": [len(p.before) for p in built],  # per prompt: FastV's --image-start for it
            "max_new_tokens": max_new_tokens, "dense_image_tokens": int(dense_runs[0, 0].image_tokens),
            "pruned_with": "reference: each method's plain-torch reference (the parity reference of its bundles); "
                           "bundle: the bundle's own graph under its target's runner here",
            "harness_kl_max": max(harness), "results": rows}


def _same_input(path: Path, manifest: Manifest, source) -> None:
    """A bundle of the model at another --image-size or --grid (the options its family declares) takes other pixels:
    one line."""
    from vlmprune.compiler.frontend import family_for

    differs = family_for(source).other_input(manifest.model, source)
    if differs:
        raise InputError(f"--bundle {path}: {differs}")


def _reference_rows(vlm, setting: Setting):
    """pixel -> (the method reference's rows of one image, positions(offset) -> (image positions, text start))."""
    from vlmprune.compiler.parity.reference import MethodPruner

    from vlmprune.compiler.parity.reference import prompt_site
    from vlmprune.passes.methods import relevance

    source = vlm.source
    pruner = MethodPruner(setting.method, setting.params, setting.site, setting.layer)
    pipeline = source.pipeline.with_pruner(pruner)
    out_tokens = setting.method.output_tokens(setting.params)
    needs = setting.method.needs(setting.params)
    prompted = needs.text or needs.tower_features

    @_per_image(prompted)
    def rows_of(pixel, prompt):
        with torch.inference_mode():
            if relevance.weight(setting.params) > 0:  # --prompt-weight: the method's own path, with the prompt's rows
                rows = rows_for_ids(vlm, prompt.before + prompt.after, vlm.model.config.text_config.hidden_size)
                pruner.text = torch.from_numpy(np.broadcast_to(rows, (len(pixel), *rows.shape)).copy())
                features, kept = pipeline(torch.from_numpy(pixel))
            elif prompted:  # the prompt's embedding rows, as the bundle gets them (compiler.prompt)
                dim = vlm.model.config.text_config.hidden_size
                dense = source.pipeline(torch.from_numpy(pixel)).numpy()
                features, kept, _ = prompt_site(source.pipeline, pruner, dense, pixel,
                                                rows_for_ids(vlm, prompt.before + prompt.after, dim))
            else:
                features, kept = pipeline(torch.from_numpy(pixel))
        prefix, extra = features.shape[1] - out_tokens, out_tokens - kept.shape[1]
        trace = pipeline.last_trace or {}
        if "num_tokens" in trace:  # K varies per image: its valid rows only, as generate takes a bundle's
            rows = int(trace["num_tokens"][0])
            features, kept = features[:, : prefix + rows], kept[:, : rows - extra]
        image = gen.pruned_image(vlm, features[0], kept[0].numpy(), None, prefix, extra)
        return image.rows, image.place
    return rows_of


def _bundle_rows(bundle_dir: Path, manifest: Manifest, vlm):
    @_per_image(text_input_dim(manifest) is not None)
    def rows_of(pixel, prompt):
        # a prompt-aware bundle: the prompt's rows
        tokens = gen.bundle_tokens(bundle_dir, manifest, pixel, vlm, bundle_feed(manifest, vlm, prompt))
        return tokens.features, lambda offset: gen.bundle_positions(tokens, offset)
    return rows_of


def _per_image(prompted: bool):
    """rows_of(pixel, prompt), run once per image unless the rows depend on the prompt too (the last one is kept)."""
    def wrap(rows_of):
        last: dict = {}

        def cached(pixel, prompt):
            key = (id(pixel), id(prompt) if prompted else None)
            if key not in last:
                last.clear()
                last[key] = rows_of(pixel, prompt)
            return last[key]
        return cached
    return wrap


def hf_first_logits(vlm, prompt: gen.Prompt, pixel: np.ndarray, tokens: int) -> torch.Tensor:
    """The model's own forward (Llava / LlavaNext / Qwen2VL ForConditionalGeneration) on the expanded input_ids and
    the pixels (with image_sizes / image_grid_thw): the harness check."""
    with torch.inference_mode():
        out = vlm.model(**gen.hf_forward_ids(vlm, prompt, tokens), **gen.hf_image_inputs(vlm, pixel),
                        logits_to_keep=1)
    return out.logits[0, -1].float()


_hf_first_logits = hf_first_logits


def _summary(name: str, keep: int, origin: str, samples: list[dict]) -> dict:
    kls = [s["kl"] for s in samples]
    share = lambda key: sum(float(s[key]) for s in samples) / len(samples)  # noqa: E731
    return {"method": name, "keep": keep, "from": origin, "image_tokens": samples[0]["image_tokens"],
            "kl_mean": sum(kls) / len(kls), "kl_max": max(kls), "first_token_agreement": share("first_token_agrees"),
            "exact_match": share("exact"), "prefix_agreement": share("prefix_share"), "samples": samples}


def table(report: dict) -> list[str]:
    """The report as a fixed-width table, one line per method and K."""
    m = report["max_new_tokens"]
    lines = [f"{'method':<10} {'K':>5} {'tokens':>6} {'KL mean':>10} {'KL max':>10} {'top-1':>6} "
             f"{'exact@' + str(m):>8} {'prefix':>7}  from"]
    for r in report["results"]:
        lines.append(f"{r['method']:<10} {r['keep']:>5} {r['image_tokens']:>6} {_g(r['kl_mean']):>10} "
                     f"{_g(r['kl_max']):>10} {r['first_token_agreement']:>6.2f} {r['exact_match']:>8.2f} "
                     f"{r['prefix_agreement']:>7.2f}  {r['from']}"
                     + (f"; language model: {r['llm']}" if r.get("llm", "transformers") != "transformers" else ""))
    return lines


def _g(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}" if math.isfinite(value) else str(value)
