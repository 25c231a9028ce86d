"""Measured timelines (koala_ds/runtime/trace_record.py; the format: /work/notes/trace_format.md).

Fast: the recorder on its own (file names, header, one write per step, a file that parses with
and without its closing `]`, a cut last line ignored), the settings that turn it on (checked
before training) and the Megatron interpreter's action spans. Slow: a 2-rank zb-h1 job on each
engine, 2 steps with the trace on: one file per rank, every action once per step in the rank's
order without overlap, wait_ms within its span, the step enclosing it all, and the losses of
the same run without a trace.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from koala_ds.core.ir import KoalaError, Op, Schedule
from koala_ds.resolve import load_schedule
from koala_ds.runtime.trace_record import TRACE_VERSION, TraceRecorder, check_trace_path, rank_path, read_trace, timed_wait

ROOT = Path(__file__).resolve().parents[1]


def test_rank_path_puts_the_rank_before_the_extension():
    assert rank_path("out/trace.json", 3) == Path("out/trace.rank3.json")
    assert rank_path("trace", 0) == Path("trace.rank0.json")
    assert rank_path("a.b.json", 12) == Path("a.b.rank12.json")


def _record(tmp_path: Path, schedule: Schedule, rank: int, steps: int, close: bool) -> TraceRecorder:
    """`steps` steps of `rank`'s actions through a recorder, each action's input wait a 1 ms sleep."""
    rec = TraceRecorder(str(tmp_path / "trace.json"), "megatron", "--koala-trace", global_rank=5)
    wait = timed_wait(rec, time.sleep)
    for _ in range(steps):
        assert rec.begin_step(schedule, rank, pipeline=2)
        for index, a in enumerate(schedule.ranks[rank]):
            rec.begin(index)
            if a.op is not Op.W:
                wait(0.001)
            rec.end()
        rec.end_step()
    if close:
        rec.close()
    return rec


def test_recorder_writes_the_header_and_one_line_per_event(tmp_path):
    schedule = load_schedule("zb-h1", 2, 4)
    rec = _record(tmp_path, schedule, rank=1, steps=2, close=False)
    assert rec.path == tmp_path / "trace.rank5.json" and [p.name for p in tmp_path.iterdir()] == ["trace.rank5.json"]
    text = rec.path.read_text()
    assert text.startswith("[\n") and text.endswith(",\n")
    events = json.loads(text[:-2] + "\n]")  # as written so far: a list once the last comma is replaced by ]
    assert events == read_trace(rec.path)
    meta = next(e for e in events if e["name"] == "koala_trace")
    assert meta["ph"] == "M" and meta["tid"] == 1
    args = meta["args"]
    assert (args["version"], args["engine"], args["schedule"], args["p"], args["m"], args["v"]) == \
        (TRACE_VERSION, "megatron", "zb-h1", 2, 4, 1)
    assert (args["rank"], args["global_rank"], args["pipeline"]) == (1, 5, 2)
    assert Schedule.from_dict(args["schedule_json"]).same_order(schedule)
    assert abs(args["wall_time_at_ts0"] + time.perf_counter() - time.time()) < 5
    assert next(e for e in events if e["name"] == "process_name")["args"]["name"] == "pipeline zb-h1 (measured)"
    actions = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    order = [str(a) for a in schedule.ranks[1]]
    assert [e["name"] for e in actions] == order * 2
    assert [e["args"]["step"] for e in actions] == [0] * len(order) + [1] * len(order)
    assert [e["args"]["index"] for e in actions] == list(range(len(order))) * 2
    for e in actions:
        a = schedule.ranks[1][e["args"]["index"]]
        assert (e["tid"], e["cat"], e["args"]["op"], e["args"]["stage"], e["args"]["microbatch"]) == \
            (1, {"F": "forward", "I": "backward-input", "W": "backward-weight"}[a.op.value], e["cat"], a.stage,
             a.microbatch)
        assert e["args"]["wait_ms"] * 1e3 <= e["dur"]
        assert (e["args"]["wait_ms"] >= 1.0) == (a.op is not Op.W)  # the timed sleep, in its own action only
    steps = [e for e in events if e["name"] == "step"]
    after = [e for e in events if e["name"] == "after-pipeline"]
    assert [e["args"]["step"] for e in steps] == [0, 1] == [e["args"]["step"] for e in after]
    for n in (0, 1):
        mine = [e for e in actions if e["args"]["step"] == n]
        assert steps[n]["ts"] <= mine[0]["ts"] and after[n]["ts"] == pytest.approx(mine[-1]["ts"] + mine[-1]["dur"])
        assert after[n]["ts"] + after[n]["dur"] == pytest.approx(steps[n]["ts"] + steps[n]["dur"])


def test_a_closed_trace_is_json_and_a_cut_last_line_is_ignored(tmp_path):
    schedule = load_schedule("1f1b", 2, 2)
    rec = _record(tmp_path, schedule, rank=0, steps=1, close=True)
    events = json.loads(rec.path.read_text())  # closed: a JSON list
    assert events[-1] == {"name": "koala_trace_end", "ph": "M", "pid": 0, "tid": 0, "args": {"steps": 1}}
    assert not rec.begin_step(schedule, 0)  # closed: records nothing more
    text = rec.path.read_text().splitlines(keepends=True)
    assert text[-1] == "]\n" and text[-3].startswith('{"name": "after-pipeline"')
    rec.path.write_text("".join(text[:-3]) + text[-3][:25])  # killed mid-write: the last line cut
    assert read_trace(rec.path) == events[:-2]  # up to the step event before it


def test_sync_runs_before_each_action_end_is_read(tmp_path):
    """On a GPU (`sync` given) an action ends when the device's work has run: the clock is read
    after sync returns, and the step's queued work is waited for before its first action."""
    schedule = load_schedule("1f1b", 2, 2)
    calls = []
    rec = TraceRecorder(str(tmp_path / "t.json"), "deepspeed", "-", sync=lambda: (calls.append(1), time.sleep(0.002)))
    rec.begin_step(schedule, 0)
    assert len(calls) == 1
    for index in range(len(schedule.ranks[0])):
        rec.begin(index)
        rec.end()
    rec.end_step()
    assert len(calls) == 1 + len(schedule.ranks[0])
    assert all(e["dur"] >= 2000 for e in read_trace(rec.path) if e.get("cat") in ("forward", "backward"))


