"""Calibrate a cost profile from measured runs: the fit behind `koala calibrate`.

The runtimes' traces (koala_ds.sim.measured) give, per action, when the runtime started on it,
how long of that it waited for its input and when its compute ended; and per rank the whole
step. From the complete steps of every traced run (ms; "typical" is the mean of the samples
less the lowest and the highest 5%, see below):

- stage times: per (stage, op), the typical compute of its actions (span less input wait): F
  gives `forward`, I `backward_input`, W `backward_weight`, B `backward`; and the stage's
  `spread` of those fields, how precisely the samples give them (`profile.value_spread`). The
  deferrable forward of a split-backward schedule costs more than a full one's (a profile
  charges the difference to I, koala_ds.profiler.core). Where every run took turns with the
  others in one process and both kinds were traced (`forward_apart`), `forward` is the full
  schedules' F and each stage's I gains what its split schedules' F took over it (at least 0;
  `Fit.forward_extra`); otherwise F is fitted over every microbatch, split or not: between runs
  minutes apart the machine drifts by more than the difference, and charging it then (765f19e)
  turned that drift into a cost of the split schedules (docs/profiling.md). A field no trace
  measured (I and W under full-backward schedules only, B under split ones) keeps the input
  profile's value, scaled by that stage's measured / profiled `forward` (and its spread); the
  result says so.
- `switch` per stage (the extra time of an action whose rank's previous action was of another
  stage: with v >= 2, the rank's other chunk): per (stage, op), each such action's compute less
  the typical compute of that op's actions after one of the same stage, pooled over the stage's
  ops, their typical value, at least 0 (the bound's durations stay lower bounds). A stage time
  is then the typical compute of its actions after the same stage and that of its actions after
  a switch less the stage's `switch`, weighted by their numbers, so that the calibrated model
  gives the traced schedules the compute they measured. Only stages with actions after a switch
  and after the same stage get one; a trace of one chunk per rank measures none (the profile's
  is kept).
- `action_overhead`: the typical gap between consecutive actions of a rank (one action's end to
  the next one's start): the runtime's work between actions.
- `p2p_latency`: over the actions that waited (more than WAIT_MIN_MS) for an input made on another
  rank, the typical (start + wait) - the producer's end, less `action_overhead`; then, in
  `koala calibrate`, the nearest latency at which the runs' predicted step times are their
  measured ones on average (`matched_latency`: the waits see only the late messages).
- `step_overhead`: the typical (step time - pipeline span - `action_overhead`): what a step costs
  beside the pipeline. The pipeline starts when the first compute of a step starts (the
  simulator's time 0: a rank that entered the step earlier only waited); the step time is the
  period, from one step's pipeline start to the next one's (the optimizer step, loading data
  and the runtime's own work between pipelines included, whichever engine: Megatron's
  forward_backward_func leaves the optimizer out, DeepSpeed's train_batch has it); the span ends
  at the last compute.

Why these are the simulator's terms: it runs an action for (its compute + action_overhead) and
sends its output at that end; so the simulated action is the measured compute followed by the
gap, its output arrives action_overhead + p2p_latency after the measured end of the compute, and
a rank's pipeline work ends action_overhead after its last compute; step_overhead comes after
that (koala_ds.sim.simulator). A trace simulated from a profile is fitted back to that profile
exactly (tests/test_calibrate.py). Clocks must agree across ranks (one machine: the runtimes
use CLOCK_MONOTONIC), or the latency and the step time are off by their difference.

Why a trimmed mean and not a median: a step's time is a sum of action times, and a runtime's
action times are skewed to the right (a loaded CPU, a collection, a late thread), so the sum of
medians falls short of the typical step; a plain mean follows a single long pause. On real
Megatron-core runs (examples/megatron_gpt, p = 2, m = 8, CPU, two runs each of 1f1b and zb-h1 on
an overloaded 2-core machine) a profile fitted on one run predicted its median step time within
-0.8%, -9.9%, -2.7% and +8.8% with the trimmed mean, -7.9%, -26.2%, -13.6% and -27.2% with
medians, and +3.6%, -4.3%, +12.1% and +42.7% with plain means (docs/profiling.md).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..core.ir import KoalaError, Op, Schedule
from .measured import Step, TracedRun, describe
from .profile import OVERHEAD_PLACEMENTS, CostProfile, value_spread
from .simulator import simulate

log = logging.getLogger(__name__)

#: The profile field each op's measured compute gives.
FIELDS = {Op.F: "forward", Op.I: "backward_input", Op.W: "backward_weight", Op.B: "backward"}
TIME_FIELDS = ("forward", "backward_input", "backward_weight", "backward")
#: The field under which `fit` gathers a split-backward schedule's F while told apart (`forward_apart`).
SPLIT_FORWARD = "forward (split backward)"
#: The share of samples left out at each end before averaging (`typical`).
TRIM = 0.05
#: An action that waited less than this (ms) for its input is not a sample of the latency: its
#: input was there, and the wait was the receive call's own time.
WAIT_MIN_MS = 0.01
#: A calibrated prediction further than this from the measured step time says the model lacks a
#: term for the run (the command says so), unless the miss is within NOISE_SPREADS x the largest
#: spread of the runs' measured medians (`RunCheck.noise`): the fit shares the stage times across
#: the runs, so one run's noisy median moves every run's prediction.
ERROR_WARN = 0.10
#: 1.5 spreads (interquartile ranges of a median over repeated runs) ~ 2 standard errors.
NOISE_SPREADS = 1.5


class CalibrationError(KoalaError):
    """Traces that do not fit the profile (another stage count, p or v)."""


def typical(samples: Sequence[float]) -> float:
    """The mean of the samples less the lowest and the highest TRIM of them (module docstring)."""
    ordered = sorted(samples)
    k = int(len(ordered) * TRIM)
    return statistics.fmean(ordered[k:len(ordered) - k])


@dataclass(frozen=True)
class Estimate:
    """A fitted value (ms; None where nothing measured it), how many samples gave it and its
    spread: how precisely the samples give it (`koala_ds.sim.profile.value_spread` over their
    median; None with fewer than 4 samples or a median of 0)."""

    value: float | None
    samples: int
    spread: float | None = None

    @classmethod
    def of(cls, samples: Sequence[float], less: float = 0.0) -> "Estimate":
        """The samples' `typical` value less `less`, at least 0; None without samples."""
        if not samples:
            return cls(None, 0)
        mid = statistics.median(samples)
        spread = None
        if len(samples) >= 4 and mid > 0:
            spread = value_spread(samples, mid)
        return cls(max(0.0, typical(samples) - less), len(samples), spread)


