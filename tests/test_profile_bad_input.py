"""`koala profile` and bad input: one line naming the option to change (exit code 2), never a
traceback. Each case used to end in a Python traceback (exit code 1) or, for `--threads 0`, be
ignored without a word."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from koala_ds.cli import main

ROOT = Path(__file__).resolve().parents[1]

#: The user's model: `--layers` and `--input` functions, good and bad.
MODEL = '''
import torch

def layers():
    return [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]

def one_layer():
    return [torch.nn.Linear(8, 8)]

def no_layers():
    return []

def forty_two():
    return 42

class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom " + "x" * 400 + "\\nsecond line")

def boom():
    return [torch.nn.Linear(8, 8), Boom()]

def sample():
    return torch.randn(2, 8)

def wrong_shape():
    return torch.randn(2, 5)

def nothing():
    return None

class Piped:  # what DeepSpeed's PipelineModule shows the profiler: its layer list and partition method
    partition_method = "uniform"
    _layer_specs = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]

def piped():
    return Piped()
'''

#: Module names of their own: Python caches an imported module by its name.
MODULE_NUMBERS = itertools.count()

#: One line of progress per stage on stderr: not an error line.
PROGRESS = "profiling "


def error_lines(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if not line.startswith(PROGRESS)]


def assert_one_line(code, err: str, *needles: str) -> str:
    """Exit code 2 and one error line (beside the progress lines) that holds every needle."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def run(capsys, *argv) -> tuple[int, str]:
    """`koala *argv` in this process: (exit code, stderr); an argparse error exits (SystemExit)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    """A module of the user's model, importable under a name of its own (per test)."""
    name = f"pbi_{next(MODULE_NUMBERS)}"
    (tmp_path / f"{name}.py").write_text(MODEL)
    (tmp_path / f"{name}_syntax.py").write_text("import torch\n\ndef layers(\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return name


DEEPSPEED = ["profile", "deepspeed", "-p", "2", "--p2p-latency", "0", "--warmup", "0", "--iters", "1"]


@pytest.mark.parametrize("layers,sample,needles", [
    ("{m}_syntax:layers", "{m}:sample", ["--layers '{m}_syntax:layers'", "SyntaxError: '(' was never closed",
                                         "{m}_syntax.py, line 3"]),
    ("{m}:no_layers", "{m}:sample", ["--layers '{m}:no_layers' returned no layers"]),
    ("{m}:forty_two", "{m}:sample", ["--layers '{m}:forty_two' returned 42 (int)", "not a PipelineModule"]),
    ("{m}:one_layer", "{m}:sample", ["--layers '{m}:one_layer' returned 1 layer(s)", "-p"]),
    ("{m}:boom", "{m}:sample", ["--layers '{m}:boom': the stage 1 forward failed: ValueError: boom xxx"]),
    # torch's own words after "RuntimeError: " vary by version (2.15 prefixes "addmm: ")
    ("{m}:layers", "{m}:wrong_shape", ["--input '{m}:wrong_shape': the stage 0 forward failed: RuntimeError: ",
                                       "mat1 and mat2 shapes cannot be multiplied (2x5 and 8x8)"]),
    ("{m}:layers", "{m}:nothing", ["--input '{m}:nothing' returned None"]),
    (":", "{m}:sample", ["--layers ':': expected MODULE:FUNCTION"]),
], ids=["syntax-error", "no-layers", "not-a-list", "fewer-layers-than-stages", "a-layer-raises", "wrong-shape",
        "input-none", "empty-reference"])
def test_a_misbehaving_layers_or_input_function_is_one_line_naming_its_option(capsys, tmp_path, model, layers,
                                                                               sample, needles):
    out = tmp_path / "prof.json"
    code, err = run(capsys, *DEEPSPEED, "--layers", layers.format(m=model), "--input", sample.format(m=model),
                    "-o", out)
    line = assert_one_line(code, err, *[n.format(m=model) for n in needles])
    assert "second line" not in line and "x" * 200 not in line, line  # the user's message: its first line, cut short
    assert not out.exists()


@pytest.mark.parametrize("method,needle", [
    ("bogus", "'bogus': use uniform, parameters or type:REGEX"),
    ("type:[", "'type:[': the REGEX of type:REGEX is not a regular expression"),
], ids=["unknown", "bad-regex"])
def test_a_bad_partition_method_is_one_line_naming_it(capsys, tmp_path, model, method, needle):
    code, err = run(capsys, *DEEPSPEED, "--layers", f"{model}:layers", "--input", f"{model}:sample",
                    "--partition-method", method, "-o", tmp_path / "prof.json")
    assert_one_line(code, err, "--partition-method", needle)


@pytest.mark.parametrize("argv,needles", [
    (["--partition-method", "type:attention"], ["--partition-method type:attention: the REGEX matches no layer",
                                                "(layer types: Linear)"]),
    (["--per-layer", "--partition-method", "uniform"], ["--partition-method: a per-layer profile measures every "
                                                         "layer", "drop it"]),
    (["--layers-of-module", "--partition-method", "parameters"], ["--partition-method parameters:", "returned a "
                                                                  "PipelineModule", "its own partition_method "
                                                                  "'uniform'"]),
], ids=["type-matching-nothing", "per-layer", "not-the-modules-own"])
def test_a_partition_method_that_would_be_ignored_or_match_nothing_is_one_line(capsys, tmp_path, model, argv,
                                                                                  needles):
    """Each was taken without a word: a type:REGEX matching no layer gave DeepSpeed's degenerate
    split, and the method was ignored with --per-layer or for a PipelineModule (its own wins)."""
    layers = f"{model}:piped" if "--layers-of-module" in argv else f"{model}:layers"
    argv = [a for a in argv if a != "--layers-of-module"]
    code, err = run(capsys, *DEEPSPEED, "--layers", layers, "--input", f"{model}:sample", *argv,
                    "-o", tmp_path / "prof.json")
    assert_one_line(code, err, *needles)
    assert not (tmp_path / "prof.json").exists()


def test_the_modules_own_partition_method_is_used_and_written(capsys, tmp_path, model):
    out = tmp_path / "prof.json"
    code, err = run(capsys, *DEEPSPEED, "--layers", f"{model}:piped", "--input", f"{model}:sample",
                    "--partition-method", "UNIFORM", "-o", out)  # the same method, as DeepSpeed reads it
    assert code == 0, err
    assert json.loads(out.read_text())["meta"]["partition_method"] == "UNIFORM"


def test_optimizer_bytes_without_per_layer_is_refused(capsys):
    """--optimizer-bytes-per-param-byte goes into per-layer profiles only; without --per-layer it
    was ignored. Refused before anything runs (the -o folder does not exist)."""
    code, err = run(capsys, "profile", "megatron-gpt", "-p", "2", "--optimizer-bytes-per-param-byte", "3",
                    "-o", "/nonexistent/p.json")
    assert_one_line(code, err, "--optimizer-bytes-per-param-byte goes into per-layer profiles only: add --per-layer")


@pytest.mark.parametrize("threads", ["-3", "0"])
def test_threads_below_one_is_refused_naming_threads(capsys, threads):
    """Refused while parsing, before anything else: the -o given here (its folder does not
    exist) is never looked at. -3 was a RuntimeError from torch.set_num_threads; 0 was ignored."""
    code, err = run(capsys, "profile", "megatron-gpt", "-p", "2", "--threads", threads, "-o", "/nonexistent/p.json")
    assert_one_line(code, err, "argument --threads: must be >= 1", repr(threads))


def _cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`koala *argv` in a process of its own, in `cwd` (where --layers / --input modules are found)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu",  # megatron-core's Apex warnings
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "koala_ds.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


@pytest.mark.slow
def test_a_ping_pong_past_timeout_is_one_line_naming_timeout(tmp_path):
    """Was a koala_ds.runtime.spawn.SpawnError traceback, exit code 1."""
    proc = _cli(tmp_path, "profile", "p2p", "--numel", "10", "--iters", "1000000000", "--timeout", "1.5")
    assert_one_line(proc.returncode, proc.stderr, "--timeout 1.5:", "did not finish in 1.5 s", "raise --timeout")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["deepspeed", "megatron-gpt"])
def test_a_profile_ping_pong_past_p2p_timeout_is_one_line_naming_it(tmp_path, model, engine):
    """Was a SpawnError traceback that gave the 0.5 s deadline as 'deadline of 0 s'."""
    argv = ["--layers", f"{model}:layers", "--input", f"{model}:sample"] if engine == "deepspeed" else \
        ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
         "--vocab-size", "16"]
    out = tmp_path / "prof.json"
    proc = _cli(tmp_path, "profile", engine, *argv, "-p", "2", "--warmup", "0", "--iters", "1", "--p2p-timeout", "0.5",
                "-o", str(out))
    assert_one_line(proc.returncode, proc.stderr, "--p2p-timeout 0.5:", "did not finish in 0.5 s",
                    "raise --p2p-timeout", "--p2p-latency")
    assert not out.exists()


@pytest.mark.slow
def test_a_spawn_deadline_below_one_second_is_written_as_given():
    from koala_ds.runtime.spawn import SpawnError, spawn

    with pytest.raises(SpawnError, match=r"deadline of 0\.5 s passed"):
        spawn("koala_ds.profiler.p2p:pingpong_worker", 2, {"numel": 1, "iters": 10 ** 9}, timeout_s=0.5)
