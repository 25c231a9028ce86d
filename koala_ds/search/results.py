"""The search's answer (`SearchResult`) and the library schedules it is compared with (`LibraryRow`)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .. import library
from ..core.ir import KoalaError, Schedule
from ..sim import simulate
from .problem import SearchProblem, relative_gap, weight_copies

log = logging.getLogger(__name__)


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
    # the profile's spread on the makespans compared for the answer (None: the profile gives none),
    # and the gain a schedule needed over a simpler one: the larger of it and min_gain (ga._answer)
    spread: float | None = None
    required_gain: float = 0.0

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