@dataclass(frozen=True)
class Fit:
    """What the traces measured: per (profile stage entry, field) and the three overheads."""

    stages: dict[tuple[int, str], Estimate]
    action_overhead: Estimate
    p2p_latency: Estimate
    step_overhead: Estimate
    #: per profile stage entry, its fitted switch cost (stages without samples left out)
    switch: dict[int, Estimate] = dataclasses.field(default_factory=dict)
    #: per stage entry, what its split schedules' F took over the full ones' (charged to I;
    #: only where `forward_apart`)
    forward_extra: dict[int, Estimate] = dataclasses.field(default_factory=dict)
    #: per placement style traced, step_overhead of its steps alone (`beside_by`)
    step_overhead_by_placement: dict[str, Estimate] = dataclasses.field(default_factory=dict)


def entry_of(stage: int, schedule: Schedule, entries: int) -> int:
    """The profile entry of a virtual stage: itself, or with one entry per stage of one pipeline
    (bidirectional schedules) its place in its pipeline (as CostProfile.stage_costs)."""
    return stage if entries == schedule.num_stages else stage % schedule.placement.stages_per_pipeline


def check_fits(runs: Sequence[TracedRun], profile: CostProfile, meta: dict | None = None) -> None:
    """A CalibrationError naming the trace whose stages (p x v, or p and v the profile was made
    for, its `meta`) are not the profile's."""
    for run in runs:
        s, pl = run.schedule, run.schedule.placement
        if profile.num_stages not in (pl.num_stages, pl.stages_per_pipeline):
            raise CalibrationError(f"{run.name}: a trace of {describe(s)} ({pl.num_stages} virtual stages), but "
                                   f"{profile.source} has {profile.num_stages} stages: give --profile the profile of "
                                   f"the traced run's {pl.stages_per_pipeline} stages")
        for key in ("p", "v"):
            made_for = (meta or {}).get(key)
            if type(made_for) is int and made_for != getattr(s, key):
                raise CalibrationError(f"{run.name}: a trace of {describe(s)}, but {profile.source} was profiled for "
                                       f"{key}={made_for} (its meta.{key}): give --profile the profile of the traced run")


