"""The timed simulator: exact for the cost model, and fast enough for a search's inner loop.

Model (see also docs/lower_bound.md):
- Each rank runs its actions in its order, one at a time.
- An action starts when its rank is free and every input has arrived. The inputs are the
  data dependencies of `koala_ds.validate.cross_dependencies`: F(s) needs F(s-1); I/B(s)
  needs F(s) and the input gradient (I or B) of s+1; W(s) needs I(s). An input computed on
  another rank arrives `p2p_latency` after it is computed.
- F costs `forward`, I `backward_input`, W `backward_weight`, B the stage's `backward` (the
  profile's field when given, else I + W).
- Memory per rank: F allocates `activation_mb`, I frees `activation_mb - w_hold_mb`, W frees
  `w_hold_mb`, B frees `activation_mb`. The peak is the maximum over the rank's order (it does
  not depend on timing, because a rank runs one action at a time).

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

from ..ir import Action, Op, Placement, Schedule, ScheduleError
from .profile import CostProfile, ProfileError

log = logging.getLogger(__name__)

MODES = ("async", "rendezvous")
#: Integer code of each op: code = (op * S + stage) * m + microbatch.
OP_INDEX = {Op.F: 0, Op.B: 1, Op.I: 2, Op.W: 3}
OPS = (Op.F, Op.B, Op.I, Op.W)
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
    finish: tuple[float, ...]  # when each rank's last action (and its send) completes
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


class Stall(NamedTuple):
    """Where integer-coded orders deadlock (async mode): the position each rank stopped at, and
    when each slot's data arrived at its consumer (-1 for slots never filled)."""

    pos: list[int]
    avail: list[float]


