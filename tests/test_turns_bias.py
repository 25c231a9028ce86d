"""benchmarks/turns_bias.py: its plan (--dry-run: the four torchruns of each round, nothing run),
its argument errors, and what its report computes from a round's medians."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "turns_bias.py"


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def bias():
    return load_script(SCRIPT, "turns_bias_bench")


def test_dry_run_runs_each_schedule_alone_and_both_taking_turns_either_engine_first(tmp_path):
    work = tmp_path / "w"
    res = _run("--dry-run", "--rounds", "2", "--work", str(work))
    assert res.returncode == 0, res.stderr
    cmds = [line.strip()[2:] for line in res.stderr.splitlines() if line.strip().startswith("$ ")]
    exports = [c for c in cmds if " export " in c]
    assert [c.split()[2] for c in exports] == ["1f1b", "zb-v"] and "-v 2" in exports[1]
    runs = [c for c in cmds if "torchrun" in c]
    assert len(runs) == 8 and all("deepspeed_pipe/train.py" in c and "--dim 1024" in c for c in runs)
    a, b = f"{work}/export_1f1b_v1.json", f"{work}/export_zb-v_v2.json"
    first = runs[:4]  # round 0 in RUNS' order; round 1 starts one later
    assert f"--schedule {a} --loss-log" in first[0] and "--steps 48 " in first[0] and "alternate" not in first[0]
    assert f"--schedule {b} --chunks 2 --placement vshape" in first[1] and "alternate" not in first[1]
    assert f"--schedule {a} " in first[2] and first[2].endswith(f"--alternate-schedules {b} --alternate-block 4")
    assert f"--schedule {b} --chunks 2 " in first[3] and first[3].endswith(f"--alternate-schedules {a} --alternate-block 4")
    assert "--steps 96 " in first[2] and "--steps 96 " in first[3]
    assert runs[4:] == [c.replace("/r0_", "/r1_") for c in first[1:] + first[:1]]
    assert not work.exists()


def test_a_schedule_file_of_two_chunks_runs_with_the_placement_given(tmp_path):
    best = tmp_path / "best.koala"
    best.write_text((ROOT / "koala_ds" / "library" / "zb-v.koala").read_text())  # a V-shape v = 2 schedule
    for flags, placement in ((["--v", "2", "--placement", "interleaved"], "interleaved"), ([], "vshape")):
        res = _run("--dry-run", "--rounds", "1", "--other", str(best), *flags, "--work", str(tmp_path / "w"))
        assert res.returncode == 0, res.stderr
        cmds = [line.strip()[2:] for line in res.stderr.splitlines() if line.strip().startswith("$ ")]
        assert any(c.endswith(f"export {best} -p 2 -m 8 -v 2 -o {tmp_path}/w/export_best_v2.json") for c in cmds)
        alone = [c for c in cmds if f"--schedule {tmp_path}/w/export_best_v2.json" in c]
        assert alone and all(f"--chunks 2 --placement {placement}" in c for c in alone), flags


@pytest.mark.parametrize("args, needle", [
    (["--warmup", "48"], "--warmup must be at least 0 and below --iterations"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--engine", "megatron", "--size", "gpt-1L"], "--size: one of gpt-4L-h64-s32, gpt-8L-h256-s64"),
    (["--size", "big"], "--size: the DeepSpeed example's --dim"),
])
def test_bad_arguments_are_one_line(args, needle):
    res = _run("--dry-run", *args)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, says", [
    (["--other", "nosuch"], "turns_bias.py: --other nosuch: unknown schedule 'nosuch'"),
    (["--other", "zb-v", "--v", "1"], "turns_bias.py: --other zb-v: schedule 'zb-v' needs v == 2"),
])
def test_a_schedule_that_cannot_run_is_one_line_naming_its_flag(args, says):
    res = _run("--dry-run", *args)
    assert res.returncode == 1 and res.stderr.startswith(says) and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "$ " not in res.stderr


def test_an_output_file_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path):
    res = _run("--dry-run", "--out", str(tmp_path / "missing" / "report.txt"))
    assert res.returncode == 2 and res.stderr.startswith("turns_bias.py: --out") and "$ " not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_report_gives_the_speedups_and_the_turns_cost_round_by_round(bias):
    rounds = [{"A alone": {"A": 100.0}, "B alone": {"B": 80.0}, "A, B taking turns": {"A": 100.0, "B": 90.0},
               "B, A taking turns": {"B": 88.0, "A": 110.0}},
              {"A alone": {"A": 120.0}, "B alone": {"B": 100.0}, "A, B taking turns": {"A": 110.0, "B": 100.0},
               "B, A taking turns": {"B": 100.0, "A": 120.0}}]
    text = "\n".join(bias.report(rounds, {"A": "1f1b", "B": "zb-v"}))
    assert "| 0 | 100.0 | 80.0 | 100.0, 90.0 | 88.0, 110.0 |" in text
    assert "zb-v over 1f1b, each alone (fresh): 1.225 (SE 0.025; rounds 1.250 1.200)" in text
    assert "zb-v over 1f1b, taking turns, 1f1b first: 1.106 (SE 0.006; rounds 1.111 1.100)" in text
    assert "zb-v over 1f1b, taking turns, zb-v first: 1.225 (SE 0.025; rounds 1.250 1.200)" in text
    assert "zb-v taking turns / alone, 1f1b first: 1.062 (SE 0.062; rounds 1.125 1.000)" in text
    assert "1f1b taking turns / alone, zb-v first: 1.050 (SE 0.050; rounds 1.100 1.000)" in text
