"""The timed simulator: exact for the cost model, and fast enough for a search's inner loop.

Model (see also docs/lower_bound.md):
- Each rank runs its actions in its order, one at a time.
- An action starts when its rank is free and every input has arrived. The inputs are the
  data dependencies of `koala_ds.core.lowered` (the table the search and the validator read too):
  F(s) needs F(s-1); I/B(s) needs F(s) and the input gradient (I or B) of s+1; W(s) needs I(s). An input computed on
  another rank arrives `p2p_latency` after it is computed.
- F costs `forward`, I `backward_input`, W `backward_weight`, B the stage's `backward` (the
  profile's field when given, else I + W); an action whose rank's previous action was of another
  stage costs its stage's `switch` more (0 unless the profile gives it).
- Memory per rank: F allocates `activation_mb`, I frees `activation_mb - w_hold_mb`, W frees
  `w_hold_mb`, B frees `activation_mb`. The peak is the maximum over the rank's order (it does
  not depend on timing, because a rank runs one action at a time).
- The profile's `action_overhead` is already in every action's time (sim.profile). Its
  `step_overhead` (the optimizer step and the runtime's other work of a step beside the
  pipeline; the placement's own where the profile gives one, `step_overhead_by_placement`) is
  added to every rank's finish, so to the makespan: a predicted step time. It counts as busy
  time (the rank works), not as bubble.

Two communication modes:
- "async" (default): sends never block (isend + blocking recv, as the adapters do).
- "rendezvous": a send to another rank completes only when the receiver posts its receive, as
  blocking gloo/NCCL sends do. Exact rule: when action X on rank A finishes computing at time
  e, and its output goes to action Y on rank B != A, rank A sends right away and is blocked
  until the handshake time h = max(e, q), where q is the time rank B reaches Y in its order
  (B is free: its previous action and that action's send are complete; B posts the receive
  for Y then, and not earlier). The data arrives at h + p2p_latency; rank A is free again at
  h + p2p_latency, and Y starts at max(q, h + p2p_latency). Orders in which two ranks each
  wait in a send for the other to post a receive deadlock in this mode only.

`Simulator(profile, placement, m, backward)` is built once per configuration; it turns orders
into integer codes and evaluates them with flat lists (several million actions per second).
`simulate(schedule, profile)` is the convenient wrapper.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import count, repeat
from typing import NamedTuple, Sequence

import numpy as np

from ..core.ir import Action, Placement, Schedule, ScheduleError
from ..core.lowered import B, F, I, Lowered, Stall, W  # noqa: F401 (Stall: the search imports it from here)
from .profile import CostProfile, ProfileError
from .timing import costed

log = logging.getLogger(__name__)

MODES = ("async", "rendezvous")
#: Relative tolerance of the memory-limit comparison (sums of floats).
MEMORY_RTOL = 1e-9


class TimedAction(NamedTuple):
    """One action of the timeline: `rank` runs `action` (its `index`-th) from `start` to `end`.

    A named tuple rather than a dataclass: timelines hold one per action and are built often."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulation found. Times in ms, memory in MB, per-rank tuples indexed by rank."""

    name: str
    mode: str
    p: int
    m: int
    v: int
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    finish: tuple[float, ...]  # when each rank's last action (and its send) completes, + step_overhead
    bubble_ratio: float  # total idle / (p * makespan)
    peak_memory_mb: tuple[float, ...]
    memory_limit_mb: tuple[float | None, ...]
    fits_memory: bool
    timeline: tuple[TimedAction, ...] | None = None

    @property
    def peak_memory_max(self) -> float:
        return max(self.peak_memory_mb)

    def rank_timeline(self, rank: int) -> list[TimedAction]:
        if self.timeline is None:
            raise ValueError("simulated with timeline=False")
        return [t for t in self.timeline if t.rank == rank]

    def to_dict(self, timeline: bool = True) -> dict:
        out = {
            "name": self.name, "mode": self.mode, "p": self.p, "m": self.m, "v": self.v,
            "makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
            "busy": list(self.busy), "idle": list(self.idle), "finish": list(self.finish),
            "peak_memory_mb": list(self.peak_memory_mb), "memory_limit_mb": list(self.memory_limit_mb),
            "fits_memory": self.fits_memory,
        }
        if timeline and self.timeline is not None:
            out["timeline"] = [{"rank": t.rank, "action": str(t.action), "start": t.start, "end": t.end}
                               for t in self.timeline]
        return out


