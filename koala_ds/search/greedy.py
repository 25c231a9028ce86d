"""Constructive seeds: a greedy list scheduler over the BTT decision tree.

This generalizes the Zero Bubble paper's greedy scheduler (Qi et al. 2024) to several chunks
per rank, any placement and a memory limit. It runs the same timed model as the simulator
(event by event); whenever a rank is free it makes the BTT choice, the next op kind and chunk
(the microbatch is implied), by a `Policy`:

- a backward (B or I) whose input gradient has arrived runs first (it is on the critical path
  and frees memory) unless the policy prefers forwards while the rank is below its cap;
- a forward runs when its input has arrived, the memory limit allows it, and, for a microbatch
  new to the rank, the rank holds fewer than `cap` microbatches and can *commit* the memory of
  all its stages for it (so that a microbatch that entered a rank can always finish there; this
  is what keeps V-shape and interleaved placements free of memory deadlocks);
- a weight-gradient step (W) fills time when nothing else can run (`w_mode` "eager"), or only
  when it ends before the next known arrival ("fit"), and always when it frees the memory
  a waiting forward needs.

`policies()` lists the tie-break variants the search tries; every one that completes is a seed.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .encoding import B_K, F_K, I_K, W_K
from .problem import PlacementProblem


@dataclass(frozen=True)
class Policy:
    """The tie-break rules of one greedy run. `cap` is (alpha, beta): a rank r admits a new
    microbatch only while it holds fewer than alpha * v * (p - r) + beta * v microbatches' worth
    of chunk-activations; alpha = None means memory alone limits it."""

    cap: tuple[float, float] | None = None
    depth_first: bool = True     # among ready forwards, the later chunk first
    w_mode: str = "eager"        # eager | fit
    prefer_b: bool = True        # a ready backward before a ready forward
    late_b: float = 0.0          # wait this fraction of a forward for an arriving backward
    commit: str = "all"          # all: reserve every entered microbatch's later chunks;
                                 # one: keep room for one microbatch's later chunks only

    def label(self) -> str:
        cap = "mem" if self.cap is None else f"{self.cap[0]:g}v(p-r)+{self.cap[1]:g}v"
        return (f"greedy[cap={cap},{'depth' if self.depth_first else 'breadth'},W={self.w_mode},"
                f"{'B' if self.prefer_b else 'F'}-first,wait={self.late_b:g},commit={self.commit}]")


def policies(p: int, v: int, backward: str) -> list[Policy]:
    caps: list[tuple[float, float] | None] = [None, (1, 0), (1, 1), (1, 2), (2, 0), (0, 1), (0, 2), (1.5, 0)]
    out = []
    for cap in caps:
        for depth in ((True, False) if v > 1 else (True,)):
            for w_mode in (("eager", "fit") if backward == "split" else ("eager",)):
                for prefer_b in (True, False):
                    for late in (0.0, 0.5):
                        if not prefer_b and late:
                            continue
                        out.append(Policy(cap, depth, w_mode, prefer_b, late))
    if v > 1:
        # entering microbatches keep room for one microbatch's later chunks only: the first
        # chunk of a rank may then fill memory while the later chunks' work has not arrived
        for cap in (None, (1, 1), (2, 0)):
            for depth in (True, False):
                for w_mode in (("eager", "fit") if backward == "split" else ("eager",)):
                    out.append(Policy(cap, depth, w_mode, True, 0.0, commit="one"))
    return out


def greedy_walk(part: PlacementProblem, policy: Policy) -> list[list[int]] | None:
    """Run the greedy list scheduler; the token lists of every rank, or None on a deadlock."""
    sim, pl, dec = part.sim, part.placement, part.decoder
    p, m, C = pl.p, sim.m, pl.chunks_per_rank
    split = sim.backward == "split"
    profile = sim.profile
    costs = profile.stage_costs(pl.num_stages, pl.pipelines)
    lat = float(profile.p2p_latency)
    S = pl.num_stages
    stage = dec.stage
    mbs = dec.mbs
    act = dec.act
    limits = dec.limits
    dF = [[costs[s].forward for s in stage[r]] for r in range(p)]
    dB = [[(costs[s].backward_input if split else costs[s].backward) for s in stage[r]] for r in range(p)]
    dW = [[costs[s].backward_weight for s in stage[r]] for r in range(p)]
    bfree = [[(dec.ifree[r][c] if split else dec.act[r][c]) for c in range(C)] for r in range(p)]
    wfree = dec.wfree
    prev = [pl.prev_stage(s) for s in range(S)]
    nxt = [pl.next_stage(s) for s in range(S)]
    rank_of = pl.stage_ranks
    chunk_of = [0] * S
    for r in range(p):
        for c, s in enumerate(stage[r]):
            chunk_of[s] = c
    # a microbatch enters rank r at its first stage there in pipeline order
    entry = [[(prev[s] is None or rank_of[prev[s]] != r or True) and c == min(
        cc for cc, ss in enumerate(stage[r]) if pl.pipeline_of(ss) == pl.pipeline_of(s))
        for c, s in enumerate(stage[r])] for r in range(p)]
    commit_need = [[sum(act[r][cc] for cc, ss in enumerate(stage[r]) if pl.pipeline_of(ss) == pl.pipeline_of(s))
                    for s in stage[r]] for r in range(p)]
    if policy.cap is None:
        cap = [math.inf] * p
    else:
        a, b = policy.cap
        vv = C
        cap = [max(1.0, a * vv * (p - r) + b * vv) for r in range(p)]

    fwd_av = [[-1.0] * m for _ in range(S)]   # F(s, mb) output at the next stage's rank
    grd_av = [[-1.0] * m for _ in range(S)]   # B/I(s, mb) output at the previous stage's rank
    f_end = [[-1.0] * m for _ in range(S)]
    nF = [[0] * C for _ in range(p)]
    nB = [[0] * C for _ in range(p)]
    wq: list[list[list[int]]] = [[[] for _ in range(C)] for _ in range(p)]  # pending W per chunk (I order)
    w_time: list[list[list[float]]] = [[[] for _ in range(C)] for _ in range(p)]
    mem = [0.0] * p
    committed = [0.0] * p
    units = [0.0] * p  # chunk-activations held (cap accounting)
    free = [0.0] * p
    total = [sum(len(mbs[r][c]) for c in range(C)) * (3 if split else 2) for r in range(p)]
    done = [0] * p
    tokens: list[list[int]] = [[] for _ in range(p)]
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    push = heapq.heappush
    late = policy.late_b

    while heap:
        t, r = heapq.heappop(heap)
        if t < free[r] or done[r] == total[r]:
            continue
        st, ms_, ac = stage[r], mbs[r], act[r]
        # candidates
        best_b = None      # (ready, -chunk, c)
        next_b = math.inf
        for c in range(C):
            k = nB[r][c]
            if k < nF[r][c]:
                s = st[c]
                mb = ms_[c][k]
                rd = f_end[s][mb]
                if nxt[s] is not None:
                    g = grd_av[nxt[s]][mb]
                    if g < 0:
                        continue
                    rd = max(rd, g)
                if rd <= t:
                    key = (rd, -c, c)
                    if best_b is None or key < best_b:
                        best_b = key
                elif rd < next_b:
                    next_b = rd
        best_f = None
        next_f = math.inf
        mem_blocked = False
        for c in range(C):
            k = nF[r][c]
            if k >= len(ms_[c]):
                continue
            s = st[c]
            mb = ms_[c][k]
            if prev[s] is None:
                rd = 0.0
            else:
                rd = fwd_av[prev[s]][mb]
                if rd < 0:
                    continue
            if entry[r][c]:
                held = committed[r] if policy.commit == "all" else mem[r]
                if held + commit_need[r][c] > limits[r] or units[r] + 1 > cap[r] + 1e-9:
                    if held + commit_need[r][c] > limits[r]:
                        mem_blocked = True
                    continue
            elif mem[r] + ac[c] > limits[r]:
                mem_blocked = True
                continue
            if rd <= t:
                key = (-c if policy.depth_first else c, rd)
                if best_f is None or key < best_f[0]:
                    best_f = (key, c)
            elif rd < next_f:
                next_f = rd
        choice = None
        if best_b is not None and (policy.prefer_b or best_f is None):
            choice = (B_K, best_b[2])
        elif best_f is not None:
            c = best_f[1]
            # optionally wait a little for an arriving backward instead of starting a forward
            if late > 0 and next_b < t + late * dF[r][c] and best_b is None:
                choice = None
            else:
                choice = (F_K, c)
        if choice is None and (best_b is not None):
            choice = (B_K, best_b[2])
        if choice is None:
            has_w = [c for c in range(C) if wq[r][c]]
            if has_w:
                c = min(has_w, key=lambda cc: w_time[r][cc][0])
                upcoming = min(next_b, next_f)
                if policy.w_mode == "eager" or mem_blocked or upcoming >= t + dW[r][c] or \
                        (best_f is None and upcoming == math.inf):
                    choice = (W_K, c)
        if choice is None:
            wake = min(next_b, next_f)
            if late > 0 and best_f is not None and wake > t:
                # we decided to wait for the backward: wake when it arrives
                pass
            if wake < math.inf:
                push(heap, (wake, r))
            continue
        kind, c = choice
        s = st[c]
        if kind == F_K:
            mb = ms_[c][nF[r][c]]
            nF[r][c] += 1
            end = t + dF[r][c]
            f_end[s][mb] = end
            mem[r] += ac[c]
            if entry[r][c]:
                committed[r] += commit_need[r][c]
                units[r] += 1
            tokens[r].append(F_K * C + c)
            n_s = nxt[s]
            if n_s is not None:
                q = rank_of[n_s]
                av = end + (lat if q != r else 0.0)
                fwd_av[s][mb] = av
                push(heap, (av, q))
            else:
                push(heap, (end, r))
        elif kind == B_K:
            mb = ms_[c][nB[r][c]]
            nB[r][c] += 1
            end = t + dB[r][c]
            mem[r] -= bfree[r][c]
            if split:
                wq[r][c].append(mb)
                w_time[r][c].append(end)
                tokens[r].append(I_K * C + c)
            else:
                committed[r] -= ac[c]
                tokens[r].append(B_K * C + c)
            if entry[r][c]:
                units[r] -= 1
            p_s = prev[s]
            if p_s is not None:
                q = rank_of[p_s]
                av = end + (lat if q != r else 0.0)
                grd_av[s][mb] = av
                push(heap, (av, q))
        else:
            wq[r][c].pop(0)
            w_time[r][c].pop(0)
            end = t + dW[r][c]
            mem[r] -= wfree[r][c]
            committed[r] -= ac[c]
            tokens[r].append(W_K * C + c)
        done[r] += 1
        free[r] = end
        push(heap, (end, r))
    if any(done[r] < total[r] for r in range(p)):
        return None
    return tokens


def greedy_seeds(part: PlacementProblem, policy_list: Sequence[Policy] | None = None
                 ) -> list[tuple[Policy, list[list[int]]]]:
    """Every policy's walk that completes without a deadlock."""
    pols = policy_list if policy_list is not None else policies(part.placement.p, part.placement.chunks_per_rank,
                                                                part.sim.backward)
    out = []
    for pol in pols:
        walk = greedy_walk(part, pol)
        if walk is not None:
            out.append((pol, walk))
    return out
