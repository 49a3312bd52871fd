"""The Python API (compiler/api/): the README's example as written, and each call's typed result against the
CLI that is a thin layer over it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmprune.compiler import api
from vlmprune.compiler.cli import render
from vlmprune.compiler.errors import InputError
from vlmprune.compiler.bundle.manifest import Manifest
from vlmprune.compiler.parity import ParityReport
from cli_helpers import one_line_error, run_cli

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def bundle(tiny_llava_dir, compiled):
    return compiled(tiny_llava_dir, keep=16).bundle


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    from skimage import data

    path = tmp_path_factory.mktemp("api_photo") / "astronaut.png"
    Image.fromarray(data.astronaut()).save(path)
    return path


def _readme_example() -> str:
    section = README.read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python API section has one example"
    return blocks[0]


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The five lines a user copies: compile the embedded `demo` preset, check it, run it on a photo, print."""
    from skimage import data

    code = _readme_example()
    assert len(code.strip().splitlines()) == 5
    monkeypatch.chdir(tmp_path)
    Image.fromarray(data.chelsea()).save(tmp_path / "photo.jpg")
    names: dict = {}
    exec(compile(code, str(README), "exec"), names)  # noqa: S102 (the README's own code)
    printed = capsys.readouterr().out.split()
    kept = names["result"].kept
    assert printed[0] == "True" and names["report"].passed
    assert kept.shape == (1, 64) and kept.dtype == np.int64
    assert float(printed[-1]) == names["result"].benchmark["latency_ms"]["p50"] > 0
    assert isinstance(names["bundle"].manifest, Manifest) and names["bundle"].manifest.method.keep == 64
    assert (tmp_path / "build" / "demo" / "manifest.json").is_file()


def test_run_returns_arrays_and_the_kept_indices_run_json_prints(bundle, photo):
    result = api.run(bundle, images=[photo])
    assert isinstance(result, api.RunResult)
    assert all(isinstance(v, np.ndarray) for v in result.outputs.values())
    printed = run_cli("run", bundle, "--image", photo, "--json")
    assert printed.exit_code == 0, printed.output
    data = json.loads(printed.stdout)
    assert result.kept.tolist() == data["kept_indices"]
    assert result.to_json() == data
    assert run_cli("run", bundle, "--image", photo).stdout.splitlines() == render.run_lines(result)


def test_run_takes_the_pixel_values_as_an_array_and_reports_the_benchmark_as_data(bundle, photo):
    pixel = api.run(bundle, images=[photo]).inputs
    result = api.run(bundle, inputs=pixel, benchmark=True, warmup=0, iterations=3)
    assert result.kept.tolist() == api.run(bundle, images=[photo]).kept.tolist()
    lat = result.benchmark["latency_ms"]
    assert result.benchmark["iterations"] == 3 and 0 < lat["min"] <= lat["p50"] <= lat["max"]
    with pytest.raises(InputError) as bad:
        api.run(bundle, inputs=pixel.astype(np.float64))
    assert str(bad.value) == "inputs: pixel_values is float64, the bundle takes float32"


def test_check_returns_the_parity_report_as_data(bundle):
    report = api.check(bundle)
    assert isinstance(report, ParityReport) and report.passed is True
    assert [s.stage for s in report.stages] == list(Manifest.load(bundle).parity.stages)
    assert report.to_json()["passed"] is True


def test_inspect_returns_the_manifest_and_prints_what_the_cli_prints(bundle):
    result = api.inspect(bundle)
    assert isinstance(result.manifest, Manifest) and result.manifest.method.keep == 16
    assert result.ops and {"name", "op", "role"} <= set(result.ops[0])
    printed = run_cli("inspect", bundle, "--json")
    assert json.loads(printed.stdout) == json.loads(json.dumps(result.to_json()))
    plain = api.inspect(bundle, ops=False)
    assert plain.ops is None
    assert run_cli("inspect", bundle).stdout.splitlines() == render.inspect_lines(plain)


