"""Schedules taking turns in one run (the examples' `--alternate-schedules`): which schedule runs
an iteration, which iterations count, and the schedules' speeds relative to the first one's.
Plain Python (no torch): examples/megatron_gpt, examples/deepspeed_pipe and
benchmarks/fidelity.py's paired rounds share it.

A turn is `block` iterations of one schedule; the schedules follow one another in the order
given. An iteration counts when it comes after the first `warmup` and is not among the first
`settle` of its turn (default 1): then on every rank the step before it ran the same schedule, so
what the previous step left in flight (the last rank still finishing it, say) is that schedule's
own. Where the schedules run on model copies of their own (another v or placement), a turn's
second step still ran slower than its third and fourth (Megatron 8x256, docs/profiling.md "A
step is one step"): `settle` 2 leaves it out too."""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from ..core.ir import KoalaError


def keeps_own_shape(spec: str) -> bool:
    """Whether an alternate schedule keeps its own v and placement: a fixed schedule file (.json,
    .csv) was made for them, and runs on a model copy of that shape where the run's model has
    another; a library name or .koala program is compiled for the run's v and placement."""
    from ..resolve import FIXED_SUFFIXES

    return str(spec).endswith(FIXED_SUFFIXES) and os.path.isfile(spec)


def turn_index(iteration: int, count: int, block: int) -> int:
    """The index (among `count` schedules) of the schedule whose turn `iteration` is."""
    return (iteration // block) % count


def kept_periods(periods: list[float], schedules: list[str], warmup: int, block: int,
                 settle: int = 1) -> dict[str, list[float]]:
    """Per schedule (in order of first appearance), the step periods of the iterations that
    count: after the first `warmup`, not among the first `settle` of a turn of `block` iterations
    (a turn of 1 keeps every iteration: none follows its own schedule's)."""
    check_settle(block, settle)
    out: dict[str, list[float]] = {name: [] for name in schedules}
    for i, (period, name) in enumerate(zip(periods, schedules)):
        if i >= warmup and (block == 1 or i % block >= settle):
            out[name].append(period)
    return out


def check_settle(block: int, settle: int) -> None:
    """A KoalaError (one line, in the examples' flags) for a settle count that leaves no iteration
    of a turn: --alternate-settle must be at least 1 and below --alternate-block."""
    if settle < 1 or (block > 1 and settle >= block):
        raise KoalaError(f"--alternate-settle {settle} must be at least 1 and below --alternate-block {block}: a "
                         f"turn keeps its iterations after the first {settle}")


@dataclass(frozen=True)
class TurnMedian:
    schedule: str
    median_ms: float
    kept: int
    speed: float  # the first schedule's median / this one's (> 1: faster than the first)


def turn_medians(periods: list[float], schedules: list[str], warmup: int, block: int,
                 settle: int = 1) -> list[TurnMedian]:
    """Each schedule's median period over its counted iterations and its speed relative to the
    first schedule's; a schedule with no counted iteration is left out."""
    kept = {name: sorted(v) for name, v in kept_periods(periods, schedules, warmup, block, settle).items() if v}
    medians = {name: statistics.median(v) for name, v in kept.items()}
    first = medians.get(schedules[0]) if schedules else None
    return [TurnMedian(name, med, len(kept[name]), first / med if first else float("nan"))
            for name, med in medians.items()]


def summary(periods: list[float], schedules: list[str], warmup: int, block: int, settle: int = 1) -> str:
    """One line for a run's end: per schedule its median step period and speed against the first."""
    rows = turn_medians(periods, schedules, warmup, block, settle)
    if not rows:
        first = "the first" if settle == 1 else f"the first {settle}"
        return f"schedules taking turns: no iteration counted (the first {warmup} and {first} of each turn of " \
               f"{block} are left out): run more iterations"
    return "schedules taking turns, median step period (iterations counted): " + ", ".join(
        f"{r.schedule} {r.median_ms:.1f} ms ({r.kept}, {r.speed:.3f}x of {schedules[0]}'s speed)" for r in rows)
