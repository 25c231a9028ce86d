"""benchmarks/recv_lookahead.py: its plan (alternating fresh runs of each lookahead), its commands
and the meaning of its table."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "recv_lookahead.py"


def _load():
    return load_script(SCRIPT, "recv_lookahead_bench")


def test_dry_run_alternates_both_lookaheads_in_fresh_traced_runs(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--rounds", "3", "--schedules", "zb-v", "x.koala",
                          "--work", str(tmp_path / "w")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    runs = [line.strip()[2:] for line in res.stderr.splitlines() if line.strip().startswith("$ ")]
    assert len(runs) == 3 * 2 * 2
    settings = [(r.split()[0], r.split("--schedule ")[1].split()[0]) for r in runs]
    assert settings[:4] == [("KOALA_RECV_LOOKAHEAD=2", "zb-v"), ("KOALA_RECV_LOOKAHEAD=all", "zb-v"),
                            ("KOALA_RECV_LOOKAHEAD=2", "x.koala"), ("KOALA_RECV_LOOKAHEAD=all", "x.koala")]
    assert settings[4:8] == settings[:4][::-1]  # the next round in the other order
    assert all("--standalone" in r and "--trace" in r and "--loss-log" in r and "--chunks 2" in r for r in runs)
    assert not (tmp_path / "w").exists()


def test_table_gives_the_rounds_ratio_and_the_late_share():
    bench = _load()
    times = {("zb-v", "2"): [100.0, 200.0], ("zb-v", "all"): [90.0, 200.0]}
    late = {("zb-v", "2"): [0.1, 3.0, 5.0, 0.0], ("zb-v", "all"): [0.1, 0.2, 2.5, 0.0]}
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in bench.format_table(times, late).splitlines()[2:]}
    assert rows["2"][4] == "-" and rows["all"][4] == f"{(0.9 * 1.0) ** 0.5:.3f}"
    assert rows["2"][5:] == ["4", "50.0%", "2.02"] and rows["all"][5:] == ["4", "25.0%", "0.70"]
