"""Turn what the user gave (a Schedule, a library name, a .koala/.json/.csv file) into a
validated Schedule for the (p, m, v) of a training step. No torch here."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..ir import KoalaError, Schedule
from ..library import FIXED_SUFFIXES, did_you_mean, load_schedule, names, read_schedule_file
from ..validate import validate

FILE_SUFFIXES = (".koala", ".json", ".csv")
#: How schedule errors name p, m and v on Megatron: its flags.
MEGATRON_NAMES = {"p": "--pipeline-model-parallel-size", "v": "--virtual-pipeline-model-parallel-size",
                  "m": "--global-batch-size / --micro-batch-size (the number of microbatches)"}


class MegatronScheduleError(KoalaError):
    """The Koala schedule does not fit the Megatron job (sizes, chunks, placement, options)."""


def looks_like_path(spec: str) -> bool:
    return spec.endswith(FILE_SUFFIXES) or os.sep in spec or "/" in spec


def check_spec(spec) -> None:
    """Fail early (at get_forward_backward_func / install time) on a missing file or unknown name."""
    if isinstance(spec, Schedule):
        return
    if not isinstance(spec, str) or not spec:
        raise MegatronScheduleError(f"--koala-schedule: expected a schedule name or file, got {spec!r}")
    if looks_like_path(spec):
        if not os.path.isfile(spec):
            raise MegatronScheduleError(f"--koala-schedule {spec}: no such file")
        return
    known = names()
    if spec not in known:
        raise MegatronScheduleError(f"--koala-schedule {spec}: unknown schedule{did_you_mean(spec, known)}; "
                                    f"library schedules: {', '.join(known)} (or give a .koala / .json / .csv file)")


@dataclass(frozen=True)
class _Key:
    spec: object
    p: int
    m: int
    v: int


def resolve(spec, p: int, m: int, v: int) -> Schedule:
    """The validated schedule for this step, or MegatronScheduleError saying what to change."""
    return _resolve(_Key(spec if not isinstance(spec, Schedule) else _Frozen(spec), p, m, v))


class _Frozen:
    """Hashable wrapper so that a given Schedule object is validated once."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def __hash__(self) -> int:
        return id(self.schedule)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Frozen) and other.schedule is self.schedule


@functools.lru_cache(maxsize=64)
def _resolve(key: _Key) -> Schedule:
    spec, p, m, v = key.spec, key.p, key.m, key.v
    if isinstance(spec, _Frozen):
        schedule, where = spec.schedule, f"schedule {spec.schedule.name!r}"
    elif looks_like_path(spec):
        where = spec
        if not os.path.isfile(spec):
            raise MegatronScheduleError(f"--koala-schedule {spec}: no such file")
        if spec.endswith(FIXED_SUFFIXES):
            schedule = read_schedule_file(spec)  # as written: the checks below name the flags
        else:
            schedule = _library_load(spec, p, m, v)
    else:
        where = f"library schedule {spec!r}"
        check_spec(spec)
        schedule = _library_load(spec, p, m, v)
    if schedule.placement.pipelines != 1:
        raise MegatronScheduleError(f"{where}: bidirectional placements ({schedule.placement.describe()}) need two "
                                    f"model replicas per rank; the Megatron runtime supports one pipeline only")
    if schedule.p != p:
        raise MegatronScheduleError(f"{where} is for p={schedule.p} pipeline ranks but --pipeline-model-parallel-size "
                                    f"is {p}: set --pipeline-model-parallel-size {schedule.p} or use a schedule for p={p}")
    if schedule.v != v:
        raise MegatronScheduleError(f"{where} needs v={schedule.v} model chunks per rank but the model list has {v}: "
                                    f"set --virtual-pipeline-model-parallel-size {schedule.v if schedule.v > 1 else 'off'}"
                                    f" (model = list of {schedule.v} chunks) or use a schedule for v={v}")
    if schedule.m != m:
        raise MegatronScheduleError(f"{where} is for m={schedule.m} microbatches but this step has "
                                    f"num_microbatches={m}: set --global-batch-size / --micro-batch-size so that "
                                    f"there are {schedule.m} microbatches, or use a schedule for m={m}")
    validate(schedule)
    return schedule


def _library_load(spec: str, p: int, m: int, v: int) -> Schedule:
    """Compile a library name or .koala file; its errors name Megatron's flags."""
    try:
        return load_schedule(spec, p, m, v, MEGATRON_NAMES)
    except MegatronScheduleError:
        raise
    except KoalaError as exc:
        raise MegatronScheduleError(f"--koala-schedule {spec}: {exc}") from None
