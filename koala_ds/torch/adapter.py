"""A Koala schedule as a torch.distributed.pipelining schedule, run by torch's own runtime.

`schedule(stages, n_microbatches, loss_fn, spec)` resolves `spec` (a library name, a `.koala`
program, a `.json` / `.csv` schedule file or a Schedule) for the (p, m, v) the stages give,
checks that this rank's PipelineStage objects are the stages the schedule's placement puts on
this rank, and returns a `KoalaPipelineSchedule`: torch's `_PipelineScheduleRuntime` fed with
every rank's compute actions (as torch's `_load_csv` would read them from
`koala export --format torch-csv`). torch then lowers them with its own passes
(`_add_unshard_reshard`, `_add_reduce_grad`, `_add_send_recv`) and runs them with its own
`_step_microbatches`; nothing of torch's runtime is copied here.

What torch cannot run is refused in one line (a ScheduleFitError, a KoalaError): a schedule
of two pipelines (chimera; each rank would hold two separately updated model replicas), and
a split-backward schedule over stage modules compiled with torch.compile (torch's I / W split
does not support them).

Where torch has a hand-written single-stage loop for exactly the schedule's order (GPipe's in
ScheduleGPipe, 1F1B's in Schedule1F1B), `schedule()` runs it there instead (`own_loop=True`,
the default): the same actions in the same order without the runtime's bookkeeping per action
(Schedule1F1B also fuses each send with the next receive); measured faster than the general
runtime on those orders (benchmarks/torch_speed.py). `own_loop=False` always takes the general
runtime.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    _Action,
    _check_torch_compile_compatibility,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from ..core.ir import Action, Op, Schedule
from ..resolve import TORCH, ScheduleFitError, Settings, _where, resolve

log = logging.getLogger(__name__)


def torch_actions(schedule: Schedule) -> dict[int, list[_Action]]:
    """Every rank's compute actions as torch's `_Action`s: what `_load_csv` makes of the
    schedule's `to_torch_csv()`, one list per rank."""
    types = {op: _ComputationType.from_str(op.value) for op in {a.op for rank in schedule.ranks for a in rank}}
    return {r: [_Action(a.stage, types[a.op], a.microbatch) for a in rank] for r, rank in enumerate(schedule.ranks)}


class KoalaPipelineSchedule(_PipelineScheduleRuntime):
    """torch's `_PipelineScheduleRuntime` running `koala_schedule` (a resolved Schedule whose
    placement matches `stages`; build it with `schedule()`, which checks that). Its `step` and
    `eval` are torch's; `pipeline_order` holds the compute actions, `pipeline_order_with_comms`
    what torch's lowering made of them."""

    def __init__(self, stages: Sequence[_PipelineStageBase], n_microbatches: int, loss_fn: Callable | None,
                 koala_schedule: Schedule, **options: Any) -> None:
        super().__init__(stages=list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, **options)
        self.koala_schedule = koala_schedule
        self.pipeline_order = torch_actions(koala_schedule)
        self._prepare_schedule_with_comms(self.pipeline_order)
        log.info("koala schedule %s (p=%d, m=%d, v=%d, %s placement, %s backward) on rank %d: stages %s",
                 koala_schedule.name, koala_schedule.p, koala_schedule.m, koala_schedule.v,
                 koala_schedule.placement.describe(), koala_schedule.backward, self.rank,
                 [s.stage_index for s in self._stages])


