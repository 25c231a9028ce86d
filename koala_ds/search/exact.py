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
time; its simulated makespan is at most the solver's objective, and equal when optimal.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from ..ir import Action, Op, Schedule
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


def _scale(values: list[float]) -> int:
    for k in range(5):
        sc = 10 ** k
        if all(abs(x * sc - round(x * sc)) <= 1e-6 * max(1.0, abs(x * sc)) for x in values):
            return sc
    return 10 ** 4


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


def _build(cp_model, problem: SearchProblem, part: PlacementProblem, hint: Schedule | None,
           machines: set[int] | None, in_order: bool) -> _Built:
    """The CP-SAT model of the module docstring; one-action-at-a-time only on `machines` (None:
    every rank)."""
    pl, sim = part.placement, part.sim
    m = sim.m
    split = sim.backward == "split"
    costs = problem.search_profile.stage_costs(pl.num_stages, pl.pipelines)
    lat = float(problem.search_profile.p2p_latency)
    S = pl.num_stages
    durs = [lat] + [x for c in costs for x in (c.forward, c.backward_input, c.backward_weight, c.backward)]
    sc = _scale(durs)
    mem_vals = [x for c in costs for x in (c.activation_mb, c.w_hold_mb)] + \
        [x for x in problem.limits if x is not None]
    msc = _scale(mem_vals)
    L = round(lat * sc)

    def q(x: float) -> int:
        return round(x * sc)

    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    dur = {}
    for s in range(S):
        c = costs[s]
        dur[(Op.F, s)] = q(c.forward)
        dur[(Op.I, s)] = q(c.backward_input)
        dur[(Op.W, s)] = q(c.backward_weight)
        dur[(Op.B, s)] = q(c.backward)
    horizon = sum(dur[(op, s)] * len(pl.microbatches_of(s, m)) for s in range(S) for op in ops)
    horizon += L * 2 * S * m
    hint_start: dict[tuple[Op, int, int], int] = {}
    if hint is not None:
        res = simulate(hint, problem.search_profile, timeline=True)
        for ta in res.timeline or ():
            a = ta.action
            st = q(ta.start)
            if a.op is Op.B and split:
                hint_start[(Op.I, a.stage, a.microbatch)] = st
                hint_start[(Op.W, a.stage, a.microbatch)] = st + dur[(Op.I, a.stage)]
            elif a.op is Op.I and not split:
                hint_start[(Op.B, a.stage, a.microbatch)] = st
            elif a.op is Op.W and not split:
                continue
            else:
                hint_start[(a.op, a.stage, a.microbatch)] = st
        if in_order:  # the hint relabelled as in the module docstring, so that it is a solution
            hint_start = _relabel(hint_start, pl, m)
        horizon = min(horizon, max(q(res.makespan), max(v + dur[(k[0], k[1])] for k, v in hint_start.items())))
    model = cp_model.CpModel()
    start, end = {}, {}
    per_rank: list[list] = [[] for _ in range(pl.p)]
    for s in range(S):
        r = pl.rank_of(s)
        for mb in pl.microbatches_of(s, m):
            for op in ops:
                d = dur[(op, s)]
                key = (op, s, mb)
                st = model.NewIntVar(0, horizon - d, f"s{op.value}{s}_{mb}")
                iv = model.NewFixedSizeIntervalVar(st, d, f"i{op.value}{s}_{mb}")
                start[key], end[key] = st, st + d
                per_rank[r].append((key, iv))
                if key in hint_start:
                    model.AddHint(st, hint_start[key])
    bwd = Op.I if split else Op.B
    for s in range(S):
        r = pl.rank_of(s)
        prev, nxt = pl.prev_stage(s), pl.next_stage(s)
        for mb in pl.microbatches_of(s, m):
            if prev is not None:
                model.Add(start[(Op.F, s, mb)] >= end[(Op.F, prev, mb)] + (L if pl.rank_of(prev) != r else 0))
            model.Add(start[(bwd, s, mb)] >= end[(Op.F, s, mb)])
            if nxt is not None:
                model.Add(start[(bwd, s, mb)] >= end[(bwd, nxt, mb)] + (L if pl.rank_of(nxt) != r else 0))
            if split:
                model.Add(start[(Op.W, s, mb)] >= end[(Op.I, s, mb)])
    # memory: an activation is held from the start of its F to the start of its I (all but
    # w_hold_mb) or of its W (w_hold_mb); B frees all of it. The level at time t is the sum of
    # the held intervals covering t, the reservoir of F/I/W/B events seen up to t.
    held: list[list[tuple]] = [[] for _ in range(pl.p)]
    for s in range(S):
        r = pl.rank_of(s)
        c = costs[s]
        for mb in pl.microbatches_of(s, m):
            f = start[(Op.F, s, mb)]
            if split:
                parts = [(start[(Op.I, s, mb)], c.activation_mb - c.w_hold_mb), (start[(Op.W, s, mb)], c.w_hold_mb)]
            else:
                parts = [(start[(Op.B, s, mb)], c.activation_mb)]
            for k, (stop, size) in enumerate(parts):
                demand = round(size * msc)
                if demand <= 0:
                    continue
                length = model.NewIntVar(0, horizon, f"h{s}_{mb}_{k}")
                held[r].append((model.NewIntervalVar(f, length, stop, f"held{s}_{mb}_{k}"), demand))
    for r in range(pl.p):
        if machines is None or r in machines:
            model.AddNoOverlap([iv for _, iv in per_rank[r]])
        limit = problem.limits[r]
        if limit is not None and held[r]:
            cap = math.floor(limit * msc * (1 + 1e-9) + 1e-6)
            model.AddCumulative([h[0] for h in held[r]], [h[1] for h in held[r]], cap)
    # microbatch order: all ops of every stage (in_order), else the first stage's forwards
    for s in range(S):
        mbs = list(pl.microbatches_of(s, m))
        first = pl.prev_stage(s) is None
        for op in ops:
            if in_order or (first and op is Op.F):
                for a, b in zip(mbs, mbs[1:]):
                    model.Add(start[(op, s, b)] >= end[(op, s, a)])
    makespan = model.NewIntVar(0, horizon, "makespan")
    for key, e in end.items():
        if key[0] in (Op.W, Op.B) or (key[0] is Op.I and not split):
            model.Add(makespan >= e)
    if in_order:  # the k-th action of a group is the k-th microbatch's
        rel = release_times(problem.search_profile, pl, m, sim.backward, problem.limits)
        for s in range(S):
            for k, mb in enumerate(pl.microbatches_of(s, m)):
                for op, r_ in ((Op.F, rel.F), (bwd, rel.I)) + (((Op.W, rel.W),) if split else ()):
                    model.Add(start[(op, s, mb)] >= math.ceil(r_[s][k] * sc - 1e-6))
                model.Add(makespan >= end[(Op.F, s, mb)] + math.floor(rel.tail_F[s] * sc + 1e-6))
                model.Add(makespan >= end[(bwd, s, mb)] + math.floor(rel.tail_I[s] * sc + 1e-6))
    model.Minimize(makespan)
    if hint is not None:
        model.AddHint(makespan, horizon)
    return _Built(model, start, end, sc, per_rank)


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
    if part is not None:
        return part
    return problem.part_for(hint.placement) if hint is not None else problem.parts[0]


