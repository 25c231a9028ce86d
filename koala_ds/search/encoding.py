"""The Binary-Tree-Traversing (BTT) encoding of pipeline schedules.

Each rank's order is a path down a decision tree: at every node the rank chooses the next *op
kind* (F, B, I or W) and, with v > 1 chunks per rank, *which chunk*; the microbatch is implied
by the order, exactly as in the Koala language: the lowest microbatch of that stage that has not
had that step yet (B and I share one counter). A rank's order in this form is its sequence of
*choices*, one small integer per step::

    choice = op_index * chunks + chunk        op index (koala_ds.core.ir.OpIndex): F = 0, B = 1, I = 2, W = 3

A schedule is one choice sequence per rank, so their product is the complete schedule space.
Orders that take a microbatch out of turn (looped-bfs runs its backwards last microbatch first)
carry the exceptions explicitly (position -> microbatch), so that every schedule, and every
library schedule in particular, is exactly one point: ``decode(encode(s)) == s``.

The search works on plain choice lists (no exceptions) and decodes them to action codes
(`koala_ds.core.lowered`) with `OrderDecoder`, which also *repairs* them: a step that cannot run yet
on its rank (a backward before its forward, a W before its I, a forward that would break the
memory limit) is deferred until it can, so that every choice list decodes to a complete,
locally ordered order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ..core.ir import OP_INDEX, OPS, Action, KoalaError, Placement, Schedule
from ..core.lowered import B, F, I, W, Lowered, action_code

#: The op indices under their older names (koala_ds.core.ir.OpIndex is the table).
F_K, B_K, I_K, W_K = F, B, I, W


class EncodingError(KoalaError):
    """Choices that do not decode to a schedule of their configuration."""


@dataclass(frozen=True)
class RankChoices:
    """One rank's order as BTT choices, plus explicit microbatches where the order breaks the
    implied one (`explicit` holds (position, microbatch) pairs, sorted by position)."""

    choices: tuple[int, ...]
    explicit: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> tuple[int, ...]:
        """The older name of `choices`."""
        return self.choices




@dataclass(frozen=True)
class Encoding:
    """A schedule in BTT form: the configuration and each rank's choices."""

    placement: Placement
    m: int
    backward: str
    ranks: tuple[RankChoices, ...]


    @property
    def p(self) -> int:
        return self.placement.p

    @property
    def chunks(self) -> int:
        return self.placement.chunks_per_rank


def choice_text(choice: int, chunks: int) -> str:
    kind, chunk = divmod(choice, chunks)
    return f"{OPS[kind].value}[{chunk}]" if chunks > 1 else OPS[kind].value


class _Counter:
    """Lowest-unused microbatch per (class, chunk) of one rank, as the language's rule."""

    def __init__(self, placement: Placement, m: int, rank: int):
        self.stages = placement.stages_of(rank)
        self.mbs = [list(placement.microbatches_of(s, m)) for s in self.stages]
        self.used: dict[tuple[int, int], set[int]] = {}
        self.ptr: dict[tuple[int, int], int] = {}

    @staticmethod
    def cls(kind: int) -> int:
        return B if kind in (B, I) else kind

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
    """The BTT choices of every rank of `schedule` (exact; see `decode`)."""
    placement = schedule.placement
    chunks = placement.chunks_per_rank
    ranks = []
    for r, actions in enumerate(schedule.ranks):
        stages = placement.stages_of(r)
        chunk_of = {s: c for c, s in enumerate(stages)}
        counter = _Counter(placement, schedule.m, r)
        choices, explicit = [], []
        for pos, a in enumerate(actions):
            if a.stage not in chunk_of:
                raise EncodingError(f"{a} is on rank {r} but stage {a.stage} lives on rank "
                                    f"{placement.rank_of(a.stage)}")
            c = chunk_of[a.stage]
            kind = OP_INDEX[a.op]
            if counter.implied(kind, c) != a.microbatch:
                explicit.append((pos, a.microbatch))
            counter.use(kind, c, a.microbatch)
            choices.append(kind * chunks + c)
        ranks.append(RankChoices(tuple(choices), tuple(explicit)))
    return Encoding(placement, schedule.m, schedule.backward, tuple(ranks))


def decode(encoding: Encoding, name: str = "searched") -> Schedule:
    """The schedule a BTT encoding stands for (exact, no repair)."""
    placement, m = encoding.placement, encoding.m
    chunks = placement.chunks_per_rank
    ranks = []
    for r, rank in enumerate(encoding.ranks):
        counter = _Counter(placement, m, r)
        explicit = dict(rank.explicit)
        out = []
        for pos, choice in enumerate(rank.choices):
            kind, c = divmod(choice, chunks)
            if not 0 <= kind < 4 or c >= len(counter.stages):
                raise EncodingError(f"rank {r} step {pos}: choice {choice} is not a choice of this tree "
                                    f"({chunks} chunk(s) per rank)")
            mb = explicit.get(pos)
            if mb is None:
                mb = counter.implied(kind, c)
                if mb is None:
                    raise EncodingError(f"rank {r} step {pos}: {choice_text(choice, chunks)} has no microbatch "
                                        f"left (m={m})")
            counter.use(kind, c, mb)
            out.append(Action(OPS[kind], counter.stages[c], mb))
        ranks.append(tuple(out))
    v = placement.v
    return Schedule(placement.p, m, v, placement, tuple(ranks), encoding.backward, name)


