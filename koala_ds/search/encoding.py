"""The Binary-Tree-Traversing (BTT) encoding of pipeline schedules.

Each rank's action order is a walk down a decision tree: at every node the rank chooses the
next *op kind* (F, B, I or W) and, with v > 1 chunks per rank, *which chunk*; the microbatch is
implied by the order, exactly as in the Koala language: the lowest microbatch of that stage
that has not had that step yet (B and I share one counter). A walk is stored as its sequence of
choices, one small integer per step::

    token = op_index * chunks + chunk        op_index: F = 0, B = 1, I = 2, W = 3

A schedule is one walk per rank, so the product of all walks is the complete schedule space.
Orders that take a microbatch out of turn (looped-bfs runs its backwards last microbatch first)
carry the exceptions explicitly (position -> microbatch), so that every schedule, and every
library schedule in particular, is exactly one point: ``decode(encode(s)) == s``.

The search works on plain token lists (no exceptions) and decodes them with `GenomeDecoder`,
which also *repairs* them: a step that cannot run yet on its rank (a backward before its
forward, a W before its I, a forward that would break the memory limit) is deferred until it
can, so that every token list decodes to a complete, locally ordered schedule.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..ir import Action, KoalaError, Op, Placement, Schedule

OP_ORDER = (Op.F, Op.B, Op.I, Op.W)
OP_INDEX = {op: k for k, op in enumerate(OP_ORDER)}
F_K, B_K, I_K, W_K = 0, 1, 2, 3


class EncodingError(KoalaError):
    """A walk that does not decode to a schedule of its configuration."""


@dataclass(frozen=True)
class Walk:
    """One rank's order as BTT choices, plus explicit microbatches where the order breaks the
    implied one (`explicit` holds (position, microbatch) pairs, sorted by position)."""

    tokens: tuple[int, ...]
    explicit: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Encoding:
    """A schedule in BTT form: the configuration and one walk per rank."""

    placement: Placement
    m: int
    backward: str
    walks: tuple[Walk, ...]

    @property
    def p(self) -> int:
        return self.placement.p

    @property
    def chunks(self) -> int:
        return self.placement.chunks_per_rank

    def token_lists(self) -> list[list[int]]:
        return [list(w.tokens) for w in self.walks]


def token(op: Op, chunk: int, chunks: int) -> int:
    return OP_INDEX[op] * chunks + chunk


def token_text(tok: int, chunks: int) -> str:
    kind, chunk = divmod(tok, chunks)
    return f"{OP_ORDER[kind].value}[{chunk}]" if chunks > 1 else OP_ORDER[kind].value


class _Counter:
    """Lowest-unused microbatch per (class, chunk) of one rank, as the language's rule."""

    def __init__(self, placement: Placement, m: int, rank: int):
        self.stages = placement.stages_of(rank)
        self.mbs = [list(placement.microbatches_of(s, m)) for s in self.stages]
        self.used: dict[tuple[int, int], set[int]] = {}
        self.ptr: dict[tuple[int, int], int] = {}

    @staticmethod
    def cls(kind: int) -> int:
        return B_K if kind in (B_K, I_K) else kind

    def implied(self, kind: int, chunk: int) -> int | None:
        key = (self.cls(kind), chunk)
        used = self.used.get(key, ())
        mbs = self.mbs[chunk]
        i = self.ptr.get(key, 0)
        while i < len(mbs) and mbs[i] in used:
            i += 1
        self.ptr[key] = i
        return mbs[i] if i < len(mbs) else None

    def use(self, kind: int, chunk: int, mb: int) -> None:
        self.used.setdefault((self.cls(kind), chunk), set()).add(mb)