def test_listings_are_data_and_the_cli_prints_their_lines():
    methods = api.methods()
    assert [m.name for m in methods][0] == "cls" and all(m.targets for m in methods)
    assert run_cli("methods").stdout.splitlines() == [line for m in methods for line in render.method_lines(m)] + \
        render.unavailable_lines(api.unavailable_methods())
    listing = api.targets()
    assert "ort" in [t.name for t in listing.targets if t.available]
    assert run_cli("targets").stdout.splitlines() == render.targets_lines(listing)


@pytest.mark.parametrize("call,args,message,keywords", [
    ("run", [], "give the input either as --image (one or more), as --video PATH or as --load-inputs FILE.npz",
     "give the input either as images (one or more), as video or as inputs"),
    ("run", ["--image", "PHOTO", "--warmup", "2"], "--warmup and --iterations only apply with --benchmark",
     "warmup and iterations only apply with benchmark=True"),
    ("inspect", [], None, None),
])
def test_bad_input_raises_input_error_with_the_clis_message(bundle, photo, tmp_path, call, args, message, keywords):
    """The same error, its options spelled as the caller gave them: keywords through the API, flags on the CLI."""
    if call == "run":
        kwargs = {"images": [photo]} if args else {}
        if "--warmup" in args:
            kwargs["warmup"] = 2
        args = [photo if a == "PHOTO" else a for a in args]
        where = bundle
        with pytest.raises(InputError) as raised:
            api.run(where, **kwargs)
    else:
        where, message = tmp_path / "nothing", f"{tmp_path / 'nothing'}: no such bundle directory"
        keywords = message
        with pytest.raises(InputError) as raised:
            api.inspect(where)
    assert str(raised.value) == keywords
    result = run_cli(call, where, *args)
    one_line_error(result, message)
    assert result.stderr.splitlines() == [f"error: {message}"]


def test_an_existing_file_names_force_as_the_caller_spells_it(tmp_path):
    """`use --force` through the API named a flag a script cannot pass: there it is force=True
    (compiler.errors.option)."""
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    with pytest.raises(InputError) as raised:
        api.eval("demo", images=tmp_path, prompts=tmp_path / "p.txt", report=existing)
    assert str(raised.value) == f"report {existing} already exists (use force=True to replace it)"
    one_line_error(run_cli("eval", "demo", "--images", tmp_path, "--prompts", existing, "--report", existing),
                   f"--report {existing} already exists (use --force to replace it)")


def test_eval_refuses_a_k_that_is_not_an_integer_before_any_work(tmp_path):
    with pytest.raises(InputError, match=r"^keeps '6x' is not an integer$"):
        api.eval("demo", images=tmp_path, prompts=tmp_path / "p.txt", methods=["cls"], keeps=["64,6x"])


def test_the_cli_reaches_only_the_api_and_names_no_target_or_exporter():
    """The CLI is a thin layer: its group (cli/__init__.py), its command modules (compile_cmd.py, ...), their error
    boundary and shared options import the API (and errors, the version, the contract's defaults), each other and
    render.py, which turns the API's results into lines with the formatters of the modules whose data they are;
    every target, exporter or family either shows comes from their declarations, so a new one needs no CLI edit."""
    import ast

    from vlmprune.compiler.llm.export import EXPORTERS
    from vlmprune.targets import TARGETS

    folder = Path(__file__).resolve().parents[2] / "compiler" / "cli"
    modules = sorted(p.name for p in folder.glob("*.py"))
    assert {"__init__.py", "__main__.py", "render.py", "boundary.py", "options.py", "compile_cmd.py",
            "check_cmd.py"} <= set(modules)
    thin = {"vlmprune.compiler", "vlmprune.compiler.errors", "vlmprune.compiler.contract"}
    render_reaches = {"vlmprune.compiler", "vlmprune.compiler.api", "vlmprune.compiler.api.running",
                      "vlmprune.compiler.bundle.manifest", "vlmprune.compiler.parity", "vlmprune.targets",
                      "vlmprune.compiler.pipeline.timings", "vlmprune.compiler.llm.export",
                      "vlmprune.compiler.ops", "vlmprune.compiler.evaluate", "vlmprune.compiler.accuracy",
                      "vlmprune.compiler.contract"}
    names = set(TARGETS) | set(EXPORTERS) | {"tensorrt", "TensorRT", "Edge-LLM", "onnxruntime-genai"}
    for name in modules:
        if name == "__main__.py":  # the entry point: it imports the group, nothing else
            continue
        tree = ast.parse((folder / name).read_text())
        imported = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        reached = {m for m in imported if m and m.startswith("vlmprune")}
        if name == "render.py":
            assert reached == render_reaches, name
        else:
            outside = {m for m in reached if not m.startswith("vlmprune.compiler.cli")}
            assert outside <= thin and "vlmprune.compiler" in reached, (name, sorted(outside - thin))
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        named = sorted({target for target in names for text in strings
                        if re.search(rf"(?<![\w-]){re.escape(target)}(?![\w-])", text)})
        assert named == [], (name, named)


