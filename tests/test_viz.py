"""Gantt charts and Chrome traces of simulated timelines, and `koala show --gantt/--trace`."""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.cli import main
from koala_ds.core.ir import KoalaError
from koala_ds.sim import load_profile, simulate
from koala_ds.viz import chrome_trace, write_chrome_trace, write_gantt


@pytest.fixture(scope="module")
def zbv():
    schedule = load_schedule("zb-v", 4, 8, 2)
    return schedule, simulate(schedule, load_profile("gpt-chunks-8"))


def test_chrome_trace_has_one_event_per_action_in_microseconds(zbv, tmp_path):
    schedule, result = zbv
    path = write_chrome_trace(result, tmp_path / "t.json", schedule)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == schedule.num_actions
    by_name = {(e["tid"], e["name"]): e for e in events}
    for t in result.timeline:
        e = by_name[(t.rank, str(t.action))]
        assert e["ts"] == pytest.approx(t.start * 1000) and e["dur"] == pytest.approx((t.end - t.start) * 1000)
        assert e["args"]["chunk"] == schedule.placement.chunk_of(t.action.stage)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert trace["otherData"]["makespan_ms"] == result.makespan


def test_trace_needs_a_timeline(zbv):
    schedule, _ = zbv
    with pytest.raises(KoalaError, match="timeline=True"):
        chrome_trace(simulate(schedule, load_profile("gpt-chunks-8"), timeline=False))


def test_gantt_png_is_an_image_of_sensible_size(zbv, tmp_path):
    schedule, result = zbv
    path = write_gantt(result, tmp_path / "g.png", schedule)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 200  # time runs along the wide axis, one row per rank


def test_gantt_svg_shows_title_ranks_and_microbatches(zbv, tmp_path):
    schedule, result = zbv
    path = write_gantt(result, tmp_path / "g.svg", schedule)
    ET.parse(path)  # well-formed XML
    text = path.read_text()
    # matplotlib writes text as glyph paths, with the string kept in a comment
    comments = re.findall(r"<!-- (.*?) -->", text)
    title = next(c for c in comments if "makespan" in c)
    assert f"makespan {result.makespan:.4g} ms" in title and f"bubble {result.bubble_ratio:.1%}" in title
    for r in range(4):
        assert f"rank {r}" in comments
    labels = [c for c in comments if c in {str(mb) for mb in range(8)}]  # microbatch numbers (and an axis tick)
    assert len(labels) > schedule.num_actions // 2
    for legend in ("F forward", "I backward (input)", "W backward (weight)", "idle"):
        assert legend in comments


def test_gantt_rejects_unknown_formats(zbv, tmp_path):
    schedule, result = zbv
    with pytest.raises(KoalaError, match=r"unknown image format '\.gif'"):
        write_gantt(result, tmp_path / "g.gif", schedule)


def test_show_with_profile_gantt_and_trace(tmp_path, capsys):
    gantt, trace = tmp_path / "show.svg", tmp_path / "show.json"
    assert main(["show", "1f1b", "-p", "4", "-m", "8", "--profile", "uniform-4", "--gantt", str(gantt),
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    expected = simulate(load_schedule("1f1b", 4, 8), load_profile("uniform-4"))
    assert f"makespan {expected.makespan:.4g} ms" in out
    assert gantt.exists() and json.loads(trace.read_text())["otherData"]["makespan_ms"] == expected.makespan


def test_show_without_profile_uses_unit_costs(tmp_path, capsys):
    gantt = tmp_path / "unit.png"
    assert main(["show", "gpipe", "-p", "3", "-m", "4", "--gantt", str(gantt)]) == 0
    assert "makespan 18 ms" in capsys.readouterr().out  # (m + p - 1) * (F + B) with F = 1, B = 2
    assert gantt.read_bytes()[:4] == b"\x89PNG"


def test_model_layer_does_not_import_torch_or_pyplot():
    import subprocess

    code = ("import sys, koala_ds.sim, koala_ds.viz, koala_ds.commands.model; "
            "bad = [m for m in ('torch', 'matplotlib', 'matplotlib.pyplot') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
