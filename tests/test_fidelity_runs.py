"""benchmarks/fidelity_runs.py: fidelity.py's reports read back (tables written by fidelity.py's own
format_table), the errors pooled over runs, the verdict per row, and bad input as one line."""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fidelity_runs.py"


@pytest.fixture(scope="module")
def fid():
    return load_script(ROOT / "benchmarks" / "fidelity.py", "fidelity_bench_for_runs")


@pytest.fixture(scope="module")
def runs_mod():
    return load_script(SCRIPT, "fidelity_runs_bench")


def _report(fid, started: str, searched: tuple[float, float, float], turns: bool = True,
            searched_label: str = "searched (vshape, v=2)") -> str:
    """One fidelity.py report: 1f1b at 100 ms predicted; the searched row predicted `searched[0]`x,
    measured fresh `searched[1]`x and paired `searched[2]`x; zb-h1 predicted 1.02x, fresh 1.0x,
    paired 1.01x."""
    def row(label, pred, fresh, paired):
        return fid.Row("megatron gpt-8L-h256-s64 p=2", label, 1, 100 / pred, 100 / fresh, (100 / fresh,), pred,
                       fresh, (fresh, fresh), 100.0, paired, (paired, paired))
    rows = [row("1f1b", 1.0, 1.0, 1.0), row("best predefined (zb-h1)", 1.02, 1.0, 1.01),
            row(searched_label, *searched)]
    how = "take turns of 4 iterations" if turns else "3 round(s) of traced runs"
    return "\n".join(["$ python benchmarks/fidelity.py --work /tmp/x", "machine: 2 cores",
                      f"started {started}; calibration: {how}; 8 measured round(s)", "calibration: ...", "",
                      fid.format_table(rows), "", "megatron ...: speedup error", "", "finished 00:00:00"]) + "\n"


def _write(tmp_path: Path, fid, runs) -> Path:
    path = tmp_path / "fidelity.txt"
    path.write_text("\n".join(_report(fid, *r) for r in runs), encoding="utf-8")
    return path


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_the_errors_of_every_run_are_pooled_per_example_and_row(tmp_path, fid):
    path = _write(tmp_path, fid, [("2026-12-07 03:00:00", (1.10, 1.05, 1.04)),
                                  ("2026-12-07 02:00:00", (1.08, 1.08, 1.00)),
                                  ("2026-12-07 01:00:00", (1.05, 1.00, 1.06), False)])
    res = _run("--file", path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "2 run(s): 2026-12-07 03:00:00, 2026-12-07 02:00:00" in lines  # the untimed-turns run left out
    searched = next(line for line in lines if "| searched |" in line)
    cells = [c.strip() for c in searched.strip("|").split("|")]
    paired = [1.04 - 1.10, 1.00 - 1.08]
    assert cells[2] == "2"
    assert cells[3] == "-0.060 -0.080"
    assert cells[4] == f"{statistics.fmean(paired):+.3f} ({statistics.stdev(paired) / 2 ** 0.5:.3f})"
    assert cells[5] == "0 of 2"
    assert cells[6] == "0"  # 1.04x and 1.00x, neither below 0.98x
    assert cells[7].startswith("-0.025 ")  # fresh: -0.05 and 0.00
    predefined = next(line for line in lines if "| best predefined |" in line)
    assert "| -0.010 -0.010 |" in predefined and "| 2 of 2 | - |" in predefined
    # since a time: the third run too
    res = _run("--file", path, "--since", "2026-12-07 00:30")
    assert "3 run(s):" in res.stdout and "-0.060 -0.080 +0.010" in res.stdout


def test_a_searched_row_that_is_1f1b_has_nothing_to_pool(tmp_path, fid):
    path = _write(tmp_path, fid, [("2026-12-07 03:00:00", (1.0, 1.0, 1.0), True, "searched (linear, v=1) = 1f1b"),
                                  ("2026-12-07 02:00:00", (1.0, 1.0, 1.0), True, "searched (linear, v=1) = 1f1b")])
    res = _run("--file", path)
    assert res.returncode == 0, res.stderr
    assert "| searched |" not in res.stdout
    assert "| best predefined | 2 |" in res.stdout


@pytest.mark.parametrize("errors, verdict", [
    ([-0.10, -0.11, -0.09, -0.10], "biased by -0.100"),
    ([0.01, -0.01, 0.0, 0.005], "within the target"),
    ([-0.04, -0.05, -0.03, -0.06], "not 0, within the target or not"),
    ([-0.09, 0.08, -0.02, 0.04], "no bias seen"),
    ([0.3], "too few runs"),
])
def test_the_verdict_over_runs_tells_a_bias_from_scatter(runs_mod, errors, verdict):
    assert verdict in runs_mod._verdict(errors)


def test_the_projects_own_results_file_reads_back(runs_mod):
    """The shipped results: every report parses; each run calibrated from turns has a row per
    example of the best predefined schedule, with numbers, and some have a searched row."""
    text = runs_mod.RESULTS.read_text(encoding="utf-8")
    runs = runs_mod.parse_runs(text, "fidelity.txt")
    assert len(runs) == text.count(runs_mod.RUN_START)
    turns = [rows for _, head, rows in runs if "take turns of" in head]
    assert len(turns) >= 5
    for rows in turns:
        assert len({r.example for r in rows if r.kind == "best predefined"}) == 4
        assert all(r.predicted > 0 and r.paired > 0 for r in rows)
    assert sum(r.kind == "searched" for rows in turns for r in rows) >= len(turns)


def test_bad_input_is_one_line(tmp_path, fid):
    res = _run("--file", tmp_path / "missing.txt")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--file" in res.stderr
    path = _write(tmp_path, fid, [("2026-12-07 01:00:00", (1.05, 1.0, 1.06), False)])
    res = _run("--file", path)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "whose calibration took turns" in res.stderr
    res = _run("--file", path, "--since", "yesterday")
    assert res.returncode == 2 and "--since" in res.stderr.splitlines()[-1]
    res = _run("--file", path, "--out", tmp_path / "no" / "such" / "dir" / "x.txt")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--out" in res.stderr
    broken = tmp_path / "broken.txt"
    broken.write_text(_report(fid, "2026-12-07 03:00:00", (1.1, 1.0, 1.0)).replace("| 1.100x |", "| oops |"),
                      encoding="utf-8")
    res = _run("--file", broken)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "2026-12-07 03:00:00" in res.stderr


def test_out_is_written_whole(tmp_path, fid):
    path = _write(tmp_path, fid, [("2026-12-07 03:00:00", (1.10, 1.05, 1.04)),
                                  ("2026-12-07 02:00:00", (1.08, 1.08, 1.00))])
    out = tmp_path / "pooled.txt"
    res = _run("--file", path, "--out", out)
    assert res.returncode == 0
    assert out.read_text(encoding="utf-8") == res.stdout
