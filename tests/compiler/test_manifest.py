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
from vlmprune.passes.methods import METHODS, method_of
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
    assert m.method.params["lambda"] == 0.3 and isinstance(method_of(m.method), METHODS["cls"])
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
    dense = method_of(m.method)
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


def library_findings(scan) -> list[str]:
    """`path:line` of every line scan(text) flags in the library's modules (compiler, passes, targets, tools), but
    the Manifest's own module and the readers RAW_ALLOWED names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("compiler", "passes", "targets", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel not in RAW_ALLOWED:
                found += [f"{rel}:{line}" for line in scan(path.read_text())]
    return found


def test_no_raw_manifest_subscript_outside_manifest():
    found = library_findings(raw_manifest_subscripts)
    assert not found, "raw manifest subscripts (read the Manifest views instead):\n" + "\n".join(found)


# The merging tower's counts (m.model.token_counts) that the model view names as fields of its own.
TOKEN_COUNT_FIELDS = ("video_frames", "merged_grid_thw")


def view_fields() -> dict[str, set[str]]:
    """The keys each typed view names, by the attribute that reaches it (m.method, m.model.token_counts, ...).

    A subscript of a view by one of these spells a key the view already spells: the view's field is read instead.
    A target's own fields (m.target.get("qdq_model")) are no view's, so they stay subscripts."""
    from vlmprune.compiler.bundle import manifest as views

    def named(cls) -> set[str]:
        return {name for name, value in vars(cls).items() if isinstance(value, property)}

    return {"target": named(views.TargetSection), "model": named(views.ModelSection),
            "method": named(views.MethodSection), "preprocess": named(views.PreprocessSection),
            "llm": named(views.LlmSection), "parity": named(views.ParitySection),
            "keep_auto": named(views.KeepAutoSection), "token_counts": set(TOKEN_COUNT_FIELDS)}


def test_the_token_count_fields_are_the_model_views():
    from vlmprune.compiler.bundle.manifest import ModelSection

    for name in TOKEN_COUNT_FIELDS:
        assert getattr(ModelSection({"token_counts": {name: "read"}}), name) == "read", name


def _own_nodes(scope):
    """The nodes of one scope (the module, or a function), not those of the functions defined inside it."""
    import ast

    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))


def view_subscripts(source: str) -> list[int]:
    """Lines where a manifest view (manifest.method, m.model.token_counts, or a name the same function bound to
    one) is subscripted, or read with .get, by a key its view names."""
    import ast

    fields = view_fields()

    def section_of(node, aliases: dict[str, str]) -> str | None:
        """The view a node reads: `<manifest or m>.<section>` (a chain: x.manifest.method), or a name bound to one."""
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr in fields:
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr in fields:  # m.model.token_counts
                return node.attr if section_of(base, aliases) else None
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            return node.attr if name in ("manifest", "m") else None
        return None

    tree = ast.parse(source)
    found = []
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        nodes = list(_own_nodes(scope))
        aliases: dict[str, str] = {}
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                section = section_of(node.value, {})
                if section:
                    aliases[node.targets[0].id] = section
        for node in nodes:
            section = key = None
            if isinstance(node, ast.Subscript):
                section, key = section_of(node.value, aliases), node.slice
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args):
                section, key = section_of(node.func.value, aliases), node.args[0]
            if section and isinstance(key, ast.Constant) and key.value in fields[section]:
                found.append(node.lineno)
    return sorted(found)


def test_the_view_scan_finds_fields_read_past_their_view():
    raw = ('a = manifest.model.get("token_counts")\n'
           'b = m.model.token_counts["merged_grid_thw"]\n'
           'method = manifest.method\nc = method.get("kept_count", 3)\n'
           'd = result.manifest.keep_auto["curve"]\n'
           'e = m.target.get("qdq_model")\nf = manifest.model.token_counts\ng = other.method["keep"]\n'
           'h = manifest.llm.rows["prefix"]\n'
           'def f(method):\n    return method.get("keep")\n'
           'def g(manifest):\n    counts = manifest.model.token_counts\n    return counts["video_frames"], counts["tokens"]\n')
    assert view_subscripts(raw) == [1, 2, 4, 5, 14]


def test_no_view_field_read_past_its_view():
    found = library_findings(view_subscripts)
    assert not found, "fields read past their view (read the view's field instead):\n" + "\n".join(found)


# The readers of finished bundles that take the Manifest (or the typed record they need: an input's Tensor, the
# keep_auto section), never the raw dict: what they read is what the views name.
TYPED_READERS = ("compiler/benchmark.py", "compiler/report.py", "compiler/pictures.py")


def untyped_manifest_parameters(source: str, names: tuple[str, ...] = ("manifest", "m")) -> list[int]:
    """Lines of a parameter named manifest (or m, or one of names) that is not annotated Manifest."""
    import ast

    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.arg) and node.arg in names
                  and not (isinstance(node.annotation, ast.Name) and node.annotation.id == "Manifest"))


def test_the_parameter_scan_finds_a_dict_manifest():
    source = "def a(manifest: dict):\n    pass\ndef b(x, manifest: Manifest, m=None):\n    pass\n"
    assert untyped_manifest_parameters(source) == [1, 3]


def test_reports_pictures_and_benchmarks_take_the_manifest_typed():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = [f"{rel}:{line}" for rel in TYPED_READERS
             for line in untyped_manifest_parameters((root / rel).read_text())]
    assert not found, "manifest parameters not typed Manifest:\n" + "\n".join(found)


# Where a `manifest: dict` parameter may stay, and why: the raw dict handed to (or read by) code that cannot take the
# typed Manifest.
DICT_ALLOWED = {
    "targets/trt_engine.py": "the TensorRT targets' on-device script: it imports nothing of vlmprune (Python 3.8 on "
                             "JetPack, TensorRT alone), so it reads the manifest's JSON as a dict",
}


def dict_manifest_parameters(source: str) -> list[int]:
    """Lines of a parameter named manifest (or m) annotated `dict` (bare, `dict[...]`, or `typing.Dict`)."""
    import ast

    def is_dict(annotation) -> bool:
        if isinstance(annotation, ast.Subscript):
            annotation = annotation.value
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
            return is_dict(ast.parse(annotation.value, mode="eval").body)
        name = (annotation.id if isinstance(annotation, ast.Name)
                else annotation.attr if isinstance(annotation, ast.Attribute) else None)
        return name in ("dict", "Dict")

    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.arg) and node.arg in ("manifest", "m") and node.annotation is not None
                  and is_dict(node.annotation))


def test_the_dict_scan_finds_a_dict_manifest_and_passes_a_typed_one():
    source = ("def a(manifest: dict):\n    pass\n"
              "def b(x, manifest: Manifest, m=None):\n    pass\n"
              "class T:\n    def c(self, bundle_dir, manifest: dict[str, object], context=None):\n        pass\n"
              "def d(m: 'dict'):\n    pass\n"
              "def e(*, manifest: typing.Dict):\n    pass\n"
              "def f(manifest):\n    pass\n")
    assert dict_manifest_parameters(source) == [1, 6, 8, 10]


def test_no_library_function_takes_the_manifest_as_a_dict():
    """Every step takes the typed Manifest (compiler.contract, importable from any layer): the families' README
    sections, the LLM exporters, the targets' stages, runners and READMEs, the passes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("compiler", "passes", "targets", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel not in DICT_ALLOWED:
                found += [f"{rel}:{line}" for line in dict_manifest_parameters(path.read_text())]
    assert not found, "manifest parameters typed dict (take compiler.contract.Manifest):\n" + "\n".join(found)


