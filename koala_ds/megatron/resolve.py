"""The schedule for a Megatron step: `koala_ds.resolve` in Megatron's words (its flags), cached
per (schedule, p, m, v) since the runtime asks every step. No torch here."""
from __future__ import annotations

import functools
import os

from ..core.ir import Schedule
from ..resolve import MEGATRON, ScheduleFitError, Settings, check_spec as _check_spec, resolve as _resolve

__all__ = ["MEGATRON", "MegatronScheduleError", "check_spec", "resolve"]

#: The Megatron adapter's name for `koala_ds.resolve.ScheduleFitError` (the same class).
MegatronScheduleError = ScheduleFitError


def check_spec(spec) -> None:
    """Fail early (at get_forward_backward_func / install time) on a missing file or unknown name."""
    _check_spec(spec, MEGATRON)


def resolve(spec, p: int, m: int, v: int, settings: Settings = MEGATRON) -> Schedule:
    """The validated schedule for this step, or MegatronScheduleError naming the flag to change
    (`settings`: MEGATRON, or MEGATRON_LM where Megatron-LM builds the model chunks)."""
    if isinstance(spec, Schedule):
        return _cached(_Same(spec), p, m, v, None, _Words(settings))
    stamp = None
    if isinstance(spec, str) and os.path.isfile(spec):
        info = os.stat(spec)
        stamp = (info.st_mtime_ns, info.st_size)  # an edited file is read again
    return _cached(spec, p, m, v, stamp, _Words(settings))


class _Words:
    """The settings a miss resolves with, left out of the cache key (equal to any other): a
    resolved schedule does not depend on them, only the messages of a failure do, and failures
    are not cached. So the launcher's check (MEGATRON_LM) and the runtime's steps (MEGATRON)
    share one compile."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other) -> bool:
        return isinstance(other, _Words)


class _Same:
    """Hashable by identity, so that a given Schedule object is checked once."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def __hash__(self) -> int:
        return id(self.schedule)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.schedule is self.schedule


@functools.lru_cache(maxsize=64)
def _cached(spec, p: int, m: int, v: int, stamp, words: _Words) -> Schedule:
    del stamp  # part of the cache key only
    return _resolve(spec.schedule if isinstance(spec, _Same) else spec, p, m, v, words.settings)
