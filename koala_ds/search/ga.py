"""The Dynamic Try-Test genetic algorithm over rank orders, and the top-level `search()`.

A candidate is one *order* per rank: the rank's sequence of actions as BTT choices (docs/search.md,
"The encoding"); the decoder turns orders into the simulator's *codes*. Population: every library
schedule valid for the configuration, the greedy list scheduler's orders (one per tie-break
policy), and random orders. Each generation makes `trials` children (crossover of two tournament
winners, then a mutation of `strength` moves on the orders), *try-tests* each on the simulator
(the decoder repairs local order and memory; a child that still deadlocks is rejected) and keeps
the best `size` distinct candidates. Each generation also polishes the best unpolished candidate
with the timeline-guided local search (`local.py`) and makes one iterated-local-search step (kick
+ descent) from the candidate that search last accepted.

The dynamic rule (documented in docs/search.md):
- strength follows the 1/5 success rule: after a generation that improved the best candidate it is
  divided by 1.5, otherwise multiplied by 1.5 ** (1/4) (so it is steady when one generation in
  five succeeds), and kept in [1, strength_max];
- trials (the try-test rate, children tested per generation) resets to its base after an
  improvement and doubles (up to 8x) after every `patience` generations without one;
- after 4 * patience generations without improvement the worse half of the population is
  replaced by strongly mutated copies of the best candidates (a restart), and strength resets.
"""
from __future__ import annotations

import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ..core.ir import Schedule
from ..core.machine import max_processes_per_node, processes_bound_text
from ..sim import SimResult, random_schedule, simulate
from .greedy import greedy_orders, policies
from .local import LocalSearch
from .operators import crossover, mutate, tournament
from .pool import Evaluator
from .problem import INFEASIBLE, PlacementProblem, SearchError, SearchProblem
from .results import LibraryRow, SearchResult, library_rows

log = logging.getLogger(__name__)


@dataclass
class Individual:
    """One try-tested candidate: its part of the problem, its orders and what they measured."""

    part: int                      # index into problem.parts
    orders: list[list[int]]        # one order per rank (BTT choices), as the decoder repaired it
    makespan: float
    peak: float
    origin: str
    key: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = (self.part, tuple(tuple(order) for order in self.orders))


# -- the search ---------------------------------------------------------------------------
@dataclass
class GAConfig:
    """The GA's settings (docs/search.md, "The Dynamic Try-Test GA")."""

    population: int = 24
    trials: int = 4              # base try-test count per generation (plus one polish and one kick)
    strength_max: float = 24.0
    patience: int = 15
    crossover_rate: float = 0.3
    random_orders: int = 4       # random schedules among the seeds
    greedy: bool = True
    local_search: bool = True    # timeline-guided descent (koala_ds/search/local.py) on the best candidates
    local_seeds: int = 2         # seeds polished per placement before the first generation
    local_evals: int = 4000      # evaluation cap of one descent
    kick_strengths: tuple[float, ...] = (1.5, 3.0, 6.0)  # an iterated-local-search kick's mutation strength:
                                                          # one of these, at random (small and large kicks)


class Population:
    """The candidates kept (`members`, at most `GAConfig.population` after each generation) and
    what every candidate tried so far taught: the keys seen (each candidate is kept once), the
    best overall and of each part, and when the best improved."""

    def __init__(self, started: float):
        self.started = started
        self.members: list[Individual] = []
        self.seen: set[tuple] = set()
        self.best: Individual | None = None
        self.part_best: dict[int, Individual] = {}
        self.history: list[tuple[float, float]] = []   # (seconds, best makespan)

    def consider(self, ind: Individual) -> bool:
        """Keep `ind` when it is new and feasible; whether it is a new best."""
        if ind.key in self.seen or ind.makespan == INFEASIBLE:
            return False
        self.seen.add(ind.key)
        self.members.append(ind)
        top = self.part_best.get(ind.part)
        if top is None or ind.makespan < top.makespan:
            self.part_best[ind.part] = ind
        if self.best is None or ind.makespan < self.best.makespan - 1e-12:
            self.best = ind
            self.history.append((time.perf_counter() - self.started, ind.makespan))
            return True
        return False

    def rank(self) -> None:
        """Sort the members, fastest first (stable: equal makespans keep their order)."""
        self.members.sort(key=lambda x: x.makespan)

    def cut(self, size: int) -> None:
        """Keep the first `size` members."""
        del self.members[size:]