class OrderDecoder:
    """Turns plain choice lists (the search's candidates) into action codes, repairing as it goes.

    Microbatches are taken in order (each (class, chunk) counter runs through the stage's
    microbatches). A choice that cannot run yet is deferred and emitted as soon as it can:
    B/I before its F, W before its I, and F when the rank's memory would go over `limit`.
    Surplus choices are dropped and missing ones appended, so any list decodes to a complete
    and locally ordered order; `decode_rank` returns the repaired choices, the codes and the
    peak. Codes and memory deltas are the configuration's `Lowered` tables. Cross-rank
    deadlocks are left to the simulator to find.
    """

    #: the cache of `decode_rank` is cleared when it holds about this many choices
    cache_choices = 2_000_000

    def __init__(self, lowered: Lowered, limits: Sequence[float | None]):
        placement = lowered.placement
        self.lowered = lowered
        self.placement, self.m, self.backward = placement, lowered.m, lowered.backward
        self.p = placement.p
        self.chunks = placement.chunks_per_rank
        self.split = lowered.split
        self.stage = [list(placement.stages_of(r)) for r in range(self.p)]   # per rank, per chunk
        self.mbs = [[list(placement.microbatches_of(s, self.m)) for s in self.stage[r]] for r in range(self.p)]
        self.limits = [float("inf") if x is None else x * (1 + 1e-9) + 1e-9 for x in limits]
        self._cache: dict = {}
        self._tabs = [self._rank_tables(r) for r in range(self.p)]

    def _rank_tables(self, rank: int) -> tuple[list[int], list[int], list[int], list[float]]:
        """Per choice of `rank`: its op index, its chunk, the code of its microbatch 0 and its
        memory delta."""
        low, C = self.lowered, self.chunks
        kinds, chunks, bases, deltas = [], [], [], []
        for t in range(4 * C):
            k, c = divmod(t, C)
            base = action_code(k, self.stage[rank][c], 0, low.num_stages, self.m)
            kinds.append(k)
            chunks.append(c)
            bases.append(base)
            deltas.append(float(low.mem[base]))
        return kinds, chunks, bases, deltas

    def canonical_counts(self, rank: int) -> list[int]:
        """How many choices of each value (op index * chunks + chunk) a complete order of `rank` has."""
        C = self.chunks
        counts = [0] * (4 * C)
        for c in range(C):
            n = len(self.mbs[rank][c])
            counts[F * C + c] = n
            if self.split:
                counts[I * C + c] = n
                counts[W * C + c] = n
            else:
                counts[B * C + c] = n
        return counts

    def decode_rank(self, rank: int, choices: Sequence[int], memory_repair: bool = True
                    ) -> tuple[list[int], list[int], float]:
        """(repaired choices, action codes, peak memory) of one rank's choices (cached)."""
        key = (rank, memory_repair, tuple(choices))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        out = self.decode_rank_nocache(rank, key[2], memory_repair)
        # bound the cache by the choices it holds, not by entries: long orders are big
        if len(self._cache) * max(1, len(choices)) > self.cache_choices:
            self._cache.clear()
        self._cache[key] = out
        return out

    def decode_rank_nocache(self, rank: int, choices: Sequence[int], memory_repair: bool = True
                            ) -> tuple[list[int], list[int], float]:
        """`decode_rank` without the cache (for one-off neighbours in local search)."""
        out = self._fast(rank, tuple(choices), memory_repair)
        if out is None:
            out = self._repair(rank, choices, memory_repair)
        return out

    def _fast(self, rank: int, choices: tuple[int, ...], memory_repair: bool
              ) -> tuple[list[int], list[int], float] | None:
        """The common case: a complete order that needs no repair; None when it does."""
        C = self.chunks
        if len(choices) != self._length(rank):
            return None
        kinds, chunks_, bases, deltas = self._tabs[rank]
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
        for ch in choices:
            k = kinds[ch]
            c = chunks_[ch]
            if k == F:
                i = nF[c]
                if i >= total[c]:
                    return None
                mem += deltas[ch]
                if mem > limit:
                    return None
                if mem > peak:
                    peak = mem
                nF[c] = i + 1
                append(bases[ch] + mbs[c][i])
            elif k == W:
                if not split:
                    return None
                i = nW[c]
                q = wq[c]
                if i >= len(q):
                    return None
                nW[c] = i + 1
                mem += deltas[ch]
                append(bases[ch] + q[i])
            else:
                if (k == I) != split:
                    return None
                i = nB[c]
                if i >= nF[c]:
                    return None
                mb = mbs[c][i]
                nB[c] = i + 1
                if k == I:
                    wq[c].append(mb)
                mem += deltas[ch]
                append(bases[ch] + mb)
        return list(choices), codes, peak

    def _length(self, rank: int) -> int:
        return sum(len(x) for x in self.mbs[rank]) * (3 if self.split else 2)

    def _normalized(self, rank: int, choices: Sequence[int]) -> list[int]:
        """The choices in this backward kind (split: a B is an I with its W right after it; full:
        I is B and W goes), surplus dropped and missing ones appended."""
        C = self.chunks
        stream: list[int] = []
        for ch in choices:
            kind, c = divmod(ch, C)
            if self.split:
                if kind == B:
                    stream += [I * C + c, W * C + c]
                    continue
            elif kind == I:
                ch = B * C + c
            elif kind == W:
                continue
            stream.append(ch)
        need = self.canonical_counts(rank)
        have = [0] * (4 * C)
        kept: list[int] = []
        for ch in stream:
            if have[ch] < need[ch]:
                have[ch] += 1
                kept.append(ch)
        for t in range(4 * C):
            kept += [t] * (need[t] - have[t])
        return kept

    def _repair(self, rank: int, choices: Sequence[int], memory_repair: bool = True
                ) -> tuple[list[int], list[int], float]:
        run = _RankRun(self, rank, self.limits[rank] if memory_repair else float("inf"))
        # deferred choices, one FIFO per choice value: the first runnable one in the given order
        # is the runnable value with the oldest head (`can` depends on the value only), O(4C) per step
        pending: list[deque[int]] = [deque() for _ in range(4 * self.chunks)]
        for seq, t in enumerate(self._normalized(rank, choices)):
            if not run.can(t):
                pending[t].append(seq)
                continue
            run.emit(t)
            q = _first(pending, run.can)  # flush deferred choices that can now run
            while q >= 0:
                pending[q].popleft()
                run.emit(q)
                q = _first(pending, run.can)
        # whatever is still pending (memory can never allow it): emit in order, ignoring memory
        while any(pending):
            q = _first(pending, run.can_ignoring_memory)
            if q < 0:  # pragma: no cover - cannot happen with complete counts
                raise EncodingError(f"rank {rank}: choices cannot be completed")
            pending[q].popleft()
            run.emit(q)
        return run.choices, run.codes, run.peak


