"""compiler.pipeline.cache: a second compile of the same model reuses the dense export and its parity products.

dart and visionzip are used because they fuse no custom op on ort: a private, empty
VLMPRUNE_CACHE then builds no op library.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from vlmprune.compiler.pipeline import cache
from vlmprune.compiler.pipeline import CompileOptions, compile_model


@pytest.fixture
def products(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VLMPRUNE_PRODUCTS", raising=False)  # the default place: $VLMPRUNE_CACHE/products
    return tmp_path / "cache" / "products"


def _compile(model, out, **options):
    lines = []
    result = compile_model(str(model), out, CompileOptions(**{"keep": 16, **options}), lines.append)
    # a step's line is "[   t s] step"; a parity stage's result comes as its record (StageResult), not a line
    return result, [line.split("] ", 1)[1] if line.startswith("[") else line for line in lines if isinstance(line, str)]


def _entries(products):
    return sorted(p.name for p in products.iterdir() if not p.name.startswith("."))


def _export_key(products):
    return next(json.loads((products / k / cache.ENTRY).read_text())["key"] for k in _entries(products)
                if json.loads((products / k / cache.ENTRY).read_text())["parts"]["product"] == "dense-export")


def test_a_second_compile_with_another_method_reuses_the_dense_products(tiny_clip_dir, products, tmp_path):
    first, first_lines = _compile(tiny_clip_dir, tmp_path / "dart", method="dart")
    assert "export (torch.onnx dynamo, opset 18, batch dynamic)" in first_lines
    assert len(_entries(products)) == 3  # the export, the dense reference, the export stage
    key = _export_key(products)
    second, lines = _compile(tiny_clip_dir, tmp_path / "visionzip", method="visionzip")
    assert f"export (cached: {key[:12]})" in lines
    assert "reference (cached)" in lines and "export parity (cached)" in lines
    assert not any(line.startswith("export (torch.onnx") for line in lines)
    assert len(_entries(products)) == 3  # nothing new: every product was found
    peer, peer_lines = _compile(tiny_clip_dir, tmp_path / "peer", method="visionzip", cache=False)
    assert not any("cached" in line for line in peer_lines)
    assert second.report.to_json() == peer.report.to_json()  # the same figures, to the last bit
    for name in ("model.onnx", "model.decomposed.onnx", "weights.bin", "parity.json"):
        assert (tmp_path / "visionzip" / name).read_bytes() == (tmp_path / "peer" / name).read_bytes(), name
    assert second.report.stages[0].to_json() == first.report.stages[0].to_json()  # the export stage, kept
    # The hit copied the entry's files (no re-serialising), and the bundle stands without the cache.
    assert (tmp_path / "visionzip" / "weights.bin").stat().st_nlink == 1
    import shutil

    from vlmprune.compiler.pipeline import check_bundle

    shutil.rmtree(products)
    assert check_bundle(second.bundle).passed


@pytest.mark.parametrize("change", [{"opset": 17}, {"feature_layer": -2}, {"cls": "keep"}, {"batch": 2}])
def test_what_changes_the_export_is_a_miss(tiny_clip_dir, products, tmp_path, change):
    _compile(tiny_clip_dir, tmp_path / "a", method="dart")
    key = _export_key(products)
    _, lines = _compile(tiny_clip_dir, tmp_path / "b", method="dart", **change)
    assert not any("cached" in line for line in lines)
    assert len(_entries(products)) == 6 and key in _entries(products)


def test_changed_weights_are_a_miss(tiny_clip_dir, products, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_clip_dir, other)
    state = load_file(other / "model.safetensors")
    name = next(k for k in sorted(state) if k.endswith("fc1.weight"))
    state[name] = state[name] * 1.01
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    _compile(tiny_clip_dir, tmp_path / "a", method="dart")
    _, lines = _compile(other, tmp_path / "b", method="dart")
    assert not any("cached" in line for line in lines)
    assert len(_entries(products)) == 6


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_is_rebuilt_not_used(tiny_clip_dir, products, tmp_path, damage):
    _compile(tiny_clip_dir, tmp_path / "a", method="dart")
    key = _export_key(products)
    weights = products / key / cache.WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    result, lines = _compile(tiny_clip_dir, tmp_path / "b", method="visionzip")
    assert f"cache entry {key[:12]} is damaged (weights.bin does not match its sha256): removed, rebuilding" in lines
    assert "export (torch.onnx dynamo, opset 18, batch dynamic)" in lines
    assert result.report.passed
    recorded = json.loads((products / key / cache.ENTRY).read_text())["files"][cache.WEIGHTS]
    assert cache.sha256_file(products / key / cache.WEIGHTS) == recorded  # rebuilt whole
    _, again = _compile(tiny_clip_dir, tmp_path / "c", method="visionzip")
    assert f"export (cached: {key[:12]})" in again


def test_no_cache_writes_nothing(tiny_clip_dir, products, tmp_path):
    result = run_cli("compile", tiny_clip_dir, "--method", "dart", "--keep", 16, "--no-cache", "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output
    assert not products.parent.exists()
    result = run_cli("check", tmp_path / "b", "--no-cache")
    assert result.exit_code == 0, result.output
    assert not products.parent.exists()


def test_check_reuses_the_products_of_the_compile(tiny_clip_dir, products, tmp_path):
    run_cli("compile", tiny_clip_dir, "--method", "dart", "--keep", 16, "-o", tmp_path / "b")
    result = run_cli("check", tmp_path / "b")
    assert result.exit_code == 0, result.output
    lines = [line.split("] ", 1)[-1] for line in result.output.splitlines()]
    assert "reference (cached)" in lines and "export parity (cached)" in lines


@pytest.mark.parametrize("method", ["divprune", "cls"])  # the tower's end (from the dense output), a block
def test_the_pruned_reference_from_the_dense_one_is_the_same(tiny_source, method):
    import numpy as np

    from vlmprune.compiler.parity import reference
    from vlmprune.compiler.contract import PruneRecord
    from vlmprune.compiler.frontend.images import parity_inputs
    from vlmprune.passes.methods import get_method

    params = get_method(method).parse(16, {})
    record = PruneRecord(method, params, get_method(method).needs(params).site, tiny_source.num_blocks)
    pixel, _ = parity_inputs(2, tiny_source.image_size, tiny_source.mean, tiny_source.std)
    dense = reference.dense_reference(tiny_source, pixel)
    _, alone = reference.torch_reference(tiny_source, record, pixel)
    _, shared = reference.torch_reference(tiny_source, record, pixel, dense)
    assert alone.outputs.keys() == shared.outputs.keys()
    for name in alone.outputs:
        np.testing.assert_array_equal(alone.outputs[name], shared.outputs[name])
    assert alone.trace.keys() == shared.trace.keys()
    if method == "divprune":  # the pruner ran on the dense output given, not on another run of the tower
        doubled = reference.Reference({reference.FEATURES: 2 * dense.outputs[reference.FEATURES]})
        _, scaled = reference.torch_reference(tiny_source, record, pixel, doubled)
        np.testing.assert_array_equal(scaled.outputs[reference.KEPT], alone.outputs[reference.KEPT])
        np.testing.assert_allclose(scaled.outputs[reference.FEATURES], 2 * alone.outputs[reference.FEATURES])


def test_the_products_folder_moves_alone(monkeypatch, tmp_path):
    from vlmprune.kernels.build import cache_dir

    monkeypatch.setenv("VLMPRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLMPRUNE_PRODUCTS", str(tmp_path / "products"))
    assert cache.products_dir() == tmp_path / "products"
    assert cache_dir() == tmp_path / "cache"  # the kernels and venvs stay where they are


def test_one_cache_root_for_kernels_and_toolchain_venvs(monkeypatch, tmp_path):
    """The kernel builds and the toolchains' venvs resolve $VLMPRUNE_CACHE in one place (kernels.build.cache_dir):
    two copies had already drifted (one expanded ~, the other did not)."""
    from vlmprune.kernels.build import cache_dir
    from vlmprune.targets import rknn_env, venvs

    assert venvs.cache_dir is cache_dir
    monkeypatch.setenv("VLMPRUNE_CACHE", "~/elsewhere")
    assert rknn_env.ENV.venv_dir().parent == cache_dir() == Path.home() / "elsewhere"


def test_the_least_recently_used_entries_go_when_the_folder_is_over_its_limit(tmp_path, monkeypatch):
    import os

    for age, name in enumerate(("new", "middle", "old")):
        entry = tmp_path / name
        entry.mkdir()
        (entry / "payload").write_bytes(b"x" * 1000)
        (entry / cache.ENTRY).write_text("{}")
        os.utime(entry / cache.ENTRY, (1e9 - age * 100, 1e9 - age * 100))
    (tmp_path / ".half-written").mkdir()  # another compile's temporary folder: never counted nor removed
    monkeypatch.setenv("VLMPRUNE_PRODUCTS_MAX_GB", str(2100 / 1e9))
    assert cache.evict(tmp_path, keep=tmp_path / "new") == ["old"]
    assert cache.evict(tmp_path, keep=tmp_path / "middle") == []  # under the limit now
    monkeypatch.setenv("VLMPRUNE_PRODUCTS_MAX_GB", "0")
    assert cache.evict(tmp_path, keep=tmp_path / "middle") == ["new"]  # the one just written stays, even alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [".half-written", "middle"]


def test_a_compile_keeps_the_folder_within_its_limit(tiny_clip_dir, products, tmp_path, monkeypatch):
    _compile(tiny_clip_dir, tmp_path / "a", method="dart")
    first = set(_entries(products))
    size = sum(f.stat().st_size for e in first for f in (products / e).iterdir())
    monkeypatch.setenv("VLMPRUNE_PRODUCTS_MAX_GB", str(size * 1.5 / 1e9))
    _compile(tiny_clip_dir, tmp_path / "b", method="dart", opset=17)  # three new entries
    left = set(_entries(products))
    assert len(left - first) == 3 and first - left  # the new ones all kept, the oldest gone
    assert sum(f.stat().st_size for e in left for f in (products / e).iterdir()) <= size * 1.5


def test_the_limit_must_be_a_number(monkeypatch):
    from vlmprune.compiler.errors import InputError

    monkeypatch.setenv("VLMPRUNE_PRODUCTS_MAX_GB", "lots")
    with pytest.raises(InputError, match=r"^VLMPRUNE_PRODUCTS_MAX_GB must be a number of gigabytes, got 'lots'$"):
        cache.limit_bytes()


def test_two_writers_of_one_key_leave_one_whole_entry(products):
    """Two compiles of one model at once: both fill a temporary folder; the first rename wins, the second's copy is
    dropped, and both get the published entry."""
    import threading

    barrier = threading.Barrier(2)
    results = []

    def fill(tag):
        def write(folder):
            (folder / "product.bin").write_bytes(b"same bytes")
            barrier.wait(timeout=30)  # both have a whole temporary folder before either publishes
        return lambda: results.append(cache._write("k" * 64, {"product": "test"}, write))

    threads = [threading.Thread(target=fill(tag)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [products / ("k" * 64)] * 2
    assert sorted(p.name for p in products.iterdir()) == ["k" * 64]  # no temporary folder left
    assert cache._read("k" * 64, ("product.bin",), lambda _m: None) == products / ("k" * 64)


def test_a_bad_limit_is_refused_before_the_export(tiny_clip_dir, products, tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPRUNE_PRODUCTS_MAX_GB", "lots")
    from vlmprune.compiler.errors import InputError

    lines = []
    with pytest.raises(InputError, match="^VLMPRUNE_PRODUCTS_MAX_GB must be a number of gigabytes, got 'lots'$"):
        compile_model(str(tiny_clip_dir), tmp_path / "b", CompileOptions(keep=16, method="dart"), lines.append)
    assert not any("export (torch.onnx" in line for line in lines) and not products.exists()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_dense_model_holds_no_torch_weights(tiny_source, products, tmp_path, enabled):
    """Hit, miss or --no-cache, the dense model a compile goes on with reads its weights from the folder's file,
    so that once the reference has run (Source.release_weights) one copy of the weights is left: the graphs'."""
    import onnx_ir as ir

    from vlmprune.compiler.frontend import DenseRequest, family_for

    family = family_for(tiny_source)
    request = DenseRequest(None, 18, None, lambda _m: None)
    model = cache.dense_export(tiny_source, family.id, request, lambda: family.dense_model(tiny_source, request),
                               tmp_path, "dense.onnx", enabled)
    large = [v.const_value for v in model.graph.initializers.values() if v.const_value.nbytes > 1024]
    assert large and all(isinstance(t, ir.ExternalTensor) for t in large), {type(t).__name__ for t in large}
    # nor any value of the graph: the exporter's model keeps torch-backed constants on values besides the
    # initializers (the 2.7 GB a qwen2.5-vl-3b-448 compile held twice)
    values = {v for node in model.graph.all_nodes() for v in (*node.inputs, *node.outputs) if v is not None}
    torch_backed = [v.name for v in values if type(v.const_value).__name__ == "TorchTensor"]
    assert not torch_backed, torch_backed[:5]


def test_released_weights_are_gone_but_the_shape_stays(tiny_clip_dir):
    import torch

    from vlmprune.compiler.frontend import load_source

    source = load_source(str(tiny_clip_dir))
    blocks = source.num_blocks
    source.release_weights()
    assert source.num_blocks == blocks and all(p.is_meta for p in source.pipeline.parameters())
    with pytest.raises(Exception):  # a forward after the release fails loudly instead of computing
        source.pipeline(torch.zeros(1, 3, source.image_size, source.image_size)).numpy()
