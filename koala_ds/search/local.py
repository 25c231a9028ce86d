"""Local search guided by the simulated timeline (critical path and idle gaps).

The GA's mutations are blind; near the optimum almost every random move makes a schedule worse
or leaves the makespan unchanged. This module improves one walk by moves that the timeline says
can matter:

- **critical path**: walk back from the action that ends last; each action on the path either
  started when the previous action of its rank ended (*rank-bound*) or when its input arrived
  (*dependency-bound*). For every rank-bound link Y -> X the only ways to start X earlier are to
  move X before Y (1..K places earlier) or to move Y after X (1..K places later: a W shifted
  into a later bubble, or a forward that was taken too early);
- **idle gaps**: for an action that waits for its input, move one of the next K actions of
  its rank in front of it (an F whose input is there, or a W) to fill the gap;
- **chains**: when no single move helps, move a microbatch's forward (or input-gradient
  step) on *every* stage by the same number of places; a microbatch that should go earlier
  must go earlier on every rank it visits, and one rank alone changes nothing (a plateau);
- moves act on the BTT tokens; the decoder repairs them (a move that breaks a local
  dependency or the memory limit is deferred to where it can run), so every candidate is valid.

Candidates are compared on (makespan, sum of the ranks' finish times): the second term lets the
search cross the plateaus where no single move shortens the makespan but one rank finishes
earlier, which gives the critical path slack. Both terms only decrease, so the search ends.
`iterated_local_search` alternates this descent with random kicks (a few BTT mutations),
keeping the best walk.

The timeline here is the simulator's asynchronous model (`koala_ds.sim.simulator`): an action
starts when its rank is free and its input has arrived (`p2p_latency` after it was computed on
another rank); tests check that the makespans agree with `Simulator.makespan`.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..sim.simulator import Stall
from .encoding import W_K
from .problem import PlacementProblem

log = logging.getLogger(__name__)

EPS = 1e-9


class Timing:
    """Start times from the simulator (async mode), plus each code's duration, dependency and
    latency for the critical-path analysis of the moves."""

    def __init__(self, part: PlacementProblem):
        sim, pl = part.sim, part.placement
        S, m = pl.num_stages, sim.m
        costs = sim.profile.stage_costs(S, pl.pipelines)
        lat = float(sim.profile.p2p_latency)
        split = sim.backward == "split"
        n = 4 * S * m
        self.dur = [0.0] * n
        self.dep = [-1] * n      # the code whose output this action needs (another stage), -1 if none
        self.lat = [0.0] * n     # latency on that dependency
        ranks = pl.stage_ranks
        bk = 2 if split else 1   # the backward kind that passes the gradient on: I (split) or B (full)
        for s in range(S):
            c = costs[s]
            prev, nxt = pl.prev_stage(s), pl.next_stage(s)
            for mb in range(m):
                f, b, i, w = ((k * S + s) * m + mb for k in range(4))
                self.dur[f], self.dur[b] = c.forward, c.backward
                self.dur[i], self.dur[w] = c.backward_input, c.backward_weight
                if prev is not None:
                    self.dep[f] = prev * m + mb
                    self.lat[f] = lat if ranks[prev] != ranks[s] else 0.0
                if nxt is not None:
                    for code in (b, i):
                        self.dep[code] = (bk * S + nxt) * m + mb
                        self.lat[code] = lat if ranks[nxt] != ranks[s] else 0.0
        self.p = pl.p
        self.sim = sim
        self.S, self.m = S, m

    def run(self, codes: Sequence[Sequence[int]]) -> tuple[list[float], list[list[float]]] | None:
        """(finish time of each rank, start time of each action per rank), or None on a deadlock."""
        res = self.sim.try_times(codes)
        return None if isinstance(res, Stall) else res


@dataclass
class LocalResult:
    tokens: list[list[int]]
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
        self.timing = Timing(part)
        self.reach = reach
        self.gap_reach = gap_reach
        self.limits = part.decoder.limits
        self.evaluations = 0

    # -- evaluation ---------------------------------------------------------------------
    def decode(self, rank: int, tokens: Sequence[int]) -> tuple[list[int], list[int]] | None:
        dec = self.part.decoder
        out = dec.decode_rank_nocache(rank, tokens)
        toks, codes, peak = out
        if peak > self.limits[rank]:
            return None
        return toks, codes

    def key(self, codes: Sequence[Sequence[int]]) -> tuple[float, float] | None:
        self.evaluations += 1
        res = self.timing.run(codes)
        if res is None:
            return None
        free = res[0]
        return max(free), sum(free)

    # -- moves --------------------------------------------------------------------------
    def critical_moves(self, codes: list[list[int]], starts: list[list[float]], free: list[float]) -> list[Move]:
        dur, dep, lat = self.timing.dur, self.timing.dep, self.timing.lat
        where = {}
        for r, order in enumerate(codes):
            for i, c in enumerate(order):
                where[c] = (r, i)
        r = max(range(len(free)), key=lambda q: free[q])
        i = len(codes[r]) - 1
        moves: list[Move] = []
        K = self.reach
        steps = 0
        while i >= 0 and steps < 100000:
            steps += 1
            c = codes[r][i]
            st = starts[r][i]
            prev_end = starts[r][i - 1] + dur[codes[r][i - 1]] if i > 0 else 0.0
            d = dep[c]
            arrival = -1.0
            if d >= 0 and d in where:
                q, j = where[d]
                arrival = starts[q][j] + dur[d] + lat[c]
            if d >= 0 and arrival >= prev_end - EPS and arrival >= st - EPS:
                r, i = where[d]      # dependency-bound: the path continues at the producer
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
        dur = self.timing.dur
        moves: list[Move] = []
        for r, order in enumerate(codes):
            for i in range(1, len(order)):
                if starts[r][i] > starts[r][i - 1] + dur[order[i - 1]] + EPS:
                    for k in range(1, self.gap_reach + 1):
                        if i + k < len(order):
                            moves.append((r, i + k, i))
        return moves

    def chain_moves(self, codes: list[list[int]], starts: list[list[float]], free: list[float]) -> list[Chain]:
        """For each rank-bound link Y -> X of the critical path: X's microbatch, X's op kind, on
        every stage, 1..K places earlier; and Y's, 1..K places later."""
        S, m = self.timing.S, self.timing.m
        where = {}
        for r, order in enumerate(codes):
            for i, c in enumerate(order):
                where[c] = (r, i)
        out: list[Chain] = []
        seen = set()
        for r, i, j in self.critical_moves(codes, starts, free):
            c = codes[r][i]
            kind, rest = divmod(c, S * m)
            mb = rest % m
            d = j - i
            if (kind, mb, d) in seen or kind == W_K:
                continue
            seen.add((kind, mb, d))
            chain = []
            for st in range(S):
                loc = where.get((kind * S + st) * m + mb)
                if loc is not None:
                    chain.append((loc[0], loc[1], d))
            if len(chain) > 1:
                out.append(tuple(chain))
        return out

    @staticmethod
    def apply(tokens: list[int], shifts: list[tuple[int, int]]) -> list[int]:
        """Move token i by d places for each (i, d), all at once (positions of the old list)."""
        key = [float(k) for k in range(len(tokens))]
        for i, d in shifts:
            key[i] = i + d + (-0.5 if d < 0 else 0.5)
        return [t for _, t in sorted(zip(key, tokens), key=lambda x: x[0])]

    # -- descent ------------------------------------------------------------------------
    def descend(self, tokens: Sequence[Sequence[int]], rng: random.Random,
                deadline: Callable[[], bool], max_evals: int | None = None) -> LocalResult | None:
        """First-improvement descent from `tokens`; None when `tokens` does not evaluate."""
        cur_t, cur_c = [], []
        for r, t in enumerate(tokens):
            d = self.decode(r, t)
            if d is None:
                return None
            cur_t.append(d[0])
            cur_c.append(d[1])
        res = self.timing.run(cur_c)
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
            res = self.timing.run(cur_c)
            assert res is not None
            free, starts = res
            moves_done += 1

    def _neighbour(self, cur_t: list[list[int]], cur_c: list[list[int]], chain: Chain
                   ) -> tuple[list[list[int]], list[list[int]]] | None:
        """(tokens, codes) after moving each (rank, index, shift) of `chain`, decoded with
        repair; None when nothing changes or a rank does not decode within its limit."""
        by_rank: dict[int, list[tuple[int, int]]] = {}
        for r, i, d in chain:
            if i < len(cur_t[r]):
                by_rank.setdefault(r, []).append((i, d))
        new_t, new_c = list(cur_t), list(cur_c)
        for r, shifts in by_rank.items():
            toks = self.apply(cur_t[r], shifts)
            if toks == cur_t[r]:
                continue
            dec = self.decode(r, toks)
            if dec is None:
                return None
            new_t[r], new_c[r] = dec
        return None if new_c == cur_c else (new_t, new_c)


def iterated_local_search(part: PlacementProblem, tokens: Sequence[Sequence[int]], rng: random.Random,
                          deadline: Callable[[], bool], kicks: int = 20,
                          kick: Callable[[list[list[int]], random.Random], list[list[int]]] | None = None,
                          searcher: LocalSearch | None = None) -> LocalResult | None:
    """Descend from `tokens`, then `kicks` times: perturb the best walk with `kick`, descend, and keep
    the result if it is at least as good (equal makespans move the search along the plateau)."""
    ls = searcher or LocalSearch(part)
    best = ls.descend(tokens, rng, deadline)
    if best is None:
        return None
    total = best.evaluations
    for _ in range(kicks if kick is not None else 0):
        if deadline():
            break
        assert kick is not None
        cand = ls.descend(kick(best.tokens, rng), rng, deadline)
        if cand is None:
            continue
        total += cand.evaluations
        if cand.makespan <= best.makespan + EPS:
            best = cand
    best.evaluations = total
    return best


def wall_deadline(seconds: float | None) -> Callable[[], bool]:
    if seconds is None:
        return lambda: False
    stop = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= stop
