"""benchmarks/turn_positions.py: per position in a turn, each schedule's speed against the first's."""
from __future__ import annotations

import json

from script_modules import load_script


def _log(path, slow_first: float) -> str:
    """Turns of 4 of a, b: b takes 10 ms a step, 10 * slow_first at a turn's first step; a 12 ms."""
    names, periods = [], []
    for turn in range(12):
        name = "a" if turn % 2 == 0 else "b"
        for k in range(4):
            names.append(name)
            periods.append(12.0 if name == "a" else (10.0 * slow_first if k == 0 else 10.0))
    path.write_text(json.dumps({"iteration_schedules": names, "period_ms": periods}))
    return str(path)


def test_a_switch_s_cost_shows_at_the_first_positions_only(tmp_path, capsys):
    bench = load_script("benchmarks/turn_positions.py", "turn_positions_bench")
    logs = [_log(tmp_path / "r0.json", 1.5), _log(tmp_path / "r1.json", 1.5)]
    assert bench.main([*logs, "--skip", "8"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b |"))
    assert row == "| b | 0.800 (0.000) | 1.200 (0.000) | 1.200 (0.000) | 1.200 (0.000) |"


def test_a_file_that_is_not_such_a_log_is_one_line(tmp_path, capsys):
    bench = load_script("benchmarks/turn_positions.py", "turn_positions_bench")
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"losses": [1.0]}))
    assert bench.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"turn_positions.py: {bad}: not a loss log") and "\n" not in err
