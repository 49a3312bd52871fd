"""tools/bench_methods.py's selection row: the method's own nodes cut out of the compiled tower, on its own values."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_methods
from vlmprune.compiler.contract import KEPT, ROLE, WEIGHTS
from vlmprune.compiler.frontend import export_onnx, load_source
from vlmprune.compiler.frontend.images import parity_inputs
from vlmprune.compiler.pipeline import CompileOptions
from vlmprune.passes.graph.structure import find_tower_structure
from vlmprune.passes.methods import get_method
from vlmprune.passes.methods.builder import role_of
from vlmprune.targets.ort import library
from vlmprune.targets.runtime import ort_session


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    source = load_source("demo")
    model = export_onnx(source.pipeline, source.image_size, 1, 18)
    ir.external_data.unload_from_model(model, folder, WEIGHTS, size_threshold_bytes=1024)
    ir.save(model, folder / "dense.onnx")
    x, _ = parity_inputs(1, source.image_size, source.mean, source.std)
    return folder, find_tower_structure(ir.load(folder / "dense.onnx").graph), x


def _compiled(folder: Path, name: str, layer: int | None = None) -> ir.Model:
    method = get_method(name)
    return bench_methods.compile_ort(folder / "dense.onnx", method, method.parse(64, {}),
                                     CompileOptions(method=name, keep=64), layer)


# What each emission reads from the tower, by the structure of the dense graph (not by what the cut found):
# cls after block 2: that block's output, Q and K (blocks 3..6, rewired to 65 tokens, are not in the cut);
# holov: the projector output and the last block's Q and K; cdpruner: the projector output, the last block's
# output, and the text_embeds graph input (and a Loop whose body reads outer values).
CASES = {
    "cls": (2, lambda s: {s.blocks[1].output.name, s.blocks[1].q.name, s.blocks[1].k.name}),
    "holov": (None, lambda s: {"image_features.dense", s.blocks[-1].q.name, s.blocks[-1].k.name}),
    "cdpruner": (None, lambda s: {"image_features.dense", s.blocks[-1].output.name, "text_embeds"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cut_is_the_methods_nodes_and_gives_the_towers_outputs(dense, name):
    folder, structure, x = dense
    layer, wanted = CASES[name]
    model = _compiled(folder, name, layer)
    ir.save(model, folder / f"{name}.onnx")
    tower = ort_session(folder / f"{name}.onnx", (library(),))
    feed = bench_methods.tower_feed(tower, x)
    towers = dict(zip([o.name for o in tower.get_outputs()], tower.run(None, feed), strict=True))
    role_nodes = [n for n in model.graph if role_of(n) is not None]
    cut = bench_methods.cut_selection(model)
    nodes = cut.model.graph.node
    assert len(nodes) == cut.ops == len(role_nodes)
    assert all(any(p.key == ROLE for p in node.metadata_props) for node in nodes)  # no tower node in it
    assert set(cut.tower_values + cut.graph_inputs) == wanted(structure)
    assert (cut.body_ops > 0) == (name == "cdpruner")  # the Loop's body travels with it
    assert KEPT in cut.outputs
    path = folder / f"{name}.selection.onnx"
    onnx.save(cut.model, path)
    onnx.checker.check_model(path, full_check=True)
    seen = bench_methods.capture(model, cut.tower_values + cut.outputs, folder / f"{name}.capture.onnx", feed,
                                 (library(),))
    inputs = {**{k: seen[k] for k in cut.tower_values}, **{k: feed[k] for k in cut.graph_inputs}}
    session = ort_session(path, (library(),))
    bench_methods._check_cut(name, session, inputs, {k: seen[k] for k in cut.outputs})
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))
    np.testing.assert_array_equal(got[KEPT], towers[KEPT])  # and the timed tower's own kept indices
    with pytest.raises(RuntimeError, match="differs"):  # the check can fail: other tokens give other outputs
        bench_methods._check_cut(name, session, {k: v[..., ::-1].copy() for k, v in inputs.items()},
                                  {k: seen[k] for k in cut.outputs})


def test_a_custom_op_without_a_role_is_refused(dense):
    """Fused ops inherit their pattern's role; one that did not could not be told from the tower, so the cut stops."""
    model = _compiled(dense[0], "cls")
    fused = next(n for n in model.graph if n.domain == "vlmprune")
    del fused.metadata_props[ROLE]
    with pytest.raises(RuntimeError, match="without a role"):
        bench_methods.cut_selection(model)
