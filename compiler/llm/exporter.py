"""The LLM exporter contract: what `--with-llm` asks of the tool that writes the language model into llm/.

An exporter declares its id (what `--llm-exporter` and the manifest's `llm_graphs.exporter_id`
name), what it takes (FastV or not, which language-model families), and does its export, its
parity check (the `llm` stage of `vlmprune check`) and its bundle README section. A target
declares the exporter ids it takes (vlmprune.targets.base.Target.llm_exporters); the table in
compiler.llm.export is the whole list, and nothing else names an exporter.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import ClassVar

from vlmprune.compiler.contract import LLM_DIR  # noqa: F401  (the bundle's folder for the language model)
from vlmprune.compiler.contract import Manifest
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.llm import lm_source


class LlmExporter(abc.ABC):
    """One way of writing the language model into the bundle; subclasses set the class attributes."""

    id: ClassVar[str]  # --llm-exporter's value, the manifest's llm_graphs.exporter_id
    name: ClassVar[str]  # the toolchain, in refusal lines ("exported with NAME")
    summary: ClassVar[str]  # what it writes, in `vlmprune targets`
    features: ClassVar[str] = ""  # what its graph keeps, in `vlmprune targets` where it is a target's default
    # FastV (--fastv-layer): None where the exporter compiles it in, else the refusal line, word for word.
    fastv_refusal: ClassVar[str | None] = None
    families: ClassVar[tuple[str, ...]] = lm_source.FAMILIES  # language-model types it exports; others refused

    def available(self) -> tuple[bool, str]:
        """Whether this machine can run the exporter, and what it is (or why not). Installs nothing."""
        return True, ""

    def status(self) -> str:
        ok, why = self.available()
        return why if ok else f"unavailable: {why}"

    def check_options(self, fastv_layer) -> None:
        """One line, before any work, for an LLM option this exporter does not take."""
        if fastv_layer is not None and self.fastv_refusal is not None:
            raise InputError(self.fastv_refusal)

    def check_model(self, spec: str, fastv) -> None:
        """MODEL's config alone (no weights) against the export, before the tower's export (seconds to minutes):
        it holds a language model this exporter takes (families), and FastV's layer is one of its layers. The default
        reads the LM source."""
        config = lm_source.text_config(spec)
        if config is not None:  # a decoder no exporter here knows: one line before the tower's export
            lm_source.check_family(config)
            if config.model_type not in self.families:  # one that another exporter takes (LFM2's: the torch one)
                raise InputError(f"language model type {config.model_type!r} is not supported by the {self.name} "
                                 f"exporter (supported: {', '.join(self.families)})")
        if config is not None and fastv is not None:
            fastv.check(config.num_hidden_layers)

    @abc.abstractmethod
    def export(self, model_spec: str, manifest: Manifest, options, folder: Path, progress, fastv) -> dict:
        """Write folder/llm/ and check it; the manifest's `llm_graphs` fields. fastv: the FastVSpec or None."""

    @abc.abstractmethod
    def parity(self, model_spec: str, bundle_dir: Path, manifest: Manifest) -> tuple[bool, dict]:
        """The compile-time check again on the bundle's own files: (passed, figures as {name: {note, passed}})."""

    # The `llm` stage's runtime, precision and tolerance (the figures are compared at parity's own tolerance).
    runtime: ClassVar[str]
    precision: ClassVar[str] = "fp32"
    atol: ClassVar[float]

    def check(self, model_spec: str, bundle_dir: Path, manifest: Manifest):
        """`vlmprune check`'s `llm` stage: one stage whatever the exporter, with its runtime and figures.

        Why a stage of its own and not a figure in the tower's: the LLM graphs take embeddings, not
        pixels, so they are compared on seeded embeddings against the reference decoder.
        """
        from vlmprune.compiler.parity import DEFAULT_TOLERANCES, StageResult

        tolerance = dataclasses.replace(DEFAULT_TOLERANCES[self.precision], max_abs=self.atol, scale_rel=None)
        try:
            passed, outputs = self.parity(model_spec, Path(bundle_dir), manifest)
        except InputError:
            raise
        except Exception as exc:  # the graphs failed to run: a failed stage with its reason
            return StageResult("llm", self.runtime, self.precision, tolerance, False,
                               error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        return StageResult("llm", self.runtime, self.precision, tolerance, passed, outputs=outputs)

    def graph_runner(self, bundle_dir: Path, manifest: Manifest) -> tuple[LlmGraphRunner | None, str]:
        """The bundle's LLM graphs as `generate` and `eval` run them on this machine, and what runs, or
        (None, why they cannot run here): those commands then answer with transformers and say why."""
        return None, f"{self.name}'s graphs are not run by generate on this machine"

    def parity_figures(self, llm: dict) -> tuple[bool, list[str]]:
        """(passed, figures) of the compile summary's `parity llm` line, from the manifest's llm_graphs this exporter
        wrote. This default reads a `parity` record of logits and greedy tokens against the reference decoder (the
        torch.onnx and onnxruntime-genai exporters')."""
        return parity_record_figures(llm)

    @abc.abstractmethod
    def readme_section(self, manifest: Manifest) -> str:
        """The bundle README's language-model section for a bundle this exporter wrote."""


class LlmGraphRunner(abc.ABC):
    """A bundle's exported language model, as greedy decoding drives it: prefill once, then one step per token.

    Arrays are numpy, batch 1: embeds [1, L, hidden]; positions [1, L] (mRoPE: [3, 1, L]), each token's original
    position; logits [vocab] float32 of the last token. `state` is the runner's own (the caches). `extra`: the
    prefill's further inputs by name, each over the whole prompt (Qwen3-VL's deepstack_embeds [L, 1, L_prompt,
    hidden]).
    """

    describe: str  # what runs, in generate's output ("llm/prefill.onnx + llm/decode.onnx, ONNX Runtime")

    @abc.abstractmethod
    def prefill(self, embeds, positions, extra: dict | None = None) -> tuple[object, object]:
        """(last token's logits, state) for the prompt."""

    @abc.abstractmethod
    def step(self, embeds, positions, state, extra: dict | None = None) -> tuple[object, object]:
        """(logits, state) of one more token on top of state; extra: the step's further inputs by name (Gemma 4's
        per_layer_inputs of the token)."""


def parity_record_figures(llm: dict) -> tuple[bool, list[str]]:
    """LlmExporter.parity_figures' default: logits max-abs and greedy tokens of llm_graphs' `parity` record."""
    from vlmprune.compiler.parity import figure_text

    parity = llm["parity"]
    return parity["passed"], [
        f"logits max-abs {figure_text(parity['logits_max_abs'], 3, at_most=parity.get('tolerance'))}",
        f"greedy tokens {'identical' if parity['tokens_identical'] else 'DIFFER'} over {parity['decode_steps']} decode "
        "steps"]


def tokens_note(got: dict) -> dict:
    """The greedy-decoding figure of a parity result, as a check note."""
    return {"note": f"{got['decode_steps']} decode steps " + ("identical" if got["tokens_identical"] else "DIFFER"),
            "passed": got["tokens_identical"]}