def test_every_library_parameter_named_manifest_is_a_manifest():
    """Not only no dict: a parameter named manifest in the library (compiler, passes, targets) is annotated Manifest,
    so that what a function reads of it is what the views name (trt_engine.py excepted: DICT_ALLOWED)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = [f"{path.relative_to(root)}:{line}" for folder in ("compiler", "passes", "targets")
             for path in sorted((root / folder).rglob("*.py")) if str(path.relative_to(root)) not in DICT_ALLOWED
             for line in untyped_manifest_parameters(path.read_text(), ("manifest",))]
    assert not found, "manifest parameters not annotated Manifest:\n" + "\n".join(found)


def _masked(raw: dict) -> dict:
    """The manifest with the values that depend on the machine, not on vlmprune's code, masked (keys and order kept):
    the versions of Python, torch and the toolchain, the weights' and files' digests, parity's measured figures."""

    def floats(value):
        if isinstance(value, float):
            return "<float>"
        if isinstance(value, dict):
            return {k: floats(v) for k, v in value.items()}
        if isinstance(value, list):
            return [floats(v) for v in value]
        return value

    out = dict(raw)
    out["host"] = {k: "<host>" for k in raw["host"]}
    out["target"] = {**raw["target"], "toolchain": {k: "<version>" for k in raw["target"]["toolchain"]}}
    out["model"] = {**raw["model"], "sha256": "<sha256>"}
    out["parity"] = floats(raw["parity"])
    out["files"] = {k: "<sha256>" for k in raw["files"]}
    out["manifest_sha256"] = "<sha256>"
    return out


# sha256 of the demo bundle's masked manifest.json (_masked, written as the compile writes it), computed from the code
# before the manifest's views moved into the contract: what a bundle records did not change with the types.
DEMO_MANIFEST_MASKED_SHA256 = "38c532b05bda47cf355ff937a68972eccbadc4ace5a912dc54c64d97e6a8fe14"


def test_a_compiled_bundle_s_manifest_json_is_byte_for_byte_what_it_was(demo_bundle, tmp_path):
    import hashlib

    text = (demo_bundle.bundle / MANIFEST).read_text()
    raw = json.loads(text)
    assert text == json.dumps(raw, indent=2) + "\n"  # written as json.dumps(indent=2): the masking keeps its bytes
    masked = json.dumps(_masked(raw), indent=2) + "\n"
    digest = hashlib.sha256(masked.encode()).hexdigest()
    assert digest == DEMO_MANIFEST_MASKED_SHA256, f"{digest}\n{masked}"
    copy = tmp_path / "bundle"  # the bundle is shared: rewrite a copy's manifest
    shutil.copytree(demo_bundle.bundle, copy)
    rewritten = bundle.write_manifest(copy, Manifest(raw))  # the same files: the same manifest, byte for byte
    assert json.dumps(rewritten, indent=2) + "\n" == text == (copy / MANIFEST).read_text()