def fit(runs: Sequence[TracedRun], entries: int) -> Fit:
    """The fit of the module docstring over every complete step of `runs`, for a profile of
    `entries` stage entries."""
    apart = forward_apart(runs)
    same: dict[tuple[int, str], list[float]] = defaultdict(list)  # after an action of the same stage (or first)
    after: dict[tuple[int, str], list[float]] = defaultdict(list)  # after an action of another stage
    gaps: list[float] = []
    arrivals: list[float] = []
    beside: list[float] = []
    for run in runs:
        schedule = run.schedule
        for step in run.steps:
            for r, spans in enumerate(step.ranks):
                order = schedule.ranks[r]
                for span in spans:
                    a = order[span.index]
                    switched = span.index > 0 and order[span.index - 1].stage != a.stage
                    name = SPLIT_FORWARD if apart and a.op is Op.F and schedule.backward == "split" else FIELDS[a.op]
                    (after if switched else same)[(entry_of(a.stage, schedule, entries), name)].append(span.compute)
                gaps += [b.start - a.end for a, b in zip(spans, spans[1:])]
            arrivals += message_delays(schedule, step)
        beside += beside_samples(run)
    overhead = Estimate.of(gaps)
    c = overhead.value or 0.0
    switch = _switch_costs(same, after)
    stages = {key: _stage_time(same[key], after[key], switch[key[0]].value if key[0] in switch else None)
              for key in sorted(same.keys() | after.keys())}
    extra = _charge_split_forward(stages)
    return Fit(stages, overhead, Estimate.of(arrivals, c), Estimate.of(beside, c), switch, extra,
               beside_by(runs, c, lambda run: run.schedule.placement.style))


def beside_by(runs: Sequence[TracedRun], action_overhead: float, key: Callable[[TracedRun], str]
              ) -> dict[str, Estimate]:
    """Per `key` of the runs (their placement style, their schedule's name), `fit`'s
    step_overhead of those runs' steps alone, in the runs' order: each timed step's time less the
    pipeline's span, less `action_overhead`. What a step spends beside the pipeline depends on
    where the stages are: on Megatron a V-shape computes the loss on rank 0, which ships the loss
    values to the last rank after its last action, before it can start the next step
    (benchmarks/beside_pipeline.py, the 4-layer example: zb-v's steps 0.6 ms more than
    interleaved-1f1b's, 1.3 ms before 0.6 ms of it went). Per schedule, they say where one pays
    another than its placement's."""
    samples: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        samples[key(run)] += beside_samples(run)
    return {k: Estimate.of(values, action_overhead) for k, values in samples.items()}


def beside_samples(run: TracedRun) -> list[float]:
    """Each timed step's time less the pipeline's span: the samples of step_overhead (with the
    action overhead of the step's last action still in them)."""
    return [step.time - step.span for step in run.timed_steps]


def forward_apart(runs: Sequence[TracedRun]) -> bool:
    """Whether `fit` tells the split schedules' forward from the full ones': both kinds traced,
    and every run took turns with others in one process (so a drift of the machine hits both
    kinds alike; module docstring)."""
    return {r.schedule.backward for r in runs} >= {"split", "full"} and all(r.took_turns for r in runs)


def _charge_split_forward(stages: dict[tuple[int, str], Estimate]) -> dict[int, Estimate]:
    """Fold the SPLIT_FORWARD entries of `stages` (in place): where the stage's full schedules'
    F was measured too, I gains what the split F took over it (at least 0), as in a profile;
    else the split F is the stage's `forward`. Returns the extra charged per stage entry."""
    extra = {}
    for entry, field in sorted(k for k in stages if k[1] == SPLIT_FORWARD):
        split, full = stages.pop((entry, field)), stages.get((entry, "forward"))
        i = stages.get((entry, "backward_input"))
        if full is None or i is None:
            stages.setdefault((entry, "forward"), split)
            continue
        more = max(0.0, split.value - full.value)
        stages[(entry, "backward_input")] = dataclasses.replace(i, value=i.value + more)
        extra[entry] = Estimate(more, split.samples)
    return extra


