"""The tiny InternVL3 the InternVL test modules share (test_internvl.py, test_internvl_tiles.py): its sizes, its
checkpoints (a tower-side one and an LLM-side one, each built once per module that imports the fixtures) and
transformers' own rows of it, so that both modules check against the same model and reference.

Import the fixtures by name into a test module (pytest finds them there); each module still builds its own
copy (module scope), as it would with its own fixture.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import tiny_internvl

SIZE, TOKENS, WIDTH = 112, 16, 48  # tiny_internvl: 112 px tiles, 4x4 = 16 merged tokens, the LLM's width
VOCAB, IMAGE = 320, 300  # the LLM-side model: a vocabulary wide enough for UTF-8 bytes as token ids
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # InternVL's processor's (ImageNet's)


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory):
    """The tower-side tiny InternVL3 (seed 3)."""
    return tiny_internvl(tmp_path_factory.mktemp("tiny_internvl"), 3)


@pytest.fixture(scope="module")
def hf_model(internvl_dir):
    """transformers' own InternVLForConditionalGeneration of internvl_dir."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(internvl_dir).eval()


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    """The LLM-side tiny InternVL3 (seed 5): its image token and vocabulary fit generate's UTF-8 byte prompts."""
    return tiny_internvl(tmp_path_factory.mktemp("tiny_internvl_llm"), 5, image_token_id=IMAGE, vocab_size=VOCAB)


def hf_rows(model, pixel: torch.Tensor) -> torch.Tensor:
    """get_image_features' rows [B, T, D] of B tiles [B, 3, S, S]: the reference every InternVL check holds to."""
    with torch.inference_mode():
        return model.model.get_image_features(pixel_values=pixel).pooler_output