def encode(schedule: Schedule) -> Encoding:
    """The BTT walk of every rank of `schedule` (exact; see `decode`)."""
    placement = schedule.placement
    chunks = placement.chunks_per_rank
    walks = []
    for r, actions in enumerate(schedule.ranks):
        stages = placement.stages_of(r)
        chunk_of = {s: c for c, s in enumerate(stages)}
        counter = _Counter(placement, schedule.m, r)
        toks, explicit = [], []
        for pos, a in enumerate(actions):
            if a.stage not in chunk_of:
                raise EncodingError(f"{a} is on rank {r} but stage {a.stage} lives on rank "
                                    f"{placement.rank_of(a.stage)}")
            c = chunk_of[a.stage]
            kind = OP_INDEX[a.op]
            if counter.implied(kind, c) != a.microbatch:
                explicit.append((pos, a.microbatch))
            counter.use(kind, c, a.microbatch)
            toks.append(kind * chunks + c)
        walks.append(Walk(tuple(toks), tuple(explicit)))
    return Encoding(placement, schedule.m, schedule.backward, tuple(walks))


def decode(encoding: Encoding, name: str = "searched") -> Schedule:
    """The schedule a BTT encoding stands for (exact, no repair)."""
    placement, m = encoding.placement, encoding.m
    chunks = placement.chunks_per_rank
    ranks = []
    for r, walk in enumerate(encoding.walks):
        counter = _Counter(placement, m, r)
        explicit = dict(walk.explicit)
        out = []
        for pos, tok in enumerate(walk.tokens):
            kind, c = divmod(tok, chunks)
            if not 0 <= kind < 4 or c >= len(counter.stages):
                raise EncodingError(f"rank {r} step {pos}: token {tok} is not a choice of this tree "
                                    f"({chunks} chunk(s) per rank)")
            mb = explicit.get(pos)
            if mb is None:
                mb = counter.implied(kind, c)
                if mb is None:
                    raise EncodingError(f"rank {r} step {pos}: {token_text(tok, chunks)} has no microbatch "
                                        f"left (m={m})")
            counter.use(kind, c, mb)
            out.append(Action(OP_ORDER[kind], counter.stages[c], mb))
        ranks.append(tuple(out))
    v = placement.chunks_per_rank // placement.pipelines
    return Schedule(placement.p, m, v, placement, tuple(ranks), encoding.backward, name)