def test_schedules_taking_turns_write_a_file_each_numbered_over_all_steps(tmp_path):
    """One recorder, steps of two schedules in turns of two (the examples' --alternate-schedules
    with a trace): the first schedule writes FILE's file, the other FILE.<name>'s; the steps are
    numbered over both, and the last step of a turn gets a next-pipeline event in its own file at
    the next turn's first compute (its input wait over) on this rank."""
    one, other = load_schedule("1f1b", 2, 2), load_schedule("zb-h1", 2, 4)
    rec = TraceRecorder(str(tmp_path / "trace.json"), "megatron", "--koala-trace", global_rank=1)
    wait = timed_wait(rec, time.sleep)
    firsts = {}
    for n, schedule in enumerate([one, one, other, other, one]):
        assert rec.begin_step(schedule if n else one, 0)
        for index in range(len(schedule.ranks[0])):
            rec.begin(index)
            if index == 0:
                wait(0.002)
                firsts[n] = (rec._t0 + rec.wait_ns) / 1e3
            rec.end()
        rec.end_step()
    rec.close()
    assert rec.paths == [tmp_path / "trace.rank1.json", tmp_path / "trace.zb-h1.rank1.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.rank1.json", "trace.zb-h1.rank1.json"]
    mine, theirs = (json.loads(p.read_text()) for p in rec.paths)
    assert [e["args"]["step"] for e in mine if e["name"] == "step"] == [0, 1, 4]
    assert [e["args"]["step"] for e in theirs if e["name"] == "step"] == [2, 3]
    assert next(e for e in theirs if e["name"] == "koala_trace")["args"]["schedule"] == "zb-h1"
    marks = [(f, e) for f in (mine, theirs) for e in f if e["name"] == "next-pipeline"]
    assert [(f is mine, e["args"]["step"]) for f, e in marks] == [(True, 1), (False, 3)]
    assert [e["ts"] for _, e in marks] == [pytest.approx(firsts[2]), pytest.approx(firsts[4])]
    assert mine[-1]["args"] == {"steps": 3} and theirs[-1]["args"] == {"steps": 2}