def _stage_time(same: list[float], after: list[float], switch: float | None) -> Estimate:
    """A (stage, op)'s time without the switch cost: the typical compute of its actions after one
    of the same stage and of those after a switch less `switch`, weighted by their numbers (the
    samples' spread is all of them)."""
    whole = Estimate.of(same + after)
    parts = [(len(x), typical(x) - less) for x, less in ((same, 0.0), (after, switch or 0.0)) if x]
    return dataclasses.replace(whole, value=max(0.0, sum(n * v for n, v in parts) / sum(n for n, _ in parts)))


def _switch_costs(same: dict[tuple[int, str], list[float]], after: dict[tuple[int, str], list[float]]
                  ) -> dict[int, Estimate]:
    """Per stage entry with actions both after a switch and after the same stage: the typical
    extra compute after a switch (module docstring)."""
    extra: dict[int, list[float]] = defaultdict(list)
    for key, samples in after.items():
        if same.get(key):
            base = typical(same[key])
            extra[key[0]] += [x - base for x in samples]
    return {entry: Estimate.of(values) for entry, values in sorted(extra.items())}


def message_delays(schedule: Schedule, step: Step, min_wait: float = WAIT_MIN_MS) -> list[float]:
    """Per action that waited more than `min_wait` ms for an input from another rank: its arrival
    less the producer's end."""
    pl = schedule.placement
    made: dict[tuple[str, int, int], tuple[int, float]] = {}  # (kind, stage, mb) -> (rank, end)
    for r, spans in enumerate(step.ranks):
        for span in spans:
            a = schedule.ranks[r][span.index]
            if a.op in (Op.F, Op.B, Op.I):
                made[("F" if a.op is Op.F else "G", a.stage, a.microbatch)] = (r, span.end)
    out = []
    for r, spans in enumerate(step.ranks):
        for span in spans:
            if span.wait <= min_wait:
                continue
            a = schedule.ranks[r][span.index]
            src = pl.prev_stage(a.stage) if a.op is Op.F else pl.next_stage(a.stage) if a.op in (Op.B, Op.I) else None
            producer = None if src is None else made.get(("F" if a.op is Op.F else "G", src, a.microbatch))
            if producer is not None and producer[0] != r:
                out.append(span.arrival - producer[1])
    return out


# -- the calibrated profile -----------------------------------------------------------------
def calibrated_profile(raw: dict, fitted: Fit, runs: Sequence[TracedRun], skip_steps: int,
                       source: str, settle_steps: int = 1) -> tuple[dict, list[str]]:
    """The input profile `raw` (its parsed JSON, from `source`) with the fitted times, and what
    was not measured (kept from the profile, as notes). Its memory fields and any other field
    are kept as they were; `meta.calibration` says which traces and how many steps."""
    stages, notes = _stage_entries(raw["stages"], fitted)
    data: dict[str, Any] = {k: (stages if k == "stages" else v) for k, v in raw.items() if k != "meta"}
    why = {"p2p_latency": "no action waited for an input from another rank",
           "action_overhead": "no rank ran two actions", "step_overhead": "no complete step"}
    for name in ("p2p_latency", "action_overhead", "step_overhead"):
        est = getattr(fitted, name)
        if est.value is not None:
            data[name] = round(est.value, 6)
        else:
            notes.append(f"{name} not measured ({why[name]}): the profile's {raw.get(name, 0.0):g} kept")
    by_placement = placement_overheads(raw, fitted)
    if by_placement:
        data["step_overhead_by_placement"] = by_placement
    meta = dict(raw.get("meta") or {})
    meta["calibration"] = {
        "tool": "koala calibrate", "profile": source, "skip_steps": skip_steps, "settle_steps": settle_steps,
        "runs": [{"trace": r.name, "schedule": r.schedule.name, "engine": r.engine, "p": r.schedule.p,
                  "m": r.schedule.m, "v": r.schedule.v, "files": [str(f.path) for f in r.files],
                  "steps": len(r.steps), "timed_steps": len(r.step_times),
                  "pipelines": len({s.pipeline for s in r.steps}),
                  "measured_step_ms": round(r.measured_ms, 6)} for r in runs],
        "samples": {"action_overhead": fitted.action_overhead.samples, "p2p_latency": fitted.p2p_latency.samples,
                    "step_overhead": fitted.step_overhead.samples,
                    "switch": {str(i): est.samples for i, est in fitted.switch.items()}},
        "not_measured": notes}
    data["meta"] = meta
    return data, notes


