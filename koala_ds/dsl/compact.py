"""`compact greedy`: the greedy compaction of V-shape schedules (Qi et al. 2024).

The generator of V-Half and V-Min (zbv_greedy.py in sail-sg/zero-bubble-pipeline-
parallelism, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024) lays a V-shape
building block every few unit-time slots and then compacts warm-up and cool-down. This
module is that last step, on plain data: each rank's passes with the slot its program gave
them (`slot EXPR` in a rank block), in, and each rank's order, out.

Passes, on rank r of p with stages r (chunk 0) and 2p - 1 - r (chunk 1):
  F0 / F1 = forward of chunk 0 / 1, I1 / I0 = input gradient of chunk 1 / 0 (this is also
  the tie-break order of passes in one slot), W = a weight gradient of either chunk.
Inputs of a pass (microbatch j): F0 and I1 need the same pass of rank r - 1, F1 and I0 that
of rank r + 1 (none at the ends of the pipeline); F1, I1, I0 need the pass before them in
F0 -> F1 -> I1 -> I0 on the same rank; every pass needs the same pass of microbatch j - 1.

The rule, as the authors' generator applies it:
  a. the F and I passes start at their given slots (the slots of W passes are ignored);
  b. W passes fill free slots: walking the slots in order, each free slot takes the oldest
     input gradient still waiting for its W (`place_weights`);
  c. walk every pass of every rank in slot order (ties: lower rank first). Warm-up passes
     (before rank 0's first I0) and cool-down passes (after the first F0 of the last
     microbatch met after warm-up, i.e. rank 0's) each move to the earliest free slot of
     their rank after their inputs (for W: after the rank's j-th input gradient in slot
     order) where the rank's peak memory stays within the highest peak of all ranks at the
     start of the walk (`_compact`); memory counts forwards held until their W;
  d. squeeze to unit time: each pass at the earliest slot its inputs and the pass before it
     on its rank allow, in the current order (`squeeze`);
  e. drop the W passes, walk again moving the cool-down passes only, with memory counted
     as if each W ran in the first free slot after its I; place W as in b and squeeze;
  f. drop the W passes and put them back per chunk: each free slot takes a W of chunk 1
     if one waits, else one of chunk 0 (oldest first); leftovers go after the last pass,
     chunk 1 first (`place_weights_per_chunk`). Each rank's order is the slot order.
"""
from __future__ import annotations

import bisect
from itertools import accumulate
from typing import NamedTuple, Sequence

from ..core.ir import KoalaError

# pass kinds, in the tie-break order of the generator
F0, F1, I1, I0, W = 0, 1, 2, 3, 4
BLOCK_KINDS = (F0, F1, I1, I0)
KIND_OF = {("F", 0): F0, ("F", 1): F1, ("I", 1): I1, ("I", 0): I0}
NAME_OF = {kind: name for name, kind in KIND_OF.items()}
_FROM_PREVIOUS_RANK = (F0, I1)
_FROM_NEXT_RANK = (F1, I0)
_HELD = {F0: 1, F1: 1, I1: 0, I0: 0, W: -1}  # activations a pass adds when the W passes are placed

Key = tuple[int, int]  # (kind, index): index is the microbatch, or the count of a W on its rank
Timeline = dict[Key, int]  # one rank: pass -> slot


class CompactError(KoalaError):
    """Passes that `compact greedy` cannot compact (wrong ops, missing or clashing slots)."""


class Pass(NamedTuple):
    """One pass of a rank as the program emitted it: op F/I/W (or B), chunk, microbatch, slot."""

    op: str
    chunk: int
    microbatch: int
    slot: int | None


# -- building blocks ------------------------------------------------------------------------
def block_timelines(ranks: Sequence[Sequence[Pass]], m: int) -> list[Timeline]:
    """The F and I passes of every rank at their slots; checks that the rule applies."""
    out: list[Timeline] = []
    for r, passes in enumerate(ranks):
        timeline: Timeline = {}
        weights = 0
        for ps in passes:
            if ps.op == "W":
                weights += 1
                continue
            if ps.op not in ("F", "I"):
                raise CompactError(f"rank {r} runs {ps.op}; compaction needs split backward (F, I and W only)")
            if ps.slot is None:
                raise CompactError(f"{ps.op}[{ps.chunk}]@{ps.microbatch} on rank {r} has no slot "
                                   f"(put 'slot EXPR' before it)")
            if ps.slot < 0:
                raise CompactError(f"{ps.op}[{ps.chunk}]@{ps.microbatch} on rank {r} is at slot {ps.slot} < 0")
            if (ps.op, ps.chunk) not in KIND_OF:
                raise CompactError(f"rank {r} runs chunk {ps.chunk}; compaction needs two chunks per rank")
            timeline[(KIND_OF[(ps.op, ps.chunk)], ps.microbatch)] = ps.slot
        want = {(kind, j) for kind in BLOCK_KINDS for j in range(m)}
        if set(timeline) != want or weights != 2 * m:
            raise CompactError(f"rank {r} must run F, I and W of both chunks for each of the {m} microbatches")
        clash = _first_clash(timeline)
        if clash is not None:
            raise CompactError(f"rank {r} has two passes at slot {clash}")
        out.append(timeline)
    return out


