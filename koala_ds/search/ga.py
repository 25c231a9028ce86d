"""The Dynamic Try-Test genetic algorithm over BTT walks, and the top-level `search()`.

Population: every library schedule valid for the configuration, the greedy list scheduler's
walks (one per tie-break policy), and random walks. Each generation makes `trials` children
(crossover of two tournament winners, then a mutation of `strength` moves on the BTT choice
sequence), *try-tests* each on the simulator (the decoder repairs local order and memory; a
child that still deadlocks is rejected) and keeps the best `size` distinct walks. Each
generation also polishes the best unpolished walk with the timeline-guided local search
(`local.py`) and makes one iterated-local-search step (kick + descent) from one of the best four.

The dynamic rule (documented in docs/search.md):
- strength follows the 1/5 success rule: after a generation that improved the best walk it is
  divided by 1.5, otherwise multiplied by 1.5 ** (1/4) (so it is steady when one generation in
  five succeeds), and kept in [1, strength_max];
- trials (the try-test rate, children tested per generation) resets to its base after an
  improvement and doubles (up to 8x) after every `patience` generations without one;
- after 4 * patience generations without improvement the worse half of the population is
  replaced by strongly mutated copies of the best walks (a restart), and strength resets.
"""
from __future__ import annotations

import logging
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .. import library
from ..ir import KoalaError, Schedule
from ..sim import random_schedule, simulate
from .encoding import W_K
from .greedy import greedy_walk, policies
from .local import LocalSearch
from .problem import INFEASIBLE, SearchError, SearchProblem, relative_gap, weight_copies

log = logging.getLogger(__name__)


@dataclass
class Individual:
    part: int                      # index into problem.parts
    tokens: list[list[int]]
    makespan: float
    peak: float
    origin: str
    key: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = (self.part, tuple(tuple(t) for t in self.tokens))


@dataclass
class LibraryRow:
    """One library schedule valid for the configuration, as simulated under the search's profile."""

    name: str
    schedule: Schedule | None
    makespan: float
    peak: float
    bubble: float
    fits: bool
    note: str = ""
    weight_copies: int = 1      # 2 for bidirectional schedules (Chimera): two copies of the weights
    comparable: bool = True     # counts as a "predefined schedule" competitor of the search result

    @property
    def eligible(self) -> bool:
        """Fits the memory limit and is a fair competitor (one copy of the weights, unless the
        search itself was allowed two)."""
        return self.fits and self.comparable


def best_predefined(rows: Sequence[LibraryRow]) -> LibraryRow | None:
    """The fastest library schedule that fits the limit and keeps as many copies of the weights
    as the search was allowed (so Chimera counts only when bidirectional placements are)."""
    ok = [r for r in rows if r.eligible]
    return min(ok, key=lambda r: (r.makespan, r.name)) if ok else None


@dataclass
class SearchResult:
    """The search's answer and what it measured."""

    schedule: Schedule
    makespan: float
    peak: float
    bubble: float
    fits: bool
    origin: str                      # which seed or generation found it
    lower_bound: float
    memory_limit: float | None
    memory_limit_source: str
    library: list[LibraryRow]
    generations: int
    evaluations: int
    wall_s: float
    stopped: str                     # lower-bound | time | generations | interrupted
    interrupted: bool = False
    history: list[tuple[float, float]] = field(default_factory=list)  # (seconds, best makespan)
    per_placement: list[tuple[Schedule, float]] = field(default_factory=list)  # best of each placement and kind
    kinds: tuple[str, ...] = ("split",)   # the backward kinds searched (two with --backward auto)
    kind_bounds: dict[str, float] = field(default_factory=dict)  # the lower bound of each kind
    library_skipped: list[str] = field(default_factory=list)  # library schedules not simulated: out of time

    def best_for(self, placement, backward: str | None = None) -> Schedule | None:
        """The best schedule found for `placement` (of backward kind `backward`; None: either)."""
        found = [(ms, sched) for sched, ms in self.per_placement
                 if sched.placement.stage_ranks == placement.stage_ranks
                 and sched.placement.pipelines == placement.pipelines
                 and (backward is None or sched.backward == backward)]
        return min(found, key=lambda x: x[0])[1] if found else None

    def best_of_kind(self, backward: str) -> float | None:
        """The best makespan the search found among schedules of one backward kind."""
        found = [ms for sched, ms in self.per_placement if sched.backward == backward]
        return min(found) if found else None

    @property
    def gap(self) -> float:
        return relative_gap(self.makespan, self.lower_bound)