def _first(pending: list[deque[int]], ready) -> int:
    """The value whose oldest deferred choice is the oldest among the `ready` values; -1 if none."""
    best = -1
    for q in range(len(pending)):
        if pending[q] and (best < 0 or pending[q][0] < pending[best][0]) and ready(q):
            best = q
    return best


class _RankRun:
    """The state of one rank while `OrderDecoder._repair` emits its choices."""

    def __init__(self, dec: OrderDecoder, rank: int, limit: float):
        C = self.C = dec.chunks
        self.kinds, self.chunk, self.bases, self.deltas = dec._tabs[rank]
        self.mbs, self.limit = dec.mbs[rank], limit
        self.total = [len(x) for x in self.mbs]
        self.nF, self.nB, self.nI, self.nW = [0] * C, [0] * C, [0] * C, [0] * C  # nB: B or I done
        self.wmb: list[list[int]] = [[] for _ in range(C)]   # per chunk, the microbatches of its I's
        self.mem = self.peak = 0.0
        self.choices: list[int] = []
        self.codes: list[int] = []

    def can(self, ch: int) -> bool:
        kind, c = self.kinds[ch], self.chunk[ch]
        if kind == F:
            return self.nF[c] < self.total[c] and self.mem + self.deltas[ch] <= self.limit
        if kind == W:
            return self.nW[c] < self.nI[c]
        return self.nB[c] < self.nF[c]

    def can_ignoring_memory(self, ch: int) -> bool:
        if self.kinds[ch] == F:
            c = self.chunk[ch]
            return self.nF[c] < self.total[c]
        return self.can(ch)

    def emit(self, ch: int) -> None:
        kind, c = self.kinds[ch], self.chunk[ch]
        if kind == F:
            mb = self.mbs[c][self.nF[c]]
            self.nF[c] += 1
        elif kind == W:  # W takes its I's in order (the oldest I of this chunk whose W is not done)
            mb = self.wmb[c][self.nW[c]]
            self.nW[c] += 1
        else:
            mb = self.mbs[c][self.nB[c]]
            self.nB[c] += 1
            if kind == I:
                self.wmb[c].append(mb)
                self.nI[c] += 1
        self.mem += self.deltas[ch]
        if kind == F and self.mem > self.peak:
            self.peak = self.mem
        self.choices.append(ch)
        self.codes.append(self.bases[ch] + mb)
