"""Fixtures the tools' tests share: a tiny randomly initialised DINOv2 tower (what the training and probe tools read)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tower")
    Dinov2Model(Dinov2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             image_size=112, patch_size=14)).save_pretrained(path)  # [CLS] + 64 patches
    return path
