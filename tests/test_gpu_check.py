"""benchmarks/gpu_check.py (issue 13's GPU check as one script) on the CPU: a hanging step is
stopped with everything it started and the next step still runs; the schedule comparison
notices unequal losses; and (slow) its --small DeepSpeed step end to end."""
import json
import re
import sys
import time
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]


def gpu_check():
    return load_script("benchmarks/gpu_check.py", "gpu_check")


def alive(pid: int) -> bool:
    """Running: a killed process whose new parent has not yet reaped it (a zombie, state Z, which
    kill(pid, 0) still finds) is not; this machine's init reaps about once a second."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# a step that hangs with a child in a session of its own, as torchrun starts its workers
HANG = ("import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
        "print('child', child.pid, flush=True); time.sleep(120)")


@pytest.mark.timeout(120)
def test_a_hanging_step_is_stopped_with_its_children_and_the_next_step_still_runs(tmp_path, monkeypatch):
    gc = gpu_check()

    def hang(sizes, device, work):
        # 1 s: its child is started and named within about 0.1 s of the step's start
        return gc.Step("a", "hangs", 1, [gc.Run("a", [sys.executable, "-c", HANG], 1)], lambda w, r: ("", {}))

    def fine(sizes, device, work):
        return gc.Step("b", "fine", 1, [gc.Run("b", [sys.executable, "-c", "print('| done |')"], 30)],
                       lambda w, r: ((w / "b.log").read_text().splitlines()[-1], {}))

    monkeypatch.setattr(gc, "STEP_BUILDERS", {"a": hang, "b": fine})
    monkeypatch.setattr(gc, "probe", lambda work, env: {})  # what the machine has: not this test's subject
    t0 = time.monotonic()
    assert gc.main(["--small", "--steps", "a,b", "--out", str(tmp_path)]) == 1  # a step failed
    assert time.monotonic() - t0 < 60
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"]["a"]["status"] == "TIMED OUT" and results["steps"]["b"]["status"] == "ok"
    summary = (tmp_path / "summary.md").read_text()
    assert "| done |" in summary and "last lines of a.log" in summary
    child = int(re.search(r"^child (\d+)$", summary, re.M).group(1))  # the hanging step's own child process
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(child)
    assert (tmp_path / "raw.tar.gz").stat().st_size > 0


def test_schedule_comparison_notices_unequal_losses_and_missing_runs(tmp_path):
    gc = gpu_check()

    def log(name, losses, ms):
        (tmp_path / f"c_{name}.json").write_text(json.dumps({"losses": losses, "iteration_ms": ms}))

    log("1f1b", [4.0, 3.5, 3.0], [10.0, 10.0, 10.0])
    log("zb-h1", [4.0, 3.5, 3.0], [8.0, 8.0, 8.0])
    text, numbers = gc.schedules_report(tmp_path)
    assert not numbers["losses_equal"]  # zb-v did not run
    assert numbers["schedules"]["zb-h1"]["ratio_to_1f1b"] == pytest.approx(0.8)
    log("zb-v", [4.0, 3.5, 3.1], [9.0, 9.0, 9.0])
    text, numbers = gc.schedules_report(tmp_path)
    assert not numbers["losses_equal"] and "NOT EQUAL" in text
    assert numbers["schedules"]["zb-v"]["max_abs_diff"] == pytest.approx(0.1)
    log("zb-v", [4.0, 3.5, 3.0], [9.0, 9.0, 9.0])
    assert gc.schedules_report(tmp_path)[1]["losses_equal"]


@pytest.mark.slow  # the profiler's p2p measurement starts two processes
@pytest.mark.timeout(300)
def test_small_deepspeed_profile_step_end_to_end(tmp_path):
    pytest.importorskip("deepspeed")
    gc = gpu_check()
    assert gc.main(["--small", "--steps", "d", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    d = results["steps"]["d"]
    assert d["status"] == "ok" and d["first_output_s"] is not None and d["elapsed_s"] > 0
    assert len(d["stages"]) == 2 and all(st["forward"] > 0 for st in d["stages"])
    assert "| 1 | yes |" in (tmp_path / "summary.md").read_text()