def test_unwritable_trace_file_is_one_line_naming_the_setting(tmp_path):
    check_trace_path(tmp_path / "trace.json", "--koala-trace")
    with pytest.raises(KoalaError, match=r"^--koala-trace .*/nope/trace.json: directory .*nope does not exist$"):
        check_trace_path(tmp_path / "nope" / "trace.json", "--koala-trace")
    (tmp_path / "dir.rank0.json").mkdir()
    with pytest.raises(KoalaError, match="is a directory"):
        check_trace_path(tmp_path / "dir.json", "--koala-trace")


def test_megatron_flag_is_checked_at_install_and_off_by_default(tmp_path):
    pytest.importorskip("torch")
    from koala_ds.megatron import MegatronScheduleError, add_arguments, schedule_from_args
    from koala_ds.megatron.runtime import KoalaForwardBackward

    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-schedule", "koala", "--koala-schedule", "zb-h1"])
    assert args.koala_trace is None and KoalaForwardBackward("zb-h1").recorder is None
    bad = str(tmp_path / "nope" / "t.json")
    args.koala_trace = bad
    with pytest.raises(MegatronScheduleError, match=f"^--koala-trace {bad}: directory .* does not exist$"):
        schedule_from_args(args)
    with pytest.raises(MegatronScheduleError, match=r"^--koala-trace is set but --pipeline-schedule is not 'koala'$"):
        schedule_from_args(parser.parse_args(["--koala-trace", str(tmp_path / "t.json")]))
    with pytest.raises(MegatronScheduleError, match=r"^get_forward_backward_func\(trace=\.\.\.\) .* does not exist"):
        KoalaForwardBackward("zb-h1", trace=bad)
    assert KoalaForwardBackward("zb-h1", trace=str(tmp_path / "t.json")).recorder is not None
    assert list(tmp_path.iterdir()) == []  # opened at the first step, not before


def test_deepspeed_config_key_and_environment_variable(tmp_path):
    pytest.importorskip("deepspeed")
    from koala_ds.deepspeed import KoalaConfigError, KoalaPipelineConfig

    read = KoalaPipelineConfig.from_pipeline_section
    assert read({"koala": {"schedule": "zb-h1"}}, env={}).trace is None
    good = str(tmp_path / "t.json")
    assert read({"koala": {"trace": good}}, env={}).trace == good
    env_cfg = read({"koala": {}}, env={"KOALA_TRACE": good})
    assert (env_cfg.trace, env_cfg.trace_source) == (good, "KOALA_TRACE")
    bad = str(tmp_path / "nope" / "t.json")
    with pytest.raises(KoalaConfigError, match=r'^DeepSpeed config "pipeline.koala.trace" .* does not exist$'):
        read({"koala": {"trace": bad}}, env={})
    with pytest.raises(KoalaConfigError, match=r"^KOALA_TRACE .* does not exist$"):
        read({}, env={"KOALA_TRACE": bad})
    with pytest.raises(KoalaConfigError, match=r'"pipeline.koala.trace" is 3: give a file name'):
        read({"koala": {"trace": 3}}, env={})