def solve_exact(problem: SearchProblem, part: PlacementProblem | None = None, hint: Schedule | None = None,
                time_limit: float = 30.0, workers: int = 1, seed: int = 0, in_order: bool = True) -> ExactResult:
    """Solve the configuration of `part` (default: the hint's placement, else the first) exactly.

    `in_order=False` drops the microbatch-order constraints and the release times (all but the
    first stage's forward order): the same optimum, proven more slowly; for tests of the
    relabelling argument."""
    cp_model = _ortools()
    if time_limit <= 0:
        raise SearchError(f"exact time limit must be positive, got {time_limit}")
    part = _part(problem, part, hint)
    t0 = time.perf_counter()
    pl, sim = part.placement, part.sim
    built = _build(cp_model, problem, part, hint, None, in_order)
    solver = _solver(cp_model, time_limit, workers, seed)
    name = _status(cp_model, solver.Solve(built.model))
    wall = time.perf_counter() - t0
    sc = built.sc
    bound = solver.BestObjectiveBound() / sc if name in ("optimal", "feasible") else 0.0
    if name not in ("optimal", "feasible"):
        log.info("exact: %s after %.1f s", name, wall)
        return ExactResult(name, None, None, None, bound, wall, sc)
    orders: list[list[tuple[int, int, Action]]] = [[] for _ in range(pl.p)]
    for (op, s, mb), st in built.start.items():
        orders[pl.rank_of(s)].append((solver.Value(st), (0 if op is Op.F else 1 if op in (Op.I, Op.B) else 2),
                                      Action(op, s, mb)))
    ranks = tuple(tuple(a for _, _, a in sorted(o, key=lambda x: (x[0], x[1]))) for o in orders)
    v = pl.chunks_per_rank // pl.pipelines
    schedule = Schedule(pl.p, sim.m, v, pl, ranks, sim.backward, "exact")
    simres = simulate(schedule, problem.search_profile, timeline=False)
    obj = solver.ObjectiveValue() / sc
    if name == "optimal":
        bound = obj
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
        raise SearchError(f"relaxation time limit must be positive, got {time_limit}")
    part = _part(problem, part, hint)
    t0 = time.perf_counter()
    per_rank = jackson_bound(problem.search_profile, part.placement, part.sim.m, part.sim.backward,
                             problem.limits).per_rank
    machines = {max(range(len(per_rank)), key=lambda r: per_rank[r])}
    best = part.lower_bound
    while True:
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            break
        built = _build(cp_model, problem, part, hint, machines, True)
        solver = _solver(cp_model, left, workers, seed)
        name = _status(cp_model, solver.Solve(built.model))
        if name not in ("optimal", "feasible"):
            break
        best = max(best, solver.BestObjectiveBound() / built.sc)
        if name != "optimal":
            break
        overlap = _overlaps(solver, built, machines)
        log.info("relaxation on ranks %s: %.6g ms; overlaps %s", sorted(machines), best, overlap)
        if not overlap:
            return RelaxedBound(best, tuple(sorted(machines)), True, time.perf_counter() - t0)
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