def _first_clash(timeline: Timeline) -> int | None:
    seen: set[int] = set()
    for slot in sorted(timeline.values()):
        if slot in seen:
            return slot
        seen.add(slot)
    return None


def _by_slot(timeline: Timeline) -> dict[int, int]:
    """slot -> kind of the pass there."""
    return {slot: kind for (kind, _), slot in timeline.items()}


def _without_weights(timeline: Timeline) -> Timeline:
    return {key: slot for key, slot in timeline.items() if key[0] != W}


def place_weights(timeline: Timeline) -> Timeline:
    """Step b: the F and I passes of `timeline`, and a W (either chunk) in each free slot
    while an input gradient waits for one, oldest first; leftovers after the last pass."""
    out = _without_weights(timeline)
    busy = _by_slot(out)
    last = max(busy)
    waiting = placed = 0
    for slot in range(last + 1):
        if slot in busy:
            waiting += busy[slot] in (I1, I0)
        elif waiting:
            out[(W, placed)] = slot
            placed, waiting = placed + 1, waiting - 1
    for extra in range(waiting):
        out[(W, placed + extra)] = last + 1 + extra
    return out


def place_weights_per_chunk(timeline: Timeline) -> list[tuple[int, str, int, int]]:
    """Step f: every pass as (slot, op, chunk, microbatch), W passes placed per chunk."""
    rows = [(slot, *NAME_OF[kind], j) for (kind, j), slot in timeline.items() if kind != W]
    busy = {slot: (op, chunk, j) for slot, op, chunk, j in rows}
    waiting: dict[int, list[int]] = {1: [], 0: []}  # chunk -> microbatches, chunk 1 first
    last = max(busy)
    for slot in range(last + 1):
        if slot in busy:
            op, chunk, j = busy[slot]
            if op == "I":
                waiting[chunk].append(j)
            continue
        for chunk, queue in waiting.items():
            if queue:
                rows.append((slot, "W", chunk, queue.pop(0)))
                break
    for chunk, queue in waiting.items():
        for j in queue:
            last += 1
            rows.append((last, "W", chunk, j))
    return sorted(rows)


# -- memory -----------------------------------------------------------------------------------
def peak(busy: dict[int, int], weights_placed: bool, slots: Sequence[int] | None = None,
         stop_above: int | None = None) -> int:
    """Peak activations of one rank (slot -> kind): a forward holds its activation until a W
    frees one; without W passes, each free slot frees one while an input gradient waits.
    `slots`: busy's slots in order, when the caller keeps them sorted; `stop_above`: without W
    passes, return as soon as the peak exceeds it (the caller only asks whether it fits)."""
    slots = slots if slots is not None else sorted(busy)
    if weights_placed:  # the activations held are a running sum: +1 per forward, -1 per W
        return max(0, max(accumulate(map(_HELD.__getitem__, map(busy.__getitem__, slots))), default=0))
    held = top = waiting = 0
    previous = -1
    stop = stop_above if stop_above is not None else float("inf")
    for slot in slots:  # the free slots between two passes at once
        if waiting:
            freed = min(slot - previous - 1, waiting)
            held, waiting = held - freed, waiting - freed
        previous = slot
        kind = busy[slot]
        if kind == F0 or kind == F1:
            held += 1
            if held > top:
                top = held
                if top > stop:
                    return top
        elif kind == W:
            held -= 1
        else:
            waiting += 1
    return top


# -- dependencies ---------------------------------------------------------------------------
def inputs(rank: int, kind: int, index: int, p: int) -> list[tuple[int, int, int]]:
    """The passes (rank, kind, index) that `kind` of microbatch `index` on `rank` waits for
    (for W only the previous W; its input gradient is found by slot, see `_earliest`)."""
    out = []
    if kind in _FROM_PREVIOUS_RANK and rank > 0:
        out.append((rank - 1, kind, index))
    if kind in _FROM_NEXT_RANK and rank + 1 < p:
        out.append((rank + 1, kind, index))
    if kind in (F1, I1, I0):
        out.append((rank, kind - 1, index))
    if index:
        out.append((rank, kind, index - 1))
    return out


def _walk_order(timelines: list[Timeline]) -> list[tuple[int, int, int, int]]:
    return sorted((slot, r, kind, j) for r, tl in enumerate(timelines) for (kind, j), slot in tl.items())