class Simulator:
    """A compiled configuration (profile, placement, m, backward mode) that simulates orders.

    Orders are one sequence per rank, of `Action`s or of integer codes (`code()`); integer
    codes skip the conversion and are the fastest input. The tables are the configuration's
    `Lowered` form (`self.lowered`).
    """

    def __init__(self, profile: CostProfile, placement: Placement, m: int, backward: str = "full") -> None:
        self.lowered = costed(placement, m, backward, profile)
        self.profile, self.placement, self.m, self.backward = profile, placement, m, backward
        self.num_stages = placement.num_stages
        self.p = placement.p
        self.latency = self.lowered.latency
        self.step_overhead = profile.step_overhead_of(placement.style)  # its placement's own, where given
        self.memory_limits = profile.memory_limits(self.p)

    # -- codes --------------------------------------------------------------------------
    def code(self, action: Action) -> int:
        return self.lowered.code(action)

    def decode(self, code: int) -> Action:
        return self.lowered.decode(code)

    def encode(self, ranks: Sequence[Sequence[Action | int]]) -> list[list[int]]:
        """Per-rank lists of integer codes (integers pass through)."""
        return self.lowered.encode(ranks)

    # -- checks -------------------------------------------------------------------------
    def check(self, codes: list[list[int]]) -> None:
        """Raise `ScheduleError` unless the orders are a complete, locally ordered schedule.

        The timing loop relies on it: dependencies within a rank are taken from the order."""
        S, m = self.num_stages, self.m
        flat = np.fromiter((c for order in codes for c in order), dtype=np.int64,
                           count=sum(len(o) for o in codes))
        rank_ids = np.repeat(np.arange(self.p), [len(o) for o in codes])
        bad = np.nonzero(self.lowered.rank_of[flat] != rank_ids)[0]
        if bad.size:
            a = self.decode(flat[bad[0]])
            raise ScheduleError(f"{a} is on rank {rank_ids[bad[0]]} but stage {a.stage} lives on rank "
                                f"{self.placement.rank_of(a.stage)}")
        counts = np.bincount(flat, minlength=4 * S * m).reshape(4, S, m)
        if counts.max(initial=0) > 1:
            raise ScheduleError(f"{self.decode(int(np.argmax(counts.ravel())))} appears more than once")
        cf, cb, ci, cw = counts[F], counts[B], counts[I], counts[W]
        passes = self.lowered.passes
        if self.backward == "full" and ci.any() | cw.any():
            op = I if ci.any() else W
            a = self.decode(int(np.flatnonzero(counts[op])[0]) + op * S * m)
            raise ScheduleError(f"{a}: op {a.op} needs backward split (this configuration is backward full)")

        def first(mask: np.ndarray) -> tuple[int, int] | None:
            hit = np.argwhere(mask)
            return None if not hit.size else (int(hit[0][0]), int(hit[0][1]))

        nbwd = cb + ci
        for mask, text in (
                (~passes & ((cf + nbwd + cw) > 0),
                 "stage {s} microbatch {mb}: that microbatch does not pass through stage {s} (m={m})"),
                (passes & (cf == 0), "missing forward {s}F{mb}"),
                (passes & (nbwd == 0), "stage {s} microbatch {mb} has no backward (B, or I and W)"),
                (nbwd > 1, "stage {s} microbatch {mb} has both B and I"),
                (ci != cw, "stage {s} microbatch {mb} needs one I and one W (has I x{i}, W x{w})")):
            hit = first(mask)
            if hit is not None:
                s, mb = hit
                raise ScheduleError(text.format(s=s, mb=mb, m=m, i=int(ci[s, mb]), w=int(cw[s, mb])))
        pos = np.full(4 * S * m, -1, dtype=np.int64)
        pos[flat] = np.arange(flat.size)
        pos = pos.reshape(4, S, m)
        bwd = np.where(cb > 0, pos[B], pos[I])
        late = np.argwhere(passes & (bwd < pos[F]))
        if late.size:
            s, mb = (int(x) for x in late[0])
            op = "B" if cb[s, mb] else "I"
            raise ScheduleError(f"{s}{op}{mb} runs before its forward {s}F{mb} on rank {self.placement.rank_of(s)}")
        late = np.argwhere((ci > 0) & (pos[W] < pos[I]))
        if late.size:
            s, mb = (int(x) for x in late[0])
            raise ScheduleError(f"{s}W{mb} runs before its input-gradient step {s}I{mb} "
                                f"on rank {self.placement.rank_of(s)}")

    # -- evaluation ---------------------------------------------------------------------
    def makespan(self, ranks: Sequence[Sequence[Action | int]], mode: str = "async", check: bool = True) -> float:
        """Makespan only: the fastest call (no timeline, no memory)."""
        codes = self.lowered.encode(ranks)
        if check:
            self.check(codes)
        free, _ = self._times(codes, mode, record=False)
        return max(free)

    def fits_memory(self, peaks: Sequence[float]) -> bool:
        return all(limit is None or peak <= limit * (1 + MEMORY_RTOL) + MEMORY_RTOL
                   for peak, limit in zip(peaks, self.memory_limits))

    def run(self, ranks: Sequence[Sequence[Action | int]], mode: str = "async", timeline: bool = False,
            check: bool = True, name: str = "candidate", v: int | None = None) -> SimResult:
        """Everything: makespan, busy/idle, bubble, memory, and optionally the timeline."""
        codes = self.lowered.encode(ranks)
        if check:
            self.check(codes)
        free, starts = self._times(codes, mode, record=timeline)
        makespan = max(free)
        durations = [self.lowered.durations(o) for o in codes]
        busy = tuple(sum(d) + self.step_overhead for d in durations)
        idle = tuple(max(0.0, makespan - b) for b in busy)  # no -5e-12 where a rank is never idle
        bubble = (sum(idle) / (self.p * makespan)) if makespan > 0 else 0.0
        peaks = self.lowered.peaks(codes)
        events = None
        if timeline:
            as_actions = bool(ranks) and bool(ranks[0]) and isinstance(ranks[0][0], Action)
            timed: list[TimedAction] = []
            for r, (order, rank_starts) in enumerate(zip(codes, starts)):
                acts = ranks[r] if as_actions else [self.decode(c) for c in order]
                ends = [st + d for d, st in zip(durations[r], rank_starts)]
                timed.extend(map(TimedAction, repeat(r), count(), acts, rank_starts, ends))
            events = tuple(timed)
        if v is None:
            v = self.placement.v
        return SimResult(name, mode, self.p, self.m, v, makespan, busy, idle, tuple(free), bubble, peaks,
                         self.memory_limits, self.fits_memory(peaks), events)

    def _times(self, codes: list[list[int]], mode: str, record: bool) -> tuple[list[float], list[list[float]]]:
        if mode == "async":
            free, starts, pos, _ = self.lowered.run_async(codes, record)
            if any(pos[r] < len(codes[r]) for r in range(self.p)):
                self._deadlock(codes, pos, [-1] * self.p, "async")
            return self._with_step(free), starts
        if mode == "rendezvous":  # the same loop, with a post and a send step per message between ranks
            free, starts, pos, sending = self.lowered.run_rendezvous(codes, record)
            if any(pos[r] < len(codes[r]) or sending[r] >= 0 for r in range(self.p)):
                self._deadlock(codes, pos, sending, "rendezvous")
            return self._with_step(free), starts
        raise ScheduleError(f"unknown simulation mode {mode!r}; use one of {', '.join(MODES)}")

    def try_times(self, codes: Sequence[Sequence[int]], record: bool = True
                  ) -> tuple[list[float], list[list[float]]] | Stall:
        """(finish time of each rank, start time of each action per rank) for integer-coded
        orders, unchecked (the search's inner loop); on a deadlock, where it stalled instead of an
        error (a search meets thousands of deadlocks; the error message decodes every action)."""
        res = self.lowered.try_times(codes, record)
        if self.step_overhead and not isinstance(res, Stall):
            return self._with_step(res[0]), res[1]
        return res

    def _with_step(self, free: list[float]) -> list[float]:
        """Each rank's finish with the profile's `step_overhead` after its pipeline work."""
        k = self.step_overhead
        return [t + k for t in free] if k else free

    @property
    def inputs(self) -> list[int]:
        """Per action code, the slot (another stage's output) it waits for; -1 if none."""
        return self.lowered.dep

    def _deadlock(self, codes: list[list[int]], pos: list[int], sending: list[int], mode: str) -> None:
        producer: dict[int, Action] = {}
        for order in codes:
            for c in order:
                if self.lowered.out[c] >= 0:
                    producer[self.lowered.out[c]] = self.decode(c)

        def slot_text(slot: int) -> str:
            if slot in producer:
                a = producer[slot]
                return f"{a} (rank {self.placement.rank_of(a.stage)})"
            return f"{self.lowered.slot_text(slot)}, which no rank runs"

        lines = []
        for r in range(self.p):
            if sending[r] >= 0:
                slot = sending[r]
                a = producer.get(slot)
                consumer = None
                for q in range(self.p):
                    for c in codes[q]:
                        if self.lowered.dep[c] == slot:
                            consumer = (q, self.decode(c))
                target = f"rank {consumer[0]} to post the receive for {consumer[1]}" if consumer else "a receiver"
                lines.append(f"rank {r} is blocked sending the output of {a} and waits for {target}")
            elif pos[r] < len(codes[r]):
                c = codes[r][pos[r]]
                lines.append(f"rank {r} waits at {self.decode(c)} for {slot_text(self.lowered.dep[c])}")
        hint = (" (the orders run with non-blocking sends: a blocking send waits for its receiver; "
                "use async sends: --mode async, mode='async' in Python; or reorder)") if mode == "rendezvous" else ""
        raise ScheduleError(f"deadlock in {mode} mode{hint}: " + "; ".join(lines))


