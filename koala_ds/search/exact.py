"""The exact solver: a CP-SAT model of the same semantics as the simulator (optional extra `exact`).

Variables: one fixed-size interval per action (F, and I and W with split backward, or B with
full backward) of every (stage, microbatch). Constraints:
- data dependencies, as the simulator's: F(s) after F(s-1); I/B(s) after F(s) and after I/B(s+1);
  W(s) after I(s); `p2p_latency` is added to every dependency between different ranks;
- each rank runs one action at a time (no-overlap); its *order* is free;
- memory per rank as a cumulative (a reservoir in interval form): F adds `activation_mb` at
  its start, I removes `activation_mb - w_hold_mb` at its start, W `w_hold_mb`, B all of it;
  each part is an interval from the F's start to the freeing action's start, and their sum
  stays within the limit at all times (a rank runs one action at a time, so the level over time
  is the prefix sum over its order, which is how the simulator measures the peak; a reservoir
  constraint says the same but its expansion made presolve take minutes);
- microbatch order: every stage runs each of its ops (F, I, W or B) in microbatch order. This
  loses nothing: microbatches are interchangeable, so relabelling the actions of each
  (op, stage) by start time turns any valid schedule into one with the same intervals on every
  rank. Each dependency x(mb) >= y(mb) + d holds for every microbatch, so it holds between the
  k-th smallest x and the k-th smallest y; a rank's memory level is a count of F's, I's and W's
  started, which relabelling does not change; the makespan is the same.
- redundant bounds that help the solver prove: the k-th action of each (op, stage) starts no
  earlier than the bound's release time for it, and ends at least its tail before the end
  (koala_ds/search/bound.py, `release_times`; valid for every schedule, so for the k-th one).
Minimizing the makespan. With split backward the model uses I+W for every pair: where B >= I + W
(always, without the profile's `backward`) a full B is no better than an I followed at once by
its W, so this loses nothing; where a profile's B is less than I + W the model covers the
schedules without B (full backward is the other model, and `koala search --backward auto`
searches both).

A relaxation gives a proven lower bound where the full model does not prove one in time
(`relaxed_bound`): the same model with the one-action-at-a-time constraint kept on some ranks
only. Its optimum bounds every schedule from below. It starts with the rank of the largest
per-rank bound and adds, one at a time, the relaxed rank whose actions overlap most in the
relaxation's optimum (constraint generation); when no relaxed rank overlaps, the relaxation's
optimum is a schedule of the full model, so it is optimal.

Times are scaled to integers (the smallest power of ten that makes every duration exact, up to
10^4). The solution is turned back into a schedule by ordering each rank's actions by start
time; its simulated makespan is at most the solver's objective, and equal when optimal. The
model times the pipeline's span; the profile's `step_overhead` (the placement's own where it
gives one) is added to its objective and bounds, as the simulator adds it to every makespan.
The profile's switch costs (an action after one of another stage on its rank) are not in the
model: its objective stays a lower bound, and a solution the simulator times above it is
reported feasible, not optimal.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from ..core.ir import OP_INDEX, OPS, Action, Op, Schedule
from ..core.lowered import Lowered
from ..sim import simulate
from .bound import jackson_bound, release_times
from .problem import PlacementProblem, SearchError, SearchProblem

log = logging.getLogger(__name__)


@dataclass
class ExactResult:
    """What CP-SAT found for one placement."""

    status: str                   # optimal | feasible | unknown | infeasible
    schedule: Schedule | None
    makespan: float | None        # the simulated makespan of `schedule`
    objective: float | None       # the solver's objective (ms)
    bound: float                  # the proven lower bound (ms)
    wall_s: float
    scale: int

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"


def _scale(values: list[float], max_exponent: int = 4) -> int:
    """The smallest power of ten (up to 10**max_exponent) that makes every value an integer."""
    for k in range(max_exponent + 1):
        sc = 10 ** k
        # within 1e-6 of the value's own magnitude, not of the scaled one: at 10**5, 19.000055 is
        # 1900005.5, half a unit off, which a tolerance of 1e-6 x 1.9e6 took for exact
        if all(abs(x * sc - round(x * sc)) <= 1e-6 * max(1.0, abs(x)) for x in values):
            return sc
    return 10 ** max_exponent


def _ortools():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise SearchError("`exact` needs the CP-SAT solver from ortools: pip install 'koala-ds[exact]' "
                          "(or drop `exact`)", "exact") from None
    return cp_model


@dataclass
class _Built:
    model: object
    start: dict
    end: dict
    sc: int
    per_rank: list


@dataclass
class _Scaled:
    """The configuration in solver units: durations per (op, stage) and the latency in ticks
    (`sc` ticks per ms), memory in `msc` units per MB, and the horizon."""

    lowered: Lowered
    ops: tuple[Op, ...]            # the ops each (stage, microbatch) runs: F, I, W or F, B
    sc: int
    msc: int
    L: int
    dur: dict
    horizon: int

    def q(self, x: float) -> int:
        return round(x * self.sc)


def _scaled(problem: SearchProblem, part: PlacementProblem) -> _Scaled:
    low, pl, m = part.sim.lowered, part.placement, part.sim.m
    costs, lat = low.costs, low.latency
    durs = [lat] + [x for c in costs for x in (c.forward, c.backward_input, c.backward_weight, c.backward)]
    sc = _scale(durs)
    # from the demands alone (a limit is a capacity: floored), exact up to 10**6: a demand rounded
    # up past a limit of exactly that much made the model "infeasible" where 1F1B fits
    msc = _scale([x for c in costs for x in (c.activation_mb, c.w_hold_mb, c.activation_mb - c.w_hold_mb)], 6)
    dur = {}
    for s, c in enumerate(costs):
        for op, x in ((Op.F, c.forward), (Op.I, c.backward_input), (Op.W, c.backward_weight), (Op.B, c.backward)):
            dur[(op, s)] = round(x * sc)
    ops = (Op.F, Op.I, Op.W) if low.split else (Op.F, Op.B)
    L = round(lat * sc)
    horizon = sum(dur[(op, s)] * len(pl.microbatches_of(s, m)) for s in range(low.num_stages) for op in ops)
    return _Scaled(low, ops, sc, msc, L, dur, horizon + L * 2 * low.num_stages * m)


def _hint_starts(problem: SearchProblem, scaled: _Scaled, hint: Schedule, in_order: bool
                 ) -> tuple[dict[tuple[Op, int, int], int], int]:
    """The hint's start times in the model's ops (a B split into I and W, or I/W merged into B),
    relabelled to microbatch order when `in_order`; and the horizon the hint allows."""
    split, q, dur = scaled.lowered.split, scaled.q, scaled.dur
    res = simulate(hint, problem.search_profile, timeline=True)
    starts: dict[tuple[Op, int, int], int] = {}
    for ta in res.timeline or ():
        a = ta.action
        st = q(ta.start)
        if a.op is Op.B and split:
            starts[(Op.I, a.stage, a.microbatch)] = st
            starts[(Op.W, a.stage, a.microbatch)] = st + dur[(Op.I, a.stage)]
        elif a.op is Op.I and not split:
            starts[(Op.B, a.stage, a.microbatch)] = st
        elif a.op is Op.W and not split:
            continue
        else:
            starts[(a.op, a.stage, a.microbatch)] = st
    if in_order:  # the hint relabelled as in the module docstring, so that it is a solution
        starts = _relabel(starts, scaled.lowered.placement, scaled.lowered.m)
    return starts, min(scaled.horizon, max(q(res.makespan), max(v + dur[(k[0], k[1])] for k, v in starts.items())))


def _build(cp_model, problem: SearchProblem, part: PlacementProblem, hint: Schedule | None,
           machines: set[int] | None, in_order: bool) -> _Built:
    """The CP-SAT model of the module docstring; one-action-at-a-time only on `machines` (None:
    every rank)."""
    scaled = _scaled(problem, part)
    hint_start: dict[tuple[Op, int, int], int] = {}
    if hint is not None:
        hint_start, scaled.horizon = _hint_starts(problem, scaled, hint, in_order)
    model = cp_model.CpModel()
    built = _Built(model, {}, {}, scaled.sc, [[] for _ in range(part.placement.p)])
    _add_intervals(built, scaled, hint_start)
    _add_dependencies(built, scaled)
    held = _held_memory(built, scaled)
    for r in range(part.placement.p):
        if machines is None or r in machines:
            model.AddNoOverlap([iv for _, iv in built.per_rank[r]])
        limit = problem.limits[r]
        if limit is not None and held[r]:
            cap = math.floor(limit * scaled.msc * (1 + 1e-9) + 1e-6)
            model.AddCumulative([h[0] for h in held[r]], [h[1] for h in held[r]], cap)
    _add_microbatch_order(built, scaled, in_order)
    makespan = model.NewIntVar(0, scaled.horizon, "makespan")
    for key, e in built.end.items():
        if key[0] in (Op.W, Op.B) or (key[0] is Op.I and not scaled.lowered.split):
            model.Add(makespan >= e)
    if in_order:  # the k-th action of a group is the k-th microbatch's
        _add_releases(built, scaled, problem, makespan)
    model.Minimize(makespan)
    if hint is not None:
        model.AddHint(makespan, scaled.horizon)
    return built


def _add_intervals(built: _Built, scaled: _Scaled, hint_start: dict) -> None:
    """One fixed-size interval per action, hinted where the hint has it."""
    low, model = scaled.lowered, built.model
    for s in range(low.num_stages):
        r = low.placement.rank_of(s)
        for mb in low.placement.microbatches_of(s, low.m):
            for op in scaled.ops:
                d = scaled.dur[(op, s)]
                key = (op, s, mb)
                st = model.NewIntVar(0, scaled.horizon - d, f"s{op.value}{s}_{mb}")
                iv = model.NewFixedSizeIntervalVar(st, d, f"i{op.value}{s}_{mb}")
                built.start[key], built.end[key] = st, st + d
                built.per_rank[r].append((key, iv))
                if key in hint_start:
                    model.AddHint(st, hint_start[key])


def _add_dependencies(built: _Built, scaled: _Scaled) -> None:
    """The lowered dependency table: each action starts after its inputs end (+ the latency
    between ranks)."""
    low, start, end = scaled.lowered, built.start, built.end
    for s in range(low.num_stages):
        for mb in low.placement.microbatches_of(s, low.m):
            for op in scaled.ops:
                for dep in low.inputs_of(OP_INDEX[op], s):
                    ready = end[(OPS[dep.op], dep.stage, mb)]
                    built.model.Add(start[(op, s, mb)] >= (ready + scaled.L if dep.cross else ready))


def _held_memory(built: _Built, scaled: _Scaled) -> list[list[tuple]]:
    """Per rank, (interval, demand) of every held activation part.

    An activation is held from the start of its F to the start of its I (all but w_hold_mb) or
    of its W (w_hold_mb); B frees all of it. The level at time t is the sum of the held intervals
    covering t, the reservoir of F/I/W/B events seen up to t."""
    low, model, start = scaled.lowered, built.model, built.start
    held: list[list[tuple]] = [[] for _ in range(low.p)]
    for s in range(low.num_stages):
        r = low.placement.rank_of(s)
        c = low.costs[s]
        for mb in low.placement.microbatches_of(s, low.m):
            f = start[(Op.F, s, mb)]
            if low.split:
                parts = [(start[(Op.I, s, mb)], c.activation_mb - c.w_hold_mb), (start[(Op.W, s, mb)], c.w_hold_mb)]
            else:
                parts = [(start[(Op.B, s, mb)], c.activation_mb)]
            for k, (stop, size) in enumerate(parts):
                demand = round(size * scaled.msc)
                if demand <= 0:
                    continue
                length = model.NewIntVar(0, scaled.horizon, f"h{s}_{mb}_{k}")
                held[r].append((model.NewIntervalVar(f, length, stop, f"held{s}_{mb}_{k}"), demand))
    return held


def _add_microbatch_order(built: _Built, scaled: _Scaled, in_order: bool) -> None:
    """Microbatch order: all ops of every stage (in_order), else the first stage's forwards."""
    low = scaled.lowered
    for s in range(low.num_stages):
        mbs = list(low.placement.microbatches_of(s, low.m))
        first = low.prev[s] is None
        for op in scaled.ops:
            if in_order or (first and op is Op.F):
                for a, b in zip(mbs, mbs[1:]):
                    built.model.Add(built.start[(op, s, b)] >= built.end[(op, s, a)])