def squeeze(timelines: list[Timeline]) -> list[Timeline]:
    """Step d: unit time; each pass at the earliest slot after its inputs and after the pass
    before it on its rank, keeping every rank's order."""
    p = len(timelines)
    previous: list[int] = [-1] * p
    out: list[Timeline] = [{} for _ in range(p)]
    for slot, r, kind, j in _walk_order(timelines):
        earliest = previous[r] + 1
        for dep_rank, dep_kind, dep_j in inputs(r, kind, j, p):
            done = out[dep_rank].get((dep_kind, dep_j))
            if done is None:
                raise CompactError(f"slots out of dependency order: {_name(kind, j)} on rank {r} at slot "
                                   f"{slot} needs {_name(dep_kind, dep_j)} of rank {dep_rank}, which comes later")
            if done >= earliest:
                earliest = done + 1
        out[r][(kind, j)] = previous[r] = earliest
    return out


def _name(kind: int, index: int) -> str:
    if kind == W:
        return f"W #{index}"
    op, chunk = NAME_OF[kind]
    return f"{op}[{chunk}]@{index}"


# -- the greedy walk --------------------------------------------------------------------------
WARMUP, STEADY, COOLDOWN = "warm-up", "steady", "cool-down"


def _gradient_slots(timeline: Timeline) -> list[int]:
    """The slots of one rank's input gradients (I of either chunk), in slot order."""
    return sorted(slot for (k, _), slot in timeline.items() if k in (I1, I0))


def _earliest(timelines: list[Timeline], r: int, kind: int, j: int, p: int, grads: list[int] | None = None) -> int:
    """The first slot after every input of the pass, at their current slots (`grads`: rank
    r's `_gradient_slots` at their current slots, when the caller has them)."""
    last = -1
    for dep_rank, dep_kind, dep_j in inputs(r, kind, j, p):
        last = max(last, timelines[dep_rank][(dep_kind, dep_j)])
    if kind == W:  # after the rank's j-th input gradient, in current slot order
        last = max(last, (grads if grads is not None else _gradient_slots(timelines[r]))[j])
    return last + 1


def _move(busy: dict[int, int], order: list[int], old: int, new: int, kind: int) -> None:
    """Move the pass at slot `old` to the free slot `new`, in `busy` and in its sorted slots."""
    del busy[old]
    busy[new] = kind
    _resort(order, old, new)


def _resort(order: list[int], old: int, new: int) -> None:
    """Replace `old` by `new` in the sorted list `order`."""
    del order[bisect.bisect_left(order, old)]
    bisect.insort(order, new)


def _compact(timelines: list[Timeline], m: int, move_warmup: bool) -> list[Timeline]:
    """Steps c and e: move warm-up (when `move_warmup`) and cool-down passes earlier."""
    p = len(timelines)
    weights_placed = any(key[0] == W for tl in timelines for key in tl)
    busy = [_by_slot(tl) for tl in timelines]
    order = [sorted(b) for b in busy]  # busy's slots, kept sorted as passes move
    limit = max(peak(b, weights_placed, o) for b, o in zip(busy, order))
    out = [dict(tl) for tl in timelines]
    taken: list[set[int]] = [set() for _ in range(p)]  # slots of passes already walked
    grads = [_gradient_slots(tl) for tl in out]  # per rank, kept sorted as input gradients move
    phase = WARMUP
    for slot, r, kind, j in _walk_order(timelines):
        if phase == WARMUP and kind == I0 and r == 0:
            phase = STEADY
        if phase == STEADY or (phase == WARMUP and not move_warmup):
            if phase == STEADY and kind == F0 and j == m - 1:
                phase = COOLDOWN
            taken[r].add(slot)
            continue
        final = slot
        for candidate in range(_earliest(out, r, kind, j, p, grads[r]), slot):
            if candidate in taken[r]:
                continue
            if weights_placed and kind not in (F0, F1):
                final = candidate  # with W placed, an I or W moved earlier cannot raise the rank's peak
                break
            _move(busy[r], order[r], slot, candidate, kind)
            fits = peak(busy[r], weights_placed, order[r], stop_above=limit) <= limit
            _move(busy[r], order[r], candidate, slot, kind)
            if fits:
                final = candidate
                break
        if final != slot:
            _move(busy[r], order[r], slot, final, kind)
            out[r][(kind, j)] = final
            if kind in (I1, I0):
                _resort(grads[r], slot, final)
        taken[r].add(final)
    return out


def compact_greedy(ranks: Sequence[Sequence[Pass]], m: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's order, as (op, chunk, microbatch), after the greedy compaction of the
    passes at their slots (steps a-f of the module docstring)."""
    timelines = [place_weights(tl) for tl in block_timelines(ranks, m)]  # a, b
    timelines = squeeze(_compact(timelines, m, move_warmup=True))  # c, d
    timelines = _compact([_without_weights(tl) for tl in timelines], m, move_warmup=False)  # e
    timelines = squeeze([place_weights(tl) for tl in timelines])
    return [[(op, chunk, j) for _, op, chunk, j in place_weights_per_chunk(tl)] for tl in timelines]  # f