def placement_overheads(raw: dict, fitted: Fit) -> dict[str, float]:
    """The calibrated profile's `step_overhead_by_placement`: each traced placement's own
    step_overhead where the traces hold several placements, or where the profile had the field
    (its other placements kept); none where one placement was traced into a profile without it
    (then step_overhead is that placement's). A placement of no name (an explicit stage map) is
    in step_overhead only."""
    fitted_own = {k: round(e.value, 6) for k, e in fitted.step_overhead_by_placement.items()
                  if e.value is not None and k in OVERHEAD_PLACEMENTS}
    had = dict(raw.get("step_overhead_by_placement") or {})
    if len(fitted_own) < 2 and not had:
        return {}
    return dict(sorted({**had, **fitted_own}.items()))


def _stage_entries(raw_stages: list[dict], fitted: Fit) -> tuple[list[dict], list[str]]:
    """The stage entries with the measured times; an unmeasured time is the profile's, scaled by
    the stage's measured / profiled forward (the median of the other stages' ratios where its
    forward was not measured either)."""
    ratios = {i: fitted.stages[(i, "forward")].value / e["forward"] for i, e in enumerate(raw_stages)
              if (i, "forward") in fitted.stages and e["forward"] > 0}
    fallback = statistics.median(ratios.values()) if ratios else 1.0
    out, kept = [], defaultdict(list)  # (fields kept) -> [(stage, ratio)]
    for i, entry in enumerate(raw_stages):
        new, scaled = dict(entry), []
        k = ratios.get(i, fallback)
        spread = dict(entry.get("spread") or {})
        for name in TIME_FIELDS:
            est = fitted.stages.get((i, name))
            if est is not None and est.value is not None:
                new[name] = round(est.value, 6)
                if est.spread is not None:
                    spread[name] = round(est.spread, 4)
            elif name in entry:
                new[name] = round(entry[name] * k, 6)
                scaled.append(name)
        if spread:
            new["spread"] = {n: x for n, x in spread.items() if n != "backward" or "backward" in new}
        est = fitted.switch.get(i)
        if est is not None and est.value is not None:
            new["switch"] = round(est.value, 6)
        if scaled:
            kept[tuple(scaled)].append((i, k))
        out.append(new)
    notes = [f"{', '.join(names)} of stage{'s' if len(items) > 1 else ''} {', '.join(str(i) for i, _ in items)} "
             f"not measured: the profile's, times the stage's measured / profiled forward "
             f"(x{min(k for _, k in items):.3g}" + (f"-{max(k for _, k in items):.3g})" if len(items) > 1 else ")")
             for names, items in kept.items()]
    return out, notes


def matched_latency(runs: Sequence[TracedRun], calibrated: CostProfile, mode: str = "async") -> float:
    """The p2p latency closest to `calibrated`'s (the waits' estimate) at which the runs' mean
    error, mean(predicted / measured - 1) of their step times, is 0: the waits' estimate sees
    only the messages that arrived late (the ones whose latency was long), and one latency for
    every message cannot be what each wait says; this one makes the model reproduce the runs on
    average. A predicted step never shortens as the latency grows (an action starts at the
    later of its rank's previous end and its inputs' arrival), so the mean error is a
    nondecreasing function of it and a bisection finds the nearest latency where it changes sign;
    0 where the runs are over-predicted even without latency. Unchanged where no run's step time
    depends on it, or no run has a measured step."""
    runs = [r for r in runs if r.measured_ms > 0]

    def error(latency: float) -> float:
        prof = dataclasses.replace(calibrated, p2p_latency=latency)
        return statistics.fmean(simulate(r.schedule, prof, mode=mode, timeline=False).makespan / r.measured_ms - 1
                                for r in runs)

    start = float(calibrated.p2p_latency)
    at_start = error(start) if runs else 0.0
    if abs(at_start) <= 1e-9:  # already (rounding apart)
        return start
    over = at_start > 0
    if over:  # the largest latency below start where the error is <= 0
        if error(0.0) > 0:
            return 0.0
        low, high = 0.0, start
    else:  # the smallest latency above start where the error is >= 0
        low, high = start, max(2 * start, 1.0)
        for _ in range(30):
            if error(high) >= 0:
                break
            low, high = high, 2 * high
        else:
            return high
    for _ in range(60):  # error(low) <= 0 < error(high) when over; error(low) < 0 <= error(high) else
        mid = (low + high) / 2
        below = error(mid) <= 0 if over else error(mid) < 0
        low, high = (mid, high) if below else (low, mid)
    return low if over else high


