"""vLLM's EVS (vllm/multimodal/evs.py) restated for one clip: the reference the evs method is held to.

Restated from the file's text, not imported (vLLM is not a dependency): compute_retained_tokens_count and
compute_retention_mask, with torch's cosine_similarity as vLLM calls it.
"""

from __future__ import annotations

import numpy as np
import torch


def vllm_count(tokens_per_frame: int, frames: int, q: float) -> int:
    """compute_retained_tokens_count as vLLM states it: the clip's count times (1 - q), truncated, at least a frame."""
    total = tokens_per_frame * frames
    return max(tokens_per_frame, int(total * (1 - q)))


def vllm_mask(clip: np.ndarray, frames: int, keep: int) -> np.ndarray:
    """compute_retention_mask as vLLM states it, for one clip [T·HW, D]: torch's cosine_similarity between each frame
    and the one before, 255 for the first frame, a stable descending argsort, the first `keep` set in a boolean mask."""
    x = torch.from_numpy(clip).reshape(frames, -1, clip.shape[-1])
    dis = 1 - torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)
    dis = torch.cat([255 * torch.ones_like(x[:1, :, 0]), dis], dim=0).reshape(-1)
    order = torch.argsort(dis, dim=-1, descending=True, stable=True)
    mask = torch.zeros_like(dis, dtype=torch.bool)
    mask[order[:keep]] = True
    return mask.numpy()
