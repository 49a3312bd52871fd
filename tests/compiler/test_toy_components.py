"""Components declare, the pipeline asks: a component is one module and one registry line, for each of the four
registries.

Each test declares a toy component here, in the test, adds it to its registry alone (the methods', the targets',
the families' or the LLM exporters' table, undone after the test), and runs it through the pipeline: a tiny tower
built offline compiled to an ort bundle whose parity passes, then checked. Nothing else names the toy component:
the compile finds it through the registry and asks it what it declares. Once unregistered, it is unknown again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_models import edited_copy
from vlmprune.compiler import api, frontend
from vlmprune.compiler.cli import render
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.family import CLS_TOKEN, PATCH_TOKENS, Family
from vlmprune.compiler.frontend.vit import VitAdapter
from vlmprune.compiler.llm import export as llm_export
from vlmprune.compiler.llm.exporter import LlmExporter
from vlmprune.passes.methods import METHODS, get_method
from vlmprune.passes.methods.fixed import FixedMethod
from vlmprune.targets import TARGETS, get_target
from vlmprune.targets.ort import OrtTarget


def _compile(model, out: Path, **options):
    result = api.compile(str(model), out, keep=16, cache=False, **options)
    assert result.passed, result.manifest.parity.stages
    return result


# ---------------------------------------------------------------------------------------------------------- methods


class _StrideMethod(FixedMethod):
    """A toy method: every (N // K)-th patch."""

    name = "toy-stride"
    summary = "a test's toy method: every (N // K)-th patch"
    baseline = False
    options = {"site": (str, "toy-stride: block or features")}

    def describe(self, params: dict) -> str:
        return f"toy stride: every {params['keep']}-th of the patches"

    def indices(self, params: dict, n: int) -> np.ndarray:
        return np.arange(0, n, n // params["keep"])[: params["keep"]].astype(np.int64)


def test_a_toy_method_is_one_registry_line(monkeypatch, tmp_path, tiny_vit_dir):
    with monkeypatch.context() as registry:
        registry.setitem(METHODS, _StrideMethod.name, _StrideMethod)
        result = _compile(tiny_vit_dir, tmp_path / "b", method="toy-stride", layer=2)
        method = result.manifest.method
        assert (method.name, method.kept_count, method.layer) == ("toy-stride", 16, 2)
        assert "toy-stride" in [m.name for m in api.methods()]
        assert api.check(tmp_path / "b").passed
    with pytest.raises(InputError, match="unknown method 'toy-stride'"):
        get_method("toy-stride")


# ---------------------------------------------------------------------------------------------------------- targets


class _ToyTarget(OrtTarget):
    """A toy target: ONNX Runtime's, under its own name and summary."""

    name = "toy-ort"
    summary = "a test's toy target (ONNX Runtime)"


def test_a_toy_target_is_one_registry_line(monkeypatch, tmp_path, tiny_vit_dir):
    with monkeypatch.context() as registry:
        registry.setitem(TARGETS, _ToyTarget.name, _ToyTarget)
        result = _compile(tiny_vit_dir, tmp_path / "b", target="toy-ort", method="random")
        assert (result.manifest.target.name, result.manifest.target.summary) == ("toy-ort", _ToyTarget.summary)
        assert api.check(tmp_path / "b").passed
        assert api.run(tmp_path / "b", inputs=np.zeros((1, 3, 112, 112), np.float32)).kept.shape == (1, 16)
    with pytest.raises(InputError, match="unknown target 'toy-ort'"):
        get_target("toy-ort")


# --------------------------------------------------------------------------------------------------------- families


class _ToyAdapter(VitAdapter):
    """Loads a ViTModel directory whose config marks it as the toy family's (its own claim, asked first)."""

    family = "toy-tower"
    summary = "a test's toy family: a ViTModel marked toy_tower in its config"

    @classmethod
    def claims(cls, checkpoint) -> bool:
        return checkpoint.raw.get("toy_tower") is True


class _ToyFamily(Family):
    id = "toy-tower"
    adapter = _ToyAdapter
    has = {PATCH_TOKENS: "the toy tower", CLS_TOKEN: "the toy tower"}

    def readme_section(self, manifest) -> str:
        return f"\n## The toy tower\n\n{manifest.model.image_size} px, patch {manifest.model.patch_size}.\n"


def _photo(folder: Path) -> Path:
    from PIL import Image

    path = folder / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def toy_tower_dir(tmp_path_factory, tiny_vit_dir):
    """The tiny ViTModel built offline (conftest), its config marked as the toy family's."""
    return edited_copy(tiny_vit_dir, tmp_path_factory.mktemp("toy") / "tower", lambda c: c.update(toy_tower=True))


def test_a_toy_family_is_one_registry_line(monkeypatch, tmp_path, toy_tower_dir):
    bundle = tmp_path / "b"
    with monkeypatch.context() as registry:
        registry.setattr(frontend, "FAMILIES", (_ToyFamily(), *frontend.FAMILIES))
        result = _compile(toy_tower_dir, bundle, method="cls")
        assert result.manifest.model.family == "toy-tower"
        cls = next(m for m in api.methods() if m.name == "cls")  # `vlmprune methods` asks the table: it is there
        assert "the toy tower" in cls.serves
        assert "## The toy tower\n\n112 px, patch 14." in (bundle / "README.md").read_text()
        assert api.check(bundle).passed
        assert api.run(bundle, images=[_photo(tmp_path)]).kept.shape == (1, 16)  # the family loads its images
    # Unregistered: the checkpoint is a plain ViT's again, and the bundle names a family nobody knows.
    assert frontend.load_source(str(toy_tower_dir)).family == "vit"
    with pytest.raises(InputError, match="unknown model family 'toy-tower'"):
        api.run(bundle, images=[_photo(tmp_path)])


# ---------------------------------------------------------------------------------------------------- LLM exporters


class _ToyExporter(LlmExporter):
    """A toy exporter: writes llm/toy.json (the hand-off it was given) and checks it is still there."""

    id = "toy-llm"
    name = "the toy exporter"
    summary = "the toy exporter's llm/toy.json"
    features = "a JSON file, no graph"
    runtime = "json"
    atol = 0.0
    asked: list[str] = []

    def check_model(self, spec: str, fastv) -> None:
        self.asked.append("check_model")

    def export(self, model_spec, manifest, options, folder: Path, progress, fastv) -> dict:
        self.asked.append("export")
        (folder / "llm").mkdir()
        (folder / "llm" / "toy.json").write_text(json.dumps({"image_tokens": manifest.llm.image_tokens}))
        return {"files": ["llm/toy.json"], "image_tokens": manifest.llm.image_tokens}

    def parity(self, model_spec, bundle_dir: Path, manifest) -> tuple[bool, dict]:
        self.asked.append("parity")
        written = json.loads((bundle_dir / "llm" / "toy.json").read_text())
        same = written["image_tokens"] == manifest.llm_graphs["image_tokens"]
        return same, {"image_tokens": {"note": f"{written['image_tokens']} image tokens", "passed": same}}

    def parity_figures(self, llm: dict) -> tuple[bool, list[str]]:
        return True, [f"{llm['image_tokens']} image tokens written"]

    def readme_section(self, manifest) -> str:
        return "\n## The toy language model\n\nllm/toy.json\n"


def test_a_toy_llm_exporter_is_one_registry_line(monkeypatch, tmp_path, tiny_vit_dir):
    bundle = tmp_path / "b"
    _ToyExporter.asked.clear()
    with monkeypatch.context() as registry:
        registry.setitem(llm_export.EXPORTERS, _ToyExporter.id, _ToyExporter)
        # the target declares the exporters it takes: ort's own two, and the toy one
        registry.setattr(OrtTarget, "llm_exporters", (*OrtTarget.llm_exporters, _ToyExporter.id))
        assert "toy-llm" in api.llm_option_texts()["exporters"]
        assert any("--llm-exporter toy-llm" in line for line in llm_export.exporter_lines())
        result = _compile(tiny_vit_dir, bundle, method="cls", with_llm=True, llm_exporter="toy-llm")
        tokens = result.manifest.llm.image_tokens  # the hand-off the exporter was given: [CLS] + 16 kept
        assert tokens == 17
        assert result.manifest.llm_graphs == {"exporter_id": "toy-llm", "files": ["llm/toy.json"], "image_tokens": 17}
        assert "parity llm        PASS  17 image tokens written" in render.compile_lines(result)
        assert "## The toy language model" in (bundle / "README.md").read_text()
        report = api.check(bundle)
        assert report.passed and report.stages[-1].outputs["image_tokens"]["passed"]
        assert _ToyExporter.asked == ["check_model", "export", "parity"]  # export checks itself; check asks parity
    with pytest.raises(InputError, match="names no known LLM exporter .exporter_id 'toy-llm'"):
        api.check(bundle)
