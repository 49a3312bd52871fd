"""tools/bench_llm_fusion.py on a tiny Qwen2 decoder: the graphs it times are the ones it names (each fusion's op
counts), they compute the same logits, and the run times every graph in every round and prints the table."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "tools"))
sys.path.insert(0, str(HERE.parents[1] / "compiler"))
import bench_llm_fusion as bench  # noqa: E402
from test_fastv import tiny_lm  # noqa: E402

LAYERS = 2


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return bench.graphs(tmp_path_factory.mktemp("llm_fusion"), lambda _line: None, genai=False,
                        lm=tiny_lm("qwen2", layers=LAYERS, seed=3))


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_each_graph_is_the_fusion_it_names(paths):
    assert list(paths) == [bench.UNFUSED, bench.ATTENTION, bench.NORMS, bench.GQA, bench.SHIPPED]
    unfused, attention, norms, gqa, shipped = (_ops(paths[name]) for name in paths)
    assert "MultiHeadAttention" not in unfused and unfused.count("Where") == LAYERS  # the per-layer causal mask
    assert attention.count("MultiHeadAttention") == LAYERS and "SkipSimplifiedLayerNormalization" not in attention
    # every norm right after a residual Add: all 2·layers + 1 but the first layer's input norm and the final one (it
    # reads the last row's Slice)
    assert norms.count("MultiHeadAttention") == LAYERS
    assert norms.count("SkipSimplifiedLayerNormalization") == 2 * LAYERS - 1
    assert attention.count("Pow") == 2 * LAYERS + 1 and norms.count("Pow") == 2
    # the tiny Qwen2 shares its key/value heads (4 query heads, 2 key/value heads)
    assert gqa.count("GroupQueryAttention") == LAYERS and "MultiHeadAttention" not in gqa
    assert gqa.count("Unsqueeze") == norms.count("Unsqueeze") - 2 * LAYERS  # repeat_kv's, for K and V: gone
    assert gqa.count("SkipSimplifiedLayerNormalization") == 2 * LAYERS - 1 and "RotaryEmbedding" not in gqa
    # what target ort ships: that, and q's and K's rotation in every layer one op
    assert shipped.count("GroupQueryAttention") == LAYERS and shipped.count("RotaryEmbedding") == 2 * LAYERS
    assert "Neg" not in shipped and shipped.count("SkipSimplifiedLayerNormalization") == 2 * LAYERS - 1


def test_the_graphs_agree_and_every_round_times_every_graph(paths):
    outputs = {}
    times, _load = bench.time_graphs(paths, tokens=12, rounds=3, log=lambda _line: None, heads=4, outputs=outputs)
    assert {name: len(t) for name, t in times.items()} == {name: 3 for name in paths}
    assert all(t > 0 for values in times.values() for t in values)
    reference = outputs[bench.UNFUSED]
    for name in (bench.ATTENTION, bench.NORMS, bench.GQA, bench.SHIPPED):
        np.testing.assert_allclose(outputs[name], reference, rtol=0, atol=1e-4)
    lines = bench.table(times, 12)
    assert lines[0].startswith("prefill of 12 tokens") and len(lines) == 4 + len(paths)
    assert lines[4].startswith(f"| {bench.UNFUSED} |") and "| 1.000x |" in lines[4]


def test_bad_counts_are_one_line(capsys):
    assert bench.main(["--rounds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --rounds must be at least 1, got 0"]
