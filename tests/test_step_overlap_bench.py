"""benchmarks/step_overlap.py: whether a pipeline rank started step n + 1 before another ended n."""
from __future__ import annotations

import json

from script_modules import load_script
from test_calibrate import _header

from koala_ds.resolve import load_schedule


def _files(tmp_path, steps: dict[int, list[tuple[float, float]]]) -> list[str]:
    """A run's files of one pipeline: per rank, its `step` events (start, end ms) by step number."""
    schedule = load_schedule("1f1b", 2, 2, 1)
    paths = []
    for rank, spans in steps.items():
        events = _header(schedule, rank, 0, rank) + [
            {"name": "step", "cat": "step", "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e3,
             "dur": (end - start) * 1e3, "args": {"step": n}} for n, (start, end) in enumerate(spans)]
        path = tmp_path / f"t.rank{rank}.json"
        path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
        paths.append(str(path))
    return paths


def test_a_rank_starting_its_next_step_early_is_counted(tmp_path, capsys):
    bench = load_script("benchmarks/step_overlap.py", "step_overlap_bench")
    # rank 0 ends its steps at 100, 200, 300; rank 1 starts steps 1 and 2 at 95 and 210
    files = _files(tmp_path, {0: [(0, 100), (105, 200), (212, 300)], 1: [(2, 90), (95, 190), (210, 290)]})
    assert bench.main(files) == 0
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 0 |")}
    assert rows[("0", "0->1")] == "| 0 | 0->1 | 2 | 1 | +2.5 | -5.0 |"  # 95 - 100, 210 - 200
    assert rows[("0", "1->0")] == "| 0 | 1->0 | 2 | 0 | +18.5 | +15.0 |"  # 105 - 90, 212 - 190
    assert rows[("0", "any")] == "| 0 | any | 2 | 1 | +2.5 | -5.0 |"
    # the same run given as its FILE reads the same files
    assert bench.main([str(tmp_path / "t.json")]) == 0
    assert "| 0 | 0->1 | 2 | 1 | +2.5 | -5.0 |" in capsys.readouterr().out


def test_files_without_every_rank_or_not_traces_are_one_line(tmp_path, capsys):
    bench = load_script("benchmarks/step_overlap.py", "step_overlap_bench")
    files = _files(tmp_path, {0: [(0, 100), (105, 200)]})
    assert bench.main(files) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("step_overlap.py: ") and "no two consecutive steps" in err and "\n" not in err
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    assert bench.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"step_overlap.py: {bad}: not a measured koala trace") and "\n" not in err
