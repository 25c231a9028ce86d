"""A provably valid lower bound on the makespan of any schedule for a configuration.

The derivation is in docs/lower_bound.md. In short, for every valid schedule (in either
communication mode) the makespan T satisfies each of:

- work:       T >= W_r, the compute time of rank r;
- fill/drain: T >= head_r + W_r + tail_r (the first action of rank r is a forward that cannot
              start before the forward chain reaches one of its stages; with full backward, the
              last is a B whose gradient must still flow down to the first stage), and two
              variants that bound the forward work and the backward work of rank r alone;
- chain:      T >= the dependency chain of one microbatch (forward through every stage, backward
              back, with p2p latency on every hop between ranks);
- backward:   with full backward every backward is a B (the stage's `backward`). A split schedule
              may still run a B for some microbatches (dualpipe-v does), so its bounds take, per
              stage, the cheaper of the two: the step that passes the gradient on lasts at least
              min(I, B), and a microbatch's whole backward at least min(I + W, B)
              (`backward_durations`). Without the profile field B = I + W and these are I and
              I + W.
- memory:     with a memory limit M_r, the activations that rank r holds at once are capped; each
              stays held at least a round trip R(s), which forces waiting (an area bound and an
              interval-packing bound).

Each component bounds the pipeline's span (the end of the last action); the profile's
`step_overhead` (its placement's, `CostProfile.step_overhead_of`) comes after it on every rank
(koala_ds.sim.simulator), so the bound's value is the largest component plus that.
(`action_overhead` is in the stage times already.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..core.ir import Placement, Schedule, ScheduleError
from .profile import CostProfile, ProfileError, StageCost
from .simulator import MEMORY_RTOL


@dataclass(frozen=True)
class LowerBound:
    """The bound and its components (ms). `value` = max of all components + `step_overhead`."""

    value: float
    work: tuple[float, ...]        # per rank: total compute time
    fill_drain: tuple[float, ...]  # per rank: the best of the fill/drain bounds
    chain: float                   # one microbatch's dependency chain
    memory: tuple[float, ...] | None  # per rank: memory term (None: no limit given)
    binding: str                   # which component gives `value`: work | fill_drain | chain | memory
    feasible: bool = True          # False when some activation cannot fit the memory limit at all
    reason: str | None = None      # why it is infeasible
    step_overhead: float = 0.0     # the profile's per-step overhead, after the pipeline's span

    def to_dict(self) -> dict:
        return {"value": self.value, "binding": self.binding, "work": list(self.work),
                "fill_drain": list(self.fill_drain), "chain": self.chain,
                "memory": None if self.memory is None else list(self.memory),
                "feasible": self.feasible, "reason": self.reason, "step_overhead": self.step_overhead}


def backward_durations(costs: Sequence[StageCost], backward: str) -> tuple[list[float], list[float]]:
    """Per stage, (the least time of the step that passes the input gradient on, the least time of
    the rest of that microbatch's backward on the stage), valid for every schedule of the mode.

    full: (B, 0). split: (min(I, B), min(I + W, B) - min(I, B)): a microbatch runs either I then
    W (I >= the first, W >= the second) or one B (B >= their sum), so the two parts bound both
    from below; with B >= I + W (and without the profile's `backward`) they are I and W."""
    if backward == "full":
        return [c.backward for c in costs], [0.0] * len(costs)
    first = [min(c.backward_input, c.backward) for c in costs]
    return first, [min(c.split_backward, c.backward) - f for c, f in zip(costs, first)]


def _limits(memory_limit: float | Sequence[float] | None, p: int) -> list[float | None]:
    if memory_limit is None:
        return [None] * p
    if isinstance(memory_limit, (int, float)):
        return [float(memory_limit)] * p
    limits = [None if x is None else float(x) for x in memory_limit]
    if len(limits) != p:
        raise ProfileError(f"memory_limit lists {len(limits)} ranks but p={p}")
    return limits


def lower_bound(profile: CostProfile, p: int, m: int, v: int = 1, placement: Placement | str = "linear",
                backward: str = "full", memory_limit: float | Sequence[float] | None = None) -> LowerBound:
    """A lower bound on the makespan of every valid schedule of this configuration.

    `placement` is a `Placement` or a style name (linear, interleaved, vshape, bidirectional).
    `memory_limit` (MB, one number or one per rank) adds the memory term; pass
    `profile.memory_limit_mb` to bound the schedules that fit the profile's limit. The bound
    holds for schedules that fit the limit; schedules that do not fit may be faster."""
    if isinstance(placement, str):
        placement = Placement.named(placement, p, v)
    if placement.p != p:
        raise ScheduleError(f"placement has {placement.p} ranks but p={p}")
    if backward not in ("full", "split"):
        raise ScheduleError(f"backward must be 'full' or 'split', got {backward!r}")
    if m < 1:
        raise ScheduleError(f"m must be >= 1, got m={m}")
    S = placement.num_stages
    costs = profile.stage_costs(S, placement.pipelines, what=f"placement {placement.describe()}")
    # The shortest time of the step that passes the input gradient on (I or B), and of the rest of
    # the microbatch's backward on that stage (W after an I; 0 with full backward).
    bwd, rest = backward_durations(costs, backward)
    chains = _Chains.of(placement, costs, profile.p2p_latency, bwd, rest)
    n = [len(placement.microbatches_of(s, m)) for s in range(S)]
    limits = _limits(memory_limit, p)
    work, fill, memory = [], [], []
    feasible, reason = True, None
    for r in range(p):
        stages = [s for s in placement.stages_of(r) if n[s] > 0]
        if not stages:
            work.append(0.0)
            fill.append(0.0)
            memory.append(0.0)
            continue
        w_r, f_r = _work_and_fill(chains, costs, n, stages, backward == "split")
        work.append(w_r)
        fill.append(f_r)
        term, why = _memory_term(chains, costs, n, stages, r, limits[r])
        if why is not None:
            feasible, reason = False, why
        memory.append(term)
    chain = 0.0
    for k in range(placement.pipelines):
        first = k * placement.stages_per_pipeline
        if n[first] > 0:
            chain = max(chain, chains.rtt[first] + rest[first])
    parts = {"work": max(work), "fill_drain": max(fill), "chain": chain}
    if memory_limit is not None:
        parts["memory"] = max(memory)
    binding = max(parts, key=lambda k: parts[k])
    step = profile.step_overhead_of(placement.style)
    return LowerBound(parts[binding] + step, tuple(work), tuple(fill), chain,
                      tuple(memory) if memory_limit is not None else None, binding, feasible, reason, step)


@dataclass(frozen=True)
class _Chains:
    """Per stage s: head, the earliest start of any forward of s; rtt, the shortest time from the
    start of F(s, mb) to the end of its I/B; tail, the shortest time from the end of I/B(s, mb)
    until that microbatch's last action (the first stage's weight gradient) ends."""

    head: list[float]
    rtt: list[float]
    tail: list[float]
    bwd: list[float]
    rest: list[float]

    @classmethod
    def of(cls, placement: Placement, costs: Sequence[StageCost], lat: float, bwd: list[float],
           rest: list[float]) -> "_Chains":
        S, rank = placement.num_stages, placement.stage_ranks

        def hop(a: int, b: int) -> float:
            return lat if rank[a] != rank[b] else 0.0

        head, rtt, tail = [0.0] * S, [0.0] * S, [0.0] * S
        for s in range(S):
            prev = placement.prev_stage(s)
            if prev is not None:
                head[s] = head[prev] + costs[prev].forward + hop(prev, s)
        for s in reversed(range(S)):
            nxt = placement.next_stage(s)
            inner = 0.0 if nxt is None else hop(s, nxt) + rtt[nxt] + hop(nxt, s)
            rtt[s] = costs[s].forward + inner + bwd[s]
        for s in range(S):
            prev = placement.prev_stage(s)
            if prev is None:
                continue  # 0: with full backward B includes the weight gradient; split: a B may end it
            tail[s] = hop(s, prev) + bwd[prev] + tail[prev]
            if placement.prev_stage(prev) is None:
                tail[s] += rest[prev]  # the first stage still runs W (or the rest of B)
        return cls(head, rtt, tail, bwd, rest)


def _work_and_fill(ch: _Chains, costs: Sequence[StageCost], n: list[int], stages: list[int],
                   split: bool) -> tuple[float, float]:
    """The work term and the best fill/drain term of one rank (module docstring)."""
    fwd_work = sum(n[s] * costs[s].forward for s in stages)
    bwd_work = sum(n[s] * (ch.bwd[s] + ch.rest[s]) for s in stages)
    w_r = fwd_work + bwd_work
    h_r = min(ch.head[s] for s in stages)
    t_r = 0.0 if split else min(ch.tail[s] for s in stages)
    first_bwd = min(ch.head[s] + ch.rtt[s] - ch.bwd[s] for s in stages)
    after_fwd = min(ch.rtt[s] - costs[s].forward + ch.tail[s] for s in stages)
    return w_r, max(h_r + w_r + t_r, first_bwd + bwd_work + t_r, h_r + fwd_work + after_fwd)


def _memory_term(ch: _Chains, costs: Sequence[StageCost], n: list[int], stages: list[int], r: int,
                 limit: float | None) -> tuple[float, str | None]:
    """The memory term of one rank, and why no schedule fits (None when one may)."""
    if limit is None:
        return 0.0, None
    too_big = [s for s in stages if costs[s].activation_mb > limit * (1 + MEMORY_RTOL) + MEMORY_RTOL]
    if too_big:
        s = too_big[0]
        return math.inf, (f"stage {s} needs {costs[s].activation_mb} MB for one activation but rank {r} "
                          f"has a limit of {limit} MB")
    h_r = min(ch.head[s] for s in stages)
    min_tail = min(ch.tail[s] for s in stages)
    term = 0.0
    if limit > 0:
        # time-weighted share of the limit (divide first: stays exact for tiny sizes)
        area = sum(n[s] * (costs[s].activation_mb / limit) * ch.rtt[s] for s in stages)
        term = h_r + area + min_tail
    smallest = min(costs[s].activation_mb for s in stages)
    jobs = sum(n[s] for s in stages)
    ratio = limit * (1 + MEMORY_RTOL) / smallest + MEMORY_RTOL if smallest > 0 else math.inf
    if ratio < jobs:  # at most `at_once` activations fit at the same time
        at_once = max(1, math.floor(ratio))
        term = max(term, h_r + math.ceil(jobs / at_once) * min(ch.rtt[s] for s in stages) + min_tail)
    return term, None


def lower_bound_for(schedule: Schedule, profile: CostProfile,
                    memory_limit: float | Sequence[float] | None = None) -> LowerBound:
    """The lower bound of `schedule`'s configuration (its placement, p, m, v and backward mode)."""
    return lower_bound(profile, schedule.p, schedule.m, schedule.v, schedule.placement, schedule.backward,
                       memory_limit)
