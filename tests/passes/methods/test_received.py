"""The received-attention score (cls --score attention, passes.methods.received): its numbers against an explicit
loop at a fixed seed, the options and sites it refuses, and a graph without merged tokens refused by structure.

The Qwen2-VL / Qwen2.5-VL end-to-end checks (against transformers' own attention weights, compiled on ort with
parity) are in tests/compiler/test_qwen2_vl.py.
"""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch

from vlmprune.compiler.errors import InputError, StructureError
from vlmprune.compiler.frontend import export_onnx
from vlmprune.compiler.frontend.clip import build_tower, tower_parts
from vlmprune.compiler.frontend.tower import VisionPipeline
from vlmprune.passes.methods import get_method
from vlmprune.compiler.contract import SITE_FEATURES
from vlmprune.passes.methods.base import SiteSpec
from vlmprune.passes.methods.received import received_attention
from vlmprune.passes.prune import InsertPruningPass

CLS = get_method("cls")


def test_received_attention_is_the_mean_column_of_the_attention():
    g = torch.Generator().manual_seed(5)
    b, h, t, d, m = 2, 3, 12, 4, 3
    q, k = torch.randn(b, h, t, d, generator=g, dtype=torch.float64), torch.randn(b, h, t, d, generator=g,
                                                                                   dtype=torch.float64)
    got = received_attention(q, k, 0.5, m)
    expected = torch.zeros(b, m, dtype=torch.float64)
    for i in range(b):
        column = torch.zeros(t, dtype=torch.float64)
        for head in range(h):
            for query in range(t):
                logits = torch.tensor([float(q[i, head, query] @ k[i, head, key]) * 0.5 for key in range(t)])
                column += torch.softmax(logits.double(), dim=0)
        column /= h * t
        for token in range(m):
            expected[i, token] = column[token * (t // m):(token + 1) * (t // m)].mean()
    torch.testing.assert_close(got, expected)
    assert torch.allclose(got.sum(dim=-1) * (t // m), torch.ones(b, dtype=torch.float64))  # a distribution
    with pytest.raises(StructureError, match="not a multiple of the 5 merged tokens"):
        received_attention(q, k, 0.5, 5)


def test_options_and_sites():
    params = CLS.parse(4, {"score": "attention"})
    assert params == {"keep": 4, "lambda": 0.0, "score": "attention"}
    needs = CLS.needs(params)
    assert needs.site == SITE_FEATURES and not needs.cls and not needs.attention and not needs.pixels
    assert "attention received at the last full-attention block" in CLS.describe(params)
    assert CLS.output_tokens(params) == 5
    CLS.check(params, SiteSpec(16, False, merge=2))
    CLS.check(params, SiteSpec(16, False))  # a graph: the emission checks the structure
    with pytest.raises(InputError, match="needs a tower whose merged tokens are the features"):
        CLS.check(params, SiteSpec(16, False, merge=1))
    with pytest.raises(InputError, match="--lambda of method cls must be 0 with --score attention"):
        CLS.parse(4, {"score": "attention", "lambda": 0.3})
    with pytest.raises(InputError, match="--score of method cls is one of cls, probe, attention, got 'mean'"):
        CLS.parse(4, {"score": "mean"})
    with pytest.raises(InputError, match="--score of method visionzip is one of cls, probe, got 'attention'"):
        get_method("visionzip").parse(8, {"score": "attention"})
    assert CLS.needs(CLS.parse(4, {})).cls  # the default is still [CLS] attention


def test_a_graph_without_merged_tokens_is_refused_by_structure():
    from transformers import SiglipVisionConfig

    torch.manual_seed(3)
    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=56, patch_size=14, vision_use_head=False)
    pipeline = VisionPipeline(tower_parts(build_tower(config), final_norm=True), None, 2, True, False, 14,
                              final_norm=True).eval()
    model = export_onnx(pipeline, 56, None, 18)
    with pytest.raises(StructureError, match="spans 16 tokens, not a whole number"):
        InsertPruningPass(CLS, CLS.parse(4, {"score": "attention"}))(model)
    assert not any(isinstance(v, ir.Value) and v.name == "kept_indices" for v in model.graph.outputs)


def test_an_onnx_clip_source_is_refused_in_one_line(elsewhere_onnx, tmp_path):
    from click.testing import CliRunner

    from vlmprune.compiler.cli import main

    result = CliRunner().invoke(main, ["compile", str(elsewhere_onnx), "-q", "--method", "cls", "--keep", "8",
                                       "--score", "attention", "-o", str(tmp_path / "b")])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "--score attention needs a Qwen2-VL / Qwen2.5-VL directory" in lines[0]  # on loading, before the passes
    assert not (tmp_path / "b").exists()