# -- library seeds ------------------------------------------------------------------------
def library_rows(problem: SearchProblem, out_of_time: Callable[[float], bool] | None = None,
                 skipped: list[str] | None = None) -> list[LibraryRow]:
    """Every library schedule valid for (p, m, v) and the backward mode, simulated as written.

    With `out_of_time` (given the seconds still needed: the next schedule, and about as much for
    one seed and the closing work), stops when it returns True once a row is in; the names not
    simulated go to `skipped`."""
    rows: list[LibraryRow] = []
    names = library.names()
    step = 0.0
    for i, name in enumerate(names):
        if out_of_time is not None and rows and out_of_time(2 * step):  # the next, and a seed
            if skipped is not None:
                skipped += names[i:]
            break
        started = time.perf_counter()
        _library_row(problem, name, rows)
        step = time.perf_counter() - started
    rows.sort(key=lambda r: (r.makespan, r.name))
    return rows


def _library_row(problem: SearchProblem, name: str, rows: list[LibraryRow]) -> None:
    """Append the row of library schedule `name` when it is valid and simulates."""
    try:
        program = library.get(name)
        reason = program.supports(problem.p, problem.m, problem.v)
    except KoalaError as exc:
        log.info("library %s skipped: %s", name, exc)
        return
    if reason is not None:
        return
    try:
        schedule = program.compile(problem.p, problem.m, problem.v)
    except KoalaError as exc:
        log.info("library %s does not compile for p=%d m=%d v=%d: %s", name, problem.p, problem.m, problem.v,
                 str(exc).splitlines()[0])
        return
    if schedule.backward == "split" and "split" not in problem.kinds:
        return
    try:
        res = simulate(schedule, problem.search_profile, timeline=False)
    except KoalaError as exc:
        log.info("library %s does not simulate: %s", name, str(exc).splitlines()[0])
        return
    copies = weight_copies(schedule.placement)
    rows.append(LibraryRow(name, schedule, res.makespan, res.peak_memory_max, res.bubble_ratio, res.fits_memory,
                           note="2x weights" if copies > 1 else "", weight_copies=copies,
                           comparable=copies == 1 or problem.allows_two_copies))


# -- variation operators ------------------------------------------------------------------
def _move(tokens: list[int], rng: random.Random, scale: float) -> None:
    n = len(tokens)
    if n < 2:
        return
    i = rng.randrange(n)
    d = max(1, int(rng.expovariate(1.0 / scale)) + 1)
    j = i + d if rng.random() < 0.5 else i - d
    j = min(max(j, 0), n - 1)
    if i == j:
        return
    t = tokens.pop(i)
    tokens.insert(j, t)


def _swap(tokens: list[int], rng: random.Random) -> None:
    n = len(tokens)
    if n < 2:
        return
    for _ in range(4):
        i = rng.randrange(n - 1)
        if tokens[i] != tokens[i + 1]:
            tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
            return


