"""benchmarks/runtime_cpu.py runs every engine it offers and prints one CPU per action for each,
and the part of it in user mode (never more than the whole; either may read 0.000 on a busy machine,
where a rank's share of the CPU rounds to nothing: the tests check the output's form and meaning,
not a measured magnitude) (the benchmark's harness: tests/engine_runs.py, both
engines and the bare references, two processes each)."""
from __future__ import annotations

import math
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


def _check_cpu_rows(plain: str, engines) -> None:
    """One row per engine: its CPU per action and the part of it in user mode, never more."""
    for engine in engines:
        row = re.search(rf"^{engine} +([0-9.]+) +([0-9.]+) *$", plain, re.M)
        assert row and 0 <= float(row.group(2)) <= float(row.group(1)), plain


def test_a_busy_machines_zero_user_time_is_a_valid_row():
    # what a fresh clone's run printed on a busy 2-core machine (2026-12-05): the suite failed on it
    _check_cpu_rows("megatron-bare 0.105 0.000\ntorch-bare 0.2 0.1\n", ("megatron-bare", "torch-bare"))
    with pytest.raises(AssertionError):  # user mode above the whole is not a valid row
        _check_cpu_rows("megatron-bare 0.105 0.200\n", ("megatron-bare",))
    with pytest.raises(AssertionError):  # nor is a missing one
        _check_cpu_rows("torch-bare 0.2 0.1\n", ("megatron-bare",))


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_every_engine_prints_its_cpu_per_action():
    engines = ("megatron", "megatron-bare", "deepspeed", "deepspeed-stock", "torch-bare")
    _check_cpu_rows(_run("--plain", "--engines", *engines), engines)
    profiled = _run("--engines", "megatron", "--top", "3")
    split = re.search(r"^megatron +([0-9.]+) +([0-9.]+) +((?:[0-9.]+% *){6})$", profiled, re.M)
    assert split and abs(sum(float(x) for x in re.findall(r"([0-9.]+)%", split.group(3))) - 100) < 0.5, profiled
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
    number = r"(-?[0-9.]+)"
    figures = (rf"{number} ms CPU per action at m=4, {number} ms as the slope between m=4 and m=16; in user mode "
               rf"{number} and {number} \(the rest is the kernel's\)")
    floor = re.search(rf"^torch-bare p=2: .*: {figures}$", done.stdout, re.M)
    engine = re.search(rf"^megatron p=2: CPU time of the runtime at zero compute .*: {figures}; above torch-bare: "
                       rf"([-+][0-9.]+) and ([-+][0-9.]+) ms per action, in user mode ([-+][0-9.]+) and ([-+][0-9.]+)",
                       done.stdout, re.M)
    assert floor and engine, done.stdout
    bare, run = [float(x) for x in floor.groups()], [float(x) for x in engine.groups()]
    for cpu, user in ((bare[0], bare[2]), (run[0], run[2])):
        assert 0 <= user <= cpu, done.stdout  # the part in user mode (a busy machine may round it to 0)
    for k in range(4):  # the differences printed are those of the figures printed
        assert abs(run[k] - bare[k] - run[4 + k]) < 0.0015, done.stdout


def test_cpu_per_step_sums_the_ranks_median_over_steps_and_splits_off_user_mode():
    from engine_runs import cpu_ms_per_step

    def rank(cpu_s, user_s):  # one job; a step: (start, end, cpu0, cpu1, user0, user1) in seconds
        return [{"key": "j", "times": [(0.0, 1.0, 0.0, c, 10.0, 10.0 + u) for c, u in zip(cpu_s, user_s)]}]

    ranks = [rank([9.0, 0.002, 0.004, 0.003], [9.0, 0.001, 0.003, 0.002]),
             rank([9.0, 0.001, 0.001, 0.001], [9.0, 0.0005, 0.0005, 0.0005])]
    assert cpu_ms_per_step(ranks, warmup=1) == pytest.approx([4.0])  # steps 3, 5, 4 ms: the warm-up left out
    assert cpu_ms_per_step(ranks, warmup=1, user=True) == pytest.approx([2.5])  # 1.5, 3.5, 2.5 ms
    old = [[{"key": "j", "times": [t[:4] for t in r[0]["times"]]}] for r in ranks]  # results without user mode
    assert cpu_ms_per_step(old, warmup=1) == pytest.approx([4.0])
    assert math.isnan(cpu_ms_per_step(old, warmup=1, user=True)[0])