class Clock:
    """The wall-clock budget, from `started` (None: no time budget)."""

    def __init__(self, problem: SearchProblem, time_budget: float | None, started: float, evaluator: Evaluator):
        self.problem = problem
        self.budget = time_budget
        self.started = started
        self.evaluator = evaluator
        self.row_seconds = 0.0   # the mean time of one library schedule (compile and simulate)

    def out_of_time(self, next_step: float = 0.0) -> bool:
        """True when the budget cannot take `next_step` more seconds and the closing work: the
        result's and each placement's best built as a schedule again, each about as long as a
        library schedule took to compile and simulate (at most a quarter of the budget)."""
        if self.budget is None:
            return False
        closing = min(self.budget / 4, (len(self.problem.parts) + 1) * self.row_seconds
                      + 2 * self.evaluator.mean_seconds)
        return time.perf_counter() - self.started + next_step + closing >= self.budget

    def half_spent(self) -> bool:
        """True once half of the budget is gone (never without a time budget)."""
        return self.budget is not None and time.perf_counter() - self.started >= self.budget / 2


class Polisher:
    """The local search (`local.py`) on candidates: a descent from one (`polish`), and the
    iterated local search's step (`kick_step`): a random kick of its current candidate, then a
    descent. The current candidate moves to each result no worse than it (so it drifts across
    plateaus of equal makespan) and back to the best candidate when that is better."""

    def __init__(self, problem: SearchProblem, cfg: GAConfig, rng: random.Random, evaluator: Evaluator,
                 population: Population):
        self.problem = problem
        self.cfg = cfg
        self.rng = rng
        self.evaluator = evaluator
        self.population = population
        self.searchers: dict[int, LocalSearch] = {}   # one per part
        self.polished: set[tuple] = set()             # keys of the candidates descended from or to
        self.current: Individual | None = None        # the iterated local search's candidate

    def done(self, ind: Individual) -> bool:
        """Whether a descent started or ended at `ind` already."""
        return ind.key in self.polished

    def polish(self, ind: Individual, origin: str, deadline: Callable[[], bool], kick: bool = False
               ) -> tuple[bool, Individual | None]:
        """A descent from `ind` (after a random kick when `kick`): (whether it found a new best,
        the candidate it ended at)."""
        self.polished.add(ind.key)
        part = self.problem.parts[ind.part]
        ls = self.searchers.get(ind.part)
        if ls is None:
            ls = self.searchers[ind.part] = LocalSearch(part)
        orders = self._kicked(part, ind.orders) if kick else ind.orders
        if orders is None:
            return False, None
        before = ls.evaluations
        res = ls.descend(orders, self.rng, deadline, self.cfg.local_evals)
        self.evaluator.count += ls.evaluations - before
        if res is None:
            return False, None
        ev = part.evaluate(res.choices)
        new = Individual(ind.part, ev.orders, ev.makespan, ev.peak, origin)
        self.polished.add(new.key)
        return self.population.consider(new), new

    def _kicked(self, part: PlacementProblem, orders: list[list[int]]) -> list[list[int]] | None:
        """`orders` after a kick of a strength drawn from `kick_strengths`, through the decoder
        (which repairs a kick that deadlocks); None when it still does not run."""
        strength = self.rng.choice(self.cfg.kick_strengths)
        ev = part.evaluate(mutate(orders, self.rng, strength, part.placement.chunks_per_rank))
        self.evaluator.count += 1
        return None if ev.makespan == INFEASIBLE else ev.orders

    def kick_step(self, origin: str, deadline: Callable[[], bool]) -> bool:
        """One iterated-local-search step; whether it found a new best."""
        best = self.population.best
        assert best is not None
        if self.current is None or self.current.makespan > best.makespan + 1e-12:
            self.current = best
        if deadline():
            return False
        found, new = self.polish(self.current, origin, deadline, kick=True)
        if new is not None and new.makespan <= self.current.makespan + 1e-12:
            self.current = new
        return found


