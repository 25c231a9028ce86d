"""benchmarks/beside_pipeline.py: its plan (--dry-run), its argument errors, and what its report
computes from the rounds' medians."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "beside_pipeline.py"


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "beside_pipeline_bench")


def test_dry_run_traces_both_schedules_taking_turns_the_first_built_alternating(tmp_path):
    work = tmp_path / "w"
    res = _run("--dry-run", "--rounds", "2", "--work", str(work))
    assert res.returncode == 0, res.stderr
    cmds = [line.strip()[2:] for line in res.stderr.splitlines() if line.strip().startswith("$ ")]
    assert [c.split()[2] for c in cmds if " export " in c] == ["interleaved-1f1b", "zb-v"]
    runs = [c for c in cmds if "torchrun" in c]
    il, zbv = f"{work}/export_interleaved-1f1b_v2.json", f"{work}/export_zb-v_v2.json"
    assert len(runs) == 2 and all("megatron_gpt/pretrain_gpt.py" in c and "--num-layers 4 " in c
                                  and "--virtual-pipeline-model-parallel-size 2 " in c for c in runs)
    assert f"--koala-schedule {il} " in runs[0] and f"--koala-trace {work}/r0.json" in runs[0]
    assert runs[0].endswith(f"--alternate-schedules {zbv} --alternate-block 4")
    assert f"--koala-schedule {zbv} " in runs[1] and runs[1].endswith(f"--alternate-schedules {il} --alternate-block 4")
    assert not work.exists()


@pytest.mark.parametrize("args, needle", [
    (["--warmup", "48"], "--warmup must be at least 0 and below --iterations"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--block", "0"], "--block must be at least 1"),
    (["--size", "gpt-1L"], "invalid choice: 'gpt-1L'"),
])
def test_bad_arguments_are_one_line(args, needle):
    res = _run("--dry-run", *args)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_the_report_gives_each_round_and_the_difference_over_them(bench):
    rounds = [{"interleaved-1f1b": (3.0, (0.04, 0.06)), "zb-v": (4.5, (0.7, 1.5))},
              {"interleaved-1f1b": (3.2, (0.05, 0.06)), "zb-v": (4.3, (0.5, 1.7))}]
    text = "\n".join(bench.report(rounds, "interleaved-1f1b", "zb-v", 2))
    assert "| 0 | zb-v | 4.50 | 0.70 | 1.50 |" in text and "| 1 | interleaved-1f1b | 3.20 | 0.05 | 0.06 |" in text
    assert "zb-v less interleaved-1f1b beside the pipeline, mean over 2 rounds: +1.30 ms (SE 0.20)" in text
    assert "after-pipeline rank 1: interleaved-1f1b 0.06 ms, zb-v 1.60 ms (means of the rounds)" in text