def _add_releases(built: _Built, scaled: _Scaled, problem: SearchProblem, makespan) -> None:
    """The bound's release times and tails for the k-th action of each group (module docstring)."""
    low, sc, model = scaled.lowered, scaled.sc, built.model
    bwd = OPS[low.gradient_op]
    rel = release_times(problem.search_profile, low.placement, low.m, low.backward, problem.limits)
    for s in range(low.num_stages):
        for k, mb in enumerate(low.placement.microbatches_of(s, low.m)):
            for op, r_ in ((Op.F, rel.F), (bwd, rel.I)) + (((Op.W, rel.W),) if low.split else ()):
                model.Add(built.start[(op, s, mb)] >= math.ceil(r_[s][k] * sc - 1e-6))
            model.Add(makespan >= built.end[(Op.F, s, mb)] + math.floor(rel.tail_F[s] * sc + 1e-6))
            model.Add(makespan >= built.end[(bwd, s, mb)] + math.floor(rel.tail_I[s] * sc + 1e-6))


def _relabel(starts: dict[tuple[Op, int, int], int], pl, m: int) -> dict[tuple[Op, int, int], int]:
    """Give the k-th start of every (op, stage) to its k-th microbatch (module docstring)."""
    groups: dict[tuple[Op, int], list[int]] = {}
    for (op, s, _), st in starts.items():
        groups.setdefault((op, s), []).append(st)
    out = {}
    for (op, s), times in groups.items():
        for mb, st in zip(pl.microbatches_of(s, m), sorted(times)):
            out[(op, s, mb)] = st
    return out


