"""The CLI end to end with click's CliRunner: the happy path and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmprune.compiler.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _assert_one_line_error(result, needle):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output


def _no_partial(parent: Path):
    assert not [p for p in parent.iterdir() if p.name.endswith(".partial") or p.name.endswith(".old")]


def test_compile_json_summary_and_bundle(tiny_llava_dir, tmp_path):
    out = tmp_path / "b"
    result = _run("compile", tiny_llava_dir, "--keep", 16, "--layer", 1, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["parity"]["passed"] is True
    assert summary["method"]["tokens_out"] == 18
    features = next(o for o in summary["outputs"] if o["name"] == "image_features")
    assert features["shape"][1:] == [17, 48]  # K + summary tokens, projected to the LLM width
    assert {"manifest.json", "model.onnx", "model.decomposed.onnx", "parity.json", "README.md"} <= {
        p.name for p in out.iterdir()}


def test_check_inspect_run_on_demo(demo_bundle, tmp_path):
    bundle = demo_bundle.bundle
    result = _run("check", bundle, "--batch", 3, "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and {s["stage"] for s in report["stages"]} == {"export", "rewritten", "fused"}
    assert all(s["indices"]["agreement"] == 1.0 for s in report["stages"] if s["indices"])
    result = _run("inspect", bundle)
    assert result.exit_code == 0 and "after block 2/5" in result.output and "sha256" in result.output
    from skimage import data
    from PIL import Image

    img = tmp_path / "cat.png"
    Image.fromarray(data.chelsea()).save(img)
    result = _run("run", bundle, "--image", img)
    assert result.exit_code == 0, result.output
    assert "image_features: shape [1, 193, 256]" in result.output
    assert len(result.output.split("kept (image 0): ")[1].split()) == 192


def test_check_refuses_tampered_bundle(demo_bundle, tmp_path):
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(demo_bundle.bundle, copy)
    with open(copy / "model.onnx", "ab") as f:
        f.write(b"\0")
    _assert_one_line_error(_run("check", copy), "does not match its sha256")


def test_targets_lists_availability():
    from vlmprune.targets import TARGETS

    result = _run("targets")
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines()[: len(TARGETS)]}
    assert list(lines) == list(TARGETS)
    for name, cls in TARGETS.items():
        ok, why = cls().available()
        status = lines[name].split(None, 1)[1]
        assert status.startswith("available ") if ok else status.startswith(f"unavailable: {why[:20]}"), lines[name]
    listed = result.output.splitlines()[len(TARGETS):]
    for cls in TARGETS.values():  # each target's own lines (qnn: its --soc values), from the target
        own = cls().listing()
        assert [line for line in listed if line in own] == own
    assert sum(len(cls().listing()) for cls in TARGETS.values()) > 1
    llm = result.output.split("--with-llm (the language model):\n", 1)[1].splitlines()
    assert [line.split()[0] for line in llm] == ["ort", "ort", "orin", "xavier", "rk3588", "qnn", "openvino"]
    assert "not supported" in llm[3] and "TensorRT Edge-LLM 0.11.0 exporter" in llm[2]


def test_check_engine_asks_the_bundles_target(demo_bundle):
    """--engine is the target's hook: a bundle whose target builds no engine is refused before any parity."""
    result = _run("check", demo_bundle.bundle, "--engine")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: {demo_bundle.bundle} targets ort, which has no engine stage (--engine: orin, xavier)"]


@pytest.mark.parametrize("args,needle", [
    (["--keep", 0], "--keep must be an integer >= 1"),
    (["--keep", 64], "keep must satisfy 1 <= keep < 64"),
    (["--target", "nope"], "unknown target 'nope'"),
    (["--layer", 9], "--layer 9 is out of range"),
    (["--layer", 0], "--layer counts blocks from 1"),
])
def test_bad_options(tiny_llava_dir, tmp_path, args, needle):
    out = tmp_path / "b"
    _assert_one_line_error(_run("compile", tiny_llava_dir, "-o", out, *args), needle)
    assert not out.exists()
    _no_partial(tmp_path)


