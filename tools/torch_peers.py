"""The fastest PyTorch peers of a lower-precision bundle, for tools/bench_tower.py and tools/bench_int8.py.

A PyTorch user who wants int8 on a CPU quantizes too, and one on a CPU with AVX-512 bf16 or
AMX runs bf16 autocast: an int8 or bf16 figure of the product is only honest beside those.
Each peer is the same pipeline and the same reference pruner as the fp32 rows (pruned the
same way, at the same site), under torch.compile (inductor, weights frozen, as the fp32
torch.compile rows run):

- int8: torchao's int8 dynamic quantization (Int8DynamicActivationInt8WeightConfig: weights
  int8 per channel, activations int8 per token at run time), on every nn.Linear of a deep
  copy (the fp32 rows keep their weights). torch.ao.quantization.quantize_dynamic is
  deprecated in its favour. The patch embedding (a Conv) stays fp32, as in torchao's default.
- bf16: torch.autocast("cpu", bfloat16) around the compiled module; its outputs are cast
  back to fp32 before they are compared.

Quality is reported as the int8 bundle's is (tools/bench_int8.py): the kept-set agreement
(intersection over K, mean over images) and the minimum per-token cosine of the features
against the fp32 reference.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


def torchao_available() -> str | None:
    """None when torchao imports, else the reason its row is left out (the benchmark says so)."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:  # the `bench` extra brings it
        return f"torchao is not installed ({exc}); pip install 'vlmprune[bench]'"
    return None


def int8_module(pipeline: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of pipeline with every nn.Linear quantized by torchao's int8 dynamic quantization."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantized = copy.deepcopy(pipeline)
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    return quantized


def compiled_int8(pipeline: torch.nn.Module, pruner) -> torch.nn.Module:
    """torch.compile of the int8-quantized pipeline with the given reference pruner (None: dense)."""
    return torch.compile(int8_module(pipeline).with_pruner(pruner), backend="inductor")


def compiled_bf16(pipeline: torch.nn.Module, pruner):
    """A callable running torch.compile of pipeline.with_pruner(pruner) under CPU bf16 autocast, outputs in fp32."""
    compiled = torch.compile(pipeline.with_pruner(pruner), backend="inductor")

    def run(x: torch.Tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        if isinstance(out, tuple):
            return (out[0].float(), *out[1:])
        return out.float()

    return run


def quality(ref, got) -> tuple[float | None, float]:
    """(kept-set agreement or None for a dense output, min per-token cosine) of got against the fp32 ref.

    ref and got are features [B, T, D] or (features, kept_indices [B, K]), torch or numpy.
    """
    ref_h, ref_k = (ref, None) if isinstance(ref, (torch.Tensor, np.ndarray)) else ref
    h, k = (got, None) if isinstance(got, (torch.Tensor, np.ndarray)) else got
    a = np.asarray(torch.as_tensor(np.asarray(ref_h)), dtype=np.float64)
    b = np.asarray(torch.as_tensor(np.asarray(h)).float(), dtype=np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    if ref_k is None:
        return None, float(cos.min())
    ref_k, k = np.asarray(ref_k), np.asarray(k)
    kept = [len(np.intersect1d(x, y)) / x.size for x, y in zip(ref_k, k)]
    return float(np.mean(kept)), float(cos.min())


def describe(ref, got) -> str:
    """quality() as bench_tower's agreement column writes it."""
    agreement, cos = quality(ref, got)
    return (f"min cos={cos:.4f}" if agreement is None
            else f"kept agreement={agreement:.4f}, min cos={cos:.4f}")
