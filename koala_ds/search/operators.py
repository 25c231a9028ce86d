"""The GA's variation operators on rank orders (lists of BTT choices, docs/search.md): moves,
swaps, W shifts, crossover, and tournament selection."""
from __future__ import annotations

import random
from typing import Sequence

from .encoding import W_K


def _move(order: list[int], rng: random.Random, scale: float) -> None:
    """Move one choice of `order` by a geometric distance (mean about `scale`)."""
    n = len(order)
    if n < 2:
        return
    i = rng.randrange(n)
    d = max(1, int(rng.expovariate(1.0 / scale)) + 1)
    j = i + d if rng.random() < 0.5 else i - d
    j = min(max(j, 0), n - 1)
    if i == j:
        return
    choice = order.pop(i)
    order.insert(j, choice)


def _swap(order: list[int], rng: random.Random) -> None:
    """Swap two adjacent different choices of `order` (up to four tries to find them)."""
    n = len(order)
    if n < 2:
        return
    for _ in range(4):
        i = rng.randrange(n - 1)
        if order[i] != order[i + 1]:
            order[i], order[i + 1] = order[i + 1], order[i]
            return


def _shift_w(order: list[int], rng: random.Random, chunks: int, scale: float) -> None:
    """Move one W of `order` by a geometric distance (any choice when there is no W)."""
    ws = [i for i, choice in enumerate(order) if choice // chunks == W_K]
    if not ws:
        _move(order, rng, scale)
        return
    i = rng.choice(ws)
    d = max(1, int(rng.expovariate(1.0 / scale)) + 1)
    j = min(max(i + (d if rng.random() < 0.5 else -d), 0), len(order) - 1)
    choice = order.pop(i)
    order.insert(j, choice)


def mutate(orders: list[list[int]], rng: random.Random, strength: float, chunks: int) -> list[list[int]]:
    """A copy of `orders` after about `strength` random moves, most of them on one rank."""
    out = [list(order) for order in orders]
    moves = max(1, int(rng.expovariate(1.0 / strength)) + 1) if strength > 1 else 1
    focus = rng.randrange(len(out))
    for _ in range(moves):
        r = focus if rng.random() < 0.6 else rng.randrange(len(out))
        x = rng.random()
        if x < 0.4:
            _move(out[r], rng, 2.0 + strength)
        elif x < 0.7:
            _swap(out[r], rng)
        else:
            _shift_w(out[r], rng, chunks, 2.0 + strength)
    return out


def crossover(a: list[list[int]], b: list[list[int]], rng: random.Random) -> list[list[int]]:
    """Per rank: take the order of a or of b; one rank gets an order crossover (a's prefix, then
    the rest of its choices in b's order)."""
    child = [list(x) if rng.random() < 0.5 else list(y) for x, y in zip(a, b)]
    r = rng.randrange(len(a))
    x, y = a[r], b[r]
    if x and len(x) == len(y):
        cut = rng.randrange(len(x))
        prefix = x[:cut]
        counts: dict[int, int] = {}
        for choice in prefix:
            counts[choice] = counts.get(choice, 0) + 1
        rest = []
        for choice in y:
            if counts.get(choice, 0):
                counts[choice] -= 1
            else:
                rest.append(choice)
        child[r] = prefix + rest
    return child


def tournament(pop: Sequence, rng: random.Random, k: int = 3):
    """The fastest of `k` members drawn at random (with replacement)."""
    best = None
    for _ in range(k):
        x = pop[rng.randrange(len(pop))]
        if best is None or x.makespan < best.makespan:
            best = x
    assert best is not None
    return best
