"""Local search guided by the simulated timeline (critical path and idle gaps).

The GA's mutations are blind; near the optimum almost every random move makes a schedule worse
or leaves the makespan unchanged. This module improves one candidate (every rank's order as BTT
choices) by moves that the timeline says can matter:

- **critical path**: go back from the action that ends last; each action on the path either
  started when the previous action of its rank ended (*rank-bound*) or when its input arrived
  (*dependency-bound*). For every rank-bound link Y -> X the only ways to start X earlier are to
  move X before Y (1..K places earlier) or to move Y after X (1..K places later: a W shifted
  into a later bubble, or a forward that was taken too early);
- **idle gaps**: for an action that waits for its input, move one of the next K actions of
  its rank in front of it (an F whose input is there, or a W) to fill the gap;
- **chains**: when no single move helps, move a microbatch's forward (or input-gradient
  step) on *every* stage by the same number of places; a microbatch that should go earlier
  must go earlier on every rank it visits, and one rank alone changes nothing (a plateau);
- moves act on the BTT choices; the decoder repairs them (a move that breaks a local
  dependency or the memory limit is deferred to where it can run), so every candidate is valid.

Candidates are compared on (makespan, sum of the ranks' finish times): the second term lets the
search cross the plateaus where no single move shortens the makespan but one rank finishes
earlier, which gives the critical path slack. Both terms only decrease, so the search ends.

The timeline is the simulator's asynchronous model, read from the configuration's lowered
tables (`koala_ds.core.lowered`: durations, and the slot each action waits for with its latency).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.lowered import W, Stall, action_code, split_code
from .problem import PlacementProblem

log = logging.getLogger(__name__)

EPS = 1e-9


@dataclass
class LocalResult:
    choices: list[list[int]]   # every rank's order as BTT choices
    codes: list[list[int]]
    makespan: float
    evaluations: int
    moves: int



def _improves(new: tuple[float, float], cur: tuple[float, float]) -> bool:
    """(makespan, sum of finish times) lower, lexicographically, beyond float noise."""
    return new[0] < cur[0] - EPS or (new[0] <= cur[0] + EPS and new[1] < cur[1] - EPS)


Move = tuple[int, int, int]   # (rank, from index, to index)
Chain = tuple[tuple[int, int, int], ...]   # (rank, index, shift) for each moved action


class LocalSearch:
    """Descent on (makespan, sum of finish times) with timeline-guided moves."""

    def __init__(self, part: PlacementProblem, reach: int = 3, gap_reach: int = 4, chains: bool = True):
        self.part = part
        self.chains = chains
        self.lowered = part.sim.lowered
        self.reach = reach
        self.gap_reach = gap_reach
        self.limits = part.decoder.limits
        self.evaluations = 0

    # -- evaluation ---------------------------------------------------------------------
    def decode(self, rank: int, choices: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """(repaired choices, codes) of one rank; None over its memory limit."""
        repaired, codes, peak = self.part.decoder.decode_rank_nocache(rank, choices)
        if peak > self.limits[rank]:
            return None
        return repaired, codes

    def times(self, codes: Sequence[Sequence[int]]) -> tuple[list[float], list[list[float]]] | None:
        """(finish time of each rank, start time of each action per rank), or None on a deadlock."""
        res = self.lowered.try_times(codes)
        return None if isinstance(res, Stall) else res

    def key(self, codes: Sequence[Sequence[int]]) -> tuple[float, float] | None:
        self.evaluations += 1
        res = self.times(codes)
        if res is None:
            return None
        free = res[0]
        return max(free), sum(free)

    # -- moves --------------------------------------------------------------------------
    def critical_moves(self, codes: list[list[int]], starts: list[list[float]], free: list[float]) -> list[Move]:
        low = self.lowered
        dep, lat, out = low.dep, low.dep_lat, low.out
        dur = [low.durations(order) for order in codes]  # per rank and position (switch costs)
        filled = {}   # slot -> (rank, index) of the action that fills it
        for r, order in enumerate(codes):
            for i, c in enumerate(order):
                if out[c] >= 0:
                    filled[out[c]] = (r, i)
        r = max(range(len(free)), key=lambda q: free[q])
        i = len(codes[r]) - 1
        moves: list[Move] = []
        K = self.reach
        steps = 0
        while i >= 0 and steps < 100000:
            steps += 1
            c = codes[r][i]
            st = starts[r][i]
            prev_end = starts[r][i - 1] + dur[r][i - 1] if i > 0 else 0.0
            d = dep[c]
            arrival = -1.0
            if d >= 0 and d in filled:
                q, j = filled[d]
                arrival = starts[q][j] + dur[q][j] + lat[c]
            if d >= 0 and arrival >= prev_end - EPS and arrival >= st - EPS:
                r, i = filled[d]     # dependency-bound: the path continues at the producer
                continue
            if i == 0:
                break
            # rank-bound link (r, i-1) -> (r, i)
            for k in range(1, K + 1):
                if i - k >= 0:
                    moves.append((r, i, i - k))
                if i - 1 + k < len(codes[r]):
                    moves.append((r, i - 1, i - 1 + k))
            i -= 1
        return moves

    def gap_moves(self, codes: list[list[int]], starts: list[list[float]]) -> list[Move]:
        moves: list[Move] = []
        for r, order in enumerate(codes):
            dur = self.lowered.durations(order)
            for i in range(1, len(order)):
                if starts[r][i] > starts[r][i - 1] + dur[i - 1] + EPS:
                    for k in range(1, self.gap_reach + 1):
                        if i + k < len(order):
                            moves.append((r, i + k, i))
        return moves

    def chain_moves(self, codes: list[list[int]], starts: list[list[float]], free: list[float]) -> list[Chain]:
        """For each rank-bound link Y -> X of the critical path: X's microbatch, X's op kind, on
        every stage, 1..K places earlier; and Y's, 1..K places later."""
        S, m = self.lowered.num_stages, self.lowered.m
        where = {}
        for r, order in enumerate(codes):
            for i, c in enumerate(order):
                where[c] = (r, i)
        out: list[Chain] = []
        seen = set()
        for r, i, j in self.critical_moves(codes, starts, free):
            c = codes[r][i]
            kind, _, mb = split_code(c, S, m)
            d = j - i
            if (kind, mb, d) in seen or kind == W:
                continue
            seen.add((kind, mb, d))
            chain = []
            for st in range(S):
                loc = where.get(action_code(kind, st, mb, S, m))
                if loc is not None:
                    chain.append((loc[0], loc[1], d))
            if len(chain) > 1:
                out.append(tuple(chain))
        return out

    @staticmethod
    def apply(choices: list[int], shifts: list[tuple[int, int]]) -> list[int]:
        """Move choice i by d places for each (i, d), all at once (positions of the old list)."""
        key = [float(k) for k in range(len(choices))]
        for i, d in shifts:
            key[i] = i + d + (-0.5 if d < 0 else 0.5)
        return [t for _, t in sorted(zip(key, choices), key=lambda x: x[0])]

    # -- descent ------------------------------------------------------------------------
    def descend(self, choices: Sequence[Sequence[int]], rng: random.Random,
                deadline: Callable[[], bool], max_evals: int | None = None) -> LocalResult | None:
        """First-improvement descent from `choices` (every rank's); None when they do not evaluate."""
        cur_t, cur_c = [], []
        for r, t in enumerate(choices):
            d = self.decode(r, t)
            if d is None:
                return None
            cur_t.append(d[0])
            cur_c.append(d[1])
        res = self.times(cur_c)
        if res is None:
            return None
        free, starts = res
        cur_key = (max(free), sum(free))
        start_evals = self.evaluations
        moves_done = 0

        def stop() -> bool:
            return deadline() or (max_evals is not None and self.evaluations - start_evals >= max_evals)

        while True:
            found = None
            phases = [lambda: [((r, i, j - i),) for r, i, j in self.critical_moves(cur_c, starts, free)],
                      lambda: [((r, i, j - i),) for r, i, j in self.gap_moves(cur_c, starts)]]
            if self.chains:  # only when no single move helps
                phases.append(lambda: self.chain_moves(cur_c, starts, free))
            for phase in phases:
                cands = list(dict.fromkeys(phase()))
                rng.shuffle(cands)
                for chain in cands:
                    if stop():
                        return LocalResult(cur_t, cur_c, cur_key[0], self.evaluations - start_evals, moves_done)
                    nb = self._neighbour(cur_t, cur_c, chain)
                    if nb is None:
                        continue
                    k = self.key(nb[1])
                    if k is not None and _improves(k, cur_key):
                        found = (nb, k)
                        break
                if found:
                    break
            if found is None:
                return LocalResult(cur_t, cur_c, cur_key[0], self.evaluations - start_evals, moves_done)
            (cur_t, cur_c), cur_key = found
            res = self.times(cur_c)
            assert res is not None
            free, starts = res
            moves_done += 1

    def _neighbour(self, cur_t: list[list[int]], cur_c: list[list[int]], chain: Chain
                   ) -> tuple[list[list[int]], list[list[int]]] | None:
        """(choices, codes) after moving each (rank, index, shift) of `chain`, decoded with
        repair; None when nothing changes or a rank does not decode within its limit."""
        by_rank: dict[int, list[tuple[int, int]]] = {}
        for r, i, d in chain:
            if i < len(cur_t[r]):
                by_rank.setdefault(r, []).append((i, d))
        new_t, new_c = list(cur_t), list(cur_c)
        for r, shifts in by_rank.items():
            moved = self.apply(cur_t[r], shifts)
            if moved == cur_t[r]:
                continue
            dec = self.decode(r, moved)
            if dec is None:
                return None
            new_t[r], new_c[r] = dec
        return None if new_c == cur_c else (new_t, new_c)
