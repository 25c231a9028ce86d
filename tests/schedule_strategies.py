"""Random valid schedules for property tests: a random topological execution of all the
actions of a configuration, assigned to ranks in the order it ran them (so deadlock-free)."""
from __future__ import annotations

import random

from koala_ds.ir import Action, Op, Placement, Schedule


def random_schedule(rng: random.Random, p: int, m: int, v: int = 1, style: str = "linear",
                    backward: str = "full") -> Schedule:
    placement = Placement.named(style, p, v)
    n = placement.num_stages
    # per (stage, mb): which backward form it uses
    split = {(s, mb): backward == "split" and rng.random() < 0.8 for s in range(n) for mb in range(m)}
    done: set[Action] = set()
    todo = []
    for s in range(n):
        for mb in placement.microbatches_of(s, m):
            todo.append(Action(Op.F, s, mb))
            if split[(s, mb)]:
                todo += [Action(Op.I, s, mb), Action(Op.W, s, mb)]
            else:
                todo.append(Action(Op.B, s, mb))

    def bwd(s: int, mb: int) -> Action:
        return Action(Op.I if split[(s, mb)] else Op.B, s, mb)

    def ready(a: Action) -> bool:
        s, mb = a.stage, a.microbatch
        if a.op is Op.F:
            prev = placement.prev_stage(s)
            return prev is None or Action(Op.F, prev, mb) in done
        if a.op is Op.W:
            return Action(Op.I, s, mb) in done
        nxt = placement.next_stage(s)
        return Action(Op.F, s, mb) in done and (nxt is None or bwd(nxt, mb) in done)

    ranks: list[list[Action]] = [[] for _ in range(p)]
    pending = set(todo)
    while pending:
        choices = sorted(a for a in pending if ready(a))
        a = rng.choice(choices)
        pending.remove(a)
        done.add(a)
        ranks[placement.rank_of(a.stage)].append(a)
    return Schedule(p, m, v, placement, tuple(tuple(r) for r in ranks), backward, "random")
