"""Measured traces read back: what a training run's runtimes recorded, per action and per step.

The runtimes write one Chrome trace per process while they train (the format is in
docs/profiling.md, "Calibrating from a measured run"): global rank g of the user's FILE writes
`FILE.rank{g}.json` (`trace.json` -> `trace.rank3.json`), a JSON list of events, one per line,
appended once per step, so that a killed rank leaves every step it finished readable. This
module reads them for `koala calibrate` (koala_ds.sim.calibrate), tolerantly:

- a TRACE argument is a FILE whose `FILE.rank*.json` siblings are the files, else a file; the
  files of one FILE are one *run*, which must be one schedule;
- every complete line is read; a cut last line (a rank killed while writing), the list's
  brackets and a line that is not JSON are skipped; a file in Chrome's object form
  (`{"traceEvents": [...]}`) is read too;
- the files of a run are grouped by pipeline (the data-parallel replica, the header's
  `pipeline`); a step of a pipeline is *complete* when every one of its p ranks' files has the
  step's "step" event and all of that rank's actions; the first `skip_steps` steps (default 1:
  step 0 is the warm-up) are left out;
- schedules that took turns in one run (the examples' --alternate-schedules with a trace) are
  one run each (FILE, FILE.<name>): a step whose predecessor is not in its files ran after
  another schedule's and is left out (what that one left in flight is not its own cost), and so
  is each of the first `settle_steps` of a turn (default 1; 2 leaves out a turn's second step
  too, which on model copies of their own still ran slow); a step whose successor ran another
  schedule ends its period at that one's `next-pipeline` event.

Times are read in microseconds (the Chrome trace's unit) and kept in milliseconds (the
profile's). Every error is a `TraceError`: one line naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..core.ir import KoalaError, Schedule, ScheduleError

log = logging.getLogger(__name__)

#: The `koala_trace` header's `args.version` this reader reads.
TRACE_VERSION = 1
#: The header fields a measured trace must have.
HEADER_FIELDS = ("version", "schedule_json", "p", "m", "v", "rank")


class TraceError(KoalaError):
    """A measured trace that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Span:
    """One measured action (ms): the runtime started on it at `start` (its input wait included),
    its compute ended (its sends posted) at `end`; `wait` of that was spent waiting for input."""

    index: int
    start: float
    end: float
    wait: float

    @property
    def compute(self) -> float:
        """The time the action worked: its span less its input wait."""
        return max(0.0, self.end - self.start - self.wait)

    @property
    def arrival(self) -> float:
        """When its wait ended: its input's arrival, for an action that waited."""
        return self.start + self.wait


@dataclass
class RankTrace:
    """One process's file: its header's facts and, per step number, what it recorded."""

    path: Path
    engine: str
    schedule: Schedule
    rank: int                      # the pipeline rank
    pipeline: int                  # the data-parallel replica
    global_rank: int
    spans: dict[int, dict[int, Span]] = field(default_factory=dict)   # step -> index -> span
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> "step" event (start, end)
    events: dict[int, list[dict]] = field(default_factory=dict)  # step -> its raw events, as read
    #: step -> when the next step, another schedule's, started its pipeline on this rank (ms)
    next_starts: dict[int, float] = field(default_factory=dict)

    def complete(self, step: int) -> bool:
        """Whether this rank recorded step `step` whole: its "step" event and every action."""
        return step in self.steps and len(self.spans.get(step, ())) == len(self.schedule.ranks[self.rank])

    def complete_steps(self) -> list[int]:
        return sorted(n for n in self.steps if self.complete(n))


