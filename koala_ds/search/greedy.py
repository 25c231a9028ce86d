"""Constructive seeds: a greedy list scheduler over the BTT decision tree.

This generalizes the Zero Bubble paper's greedy scheduler (Qi et al. 2024) to several chunks
per rank, any placement and a memory limit. It runs the same timed model as the simulator
(event by event); whenever a rank is free it makes the BTT choice, the next op kind and chunk
(the microbatch is implied), by a `Policy`:

- a backward (B or I) whose input gradient has arrived runs first (it is on the critical path
  and frees memory) unless the policy prefers forwards while the rank is below its cap;
- a forward runs when its input has arrived, the memory limit allows it, and, for a microbatch
  new to the rank, the rank holds fewer than `cap` microbatches and can *commit* the memory of
  all its stages for it (so that a microbatch that entered a rank can always finish there; this
  is what keeps V-shape and interleaved placements free of memory deadlocks);
- a weight-gradient step (W) fills time when nothing else can run (`w_mode` "eager"), or only
  when it ends before the next known arrival ("fit"), and always when it frees the memory
  a waiting forward needs.

`policies()` lists the tie-break variants the search tries; every one that completes is a seed.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from ..core.lowered import B, F, W, action_code
from .problem import PlacementProblem


@dataclass(frozen=True)
class Policy:
    """The tie-break rules of one greedy run. `cap` is (alpha, beta): a rank r admits a new
    microbatch only while it holds fewer than alpha * v * (p - r) + beta * v microbatches' worth
    of chunk-activations; alpha = None means memory alone limits it."""

    cap: tuple[float, float] | None = None
    depth_first: bool = True     # among ready forwards, the later chunk first
    w_mode: str = "eager"        # eager | fit
    prefer_b: bool = True        # a ready backward before a ready forward
    late_b: float = 0.0          # wait this fraction of a forward for an arriving backward
    commit: str = "all"          # all: reserve every entered microbatch's later chunks;
                                 # one: keep room for one microbatch's later chunks only

    def label(self) -> str:
        cap = "mem" if self.cap is None else f"{self.cap[0]:g}v(p-r)+{self.cap[1]:g}v"
        return (f"greedy[cap={cap},{'depth' if self.depth_first else 'breadth'},W={self.w_mode},"
                f"{'B' if self.prefer_b else 'F'}-first,wait={self.late_b:g},commit={self.commit}]")


def policies(p: int, v: int, backward: str) -> list[Policy]:
    caps: list[tuple[float, float] | None] = [None, (1, 0), (1, 1), (1, 2), (2, 0), (0, 1), (0, 2), (1.5, 0)]
    out = []
    for cap in caps:
        for depth in ((True, False) if v > 1 else (True,)):
            for w_mode in (("eager", "fit") if backward == "split" else ("eager",)):
                for prefer_b in (True, False):
                    for late in (0.0, 0.5):
                        if not prefer_b and late:
                            continue
                        out.append(Policy(cap, depth, w_mode, prefer_b, late))
    if v > 1:
        # entering microbatches keep room for one microbatch's later chunks only: the first
        # chunk of a rank may then fill memory while the later chunks' work has not arrived
        for cap in (None, (1, 1), (2, 0)):
            for depth in (True, False):
                for w_mode in (("eager", "fit") if backward == "split" else ("eager",)):
                    out.append(Policy(cap, depth, w_mode, True, 0.0, commit="one"))
    return out


def greedy_orders(part: PlacementProblem, policy: Policy) -> list[list[int]] | None:
    """Run the greedy list scheduler; every rank's order as BTT choices, or None on a deadlock."""
    run = _GreedyRun(part, policy)
    free, done, total, choose, execute = run.free, run.done, run.total, run.choose, run.execute
    heap = [(0.0, r) for r in range(run.p)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        t, r = pop(heap)
        if t < free[r] or done[r] == total[r]:
            continue
        choice, wake = choose(r, t)
        if choice is None:
            if wake < math.inf:
                push(heap, (wake, r))
            continue
        for event in execute(r, choice[0], choice[1], t):
            push(heap, event)
    if any(done[r] < total[r] for r in range(run.p)):
        return None
    return run.choices




class _GreedyRun:
    """The state of one greedy run: per rank and chunk, what ran and what is held; per slot of
    the lowered configuration, when its data arrives (-1: not yet)."""

    def __init__(self, part: PlacementProblem, policy: Policy):
        low, pl = part.sim.lowered, part.placement
        self.low, self.policy = low, policy
        p, C, S, m = pl.p, pl.chunks_per_rank, low.num_stages, low.m
        self.p, self.C = p, C
        self.limits = part.decoder.limits
        stage = [pl.stages_of(r) for r in range(p)]
        self.mbs = [[list(pl.microbatches_of(s, m)) for s in stage[r]] for r in range(p)]
        bk = low.gradient_op  # the backward that passes the gradient on: I (split) or B (full)
        # per rank and chunk: the codes of microbatch 0 (F, I/B, W)
        self.fbase = [[action_code(F, s, 0, S, m) for s in stage[r]] for r in range(p)]
        self.bbase = [[action_code(bk, s, 0, S, m) for s in stage[r]] for r in range(p)]
        self.wbase = [[action_code(W, s, 0, S, m) for s in stage[r]] for r in range(p)]
        self.bchoice = bk * C
        self.mem_delta = low.mem.tolist()
        self.act = [[self.mem_delta[f] for f in self.fbase[r]] for r in range(p)]
        # a microbatch enters rank r at its first chunk of that pipeline; it then commits the
        # memory of all the rank's stages of that pipeline
        first = [{} for _ in range(p)]
        for r in range(p):
            for c, s in enumerate(stage[r]):
                first[r].setdefault(pl.pipeline_of(s), c)
        self.entry = [[first[r][pl.pipeline_of(s)] == c for c, s in enumerate(stage[r])] for r in range(p)]
        self.commit_need = [[sum(self.act[r][cc] for cc, ss in enumerate(stage[r])
                                 if pl.pipeline_of(ss) == pl.pipeline_of(s)) for s in stage[r]] for r in range(p)]
        if policy.cap is None:
            self.cap = [math.inf] * p
        else:
            a, b = policy.cap
            self.cap = [max(1.0, a * C * (p - r) + b * C) for r in range(p)]
        self.avail = [-1.0] * low.nslots
        self.f_end = [-1.0] * (S * m)   # when F(s, mb) ended, by its code s * m + mb
        self.nF, self.nB = [[0] * C for _ in range(p)], [[0] * C for _ in range(p)]
        self.wq: list[list[list[tuple[int, float]]]] = [[[] for _ in range(C)] for _ in range(p)]  # (mb, I's end)
        self.mem, self.committed = [0.0] * p, [0.0] * p
        self.units = [0.0] * p  # chunk-activations held (cap accounting)
        self.free, self.done = [0.0] * p, [0] * p
        self.total = [sum(len(x) for x in self.mbs[r]) * (3 if low.split else 2) for r in range(p)]
        self.choices: list[list[int]] = [[] for _ in range(p)]
        self.dep, self.C_range = low.dep, range(C)
        # per rank, the lists the candidate loops read (bound once: they are updated in place)
        self.view = [(self.nB[r], self.nF[r], self.mbs[r], self.fbase[r], self.bbase[r], self.entry[r],
                      self.commit_need[r], self.act[r]) for r in range(p)]

    def choose(self, r: int, t: float) -> tuple[tuple[int, int] | None, float]:
        """(op index, chunk) to run on rank r at t, or None and when to look again (one loop over
        the chunks for the backwards, one for the forwards: the greedy's inner loop)."""
        pol, dep, avail, limit = self.policy, self.dep, self.avail, self.limits[r]
        nB, nF, mbs, fbase, bbase, entry, need, act = self.view[r]
        f_end, chunks = self.f_end, self.C_range
        b, b_key, next_b = None, None, math.inf   # the backward ready first, the next one to be ready
        for c in chunks:
            k = nB[c]
            if k >= nF[c]:
                continue
            mb = mbs[c][k]
            rd = f_end[fbase[c] + mb]
            d = dep[bbase[c] + mb]
            if d >= 0:
                if avail[d] < 0:
                    continue
                rd = max(rd, avail[d])
            if rd <= t:
                if b_key is None or (rd, -c) < b_key:
                    b, b_key = c, (rd, -c)
            elif rd < next_b:
                next_b = rd
        if b is not None and pol.prefer_b:
            return (B, b), 0.0
        mem = self.mem[r]
        held = self.committed[r] if pol.commit == "all" else mem
        full = self.units[r] + 1 > self.cap[r] + 1e-9
        f, f_key, next_f, mem_blocked = None, None, math.inf, False
        for c in chunks:
            k = nF[c]
            if k >= len(mbs[c]):
                continue
            d = dep[fbase[c] + mbs[c][k]]
            rd = 0.0 if d < 0 else avail[d]
            if rd < 0:
                continue
            if entry[c]:  # a microbatch new to the rank: commit its memory, within the cap
                if held + need[c] > limit or full:
                    mem_blocked = mem_blocked or held + need[c] > limit
                    continue
            elif mem + act[c] > limit:
                mem_blocked = True
                continue
            if rd <= t:
                key = (-c if pol.depth_first else c, rd)
                if f_key is None or key < f_key:
                    f, f_key = c, key
            elif rd < next_f:
                next_f = rd
        return self._decide(r, t, b, f, min(next_b, next_f), next_b, mem_blocked)

    def _decide(self, r: int, t: float, b: int | None, f: int | None, upcoming: float, next_b: float,
                mem_blocked: bool) -> tuple[tuple[int, int] | None, float]:
        pol, dur = self.policy, self.low.dur
        if b is not None and (pol.prefer_b or f is None):
            return (B, b), 0.0
        # optionally wait a little for an arriving backward instead of starting a forward
        if f is not None and not (pol.late_b > 0 and b is None and next_b < t + pol.late_b * dur[self.fbase[r][f]]):
            return (F, f), 0.0
        waiting = [c for c in self.C_range if self.wq[r][c]]
        if waiting:
            c = min(waiting, key=lambda cc: self.wq[r][cc][0][1])
            if pol.w_mode == "eager" or mem_blocked or upcoming >= t + dur[self.wbase[r][c]] or \
                    (f is None and upcoming == math.inf):
                return (W, c), 0.0
        return None, upcoming

    def execute(self, r: int, kind: int, c: int, t: float) -> list[tuple[float, int]]:
        """Run (kind, chunk) on rank r from t; the (time, rank) events it causes."""
        low = self.low
        nB, nF, mbs, fbase, bbase, entry, need, act = self.view[r]
        if kind == F:
            mb = mbs[c][nF[c]]
            nF[c] += 1
            code = fbase[c] + mb
            if entry[c]:
                self.committed[r] += need[c]
                self.units[r] += 1
            self.f_end[code] = end = t + low.dur[code]
        elif kind == B:
            mb = mbs[c][nB[c]]
            nB[c] += 1
            code = bbase[c] + mb
            end = t + low.dur[code]
            if low.split:
                self.wq[r][c].append((mb, end))
            else:
                self.committed[r] -= act[c]
            if entry[c]:
                self.units[r] -= 1
        else:
            mb, _ = self.wq[r][c].pop(0)
            code = self.wbase[r][c] + mb
            end = t + low.dur[code]
            self.committed[r] -= act[c]
        self.mem[r] += self.mem_delta[code]
        self.choices[r].append(c + (self.bchoice if kind == B else kind * self.C))
        self.done[r] += 1
        self.free[r] = end
        o = low.out[code]
        if o >= 0:  # the output goes to the next stage (F) or the previous one (I/B): wake its rank
            av = end + low.out_lat[code]
            self.avail[o] = av
            return [(av, low.out_rank[code]), (end, r)]
        # a last stage's forward wakes its own rank twice, as it always did (same events, same seeds)
        return [(end, r), (end, r)] if kind == F else [(end, r)]


def greedy_seeds(part: PlacementProblem, policy_list: Sequence[Policy] | None = None
                 ) -> list[tuple[Policy, list[list[int]]]]:
    """Every policy's orders (as BTT choices) that complete without a deadlock."""
    pols = policy_list if policy_list is not None else policies(part.placement.p, part.placement.chunks_per_rank,
                                                                part.sim.backward)
    out = []
    for pol in pols:
        orders = greedy_orders(part, pol)
        if orders is not None:
            out.append((pol, orders))
    return out
