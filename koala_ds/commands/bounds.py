""""over bound", one definition for `koala simulate`, `koala compare` and `koala search`.

The bound is the search's: the least makespan any schedule of the configuration (profile, p, m,
v; the single-copy placements valid for v, full and split backward) can reach within the memory
limit in force, which is --memory-limit, else the profile's `memory_limit_mb`, else 1F1B's peak
(`koala_ds.search.SearchProblem`, docs/search.md). "over bound" is makespan / bound - 1. The
bound says nothing of a schedule that does not fit that limit (such a schedule may beat it):
those show "does not fit" instead of a gap; a two-copy (bidirectional) schedule that beats it
shows "2x weights".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from ..search.problem import SearchError, SearchProblem, relative_gap
from . import cli_words

log = logging.getLogger(__name__)

NO_FIT = "does not fit"


@dataclass(frozen=True)
class ConfigBound:
    value: float
    binding: str
    limits: tuple[float | None, ...]   # per rank, MB
    limit_source: str                  # --memory-limit | the profile | 1F1B's peak

    @property
    def limit_mb(self) -> float | None:
        known = [x for x in self.limits if x is not None]
        return max(known) if known else None

    def fits(self, peaks: Sequence[float]) -> bool:
        return all(lim is None or peak <= lim * (1 + 1e-9) + 1e-9 for peak, lim in zip(peaks, self.limits))

    def over(self, makespan: float, fits: bool, copies: int = 1) -> float | None:
        """The relative gap, or None when the bound does not apply (does not fit, or two copies of
        the weights below it)."""
        gap = relative_gap(makespan, self.value)
        if not fits or (copies > 1 and gap < 0):
            return None
        return gap

    def text(self, makespan: float, fits: bool, copies: int = 1, digits: int = 2) -> str:
        gap = self.over(makespan, fits, copies)
        if gap is None:
            return NO_FIT if not fits else "2x weights"
        return f"{gap:+.{digits}%}"

    def describe(self) -> str:
        lim = self.limit_mb
        within = "no memory limit" if lim is None else f"{lim:.6g} MB per rank ({self.limit_source})"
        return f"lower bound {self.value:.6g} ms (any schedule of this configuration within {within}; {self.binding})"

    def to_dict(self) -> dict:
        return {"value": self.value, "binding": self.binding, "memory_limit_mb": list(self.limits),
                "memory_limit_source": self.limit_source}


def from_problem(problem: SearchProblem) -> ConfigBound:
    """The bound of a search problem (its searched placements and backward kinds)."""
    parts = problem.searched_parts
    best = min(parts, key=lambda part: part.lower_bound)
    return ConfigBound(best.lower_bound, best.lower_bound_binding, tuple(problem.limits),
                       cli_words(problem.memory_limit_source))


def configuration_bound(profile, p: int, m: int, v: int, memory_limit: float | None = None
                        ) -> tuple[ConfigBound, SearchProblem] | None:
    """The bound (and the problem that gives it, whose `search_profile` carries the limit in
    force), or None when the search's model does not apply (the profile's stages are not p * v,
    or the memory limit is below what any schedule needs)."""
    try:
        problem = SearchProblem(profile, p, m, v, "auto", memory_limit)
    except SearchError as exc:
        log.info("no configuration bound: %s", exc)
        return None
    return from_problem(problem), problem
