"""Measured timelines of the engines' runtimes: a Chrome trace per process, written step by step.

Both runtimes (koala_ds/megatron/runtime.py, koala_ds/deepspeed/engine.py) record, per compute
action of a training step, when the runtime started working on it (the receives it posts
before it and the wait for its input included), when its compute and the posting of its send
ended, and how long of that it waited for its input message. The file is what `koala
calibrate` reads (version 1):

- global rank g writes `FILE.rank{g}.json` (`trace.json` -> `trace.rank0.json`; `trace` ->
  `trace.rank0.json`): `[`, then one event per line (`<json>,`), appended and flushed once per
  step, so a killed rank leaves every completed step readable (a reader ignores a cut last
  line: `read_trace`); a clean close writes a `koala_trace_end` event and `]`;
- header: `process_name`, `thread_name` / `thread_sort_index` of the row, and `koala_trace`
  (metadata; args: version, engine, schedule, p, m, v, rank (pipeline rank), global_rank,
  pipeline (data-parallel replica), schedule_json (Schedule.to_dict()), wall_time_at_ts0);
- per action a complete event (`ph` "X") named as the action (`1I3`), `cat` and `cname` as
  `koala show --trace` (koala_ds/viz/trace.py), `tid` the pipeline rank, `ts` / `dur` in
  microseconds of `time.perf_counter` (one clock for the processes of a machine), args stage,
  microbatch, op, chunk, index (position in the rank's order), step, wait_ms;
- per step a `step` event (the runtime's whole step) and an `after-pipeline` one (from the end
  of the last action to the end of the step), args {"step": n}, steps numbered from 0.

The recorder is plain Python. Its per-action work is `begin(index)` / `end()` (a clock read
and a tuple each) and the timed input wait; the JSON lines are made at `end_step`. Runtimes
bind it once: when tracing is off there is no recorder and no per-action check at all. On a
GPU the runtimes give it `sync` (torch.cuda.synchronize): each action's end then waits for its
kernels, so the spans are the device's, at the cost of the host no longer queueing the next
action's kernels while the device runs the last one's.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from ..core.ir import KoalaError, Schedule
from ..core.outputs import check_output
from ..viz.trace import OP_COLOURS, OP_NAMES

log = logging.getLogger(__name__)

#: `args.version` of the `koala_trace` header event.
TRACE_VERSION = 1
_perf_ns = time.perf_counter_ns


class TraceOpenError(KoalaError):
    """The trace file of this rank could not be opened or written. What one rank saw
    (`rank_local`): that rank prints it (koala_ds.core.errors)."""

    rank_local = True


def rank_path(file: str | os.PathLike, global_rank: int) -> Path:
    """The file global rank `global_rank` writes for the user's FILE: `trace.json` ->
    `trace.rank3.json`, `trace` -> `trace.rank3.json`."""
    path = Path(file)
    if path.suffix:
        return path.with_name(f"{path.stem}.rank{global_rank}{path.suffix}")
    return path.with_name(f"{path.name}.rank{global_rank}.json")


def check_trace_path(file: str | os.PathLike, setting: str) -> None:
    """Before training: a KoalaError (koala_ds.core.outputs.OutputError) naming `setting` (the flag or
    config key) when the per-rank files of FILE cannot be written (no such folder, not writable,
    FILE a folder)."""
    check_output(file, setting)
    check_output(rank_path(file, 0), setting)


def timed_wait(recorder: "TraceRecorder", wait: Callable) -> Callable:
    """`wait` (a function that blocks for an action's input), its time added to the recorder's
    current action (`wait_ms`)."""
    def call(*args):
        t0 = _perf_ns()
        try:
            return wait(*args)
        finally:
            recorder.wait_ns += _perf_ns() - t0

    return call


def _event_template(schedule: Schedule, rank: int, index: int) -> str:
    """The JSON line of action `index` of `rank`, with %-slots for ts, dur, step and wait_ms."""
    a = schedule.ranks[rank][index]
    op = OP_NAMES[a.op]
    head = json.dumps({"name": str(a), "cat": op, "ph": "X", "pid": 0, "tid": rank})[:-1]
    args = json.dumps({"stage": a.stage, "microbatch": a.microbatch, "op": op,
                       "chunk": schedule.placement.chunk_of(a.stage), "index": index})[:-1]
    return (head.replace("%", "%%") + ', "ts": %.3f, "dur": %.3f, "cname": ' + json.dumps(OP_COLOURS[a.op])
            + ', "args": ' + args + ', "step": %d, "wait_ms": %.4f}},\n')


def _line(event: dict) -> str:
    return json.dumps(event) + ",\n"


@dataclass(eq=False)
class TraceRecorder:
    """The measured trace of one process (see the module docstring). `file`: the user's FILE;
    `setting`: how messages name it (a flag or config key); `engine`: "megatron", "deepspeed"."""

    file: str
    engine: str
    setting: str
    global_rank: int = 0
    #: Waits for the device's queued work (torch.cuda.synchronize on CUDA), called at each
    #: action's end and at a step's start, so that the host's clock reads the device's progress
    #: (else an action would end when its kernels were queued); None on the CPU.
    sync: Callable[[], None] | None = None
    wait_ns: int = 0  # input wait of the current action (timed_wait adds to it)
    schedule: Schedule | None = field(default=None, init=False)
    rank: int = field(default=0, init=False)  # pipeline rank
    steps: int = field(default=0, init=False)  # steps written
    _fh: IO[str] | None = field(default=None, init=False, repr=False)
    _templates: tuple = field(default=(), init=False, repr=False)
    _spans: list = field(default_factory=list, init=False, repr=False)
    _index: int = field(default=-1, init=False, repr=False)
    _t0: int = field(default=0, init=False, repr=False)
    _step_t0: int = field(default=0, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    @property
    def path(self) -> Path:
        return rank_path(self.file, self.global_rank)

    # -- steps ---------------------------------------------------------------------------
    def begin_step(self, schedule: Schedule, rank: int, pipeline: int = 0, start_ns: int | None = None) -> bool:
        """Start recording a step of `schedule` on pipeline rank `rank` (of data-parallel
        replica `pipeline`) that began at `start_ns` (perf_counter_ns; default now). The first
        step opens the file and writes the header; a later step of another schedule is not
        recorded (False; said once)."""
        if self._fh is None:
            if self._closed:
                return False
            self._open(schedule, rank, pipeline)
        elif schedule is not self.schedule and not schedule.same_order(self.schedule):
            if not self._warned:
                log.warning("koala trace %s: a step of schedule %r (m=%d) differs from the traced %r (m=%d): "
                            "not recorded", self.path, schedule.name, schedule.m, self.schedule.name,
                            self.schedule.m)
                self._warned = True
            return False
        self._spans.clear()
        self._index = -1
        self._step_t0 = _perf_ns() if start_ns is None else start_ns
        if self.sync is not None:  # the work queued before the step: not in its first action
            self.sync()
        return True

    def begin(self, index: int) -> None:
        """The runtime starts on action `index` of the rank's order."""
        self._index = index
        self.wait_ns = 0
        self._t0 = _perf_ns()

    def end(self) -> None:
        """The action begun last ended (its compute done, its send posted)."""
        if self.sync is not None:
            self.sync()
        self._spans.append((self._index, self._t0, _perf_ns(), self.wait_ns))

    def end_step(self) -> None:
        """The step ended: append its events (actions, "step", "after-pipeline") and flush."""
        t_end = _perf_ns()
        if self._fh is None:
            return
        n, r, templates = self.steps, self.rank, self._templates
        lines = [templates[i] % (t0 / 1e3, (t1 - t0) / 1e3, n, w / 1e6) for i, t0, t1, w in self._spans]
        last = self._spans[-1][2] if self._spans else self._step_t0
        for name, t0 in (("step", self._step_t0), ("after-pipeline", last)):
            lines.append(_line({"name": name, "cat": "step", "ph": "X", "pid": 0, "tid": r, "ts": t0 / 1e3,
                                "dur": (t_end - t0) / 1e3, "args": {"step": n}}))
        self._spans.clear()
        self._write("".join(lines))
        self.steps += 1

    def close(self) -> None:
        """End the list (a metadata event with the number of steps, then `]`); idempotent.
        Also run at interpreter exit."""
        if self._fh is None:
            self._closed = True
            return
        fh, self._fh, self._closed = self._fh, None, True
        atexit.unregister(self.close)
        try:
            fh.write(json.dumps({"name": "koala_trace_end", "ph": "M", "pid": 0, "tid": self.rank,
                                 "args": {"steps": self.steps}}) + "\n]\n")
            fh.close()
        except OSError as exc:
            log.warning("koala trace %s: could not close it: %s", self.path, exc)

    # -- file ----------------------------------------------------------------------------
    def _open(self, schedule: Schedule, rank: int, pipeline: int) -> None:
        self.schedule, self.rank = schedule, rank
        self._templates = tuple(_event_template(schedule, rank, i) for i in range(len(schedule.ranks[rank])))
        try:
            self._fh = open(self.path, "w", encoding="utf-8")
        except OSError as exc:
            raise TraceOpenError(f"{self.setting} {self.file}: cannot write {self.path}: {exc.strerror or exc}") \
                from None
        atexit.register(self.close)
        self._write("[\n" + "".join(_line(e) for e in self._header(schedule, rank, pipeline)))
        log.info("koala trace: rank %d writes %s", self.global_rank, self.path)

    def _header(self, schedule: Schedule, rank: int, pipeline: int) -> list[dict]:
        meta = {"version": TRACE_VERSION, "engine": self.engine, "schedule": schedule.name, "p": schedule.p,
                "m": schedule.m, "v": schedule.v, "rank": rank, "global_rank": self.global_rank,
                "pipeline": pipeline, "schedule_json": schedule.to_dict(),
                "wall_time_at_ts0": time.time() - time.perf_counter()}
        return [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipeline {schedule.name} (measured)"}},
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
                {"name": "koala_trace", "ph": "M", "pid": 0, "tid": rank, "args": meta}]

    def _write(self, text: str) -> None:
        try:
            self._fh.write(text)
            self._fh.flush()
        except OSError as exc:
            raise TraceOpenError(f"{self.setting} {self.file}: writing {self.path} failed: {exc.strerror or exc}") \
                from None


def read_trace(path: str | os.PathLike) -> list[dict]:
    """The events of a measured trace file: every complete line (a cut last line, as a killed
    rank leaves, is ignored), with or without the closing `]`."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            text = line.strip()
            if not line.endswith("\n") or text in ("[", "]", ""):
                continue
            try:
                events.append(json.loads(text[:-1] if text.endswith(",") else text))
            except json.JSONDecodeError:
                continue
    return events
