"""A second provable lower bound for the search: release times, tails and a per-rank
one-machine relaxation (Jackson's preemptive schedule), with a memory term.

The proof is in docs/search.md ("A tighter bound"). In short, for one placement:

1. Order statistics of start times. For a group g = (op, stage), let R_g[k] bound from below
   the k-th smallest start time (k = 0, 1, ...) of the group's actions, over all valid
   schedules. Valid recurrences (microbatches are interchangeable, and a pointwise bound on
   a multiset bounds its order statistics):
   - the actions of one group run on one rank, one at a time: R_g[k] >= R_g[k-1] + d_g;
   - F(s) needs F(prev) plus the hop: R_F(s)[k] >= R_F(prev)[k] + d_F(prev) + hop;
   - I/B(s) needs F(s) and I/B(next): R_I(s)[k] >= max(R_F(s)[k] + d_F(s),
     R_I(next)[k] + d_I(next) + hop); W(s) needs I(s): R_W(s)[k] >= R_I(s)[k] + d_I(s);
   - memory: when the k-th F(s) starts, rank r holds activation_mb(s) for each F(s) begun
     (k + 1 with this one) whose I/B(s) has not run yet, and every other term of its level is
     non-negative; so at least k + 1 - c of the I/B(s) ran before it, c = floor(limit_r /
     activation_mb(s)), and R_F(s)[k] >= R_I(s)[k - c] + d_I(s). Across the stages of a rank:
     if an earlier stage a of the same pipeline is on the same rank, the k-th F(s) comes
     after k + 1 F(a) there, and the level after it is at least activation_mb(s) +
     activation_mb(a) * (k + 1 - #I(a) so far); so R_F(s)[k] >= R_I(a)[k - c'] + d_I(a), with
     c' = floor((limit_r - activation_mb(s)) / activation_mb(a)). And since I(a) of a
     microbatch follows its I(s) on that rank, #I(a) <= #I(s) at any point: the level is at
     least (activation_mb(s) + the sum of those activation_mb(a)) * (k + 1 - #I(s)), so c
     can be taken as floor(limit_r / that sum).
2. Tails: q_g, the least time from the end of any action of group g to the end of the
   schedule (its chain of successors: the forward chain to the last stage, the backward
   chain to the first, the W after each I).
3. Each rank runs its actions one at a time. Give the k-th group-g action to start the
   release R_g[k]; the schedule restricted to the rank is a non-preemptive schedule of these
   jobs that respects the releases, and T >= C_j + q_j for every job j. So T is at least the
   optimum of the preemptive one-machine problem with releases and tails, which Jackson's
   preemptive schedule (always run the released job with the largest tail) attains.
4. Memory also caps the run-ahead of a rank's forwards: until t0, the least release of its
   I/B jobs, the rank can run only forwards, and only as much forward work as fits in its
   limit (a bounded knapsack over its stages, exact); so T >= t0 + (all its work) - min(t0 - r0,
   that), r0 the least release of its jobs.
5. T above is the end of the pipeline's last action; the profile's `step_overhead` (the
   placement's own where it gives one) follows it on every rank (koala_ds.sim.simulator), so
   each rank's bound gets it added.

Durations: F takes `forward`; with full backward I/B is a B (the stage's `backward`) and W is
absent. With split backward a schedule may still run a full B for some microbatches; the bound
treats each B as two jobs, its first min(I, B) (group I/B) and the rest up to min(I + W, B)
(group W), which lie inside the B's interval, and every step above holds with these durations
(`koala_ds.sim.lower_bound.backward_durations`; they are I and W when B >= I + W).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from ..core.ir import Placement
from ..core.lowered import F, W, Lowered
from ..sim.timing import costed
from ..sim import CostProfile
from ..sim.lower_bound import backward_durations
from ..sim.simulator import MEMORY_RTOL


_KNAPSACK_ENUMERATION = 100_000  # count combinations the exact run-ahead knapsack may enumerate


@dataclass(frozen=True)
class JacksonBound:
    value: float
    per_rank: tuple[float, ...]


@dataclass(frozen=True)
class Releases:
    """Steps 1 and 2 of the module docstring for one placement: per stage s and k, the least
    start of the k-th F, I/B and W of s (`F[s][k]`, `I[s][k]`, `W[s][k]`; W only with split
    backward) and the least time from the end of an F or I/B of s to the end of the schedule
    (`tail_F[s]`, `tail_I[s]`; a W's is 0). Every valid schedule starts its k-th action of a
    group no earlier, and ends no earlier than an action's end plus its tail."""

    F: tuple[tuple[float, ...], ...]
    I: tuple[tuple[float, ...], ...]
    W: tuple[tuple[float, ...], ...]
    tail_F: tuple[float, ...]
    tail_I: tuple[float, ...]
    d_F: tuple[float, ...]        # the durations they were computed with (I/B: B's with full backward,
    d_I: tuple[float, ...]        # min(I, B) with split; W: 0 with full backward, min(I + W, B) - min(I, B)
                                  # with split) and the microbatches through each stage
    d_W: tuple[float, ...]
    n: tuple[int, ...]


def release_times(profile: CostProfile, placement: Placement, m: int, backward: str,
                  limits: Sequence[float | None]) -> Releases:
    """Release times and tails (steps 1-2 of the module docstring) for one placement."""
    low = costed(placement, m, backward, profile)
    # I/B: the least time of the step that passes the gradient on; W: of the rest of the backward
    # (the part of a B after it, when a split schedule runs a B; 0 with full backward)
    dF = [c.forward for c in low.costs]
    dI, dW = backward_durations(low.costs, backward)
    n = [len(placement.microbatches_of(s, m)) for s in range(low.num_stages)]
    qF, qI = _tails(low, dF, dI, dW)
    RF, RI, RW = _order_statistics(low, {F: dF, low.gradient_op: dI, W: dW}, n, limits)
    return Releases(tuple(map(tuple, RF)), tuple(map(tuple, RI)), tuple(map(tuple, RW)), tuple(qF), tuple(qI),
                    tuple(dF), tuple(dI), tuple(dW), tuple(n))


def _memory_caps(low: Lowered, limits: Sequence[float | None]) -> tuple[list[float], list[list[tuple[int, int]]]]:
    """Per stage s: c, at most c microbatches hold s's activation when an F(s) starts (step 1's
    memory term); and (s', c') for each earlier stage s' of the same pipeline on the rank of s,
    at most c' microbatches hold s' then."""
    costs, rank, S = low.costs, low.placement.stage_ranks, low.num_stages
    cap: list[float] = []
    for s in range(S):
        lim = limits[rank[s]]
        act = costs[s].activation_mb
        if lim is None or act <= 0:
            cap.append(math.inf)
        else:
            cap.append(max(1, math.floor(lim * (1 + MEMORY_RTOL) / act + MEMORY_RTOL)))
    upstream: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    for s in range(S):
        lim = limits[rank[s]]
        if lim is None:
            continue
        a = low.prev[s]
        while a is not None:
            act_a = costs[a].activation_mb
            if rank[a] == rank[s] and act_a > 0:
                room = lim * (1 + MEMORY_RTOL) - costs[s].activation_mb
                upstream[s].append((a, max(1, math.floor(room / act_a + MEMORY_RTOL))))
            a = low.prev[a]
        held = costs[s].activation_mb + sum(costs[a].activation_mb for a, _ in upstream[s])
        if held > 0:
            cap[s] = min(cap[s], max(1, math.floor(lim * (1 + MEMORY_RTOL) / held + MEMORY_RTOL)))
    return cap, upstream


def _tails(low: Lowered, dF: list[float], dI: list[float], dW: list[float]) -> tuple[list[float], list[float]]:
    """Step 2: per stage, the least time from the end of an F (of an I/B) to the end of the schedule."""
    S = low.num_stages
    qI = [0.0] * S
    for s in range(S):  # prev stages first (pipeline order)
        t = dW[s]
        p_ = low.prev[s]
        if p_ is not None:
            t = max(t, low.hop(s, p_) + dI[p_] + qI[p_])
        qI[s] = t
    qF = [0.0] * S
    for s in reversed(range(S)):
        t = dI[s] + qI[s]
        x = low.next[s]
        if x is not None:
            t = max(t, low.hop(s, x) + dF[x] + qF[x])
        qF[s] = t
    return qF, qI


def _order_statistics(low: Lowered, dur: dict[int, list[float]], n: list[int], limits: Sequence[float | None]
                      ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Step 1: the least start of the k-th F, I/B and W of each stage, k outer so that the memory
    term can look back; each group after its inputs in the lowered dependency table."""
    S, bk = low.num_stages, low.gradient_op
    cap, upstream = _memory_caps(low, limits)
    RF, RI, RW = ([[0.0] * n[s] for s in range(S)] for _ in range(3))
    R = {F: RF, bk: RI, W: RW}

    def release(op: int, s: int, k: int) -> float:
        r = R[op][s][k - 1] + dur[op][s] if k else 0.0   # one group runs one at a time
        for dep in low.inputs_of(op, s):
            r = max(r, R[dep.op][dep.stage][k] + dur[dep.op][dep.stage] + (low.latency if dep.cross else 0.0))
        return r

    fwd_order = sorted(range(S), key=lambda s: (low.placement.pipeline_of(s), s))
    dI = dur[bk]
    for k in range(max(n) if n else 0):
        for s in fwd_order:
            if k >= n[s]:
                continue
            r = release(F, s, k)
            if k - cap[s] >= 0:
                r = max(r, RI[s][k - cap[s]] + dI[s])
            for a, c in upstream[s]:
                if k - c >= 0:
                    r = max(r, RI[a][k - c] + dI[a])
            RF[s][k] = r
        for s in reversed(fwd_order):
            if k < n[s]:
                RI[s][k] = release(bk, s, k)
                if low.split:
                    RW[s][k] = release(W, s, k)
    return RF, RI, RW


def jackson_bound(profile: CostProfile, placement: Placement, m: int, backward: str,
                  limits: Sequence[float | None]) -> JacksonBound:
    """The bound of the module docstring for one placement (ms)."""
    rel = release_times(profile, placement, m, backward, limits)
    RF, RI, RW, qF, qI = rel.F, rel.I, rel.W, rel.tail_F, rel.tail_I
    dF, dI, dW, n = rel.d_F, rel.d_I, rel.d_W, rel.n
    costs = profile.stage_costs(placement.num_stages, placement.pipelines)
    split = backward == "split"
    step = profile.step_overhead_of(placement.style)
    per_rank = []
    for rr in range(placement.p):
        jobs = []
        for s in placement.stages_of(rr):
            for k in range(n[s]):
                jobs.append((RF[s][k], dF[s], qF[s]))
                jobs.append((RI[s][k], dI[s], qI[s]))
                if split:
                    jobs.append((RW[s][k], dW[s], 0.0))
        value = _jackson(jobs)
        # forward-only prefix: until the rank's first backward can start (t0) it runs only
        # forwards, and no more than fit in its memory (nothing is freed before an I/B); the
        # rest of its work comes after t0
        lim = limits[rr]
        stages = [s for s in placement.stages_of(rr) if n[s]]
        if lim is not None and stages:
            t0 = min(RI[s][0] for s in stages)
            r0 = min(RF[s][0] for s in stages)
            fits = _forward_work_that_fits([(dF[s], costs[s].activation_mb, n[s]) for s in stages], lim)
            value = max(value, t0 + sum(j[1] for j in jobs) - min(t0 - r0, fits))
        per_rank.append(value + step)  # a step ends `step_overhead` (its placement's) after its pipeline work
    return JacksonBound(max(per_rank) if per_rank else 0.0, tuple(per_rank))


def _forward_work_that_fits(forwards: list[tuple[float, float, int]], limit: float) -> float:
    """The most forward time whose activations fit in `limit` together: a bounded knapsack over
    the rank's stages (duration, activation, count), solved exactly by enumerating the counts of
    all stages but the last (a rank holds few stages); the fractional relaxation, an upper bound
    too, when that enumeration would be large."""
    room = limit * (1 + MEMORY_RTOL)
    items = [(d, act, count) for d, act, count in forwards if count > 0 and d > 0]
    if any(act <= 0 for _, act, _ in items):
        return math.inf
    if not items:
        return 0.0
    size = 1
    for _, act, count in items[:-1]:
        size *= min(count, math.floor(room / act + MEMORY_RTOL)) + 1
    if size > _KNAPSACK_ENUMERATION:
        return _fractional(items, room)

    def best(i: int, left: float) -> float:
        d, act, count = items[i]
        most = min(count, math.floor(left / act + MEMORY_RTOL))
        if i == len(items) - 1:
            return most * d
        return max(x * d + best(i + 1, left - x * act) for x in range(most + 1))

    return best(0, room)


def _fractional(items: list[tuple[float, float, int]], room: float) -> float:
    total = 0.0
    for d, act, count in sorted(items, key=lambda x: -(x[0] / x[1])):
        take = min(count, room / act)
        total += take * d
        room -= take * act
        if room <= 0:
            break
    return total


def _jackson(jobs: list[tuple[float, float, float]]) -> float:
    """Optimum of max(C_j + q_j) on one machine with releases, preemption allowed."""
    jobs.sort()
    heap: list[tuple[float, float]] = []
    t, i, best, nj = 0.0, 0, 0.0, len(jobs)
    while i < nj or heap:
        if not heap:
            t = max(t, jobs[i][0])
        while i < nj and jobs[i][0] <= t:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        negq, rem = heapq.heappop(heap)
        nxt_r = jobs[i][0] if i < nj else math.inf
        run = min(rem, nxt_r - t)
        t += run
        rem -= run
        if rem > 1e-12:
            heapq.heappush(heap, (negq, rem))
        else:
            best = max(best, t - negq)
    return best
