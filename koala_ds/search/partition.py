"""Search the split (layers per virtual stage) and the schedule together, under a per-rank
memory limit that counts each rank's static memory (docs/search.md, "Searching the split").

1. Candidates: the engines' uniform split and a balancing split (dynamic programming: the
   least largest stage time F + I + W among the splits whose stages hold their static memory
   and their 1F1B in-flight activations). Each is scored by simulating every predefined
   (library) schedule on it: the fastest that fits.
2. Local moves of one cut point (one or two layers either way) from each, taking the best
   neighbour while it improves (ties broken by the stage times, largest first). One descent
   scores with the fastest predefined schedule, one with 1F1B alone (the "searched split +
   1F1B" side).
3. The schedule search (`koala_ds.search.search`, a share of the time budget each) on the
   uniform split and on the best splits found, skipping a split whose own lower bound is not
   below the best answer so far.
The answer is the fastest (split, schedule) pair met anywhere, so it is never slower than the
uniform split with the best predefined or the searched schedule, nor than the searched split
with 1F1B. Memory: the layer profile's `memory_limit_mb` (whole memory per rank), else the
uniform split's 1F1B peak with its static memory; each split's stage profile gets, per rank,
that limit minus the rank's static memory (`LayerProfile.stage_profile`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import library
from ..core.ir import KoalaError, Placement, Schedule
from ..sim import CostProfile, ProfileError, lower_bound, simulate
from ..sim.layers import LayerProfile, partition_text
from .partition_bound import JointBound, joint_lower_bound, min_max_partition
from .problem import SearchError, SearchProblem, default_placements, relative_gap

log = logging.getLogger(__name__)

BASELINES = ("1f1b", "interleaved-1f1b")   # "1F1B" of the searched-split side (its chunked form for v > 1)
MOVES = (1, -1, 2, -2)


@dataclass(frozen=True)
class Answer:
    """One (split, schedule) pair and its simulated makespan."""

    label: str
    partition: tuple[int, ...]
    schedule_name: str
    makespan: float
    peak: float
    schedule: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def placement(self) -> Placement | None:
        return None if self.schedule is None else self.schedule.placement


@dataclass
class PartitionResult:
    joint: Answer
    uniform_predefined: Answer | None
    uniform_searched: Answer | None
    split_baseline: Answer | None
    bound: JointBound
    memory_limit_mb: float | tuple[float, ...] | None
    memory_limit_source: str
    partitions_scored: int
    schedule_searches: int
    wall_s: float

    @property
    def gap(self) -> float:
        return relative_gap(self.joint.makespan, self.bound.value)

    @property
    def speedup(self) -> float | None:
        """The joint answer's speed over the uniform split with the best predefined schedule."""
        base = self.uniform_predefined
        return None if base is None or self.joint.makespan <= 0 else base.makespan / self.joint.makespan


@dataclass(frozen=True)
class Score:
    """A split's predefined schedules: the fastest that fits, and the baseline's makespan."""

    best: Answer | None
    baseline: Answer | None
    bound: float                         # the split's lower bound with memory (koala_ds.sim.lower_bound)
    stage_work: tuple[float, ...]        # F + I + W per stage, largest first (the tie-break)


def default_memory_limit(lp: LayerProfile, p: int, m: int, v: int) -> float:
    """The uniform split's 1F1B peak with static memory: the largest over ranks of min(p - r, m)
    microbatches of the activations of rank r's stages (interleaved placement) plus its static MB."""
    part = lp.uniform_partition(p * v)
    pl = Placement.named("interleaved", p, v)
    static = lp.rank_static_mb(part, pl)
    stages = [lp.stage_cost(rng) for rng in lp.stage_layers(part)]
    return max(min(p - r, m) * sum(stages[s].activation_mb for s in pl.stages_of(r)) + static[r] for r in range(p))


