"""The lowered form of a configuration: what depends on what, built once, read everywhere.

An action is an integer *code* in the model, the search and the validator::

    code = (op index * S + stage) * m + microbatch     op index: F = 0, B = 1, I = 2, W = 3

(`koala_ds.core.ir.OpIndex`, S the number of virtual stages). A rank's sequence of codes is its
*order*; one order per rank are the *orders* of a schedule.

`Lowered(placement, m, backward, costs, latency)` holds, per code: its duration, its memory delta,
its rank, and its data dependencies, each with whether it crosses ranks. This module needs no
cost model: `costs` are any per-stage records with the fields of `koala_ds.sim.StageCost` (the
model's `koala_ds.sim.timing.costed` builds them from a profile). Dependencies between stages
go through *slots*: slot `stage * m + mb` holds the output of the forward F(stage, mb) for the
next stage, slot `S * m + stage * m + mb` the input gradient that I(stage, mb) or B(stage, mb)
sends to the previous stage. Each code waits for at most one slot (`dep`) and fills at most one
(`out`): F(s) needs F(prev(s)); I/B(s) needs F(s) (same rank) and the input gradient of
next(s); W(s) needs I(s) (same rank). Dependencies within a rank are kept by the rank's order,
so only the slots are timed. Without costs every action lasts 1 and an activation counts 1
(F +1, I/B -1, W 0): the validator's unit-time dry run. A stage's `switch` cost (the profile's,
0 by default) is added to an action whose rank's previous action was of another stage: the one
duration that depends on the order and not on the code alone (`durations`).

`run_async` is the one timing loop (the simulator, the validator's dry run and the search run
it). Blocking sends (the simulator's rendezvous mode) run through it too, as two steps added
per message between ranks (`rendezvous_steps`): no second loop to keep in step with the first.

`inputs_of(op, stage)` gives the same dependencies per group (op, stage), local ones included,
for the models that reason per group (the bound, the exact solver); there the input gradient
comes from the configuration's backward kind (I with split backward, B with full).
"""
from __future__ import annotations

import functools
from itertools import chain, compress
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from .ir import OP_INDEX, OPS, Action, OpIndex, Placement, Schedule, ScheduleError


class StageCosts(Protocol):
    """What one virtual stage costs per microbatch (ms, MB): `koala_ds.sim.StageCost` is one."""

    forward: float
    backward_input: float
    backward_weight: float
    activation_mb: float
    w_hold_mb: float
    switch: float

    @property
    def backward(self) -> float: ...

#: The op indices as plain ints, for the loops that compare them often (an IntEnum compares slower).
F, B, I, W = (int(k) for k in (OpIndex.F, OpIndex.B, OpIndex.I, OpIndex.W))  # noqa: E741
BACKWARDS = ("full", "split")


def action_code(op: int, stage: int, microbatch: int, num_stages: int, m: int) -> int:
    """The integer code of (op index, stage, microbatch)."""
    return (op * num_stages + stage) * m + microbatch


def split_code(code: int, num_stages: int, m: int) -> tuple[int, int, int]:
    """(op index, stage, microbatch) of an integer code (the inverse of `action_code`)."""
    rest, mb = divmod(int(code), m)
    op, stage = divmod(rest, num_stages)
    return op, stage, mb


class Input(NamedTuple):
    """A data dependency of a group (op, stage): the action of the same microbatch it needs."""

    op: int        # the producer's op index
    stage: int
    cross: bool    # the producer runs on another rank: its output arrives `latency` later


class Stall(NamedTuple):
    """Where orders deadlock (async timing): the position each rank stopped at, and when each
    slot's data arrived at its consumer (-1 for slots never filled)."""

    pos: list[int]
    avail: list[float]


class Steps(NamedTuple):
    """The per-code tables a timing run reads (`Lowered.run_async`): the lowered codes' own, or
    with the steps of blocking sends added (`Lowered.rendezvous_steps`)."""

    dur: list[float]
    dep: list[int]
    out: list[int]
    out_lat: list[float]
    nslots: int
    code_stage: list[int]                 # per code, its stage; -1 for a step that is no action
    switch: list[float] | None            # per stage, its switch cost; None where every one is 0