@functools.lru_cache(maxsize=8)
def _cached_simulator(profile: CostProfile, placement: Placement, m: int, backward: str) -> Simulator:
    return Simulator(profile, placement, m, backward)


def simulator_for(schedule: Schedule, profile: CostProfile) -> Simulator:
    """The (cached) `Simulator` of a schedule's configuration."""
    try:
        return _cached_simulator(profile, schedule.placement, schedule.m, schedule.backward)
    except ProfileError as exc:
        raise ProfileError(f"{exc} (schedule {schedule.name!r}: p={schedule.p}, v={schedule.v})") from None


def simulate(schedule: Schedule, profile: CostProfile | None = None, mode: str = "async",
             timeline: bool = True, check: bool = True) -> SimResult:
    """Simulate `schedule` under `profile` (unit costs when None). Raises `ScheduleError`
    for an invalid schedule or a deadlock, `ProfileError` for a profile that does not fit."""
    if mode not in MODES:
        raise ScheduleError(f"unknown simulation mode {mode!r}; use one of {', '.join(MODES)}")
    if profile is None:
        profile = CostProfile.uniform(schedule.placement.stages_per_pipeline)
    sim = simulator_for(schedule, profile)
    try:
        return sim.run(schedule.ranks, mode=mode, timeline=timeline, check=check, name=schedule.name, v=schedule.v)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, v={schedule.v}): "
                            f"{exc}") from None


def unit_profile(schedule: Schedule) -> CostProfile:
    """Unit costs for `schedule`: F = I = W = 1 (B = 2), 1 MB per activation, no latency."""
    return CostProfile.uniform(schedule.placement.stages_per_pipeline, source="<unit costs>")