class Dynamics:
    """The adaptive rule (module docstring): mutation strength and try-test rate."""

    def __init__(self, cfg: GAConfig):
        self.cfg = cfg
        self.strength = 2.0
        self.trials = cfg.trials   # children per generation
        self.since = 0             # generations since the last improvement

    def after(self, improved: bool) -> bool:
        """Update after a generation; whether a restart is due (the strength then resets)."""
        if improved:
            self.strength = max(1.0, self.strength / 1.5)
            self.trials = self.cfg.trials
            self.since = 0
            return False
        self.strength = min(self.cfg.strength_max, self.strength * 1.5 ** 0.25)
        self.since += 1
        if self.since % self.cfg.patience == 0:
            self.trials = min(self.cfg.trials * 8, self.trials * 2)
        if self.since % (4 * self.cfg.patience) == 0:
            self.strength = 2.0
            return True
        return False


class Progress:
    """The progress bar (tqdm, on a terminal only) and the `on_generation` callback."""

    def __init__(self, show: bool, generations: int | None, lower_bound: float,
                 on_generation: Callable[[int, float], None] | None):
        self.show = show
        self.generations = generations
        self.lower_bound = lower_bound
        self.on_generation = on_generation
        self.bar = None

    def start(self) -> None:
        if not self.show:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            return
        self.bar = tqdm(total=self.generations, desc="koala search", unit="gen", file=sys.stderr, leave=False,
                        dynamic_ncols=True, disable=None)  # None: off when stderr is not a terminal

    def update(self, gen: int, best: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            lb = self.lower_bound
            self.bar.set_postfix_str(f"best {best:.6g} ms, gap {best / lb - 1:+.2%}" if lb > 0
                                     else f"best {best:.6g} ms")
        if self.on_generation is not None:
            self.on_generation(gen, best)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


Job = tuple[int, list[list[int]], str]   # (part index, orders, origin)


class _Run:
    """One search: its phases (library, seeds, first polish, generations) and its state."""

    def __init__(self, problem: SearchProblem, cfg: GAConfig, seed: int, workers: int,
                 time_budget: float | None, started: float):
        self.problem = problem
        self.cfg = cfg
        self.workers = workers
        self.rng = random.Random(seed)
        self.evaluator = Evaluator(problem, workers)
        self.clock = Clock(problem, time_budget, started, self.evaluator)
        self.population = Population(started)
        self.polisher = Polisher(problem, cfg, self.rng, self.evaluator, self.population)
        self.stop_at = problem.lower_bound * (1 + 1e-9)
        self.library: list[LibraryRow] = []
        self.library_skipped: list[str] = []
        self.library_seeds: list[LibraryRow] = []   # rows whose placement is searched
        self.gen = 0
        self.stopped = "generations"   # lower-bound | time | generations | interrupted
        self.interrupted = False

    @property
    def best(self) -> Individual:
        assert self.population.best is not None
        return self.population.best

    def run(self, generations: int | None, progress: Progress) -> None:
        """Every phase; Ctrl-C ends it with the best so far (once there is one)."""
        try:
            self.simulate_library()
            self.seed()
            self.polish_seeds()
            progress.start()
            self.evolve(generations, progress)
        except KeyboardInterrupt:
            self.interrupted = True
            self.stopped = "interrupted"
            if self.population.best is None:
                raise
        finally:
            self.evaluator.close()
            progress.close()

    def try_test(self, jobs: list[Job], out_of_time: Callable[[], bool] | None = None) -> bool:
        """Try-test `jobs` (a prefix of them with `out_of_time`) and keep what runs; whether the
        best improved."""
        results = self.evaluator([(idx, orders) for idx, orders, _ in jobs], out_of_time)
        improved = False
        for (idx, _, origin), (ms, pk, orders) in zip(jobs, results):
            improved = self.population.consider(Individual(idx, orders, ms, pk, origin)) or improved
        return improved

    def simulate_library(self) -> None:
        """The library rows; those of searched placements seed the search."""
        phase = time.perf_counter()
        self.library += library_rows(self.problem, self.clock.out_of_time, self.library_skipped)
        self.clock.row_seconds = (time.perf_counter() - phase) / max(1, len(self.library))
        self.library_seeds += [row for row in self.library
                               if row.schedule is not None and self.problem.allows(row.schedule.placement)]

    def seed(self) -> None:
        """Seeds (library, greedy, random orders), made and try-tested in turn while time is left."""
        seeding, made = time.perf_counter(), 0
        size = 2 * self.workers if self.workers > 1 else 1
        for batch in _seed_batches(self.problem, self.library_seeds, self.cfg, self.rng, size):
            self.try_test(batch)
            made += 1
            if self.population.best is not None and self.clock.out_of_time((time.perf_counter() - seeding) / made):
                break
        if self.population.best is None:
            raise SearchError("no seed schedule fits the memory limit and runs without deadlock; "
                              "raise `memory_limit`", "memory_limit")

    def polish_seeds(self) -> None:
        """Polish the best seeds of each placement (within half of the time budget)."""
        pop = self.population
        pop.rank()
        if self.cfg.local_search and self.best.makespan > self.stop_at:
            firsts: list[Individual] = []
            for idx in range(len(self.problem.parts)):
                firsts += [x for x in pop.members if x.part == idx][:self.cfg.local_seeds]
            firsts.sort(key=lambda x: x.makespan)
            for ind in firsts:
                if self.clock.half_spent() or self.best.makespan <= self.stop_at:
                    break
                self.polisher.polish(ind, f"{ind.origin} + local search", self.clock.half_spent)
            pop.rank()
        pop.cut(self.cfg.population)

    def stop_reason(self, generations: int | None) -> str | None:
        if self.best.makespan <= self.stop_at:
            return "lower-bound"
        if generations is not None and self.gen >= generations:
            return "generations"
        if self.clock.out_of_time():
            return "time"
        return None

    def evolve(self, generations: int | None, progress: Progress) -> None:
        """Generations until a budget ends or the best reaches the lower bound."""
        dynamics = Dynamics(self.cfg)
        out_of_time = self.clock.out_of_time
        while True:
            stopped = self.stop_reason(generations)
            if stopped is not None:
                self.stopped = stopped
                return
            self.gen += 1
            improved = self.try_test(self.children(dynamics), out_of_time)
            if self.cfg.local_search:
                improved = self.local_steps() or improved
            self.population.rank()
            self.population.cut(self.cfg.population)
            if dynamics.after(improved):
                self.restart()
            progress.update(self.gen, self.best.makespan)

    def children(self, dynamics: Dynamics) -> list[Job]:
        """`trials` children: tournament winners, some crossed over, all mutated; a quarter of
        those of the best candidate's part are one-move neighbours of the best."""
        pop, rng, best = self.population.members, self.rng, self.best
        out: list[Job] = []
        for _ in range(dynamics.trials):
            a = tournament(pop, rng)
            orders = a.orders
            if rng.random() < self.cfg.crossover_rate:
                mates = [x for x in pop if x.part == a.part and x is not a]
                if mates:
                    orders = crossover(a.orders, tournament(mates, rng).orders, rng)
            chunks = self.problem.parts[a.part].placement.chunks_per_rank
            if rng.random() < 0.25 and a.part == best.part:
                orders = mutate(best.orders, rng, 1.0, chunks)
            else:
                orders = mutate(orders, rng, dynamics.strength, chunks)
            out.append((a.part, orders, f"generation {self.gen}"))
        return out

    def local_steps(self) -> bool:
        """Polish the best candidate of the top three not polished yet, then one iterated local
        search step; whether either found a new best."""
        pop = self.population
        pop.rank()
        improved = False
        fresh_top = [x for x in pop.members[:3] if not self.polisher.done(x)]
        out_of_time = self.clock.out_of_time
        if fresh_top and self.polisher.polish(fresh_top[0], f"generation {self.gen} + local search", out_of_time)[0]:
            improved = True
        found = self.polisher.kick_step(f"generation {self.gen} kick + local search", out_of_time)
        return improved or found

    def restart(self) -> None:
        """Replace the worse half of the population by strongly mutated copies of the best four."""
        pop = self.population
        keep = pop.members[: max(2, len(pop.members) // 2)]
        fresh: list[Job] = []
        for _ in range(len(pop.members) - len(keep)):
            a = self.rng.choice(keep[:4])
            chunks = self.problem.parts[a.part].placement.chunks_per_rank
            fresh.append((a.part, mutate(a.orders, self.rng, self.cfg.strength_max, chunks), f"restart {self.gen}"))
        pop.members[:] = keep
        self.try_test(fresh, self.clock.out_of_time)


def check_budgets(time_budget: float | None, generations: int | None, workers: int, min_gain: float = 0.0) -> None:
    """SearchError naming the budget parameter `search` would refuse (front ends check first)."""
    if not (0 <= min_gain < math.inf):
        raise SearchError(f"`min_gain` must be a finite fraction >= 0, got {min_gain}", "min_gain")
    if time_budget is not None and not (0 < time_budget < math.inf):
        raise SearchError(f"`time_budget` must be a finite number of seconds > 0, got {time_budget}", "time_budget")
    if generations is not None and generations < 0:
        raise SearchError(f"`generations` must be >= 0, got {generations}", "generations")
    if time_budget is None and generations is None:  # else it would run until Ctrl-C or the bound
        raise SearchError("`time_budget` and `generations` are both None: give at least one budget",
                          "time_budget", "generations")
    if workers < 1:
        raise SearchError(f"`workers` must be >= 1, got {workers}", "workers")
    most = max_processes_per_node()
    if workers > most:  # a process each: more would start processes until the machine gives out
        raise SearchError(f"`workers` must be at most {most} ({processes_bound_text()}), got {workers}", "workers")


def search(problem: SearchProblem, *, time_budget: float | None = 10.0, generations: int | None = None,
           seed: int = 0, workers: int = 1, progress: bool = False, config: GAConfig | None = None,
           on_generation: Callable[[int, float], None] | None = None, started: float | None = None,
           min_gain: float = 0.0, use_spread: bool = True) -> SearchResult:
    """Search the schedule space of `problem`; the best schedule found within the budgets.

    Deterministic for a given `seed` when `time_budget` is None (a generation budget) or does
    not bind: the random stream and the evaluation order do not depend on timing or workers.
    Ctrl-C (KeyboardInterrupt) ends the search and returns the best schedule so far.

    The time budget counts from `started` (a `time.perf_counter()` value; default: now) and
    binds every phase: the library schedules, the seeds (library, greedy, random orders: each
    is made and try-tested only while time is left, once one seed is in), the polish and the
    generations. Bad budgets, or none at all, raise `SearchError` naming the parameter (`.parameter`).

    `min_gain` (a fraction, default 0): the answer is 1f1b (when it is valid and fits), else the
    fastest fitting library schedule, unless a schedule is predicted faster than it by more than
    this: 0.03 keeps the known schedule for any predicted gain within 3%, a model's typical error
    on real hardware (see docs/search.md). A profile with a measured `spread` raises the gain
    needed to the spread it makes on the makespans compared (`makespan_spread`, `_answer`), unless
    `use_spread` is False."""
    check_budgets(time_budget, generations, workers, min_gain)
    run = _Run(problem, config or GAConfig(), seed, workers, time_budget,
               time.perf_counter() if started is None else started)
    run.run(generations, Progress(progress, generations, problem.lower_bound, on_generation))
    return _result(run, min_gain, use_spread)


def makespan_spread(schedule: Schedule, quartiles, makespan: float) -> float:
    """What the profile's spread makes on `schedule`'s makespan: (makespan at the measurements'
    upper quartiles - at their lower ones) / `makespan` (`CostProfile.quartile_profiles`)."""
    if makespan <= 0:
        return 0.0
    low, high = (simulate(schedule, q, timeline=False).makespan for q in quartiles)
    return max(0.0, (high - low) / makespan)


@dataclass(frozen=True)
class _Choice:
    """`_answer`'s answer: the schedule, the best candidate's own schedule, the answer simulated,
    where it came from, the largest spread on the makespans compared (None: the profile gives
    none) and the gain a schedule needed over the one before (the larger of it and min_gain)."""

    schedule: Schedule
    own: Schedule
    res: SimResult
    origin: str
    spread: float | None
    required_gain: float


def _answer(run: _Run, min_gain: float, use_spread: bool = True) -> _Choice:
    """From the simplest up, 1f1b, the fastest other fitting library seed, the best candidate:
    each replaces the one before only when faster by more than the required gain: `min_gain` (a
    fraction) or, when larger, the profile's spread on the makespans compared (the largest of
    the three schedules'; docs/search.md, "Keeping the known schedule"). At 0 a tie keeps the
    known schedule (nothing faster was found), and a library order may still win: the decoder
    takes microbatches in order, and some library orders do not. `use_spread` False: min_gain alone."""
    problem, best = run.problem, run.best
    part = problem.parts[best.part]
    own = part.schedule(part.evaluate(best.orders).codes, "searched")   # the repaired orders' codes
    own_res = part.sim.run(own.ranks, timeline=False)
    fitting = [row for row in run.library_seeds if row.fits and row.schedule is not None]
    one = [row for row in fitting if row.name == "1f1b"]
    others = sorted((row for row in fitting if row.name != "1f1b"), key=lambda r: (r.makespan, r.name))
    options = [(row.makespan, row.schedule, row) for row in one[:1] + others[:1]] + [(own_res.makespan, own, None)]
    quartiles = problem.search_profile.quartile_profiles() if use_spread else None
    spread = None if quartiles is None else max(makespan_spread(sched, quartiles, ms) for ms, sched, _ in options)
    needed = max(min_gain, spread or 0.0)
    chosen = None
    for makespan, _, row in options:
        if chosen is None or makespan * (1 + needed) < chosen[0] - 1e-9:
            chosen = (makespan, row)
    row = chosen[1]
    if row is None:
        return _Choice(own, own, own_res, best.origin, spread, needed)
    return _Choice(row.schedule, own, simulate(row.schedule, problem.search_profile, timeline=False),
                   f"library {row.name}", spread, needed)


def _per_placement(run: _Run, own: Schedule) -> list[tuple[Schedule, float]]:
    """The best schedule of each part that has one (the best candidate's is `own`)."""
    out = []
    for idx, part in enumerate(run.problem.parts):
        top = run.population.part_best.get(idx)
        if top is None:
            continue
        if top is run.best:
            out.append((own, top.makespan))
        else:
            out.append((part.schedule(part.evaluate(top.orders).codes, "searched"), top.makespan))
    return out


def _result(run: _Run, min_gain: float = 0.0, use_spread: bool = True) -> SearchResult:
    problem, lb = run.problem, run.problem.lower_bound
    choice = _answer(run, min_gain, use_spread)
    schedule, own, res, origin = choice.schedule, choice.own, choice.res, choice.origin
    schedule = schedule.with_name("searched")
    schedule.meta["description"] = (f"found by koala search: makespan {res.makespan:.6g} ms under "
                                    f"{problem.profile.source}, lower bound {lb:.6g} ms")
    per_placement = _per_placement(run, own)
    wall = time.perf_counter() - run.clock.started
    evaluations = run.evaluator.count
    log.info("search: best %.6g ms (%s) after %d generations, %d evaluations, %.2f s; stopped: %s",
             res.makespan, origin, run.gen, evaluations, wall, run.stopped)
    return SearchResult(schedule, res.makespan, res.peak_memory_max, res.bubble_ratio, res.fits_memory,
                        origin, lb, problem.memory_limit_mb, problem.memory_limit_source, run.library, run.gen,
                        evaluations, wall, run.stopped, run.interrupted, run.population.history, per_placement,
                        problem.kinds, {kind: problem.lower_bound_of(kind) for kind in problem.kinds},
                        run.library_skipped, choice.spread, choice.required_gain)


def _seed_batches(problem: SearchProblem, seeds_lib: Sequence[LibraryRow], cfg: GAConfig, rng: random.Random,
                  size: int) -> Iterator[list[Job]]:
    """The seeds (part index, orders, origin) in batches of `size`, each made only when the one
    before was asked for: library schedules, greedy orders, random orders."""
    batch: list[Job] = []
    for job in _seeds(problem, seeds_lib, cfg, rng):
        batch.append(job)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _seeds(problem: SearchProblem, seeds_lib: Sequence[LibraryRow], cfg: GAConfig, rng: random.Random
           ) -> Iterator[Job]:
    yield from _library_seeds(problem, seeds_lib)
    if cfg.greedy:
        for idx, part in enumerate(problem.searched_parts):
            for pol in policies(part.placement.p, part.placement.chunks_per_rank, part.sim.backward):
                orders = greedy_orders(part, pol)
                if orders is not None:
                    yield idx, orders, pol.label() + f" {part.placement.describe()}"
    for k in range(cfg.random_orders):
        idx = k % len(problem.parts)
        part = problem.parts[idx]
        sched = random_schedule(part.placement, problem.m, part.backward, seed=rng.randrange(2 ** 31))
        yield idx, part.orders_of(sched), "random order"


def _library_seeds(problem: SearchProblem, rows: Sequence[LibraryRow]) -> Iterator[Job]:
    """Seeds from library schedules: each seeds every part of its placement that admits it (a
    full-backward schedule seeds the split part too, as I + W)."""
    for row in rows:
        sched = row.schedule
        assert sched is not None
        problem.part_for(sched.placement)  # adds its parts when its placement is not searched
        for idx, part in enumerate(problem.parts):
            if part.admits(sched):
                as_split = " as I + W" if part.backward != sched.backward else ""  # a full B run split
                yield idx, part.orders_of(sched), f"library {row.name}{as_split}"