def test_missing_path(tmp_path):
    _assert_one_line_error(_run("compile", tmp_path / "nothing", "-o", tmp_path / "b"), "no such file or directory")


def test_a_missing_image_is_worded_alike_by_run_compare_and_generate(tmp_path):
    """run said click's "Invalid value for '--image': File ... does not exist.", generate "X: no such image file"."""
    from vlmprune.compiler import api
    from vlmprune.compiler.errors import InputError

    missing, folder = tmp_path / "nope.png", tmp_path
    for image, why in ((missing, "no such image file"), (folder, "a directory, not an image file")):
        for args in (["run", tmp_path, "--image", image],
                     ["compare", tmp_path, "--image", image, "-o", tmp_path / "c.png"],
                     ["generate", tmp_path, "--image", image, "--prompt", "what is it?"]):
            result = _run(*args)
            assert result.exit_code == 2 and result.stderr.splitlines() == [f"error: --image {image}: {why}"], args
        for call, given in ((api.run, {"images": [image]}),
                            (api.compare, {"image": image, "output": tmp_path / "c.png"}),
                            (api.generate, {"image": image, "prompt": "what is it?"})):
            keyword = "images" if call is api.run else "image"
            with pytest.raises(InputError, match=f"^{keyword} {image}: {why}$"):
                call(*([[tmp_path]] if call is api.compare else [tmp_path]), **given)


@pytest.mark.parametrize("command", ["generate", "run"])
def test_an_empty_prompt_is_refused_before_any_work(tmp_path, command):
    """generate --prompt "" loaded the bundle and the model and preprocessed the image before saying so; nothing
    here exists, so a refusal after any of those would name it instead."""
    result = _run(command, tmp_path / "no-bundle", "--image", tmp_path / "no.png", "--prompt", " ")
    assert result.exit_code == 2 and result.stderr.splitlines() == ["error: --prompt is empty"], result.output


def test_user_facing_text_says_what_things_are_not_which_seed_or_issue_brought_them():
    """`vlmprune methods` once named the internal work item its coarse stage came from, docs/quality.md the tracker
    number of its methods and options: a user has neither the work items nor the tracker. Every command's help, the
    listings, a refusal, README and the guides."""
    import re

    from vlmprune.compiler.errors import InputError
    from vlmprune.passes.methods import NEEDS_TRAINED_WEIGHTS, get_method

    texts = [_run(*command, "--help").output for command in [[]] + [[name] for name in main.commands]]
    texts += [_run("methods").output, _run("targets").output]
    for name in NEEDS_TRAINED_WEIGHTS:
        with pytest.raises(InputError) as refused:
            get_method(name)
        texts.append(str(refused.value))
    root = Path(__file__).parents[2]
    texts += [(root / "README.md").read_text(), (root / "docs" / "quality.md").read_text()]
    internal = re.compile(r"\bseed \d{3}\b|\bseeds'|\bissue \d+\b", re.I)
    assert [m.group(0) for text in texts for m in internal.finditer(text)] == []


def test_corrupt_onnx(tmp_path):
    bad = tmp_path / "tower.onnx"
    bad.write_bytes(b"this is not a protobuf")
    _assert_one_line_error(_run("compile", bad, "-o", tmp_path / "b"), "not a readable ONNX model")
    assert not (tmp_path / "b").exists()


def test_tower_without_cls(tiny_siglip_dir, tmp_path):
    """The refusal on SigLIP (an attention-pooling head) suggests the cls method's own way out."""
    _assert_one_line_error(_run("compile", tiny_siglip_dir, "--keep", 8, "-o", tmp_path / "b"),
                           "needs a [CLS] token, and this tower has none: use --score probe")


