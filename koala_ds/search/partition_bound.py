"""A lower bound for the joint problem: no partition of a per-layer profile into p x v stages,
with any schedule (full or split backward) that fits the memory, is faster.

The derivation is in docs/search.md ("Searching the split"). Per layer l let F_l be its
forward, b_l = min(I_l, B_l) the least time of the step that passes its input gradient on, and
c_l = min(I_l + W_l, B_l) the least time of its whole backward (a stage's sums of these bound
the stage's own from below: min(sum I, sum B) >= sum min(I_l, B_l)). For a stage s holding
layers [a, b) with h(s) rank changes before it in pipeline order (H in all), latency d:

- work:      T >= m * sum over all layers (F_l + c_l) / p            (p ranks, one action at a time)
- fill:      T >= sum_{l<a} F_l + h(s) d + m * sum_{a<=l<b} (F_l + c_l)
- drain:     T >= sum_l F_l + H d + sum_{l>=b} b_l + (H - h(s)) d + m * sum_{a<=l<b} c_l
             (no backward of s starts before a microbatch has gone all the way forward and
             its gradient has come back to s)
- last forward: T >= sum_{l<a} F_l + h(s) d + m * sum_{a<=l<b} F_l + sum_{l>=b} F_l
             + 2 (H - h(s)) d + sum_{l>=b} b_l + sum_{a<=l<b} c_l
A stage's actions all run on one rank, so every schedule of every partition obeys the terms of
each of its stages. The bound is min over placements of max(work, min over partitions of the
largest stage term) plus the placement's step overhead (`LayerProfile.step_overhead_of`: every
makespan is the pipeline's span plus it), the inner min by dynamic programming over the cut
points (exact for that max). A stage that cannot hold its static memory and one microbatch's
activations under its rank's limit is excluded (no schedule of such a partition fits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..core.ir import Placement
from ..sim.layers import LayerProfile


@dataclass(frozen=True)
class JointBound:
    value: float                         # the bound: the placement's step overhead included
    work: float                          # the work term
    partition: tuple[int, ...] | None    # a partition attaining the stage-term minimum (None: none fits)
    placement: str


class _Sums:
    """Prefix sums of the per-layer terms."""

    def __init__(self, lp: LayerProfile) -> None:
        def prefix(values):
            out = [0.0]
            for x in values:
                out.append(out[-1] + x)
            return out

        ls = lp.layers
        self.F = prefix([x.forward for x in ls])
        self.b = prefix([min(x.backward_input, x.backward) for x in ls])
        self.c = prefix([min(x.backward_input + x.backward_weight, x.backward) for x in ls])
        self.act = prefix([x.activation_mb for x in ls])
        self.static = prefix([x.param_mb * (1 + lp.optimizer_bytes_per_param_byte) for x in ls])


def _stage_term(z: _Sums, a: int, b: int, hb: float, ha: float, m: int) -> float:
    """The largest of the fill, drain and last-forward terms of a stage [a, b); hb, ha: the
    latency before it and from it to the end."""
    N = len(z.F) - 1
    head = z.F[a] + hb
    f_own, c_own = z.F[b] - z.F[a], z.c[b] - z.c[a]
    back = z.b[N] - z.b[b]
    fill = head + m * (f_own + c_own)
    drain = z.F[N] + hb + ha + back + ha + m * c_own
    last = head + m * f_own + (z.F[N] - z.F[b]) + 2 * ha + back + c_own
    return max(fill, drain, last)


def min_max_partition(N: int, S: int, term) -> tuple[float, tuple[int, ...] | None]:
    """min over partitions of N layers into S stages (each >= 1 layer) of max_s term(s, a, b),
    stage s holding layers [a, b) (term inf: not allowed), by dynamic programming over the cut
    points; the value and a partition attaining it (None when none is allowed)."""
    inf = math.inf
    best = [[inf] * (N + 1) for _ in range(S + 1)]
    arg = [[-1] * (N + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(S):
        for b in range(s + 1, N - (S - s - 1) + 1):
            for a in range(s, b):
                prev = best[s][a]
                if prev >= best[s + 1][b]:
                    continue
                val = max(prev, term(s, a, b))
                if val < best[s + 1][b]:
                    best[s + 1][b], arg[s + 1][b] = val, a
    if best[S][N] == inf:
        return inf, None
    cuts, b = [], N
    for s in range(S, 0, -1):
        a = arg[s][b]
        cuts.append(b - a)
        b = a
    return best[S][N], tuple(reversed(cuts))


def _placement_min(lp: LayerProfile, z: _Sums, placement: Placement, m: int) -> tuple[float, tuple[int, ...] | None]:
    """min over partitions of the largest stage term, for one placement."""
    ranks = placement.stage_ranks
    S, d = len(ranks), lp.p2p_latency
    before = [0] * S
    for s in range(1, S):
        before[s] = before[s - 1] + (ranks[s] != ranks[s - 1])
    total = before[-1]
    limits = [lp.limit_for(ranks[s], placement.p) for s in range(S)]

    def term(s: int, a: int, b: int) -> float:
        lim = limits[s]
        if lim is not None and (z.static[b] - z.static[a]) + (z.act[b] - z.act[a]) > lim * (1 + 1e-9):
            return math.inf
        return _stage_term(z, a, b, before[s] * d, (total - before[s]) * d, m)

    return min_max_partition(lp.num_layers, S, term)


def joint_lower_bound(lp: LayerProfile, p: int, m: int, placements: Sequence[Placement]) -> JointBound:
    """The bound of the module docstring over `placements` (each with p x v stages)."""
    z = _Sums(lp)
    N = lp.num_layers
    work = m * (z.F[N] + z.c[N]) / p
    found = []
    for pl in placements:
        value, part = _placement_min(lp, z, pl, m)
        found.append((max(work, value) + lp.step_overhead_of(pl.style), part, pl.describe()))
    value, part, name = min(found, key=lambda x: x[0])
    return JointBound(value, work, part, name)