class PartitionSearch:
    """The state of one joint search: the profile, the configuration and the caches."""

    def __init__(self, lp: LayerProfile, p: int, m: int, v: int = 1, memory_limit: float | None = None) -> None:
        if min(p, m, v) < 1:
            raise SearchError(f"`p`, `m` and `v` must be >= 1, got p={p} m={m} v={v}", "p", "m", "v")
        self.p, self.m, self.v, self.S = p, m, v, p * v
        lp.uniform_partition(self.S)  # enough layers for p x v stages, or a one-line error
        if memory_limit is not None:
            lp, self.limit_source = dataclasses.replace(lp, memory_limit_mb=float(memory_limit)), "`memory_limit`"
        elif lp.memory_limit_mb is not None:
            self.limit_source = "the profile"
        else:
            lim = default_memory_limit(lp, p, m, v)
            lp, self.limit_source = dataclasses.replace(lp, memory_limit_mb=lim), "1F1B's peak on the uniform split"
        self.lp = lp
        self.placements = default_placements(p, v)
        self.schedules = self._library()
        self._profiles: dict[tuple, CostProfile | None] = {}
        self._scores: dict[tuple[int, ...], Score] = {}

    def _library(self) -> list[Schedule]:
        ranks = {pl.stage_ranks for pl in self.placements}
        out = []
        for name in library.names():
            program = library.get(name)
            try:
                if program.supports(self.p, self.m, self.v) is not None:
                    continue
                sched = program.compile(self.p, self.m, self.v)
            except KoalaError as exc:  # supports() said yes: a library schedule that cannot compile here
                log.debug("library schedule %s left out of the partition search at p=%d m=%d v=%d: %s",
                          name, self.p, self.m, self.v, exc)
                continue
            if sched.placement.pipelines == 1 and sched.placement.stage_ranks in ranks:
                out.append(sched)
        return out

    def profile(self, partition: tuple[int, ...], placement: Placement) -> CostProfile | None:
        """The stage profile of a split on a placement; None when a rank's static memory does not
        fit its limit."""
        key = (partition, placement.stage_ranks)
        if key not in self._profiles:
            try:
                self._profiles[key] = self.lp.stage_profile(partition, self.p, placement)
            except ProfileError:
                self._profiles[key] = None
        return self._profiles[key]

    def score(self, partition: tuple[int, ...]) -> Score:
        """Every predefined schedule on the split: the fastest that fits, and the baseline."""
        if partition in self._scores:
            return self._scores[partition]
        best = baseline = None
        for sched in self.schedules:
            prof = self.profile(partition, sched.placement)
            if prof is None:
                continue
            res = simulate(sched, prof, timeline=False)
            if not res.fits_memory:
                continue
            ans = Answer("", partition, sched.name, res.makespan, res.peak_memory_max, sched)
            if best is None or (ans.makespan, ans.schedule_name) < (best.makespan, best.schedule_name):
                best = ans
            if sched.name in BASELINES and (baseline is None or BASELINES.index(sched.name) <
                                            BASELINES.index(baseline.schedule_name)):
                baseline = ans
        work = sorted((c.forward + c.backward_input + c.backward_weight
                       for c in map(self.lp.stage_cost, self.lp.stage_layers(partition))), reverse=True)
        self._scores[partition] = Score(best, baseline, self._bound(partition), tuple(work))
        return self._scores[partition]

    def _bound(self, partition: tuple[int, ...]) -> float:
        """The split's least lower bound over placements and backward kinds, memory terms included
        (it guides the descents where no predefined schedule fits)."""
        out = math.inf
        for pl in self.placements:
            prof = self.profile(partition, pl)
            if prof is None:
                continue
            for kind in ("split", "full"):
                lb = lower_bound(prof, self.p, self.m, self.v, pl, kind, memory_limit=list(prof.memory_limits(self.p)))
                if lb.feasible:
                    out = min(out, lb.value)
        return out

    @property
    def scored(self) -> int:
        return len(self._scores)

    # -- candidates ---------------------------------------------------------------------------
    def balanced(self) -> tuple[int, ...] | None:
        """The split with the least largest stage time (F + I + W) whose stages hold their static
        memory and 1F1B's in-flight activations (min(p - r, m) microbatches on rank r)."""
        lp, pl = self.lp, self.placements[-1]
        F = _prefix([x.forward + x.backward_input + x.backward_weight for x in lp.layers])
        act = _prefix([x.activation_mb for x in lp.layers])
        static = _prefix([x.param_mb * (1 + lp.optimizer_bytes_per_param_byte) for x in lp.layers])

        def term(s: int, a: int, b: int) -> float:
            r = pl.stage_ranks[s]
            lim = lp.limit_for(r, self.p)
            held = min(self.p - r, self.m) if self.v == 1 else 1
            if lim is not None and static[b] - static[a] + held * (act[b] - act[a]) > lim:
                return math.inf
            return F[b] - F[a]

        return min_max_partition(lp.num_layers, self.S, term)[1]

    def descend(self, start: tuple[int, ...], key: Callable[[Score], float],
                deadline: Callable[[], bool]) -> tuple[int, ...]:
        """Best-neighbour descent over moves of one cut point by one or two layers."""
        def rank(part: tuple[int, ...]) -> tuple:
            sc = self.score(part)
            return key(sc), sc.bound, sc.stage_work

        current, cur_rank = start, rank(start)
        while not deadline():
            best, best_rank = None, cur_rank
            for nb in _neighbours(current):
                r = rank(nb)
                if r < best_rank:
                    best, best_rank = nb, r
            if best is None:
                break
            current, cur_rank = best, best_rank
        return current


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out


