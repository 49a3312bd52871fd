"""Helpers of the kernel tests: ctypes bindings of the vlmp_* C functions and numpy
references of the pruning semantics (shared/DESIGN.md)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

VLMP_OK = 0
VLMP_ERR_INVALID_ARGUMENT = 1
VLMP_ERR_UNSUPPORTED = 2
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}


class CpuKernels:
    """ctypes view of the C ABI (vlmprune/kernels.h) inside one loaded library."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.lib.vlmp_select_topk_cpu.argtypes = [p, i64, i64, i64, p]
        self.lib.vlmp_gather_summary_cpu.argtypes = [c_int, p, i64, i64, i64, c_int, p, i64, p]
        self.lib.vlmp_cls_scores_cpu.argtypes = [c_int, p, p, i64, i64, i64, i64, c_int, ctypes.c_float, c_int, c_int, p]
        self.lib.vlmp_divprune_select_cpu.argtypes = [p, i64, i64, i64, p]
        for fn in (self.lib.vlmp_select_topk_cpu, self.lib.vlmp_gather_summary_cpu, self.lib.vlmp_cls_scores_cpu,
                   self.lib.vlmp_divprune_select_cpu):
            fn.restype = c_int

    def select_topk_status(self, scores: np.ndarray, k: int) -> tuple[int, np.ndarray]:
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        b, n = scores.shape
        kept = np.full((b, max(k, 0)), -1, dtype=np.int64)
        status = self.lib.vlmp_select_topk_cpu(scores.ctypes.data, b, n, k, kept.ctypes.data)
        return status, kept

    def select_topk(self, scores: np.ndarray, k: int) -> np.ndarray:
        status, kept = self.select_topk_status(scores, k)
        assert status == VLMP_OK
        return kept

    def gather_summary_status(self, hidden: np.ndarray, kept: np.ndarray, has_cls: int) -> tuple[int, np.ndarray]:
        hidden = np.ascontiguousarray(hidden)
        kept = np.ascontiguousarray(kept, dtype=np.int64)
        b, t, d = hidden.shape
        k = kept.shape[1]
        out = np.full((b, has_cls + k + 1, d), np.nan, dtype=hidden.dtype)
        status = self.lib.vlmp_gather_summary_cpu(DTYPES[hidden.dtype], hidden.ctypes.data, b, t, d, has_cls,
                                                  kept.ctypes.data, k, out.ctypes.data)
        return status, out

    def gather_summary(self, hidden: np.ndarray, kept: np.ndarray, has_cls: int) -> np.ndarray:
        status, out = self.gather_summary_status(hidden, kept, has_cls)
        assert status == VLMP_OK
        return out

    def cls_scores_status(self, q, k, *, k_transposed: bool, scale: float, has_cls: int, int8: bool):
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k, dtype=q.dtype)
        b, h, t, dh = q.shape
        scores = np.full((b, t - has_cls), np.nan, dtype=np.float32)
        status = self.lib.vlmp_cls_scores_cpu(DTYPES[q.dtype], q.ctypes.data, k.ctypes.data, b, h, t, dh,
                                              int(k_transposed), scale, has_cls, int(int8), scores.ctypes.data)
        return status, scores

    def cls_scores(self, q, k, **kw) -> np.ndarray:
        status, scores = self.cls_scores_status(q, k, **kw)
        assert status == VLMP_OK
        return scores

    def divprune_select_status(self, dist: np.ndarray, k: int) -> tuple[int, np.ndarray]:
        dist = np.ascontiguousarray(dist, dtype=np.float32)
        b, n, _ = dist.shape
        picks = np.full((b, max(k, 0)), -1, dtype=np.int64)
        status = self.lib.vlmp_divprune_select_cpu(dist.ctypes.data, b, n, k, picks.ctypes.data)
        return status, picks

    def divprune_select(self, dist: np.ndarray, k: int) -> np.ndarray:
        status, picks = self.divprune_select_status(dist, k)
        assert status == VLMP_OK
        return picks


# ------------------------------------------------------------------ references


def ref_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """TopK per row, ties towards the lower index, kept indices ascending."""
    rows = []
    for row in np.asarray(scores, dtype=np.float64):
        order = np.lexsort((np.arange(row.size), -row))  # last key is primary: score descending
        rows.append(np.sort(order[:k]))
    return np.stack(rows).astype(np.int64)


def ref_gather_summary(hidden: np.ndarray, kept: np.ndarray, has_cls: int) -> np.ndarray:
    """[CLS] + kept tokens (exact copies) + fp64 mean of the pruned tokens, in hidden's dtype."""
    b, t, d = hidden.shape
    n, k = t - has_cls, kept.shape[1]
    patches = hidden[:, has_cls:]
    pruned = np.ones((b, n), dtype=bool)
    np.put_along_axis(pruned, kept, False, axis=1)
    summary = (patches.astype(np.float64) * pruned[..., None]).sum(axis=1) / (n - k)
    gathered = np.take_along_axis(patches, kept[..., None], axis=1)
    parts = ([hidden[:, :1]] if has_cls else []) + [gathered, summary[:, None, :].astype(hidden.dtype)]
    return np.concatenate(parts, axis=1)


