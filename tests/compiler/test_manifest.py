"""compiler.bundle.manifest.Manifest: the manifest.json a compile writes, read through typed fields; refused in one line
when a section is missing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from cli_helpers import one_line_error, run_cli
from vlmprune.compiler import bundle
from vlmprune.compiler.contract import FEATURES, KEPT, MANIFEST, PIXELS
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.bundle.manifest import Manifest, manifest_digest
from vlmprune.passes.methods import METHODS
from vlmprune.passes.methods.dense import Dense


def test_typed_fields_read_a_real_bundle_and_keep_its_json(demo_bundle):
    raw = json.loads((demo_bundle.bundle / MANIFEST).read_text())
    m = Manifest.load(demo_bundle.bundle)
    assert m == raw and json.dumps(m, indent=2) + "\n" == (demo_bundle.bundle / MANIFEST).read_text()
    assert manifest_digest(m) == raw["manifest_sha256"]  # what is on disk did not change
    assert isinstance(demo_bundle.manifest, Manifest) and demo_bundle.manifest == raw
    assert (m.target.name, m.target.options, m.target.fused) == ("ort", raw["target"]["options"],
                                                                 raw["target"]["fused"])
    assert m.target.get("custom_op_library") == raw["target"].get("custom_op_library")
    model = raw["model"]
    assert (m.model.source, m.model.kind, m.model.family, m.model.sha256) == (
        "demo", "preset", model["family"], model["sha256"])
    assert (m.model.image_size, m.model.patch_size) == (model["image_size"], model["patch_size"])
    method = raw["method"]
    assert m.method.pruned and (m.method.name, m.method.keep, m.method.layer, m.method.site) == (
        "cls", 192, 2, "block")
    assert (m.method.tokens_in, m.method.tokens_out, m.method.has_cls, m.method.prefix, m.method.params) == (
        method["tokens_in"], method["tokens_out"], method["has_cls"], method["prefix"], method["params"])
    assert m.method.params["lambda"] == 0.3 and isinstance(m.method.method(), METHODS["cls"])
    assert [(t.name, t.shape, t.dtype) for t in m.inputs] == [(PIXELS, raw["inputs"][0]["shape"], "float")]
    assert m.output_names == [FEATURES, KEPT] == [t.name for t in m.outputs]
    assert (m.preprocess.mean, m.preprocess.std, m.preprocess.size) == (
        raw["preprocess"]["mean"], raw["preprocess"]["std"], raw["preprocess"]["size"])
    assert m.compile_options == raw["compile_options"] and m.llm == raw["llm"] and m.llm_graphs is None
    llm = raw["llm"]
    assert (m.llm.image_tokens, m.llm.hidden_size, m.llm.rows, m.llm.dense_image_tokens) == (
        llm["image_tokens"], llm["hidden_size"], llm["rows"], llm["dense_image_tokens"])
    assert m.keep_auto is None and m.method.roi is None  # no --keep auto, no --roi
    assert m.parity.passed is True and m.parity.stages == raw["parity"]["stages"]
    assert m.files == raw["files"] and m.version == raw["vlmprune_version"]
    with pytest.raises(TypeError):
        m.method["name"] = "cls"  # the views are read-only


def test_a_dense_bundle_records_the_dense_method(compiled, tiny_llava_dir):
    m = bundle.load_manifest(compiled(tiny_llava_dir, prune=False).bundle)
    assert isinstance(m, Manifest)
    assert m["method"] == {"name": "none", "summary": "dense (no pruning)"}  # as every dense bundle so far
    assert not m.method.pruned and m.method.prefix is None
    dense = m.method.method()
    assert isinstance(dense, Dense) and not dense.prunes and dense.summary == m.method.summary
    assert all(cls.prunes for cls in METHODS.values())


def test_the_manifest_s_record_is_the_graph_s_and_its_section_round_trips(demo_bundle):
    """The prune record has one writer and one reader per form: the record rebuilt from manifest.json equals the one
    the insertion left in model.decomposed.onnx (so parity's reference, which reads the manifest, runs the method
    the graph runs), and writing it back gives the manifest's method section key for key, in the file's order."""
    import onnx_ir as ir

    from vlmprune.compiler.contract import DECOMPOSED, PruneRecord
    from vlmprune.passes.prune import prune_record

    m = Manifest.load(demo_bundle.bundle)
    graph = prune_record(ir.load(demo_bundle.bundle / DECOMPOSED))
    assert isinstance(graph, PruneRecord) and m.record == graph
    assert json.dumps(graph.manifest_section()) == json.dumps(dict(m.method))  # same keys, same order
    assert PruneRecord.from_json(graph.to_json()) == graph
    assert graph.summary and not graph.summary.endswith("patch tokens)")  # the method's line, not the manifest's
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.layer = 3  # one record for every reader: none edits it under another


def test_a_schedule_s_steps_and_a_variable_k_s_output_round_trip(compiled):
    """The record's optional fields (absent from the IR's JSON where they do not apply) survive the manifest: a
    --schedule's steps, an adaptive budget's num_tokens output (which the manifest lists among the outputs)."""
    import onnx_ir as ir

    from vlmprune.compiler.contract import DECOMPOSED, NUM_TOKENS
    from vlmprune.passes.prune import prune_record

    for options in ({"keep": 32, "method_options": {"schedule": "2,4"}},
                    {"keep": 64, "method_options": {"budget": "adaptive"}}):
        result = compiled("demo", **options)
        graph = prune_record(ir.load(result.bundle / DECOMPOSED))
        assert result.manifest.record == graph
        assert (graph.steps is not None) == ("schedule" in options["method_options"])
        assert (graph.num_tokens == NUM_TOKENS) == ("budget" in options["method_options"])


def test_a_dense_bundle_has_no_record(compiled, tiny_llava_dir):
    assert bundle.load_manifest(compiled(tiny_llava_dir, prune=False).bundle).record is None


@pytest.mark.parametrize("section", ["method", "inputs"])
def test_a_manifest_missing_a_section_is_one_line(demo_bundle, tmp_path, section):
    out = tmp_path / "b"
    shutil.copytree(demo_bundle.bundle, out)  # the compiled bundle is shared
    data = json.loads((out / MANIFEST).read_text())
    del data[section]
    data["manifest_sha256"] = manifest_digest(data)  # edited and re-signed: the digest alone would not tell
    (out / MANIFEST).write_text(json.dumps(data))
    line = (f"{out / MANIFEST}: not a vlmprune manifest (no {section!r} section); the bundle was modified or is not "
            "a vlmprune bundle")
    for verify in (True, False):
        with pytest.raises(InputError) as exc:
            Manifest.load(out, verify=verify)
        assert str(exc.value) == line
    one_line_error(run_cli("inspect", str(out)), line)


# The library reads manifests through the views. Where a raw subscript may stay, and why.
RAW_ALLOWED = {
    "compiler/bundle/manifest.py": "Manifest itself: its views are the one place that spells the keys",
    "targets/trt_engine.py": "the TensorRT targets' on-device script: it runs on the Jetson with TensorRT alone and "
                             "imports nothing of vlmprune, so it reads the manifest's JSON as it is",
}


def raw_manifest_subscripts(source: str) -> list[int]:
    """Lines of `manifest["key"]` (or `x.manifest["key"]`, `m["key"]`) and `manifest.get("key")` in Python source."""
    import ast

    def named_manifest(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        return name in ("manifest", "m")

    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and named_manifest(node.value):
            key = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and named_manifest(node.func.value) and node.args):
            key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append(node.lineno)
    return sorted(found)


def test_the_scan_finds_raw_subscripts_and_passes_views():
    raw = ('a = manifest["model"]["family"]\nb = self.manifest["target"]\nc = m.get("llm")\n'
           'd = manifest.model.family\ne = m.target.get("qdq_model")\nf = other["model"]\n')
    assert raw_manifest_subscripts(raw) == [1, 2, 3]


def test_no_raw_manifest_subscript_outside_manifest():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("compiler", "passes", "targets", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel not in RAW_ALLOWED:
                found += [f"{rel}:{line}" for line in raw_manifest_subscripts(path.read_text())]
    assert not found, "raw manifest subscripts (read the Manifest views instead):\n" + "\n".join(found)