def test_unwritable_output(tiny_llava_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", blocker / "b"), "not a directory")
    # Root ignores permission bits, so use a filesystem nobody can write to.
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", "/proc/vlmprune-bundle"), "not writable")


def test_existing_output_needs_force(tiny_llava_dir, tmp_path):
    """Only a bundle is offered --force; a directory that is something else is refused alike with it."""
    out = tmp_path / "b"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    _assert_one_line_error(_run("compile", tiny_llava_dir, "--keep", 16, "-o", out),
                           "already exists (use --force to replace it)")
    (out / "manifest.json").unlink()
    (out / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):
        result = _run("compile", tiny_llava_dir, "--keep", 16, "-o", out, *force)
        assert result.exit_code == 2 and result.stderr.splitlines() == [
            f"error: {out} exists and is not a vlmprune bundle (no manifest.json), and --force replaces only a "
            "bundle: choose another -o or remove it"], result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_check_missing_bundle(tmp_path):
    _assert_one_line_error(_run("check", tmp_path), "not a vlmprune bundle")


def test_a_reader_that_leaves_early_is_no_error(demo_bundle):
    """`vlmprune inspect B --ops | head`: the pipe closes before vlmprune writes; that is not a vlmprune bug."""
    import subprocess
    import sys

    code = "from vlmprune.compiler.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "inspect", str(demo_bundle.bundle), "--ops"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even imported vlmprune: the first write meets EPIPE
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err.decode()
    assert b"error" not in err and b"Traceback" not in err, err.decode()


@pytest.mark.parametrize("args,line", [
    (["--no-prune", "-k", 64], "error: --no-prune compiles the dense tower: --keep does not apply to it"),
    (["--no-prune", "-m", "cls", "--layer", 1, "--lambda", 0.3],
     "error: --no-prune compiles the dense tower: --method, --layer, --lambda do not apply to it"),
])
def test_no_prune_refuses_pruning_options_given_with_it(tiny_llava_dir, tmp_path, args, line):
    """Given explicitly, they would be ignored without a word; their defaults are no reason to refuse."""
    out = tmp_path / "b"
    result = _run("compile", tiny_llava_dir, "-o", out, *args)
    assert result.exit_code == 2 and result.stderr.splitlines() == [line], result.output
    assert not out.exists()


@pytest.mark.parametrize("args,line", [
    (["compile", "demo", "--keep", "1e3"],
     "error: Invalid value for '--keep' / '-k': '1e3' is not an integer or auto (see vlmprune compile --help)"),
    (["compile"], "error: Missing argument 'MODEL'. (see vlmprune compile --help)"),
    (["run", "b", "--no-such-option"], "error: No such option '--no-such-option'. (see vlmprune run --help)"),
    (["check"], "error: Missing argument 'BUNDLE_DIR'. (see vlmprune check --help)"),
    (["compile", "demo", "--cls", "maybe"],
     "error: Invalid value for '--cls': 'maybe' is not one of 'drop', 'keep'. (see vlmprune compile --help)"),
    (["no-such-command"], "error: No such command 'no-such-command'. (see vlmprune --help)"),
])
def test_usage_errors_are_one_error_line(args, line):
    result = _run(*args)
    assert result.exit_code == 2 and result.stderr.splitlines() == [line] and result.stdout == "", result.output


def test_native_writes_to_stdout_go_to_stderr_while_a_command_works():
    """A native library writing to file descriptor 1 (QNN's `# LIBNATIVE:` line; C stdio, buffered on a pipe)
    during the work lands on stderr, with or without --json; the data and the summary stay on stdout."""
    import subprocess
    import sys

    code = """if True:
        import ctypes, os
        from vlmprune.compiler.cli.boundary import stdout_for_data
        with stdout_for_data() as emit:
            os.write(1, b"native write\\n")
            ctypes.CDLL(None).puts(b"native puts")
            print("stray print")
            emit("data")
        print("summary")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["data", "summary"]
    assert {"native write", "native puts", "stray print"} <= set(done.stderr.splitlines())


def test_compile_summary_lines(tiny_llava_dir, tmp_path):
    out = tmp_path / "b"
    result = _run("compile", tiny_llava_dir, "--keep", 16, "--with-llm", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == ("tokens: 64 patch tokens -> [CLS] attention: top 16 + 1 summary "
                        "(at the tower's end, after block 2/2)")
    stages = [line.split()[1] for line in lines if line.startswith("parity ")]
    assert stages == ["export", "rewritten", "fused", "llm"]
    parity = json.loads((out / "manifest.json").read_text())["llm_graphs"]["parity"]
    assert lines[-2] == (f"parity llm        PASS  logits max-abs {parity['logits_max_abs']:.3g}, greedy tokens "
                         f"identical over {parity['decode_steps']} decode steps")
    assert lines[-1].startswith(f"bundle: {out} (")


def test_a_failing_llm_figure_reads_as_failing():
    """A logits gap just over its tolerance must not print as the tolerance itself."""
    from vlmprune.compiler.cli.render import llm_parity_line as _llm_parity_line

    parity = {"passed": False, "logits_max_abs": 1.00004e-4, "tolerance": 1e-4, "tokens_identical": True,
              "decode_steps": 3}
    assert _llm_parity_line({"parity": parity}) == ("parity llm        FAIL  logits max-abs 0.000100004, greedy "
                                                    "tokens identical over 3 decode steps")
    # Another exporter's record, in that exporter's own figures (LlmExporter.parity_figures): Edge-LLM's checks.
    edge = {"exporter_id": "edgellm", "checks": {"weights": {"passed": True, "max_abs": 0.0, "tensors_checked": 19},
                                                 "standard_ops_in_onnxruntime": {"ran": False}}}
    assert _llm_parity_line(edge) == ("parity llm        PASS  weights max-abs 0.00e+00 over 19 tensors, standard ops "
                                      "not run here")


def test_missing_output_parents_are_made_and_removed_if_the_command_fails(tiny_clip_dir, tiny_siglip_dir, tmp_path,
                                                                          monkeypatch):
    """docs/ci.md's workflow as written, in a fresh checkout: no build/ and no results/ yet."""
    monkeypatch.chdir(tmp_path)
    result = _run("compile", tiny_clip_dir, "--keep", 8, "-o", "build/bundle", "--quiet")
    assert result.exit_code == 0, result.output
    result = _run("check", "build/bundle", "--quiet", "--junit", "results/parity.xml", "--report", "results/parity.html")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["parity.html", "parity.xml"]
    # The compile fails after its claim (siglip has no [CLS]): the folders it made are gone again.
    _assert_one_line_error(_run("compile", tiny_siglip_dir, "--keep", 8, "-o", "new/sub/b"), "needs a [CLS] token")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "results"]


