"""Speedups between schedules traced taking turns in one process: measured, and a profile's.

Runs traced taking turns (the examples' --alternate-schedules with a trace: FILE and FILE.<name>
from one process) ran step by step alternating, so a drift of the machine hits every one of them
alike: the ratio of their measured step times is the speedup a user would get, with the drift
taken out. It is what a search's printed speedup promises, and so `koala calibrate` puts it beside
the calibrated profile's: where the two differ by more than SPEEDUP_TOLERANCE and by more than
their noise, the model lacks a term one of the schedules pays, and a search on that profile
would misjudge such schedules by as much.

On the fidelity benchmark's examples (CPU, p = 2, m = 8, 1f1b and zb-h1 taking turns of 4
iterations, three runs of 96-192 iterations, 2026-12-07) the calibrated profile gave zb-h1 over
1f1b 1.010x / 1.026x / 1.074x where the runs measured 1.012x / 1.018x / 1.067x (Megatron 4x64,
8x256, DeepSpeed dim 1024); fitted on each third of the steps alone, it followed that third's
measured speedup within 0.02 while the measured speedup itself moved by up to 0.07 between them
(README, "What the calibration's own runs say").
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from .measured import TracedRun

#: the largest difference between a measured and a predicted speedup that counts as agreement
#: (the fidelity target of issue 39)
SPEEDUP_TOLERANCE = 0.05


@dataclass(frozen=True)
class TurnSpeedup:
    """`schedule`'s speedup over `over` (the first traced schedule): measured in each process
    where both took turns (`over`'s median step / `schedule`'s), and predicted by a profile."""

    schedule: str
    over: str
    measured: tuple[float, ...]
    predicted: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.measured)

    @property
    def se(self) -> float | None:
        """The standard error of `mean` (None from one process)."""
        n = len(self.measured)
        return statistics.stdev(self.measured) / math.sqrt(n) if n > 1 else None

    @property
    def error(self) -> float:
        return self.predicted - self.mean

    @property
    def misses(self) -> bool:
        """Off by more than SPEEDUP_TOLERANCE and by more than twice the measured mean's SE."""
        return abs(self.error) > SPEEDUP_TOLERANCE and abs(self.error) > 2 * (self.se or 0.0)

    @property
    def imprecise(self) -> bool:
        """Measured too loosely to judge a promise within SPEEDUP_TOLERANCE: twice the mean's SE is
        more, as printed (to 3 decimals), or only one process measured it (its noise unknown)."""
        return self.se is None or round(2 * self.se, 3) > SPEEDUP_TOLERANCE

    def to_dict(self) -> dict:
        """As the calibrated profile keeps it (meta.calibration.turn_speedups)."""
        return {"schedule": self.schedule, "over": self.over, "measured": [round(x, 6) for x in self.measured],
                "calibrated": round(self.predicted, 6)}

    def line(self) -> str:
        se = f", SE {self.se:.3f}" if self.se is not None else ""
        each = ", ".join(f"{x:.3f}" for x in self.measured)
        return (f"{self.schedule} over {self.over}: measured {each} (mean {self.mean:.3f}{se}); "
                f"calibrated {self.predicted:.3f} ({self.error:+.3f})")


def processes(runs: Sequence[TracedRun]) -> list[list[int]]:
    """The indices of `runs` grouped by the process they took turns in: runs whose steps overlap in
    time (one machine, one clock) ran together. Runs that did not take turns are left out."""
    spans = sorted((min(s.start for s in r.steps), max(s.end for s in r.steps), i)
                   for i, r in enumerate(runs) if r.took_turns and r.steps)
    groups: list[list[int]] = []
    end = -math.inf
    for start, stop, i in spans:
        if start > end:
            groups.append([])
        groups[-1].append(i)
        end = max(end, stop)
    return [sorted(g) for g in groups if len(g) > 1]


def turn_speedups(runs: Sequence[TracedRun], measured: Sequence[float], predicted: Sequence[float]
                  ) -> list[TurnSpeedup]:
    """Per schedule that took turns with the first run's schedule, its speedup over it: measured
    (each run's median step time, `measured[i]`) in every process where both ran, and predicted
    (`predicted[i]`, a profile's step time of run i). [] where no process ran it beside another."""
    if not runs:
        return []
    over = runs[0].schedule.name
    found: dict[str, list[float]] = {}
    model: dict[str, float] = {}
    base_ms = None
    for group in processes(runs):
        names = {runs[i].schedule.name: i for i in reversed(group)}  # the first run of each name
        if over not in names:
            continue
        b = names[over]
        base_ms = predicted[b]
        for name, i in names.items():
            if name != over and measured[i] > 0:
                found.setdefault(name, []).append(measured[b] / measured[i])
                model[name] = predicted[i]
    return [TurnSpeedup(name, over, tuple(values), base_ms / model[name]) for name, values in found.items()
            if base_ms and model[name] > 0]