def _neighbours(part: tuple[int, ...]):
    for i in range(len(part) - 1):
        for d in MOVES:
            a, b = part[i] - d, part[i + 1] + d
            if a >= 1 and b >= 1:
                yield part[:i] + (a, b) + part[i + 2:]


def _best_key(sc: Score) -> float:
    return math.inf if sc.best is None else sc.best.makespan


def _baseline_key(sc: Score) -> float:
    return math.inf if sc.baseline is None else sc.baseline.makespan


# -- the schedule search on one split ---------------------------------------------------------
def search_schedule(ps: PartitionSearch, partition: tuple[int, ...], budget: float, seed: int = 0,
                    beat: float = math.inf) -> Answer | None:
    """The schedule search on one split (placements with the same per-rank limits searched
    together); None when no schedule fits or when the split's own lower bound is not below `beat`."""
    from .ga import search

    groups: dict[tuple, list[Placement]] = {}
    for pl in ps.placements:
        prof = ps.profile(partition, pl)
        if prof is not None:
            groups.setdefault((prof.memory_limit_mb,), []).append(pl)
    problems = []
    for pls in groups.values():
        try:
            problems.append(SearchProblem(ps.profile(partition, pls[0]), ps.p, ps.m, ps.v, placements=pls))
        except SearchError as exc:   # a limit below one microbatch's activations on some rank
            log.info("split %s: %s", partition_text(partition), exc)
    problems = [pr for pr in problems if pr.lower_bound < beat * (1 - 1e-9)]
    best = None
    for pr in problems:
        res = search(pr, time_budget=max(0.5, budget / len(problems)), seed=seed, progress=False)
        if res.fits and (best is None or res.makespan < best.makespan):
            best = Answer("", partition, "searched", res.makespan, res.peak, res.schedule)
    return best


def search_partition(lp: LayerProfile, p: int, m: int, v: int = 1, memory_limit: float | None = None,
                     time_budget: float = 30.0, seed: int = 0, top: int = 2) -> PartitionResult:
    """The joint search of the module docstring within about `time_budget` seconds."""
    if not (0 < time_budget < math.inf):
        raise SearchError(f"`time_budget` must be a finite number of seconds > 0, got {time_budget}", "time_budget")
    t0 = time.perf_counter()
    ps = PartitionSearch(lp, p, m, v, memory_limit)
    bound = joint_lower_bound(ps.lp, p, m, ps.placements)
    if bound.partition is None:
        raise SearchError(f"no split of {lp.source} into p x v = {ps.S} stages fits the memory limit "
                          f"({ps.limit_source}): a stage's static memory and one microbatch's activations exceed "
                          f"its rank's limit; raise `memory_limit` or `p`", "memory_limit", "p")
    uniform = tuple(lp.uniform_partition(ps.S))
    starts = list(dict.fromkeys(x for x in (uniform, ps.balanced(), bound.partition) if x is not None))
    climb_end = t0 + 0.3 * time_budget
    deadline = lambda: time.perf_counter() > climb_end  # noqa: E731
    for start in starts:
        ps.descend(start, _best_key, deadline)
    base_part = min((ps.descend(s, _baseline_key, deadline) for s in starts), key=lambda x: _baseline_key(ps.score(x)))
    # where no predefined schedule fits, the split's own bound ranks it
    ranked = sorted((_best_key(sc), sc.bound, sc.stage_work, part) for part, sc in ps._scores.items()
                    if sc.bound < math.inf)
    cands = list(dict.fromkeys([r[3] for r in ranked[:top]] + [uniform]))
    answers = [sc.best for sc in ps._scores.values() if sc.best is not None]
    uniform_searched = None
    for i, part in enumerate(cands):
        left = time_budget - (time.perf_counter() - t0)
        beat = math.inf if part == uniform else min((a.makespan for a in answers), default=math.inf)
        found = search_schedule(ps, part, left / (len(cands) - i), seed, beat)
        if found is not None:
            answers.append(found)
            if part == uniform:
                uniform_searched = found
    joint = min(answers, key=lambda a: (a.makespan, a.schedule_name != "searched")) if answers else None
    if joint is None:
        raise SearchError(f"no schedule fits the memory limit ({ps.limit_source}) on any split tried; raise "
                          f"`memory_limit`", "memory_limit")
    u = ps.score(uniform).best
    sb = ps.score(base_part).baseline
    return PartitionResult(
        dataclasses.replace(joint, label="searched split + searched schedule"),
        None if u is None else dataclasses.replace(u, label="uniform split + best predefined"),
        None if uniform_searched is None else dataclasses.replace(uniform_searched, label="uniform split + searched"),
        None if sb is None else dataclasses.replace(sb, label=f"searched split + {sb.schedule_name}"),
        bound, ps.lp.memory_limit_mb, ps.limit_source, ps.scored, len(cands), time.perf_counter() - t0)