def test_check_a_bundle_whose_source_moved(tiny_clip_dir, tiny_llava_dir, tmp_path):
    import shutil

    source = tmp_path / "clip"
    shutil.copytree(tiny_clip_dir, source)
    out = tmp_path / "b"
    assert _run("compile", source, "--keep", 8, "-o", out, "-q").exit_code == 0
    moved = source.rename(tmp_path / "moved")
    result = _run("check", out)
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: the bundle's source {source} was not found (moved?); pass --model PATH"], result.output
    result = _run("check", out, "--model", moved, "-q")
    assert result.exit_code == 0, result.output
    _assert_one_line_error(_run("check", out, "--model", tiny_llava_dir),
                           f"--model {tiny_llava_dir} is not the bundle's source {source} (content hash differs)")


# The console script's own code (pyproject's [project.scripts]), as a subprocess: signals need a real process.
ENTRY = ["-c", "from vlmprune.compiler.__main__ import main; main()"]
# As a shell starts a command: SIGINT at its default and unblocked, whatever the test process has come to hold
# in a long session (a child inherits an ignored or blocked SIGINT across exec, and would then never see one).
AS_A_SHELL_STARTS_IT = ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n")


def test_the_console_script_is_the_interrupt_boundary():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"vlmprune": "vlmprune.compiler.__main__:main"}