class _Unit(NamedTuple):
    """Stage costs without a profile: every action lasts 1, an activation counts 1."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    backward: float = 1.0
    activation_mb: float = 1.0
    w_hold_mb: float = 0.0
    switch: float = 0.0


class Lowered:
    """One configuration (placement, m, backward kind; per-stage costs and the p2p latency, unit
    times without them) lowered to per-code tables.

    Lists (not arrays) where the timing loops read one element at a time; numpy arrays where
    whole orders are gathered at once (`mem`, `rank_of`, `dur_np`)."""

    def __init__(self, placement: Placement, m: int, backward: str = "full",
                 costs: Sequence[StageCosts] | None = None, latency: float = 0.0) -> None:
        if backward not in BACKWARDS:
            raise ScheduleError(f"backward must be 'full' or 'split', got {backward!r}")
        if m < 1:
            raise ScheduleError(f"m must be >= 1, got m={m}")
        self.placement, self.m, self.backward = placement, m, backward
        self.split = backward == "split"
        self.p = placement.p
        self.v = placement.v   # chunks per rank and pipeline
        S = self.num_stages = placement.num_stages
        self.ncodes, self.nslots = 4 * S * m, 2 * S * m
        if costs is not None and len(costs) != S:
            raise ScheduleError(f"got costs of {len(costs)} stages for a placement of {S} virtual stages")
        self.costs: Sequence[StageCosts] = (_Unit(),) * S if costs is None else tuple(costs)
        self.latency = float(latency)
        #: per stage, its previous and next stage in pipeline order (None at the ends)
        self.prev = [placement.prev_stage(s) for s in range(S)]
        self.next = [placement.next_stage(s) for s in range(S)]
        self._tables()

    def _tables(self) -> None:
        """The per-code lists, in code order ((op, stage, microbatch) arrays flattened). Lists of
        Python numbers for the timing loops, built from arrays so that each list's numbers lie
        together in memory (the large timing runs are ~10% faster than with numbers made one by
        one); durations and latencies share one number object per value."""
        S, m, lat = self.num_stages, self.m, self.latency
        ranks = np.asarray(self.placement.stage_ranks, dtype=np.int64)
        prev = np.array([-1 if x is None else x for x in self.prev], dtype=np.int64)
        nxt = np.array([-1 if x is None else x for x in self.next], dtype=np.int64)
        up, down, stage, mb = prev >= 0, nxt >= 0, np.arange(S), np.arange(m)
        dep, out, out_rank = (np.full((4, S, m), -1, dtype=np.int64) for _ in range(3))
        dep_cross, out_cross = np.zeros((4, S, m), dtype=bool), np.zeros((4, S, m), dtype=bool)
        dep[F][up] = prev[up, None] * m + mb                 # F waits for the forward of the previous stage
        dep_cross[F][up] = (ranks[prev[up]] != ranks[up])[:, None]
        out[F][down] = stage[down, None] * m + mb            # ... and sends its own to the next stage
        out_cross[F][down] = (ranks[nxt[down]] != ranks[down])[:, None]
        out_rank[F][down] = ranks[nxt[down], None]
        for k in (B, I):
            dep[k][down] = S * m + nxt[down, None] * m + mb  # B/I wait for the next stage's input gradient
            dep_cross[k][down] = (ranks[nxt[down]] != ranks[down])[:, None]
            out[k][up] = S * m + stage[up, None] * m + mb    # ... and send theirs to the previous stage
            out_cross[k][up] = (ranks[prev[up]] != ranks[up])[:, None]
            out_rank[k][up] = ranks[prev[up], None]
        self.dep, self.out, self.out_rank = dep.ravel().tolist(), out.ravel().tolist(), out_rank.ravel().tolist()
        self.dep_cross, self.out_cross = dep_cross.ravel().tolist(), out_cross.ravel().tolist()
        self.dep_lat = [lat if x else 0.0 for x in self.dep_cross]   # latency on the dependency
        self.out_lat = [lat if x else 0.0 for x in self.out_cross]
        per_group = [(c.forward, c.backward, c.backward_input, c.backward_weight) for c in self.costs]
        self.dur = [x for k in range(4) for s in range(S) for x in [per_group[s][k]] * m]
        self.dur_np = np.asarray(self.dur)
        deltas = [(c.activation_mb, -c.activation_mb, -(c.activation_mb - c.w_hold_mb), -c.w_hold_mb)
                  for c in self.costs]
        switch = [float(c.switch) for c in self.costs]
        #: per stage its switch cost, None where every stage's is 0 (the timing loop skips the term)
        self.switch: list[float] | None = switch if any(switch) else None
        self.code_stage: list[int] = np.tile(np.repeat(np.arange(S), m), 4).tolist()
        self.mem = np.repeat(np.array([[deltas[s][k] for s in range(S)] for k in range(4)]).ravel(), m)
        self.rank_of = np.tile(np.repeat(ranks, m), 4)
        self.passes = np.zeros((S, m), dtype=bool)
        for s in range(S):
            self.passes[s, list(self.placement.microbatches_of(s, m))] = True

    # -- codes --------------------------------------------------------------------------
    def code(self, action: Action) -> int:
        if action.stage >= self.num_stages or action.microbatch >= self.m:
            raise ScheduleError(f"{action}: out of range for {self.num_stages} stages and m={self.m}")
        return (OP_INDEX[action.op] * self.num_stages + action.stage) * self.m + action.microbatch

    def decode(self, code: int) -> Action:
        op, stage, mb = split_code(code, self.num_stages, self.m)
        return Action(OPS[op], stage, mb)

    def encode(self, orders: Sequence[Sequence[Action | int]]) -> list[list[int]]:
        """Per-rank lists of codes (integers pass through, checked to be in range)."""
        if len(orders) != self.p:
            raise ScheduleError(f"got {len(orders)} rank orders for a placement of p={self.p} ranks")
        S, m, n = self.num_stages, self.m, self.ncodes
        out: list[list[int]] = []
        for order in orders:
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

    def slot_text(self, slot: int, gradient_op: dict[int, str] | None = None) -> str:
        """The action that fills `slot`, as text (`gradient_op`: stage * m + mb -> "I" or "B" where
        known; else B/I)."""
        grad, rest = divmod(slot, self.num_stages * self.m)
        s, mb = divmod(rest, self.m)
        if not grad:
            return f"{s}F{mb}"
        return f"{s}{(gradient_op or {}).get(rest, 'B/I')}{mb}"

    # -- dependencies per group ---------------------------------------------------------
    @property
    def gradient_op(self) -> int:
        """The op that passes the input gradient on in this backward kind: I (split) or B (full)."""
        return I if self.split else B

    def inputs_of(self, op: int, stage: int) -> tuple[Input, ...]:
        """The data dependencies of the group (op, stage), local ones included (module docstring)."""
        ranks = self.placement.stage_ranks
        if op == F:
            prev = self.prev[stage]
            return () if prev is None else (Input(F, prev, ranks[prev] != ranks[stage]),)
        if op == W:
            return (Input(I, stage, False),)
        nxt = self.next[stage]
        local = Input(F, stage, False)
        return (local,) if nxt is None else (local, Input(self.gradient_op, nxt, ranks[nxt] != ranks[stage]))

    def hop(self, a: int, b: int) -> float:
        """The latency between stages a and b (0 on one rank)."""
        ranks = self.placement.stage_ranks
        return self.latency if ranks[a] != ranks[b] else 0.0

    # -- timing -------------------------------------------------------------------------
    def durations(self, order: Sequence[int]) -> list[float]:
        """Per position of one rank's order, how long its action runs: its code's duration, plus
        its stage's switch cost where the previous action was of another stage."""
        dur = self.dur
        if self.switch is None:
            return [dur[c] for c in order]
        stage, sw = self.code_stage, self.switch
        return [dur[c] + (sw[stage[c]] if i and stage[c] != stage[order[i - 1]] else 0.0)
                for i, c in enumerate(order)]

    def run_async(self, codes: Sequence[Sequence[int]], record: bool, steps: Steps | None = None
                  ) -> tuple[list[float], list[list[float]], list[int], list[float]]:
        """Time orders with non-blocking sends: (finish of each rank, start of each action per
        rank if `record`, how far each rank got, when each slot arrived). Unchecked: the
        caller makes sure the orders are complete and locally ordered. `steps`: other tables
        (`run_rendezvous`)."""
        # Each rank runs until its next action waits for a slot no one has filled yet; it then
        # registers as that slot's (only) waiter and is pushed back when the slot is filled.
        # The one event loop of the package: keep it lean (the search's inner loop runs it).
        low = self if steps is None else steps
        dur, dep, out, olat = low.dur, low.dep, low.out, low.out_lat
        sw, stage = low.switch, low.code_stage
        p = len(codes)
        avail = [-1.0] * low.nslots  # when the slot's data is at its consumer's rank
        waiter = [-1] * low.nslots
        pos = [0] * p
        free = [0.0] * p
        lasts = [-1] * p  # the stage of each rank's last action so far (switch costs)
        starts: list[list[float]] = [[] for _ in range(p)]
        stack = list(range(p - 1, -1, -1))
        pop, push = stack.pop, stack.append
        while stack:
            r = pop()
            order = codes[r]
            n = len(order)
            i = pos[r]
            t = free[r]
            last = lasts[r]
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
                if sw is not None:
                    s = stage[c]
                    if s != last and s >= 0:  # a step that is no action (-1) keeps the last stage
                        if last >= 0:
                            t += sw[s]
                        last = s
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
            lasts[r] = last
        return free, starts, pos, avail

    @functools.cached_property
    def rendezvous_steps(self) -> Steps:
        """The tables with blocking sends (codes and slots past the lowered ones). The message in
        slot k, from X on rank A to Y on rank B != A, becomes two more steps: B's *post* of the
        receive (code ncodes + nslots + k), just before Y: it takes no time and fills slot
        nslots + k as B reaches Y; A's *send* (code ncodes + k), just after X: it waits for that
        post, lasts `latency` and fills slot k. So A is free again, and Y's input is there, at
        max(end of X, B reaches Y) + latency: the rule of koala_ds.sim.simulator."""
        n, k = self.ncodes, self.nslots
        out = [-1 if cross else o for o, cross in zip(self.out, self.out_cross)]
        return Steps(self.dur + [self.latency] * k + [0.0] * k, self.dep + list(range(k, 2 * k)) + [-1] * k,
                     out + list(range(2 * k)), [0.0] * (n + 2 * k), 2 * k, self.code_stage + [-1] * (2 * k),
                     self.switch)

    @functools.cached_property
    def _with_steps(self) -> tuple[list[tuple[int, ...]], list[bool]]:
        """Per code, the steps it runs as with blocking sends (post, the code, send); per step
        code of `rendezvous_steps`, whether it is an action (not a post or a send)."""
        n, k = self.ncodes, self.nslots
        expand = [(n + k + d,) * x + (c,) + (n + o,) * y for c, d, x, o, y in
                  zip(range(n), self.dep, self.dep_cross, self.out, self.out_cross)]
        return expand, [True] * n + [False] * (2 * k)

    def run_rendezvous(self, codes: Sequence[Sequence[int]], record: bool
                       ) -> tuple[list[float], list[list[float]], list[int], list[int]]:
        """Time orders with blocking sends (`rendezvous_steps`): (finish of each rank, start of
        each action per rank if `record`, how far each rank got, the slot each rank is blocked
        sending or -1). Unchecked, as `run_async`."""
        n, k = self.ncodes, self.nslots
        expand, is_action = self._with_steps
        orders = [list(chain.from_iterable(map(expand.__getitem__, order))) for order in codes]
        free, starts, pos, _ = self.run_async(orders, record, self.rendezvous_steps)
        sending = [-1] * self.p
        for r, (steps, j) in enumerate(zip(orders, pos)):
            if record:
                starts[r] = list(compress(starts[r], map(is_action.__getitem__, steps)))
            if j < len(steps):  # stalled: count the actions done (a blocked send's action too)
                sending[r] = steps[j] - n if n <= steps[j] < n + k else -1
                pos[r] = sum(1 for c in steps[:j] if c < n)
            else:
                pos[r] = len(codes[r])
        return free, starts, pos, sending

    def try_times(self, codes: Sequence[Sequence[int]], record: bool = True
                  ) -> tuple[list[float], list[list[float]]] | Stall:
        """(finish of each rank, start of each action per rank), or where the orders stall."""
        free, starts, pos, avail = self.run_async(codes, record)
        if any(pos[r] < len(codes[r]) for r in range(self.p)):
            return Stall(pos, avail)
        return free, starts

    def peaks(self, codes: Sequence[Sequence[int]]) -> tuple[float, ...]:
        """Peak memory of each rank's order (the prefix sums of the memory deltas; at least 0)."""
        mem = self.mem
        return tuple(max(0.0, float(np.cumsum(mem[np.asarray(order, dtype=np.int64)]).max())) if len(order)
                     else 0.0 for order in codes)


def lower(schedule: Schedule) -> tuple[Lowered, list[list[int]]]:
    """The lowered configuration of `schedule` (unit costs) and its orders as codes; with a
    profile's costs: `koala_ds.sim.timing.lower`."""
    lowered = Lowered(schedule.placement, schedule.m, schedule.backward)
    return lowered, lowered.encode(schedule.ranks)
