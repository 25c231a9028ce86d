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
  of the last action to the end of the step), args {"step": n}, steps numbered from 0;
- schedules taking turns in one process share a recorder: the first traced writes FILE's
  files, each other one FILE.<its name>'s (`trace.zb-h1.rank0.json`); steps are numbered over
  all of them (a gap in a file is another schedule's turn), and a step followed by another
  schedule's gets a `next-pipeline` instant event (`ph` "i", args.step) in its own file at the
  successor's first compute on this rank, where its period ends.

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
import re
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


def schedule_file(file: str | os.PathLike, name: str, taken: set) -> str:
    """The FILE of another schedule traced by the same recorder: `trace.json` + "zb-h1" ->
    `trace.zb-h1.json` (the name made safe for a file name; `-2`, `-3`... where it is `taken`)."""
    path = Path(file)
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "-", name).strip(".-") or "schedule"
    stem, suffix = (path.stem, path.suffix) if path.suffix else (path.name, "")
    out, k = str(path.with_name(f"{stem}.{safe}{suffix}")), 1
    while out in taken:
        k += 1
        out = str(path.with_name(f"{stem}.{safe}-{k}{suffix}"))
    return out


@dataclass(eq=False)
class _ScheduleFile:
    """The trace file of one schedule: its user-level FILE, its open file and action templates."""

    file: str
    path: Path
    schedule: Schedule
    rank: int
    fh: IO[str] | None
    templates: tuple
    steps: int = 0  # steps written