class Simulator:
    """A compiled configuration (profile, placement, m, backward mode) that simulates orders.

    Orders are one sequence per rank, of `Action`s or of integer codes (`code()`); integer
    codes skip the conversion and are the fastest input.
    """

    def __init__(self, profile: CostProfile, placement: Placement, m: int, backward: str = "full") -> None:
        if backward not in ("full", "split"):
            raise ScheduleError(f"backward must be 'full' or 'split', got {backward!r}")
        if m < 1:
            raise ScheduleError(f"m must be >= 1, got m={m}")
        self.profile, self.placement, self.m, self.backward = profile, placement, m, backward
        S = self.num_stages = placement.num_stages
        self.p = placement.p
        costs = profile.stage_costs(S, placement.pipelines, what=f"placement {placement.describe()}")
        self.latency = lat = float(profile.p2p_latency)
        self.memory_limits = profile.memory_limits(self.p)
        n = 4 * S * m
        dur = [0.0] * n
        dep = [-1] * n   # slot this action waits for, -1 if none on another stage
        dcross = [False] * n
        out = [-1] * n   # slot this action fills for the next consumer, -1 if none
        olat = [0.0] * n
        ocross = [False] * n
        mem = np.zeros(n)
        rank_of = np.zeros(n, dtype=np.int64)
        passes = np.zeros((S, m), dtype=bool)
        ranks = placement.stage_ranks
        Sm = S * m
        for s in range(S):
            c = costs[s]
            r = ranks[s]
            prev, nxt = placement.prev_stage(s), placement.next_stage(s)
            passes[s, list(placement.microbatches_of(s, m))] = True
            rank_of[[(k * S + s) * m + mb for k in range(4) for mb in range(m)]] = r
            for mb in range(m):
                f, b, i, w = ((k * S + s) * m + mb for k in range(4))
                dur[f], dur[b], dur[i], dur[w] = c.forward, c.backward, c.backward_input, c.backward_weight
                mem[f], mem[b], mem[i], mem[w] = c.activation_mb, -c.activation_mb, \
                    -(c.activation_mb - c.w_hold_mb), -c.w_hold_mb
                if prev is not None:  # F waits for the forward of the previous stage
                    dep[f] = prev * m + mb
                    dcross[f] = ranks[prev] != r
                    out[b] = out[i] = Sm + s * m + mb  # and B/I send it the input gradient
                    ocross[b] = ocross[i] = ranks[prev] != r
                    olat[b] = olat[i] = lat if ranks[prev] != r else 0.0
                if nxt is not None:
                    out[f] = s * m + mb
                    ocross[f] = ranks[nxt] != r
                    olat[f] = lat if ranks[nxt] != r else 0.0
                    dep[b] = dep[i] = Sm + nxt * m + mb
                    dcross[b] = dcross[i] = ranks[nxt] != r
        self._dur, self._dep, self._dcross, self._out, self._olat, self._ocross = dur, dep, dcross, out, olat, ocross
        self._mem, self._rank_of, self._passes = mem, rank_of, passes
        self._nslots = 2 * Sm
        self._dur_np = np.asarray(dur)

    # -- codes --------------------------------------------------------------------------
    def code(self, action: Action) -> int:
        if action.stage >= self.num_stages or action.microbatch >= self.m:
            raise ScheduleError(f"{action}: out of range for {self.num_stages} stages and m={self.m}")
        return (OP_INDEX[action.op] * self.num_stages + action.stage) * self.m + action.microbatch

    def decode(self, code: int) -> Action:
        rest, mb = divmod(int(code), self.m)
        op, stage = divmod(rest, self.num_stages)
        return Action(OPS[op], stage, mb)

    def encode(self, ranks: Sequence[Sequence[Action | int]]) -> list[list[int]]:
        """Per-rank lists of integer codes (integers pass through)."""
        if len(ranks) != self.p:
            raise ScheduleError(f"got {len(ranks)} rank orders for a placement of p={self.p} ranks")
        S, m, n = self.num_stages, self.m, 4 * self.num_stages * self.m
        out: list[list[int]] = []
        for order in ranks:
            if isinstance(order, np.ndarray):
                order = order.tolist()
            if order and not isinstance(order[0], Action):
                codes = order if type(order) is list and type(order[0]) is int else [int(c) for c in order]
                if min(codes) < 0 or max(codes) >= n:
                    raise ScheduleError(f"action code out of range 0..{n - 1}")
                out.append(codes)
                continue
            codes = []
            for a in order:
                s, mb = a.stage, a.microbatch
                if s >= S or mb >= m:
                    raise ScheduleError(f"{a}: stage or microbatch out of range ({S} stages, m={m})")
                codes.append((OP_INDEX[a.op] * S + s) * m + mb)
            out.append(codes)
        return out

    # -- checks -------------------------------------------------------------------------
    def check(self, codes: list[list[int]]) -> None:
        """Raise `ScheduleError` unless the orders are a complete, locally ordered schedule.

        The timing loop relies on it: dependencies within a rank are taken from the order."""
        S, m = self.num_stages, self.m
        flat = np.fromiter((c for order in codes for c in order), dtype=np.int64,
                           count=sum(len(o) for o in codes))
        rank_ids = np.repeat(np.arange(self.p), [len(o) for o in codes])
        bad = np.nonzero(self._rank_of[flat] != rank_ids)[0]
        if bad.size:
            a = self.decode(flat[bad[0]])
            raise ScheduleError(f"{a} is on rank {rank_ids[bad[0]]} but stage {a.stage} lives on rank "
                                f"{self.placement.rank_of(a.stage)}")
        counts = np.bincount(flat, minlength=4 * S * m).reshape(4, S, m)
        if counts.max(initial=0) > 1:
            raise ScheduleError(f"{self.decode(int(np.argmax(counts.ravel())))} appears more than once")
        cf, cb, ci, cw = counts
        passes = self._passes
        if self.backward == "full" and ci.any() | cw.any():
            op = 2 if ci.any() else 3
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
        bwd = np.where(cb > 0, pos[1], pos[2])
        late = np.argwhere(passes & (bwd < pos[0]))
        if late.size:
            s, mb = (int(x) for x in late[0])
            op = "B" if cb[s, mb] else "I"
            raise ScheduleError(f"{s}{op}{mb} runs before its forward {s}F{mb} on rank {self.placement.rank_of(s)}")
        late = np.argwhere((ci > 0) & (pos[3] < pos[2]))
        if late.size:
            s, mb = (int(x) for x in late[0])
            raise ScheduleError(f"{s}W{mb} runs before its input-gradient step {s}I{mb} "
                                f"on rank {self.placement.rank_of(s)}")

    # -- evaluation ---------------------------------------------------------------------
    def makespan(self, ranks: Sequence[Sequence[Action | int]], mode: str = "async", check: bool = True) -> float:
        """Makespan only: the fastest call (no timeline, no memory)."""
        codes = self.encode(ranks)
        if check:
            self.check(codes)
        free, _ = self._times(codes, mode, record=False)
        return max(free)

    def peak_memory(self, ranks: Sequence[Sequence[Action | int]]) -> tuple[float, ...]:
        """Peak memory of each rank (MB); depends on the orders only, not on timing."""
        return self._peaks(self.encode(ranks))

    def fits_memory(self, peaks: Sequence[float]) -> bool:
        return all(limit is None or peak <= limit * (1 + MEMORY_RTOL) + MEMORY_RTOL
                   for peak, limit in zip(peaks, self.memory_limits))

    def run(self, ranks: Sequence[Sequence[Action | int]], mode: str = "async", timeline: bool = False,
            check: bool = True, name: str = "candidate", v: int | None = None) -> SimResult:
        """Everything: makespan, busy/idle, bubble, memory, and optionally the timeline."""
        codes = self.encode(ranks)
        if check:
            self.check(codes)
        free, starts = self._times(codes, mode, record=timeline)
        makespan = max(free)
        dur = self._dur_np
        busy = tuple(float(dur[np.asarray(o, dtype=np.int64)].sum()) if o else 0.0 for o in codes)
        idle = tuple(makespan - b for b in busy)
        bubble = (sum(idle) / (self.p * makespan)) if makespan > 0 else 0.0
        peaks = self._peaks(codes)
        events = None
        if timeline:
            d = self._dur
            as_actions = bool(ranks) and bool(ranks[0]) and isinstance(ranks[0][0], Action)
            timed: list[TimedAction] = []
            for r, (order, rank_starts) in enumerate(zip(codes, starts)):
                acts = ranks[r] if as_actions else [self.decode(c) for c in order]
                ends = [st + d[c] for c, st in zip(order, rank_starts)]
                timed.extend(map(TimedAction, repeat(r), count(), acts, rank_starts, ends))
            events = tuple(timed)
        if v is None:
            v = self.placement.chunks_per_rank // self.placement.pipelines
        return SimResult(name, mode, self.p, self.m, v, makespan, busy, idle, tuple(free), bubble, peaks,
                         self.memory_limits, self.fits_memory(peaks), events)

    def start_times(self, codes: Sequence[Sequence[int]], mode: str = "async") -> tuple[list[float], list[list[float]]]:
        """(finish time of each rank, start time of each action per rank) for integer-coded
        orders, unchecked (the search's inner loop); raises ScheduleError on a deadlock."""
        return self._times([list(c) for c in codes], mode, True)

    def _peaks(self, codes: list[list[int]]) -> tuple[float, ...]:
        mem = self._mem
        peaks = []
        for order in codes:
            if not order:
                peaks.append(0.0)
                continue
            peaks.append(max(0.0, float(np.cumsum(mem[np.asarray(order, dtype=np.int64)]).max())))
        return tuple(peaks)

    def _times(self, codes: list[list[int]], mode: str, record: bool) -> tuple[list[float], list[list[float]]]:
        if mode == "async":
            return self._run_async(codes, record)
        if mode == "rendezvous":
            return self._run_rendezvous(codes)
        raise ScheduleError(f"unknown simulation mode {mode!r}; use one of {', '.join(MODES)}")

    def try_times(self, codes: Sequence[Sequence[int]], record: bool = True
                  ) -> tuple[list[float], list[list[float]]] | Stall:
        """`start_times` for the search's inner loop: on a deadlock, where it stalled instead of an
        error (a search meets thousands of deadlocks; the error message decodes every action)."""
        free, starts, pos, avail = self._async(codes, record)
        if any(pos[r] < len(codes[r]) for r in range(self.p)):
            return Stall(pos, avail)
        return free, starts

    @property
    def inputs(self) -> list[int]:
        """Per action code, the slot (another stage's output) it waits for; -1 if none."""
        return self._dep

    def _run_async(self, codes: list[list[int]], record: bool) -> tuple[list[float], list[list[float]]]:
        free, starts, pos, _ = self._async(codes, record)
        if any(pos[r] < len(codes[r]) for r in range(self.p)):
            self._deadlock(codes, pos, [-1] * self.p, "async")
        return free, starts

    def _async(self, codes: Sequence[Sequence[int]], record: bool
               ) -> tuple[list[float], list[list[float]], list[int], list[float]]:
        # Each rank runs until its next action waits for a slot no one has filled yet; it then
        # registers as that slot's (only) waiter and is pushed back when the slot is filled.
        dur, dep, out, olat = self._dur, self._dep, self._out, self._olat
        p = self.p
        avail = [-1.0] * self._nslots  # when the slot's data is at its consumer's rank
        waiter = [-1] * self._nslots
        pos = [0] * p
        free = [0.0] * p
        starts: list[list[float]] = [[] for _ in range(p)]
        stack = list(range(p - 1, -1, -1))
        pop, push = stack.pop, stack.append
        while stack:
            r = pop()
            order = codes[r]
            n = len(order)
            i = pos[r]
            t = free[r]
            rec = starts[r].append if record else None
            while i < n:
                c = order[i]
                d = dep[c]
                if d >= 0:
                    a = avail[d]
                    if a < 0.0:
                        waiter[d] = r
                        break
                    if a > t:
                        t = a
                if rec is not None:
                    rec(t)
                t += dur[c]
                o = out[c]
                if o >= 0:
                    avail[o] = t + olat[c]
                    w = waiter[o]
                    if w >= 0:
                        push(w)
                i += 1
            pos[r] = i
            free[r] = t
        return free, starts, pos, avail

    def _run_rendezvous(self, codes: list[list[int]]) -> tuple[list[float], list[list[float]]]:
        dur, dep, out, dcross, ocross = self._dur, self._dep, self._out, self._dcross, self._ocross
        lat = self.latency
        p, ns = self.p, self._nslots
        avail = [-1.0] * ns
        waiter = [-1] * ns
        posted = [-1.0] * ns      # when the consumer posted its receive for the slot
        sender = [-1] * ns        # rank blocked in its send of the slot
        send_ready = [0.0] * ns   # when that send started
        sending = [-1] * p        # slot each rank is blocked sending, -1 if none
        pos = [0] * p
        free = [0.0] * p
        starts: list[list[float]] = [[] for _ in range(p)]
        stack = list(range(p - 1, -1, -1))
        while stack:
            r = stack.pop()
            order = codes[r]
            n = len(order)
            i = pos[r]
            t = free[r]
            blocked_in_send = False
            while i < n:
                c = order[i]
                d = dep[c]
                if d >= 0:
                    a = avail[d]
                    if a < 0.0:
                        if not dcross[c]:
                            waiter[d] = r
                            break
                        if posted[d] < 0.0:
                            posted[d] = t
                        s_rank = sender[d]
                        if s_rank < 0:
                            waiter[d] = r
                            break
                        # The producer waits in its send: the handshake happens now.
                        a = max(send_ready[d], posted[d]) + lat
                        avail[d] = a
                        sender[d] = sending[s_rank] = -1
                        free[s_rank] = a
                        stack.append(s_rank)
                    if a > t:
                        t = a
                starts[r].append(t)
                t += dur[c]
                i += 1
                o = out[c]
                if o >= 0:
                    if ocross[c]:
                        q = posted[o]
                        if q < 0.0:  # the receiver has not posted yet: block in the send
                            sender[o], send_ready[o], sending[r] = r, t, o
                            blocked_in_send = True
                            break
                        t = max(q, t) + lat
                    avail[o] = t
                    w = waiter[o]
                    if w >= 0:
                        stack.append(w)
            pos[r] = i
            if not blocked_in_send:
                free[r] = t
        if any(pos[r] < len(codes[r]) or sending[r] >= 0 for r in range(p)):
            self._deadlock(codes, pos, sending, "rendezvous")
        return free, starts

    def _deadlock(self, codes: list[list[int]], pos: list[int], sending: list[int], mode: str) -> None:
        S, m = self.num_stages, self.m
        producer: dict[int, Action] = {}
        for order in codes:
            for c in order:
                if self._out[c] >= 0:
                    producer[self._out[c]] = self.decode(c)

        def slot_text(slot: int) -> str:
            if slot in producer:
                a = producer[slot]
                return f"{a} (rank {self.placement.rank_of(a.stage)})"
            grad, rest = divmod(slot, S * m)
            s, mb = divmod(rest, m)
            return f"{s}{'B/I' if grad else 'F'}{mb}, which no rank runs"

        lines = []
        for r in range(self.p):
            if sending[r] >= 0:
                slot = sending[r]
                a = producer.get(slot)
                consumer = None
                for q in range(self.p):
                    for c in codes[q]:
                        if self._dep[c] == slot:
                            consumer = (q, self.decode(c))
                target = f"rank {consumer[0]} to post the receive for {consumer[1]}" if consumer else "a receiver"
                lines.append(f"rank {r} is blocked sending the output of {a} and waits for {target}")
            elif pos[r] < len(codes[r]):
                c = codes[r][pos[r]]
                lines.append(f"rank {r} waits at {self.decode(c)} for {slot_text(self._dep[c])}")
        hint = (" (the orders run with non-blocking sends: a blocking send waits for its receiver; "
                "use mode='async' or reorder)") if mode == "rendezvous" else ""
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