def _solver(cp_model, time_limit: float, workers: int, seed: int):
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_search_workers = max(1, int(workers))
    solver.parameters.random_seed = int(seed)
    return solver


def _status(cp_model, status) -> str:
    return {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(
        status, "unknown")


def _part(problem: SearchProblem, part: PlacementProblem | None, hint: Schedule | None) -> PlacementProblem:
    """The part to solve; `problem` is left as it was (a hint of a placement not searched gets a
    part of its own, not one the search would then see)."""
    if hint is not None and (hint.p, hint.m) != (problem.p, problem.m):
        raise SearchError(f"`hint` is a schedule of p={hint.p}, m={hint.m}; the problem's p={problem.p}, "
                          f"m={problem.m}", "hint")
    if part is not None:
        return part
    return problem.part_of(hint.placement, hint.backward) if hint is not None else problem.parts[0]


def solve_exact(problem: SearchProblem, part: PlacementProblem | None = None, hint: Schedule | None = None,
                time_limit: float = 30.0, workers: int = 1, seed: int = 0, in_order: bool = True) -> ExactResult:
    """Solve the configuration of `part` (default: the hint's placement, else the first) exactly.

    `in_order=False` drops the microbatch-order constraints and the release times (all but the
    first stage's forward order): the same optimum, proven more slowly; for tests of the
    relabelling argument."""
    cp_model = _ortools()
    if time_limit <= 0:
        raise SearchError(f"`time_limit` must be positive, got {time_limit} (the exact model's solver time, s)", "time_limit")
    part = _part(problem, part, hint)
    t0 = time.perf_counter()
    pl, sim = part.placement, part.sim
    built = _build(cp_model, problem, part, hint, None, in_order)
    solver = _solver(cp_model, time_limit, workers, seed)
    name = _status(cp_model, solver.Solve(built.model))
    wall = time.perf_counter() - t0
    sc, step = built.sc, problem.search_profile.step_overhead_of(pl.style)  # the model's span + the step overhead
    bound = solver.BestObjectiveBound() / sc + step if name in ("optimal", "feasible") else 0.0
    if name not in ("optimal", "feasible"):
        log.info("exact: %s after %.1f s", name, wall)
        return ExactResult(name, None, None, None, bound, wall, sc)
    orders: list[list[tuple[int, int, Action]]] = [[] for _ in range(pl.p)]
    for (op, s, mb), st in built.start.items():
        orders[pl.rank_of(s)].append((solver.Value(st), (0 if op is Op.F else 1 if op in (Op.I, Op.B) else 2),
                                      Action(op, s, mb)))
    ranks = tuple(tuple(a for _, _, a in sorted(o, key=lambda x: (x[0], x[1]))) for o in orders)
    v = pl.v
    schedule = Schedule(pl.p, sim.m, v, pl, ranks, sim.backward, "exact")
    simres = simulate(schedule, problem.search_profile, timeline=False)
    obj = solver.ObjectiveValue() / sc + step
    if name == "optimal":
        bound = obj
        slack = sum(map(len, ranks)) / sc  # the rounding of the scaled durations, at most
        if sim.lowered.switch is not None and simres.makespan > obj + slack:
            name = "feasible"  # the profile's switch costs, which the model leaves out, made it longer
    log.info("exact: %s, objective %.6g ms (simulated %.6g), bound %.6g, %.1f s", name, obj, simres.makespan,
             bound, wall)
    return ExactResult(name, schedule, simres.makespan, obj, bound, wall, sc)


@dataclass
class RelaxedBound:
    """What the relaxations proved (module docstring)."""

    bound: float                  # proven lower bound for every schedule of the placement (ms)
    machines: tuple[int, ...]     # the ranks kept one-action-at-a-time in the last relaxation solved
    optimal: bool                 # the last relaxation's optimum is a schedule of the full model
    wall_s: float


def relaxed_bound(problem: SearchProblem, part: PlacementProblem | None = None, hint: Schedule | None = None,
                  time_limit: float = 60.0, workers: int = 1, seed: int = 0) -> RelaxedBound:
    """A proven lower bound from relaxations that keep one-action-at-a-time on some ranks only,
    adding ranks while time is left (module docstring). At least the placement's search bound."""
    cp_model = _ortools()
    if time_limit <= 0:
        raise SearchError(f"`time_limit` must be positive, got {time_limit} (the relaxation bound's solver time, s)", "time_limit")
    part = _part(problem, part, hint)
    t0 = time.perf_counter()
    per_rank = jackson_bound(problem.search_profile, part.placement, part.sim.m, part.sim.backward,
                             problem.limits).per_rank
    machines = {max(range(len(per_rank)), key=lambda r: per_rank[r])}
    best, step = part.lower_bound, problem.search_profile.step_overhead_of(part.placement.style)
    while True:
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            break
        built = _build(cp_model, problem, part, hint, machines, True)
        solver = _solver(cp_model, left, workers, seed)
        name = _status(cp_model, solver.Solve(built.model))
        if name not in ("optimal", "feasible"):
            break
        best = max(best, solver.BestObjectiveBound() / built.sc + step)
        if name != "optimal":
            break
        overlap = _overlaps(solver, built, machines)
        log.info("relaxation on ranks %s: %.6g ms; overlaps %s", sorted(machines), best, overlap)
        if not overlap:
            # a schedule of the model without the profile's switch costs: optimal only where it has none
            tight = part.sim.lowered.switch is None
            return RelaxedBound(best, tuple(sorted(machines)), tight, time.perf_counter() - t0)
        machines.add(max(overlap, key=lambda r: (overlap[r], -r)))
    return RelaxedBound(best, tuple(sorted(machines)), False, time.perf_counter() - t0)


def _overlaps(solver, built: _Built, machines: set[int]) -> dict[int, int]:
    """Per relaxed rank, the total time its actions overlap in the solver's solution (ticks)."""
    out = {}
    for r, items in enumerate(built.per_rank):
        if r in machines:
            continue
        spans = sorted((solver.Value(built.start[k]), solver.Value(built.end[k])) for k, _ in items)
        total, reach = 0, -math.inf
        for a, b in spans:
            if a < reach:
                total += min(b, reach) - a
            reach = max(reach, b)
        if total > 0:
            out[r] = total
    return out