@dataclass(eq=False)
class TraceRecorder:
    """The measured trace of one process (see the module docstring). `file`: the user's FILE;
    `setting`: how messages name it (a flag or config key); `engine`: "megatron", "deepspeed".

    Schedules taking turns in one process (the examples' --alternate-schedules) share one
    recorder: the first schedule traced writes FILE, each other one FILE.<its name> (`trace.json`
    -> `trace.zb-h1.rank0.json`), every one a run `koala calibrate` reads. Steps are numbered in
    the recorder's order, whichever schedule ran them, so a gap in one file's numbers is where
    another schedule ran (koala calibrate leaves out a step that follows another schedule's);
    and when a step's successor ran another schedule, its file gets a `next-pipeline` instant
    event (args.step: the step) at the successor's first compute, its input wait over, on this
    rank: where the step's period ends."""

    file: str
    engine: str
    setting: str
    global_rank: int = 0
    #: Waits for the device's queued work (torch.cuda.synchronize on CUDA), called at each
    #: action's end and at a step's start, so that the host's clock reads the device's progress
    #: (else an action would end when its kernels were queued); None on the CPU.
    sync: Callable[[], None] | None = None
    wait_ns: int = 0  # input wait of the current action (timed_wait adds to it)
    schedule: Schedule | None = field(default=None, init=False)  # the schedule of the step recorded last
    rank: int = field(default=0, init=False)  # pipeline rank
    steps: int = field(default=0, init=False)  # steps written, every schedule's
    _files: list = field(default_factory=list, init=False, repr=False)  # _ScheduleFile, first traced first
    _current: _ScheduleFile | None = field(default=None, init=False, repr=False)
    _previous: _ScheduleFile | None = field(default=None, init=False, repr=False)  # the last step's file
    _spans: list = field(default_factory=list, init=False, repr=False)
    _index: int = field(default=-1, init=False, repr=False)
    _t0: int = field(default=0, init=False, repr=False)
    _step_t0: int = field(default=0, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def path(self) -> Path:
        """The file of the first schedule traced (of FILE itself before any step)."""
        return self._files[0].path if self._files else rank_path(self.file, self.global_rank)

    @property
    def paths(self) -> list[Path]:
        """Every file written, one per schedule traced, the first traced first."""
        return [f.path for f in self._files]

    # -- steps ---------------------------------------------------------------------------
    def begin_step(self, schedule: Schedule, rank: int, pipeline: int = 0, start_ns: int | None = None) -> bool:
        """Start recording a step of `schedule` on pipeline rank `rank` (of data-parallel
        replica `pipeline`) that began at `start_ns` (perf_counter_ns; default now). The first
        step of a schedule opens its file and writes the header (False once closed)."""
        if self._closed:
            return False
        found = next((f for f in self._files if f.schedule is schedule or f.schedule.same_order(schedule)), None)
        self._current = found or self._open(schedule, rank, pipeline)
        self.schedule, self.rank = schedule, rank
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
        """The step ended: append its events (actions, "step", "after-pipeline") and flush; where
        the step before it was another schedule's, that file's `next-pipeline` event."""
        t_end = _perf_ns()
        f = self._current
        if f is None or f.fh is None:
            return
        n, r, templates = self.steps, self.rank, f.templates
        lines = [templates[i] % (t0 / 1e3, (t1 - t0) / 1e3, n, w / 1e6) for i, t0, t1, w in self._spans]
        last = self._spans[-1][2] if self._spans else self._step_t0
        for name, t0 in (("step", self._step_t0), ("after-pipeline", last)):
            lines.append(_line({"name": name, "cat": "step", "ph": "X", "pid": 0, "tid": r, "ts": t0 / 1e3,
                                "dur": (t_end - t0) / 1e3, "args": {"step": n}}))
        first = next((s for s in self._spans if s[0] == 0), None)
        before = self._previous
        self._spans.clear()
        self._write(f, "".join(lines))
        if before is not None and before is not f and before.fh is not None and first is not None:
            _, t0, _, w = first
            self._write(before, _line({"name": "next-pipeline", "cat": "step", "ph": "i", "s": "t", "pid": 0,
                                       "tid": before.rank, "ts": (t0 + w) / 1e3, "args": {"step": n - 1}}))
        f.steps += 1
        self.steps += 1
        self._previous, self._current = f, None

    def close(self) -> None:
        """End each file's list (a metadata event with its number of steps, then `]`); idempotent.
        Also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for f in self._files:
            fh, f.fh = f.fh, None
            if fh is None:
                continue
            try:
                fh.write(json.dumps({"name": "koala_trace_end", "ph": "M", "pid": 0, "tid": f.rank,
                                     "args": {"steps": f.steps}}) + "\n]\n")
                fh.close()
            except OSError as exc:
                log.warning("koala trace %s: could not close it: %s", f.path, exc)

    # -- files ---------------------------------------------------------------------------
    def _open(self, schedule: Schedule, rank: int, pipeline: int) -> _ScheduleFile:
        user_file = self.file if not self._files else schedule_file(self.file, schedule.name,
                                                                   {f.file for f in self._files})
        path = rank_path(user_file, self.global_rank)
        try:
            fh = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise TraceOpenError(f"{self.setting} {self.file}: cannot write {path}: {exc.strerror or exc}") \
                from None
        if not self._files:
            atexit.register(self.close)
        templates = tuple(_event_template(schedule, rank, i) for i in range(len(schedule.ranks[rank])))
        f = _ScheduleFile(user_file, path, schedule, rank, fh, templates)
        self._files.append(f)
        self._write(f, "[\n" + "".join(_line(e) for e in self._header(schedule, rank, pipeline)))
        log.info("koala trace: rank %d writes %s (schedule %s)", self.global_rank, path, schedule.name)
        return f

    def _header(self, schedule: Schedule, rank: int, pipeline: int) -> list[dict]:
        meta = {"version": TRACE_VERSION, "engine": self.engine, "schedule": schedule.name, "p": schedule.p,
                "m": schedule.m, "v": schedule.v, "rank": rank, "global_rank": self.global_rank,
                "pipeline": pipeline, "schedule_json": schedule.to_dict(),
                "wall_time_at_ts0": time.time() - time.perf_counter()}
        return [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipeline {schedule.name} (measured)"}},
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
                {"name": "koala_trace", "ph": "M", "pid": 0, "tid": rank, "args": meta}]

    def _write(self, f: _ScheduleFile, text: str) -> None:
        try:
            f.fh.write(text)
            f.fh.flush()
        except OSError as exc:
            raise TraceOpenError(f"{self.setting} {self.file}: writing {f.path} failed: {exc.strerror or exc}") \
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