def ref_cls_scores(q, k, *, k_transposed: bool, scale: float, has_cls: int, int8: bool = False) -> np.ndarray:
    """Mean over heads of softmax(scale * q_cls . K^T)[has_cls:], in fp64 (int8: same quantiser as the kernels)."""
    q_cls = q[:, :, 0, :].astype(np.float32)
    keys = (np.swapaxes(k, 2, 3) if k_transposed else k).astype(np.float32)  # [B, H, T, dh]
    if int8:
        blk = rotation_block(q_cls.shape[-1])
        step, q_c = quantize_query(hadamard_blocks(q_cls, blk))
        mean = keys.astype(np.float64).mean(axis=2, keepdims=True).astype(np.float32)  # centring: exact for softmax
        k_s, k_i = quantize_per_vector(hadamard_blocks((keys - mean).astype(np.float32), blk))
        dot = np.einsum("bhd,bhtd->bht", q_c.astype(np.int64), k_i.astype(np.int64)).astype(np.float32)
        logits = (np.float32(scale) / np.float32(blk)) * ((step[..., None] * k_s) * dot)
    else:
        logits = scale * np.einsum("bhd,bhtd->bht", q_cls.astype(np.float64), keys.astype(np.float64))
    logits = logits.astype(np.float64)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    attn = e / e.sum(axis=-1, keepdims=True)
    return attn[:, :, has_cls:].mean(axis=1)


def ref_divprune(dist: np.ndarray, k: int) -> np.ndarray:
    """DivPrune's greedy picks [B, K] in pick order, written as the contract reads (kernels.h).

    All in fp32: the column minimum off the diagonal picks first, then the running
    minimum of the picked rows with picked tokens at -inf; np.argmax takes the first
    maximum, i.e. ties go to the lowest index.
    """
    dist = np.asarray(dist, dtype=np.float32)
    b, n, _ = dist.shape
    picks = np.empty((b, k), dtype=np.int64)
    for i in range(b):
        d = dist[i]
        candidates = np.where(np.eye(n, dtype=bool), np.float32(np.inf), d).min(axis=0)
        picked = np.zeros(n, dtype=bool)
        running = None
        for step in range(k):
            pick = int(np.argmax(candidates))
            picks[i, step] = pick
            picked[pick] = True
            running = d[pick].copy() if running is None else np.minimum(running, d[pick])
            candidates = np.where(picked, np.float32(-np.inf), running)
    return picks


def cosine_distances(rng: np.random.Generator, b: int, n: int, dim: int = 64) -> np.ndarray:
    """1 - cosine between random token rows, in fp32 as the graph computes it: [B, N, N]."""
    tokens = rng.standard_normal((b, n, dim)).astype(np.float32)
    unit = tokens / np.maximum(np.linalg.norm(tokens, axis=-1, keepdims=True), np.float32(1e-12))
    return (np.float32(1) - unit @ np.swapaxes(unit, 1, 2)).astype(np.float32)


def quantize_per_vector(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over the last axis, exactly as the kernels do it in fp32."""
    x = x.astype(np.float32)
    max_abs = np.abs(x).max(axis=-1)
    scale = np.where(max_abs > 0, max_abs / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int32)
    return scale, q


def rotation_block(dh: int) -> int:
    """The int8 scorer's Hadamard block: the largest power of two dividing dh, at most 64 (kernels.h)."""
    return min(dh & -dh, 64)


def hadamard_blocks(x: np.ndarray, blk: int) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform of every blk-wide block of the last axis, in fp32 with the
    kernels' butterfly order (adds and subtracts only, so every step rounds as theirs do)."""
    x = np.array(x, dtype=np.float32, copy=True)
    shape = x.shape
    x = x.reshape(*shape[:-1], shape[-1] // blk, blk)
    length = 1
    while length < blk:
        y = x.reshape(*x.shape[:-1], blk // (2 * length), 2, length)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*shape[:-1], shape[-1] // blk, blk)
        length *= 2
    return x.reshape(shape)


def quantize_query(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The query in two int8 limbs, combined: qc = 127 * hi + lo, x ~= (s / 127) * qc (kernels.h). The residual
    x - s * hi is computed exactly (in fp64) and rounded once to fp32, which is what the kernels' fma does."""
    x = x.astype(np.float32)
    s, hi = quantize_per_vector(x)
    step = (s / np.float32(127)).astype(np.float32)
    r = (x.astype(np.float64) - s[..., None].astype(np.float64) * hi).astype(np.float32)
    lo = np.clip(np.rint(r / step[..., None]), -127, 127).astype(np.int32)
    return step, 127 * hi + lo


def tied_scores(rng: np.random.Generator, b: int, n: int, levels: int = 7) -> np.ndarray:
    """Scores drawn from a few values only, so the K-th boundary always falls inside a tie."""
    return (rng.integers(0, levels, size=(b, n)) / levels).astype(np.float32)


def attention_like_qk(rng: np.random.Generator, b: int, h: int, t: int, dh: int) -> tuple[np.ndarray, np.ndarray]:
    """q, k [B, H, T, dh] whose [CLS] attention looks like a ViT's: a few sink tokens,
    a heavy-tailed spread over the rest, and a component shared by all keys."""
    shared = rng.standard_normal((b, h, 1, dh))
    k = 0.6 * shared + rng.standard_normal((b, h, t, dh)) * rng.lognormal(0.0, 0.35, size=(b, h, t, 1))
    q = rng.standard_normal((b, h, t, dh)) * 1.5
    q_dir = q[:, :, 0, :] / np.linalg.norm(q[:, :, 0, :], axis=-1, keepdims=True)  # [B, H, dh]
    for i in range(b):
        for s in rng.choice(np.arange(1, t), size=4, replace=False):
            k[i, :, s, :] += 2.5 * q_dir[i]
    return q.astype(np.float32), k.astype(np.float32)
