"""The model-adapter interface: one adapter per model family, asked by the pipeline, never branched on.

An adapter turns a Hugging Face directory of its family into a Source: it reads the
weights it needs (safetensors only), says what the model is (has [CLS], patch grid,
feature layer and select strategy, the positions an LLM needs for kept tokens), how its
images are preprocessed (size, mean, std), and builds the dense torch pipeline, which is
both the parity reference (its output equals the family's own image-feature path in
transformers) and what is exported. What a compile asks of the family beyond loading is
its family object's (compiler.frontend.family). Adding a family is one module with its
adapter and its family object, its tests, and one line in frontend/__init__.py's FAMILIES.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import ClassVar

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.source import Source, quiet_transformers


class ModelAdapter(abc.ABC):
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json model_type values this adapter loads
    summary: ClassVar[str]

    @classmethod
    def claims(cls, checkpoint: Checkpoint) -> bool:
        """Whether this adapter loads the checkpoint; asked in table order, so a family sharing a model_type
        (a LLaVA on another tower) claims its checkpoints before the general one."""
        return checkpoint.model_type in cls.model_types

    @abc.abstractmethod
    def load(self, checkpoint: Checkpoint, feature_layer: int | None) -> Source:
        """The Source of a checkpoint of this family."""


class Checkpoint:
    """A Hugging Face model directory: its config (raw and parsed), safetensors files and preprocessing."""

    def __init__(self, path: Path):
        quiet_transformers()
        self.path = path
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError(f"{path}: not a Hugging Face model directory (no config.json)")
        try:
            self.raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{config_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(self.raw, dict):
            raise InputError(f"{config_path}: not a transformers config (a JSON object)")
        self.model_type = self.raw.get("model_type", "")
        self.weights = [w for w in sorted(path.glob("*.safetensors")) if w.name != "mm_projector.safetensors"]
        if not self.weights:
            raise InputError(f"{path}: no .safetensors weights (vlmprune never unpickles .bin checkpoints)")
        self._config_path = config_path
        self._config = None

    @property
    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            try:
                self._config = AutoConfig.from_pretrained(str(self.path), local_files_only=True)
            except Exception as exc:  # transformers raises many kinds for a bad config
                raise InputError(f"{self._config_path}: cannot be read as a transformers config "
                                 f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        return self._config

    def files(self, *extra: str) -> list[Path]:
        """The files whose content defines the model (hashed into the bundle's manifest)."""
        return [self._config_path, *self.weights] + [self.path / e for e in extra if (self.path / e).is_file()]

    def preprocessing(self, mean, std) -> tuple[tuple, tuple]:
        """mean and std from preprocessor_config.json where present, else the family's defaults."""
        pre = self.path / "preprocessor_config.json"
        if not pre.is_file():
            return tuple(mean), tuple(std)
        try:
            prep = json.loads(pre.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{pre}: not valid JSON ({exc.msg})") from None
        return tuple(prep.get("image_mean", mean)), tuple(prep.get("image_std", std))
