"""benchmarks/runtime_cpu.py runs every engine it offers and prints one positive CPU per action
for each (the benchmark's harness: tests/engine_runs.py, both engines and the bare references,
two processes each)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/runtime_cpu.py"), "-p", "2", "-m", "4", "--steps", "3",
                           *args], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_every_engine_prints_its_cpu_per_action():
    engines = ("megatron", "megatron-bare", "deepspeed", "deepspeed-stock", "torch-bare")
    plain = _run("--plain", "--engines", *engines)
    for engine in engines:
        row = re.search(rf"^{engine} +([0-9.]+) *$", plain, re.M)
        assert row and float(row.group(1)) > 0, plain
    profiled = _run("--engines", "megatron", "--top", "3")
    split = re.search(r"^megatron +([0-9.]+) +((?:[0-9.]+% *){6})$", profiled, re.M)
    assert split and abs(sum(float(x) for x in re.findall(r"([0-9.]+)%", split.group(2))) - 100) < 0.5, profiled
    assert len(re.findall(r"ms/action +[0-9.]+ calls/action", profiled)) == 3, profiled


@pytest.mark.parametrize("engine", ["megatron-bare", "deepspeed-stock", "torch-bare"])
def test_the_bare_loops_and_the_stock_engine_run_only_1f1b(engine):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/runtime_cpu.py"), "--schedule", "zb-h1",
                           "--engines", engine], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "use --schedule 1f1b" in done.stderr.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_speedup_prints_the_runtimes_cpu_next_to_torch_and_gloo_alone():
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/engine_speedup.py"), "--overhead-only", "-p", "2",
                           "--engines", "megatron", "--steps", "2"], capture_output=True, text=True, timeout=400,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    floor = re.search(r"^torch-bare p=2: .*: ([0-9.]+) ms CPU per action at m=4, (-?[0-9.]+) ms as the slope",
                      done.stdout, re.M)
    engine = re.search(r"^megatron p=2: CPU time of the runtime at zero compute: ([0-9.]+) ms per action .*"
                       r"above torch-bare: ([-+][0-9.]+) and ([-+][0-9.]+) ms per action", done.stdout, re.M)
    assert floor and engine and float(floor.group(1)) > 0 and float(engine.group(1)) > 0, done.stdout
    assert abs(float(engine.group(1)) - float(floor.group(1)) - float(engine.group(2))) < 0.0015, done.stdout