def test_the_llm_options_are_the_declarations():
    from vlmprune.compiler import api

    texts = api.llm_option_texts()
    assert texts["exporters"] == ["torch", "genai"]  # ort, the one target with a choice, declares these
    assert texts["with_llm"] == ("Also export the language model into llm/ (ort: torch.onnx prefill + decode; "
                                 "orin: TensorRT Edge-LLM 0.11.0 exporter).")


# ------------------------------------------------------------------ the package's shape

API_DIR = Path(api.__file__).parent


def _vlmprune_imports(path: Path) -> list[str]:
    """Every vlmprune module path imports, a function's own imports included."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmprune"):
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("vlmprune")]
    return found


def test_the_api_is_one_small_module_per_command():
    """compiler/api.py had grown to ~960 lines holding every command: each command now has its module, none
    over 300 lines, and the package re-exports the calls a script makes."""
    modules = sorted(API_DIR.glob("*.py"))
    assert len(modules) >= 8
    too_long = {p.name: n for p in modules if (n := len(p.read_text().splitlines())) > 300}
    assert not too_long, too_long
    for name in ("compile", "check", "run", "inspect", "compare", "generate", "eval", "methods", "targets",
                 "build_engine"):
        assert callable(getattr(api, name)) and name in api.__all__, name


def test_the_api_imports_nothing_of_the_cli():
    """The CLI is a client of the API: the API returns data, the CLI's render.py turns it into lines."""
    found = {p.name: i for p in sorted(API_DIR.glob("*.py")) for i in _vlmprune_imports(p)
             if i == "vlmprune.compiler.cli" or i.startswith("vlmprune.compiler.cli.")}
    assert not found, found
    assert all(not hasattr(cls, "lines") for cls in (api.CompileResult, api.RunResult, api.InspectResult,
                                                     api.EvalResult, api.CompareResult, api.MethodInfo,
                                                     api.TargetListing))


def test_the_import_check_sees_the_cli(tmp_path):
    """_vlmprune_imports finds an import of the CLI at the top and inside a function alike."""
    module = tmp_path / "m.py"
    module.write_text("from vlmprune.compiler import cli\ndef f():\n    import vlmprune.compiler.cli.render\n")
    assert {"vlmprune.compiler.cli", "vlmprune.compiler.cli.render"} <= set(_vlmprune_imports(module))


def test_a_target_command_refuses_what_it_does_not_take():
    with pytest.raises(InputError) as unknown:
        api.target_command("no-such-command")
    assert str(unknown.value).startswith("no target adds a command 'no-such-command'; they add: build-engine")
    with pytest.raises(InputError) as bad:
        api.build_engine("b", colour="red")
    assert str(bad.value).startswith("build-engine takes no colour; it takes bundle_dir, ")
    with pytest.raises(InputError, match="^build-engine needs bundle_dir$"):
        api.target_command("build-engine")