# -- checking it ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunCheck:
    """One traced run: its measured step time and the two predictions (ms)."""

    run: TracedRun
    measured: float
    input_ms: float
    calibrated_ms: float
    #: the largest `spread` among the runs fitted together (this one's included)
    noise: float = 0.0

    @property
    def input_error(self) -> float:
        return self.input_ms / self.measured - 1 if self.measured > 0 else 0.0

    @property
    def calibrated_error(self) -> float:
        return self.calibrated_ms / self.measured - 1 if self.measured > 0 else 0.0

    @property
    def spread(self) -> float:
        """How precisely the run's steps give its median step time: `value_spread` of the step
        times, a fraction of the median (0 with fewer than 2 steps)."""
        times = self.run.step_times
        return value_spread(times, self.measured) if len(times) >= 2 else 0.0

    @property
    def off(self) -> bool:
        """The calibrated prediction is more than ERROR_WARN off this run."""
        return abs(self.calibrated_error) > ERROR_WARN

    @property
    def misses(self) -> bool:
        """`off`, and by more than the measured medians' own noise (NOISE_SPREADS x noise)."""
        return self.off and abs(self.calibrated_error) > NOISE_SPREADS * self.noise


def check_runs(runs: Sequence[TracedRun], profile: CostProfile, calibrated: CostProfile,
               mode: str = "async") -> list[RunCheck]:
    """Each run's schedule simulated with the input and the calibrated profile, against its
    measured step time (the median over its complete steps)."""
    out = []
    for run in runs:
        try:
            before = simulate(run.schedule, profile, mode=mode, timeline=False).makespan
            after = simulate(run.schedule, calibrated, mode=mode, timeline=False).makespan
        except KoalaError as exc:
            raise CalibrationError(f"{run.name}: {exc}") from None
        out.append(RunCheck(run, run.measured_ms, before, after))
    noise = max((c.spread for c in out), default=0.0)
    return [dataclasses.replace(c, noise=noise) for c in out]


def merged_timeline(runs: Sequence[TracedRun], calibrated: Sequence[CostProfile], mode: str = "async") -> dict:
    """One Chrome trace: per run i, its median complete step as measured (pid 2i) beside the
    prediction with its calibrated profile `calibrated[i]` (pid 2i + 1: koala_ds.viz.trace's rows
    and names, plus each rank's step overhead), the first actions at the same time."""
    from ..viz.trace import chrome_trace

    events: list[dict] = []
    for i, (run, prof) in enumerate(zip(runs, calibrated)):
        step = run.median_step()
        lead = (step.anchor - step.start) * 1e3  # us from the step's start to the pipeline's
        where = f", pipeline {step.pipeline}" if any(s.pipeline for s in run.steps) else ""
        events += _process(2 * i, f"{run.schedule.name} measured ({run.name}, step {step.number}{where})",
                           run.schedule.p)
        events += [dict(e, pid=2 * i, ts=e["ts"] - step.start * 1e3) for e in run.events_of(step)]
        result = simulate(run.schedule, prof, mode=mode, timeline=True)
        predicted = [dict(e, pid=2 * i + 1) for e in chrome_trace(result, run.schedule)["traceEvents"]
                     if e.get("name") != "process_name"]
        for e in predicted:
            if "ts" in e:
                e["ts"] += lead
        events += _process(2 * i + 1, f"{run.schedule.name} calibrated prediction", 0) + predicted
        own = prof.step_overhead_of(run.schedule.placement.style)
        k = own * 1e3
        events += [{"name": "step overhead", "cat": "step", "ph": "X", "pid": 2 * i + 1, "tid": r,
                    "ts": lead + end * 1e3 - k, "dur": k, "args": {"step_overhead_ms": own}}
                   for r, end in enumerate(result.finish) if k > 0]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"koala": "koala calibrate --timeline: measured (even pid) and calibrated prediction (odd pid)"}}


def _process(pid: int, name: str, p: int) -> list[dict]:
    out: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
                       {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    for r in range(p):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": r, "args": {"sort_index": r}})
    return out