def local_stages(stages, where: str = "stages") -> list[_PipelineStageBase]:
    """This rank's stages (one PipelineStage or a sequence of them) in stage order, after
    checking they belong to one pipeline: same process group, same num_stages, no index twice."""
    given = [stages] if isinstance(stages, _PipelineStageBase) else stages
    if not isinstance(given, (list, tuple)) or not given:
        raise ScheduleFitError(f"{where}: expected this rank's PipelineStage objects (one, or a non-empty list), "
                               f"got {stages!r}")
    for stage in given:
        if not isinstance(stage, _PipelineStageBase):
            raise ScheduleFitError(f"{where}: expected torch.distributed.pipelining PipelineStage objects, got "
                                   f"{type(stage).__name__}")
    first = given[0]
    for stage in given[1:]:
        if (stage.num_stages, stage.group_size, stage.group_rank) != (first.num_stages, first.group_size,
                                                                      first.group_rank):
            raise ScheduleFitError(f"{where}: the stages disagree: stage {first.stage_index} has num_stages="
                                   f"{first.num_stages} on rank {first.group_rank} of {first.group_size}, stage "
                                   f"{stage.stage_index} num_stages={stage.num_stages} on rank {stage.group_rank} of "
                                   f"{stage.group_size}: build every stage of a rank with the same num_stages and "
                                   f"process group")
    indices = [s.stage_index for s in given]
    if len(set(indices)) != len(indices):
        raise ScheduleFitError(f"{where}: stage_index {sorted(i for i in indices if indices.count(i) > 1)[0]} is "
                               f"given twice on rank {first.group_rank}")
    return sorted(given, key=lambda s: s.stage_index)


def chunks_per_rank(p: int, num_stages: int, held: int, rank: int) -> int:
    """v: num_stages / p, which every rank must hold (`held`: how many this `rank` holds)."""
    if num_stages % p:
        raise ScheduleFitError(f"the PipelineStage's num_stages={num_stages} is not a multiple of its process group's "
                               f"{p} ranks: build the same number of stages on every rank")
    if held != num_stages // p:
        raise ScheduleFitError(f"rank {rank} holds {held} PipelineStage(s) but num_stages / group size = "
                               f"{num_stages} / {p} = {num_stages // p}: build {num_stages // p} stage(s) on every "
                               f"rank")
    return num_stages // p


def check_stages(schedule: Schedule, rank: int, have: Sequence[int], where: str) -> None:
    """The stage indices `rank` holds (`have`, in order) must be the ones the schedule places on it."""
    want = schedule.placement.stages_of(rank)
    if tuple(have) != want:
        listed = ", ".join(map(str, want))
        raise ScheduleFitError(f"{where} places stage(s) {listed} on rank {rank} ({schedule.placement.describe()} "
                               f"placement), but this rank's PipelineStage objects have stage_index "
                               f"{', '.join(map(str, have))}: build rank {rank}'s PipelineStage(s) with stage_index "
                               f"{listed}")


def stage_indices(spec, rank: int, p: int, m: int, v: int = 1, settings: Settings = TORCH) -> tuple[int, ...]:
    """The stage indices to build on `rank` for `spec` at (p, m, v): its placement's."""
    return resolve(spec, p, m, v, settings).placement.stages_of(rank)


#: torch's single-stage loops and the keyword options they take.
SINGLE_OPTIONS = frozenset({"args_chunk_spec", "kwargs_chunk_spec", "output_merge_spec", "scale_grads"})


