"""Random valid schedules: random topological orders of a configuration's actions.

Used by the property tests (simulator vs reference, lower bound) and useful as seeds or
noise for a search. Every schedule returned is complete, locally ordered and free of
deadlock with non-blocking sends (it is built by executing actions in one global order).
"""
from __future__ import annotations

import random

from ..core.ir import Action, Op, Placement, Schedule


def random_schedule(placement: Placement, m: int, backward: str = "full", seed: int | random.Random | None = None,
                    split_probability: float = 1.0, name: str = "random") -> Schedule:
    """A random valid schedule.

    With backward "split", each (stage, microbatch) uses I+W with `split_probability` and a
    full B otherwise (schedules may mix them, as dualpipe-v does)."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    p = placement.p
    ready: list[list[Action]] = [[] for _ in range(p)]
    f_done: set[tuple[int, int]] = set()
    grad_done: set[tuple[int, int]] = set()
    use_split = {}

    def backward_action(s: int, mb: int) -> Action:
        key = (s, mb)
        if key not in use_split:
            use_split[key] = backward == "split" and rng.random() < split_probability
        return Action(Op.I if use_split[key] else Op.B, s, mb)

    for s in range(placement.num_stages):
        if placement.prev_stage(s) is None:
            for mb in placement.microbatches_of(s, m):
                ready[placement.rank_of(s)].append(Action(Op.F, s, mb))
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = sum(len(placement.microbatches_of(s, m)) for s in range(placement.num_stages))
    while True:
        live = [r for r in range(p) if ready[r]]
        if not live:
            break
        r = rng.choice(live)
        k = rng.randrange(len(ready[r]))
        ready[r][k], ready[r][-1] = ready[r][-1], ready[r][k]
        a = ready[r].pop()
        orders[r].append(a)
        s, mb = a.stage, a.microbatch
        if a.op is Op.F:
            f_done.add((s, mb))
            nxt = placement.next_stage(s)
            if nxt is not None:
                ready[placement.rank_of(nxt)].append(Action(Op.F, nxt, mb))
            if nxt is None or (nxt, mb) in grad_done:
                ready[r].append(backward_action(s, mb))
        elif a.op in (Op.B, Op.I):
            grad_done.add((s, mb))
            if a.op is Op.I:
                ready[r].append(Action(Op.W, s, mb))
            prev = placement.prev_stage(s)
            if prev is not None and (prev, mb) in f_done:
                ready[placement.rank_of(prev)].append(backward_action(prev, mb))
    assert len(grad_done) == total, "random_schedule: internal error, not every backward was placed"
    v = placement.v
    return Schedule(p, m, v, placement, tuple(tuple(o) for o in orders), backward, name)