@dataclass(frozen=True)
class Step:
    """One complete step of one pipeline: its "step" events' extent over the ranks, each
    pipeline rank's actions in its order, and when the next step's pipeline started (None when
    the next step is not complete)."""

    pipeline: int
    number: int
    start: float
    end: float
    ranks: tuple[tuple[Span, ...], ...]
    next_anchor: float | None = None

    @property
    def anchor(self) -> float:
        """When the pipeline started: the earliest start of a rank's first compute (its input
        wait over). The simulator's time 0: a rank that entered the step earlier only waited."""
        return min(r[0].arrival for r in self.ranks if r)

    @property
    def period(self) -> float | None:
        """From this step's pipeline start to the next one's (ms): the step time with all the
        work between the pipelines (the optimizer step, the data, the runtime's own)."""
        return None if self.next_anchor is None else self.next_anchor - self.anchor

    @property
    def time(self) -> float:
        """The step time (ms): the period; for a step with no complete next step, the latest end
        of a rank's "step" event less the pipeline's start."""
        return self.period if self.period is not None else self.end - self.anchor

    @property
    def span(self) -> float:
        """The pipeline's span: the last action's end less the pipeline's start (ms)."""
        return max(r[-1].end for r in self.ranks if r) - self.anchor


@dataclass(frozen=True)
class TracedRun:
    """The files of one FILE: one schedule, its complete steps (every pipeline's) and notes on
    what was left out (incomplete steps, a pipeline without every rank's file)."""

    name: str
    schedule: Schedule
    engine: str
    files: tuple[RankTrace, ...]
    steps: tuple[Step, ...]
    notes: tuple[str, ...] = ()

    @property
    def took_turns(self) -> bool:
        """Whether other schedules ran between this run's steps (its step numbers have gaps)."""
        return any(f.next_starts or _gaps(f.steps.keys() | f.spans.keys()) for f in self.files)

    @property
    def timed_steps(self) -> list[Step]:
        """The steps whose time is a period (the next step complete too); all of them where none is."""
        return [s for s in self.steps if s.period is not None] or list(self.steps)

    @property
    def step_times(self) -> list[float]:
        return [s.time for s in self.timed_steps]

    @property
    def measured_ms(self) -> float:
        """The median step time over the timed steps (ms)."""
        return statistics.median(self.step_times)

    def median_step(self) -> Step:
        """A timed step whose time is the median (the lower middle one of an even count)."""
        ordered = sorted(self.timed_steps, key=lambda s: (s.time, s.pipeline, s.number))
        return ordered[(len(ordered) - 1) // 2]

    def events_of(self, step: Step) -> list[dict]:
        """The raw events (actions, "step", "after-pipeline") of one step, every rank's."""
        return [e for f in self.files if f.pipeline == step.pipeline for e in f.events.get(step.number, ())]


# -- files ----------------------------------------------------------------------------------
_RANK_SUFFIX = re.compile(r"^(?P<stem>.*)\.rank(?P<rank>\d+)$")


def rank_siblings(file: str | Path) -> list[Path]:
    """The per-rank files of the user's FILE (`trace.json` -> `trace.rank*.json`, `trace` ->
    `trace.rank*.json`), by global rank."""
    path = Path(file)
    stem, suffix = (path.stem, path.suffix) if path.suffix else (path.name, ".json")
    pattern = re.compile(re.escape(stem) + r"\.rank(\d+)" + re.escape(suffix) + "$")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := pattern.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def run_name(path: Path) -> str:
    """The FILE a per-rank file belongs to (`trace.rank3.json` -> `trace.json`), else itself."""
    m = _RANK_SUFFIX.match(path.stem)
    return str(path.with_name(m.group("stem") + path.suffix)) if m else str(path)


def trace_paths(arg: str) -> list[Path]:
    """The files a TRACE argument names: its `.rank*` siblings, else the file itself."""
    path = Path(arg)
    if path.is_dir():
        raise TraceError(f"{arg}: a directory; give a trace file (FILE, or its FILE.rank*.json files)")
    found = rank_siblings(path) or ([path] if path.is_file() else [])
    if not found:
        raise TraceError(f"{arg}: no such file, and no {Path(arg).stem if Path(arg).suffix else Path(arg).name}"
                         f".rank*{Path(arg).suffix or '.json'} beside it (the files a traced run writes, one per "
                         f"rank)")
    return found


def read_events(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, event) of every complete line that holds a JSON object; a cut last line is
    skipped. A file in Chrome's object form (`{"traceEvents": [...]}`) gives its events."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    text = data.decode("utf-8-sig", errors="replace")
    if text.lstrip().startswith("{"):
        whole = _object_form(text)
        if whole is not None:
            yield from ((0, e) for e in whole if isinstance(e, dict))
            return
    lines = text.split("\n")
    for n, line in enumerate(lines[:-1], 1):  # the last piece has no newline: cut, or empty
        item = line.strip().rstrip(",")
        if not item.startswith("{"):
            continue
        try:
            event = json.loads(item)
        except (ValueError, RecursionError):
            log.info("%s:%d: not a JSON event, skipped", path, n)
            continue
        if isinstance(event, dict):
            yield n, event


def _object_form(text: str) -> list | None:
    try:
        whole = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return whole.get("traceEvents") if isinstance(whole, dict) and isinstance(whole.get("traceEvents"), list) else None


# -- one file -------------------------------------------------------------------------------
def read_rank_trace(path: Path) -> RankTrace:
    """A file's header and its steps' events (TraceError for a file that is not a measured trace)."""
    events = list(read_events(path))
    header = next((e.get("args") for _, e in events if e.get("ph") == "M" and e.get("name") == "koala_trace"), None)
    if not isinstance(header, dict):
        hint = (" (a simulated trace, as koala simulate --trace writes, has none)"
                if any(e.get("ph") == "X" for _, e in events) else "")
        raise TraceError(f"{path}: not a measured koala trace: no koala_trace header event{hint}; give the files a "
                         f"run wrote with tracing on (docs/profiling.md, \"Calibrating from a measured run\")")
    trace = _from_header(path, header)
    for line, event in events:
        if event.get("ph") == "X":
            _add_event(trace, line, event)
        elif event.get("ph") == "i" and event.get("name") == "next-pipeline":
            _add_next_start(trace, line, event)
    return trace


def _add_next_start(trace: RankTrace, line: int, event: dict) -> None:
    """A `next-pipeline` event: the next step ran another schedule (in another file) and its
    first compute started then on this rank."""
    args = event.get("args") if isinstance(event.get("args"), dict) else {}
    ts, step = event.get("ts"), args.get("step")
    if not (_number(ts) and _whole(step)):
        raise TraceError(f"{trace.path}:{line}: event 'next-pipeline' needs a number ts (us) and args.step, got "
                         f"ts={ts!r} step={step!r}")
    trace.next_starts[step] = ts / 1e3


def _from_header(path: Path, header: dict) -> RankTrace:
    missing = [k for k in HEADER_FIELDS if k not in header]
    if missing:
        raise TraceError(f"{path}: the koala_trace header has no {missing[0]!r}")
    if header["version"] != TRACE_VERSION:
        raise TraceError(f"{path}: koala_trace version {header['version']!r}; this koala-ds reads version "
                         f"{TRACE_VERSION}")
    try:
        schedule = Schedule.from_dict(header["schedule_json"], source=f"{path}: schedule_json")
    except ScheduleError as exc:
        raise TraceError(str(exc)) from None
    for key in ("p", "m", "v"):
        if header[key] != getattr(schedule, key):
            raise TraceError(f"{path}: the header says {key}={header[key]!r} but its schedule_json has "
                             f"{key}={getattr(schedule, key)}")
    rank, pipeline = header["rank"], header.get("pipeline", 0)
    if not _whole(rank) or rank >= schedule.p or not _whole(pipeline):
        raise TraceError(f"{path}: the header's rank {rank!r} / pipeline {pipeline!r} is not a pipeline rank of "
                         f"p={schedule.p} / a replica index")
    return RankTrace(path, str(header.get("engine", "?")), schedule, rank, pipeline,
                     header.get("global_rank", rank) if _whole(header.get("global_rank", rank)) else rank)


def _whole(x: object) -> bool:
    return type(x) is int and x >= 0


def _number(x: object) -> bool:
    return type(x) in (int, float) and x == x and abs(x) != float("inf")


def _add_event(trace: RankTrace, line: int, event: dict) -> None:
    """One complete event: an action of the rank's order, a step's "step" or "after-pipeline"."""
    where = f"{trace.path}:{line}"
    args = event.get("args") if isinstance(event.get("args"), dict) else {}
    ts, dur, step = event.get("ts"), event.get("dur"), args.get("step")
    if not (_number(ts) and _number(dur) and _whole(step)):
        raise TraceError(f"{where}: event {event.get('name')!r} needs numbers ts and dur (us) and args.step, got "
                         f"ts={ts!r} dur={dur!r} step={step!r}")
    if event.get("cat") == "step":
        if event.get("name") == "step":
            trace.steps[step] = (ts / 1e3, (ts + dur) / 1e3)
        trace.events.setdefault(step, []).append(event)
        return
    order = trace.schedule.ranks[trace.rank]
    index, wait = args.get("index"), args.get("wait_ms", 0.0)
    if not _whole(index) or index >= len(order) or event.get("name") != str(order[index]):
        expected = f"{order[index]}" if _whole(index) and index < len(order) else f"indices 0-{len(order) - 1}"
        raise TraceError(f"{where}: action {event.get('name')!r} at index {index!r}, but rank {trace.rank}'s order "
                         f"(the header's schedule_json) has {expected} there")
    if not _number(wait) or wait < 0:
        raise TraceError(f"{where}: args.wait_ms must be a number >= 0, got {wait!r}")
    spans = trace.spans.setdefault(step, {})
    if index in spans:
        raise TraceError(f"{where}: action {event['name']} of step {step} appears twice")
    spans[index] = Span(index, ts / 1e3, (ts + dur) / 1e3, min(float(wait), dur / 1e3))
    trace.events.setdefault(step, []).append(event)


# -- runs -----------------------------------------------------------------------------------
def load_runs(traces: Sequence[str], skip_steps: int = 1, settle_steps: int = 1) -> list[TracedRun]:
    """The runs the TRACE arguments name (each a FILE with its per-rank files, or files of
    one), with their complete steps from step `skip_steps` on, each after `settle_steps` steps of
    its own schedule where schedules took turns. TraceError when a run has none."""
    runs: dict[Path, tuple[str, list[RankTrace]]] = {}
    seen: set[Path] = set()
    for arg in traces:
        for path in trace_paths(arg):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            name = run_name(path)
            runs.setdefault(Path(name).resolve(), (name, []))[1].append(read_rank_trace(path))
    return [_run(name, files, skip_steps, settle_steps) for name, files in runs.values()]


def describe(schedule: Schedule) -> str:
    return f"{schedule.name!r}: p={schedule.p} m={schedule.m} v={schedule.v}, {schedule.backward} backward"


def _run(name: str, files: list[RankTrace], skip: int, settle: int = 1) -> TracedRun:
    first = files[0]
    for f in files[1:]:
        if not f.schedule.same_order(first.schedule):
            raise TraceError(f"{f.path}: a trace of schedule {describe(f.schedule)}, but {first.path} of the same run "
                             f"({name}) is a trace of {describe(first.schedule)}; each run's files must be one "
                             f"schedule (give each traced run's FILE on its own)")
    by_pipeline: dict[int, dict[int, RankTrace]] = defaultdict(dict)
    for f in files:
        other = by_pipeline[f.pipeline].get(f.rank)
        if other is not None:
            raise TraceError(f"{f.path}: pipeline rank {f.rank} of pipeline {f.pipeline}, as {other.path} is: two "
                             f"files of one rank in one run")
        by_pipeline[f.pipeline][f.rank] = f
    steps: list[Step] = []
    reasons: list[str] = []
    for pipeline, ranks in sorted(by_pipeline.items()):
        got, why = _pipeline_steps(first.schedule, pipeline, ranks, skip, settle)
        steps += got
        if why:
            reasons.append(why)
    if not steps:
        raise TraceError("; ".join(reasons))
    return TracedRun(name, first.schedule, first.engine, tuple(files), tuple(steps), tuple(reasons))


def _pipeline_steps(schedule: Schedule, pipeline: int, ranks: dict[int, RankTrace], skip: int, settle: int = 1
                    ) -> tuple[list[Step], str | None]:
    """The complete steps of one pipeline from step `skip` on that follow `settle` steps of their
    own schedule (in a run where schedules took turns, the first of each turn follows another's:
    left out, and with `settle` 2 the second too), and why steps were left out."""
    missing = [r for r in range(schedule.p) if r not in ranks]
    if missing:
        some = ranks[min(ranks)].path
        return [], (f"{some}: pipeline {pipeline} has no file of pipeline rank {missing[0]} (of p={schedule.p}): "
                    f"every rank of a traced run writes its own FILE.rank{{g}}.json; give them all")
    complete = sorted(set.intersection(*(set(f.complete_steps()) for f in ranks.values())))
    recorded = set().union(*(f.steps.keys() | f.spans.keys() for f in ranks.values()))
    late = [n for n in complete if n >= skip]
    used = [n for n in late if all(k in recorded for k in range(max(0, n - settle), n))]
    turned = [n for n in late if n not in used]
    short = min(ranks.values(), key=lambda f: (max(f.steps, default=-1), f.rank))
    last = max(short.steps, default=-1)
    killed = last < max(max(f.steps, default=-1) for f in ranks.values())
    head = f"{short.path} ends in step {last + 1} (a killed rank?)" if killed else str(short.path)
    if used:
        why = [f"{head}: steps {_steps_text(used)} of pipeline {pipeline} are complete and used"] if killed else []
        if turned:
            why.append(f"{ranks[min(ranks)].path}: steps {_steps_text(turned)} left out, each {_within(settle)} "
                       f"(schedules took turns)")
        steps = [_step(pipeline, n, ranks) for n in used]
        after = {s.number: s.anchor for s in steps}
        return [dataclasses.replace(s, next_anchor=after.get(s.number + 1, _next_start(ranks, s.number)))
                for s in steps], "; ".join(why) or None
    if turned:
        return [], (f"{ranks[min(ranks)].path}: every complete step ({_steps_text(turned)}) is {_within(settle)}: "
                    f"let each schedule's turn be {settle + 1} steps or more (--alternate-block)"
                    + (", or give a smaller --settle-steps" if settle > 1 else ""))
    if complete:
        many = len(complete) > 1
        return [], (f"{head}: step{'s' if many else ''} {_steps_text(complete)} {'are' if many else 'is'} complete, "
                    f"and --skip-steps {skip} leaves {'them' if many else 'it'} out (step 0 is the warm-up): trace "
                    f"more steps, or give --skip-steps {complete[-1]}" + (" or less" if complete[-1] else ""))
    if killed:
        done = (f"steps {_steps_text(range(last + 1))} are complete there, but not in every rank's file"
                if last >= 0 else "it has no complete step")
        return [], f"{head}: {done}"
    per_rank = ", ".join(f"rank {r}: {_steps_text(f.complete_steps()) or 'none'}" for r, f in sorted(ranks.items()))
    return [], (f"{short.path}: no step of pipeline {pipeline} is complete (its 'step' event and every action) in "
                f"every rank's file; complete steps per rank: {per_rank}")


def _within(settle: int) -> str:
    return ("the first after a step of another schedule" if settle == 1 else
            f"among the first {settle} after a step of another schedule (--settle-steps {settle})")


def _next_start(ranks: dict[int, RankTrace], step: int) -> float | None:
    """When the step after `step`, another schedule's, started its pipeline (the earliest of the
    ranks' `next-pipeline` times); None unless every rank recorded one."""
    starts = [f.next_starts.get(step) for f in ranks.values()]
    return None if None in starts else min(starts)


def _step(pipeline: int, n: int, ranks: dict[int, RankTrace]) -> Step:
    order = sorted(ranks)
    start = min(ranks[r].steps[n][0] for r in order)
    end = max(ranks[r].steps[n][1] for r in order)
    spans = tuple(tuple(s for _, s in sorted(ranks[r].spans[n].items())) for r in order)
    return Step(pipeline, n, start, end, spans)


def _gaps(numbers: set[int]) -> bool:
    """Whether step numbers miss some between their lowest and highest."""
    return bool(numbers) and max(numbers) - min(numbers) + 1 > len(numbers)


def _steps_text(steps: Iterable[int]) -> str:
    """`0-3`, `2, 5, 7` (runs of consecutive numbers as ranges)."""
    out: list[tuple[int, int]] = []
    for n in sorted(steps):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