def single_stage_orders(p: int, m: int) -> dict[type, list[list[Action]]]:
    """What ScheduleGPipe and Schedule1F1B execute on each rank (their `_step_microbatches`)."""
    gpipe = [[Action(Op.F, r, i) for i in range(m)] + [Action(Op.B, r, i) for i in range(m)] for r in range(p)]
    one_f_one_b = []
    for r in range(p):
        warm = min(m, p - r)
        order = [Action(Op.F, r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action(Op.B, r, i), Action(Op.F, r, warm + i)]
        one_f_one_b.append(order + [Action(Op.B, r, i) for i in range(m - warm, m)])
    return {ScheduleGPipe: gpipe, Schedule1F1B: one_f_one_b}


def own_loop_class(schedule: Schedule, options: dict) -> type[PipelineScheduleSingle] | None:
    """torch's single-stage class that executes exactly `schedule`'s order, or None."""
    if (schedule.v != 1 or schedule.placement.pipelines != 1 or schedule.backward != "full"
            or set(options) - SINGLE_OPTIONS or schedule.placement.stage_ranks != tuple(range(schedule.p))):
        return None
    ranks = [list(r) for r in schedule.ranks]
    for cls, order in single_stage_orders(schedule.p, schedule.m).items():
        if ranks == order and not (cls is Schedule1F1B and schedule.m < schedule.p):  # 1F1B's own limit
            return cls
    return None


def schedule(stages, n_microbatches: int, loss_fn: Callable | None, spec, *, settings: Settings = TORCH,
             source: str | None = None, own_loop: bool = True, **options: Any) -> _PipelineSchedule:
    """`spec` (a library name, a .koala / .json / .csv file, or a Schedule) as a torch pipeline
    schedule over this rank's `stages` (one PipelineStage or a list). p is the stages' group
    size, v their num_stages / p; `n_microbatches` is m. `options` go to torch's schedule
    (args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
    backward_requires_autograd, defer_pp_recv). `settings` names the user's own settings in
    error messages (a script passes its flags' names), `source` the schedule. Returns a
    KoalaPipelineSchedule, or with `own_loop` torch's ScheduleGPipe / Schedule1F1B where that
    loop runs exactly the schedule's order (its `koala_schedule` attribute is the schedule)."""
    where = source or _where(spec, settings)
    local = local_stages(stages)
    first = local[0]
    v = chunks_per_rank(first.group_size, first.num_stages, len(local), first.group_rank)
    resolved = resolve(spec, first.group_size, n_microbatches, v, settings, source)
    check_stages(resolved, first.group_rank, [s.stage_index for s in local], where)
    if resolved.backward == "split":
        try:
            _check_torch_compile_compatibility(local, f"split-backward {resolved.name}")
        except RuntimeError as exc:
            raise ScheduleFitError(f"{where}: {exc} (torch's I / W split); use a full-backward schedule "
                                   f"(e.g. 1f1b or interleaved-1f1b) or stages without torch.compile") from None
    single = own_loop_class(resolved, options) if own_loop else None
    if single is None:
        return KoalaPipelineSchedule(local, n_microbatches, loss_fn, resolved, **options)
    pipe = single(local[0], n_microbatches, loss_fn=loss_fn, **options)
    pipe.koala_schedule = resolved
    log.info("koala schedule %s (p=%d, m=%d) on rank %d: torch's %s runs its order", resolved.name, resolved.p,
             resolved.m, first.group_rank, single.__name__)
    return pipe


#: torchtitan builds each rank's stages by its --parallelism.pipeline_parallel_schedule class:
#: V-shape (two stages per rank) for these, else looped (stage s on rank s % p).
TORCHTITAN_V_NAMES = ("ZBVZeroBubble", "DualPipeV")


def torchtitan_schedule_name(schedule: Schedule) -> str:
    """The --parallelism.pipeline_parallel_schedule to pass torchtitan with
    --parallelism.pipeline_parallel_schedule_csv (`koala export --format torch-csv`): the
    class whose stage placement is the schedule's (torchtitan runs the CSV on
    `_PipelineScheduleRuntime` whatever the class; the class only decides which stages each
    rank builds). One line for a placement torchtitan does not build."""
    placement = schedule.placement
    if placement.pipelines == 1 and schedule.v == 1:
        return "1F1B"  # any single-stage class: one stage per rank, stage r on rank r
    if placement.pipelines == 1 and placement.style == "interleaved":
        return "PipelineScheduleMulti"
    if placement.pipelines == 1 and placement.style == "vshape" and schedule.v == 2:
        return TORCHTITAN_V_NAMES[0]
    raise ScheduleFitError(f"schedule {schedule.name!r} places its stages {placement.describe()} with v={schedule.v}: "
                           f"torchtitan builds one stage per rank, stage s on rank s % p, or a V of 2 stages per "
                           f"rank; run it with koala_ds.torch.schedule on stages you build")