def _shift_w(tokens: list[int], rng: random.Random, chunks: int, scale: float) -> None:
    ws = [i for i, t in enumerate(tokens) if t // chunks == W_K]
    if not ws:
        _move(tokens, rng, scale)
        return
    i = rng.choice(ws)
    d = max(1, int(rng.expovariate(1.0 / scale)) + 1)
    j = min(max(i + (d if rng.random() < 0.5 else -d), 0), len(tokens) - 1)
    t = tokens.pop(i)
    tokens.insert(j, t)


def mutate(tokens: list[list[int]], rng: random.Random, strength: float, chunks: int) -> list[list[int]]:
    out = [list(t) for t in tokens]
    moves = max(1, int(rng.expovariate(1.0 / strength)) + 1) if strength > 1 else 1
    focus = rng.randrange(len(out))
    for _ in range(moves):
        r = focus if rng.random() < 0.6 else rng.randrange(len(out))
        x = rng.random()
        if x < 0.4:
            _move(out[r], rng, 2.0 + strength)
        elif x < 0.7:
            _swap(out[r], rng)
        else:
            _shift_w(out[r], rng, chunks, 2.0 + strength)
    return out


def crossover(a: list[list[int]], b: list[list[int]], rng: random.Random) -> list[list[int]]:
    """Per rank: take the walk of a or of b; one rank gets an order crossover (a's prefix, then
    the rest of its tokens in b's order)."""
    child = [list(x) if rng.random() < 0.5 else list(y) for x, y in zip(a, b)]
    r = rng.randrange(len(a))
    x, y = a[r], b[r]
    if x and len(x) == len(y):
        cut = rng.randrange(len(x))
        prefix = x[:cut]
        counts: dict[int, int] = {}
        for t in prefix:
            counts[t] = counts.get(t, 0) + 1
        rest = []
        for t in y:
            if counts.get(t, 0):
                counts[t] -= 1
            else:
                rest.append(t)
        child[r] = prefix + rest
    return child


# -- parallel try-test --------------------------------------------------------------------
_WORKER: SearchProblem | None = None


def _exit_with_parent(parent: int) -> None:
    """End this worker when the search process dies (kill -9 included), instead of leaving it and
    multiprocessing's resource tracker running as orphans: Linux's parent-death signal, and a
    thread that polls the parent elsewhere (and covers a parent that died before the call)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="koala-parent-watch", daemon=True).start()


def _worker_init(args: tuple, parent: int | None = None) -> None:
    global _WORKER
    # Ctrl-C goes to the whole process group: only the search process answers it (with the best
    # schedule so far); a worker ignores it and finishes its batch, then exits with the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        _exit_with_parent(parent)
    profile, p, m, v, backward, limit, placements = args
    _WORKER = SearchProblem(profile, p, m, v, backward, limit, placements)


def _worker_eval(job: tuple[int, list[list[int]]]) -> tuple[float, float, list[list[int]]]:
    assert _WORKER is not None
    ev = _WORKER.parts[job[0]].evaluate(job[1])
    return ev.makespan, ev.peak, ev.tokens


class _Evaluator:
    def __init__(self, problem: SearchProblem, workers: int):
        self.problem = problem
        self.pool = None
        self.count = 0
        self.seconds = 0.0  # wall time of the calls, for the mean time of one try-test
        if workers > 1:
            import concurrent.futures as cf
            import multiprocessing as mp

            limit = problem.memory_limit if problem.memory_limit is not None else list(problem.limits)
            if isinstance(limit, list) and len(set(limit)) == 1:
                limit = limit[0]
            placements = list({(pt.placement.stage_ranks, pt.placement.pipelines): pt.placement
                               for pt in problem.parts}.values())
            args = (problem.profile if problem.memory_limit is not None else problem.search_profile,
                    problem.p, problem.m, problem.v, problem.backward,
                    limit if not isinstance(limit, list) else None, placements)
            self.pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                               initializer=_worker_init, initargs=(args, os.getpid()))
            self.workers = workers
            self.started = False

    def _start_workers(self) -> None:
        """Start every worker now, with SIGINT ignored while they are created: they inherit that,
        so a Ctrl-C while they import is not theirs either (no worker tracebacks)."""
        self.started = True
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set in the main thread; the initializer still ignores SIGINT
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for _ in range(self.workers):
                self.pool.submit(os.getpid)
        finally:
            signal.signal(signal.SIGINT, old)

    def __call__(self, jobs: list[tuple[int, list[list[int]]]], out_of_time: Callable[[], bool] | None = None
                 ) -> list[tuple[float, float, list[list[int]]]]:
        """The results of `jobs`, in order; with `out_of_time`, of a prefix of them: it stops
        when that returns True (one job or one round of the pool at a time)."""
        t0 = time.perf_counter()
        try:
            return self._run(jobs, out_of_time)
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    def _run(self, jobs: list[tuple[int, list[list[int]]]], out_of_time: Callable[[], bool] | None
             ) -> list[tuple[float, float, list[list[int]]]]:
        if out_of_time is not None:
            step = 1 if self.pool is None else 2 * self.workers
            out: list = []
            for i in range(0, len(jobs), step):
                if i and out_of_time():
                    break
                out += self._run(jobs[i:i + step], None)
            return out
        self.count += len(jobs)
        if self.pool is None or len(jobs) < 4:
            out = []
            for part, toks in jobs:
                ev = self.problem.parts[part].evaluate(toks)
                out.append((ev.makespan, ev.peak, ev.tokens))
            return out
        if not self.started:
            self._start_workers()
        chunk = max(1, len(jobs) // (self.workers * 2))
        return list(self.pool.map(_worker_eval, jobs, chunksize=chunk))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


# -- the search ---------------------------------------------------------------------------
@dataclass
class GAConfig:
    population: int = 24
    trials: int = 4              # base try-test count per generation (plus one polish and one kick)
    strength_max: float = 24.0
    patience: int = 15
    crossover_rate: float = 0.3
    random_walks: int = 4
    greedy: bool = True
    local_search: bool = True    # timeline-guided descent (koala_ds/search/local.py) on the best walks
    local_seeds: int = 2         # seeds polished per placement before the first generation
    local_evals: int = 4000      # evaluation cap of one descent
    kick_strengths: tuple[float, ...] = (1.5, 3.0, 6.0)  # an iterated-local-search kick's mutation strength:
                                                          # one of these, at random (small and large kicks)


def search(problem: SearchProblem, *, time_budget: float | None = 10.0, generations: int | None = None,
           seed: int = 0, workers: int = 1, progress: bool = False, config: GAConfig | None = None,
           on_generation: Callable[[int, float], None] | None = None, started: float | None = None
           ) -> SearchResult:
    """Search the schedule space of `problem`; the best schedule found within the budgets.

    Deterministic for a given `seed` when `time_budget` is None (a generation budget) or does
    not bind: the random stream and the evaluation order do not depend on timing or workers.
    Ctrl-C (KeyboardInterrupt) ends the search and returns the best schedule so far.

    The time budget counts from `started` (a `time.perf_counter()` value; default: now) and
    binds every phase: the library schedules, the seeds (library, greedy, random walks: each
    is made and try-tested only while time is left, once one seed is in), the polish and the
    generations."""
    if time_budget is not None and not (0 < time_budget < math.inf):
        raise SearchError(f"--time-budget must be a finite number of seconds > 0, got {time_budget}")
    if generations is not None and generations < 0:
        raise SearchError(f"--generations must be >= 0, got {generations}")
    if workers < 1:
        raise SearchError(f"--workers must be >= 1, got {workers}")
    cfg = config or GAConfig()
    t0 = time.perf_counter() if started is None else started
    rng = random.Random(seed)
    lib: list[LibraryRow] = []
    lib_skipped: list[str] = []
    seeds_lib: list[LibraryRow] = []
    lb = problem.lower_bound
    row_seconds = 0.0  # the mean time of one library schedule (compile and simulate)
    stop_at = lb * (1 + 1e-9)
    evaluator = _Evaluator(problem, workers)
    pop: list[Individual] = []
    seen: dict[tuple, float] = {}
    history: list[tuple[float, float]] = []
    best: Individual | None = None
    interrupted = False
    stopped = "generations"
    gen = 0
    bar = None

    part_best: dict[int, Individual] = {}

    def consider(ind: Individual) -> bool:
        nonlocal best
        if ind.key in seen or ind.makespan == INFEASIBLE:
            return False
        seen[ind.key] = ind.makespan
        pop.append(ind)
        if ind.part not in part_best or ind.makespan < part_best[ind.part].makespan:
            part_best[ind.part] = ind
        if best is None or ind.makespan < best.makespan - 1e-12:
            best = ind
            history.append((time.perf_counter() - t0, ind.makespan))
            return True
        return False

    def out_of_time(next_step: float = 0.0) -> bool:
        """True when the budget cannot take `next_step` more seconds and the closing work: the
        result's and each placement's best built as a schedule again, each about as long as a
        library schedule took to compile and simulate (at most a quarter of the budget)."""
        if time_budget is None:
            return False
        closing = min(time_budget / 4, (len(problem.parts) + 1) * row_seconds + 2 * evaluator.mean_seconds)
        return time.perf_counter() - t0 + next_step + closing >= time_budget

    searchers: dict[int, LocalSearch] = {}
    polished: set[tuple] = set()

    def polish(ind: Individual, origin: str, kick: bool = False,
               deadline: Callable[[], bool] = out_of_time) -> tuple[bool, Individual | None]:
        """Local search from `ind` (after a random kick when `kick`): (whether it found a new
        best, the walk it ended at)."""
        polished.add(ind.key)
        part = problem.parts[ind.part]
        ls = searchers.get(ind.part)
        if ls is None:
            ls = searchers[ind.part] = LocalSearch(part)
        toks = ind.tokens
        if kick:
            # through the decoder, which repairs a kick that deadlocks
            strength = rng.choice(cfg.kick_strengths)
            ev = part.evaluate(mutate(toks, rng, strength, part.placement.chunks_per_rank))
            evaluator.count += 1
            if ev.makespan == INFEASIBLE:
                return False, None
            toks = ev.tokens
        before = ls.evaluations
        res = ls.descend(toks, rng, deadline, cfg.local_evals)
        evaluator.count += ls.evaluations - before
        if res is None:
            return False, None
        ev = part.evaluate(res.tokens)
        new = Individual(ind.part, ev.tokens, ev.makespan, ev.peak, origin)
        polished.add(new.key)
        return consider(new), new

    try:
        phase = time.perf_counter()
        lib += library_rows(problem, out_of_time, lib_skipped)
        row_seconds = (time.perf_counter() - phase) / max(1, len(lib))
        # library schedules seed the search when their placement is one the problem searches
        seeds_lib += [row for row in lib if row.schedule is not None and problem.allows(row.schedule.placement)]
        # seeds: library, greedy, random walks; made and try-tested in turn while time is left
        seeding, made = time.perf_counter(), 0
        for batch in _seed_batches(problem, seeds_lib, cfg, rng, 2 * workers if workers > 1 else 1):
            for (idx, _, origin), (ms, pk, toks) in zip(batch, evaluator([(i, w) for i, w, _ in batch])):
                consider(Individual(idx, toks, ms, pk, origin))
            made += 1
            if best is not None and out_of_time((time.perf_counter() - seeding) / made):
                break
        if best is None:
            raise SearchError("no seed schedule fits the memory limit and runs without deadlock; "
                              "raise --memory-limit")
        pop.sort(key=lambda x: x.makespan)
        if cfg.local_search and best.makespan > stop_at:
            # polish the best seeds of each placement (at most half of the wall-clock budget)
            half = (lambda: time.perf_counter() - t0 >= time_budget / 2) if time_budget is not None \
                else (lambda: False)
            firsts = []
            for idx in range(len(problem.parts)):
                firsts += [x for x in pop if x.part == idx][:cfg.local_seeds]
            firsts.sort(key=lambda x: x.makespan)
            for ind in firsts:
                if half() or best.makespan <= stop_at:
                    break
                polish(ind, f"{ind.origin} + local search", deadline=half)
            pop.sort(key=lambda x: x.makespan)
        del pop[cfg.population:]
        if progress:
            try:
                from tqdm import tqdm
                bar = tqdm(total=generations, desc="koala search", unit="gen", file=sys.stderr, leave=False,
                           dynamic_ncols=True, disable=None)  # None: off when stderr is not a terminal
            except ImportError:  # pragma: no cover
                bar = None
        strength = 2.0
        trials = cfg.trials
        since = 0
        walker: Individual | None = None
        while True:
            if best.makespan <= stop_at:
                stopped = "lower-bound"
                break
            if generations is not None and gen >= generations:
                stopped = "generations"
                break
            if out_of_time():
                stopped = "time"
                break
            gen += 1
            children = []
            for _ in range(trials):
                a = _tournament(pop, rng)
                toks = a.tokens
                if rng.random() < cfg.crossover_rate:
                    mates = [x for x in pop if x.part == a.part and x is not a]
                    if mates:
                        b = _tournament(mates, rng)
                        toks = crossover(a.tokens, b.tokens, rng)
                chunks = problem.parts[a.part].placement.chunks_per_rank
                # exploit: a share of the children are one-move neighbours of the best walk
                if rng.random() < 0.25 and a.part == best.part:
                    toks = mutate(best.tokens, rng, 1.0, chunks)
                else:
                    toks = mutate(toks, rng, strength, chunks)
                children.append((a.part, toks))
            improved = False
            for (idx, _), (ms, pk, toks) in zip(children, evaluator(children, out_of_time)):
                if consider(Individual(idx, toks, ms, pk, f"generation {gen}")):
                    improved = True
            if cfg.local_search:
                pop.sort(key=lambda x: x.makespan)
                # polish the best walk not yet polished, then one iterated-local-search kick
                fresh_top = [x for x in pop[:3] if x.key not in polished]
                if fresh_top and polish(fresh_top[0], f"generation {gen} + local search")[0]:
                    improved = True
                # the iterated local search walks on: it kicks the walk it last accepted, and
                # accepts a result no worse than it (so it drifts across plateaus)
                if walker is None or walker.makespan > best.makespan + 1e-12:
                    walker = best
                if not out_of_time():
                    found, new = polish(walker, f"generation {gen} kick + local search", kick=True)
                    improved = improved or found
                    if new is not None and new.makespan <= walker.makespan + 1e-12:
                        walker = new
            pop.sort(key=lambda x: x.makespan)
            del pop[cfg.population:]
            if improved:
                strength = max(1.0, strength / 1.5)
                trials = cfg.trials
                since = 0
            else:
                strength = min(cfg.strength_max, strength * 1.5 ** 0.25)
                since += 1
                if since % cfg.patience == 0:
                    trials = min(cfg.trials * 8, trials * 2)
                if since % (4 * cfg.patience) == 0:
                    keep = pop[: max(2, len(pop) // 2)]
                    fresh = []
                    for _ in range(len(pop) - len(keep)):
                        a = rng.choice(keep[:4])
                        fresh.append((a.part, mutate(a.tokens, rng, cfg.strength_max,
                                                     problem.parts[a.part].placement.chunks_per_rank)))
                    pop[:] = keep
                    for (idx, _), (ms, pk, toks) in zip(fresh, evaluator(fresh, out_of_time)):
                        consider(Individual(idx, toks, ms, pk, f"restart {gen}"))
                    strength = 2.0
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"best {best.makespan:.6g} ms, gap {best.makespan / lb - 1:+.2%}"
                                    if lb > 0 else f"best {best.makespan:.6g} ms")
            if on_generation is not None:
                on_generation(gen, best.makespan)
    except KeyboardInterrupt:
        interrupted = True
        stopped = "interrupted"
        if best is None:
            raise
    finally:
        evaluator.close()
        if bar is not None:
            bar.close()
    assert best is not None
    part = problem.parts[best.part]
    # the repaired walk's own codes
    ev = part.evaluate(best.tokens)
    schedule = own = part.schedule(ev.codes, "searched")
    res = part.sim.run(schedule.ranks, timeline=False)
    chosen_makespan, origin = res.makespan, best.origin
    fit_lib = sorted((row for row in seeds_lib if row.fits), key=lambda r: (r.makespan, r.name))
    if fit_lib and fit_lib[0].makespan <= chosen_makespan + 1e-9 and fit_lib[0].schedule is not None:
        # the decoder takes microbatches in order, so a library order that does not may still
        # win; and on a tie the known schedule is the better answer (nothing faster was found)
        schedule = fit_lib[0].schedule
        res = simulate(schedule, problem.search_profile, timeline=False)
        chosen_makespan, origin = res.makespan, f"library {fit_lib[0].name}"
    schedule = schedule.with_name("searched")
    schedule.meta["description"] = (f"found by koala search: makespan {chosen_makespan:.6g} ms under "
                                    f"{problem.profile.source}, lower bound {lb:.6g} ms")
    per_placement = []
    for idx, part_i in enumerate(problem.parts):
        if idx not in part_best:
            continue
        top = part_best[idx]
        if top is best:
            per_placement.append((own, top.makespan))
            continue
        ev_i = part_i.evaluate(top.tokens)
        per_placement.append((part_i.schedule(ev_i.codes, "searched"), top.makespan))
    wall = time.perf_counter() - t0
    log.info("search: best %.6g ms (%s) after %d generations, %d evaluations, %.2f s; stopped: %s",
             chosen_makespan, origin, gen, evaluator.count, wall, stopped)
    return SearchResult(schedule, chosen_makespan, res.peak_memory_max, res.bubble_ratio, res.fits_memory,
                        origin, lb, problem.memory_limit_mb, problem.memory_limit_source, lib, gen,
                        evaluator.count, wall, stopped, interrupted, history, per_placement, problem.kinds,
                        {kind: problem.lower_bound_of(kind) for kind in problem.kinds}, lib_skipped)


def _seed_batches(problem: SearchProblem, seeds_lib: Sequence[LibraryRow], cfg: GAConfig, rng: random.Random,
                  size: int) -> Iterator[list[tuple[int, list[list[int]], str]]]:
    """The seed walks (part index, walk, origin) in batches of `size`, each made only when the
    one before was asked for: library schedules, greedy walks, random walks."""
    batch: list[tuple[int, list[list[int]], str]] = []
    for job in _seed_walks(problem, seeds_lib, cfg, rng):
        batch.append(job)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _seed_walks(problem: SearchProblem, seeds_lib: Sequence[LibraryRow], cfg: GAConfig, rng: random.Random
                ) -> Iterator[tuple[int, list[list[int]], str]]:
    yield from _library_jobs(problem, seeds_lib)
    if cfg.greedy:
        for idx, part in enumerate(problem.searched_parts):
            for pol in policies(part.placement.p, part.placement.chunks_per_rank, part.sim.backward):
                walk = greedy_walk(part, pol)
                if walk is not None:
                    yield idx, walk, pol.label() + f" {part.placement.describe()}"
    for k in range(cfg.random_walks):
        idx = k % len(problem.parts)
        part = problem.parts[idx]
        sched = random_schedule(part.placement, problem.m, part.backward, seed=rng.randrange(2 ** 31))
        yield idx, part.tokens_of(sched), "random walk"


def _library_jobs(problem: SearchProblem, rows: Sequence[LibraryRow]
                  ) -> Iterator[tuple[int, list[list[int]], str]]:
    """Seed walks from library schedules: each seeds every part of its placement that admits it (a
    full-backward schedule seeds the split part too, as I + W)."""
    for row in rows:
        sched = row.schedule
        assert sched is not None
        problem.part_for(sched.placement)  # adds its parts when its placement is not searched
        for idx, part in enumerate(problem.parts):
            if part.admits(sched):
                yield idx, part.tokens_of(sched), f"library {row.name}"


def _tournament(pop: Sequence[Individual], rng: random.Random, k: int = 3) -> Individual:
    best = None
    for _ in range(k):
        x = pop[rng.randrange(len(pop))]
        if best is None or x.makespan < best.makespan:
            best = x
    assert best is not None
    return best