def test_each_command_lives_in_a_module_of_its_own():
    """The group (cli/__init__.py) holds no command: each command, or a small family of them, is its own module
    under compiler/cli/, so a command is read and changed without the others; the targets' commands come from
    target_cmds. A command's callback is the boundary's wrapper (functools.wraps keeps the module it came from)."""
    import sys

    from vlmprune.compiler import cli

    modules = {}
    for name, command in main.commands.items():
        module = command.callback.__module__
        assert module.startswith("vlmprune.compiler.cli.") and module != "vlmprune.compiler.cli", (name, module)
        modules.setdefault(module, []).append(name)
    assert modules["vlmprune.compiler.cli.compile_cmd"] == ["compile"]
    assert modules["vlmprune.compiler.cli.target_cmds"] == ["build-engine"]
    assert max(len(names) for names in modules.values()) <= 3, modules
    source = Path(sys.modules[cli.__name__].__file__).read_text()
    assert "@click.command" not in source and "@main.command" not in source
    assert len(source.splitlines()) < 120


def test_ctrl_c_while_the_cli_imports_is_one_line(tmp_path):
    """A real SIGINT, sent by the process to itself at a fixed point of the CLI's import (as vlmprune.targets
    starts importing, after torch and before any command). Sent from outside at a moment in time instead, it
    can land inside a native library's initialisation that swallows it (torch's does, under load), and the
    test would prove nothing either way."""
    import subprocess
    import sys

    at_import = (AS_A_SHELL_STARTS_IT + "import importlib.abc, os, signal, sys\n"
                 "class Interrupt(importlib.abc.MetaPathFinder):\n"
                 "    def find_spec(self, name, path=None, target=None):\n"
                 "        if name == 'vlmprune.targets':\n"
                 "            assert 'torch' in sys.modules and 'vlmprune.compiler.pipeline' not in sys.modules\n"
                 "            sys.meta_path.remove(self)\n"
                 "            os.kill(os.getpid(), signal.SIGINT)\n"
                 "sys.meta_path.insert(0, Interrupt())\n")
    proc = subprocess.Popen([sys.executable, "-c", at_import + ENTRY[1], "compile", "demo", "-o", str(tmp_path / "x")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, err.splitlines(), out) == (130, ["interrupted; nothing was written"], "")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_after_the_bundle_line_leaves_a_complete_bundle_said_so(tiny_clip_dir, tmp_path):
    """Either the command was still ending (the line says the bundle is complete, exit 130), or it had ended and
    the interpreter was shutting down (the interrupt stops nothing: exit 0, as the command said); never a
    traceback, never a silent 130."""
    import signal
    import subprocess
    import sys

    from vlmprune.compiler.bundle import load_manifest

    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-c", AS_A_SHELL_STARTS_IT + ENTRY[1], "compile", str(tiny_clip_dir),
                             "--keep", "8", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("bundle: "):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    assert rest == "" and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if proc.returncode == 130:
        assert err.splitlines()[-1] == f"interrupted; the bundle at {out} is complete", err
    else:
        assert proc.returncode == 0 and "interrupted" not in err, (proc.returncode, err)
    assert load_manifest(out)["parity"]["passed"]


def test_an_interrupt_landing_as_the_command_ends_is_the_interrupt_line_not_clicks(demo_bundle, monkeypatch):
    """The deterministic half of the race above: a Ctrl-C delivered while on_command_end is being entered
    (before the console script's SIG_IGN takes effect) is our line and 130, never click's `Aborted!` and 1."""
    from vlmprune.compiler.cli import boundary

    calls = []

    def end_interrupted_once():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(boundary, "on_command_end", end_interrupted_once)
    res = CliRunner().invoke(main, ["inspect", str(demo_bundle.bundle)])
    assert (res.exit_code, res.output.splitlines()[-1]) == (130, "interrupted; nothing was written"), res.output
    assert "Aborted" not in res.output and len(calls) == 2


def test_parity_photographs_are_the_documented_ones(demo_bundle):
    """docs/design.md: two photographs by default, astronaut and chelsea; check --batch 3 adds coffee."""
    images = json.loads((demo_bundle.bundle / "parity.json").read_text())["inputs"]["images"]
    assert images == ["skimage.data.astronaut", "skimage.data.chelsea"]
    design = (Path(__file__).parents[2] / "docs" / "design.md").read_text()
    assert "two by default (astronaut and chelsea" in " ".join(design.split())
