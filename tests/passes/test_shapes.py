"""FoldStaticDimsPass (passes.shapes): run-time sizes read from static dims fold; the batch stays dynamic."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from vlmprune.passes.shapes import FoldStaticDimsPass
from vlmprune.targets.runtime import ort_session

# The TorchScript exporter's form: scalar Gathers and a Slice of Shape(x), arithmetic, then the sizes of a Reshape.
TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[batch, 3, 8, 8] x) => (float[batch, 3, N] y) {
    s = Shape(x)
    i0 = Constant<value = int64[1] {0}>()
    i2 = Constant<value = int64 {2}>()
    b = Gather(s, i0)
    h = Gather(s, i2)
    st = Constant<value = int64[1] {3}>()
    en = Constant<value = int64[1] {4}>()
    w = Slice(s, st, en)
    ax = Constant<value = int64[1] {0}>()
    h1 = Unsqueeze(h, ax)
    n = Mul(h1, w)
    c3 = Constant<value = int64[1] {3}>()
    target = Concat<axis = 0>(b, c3, n)
    y = Reshape(x, target)
}
"""


def _model(text: str = TEXT) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


def test_static_dims_fold_and_the_batch_stays_dynamic():
    model = _model()
    result = FoldStaticDimsPass()(model)
    assert result.modified
    ops = [n.op_type for n in model.graph if n.op_type != "Constant"]
    assert ops == ["Shape", "Gather", "Concat", "Reshape"]  # only the batch is read at run time
    shape = model.graph.outputs[0].shape
    assert not isinstance(shape[0], int) and list(shape)[1:] == [3, 64]
    x = np.random.default_rng(0).standard_normal((5, 3, 8, 8)).astype(np.float32)
    session = ort_session(ir.serde.serialize_model(model).SerializeToString())
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.reshape(5, 3, 64))
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def test_dynamic_dims_are_left_and_it_says_so():
    model = _model(TEXT.replace("float[batch, 3, 8, 8] x", "float[batch, 3, H, W] x"))
    ops = [n.op_type for n in model.graph]
    assert not FoldStaticDimsPass()(model).modified
    assert [n.op_type for n in model.graph] == ops
