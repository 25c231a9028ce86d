"""benchmarks/fidelity.py: its argument handling, its plan (--dry-run: the user's commands, nothing
run) and the form of its table; and the DeepSpeed example's hooks it uses (`train:layers` for
`koala profile deepspeed`, `--loss-log`)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    return load_script(SCRIPT, "fidelity_bench")


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_dry_run_prints_the_users_commands_and_writes_nothing(tmp_path):
    work = tmp_path / "work"
    res = _run("--dry-run", "--quick", "--work", str(work), "--out", str(tmp_path / "report.txt"))
    assert res.returncode == 0, res.stderr
    out, err = res.stdout, res.stderr
    assert out.splitlines()[0].startswith("$ python benchmarks/fidelity.py --dry-run --quick")
    assert "machine: " in out and "load average" in out and "calibration: megatron" in out
    commands = [line.strip()[2:] for line in err.splitlines() if line.strip().startswith("$ ")]
    koala = [c for c in commands if c.split()[0].endswith("koala")]
    runs = [c for c in commands if c.split()[0].endswith("torchrun")]
    assert any(" profile megatron-gpt " in c and "--num-layers 4 --hidden-size 64" in c for c in koala)
    assert any(" profile deepspeed --layers train:layers --input train:sample" in c for c in koala)
    searches = [c for c in koala if " search " in c]
    # per v the model's own pick (--min-gain 0), and what the search's defaults give a user
    assert [("--min-gain 0" in c, "/default_v1.koala" in c) for c in searches] == [(True, False), (False, True)] * 2
    assert any("pretrain_gpt.py" in c and "--loss-log" in c for c in runs)
    assert any("deepspeed_pipe/train.py" in c and "--loss-log" in c for c in runs)
    assert all("--standalone" in c for c in runs)  # no fixed port shared with other jobs
    assert not work.exists() and not (tmp_path / "report.txt").exists()


def _commands(stderr: str) -> list[str]:
    return [line.strip()[2:] for line in stderr.splitlines() if line.strip().startswith("$ ")]


def test_dry_run_calibrates_on_traced_library_runs_before_choosing(tmp_path):
    """The user's path: profile -> a traced run in which 1f1b and zb-h1 take turns (a trace per
    schedule) -> koala calibrate on those traces and the profile, each schedule's first turn left
    out -> compare / search / simulate on the calibrated profile."""
    res = _run("--dry-run", "--quick", "--work", str(tmp_path / "w"))
    assert res.returncode == 0, res.stderr
    for engine, flag in (("megatron", "--koala-trace"), ("deepspeed", "--trace")):
        work = tmp_path / "w" / ("megatron-gpt-4L-h64-s32-p2" if engine == "megatron" else "deepspeed-dim64-p2")
        cmds = [c for c in _commands(res.stderr) if str(work) in c]
        first = "--koala-schedule" if engine == "megatron" else "--schedule"
        traced = [c for c in cmds if f" {flag} " in c and "/trace_" in c]
        assert len(traced) == 1 and f"{first} {work}/export_1f1b_v1.json " in traced[0]
        assert f" {flag} {work}/trace_r0.json " in traced[0]
        assert traced[0].endswith(f"--alternate-schedules {work}/export_zb-h1_v1.json --alternate-block 4 "
                                  f"--alternate-settle 2")
        assert "torchrun" in traced[0] and ("--train-iters 24 " in traced[0] or "--steps 24 " in traced[0])
        cal = [c for c in cmds if " calibrate " in c and "recalibrated" not in c]
        assert cal == [f"{Path(cal[0].split()[0])} calibrate {work}/trace_r0.json {work}/trace_r0.zb-h1.json "
                       f"--profile {work}/profile_v1.json -o {work}/calibrated_v1.json --skip-steps 8 --settle-steps 2"]
        assert not any("/export_export_" in c for c in cmds)  # each schedule exported once
        exports = [c for c in cmds[:cmds.index(traced[0])] if " export " in c]
        assert len(exports) == len(set(exports)) == 2  # 1f1b, zb-h1: once each before the calibration
        traced.insert(1, traced[0])
        order = [cmds.index(c) for c in (traced[0], traced[1], cal[0])]
        assert order == sorted(order) and all(" profile " not in c for c in cmds[order[-1]:])
        first_run = next(i for i, c in enumerate(cmds) if i > order[-1] and "torchrun" in c)
        chose = [c for c in cmds[order[-1]:first_run] if " compare " in c or " search " in c or " simulate " in c]
        assert chose and all(f"--profile {work}/calibrated_v1.json" in c for c in chose)
        measured = [c for c in cmds[order[-1]:] if "torchrun" in c and "/paired_round" not in c]
        assert measured and all(f" {flag} {work}/measured_round0_" in c for c in measured)
        recal = [c for c in cmds if " calibrate " in c and "recalibrated" in c]
        assert len(recal) == 1 and cmds.index(recal[0]) > cmds.index(measured[-1])
        # the paired round: one untraced run in which the schedules take turns, each as its
        # exported file (which keeps its own v and placement)
        paired = [c for c in cmds if "/paired_round" in c]
        assert len(paired) == 1 and cmds.index(measured[-1]) < cmds.index(paired[0]) < cmds.index(recal[0])
        first = "--koala-schedule" if engine == "megatron" else "--schedule"
        assert f"{first} {work}/export_1f1b_v1.json " in paired[0]
        assert f" {flag} " not in paired[0] and ("--train-iters 20 " in paired[0] or "--steps 20 " in paired[0])
        assert (f"--alternate-schedules '{work}/export_<best predefined>_v1.json,{work}/export_searched_v1_v1.json' "
                f"--alternate-block 4 --alternate-settle 2") in paired[0]
        assert any(f" export {work}/searched_v1.koala " in c and c.endswith(f"-o {work}/export_searched_v1_v1.json")
                   for c in cmds[:cmds.index(paired[0])])
        assert all(f"{work}/measured_round0_" in t for t in recal[0].split("calibrate ")[1].split(" --profile")[0]
                   .split()), recal
        assert f"--profile {work}/profile_v1.json --skip-steps 3 -o {work}/recalibrated_v1.json" in recal[0]
        after = cmds[cmds.index(recal[0]) + 1:]
        assert after and all(f"--profile {work}/recalibrated_v1.json" in c for c in after if " simulate " in c)
    assert ("calibration: megatron gpt-4L-h64-s32 p=2: koala calibrate on traced runs where the library schedules "
            "take turns") in res.stdout


def test_full_plan_alternates_fresh_runs_and_profiles_each_v(tmp_path, fidelity):
    res = _run("--dry-run", "--engines", "deepspeed", "--rounds", "2", "--work", str(tmp_path / "w"))
    assert res.returncode == 0, res.stderr
    cmds = [line.strip()[2:] for line in res.stderr.splitlines() if line.strip().startswith("$ ")]
    profiles = [c for c in cmds if " profile deepspeed " in c]
    assert any("-v 2" in c for c in profiles) and any("-v 1" in c for c in profiles)
    assert any("fidelity_ds_dim1024:layers" in c for c in profiles)  # the other --dim: a module of its own
    dim64 = [c for c in cmds if "torchrun" in c and "--dim 64 " in c]
    runs = [c.split("--schedule ")[1].split()[0] for c in dim64 if "/trace_" not in c and "/paired_" not in c]
    assert len(runs) == 2 * 3  # two rounds of three schedules, a fresh torchrun each
    paired = [c.split("--schedule ")[1].split()[0] for c in dim64 if "/paired_" in c]
    assert len(paired) == 6 and paired[0] != paired[1]  # --paired-rounds' default, the first schedule rotating
    assert runs[:3] != runs[3:] and sorted(runs[:3]) == sorted(runs[3:])  # the order rotates
    traced = [c for c in dim64 if "/trace_" in c]  # calibration: per v a full and a split backward,
    # every v's taking turns in one run (v = 1 and v = 2 calibrated over the same moments), 3 runs,
    # the first schedule rotated
    w = tmp_path / "w" / "deepspeed-dim64-p2"
    names = ["1f1b_v1", "zb-h1_v1", "interleaved-1f1b_v2", "zb-v_v2"]
    assert [c.split("--schedule ")[1].split()[0] for c in traced] == [f"{w}/export_{n}.json" for n in names[:3]]
    for r, c in enumerate(traced):
        rest = [f"{w}/export_{n}.json" for n in names[r + 1:] + names[:r]]
        assert c.endswith(f"--alternate-schedules {','.join(rest)} --alternate-block 4 --alternate-settle 2")
        assert "--steps 160 " in c
        assert f"--trace {w}/trace_r{r}.json " in c
    assert "--chunks 2 --placement interleaved" in traced[2] and " --chunks " not in traced[0] + traced[1]
    cal = [c for c in cmds if " calibrate " in c and "dim64" in c and "recalibrated" not in c]
    recal = [c for c in cmds if " calibrate " in c and "dim64" in c and "recalibrated" in c]
    assert len(recal) == 1 and recal[0].count("/measured_round") == 2 * 3
    # one koala calibrate, a --profile per v: each v's fitted to its traces, the speedups across v printed
    assert len(cal) == 1
    assert cal[0].split(" calibrate ")[1].split(" --profile")[0].split() == [
        f"{w}/trace_r0.json", f"{w}/trace_r0.zb-h1.json", f"{w}/trace_r1.json", f"{w}/trace_r1.1f1b.json",
        f"{w}/trace_r2.1f1b.json", f"{w}/trace_r2.zb-h1.json", f"{w}/trace_r0.interleaved-1f1b.json",
        f"{w}/trace_r0.zb-v.json", f"{w}/trace_r1.interleaved-1f1b.json", f"{w}/trace_r1.zb-v.json",
        f"{w}/trace_r2.json", f"{w}/trace_r2.zb-v.json"]
    assert cal[0].endswith(f"--profile {w}/profile_v1.json -o {w}/calibrated_v1.json --profile {w}/profile_v2.json "
                           f"-o {w}/calibrated_v2.json --skip-steps 16 --settle-steps 2")


@pytest.mark.parametrize("args, says", [
    (["--warmup", "8", "--iterations", "8"], "--warmup 8 must be >= 0 and below --iterations 8"),
    (["--chunks", "2"], "--chunks 2: each v >= 1, and 1 among them"),
    (["--chunks", "one"], "--chunks 'one': expected comma-separated integers"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--calib-rounds", "0"], "--calib-rounds must be >= 1"),
    (["--search-budget", "0"], "--search-budget must be > 0"),
    (["--calib-iterations", "31"], "--calib-iterations 31 must be at least 32: two turns of 4 iterations of each "
                                   "calibration schedule"),
    (["--engines", "torch"], "invalid choice: 'torch'"),
    (["--paired-rounds", "-1"], "--paired-rounds must be >= 0"),
    (["--paired-iterations", "19"], "--paired-iterations 19 must be at least --warmup 4 + 16"),
])
def test_bad_arguments_are_one_line(args, says):
    res = _run("--dry-run", *args)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0], res.stderr


def test_an_unwritable_out_is_refused_before_anything_runs(tmp_path):
    res = _run("--quick", "--out", str(tmp_path / "missing" / "report.txt"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"fidelity.py: --out {tmp_path / 'missing' / 'report.txt'}: directory "
                                               f"{tmp_path / 'missing'} does not exist"]
    assert res.stdout == ""


def test_rows_give_speedups_over_1f1b_and_the_error(fidelity):
    ex = fidelity.Example("deepspeed", "dim64", 2, {"dim": 64})
    chosen = [fidelity.Candidate("1f1b", "1f1b", 1, predicted_ms=100.0),
              fidelity.Candidate("best predefined (zb-h1)", "zb-h1", 1, predicted_ms=80.0),
              fidelity.Candidate("searched (linear, v=1) = zb-h1", "s.koala", 1, predicted_ms=80.0,
                                 same_as="best predefined (zb-h1)")]
    times = {"1f1b": [[110.0, 130.0, 120.0], [140.0]], "best predefined (zb-h1)": [[90.0, 100.0], [95.0, 500.0]]}
    rows = fidelity.rows_of(ex, chosen, times)
    assert [r.speedup_predicted for r in rows] == [1.0, 1.25, 1.25]
    assert rows[0].measured_ms == 125.0 and rows[1].measured_ms == 97.5  # median of every kept iteration
    assert rows[1].speedup_measured == pytest.approx(125.0 / 97.5)
    assert rows[2].measured_ms == rows[1].measured_ms  # a duplicate is run once and reported for both
    assert rows[0].error == pytest.approx(0.25) and rows[1].error == pytest.approx(97.5 / 80.0 - 1)
    assert rows[0].round_medians == (120.0, 140.0)
    table = fidelity.format_table(rows).splitlines()
    assert table[0] == "| " + " | ".join(fidelity.COLUMNS) + " |"
    assert len(table) == 2 + len(rows) and all(line.count("|") == len(fidelity.COLUMNS) + 1 for line in table)
    assert rows[1].round_speedups == pytest.approx((120.0 / 95.0, 140.0 / 297.5))  # round by round
    assert rows[1].speedup_error == pytest.approx(125.0 / 97.5 - 1.25)
    se = abs(120.0 / 95.0 - 140.0 / 297.5) / 2  # two rounds: stdev / sqrt(2) = half their difference
    assert rows[1].speedup_se == pytest.approx(se) and rows[0].speedup_se == 0.0
    assert table[3] == ("| deepspeed dim64 p=2 | best predefined (zb-h1) | 1 | 80.0 | 97.5 | 95.0-297.5 | "
                        f"1.250x | 1.282x | 0.471-1.263 | {se:.3f} | +0.032 | +21.9% | - | - | - | - | - | - |")
    said = fidelity.verdict(rows)  # the default's answer, then the searched row: within 0.05, above 0.98x,
    # rounds too far apart
    assert said[0] == ("deepspeed dim64 p=2: koala search with its defaults (--min-gain 5, the profile's spread) "
                       "answers a schedule not measured here")
    said = said[1:]
    assert len(said) == 1 and said[0].startswith("deepspeed dim64 p=2, searched (linear, v=1) = zb-h1: speedup "
                                                 "error +0.032 (within 0.05); measured 1.282x of 1f1b (at least 0.98x)")
    assert said[0].endswith(f"span 0.793, their mean +-{2 * se:.3f} (2 standard errors): wider than the target, "
                            "this run cannot resolve it")
    one_round = fidelity.rows_of(ex, chosen, {k: v[:1] for k, v in times.items()})
    assert one_round[1].speedup_se is None and "| - |" in fidelity.format_table(one_round)
    assert fidelity.verdict(one_round)[1].endswith("one round: no spread to judge it by")
    # a round in which a schedule kept no iteration: the other rounds still pair 1f1b's round with
    # the same round of the schedule (round by round, not the n-th non-empty ones)
    gap = fidelity.rows_of(ex, chosen, {"1f1b": [[100.0], [200.0]], "best predefined (zb-h1)": [[], [100.0]]})
    assert gap[1].round_speedups == (2.0,) and gap[1].speedup_measured == 1.5
    steady = {"1f1b": [[120.0]] * 4 + [[121.0]] * 4, "best predefined (zb-h1)": [[100.0]] * 8}
    said = fidelity.verdict(fidelity.rows_of(ex, chosen, steady))[1]  # 8 close rounds resolve the target
    assert said.endswith("(2 standard errors)") and "cannot resolve" not in said


def test_the_default_searchs_answer_is_measured_where_it_is_none_of_the_others(fidelity, monkeypatch, tmp_path):
    """koala search with its defaults may answer a schedule none of the measured candidates is
    (at 5ee9bef on Megatron 8 layers: a v = 2 schedule, where the model's own pick was zb-h1):
    then it joins them, measured as a user would run it, with its own target lines."""
    ex = fidelity.Example("megatron", "gpt-8L", 2, dict(fidelity.MEGATRON_SIZES["gpt-8L-h256-s64"]))
    profiles = {1: tmp_path / "profile_v1.json", 2: tmp_path / "profile_v2.json"}
    monkeypatch.setattr(fidelity, "run", lambda *a, **k: "")
    ms = {1: 100.0, 2: 90.0}
    monkeypatch.setattr(fidelity, "predict", lambda ex, c, prof, *a: (ms[c.v], "linear" if c.v == 1 else "vshape"))
    keys = {}
    monkeypatch.setattr(fidelity, "schedule_key", lambda ex, c, *a: keys.get(c.schedule, c.schedule))

    def chosen():
        return [fidelity.Candidate("1f1b", "1f1b", 1, predicted_ms=100.0),
                fidelity.Candidate("searched (linear, v=1)", "s.koala", 1, predicted_ms=95.0)]

    keys[str(tmp_path / "default_v2.koala")] = "s.koala"  # the answer is the searched schedule
    measured = chosen()
    assert fidelity.default_answer(ex, profiles, measured, 1.0, tmp_path, False, print) == "searched (linear, v=1)"
    assert len(measured) == 2
    keys.clear()  # the answer is another schedule: measured too
    measured = chosen()
    label = fidelity.default_answer(ex, profiles, measured, 1.0, tmp_path, False, print)
    assert label == "default search (vshape, v=2)" and measured[-1].label == label
    assert (measured[-1].schedule, measured[-1].v, measured[-1].predicted_ms) == (str(tmp_path / "default_v2.koala"),
                                                                                 2, 90.0)
    rows = fidelity.rows_of(ex, measured, {"1f1b": [[100.0]], "searched (linear, v=1)": [[96.0]], label: [[95.0]]},
                            None, None, label)
    said = fidelity.verdict(rows)
    assert said[0].endswith(f"answers {label}: measured {100 / 95:.3f}x of 1f1b")
    assert [line.split(":")[0] for line in said[1:]] == ["megatron gpt-8L p=2, searched (linear, v=1)",
                                                         f"megatron gpt-8L p=2, {label}"]
    # another v's answer by less than --min-gain's default over the first v's: the first v's, as
    # within one search (at 2cf472c a v = 2 answer 0.1% faster than 1f1b was taken, and measured 0.908x)
    keys[str(tmp_path / "default_v1.koala")] = "1f1b"
    for faster, want in ((0.999, "1f1b"), (1 / (1 + fidelity.DEFAULT_MIN_GAIN_PCT / 100) - 0.001, label)):
        ms[2] = 100.0 * faster
        measured = chosen()
        assert fidelity.default_answer(ex, profiles, measured, 1.0, tmp_path, False, print) == want, faster


def test_rows_give_the_step_time_after_calibrating_on_the_measured_runs(fidelity):
    """recalibrated ms: the schedule simulated on the profile fitted to the measured runs' own
    traces; the verdict says per example whether every schedule is within 10% of it."""
    ex = fidelity.Example("deepspeed", "dim64", 2, {"dim": 64})
    chosen = [fidelity.Candidate("1f1b", "1f1b", 1, predicted_ms=100.0),
              fidelity.Candidate("best predefined (zb-h1)", "zb-h1", 1, predicted_ms=80.0),
              fidelity.Candidate("searched (v=2)", "s.koala", 2, predicted_ms=70.0)]
    times = {"1f1b": [[100.0]], "best predefined (zb-h1)": [[90.0]], "searched (v=2)": [[76.0]]}
    rows = fidelity.rows_of(ex, chosen, times, {"1f1b": 104.0, "best predefined (zb-h1)": 88.0,
                                                "searched (v=2)": 70.0})
    assert [r.recalibrated_ms for r in rows] == [104.0, 88.0, 70.0]
    assert [round(r.recalibrated_error, 4) for r in rows] == [round(100 / 104 - 1, 4), round(90 / 88 - 1, 4),
                                                                   round(76 / 70 - 1, 4)]
    assert fidelity.format_table(rows).splitlines()[4].endswith("| 70.0 | +8.6% | - | - | - | - |")
    said = fidelity.verdict(rows)
    assert said[0] == ("deepspeed dim64 p=2: after koala calibrate on the measured runs' traces, step-time errors "
                       "-3.8%..+8.6% (within 10%)")
    rows = fidelity.rows_of(ex, chosen, times, {"1f1b": 104.0, "best predefined (zb-h1)": 88.0,
                                                "searched (v=2)": 68.0})
    assert fidelity.verdict(rows)[0].endswith("-3.8%..+11.8% (beyond 10%)")


def test_paired_rounds_give_speedups_from_the_turns_each_schedule_took(fidelity, tmp_path, monkeypatch):
    """measure_paired keeps, per schedule, the periods of its own turns after the warm-up and
    the first iteration of each turn; rows and verdict give the paired speedup beside the fresh
    rounds' one."""
    ex = fidelity.Example("megatron", "gpt-4L", 2, dict(fidelity.MEGATRON_SIZES["gpt-4L-h64-s32"]))
    chosen = [fidelity.Candidate("1f1b", "1f1b", 1, predicted_ms=100.0),
              fidelity.Candidate("best predefined (zb-v)", "zb-v", 2, "vshape", predicted_ms=95.0),
              fidelity.Candidate("searched (linear, v=1)", "s.koala", 1, predicted_ms=90.0)]
    assert [c.label for c in fidelity.paired_candidates(chosen)] == [c.label for c in chosen]
    assert fidelity.paired_candidates(chosen[:1]) == []  # nothing to take turns with 1f1b
    assert fidelity.paired_candidates([chosen[0], dataclasses.replace(chosen[1], same_as="1f1b")]) == []
    said = []
    ms = {"1f1b": 100.0, "zb-v": 90.0, "s": 80.0}

    def fake_run(cmd, log, env=None, cwd=None, dry=False, say=print):
        if "export" in cmd:  # schedule_file: koala export NAME ... -o FILE
            Path(cmd[cmd.index("-o") + 1]).write_text("{}")
            return ""
        said.append(cmd)
        turns = [cmd[cmd.index("--koala-schedule") + 1], *cmd[cmd.index("--alternate-schedules") + 1].split(",")]
        names = [turns[(i // 4) % len(turns)] for i in range(24)]
        # the first two of a turn and the warm-up 1000 ms (never kept)
        periods = [1000.0 if i < 2 or i % 4 < 2 else ms[Path(n).stem.split("_")[1]] + len(said)
                   for i, n in enumerate(names)]
        Path(log).with_suffix(".json").write_text(json.dumps({"period_ms": periods, "iteration_schedules": names}))
        return ""

    monkeypatch.setattr(fidelity, "run", fake_run)
    args = fidelity.parse_args(["--paired-rounds", "2", "--paired-iterations", "24", "--warmup", "2"])
    paired = fidelity.measure_paired(ex, chosen, args, tmp_path, lambda s: None)
    # every schedule as its exported file, so that each keeps its own v: zb-v (v=2) beside 1f1b
    assert [c[c.index("--koala-schedule") + 1] for c in said] == [str(tmp_path / "export_1f1b_v1.json"),
                                                                   str(tmp_path / "export_zb-v_v2.json")]
    assert "--virtual-pipeline-model-parallel-size" not in said[0] and \
        said[1][said[1].index("--virtual-pipeline-model-parallel-size") + 1] == "2"
    # kept: the last two of each turn of 4 (iterations 2-3, 6-7, ..., 22-23); two turns each per round
    assert paired == {"1f1b": [[101.0] * 4, [102.0] * 4], "best predefined (zb-v)": [[91.0] * 4, [92.0] * 4],
                      "searched (linear, v=1)": [[81.0] * 4, [82.0] * 4]}
    rows = fidelity.rows_of(ex, chosen, {"1f1b": [[100.0]], "best predefined (zb-v)": [[99.0]],
                                         "searched (linear, v=1)": [[97.0]]}, None, paired)
    assert rows[2].paired_speedup == pytest.approx(101.5 / 81.5)  # medians over both rounds
    assert rows[2].paired_round_speedups == pytest.approx((101 / 81, 102 / 82))
    assert rows[2].paired_error == pytest.approx(101.5 / 81.5 - 100.0 / 90.0)
    assert rows[1].paired_speedup == pytest.approx(101.5 / 91.5)  # the v = 2 schedule paired too
    assert rows[0].paired_speedup == 1.0
    without = fidelity.rows_of(ex, chosen, {"1f1b": [[100.0]], "best predefined (zb-v)": [[99.0]],
                                            "searched (linear, v=1)": [[97.0]]}, None,
                               {k: val for k, val in paired.items() if "zb-v" not in k})
    assert without[1].paired_round_speedups == () and without[1].paired_speedup != without[1].paired_speedup
    assert fidelity.format_table(without).splitlines()[3].endswith("| - | - | - | - |")
    said = fidelity.verdict(rows)
    assert said[0].endswith("answers a schedule not measured here")
    rows = fidelity.rows_of(ex, chosen, {"1f1b": [[100.0]], "best predefined (zb-v)": [[99.0]],
                                         "searched (linear, v=1)": [[97.0]]}, None, paired, "searched (linear, v=1)")
    said = fidelity.verdict(rows)
    assert said[0] == ("megatron gpt-4L p=2: koala search with its defaults (--min-gain 5, the profile's spread) "
                       "answers searched (linear, v=1): measured 1.031x of 1f1b, 1.245x in the paired rounds")
    assert said[-2] == ("megatron gpt-4L p=2, searched (linear, v=1): speedup error -0.080 (beyond 0.05); measured "
                        "1.031x of 1f1b (at least 0.98x); one round: no spread to judge it by")
    assert said[-1] == ("megatron gpt-4L p=2, searched (linear, v=1), paired rounds (taking turns with 1f1b "
                               "in one run): speedup error +0.134 (beyond 0.05); measured 1.245x of 1f1b (at least "
                               "0.98x); the paired rounds' speedups span 0.003, their mean +-0.003 (2 standard "
                               "errors)")
    ds = fidelity.Example("deepspeed", "dim64", 2, {"dim": 64}).run_cmd(chosen[0], 12, tmp_path / "x.json",
                                                                        alternate=(chosen[2],))
    assert ds[-4:] == ["--alternate-schedules", "s.koala", "--alternate-block", "4"]  # settle 1: the example's default
    ds = fidelity.Example("deepspeed", "dim64", 2, {"dim": 64}).run_cmd(chosen[0], 12, tmp_path / "x.json",
                                                                        alternate=(chosen[2],), settle=2)
    assert ds[-6:] == ["--alternate-schedules", "s.koala", "--alternate-block", "4", "--alternate-settle", "2"]


def test_each_example_runs_the_v_its_layers_allow(fidelity, monkeypatch):
    mg = fidelity.Example("megatron", "gpt-4L", 2, dict(fidelity.MEGATRON_SIZES["gpt-4L-h64-s32"]))
    assert mg.chunks((1, 2)) == (1, 2)
    assert fidelity.Example("megatron", "gpt-4L", 4, mg.size).chunks((1, 2)) == (1,)  # 4 layers, 8 stages: no
    assert fidelity.Example("deepspeed", "dim64", 4, {"dim": 64}).chunks((1, 2)) == (1, 2)  # 9 layers >= 8
    args = fidelity.parse_args(["--quick"])
    monkeypatch.setattr(fidelity.os, "cpu_count", lambda: 2)
    assert [(e.engine, e.p) for e in fidelity.plan(args)] == [("megatron", 2), ("deepspeed", 2)]
    monkeypatch.setattr(fidelity.os, "cpu_count", lambda: 8)
    assert [e.p for e in fidelity.plan(args)] == [2, 2, 4, 4]


def test_a_failing_step_is_one_line_naming_its_log(fidelity, tmp_path):
    log = tmp_path / "step.log"
    with pytest.raises(fidelity.BenchError) as info:
        fidelity.run([sys.executable, "-c", "import sys; print('x'); sys.exit('ValueError: bad size')"], log,
                     say=lambda s: None)
    assert "\n" not in str(info.value) and "ValueError: bad size" in str(info.value) and str(log) in str(info.value)


# -- the DeepSpeed example's parts the benchmark uses ---------------------------------------------
@pytest.fixture(scope="module")
def example():
    pytest.importorskip("deepspeed")
    return load_script(ROOT / "examples" / "deepspeed_pipe" / "train.py", "ds_example_train_fidelity")


def test_the_example_builds_its_layer_list_for_any_dim(example):
    import torch

    specs = example.build_layers(32)
    assert len(specs) == 9 and [s.typename for s in specs] == [example.Block] * 8 + [torch.nn.Linear]
    assert specs[-1].module_args == (32, 1) and example.sample_input(32).shape == (example.MICRO_BATCH, 32)
    assert len(example.layers()) == 9 and example.sample().shape == (example.MICRO_BATCH, 64)


def test_the_profile_reseeds_per_layer_as_the_examples_pipeline_module_does(example, fidelity, tmp_path):
    """The example builds PipelineModule(seed_layers=SEED_LAYERS): DeepSpeed then reseeds before
    every layer of every forward, which the benchmark's profile must measure (--seed-layers)."""
    ex = fidelity.Example("deepspeed", "dim64", 2, {"dim": 64})
    cmd = ex.profile_cmd(1, tmp_path / "p.json", tmp_path, quick=True)
    assert fidelity.DEEPSPEED_SEED_LAYERS is example.SEED_LAYERS
    assert ("--seed-layers" in cmd) is example.SEED_LAYERS


def test_the_examples_loss_log_is_checked_before_deepspeed_starts(example, monkeypatch, capsys, tmp_path):
    from koala_ds.core.errors import run_main

    monkeypatch.setattr(example.deepspeed, "init_distributed", lambda **_: pytest.fail("DeepSpeed was started"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["train.py", "--loss-log", str(tmp_path / "no" / "times.json")])
    with pytest.raises(SystemExit) as info:
        run_main(example.main, "train.py")
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"train.py: error: --loss-log {tmp_path / 'no' / 'times.json'}: directory {tmp_path / 'no'} "
                     f"does not exist"]


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(300)
def test_the_examples_schedules_take_turns_with_the_losses_of_one(tmp_path):
    """examples/deepspeed_pipe --alternate-schedules: 1f1b and zb-h1 taking turns every 2 steps
    train as 1f1b alone does; the loss log names each step's schedule. A schedule file of another
    placement (V-shape, 2 chunks) takes its turns on an engine and model copy of its own, which
    starts as the same model: its steps repeat 1f1b's first ones (every step trains on the same
    batch)."""
    from koala_ds.resolve import load_schedule

    zbv = tmp_path / "schedules" / "zb-v.json"
    zbv.parent.mkdir()
    zbv.write_text(load_schedule("zb-v", 2, 8, 2).to_json())
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    logs, out = {}, {}
    traces = tmp_path / "traces"
    traces.mkdir()
    for label, extra in (("one", []), ("turns", ["--alternate-schedules", "zb-h1", "--trace", str(traces / "a.json")]),
                         ("copies", ["--alternate-schedules", str(zbv), "--trace", str(traces / "b.json")])):
        logs[label] = tmp_path / f"{label}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "deepspeed_pipe" / "train.py"), "--schedule", "1f1b", "--steps", "6",
               "--loss-log", str(logs[label]), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[label] = proc.stdout
    assert "schedules taking turns" not in out["one"]  # the end line: one per schedule, counted steps 1 each
    assert "median step period (iterations counted): 1f1b " in out["turns"] and " (1, " in out["turns"]
    one, turns = (json.loads(logs[k].read_text()) for k in ("one", "turns"))
    assert turns["iteration_schedules"] == ["1f1b", "1f1b", "zb-h1", "zb-h1", "1f1b", "1f1b"]
    assert one["iteration_schedules"] == ["1f1b"] * 6 and turns["schedule"] == "1f1b"
    assert turns["losses"] == pytest.approx(one["losses"], rel=1e-6)
    copies = json.loads(logs["copies"].read_text())
    assert copies["iteration_schedules"] == ["1f1b", "1f1b", str(zbv), str(zbv), "1f1b", "1f1b"]
    first = one["losses"]
    assert copies["losses"] == pytest.approx([first[0], first[1], first[0], first[1], first[2], first[3]], rel=1e-6)
    # --trace: a trace per schedule (the copy's engine records into the first's recorder), their
    # steps numbered together; koala calibrate's reader leaves out each turn's first step
    from koala_ds.sim.measured import load_runs

    assert sorted(p.name for p in traces.iterdir()) == sorted(
        f"{x}.rank{g}.json" for x in ("a", "a.zb-h1", "b", "b.zb-v") for g in (0, 1))
    for run, other, v in (("a", "zb-h1", 1), ("b", "zb-v", 2)):
        mine, theirs = load_runs([str(traces / f"{run}.json"), str(traces / f"{run}.{other}.json")])
        assert mine.schedule.name == "1f1b" and (theirs.schedule.name, theirs.schedule.v) == (other, v)
        assert [s.number for s in mine.steps] == [1, 5] and [s.number for s in theirs.steps] == [3]
        assert mine.steps[0].period is not None and theirs.steps[0].period is not None  # to the next turn's start
        assert mine.steps[1].period is None  # the run's last step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_koala_profile_deepspeed_profiles_the_examples_layer_list(tmp_path):
    """What the benchmark runs first, as a user would: the example's own `train:layers` (one
    process; the p2p latency given, so no ping-pong)."""
    pytest.importorskip("deepspeed")
    import os

    from deepspeed_jobs import extensions_dir

    out = tmp_path / "prof.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "examples" / "deepspeed_pipe"), DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    koala = str(Path(sys.executable).parent / "koala")
    res = subprocess.run([koala, "profile", "deepspeed", "--layers", "train:layers", "--input", "train:sample",
                          "--partition-method", "uniform", "-p", "2", "-v", "2", "--p2p-latency", "0.1", "--warmup",
                          "1", "--iters", "2", "-o", str(out)],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    stages = json.loads(out.read_text())["stages"]
    assert len(stages) == 4 and all(s["forward"] > 0 and s["backward_input"] > 0 for s in stages)