def test_a_recorded_deepspeed_step_runs_at_the_stack_depth_of_an_unrecorded_one(tmp_path, monkeypatch):
    """The Koala engine's train_batch calls DeepSpeed's from the same frame with and without a
    trace: a deeper stack costs every forward of a PipelineModule(seed_layers=True) more (torch
    formats the stack per deferred device seed, ~10 us a frame), so a trace one frame deeper made
    the DeepSpeed example's traced steps slower than the untraced ones it stood for."""
    pytest.importorskip("deepspeed")
    import contextlib
    import types

    from deepspeed.runtime.pipe.engine import PipelineEngine

    from koala_ds.deepspeed.engine import KoalaPipelineEngine

    depths: list[int] = []

    def stock_train_batch(self, data_iter=None):  # DeepSpeed's, which runs the step: how deep it is called
        frame, n = sys._getframe(), 0
        while frame is not None:
            frame, n = frame.f_back, n + 1
        depths.append(n)
        return 0.5

    monkeypatch.setattr(PipelineEngine, "train_batch", stock_train_batch)
    engine = object.__new__(KoalaPipelineEngine)  # the attributes train_batch reads, not a whole engine
    recorder = TraceRecorder(str(tmp_path / "t.json"), "deepspeed", "-")
    for name, value in {"_koala_recorder": None, "_koala_step_recorder": None, "stage_id": 0,
                        "_koala_schedule": load_schedule("zb-h1", 2, 4),
                        "grid": types.SimpleNamespace(data_parallel_id=0),
                        "_bounded_collectives": contextlib.nullcontext}.items():
        object.__setattr__(engine, name, value)
    assert engine.train_batch() == 0.5
    object.__setattr__(engine, "_koala_recorder", recorder)
    assert engine.train_batch() == 0.5
    recorder.close()
    assert depths[0] == depths[1]
    assert [e["name"] for e in read_trace(rank_path(tmp_path / "t.json", 0)) if e.get("ph") == "X"] == \
        ["step", "after-pipeline"]  # the step was recorded


@pytest.mark.parametrize("name,p,v", [("zb-h1", 2, 1), ("1f1b", 4, 1), ("zb-v", 2, 2), ("interleaved-1f1b", 2, 2)])
@pytest.mark.parametrize("lookahead", [2, None])
def test_megatron_spans_cover_each_action_once_with_its_send(name, p, v, lookahead):
    """Each compute action's span in the interpreter's program: in the rank's order, disjoint,
    holding that action's compute and the SEND right after it, and the receives posted before it
    (lookahead None, gloo's: every receive in the first action's span)."""
    pytest.importorskip("torch")
    from koala_ds.megatron.runtime import KoalaForwardBackward, _StepRunner, _traced

    R = _StepRunner
    compute = {R._forward, R._backward_full, R._backward_input, R._backward_weight}
    schedule = load_schedule(name, p, 2 * p, v)
    for rank in range(p):
        prep = KoalaForwardBackward(schedule)._prepare(schedule, rank, False, lookahead)
        program, spans = prep.program, prep.spans
        posts = [k for k, (fn, _) in enumerate(program) if fn is R._post]
        assert posts and (lookahead is not None or max(posts) < spans[0][1])
        assert len(spans) == len(schedule.ranks[rank])
        assert all(a < b <= c for (a, b), (c, _) in zip(spans, spans[1:] + ((len(program), 0),)))
        for (first, end), action in zip(spans, schedule.ranks[rank]):
            inside = [fn for fn, _ in program[first:end]]
            assert [fn for fn in inside if fn in compute] == [
                {Op.F: R._forward, Op.B: R._backward_full, Op.I: R._backward_input, Op.W: R._backward_weight}[action.op]]
            assert inside.count(R._send) <= 1 and (R._send not in inside or inside[-1] is R._send)
        outside = [fn for k, (fn, _) in enumerate(program) if not any(a <= k < b for a, b in spans)]
        assert set(outside) <= {R._sync_after}  # every receive is posted inside an action's span
        traced = _traced(program, spans)
        marks = [fn for fn, _ in traced if fn in (R._trace_begin, R._trace_end)]
        assert marks == [R._trace_begin, R._trace_end] * len(spans)
        assert [args[0] for fn, args in traced if fn is R._trace_begin] == list(range(len(spans)))
        assert [e for e in traced if e[0] not in (R._trace_begin, R._trace_end)] == list(program)