class GenomeDecoder:
    """Turns plain token lists (the GA's genomes) into simulator codes, repairing as it goes.

    Microbatches are taken in order (each (class, chunk) counter runs through the stage's
    microbatches). A token that cannot run yet is deferred and emitted as soon as it can:
    B/I before its F, W before its I, and F when the rank's memory would go over `limit`.
    Surplus tokens are dropped and missing ones appended, so any list decodes to a complete
    and locally ordered order; `decode` returns the repaired tokens, the codes and the peak.
    Cross-rank deadlocks are left to the simulator to find.
    """

    def __init__(self, placement: Placement, m: int, backward: str, sim_code_base: tuple[int, int],
                 stage_mem: Sequence[tuple[float, float, float]],
                 limits: Sequence[float | None]):
        self.placement, self.m, self.backward = placement, m, backward
        self.p = placement.p
        self.chunks = placement.chunks_per_rank
        S, _ = sim_code_base
        self.S = S
        self.split = backward == "split"
        # per rank, per chunk: stage, microbatches, memory deltas
        self.stage = [[s for s in placement.stages_of(r)] for r in range(self.p)]
        self.mbs = [[list(placement.microbatches_of(s, m)) for s in self.stage[r]] for r in range(self.p)]
        self.act = [[stage_mem[s][0] for s in self.stage[r]] for r in range(self.p)]
        self.ifree = [[stage_mem[s][1] for s in self.stage[r]] for r in range(self.p)]
        self.wfree = [[stage_mem[s][2] for s in self.stage[r]] for r in range(self.p)]
        self.limits = [float("inf") if x is None else x * (1 + 1e-9) + 1e-9 for x in limits]

    def code(self, kind: int, stage: int, mb: int) -> int:
        # the simulator's integer code: (op * S + stage) * m + mb, op F=0, B=1, I=2, W=3
        return (kind * self.S + stage) * self.m + mb

    def canonical_counts(self, rank: int) -> list[int]:
        """How many tokens of each kind*chunks+chunk a complete walk of `rank` has."""
        C = self.chunks
        counts = [0] * (4 * C)
        for c in range(C):
            n = len(self.mbs[rank][c])
            counts[F_K * C + c] = n
            if self.split:
                counts[I_K * C + c] = n
                counts[W_K * C + c] = n
            else:
                counts[B_K * C + c] = n
        return counts

    def decode_rank(self, rank: int, tokens: Sequence[int], memory_repair: bool = True
                    ) -> tuple[list[int], list[int], float]:
        """(repaired tokens, simulator codes, peak memory) of one rank's walk (cached)."""
        key = (rank, memory_repair, tuple(tokens))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        out = self.decode_rank_nocache(rank, key[2], memory_repair)
        # bound the cache by the tokens it holds (~2M), not by entries: long walks are big
        if len(self._cache) * max(1, len(tokens)) > self.cache_tokens:
            self._cache.clear()
        self._cache[key] = out
        return out

    def decode_rank_nocache(self, rank: int, tokens: Sequence[int], memory_repair: bool = True
                            ) -> tuple[list[int], list[int], float]:
        """`decode_rank` without the cache (for one-off neighbours in local search)."""
        out = self._fast(rank, tuple(tokens), memory_repair)
        if out is None:
            out = self._repair(rank, tokens, memory_repair)
        return out

    cache_tokens = 2_000_000

    @property
    def _cache(self) -> dict:
        try:
            return self.__dict__["_cache_d"]
        except KeyError:
            self.__dict__["_cache_d"] = {}
            return self.__dict__["_cache_d"]

    def _fast(self, rank: int, tokens: tuple[int, ...], memory_repair: bool
              ) -> tuple[list[int], list[int], float] | None:
        """The common case: a complete walk that needs no repair; None when it does."""
        C = self.chunks
        if len(tokens) != self._length(rank):
            return None
        kinds, chunks_, bases, deltas = self._tables(rank)
        mbs = self.mbs[rank]
        limit = self.limits[rank] if memory_repair else float("inf")
        nF = [0] * C
        nB = [0] * C
        wq: list[list[int]] = [[] for _ in range(C)]
        nW = [0] * C
        total = [len(x) for x in mbs]
        mem = peak = 0.0
        codes = []
        append = codes.append
        split = self.split
        for tok in tokens:
            k = kinds[tok]
            c = chunks_[tok]
            if k == 0:
                i = nF[c]
                if i >= total[c]:
                    return None
                mem += deltas[tok]
                if mem > limit:
                    return None
                if mem > peak:
                    peak = mem
                nF[c] = i + 1
                append(bases[tok] + mbs[c][i])
            elif k == 3:
                if not split:
                    return None
                i = nW[c]
                q = wq[c]
                if i >= len(q):
                    return None
                nW[c] = i + 1
                mem += deltas[tok]
                append(bases[tok] + q[i])
            else:
                if (k == 2) != split:
                    return None
                i = nB[c]
                if i >= nF[c]:
                    return None
                mb = mbs[c][i]
                nB[c] = i + 1
                if k == 2:
                    wq[c].append(mb)
                mem += deltas[tok]
                append(bases[tok] + mb)
        return list(tokens), codes, peak

    def _length(self, rank: int) -> int:
        return sum(len(x) for x in self.mbs[rank]) * (3 if self.split else 2)

    def _tables(self, rank: int):
        tabs = self.__dict__.setdefault("_tabs", {})
        if rank not in tabs:
            C = self.chunks
            kinds, chunks_, bases, deltas = [], [], [], []
            for t in range(4 * C):
                k, c = divmod(t, C)
                kinds.append(k)
                chunks_.append(c)
                bases.append((k * self.S + self.stage[rank][c]) * self.m)
                deltas.append((self.act[rank][c], -self.act[rank][c], -self.ifree[rank][c],
                               -self.wfree[rank][c])[k])
            tabs[rank] = (kinds, chunks_, bases, deltas)
        return tabs[rank]

    def _repair(self, rank: int, tokens: Sequence[int], memory_repair: bool = True
                ) -> tuple[list[int], list[int], float]:
        C = self.chunks
        stage, mbs = self.stage[rank], self.mbs[rank]
        act, ifree, wfree = self.act[rank], self.ifree[rank], self.wfree[rank]
        limit = self.limits[rank] if memory_repair else float("inf")
        nF = [0] * C
        nB = [0] * C   # B or I done
        nI = [0] * C   # I done (W needs them)
        nW = [0] * C
        total = [len(x) for x in mbs]
        mem = 0.0
        peak = 0.0
        out_tok: list[int] = []
        out_code: list[int] = []
        m, S = self.m, self.S

        def can(tok: int) -> bool:
            kind, c = divmod(tok, C)
            if kind == F_K:
                return nF[c] < total[c] and mem + act[c] <= limit
            if kind == W_K:
                return nW[c] < nI[c]
            return nB[c] < nF[c]

        def emit(tok: int) -> None:
            nonlocal mem, peak
            kind, c = divmod(tok, C)
            if kind == F_K:
                mb = mbs[c][nF[c]]
                nF[c] += 1
                mem += act[c]
                if mem > peak:
                    peak = mem
            elif kind == W_K:
                # W takes its I's in order (the oldest I of this chunk whose W is not done)
                k = nW[c]
                # find the k-th I among the backward steps of this chunk
                mb = self._wmb[c][k]
                nW[c] += 1
                mem -= wfree[c]
            else:
                k = nB[c]
                mb = mbs[c][k]
                nB[c] += 1
                if kind == I_K:
                    self._wmb[c].append(mb)
                    nI[c] += 1
                    mem -= ifree[c]
                else:
                    mem -= act[c]
            out_tok.append(tok)
            out_code.append((kind * S + stage[c]) * m + mb)

        self._wmb: list[list[int]] = [[] for _ in range(C)]
        need = self.canonical_counts(rank)
        have = [0] * (4 * C)
        stream: list[int] = []
        for tok in tokens:
            kind, c = divmod(tok, C)
            if self.split:
                if kind == B_K:  # a B is an I with its W right after it
                    stream += [I_K * C + c, W_K * C + c]
                    continue
            elif kind == I_K:
                tok = B_K * C + c
            elif kind == W_K:
                continue
            stream.append(tok)
        kept: list[int] = []
        for tok in stream:
            if have[tok] < need[tok]:
                have[tok] += 1
                kept.append(tok)
        for t in range(4 * C):  # append what is missing
            kept += [t] * (need[t] - have[t])
        # deferred tokens, one FIFO per token value: the first runnable one in walk order is the
        # runnable value with the oldest head (can() depends on the value only), O(4C) per step
        pending: list[deque[int]] = [deque() for _ in range(4 * C)]

        def first(ready: Callable[[int], bool]) -> int:
            best = -1
            for q in range(4 * C):
                if pending[q] and (best < 0 or pending[q][0] < pending[best][0]) and ready(q):
                    best = q
            return best

        for seq, t in enumerate(kept):
            if not can(t):
                pending[t].append(seq)
                continue
            emit(t)
            q = first(can)  # flush deferred tokens that can now run
            while q >= 0:
                pending[q].popleft()
                emit(q)
                q = first(can)
        # whatever is still pending (memory can never allow it): emit in order, ignoring memory
        ignore_memory = (lambda q: nF[q % C] < total[q % C] if q // C == F_K else can(q))
        while any(pending):
            q = first(ignore_memory)
            if q < 0:  # pragma: no cover - cannot happen with complete counts
                raise EncodingError(f"rank {rank}: walk cannot be completed")
            pending[q].popleft()
            emit(q)
        return out_tok, out_code, peak
