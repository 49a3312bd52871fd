"""vLLM's EVS (vllm/multimodal/evs.py) and DyCoke's TTM (KD-TAO/DyCoke) restated for one clip: the references
the evs and dycoke methods are held to.

Restated from the files' text, not imported (neither is a dependency): vLLM's compute_retained_tokens_count and
compute_retention_mask, with torch's cosine_similarity as vLLM calls it; DyCoke's dycole_ttm.
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


def dycoke_official(clip: torch.Tensor, per_frame: int, merging_ratio: float = 0.7) -> list[list[int]]:
    """DyCoke's dycole_ttm (KD-TAO/DyCoke, llava/model/llava_arch.py) restated for one clip [T·N, D]: per frame, the
    token indices it keeps, in the official order (topk's, lowest similarity first). Pairs: odd frame 2p + 1 is
    scored by similarities[(i - 2) // 2] with i = 2p (Python's floor and negative index); then for i in
    range(0, T - 4, 4), frame i + 2 by its cosine to frame i."""
    frames = clip.shape[0] // per_frame
    keep_share = 1 - merging_ratio
    f = lambda i: clip[i * per_frame:(i + 1) * per_frame]  # noqa: E731
    norm = torch.nn.functional.normalize
    similarities = [torch.nn.functional.cosine_similarity(norm(f(i), p=2, dim=1), norm(f(i + 1), p=2, dim=1), dim=1)
                    for i in range(0, frames - 1, 2)]
    kept: list[list[int]] = []
    for i in range(0, frames - 1, 2):
        k = int(keep_share * per_frame)
        kept.append(list(range(per_frame)))
        kept.append(similarities[(i - 2) // 2].topk(k, largest=False).indices.tolist())
    for i in range(0, frames - 4, 4):
        k = int(keep_share * per_frame)
        similarity = torch.nn.functional.cosine_similarity(f(i), f(i + 2), dim=1)
        kept[i] = list(range(per_frame))
        kept[i + 2] = similarity.topk(k, largest=False).indices.tolist()
    return kept
