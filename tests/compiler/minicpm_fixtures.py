"""The tiny MiniCPM-V 4.6 the MiniCPM-V test modules share (test_minicpm_v.py, test_minicpm_v_slices.py): its
checkpoint and transformers' own model of it, so that both modules check against the same model.

Import the fixtures by name into a test module (pytest finds them there); each module still builds its own copy
(module scope), as it would with its own fixture.
"""

from __future__ import annotations

import pytest

from tiny_models import tiny_minicpm_v

VOCAB, IMAGE = 320, 300  # the LLM-side model: bytes 0-255, its special tokens, the image token at 300
PROMPT = "what is in the image?"


@pytest.fixture(scope="module")
def minicpm_dir(tmp_path_factory):
    """The tiny MiniCPM-V 4.6 (seed 0)."""
    return tiny_minicpm_v(tmp_path_factory.mktemp("tiny_minicpm_v"), 0)


@pytest.fixture(scope="module")
def hf_model(minicpm_dir):
    """transformers' own MiniCPMV4_6ForConditionalGeneration of minicpm_dir."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(minicpm_dir).eval()