# -- slow: the engines ----------------------------------------------------------------------
def check_trace(path: str, world: int, steps: int, engine: str) -> Schedule:
    """The per-rank files of a `world`-process, one-pipeline run of `steps` training steps: the
    properties the format promises; the schedule they ran."""
    files = sorted(p.name for p in Path(path).parent.iterdir() if p.name.startswith(Path(path).stem + ".rank"))
    assert files == [rank_path(path, g).name for g in range(world)]
    schedule = None
    for g in range(world):
        events = read_trace(rank_path(path, g))
        meta = next(e for e in events if e["name"] == "koala_trace")["args"]
        assert (meta["engine"], meta["global_rank"], meta["pipeline"]) == (engine, g, 0)
        schedule = Schedule.from_dict(meta["schedule_json"])
        assert events[-1]["name"] == "koala_trace_end" and events[-1]["args"]["steps"] == steps  # closed
        r = meta["rank"]
        order = [str(a) for a in schedule.ranks[r]]
        for n in range(steps):
            mine = [e for e in events if e["ph"] == "X" and e["args"]["step"] == n]
            acts = [e for e in mine if e["cat"] != "step"]
            assert all(e["tid"] == r for e in mine)
            assert [e["name"] for e in sorted(acts, key=lambda e: e["ts"])] == order  # each once, in order
            assert [e["args"]["index"] for e in acts] == list(range(len(order)))
            for e, nxt in zip(acts, acts[1:]):
                assert e["ts"] + e["dur"] <= nxt["ts"] + 1e-3, (e, nxt)  # no overlap
            assert all(0 <= e["args"]["wait_ms"] * 1e3 <= e["dur"] + 1e-3 for e in acts)
            (step,), (after,) = ([e for e in mine if e["name"] == k] for k in ("step", "after-pipeline"))
            assert step["ts"] <= acts[0]["ts"] and acts[-1]["ts"] + acts[-1]["dur"] <= after["ts"] + 1e-3
            assert after["ts"] + after["dur"] == pytest.approx(step["ts"] + step["dur"], abs=1e-3)
        steps_seen = [e["args"]["step"] for e in events if e["name"] == "step"]
        assert steps_seen == list(range(steps)), steps_seen  # eval_batch / forward-only calls: not recorded
    return schedule


def _megatron_run(tmp_path: Path, extra: list[str]) -> list[float]:
    log = tmp_path / f"loss{len(extra)}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "examples/megatron_gpt/pretrain_gpt.py"), "--pipeline-model-parallel-size", "2",
           "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--lr", "3e-3",
           "--pipeline-schedule", "koala", "--koala-schedule", "zb-h1", "--loss-log", str(log), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(log.read_text())["losses"]


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(600)
def test_megatron_example_writes_a_trace_per_rank(tmp_path):
    pytest.importorskip("megatron.core")
    trace = tmp_path / "traces" / "trace.json"
    trace.parent.mkdir()
    traced = _megatron_run(tmp_path, ["--koala-trace", str(trace)])
    schedule = check_trace(str(trace), world=2, steps=2, engine="megatron")
    assert schedule.name == "zb-h1" and schedule.m == 4 and schedule.backward == "split"
    assert traced == _megatron_run(tmp_path, [])  # the same losses without a trace
    assert len(list(trace.parent.iterdir())) == 2


@pytest.mark.slow  # multi-process
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_deepspeed_engine_writes_a_trace_per_rank(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed_jobs import launch, train_worker

    trace = str(tmp_path / "trace.json")
    cases = [{"label": "traced", "schedule": "zb-h1", "koala": {"trace": trace}},
             {"label": "plain", "schedule": "zb-h1"}]
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "blocks": 4, "steps": 2, "cases": cases, "params": False,
            "target_scale": 10.0}
    results = launch(train_worker, 2, spec, timeout_s=300)
    schedule = check_trace(trace, world=2, steps=2, engine="deepspeed")
    assert schedule.name == "zb-h1" and schedule.m == 4 and schedule.backward == "split"
    for res in results:
        got = res["value"]["cases"]
        assert got["traced"]["losses"] == got["plain"]["losses"]
        assert got["traced"]["engine"] == "KoalaPipelineEngine"
