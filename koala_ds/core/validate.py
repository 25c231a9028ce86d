"""Schedule validation: completeness, local order, deadlock freedom, in-flight activations.

Errors raise `ScheduleError` with a rank x step grid in which the offending action is
marked, so that a user sees where the schedule goes wrong.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .ir import MAX_ACTIONS, Action, Op, Placement, Schedule, ScheduleError
from .lowered import Lowered

BACKWARD_INPUT_OPS = (Op.I, Op.B)


def render_grid(schedule: Schedule, mark: Action | None = None, mark_rank: int | None = None,
                steps: list[list[int]] | None = None, width: int = 24) -> str:
    """Rank x step grid. With `steps` (start step of each action), columns are time steps
    and idle steps show as '.'; otherwise columns are positions in each rank's list."""
    cells: list[dict[int, str]] = []
    mark_col = None
    for r, actions in enumerate(schedule.ranks):
        row: dict[int, str] = {}
        for i, a in enumerate(actions):
            col = steps[r][i] if steps is not None else i
            text = str(a)
            if mark is not None and a == mark and (mark_rank is None or mark_rank == r):
                text = f">{text}<"
                mark_col = col
            row[col] = text
        cells.append(row)
    ncols = max((max(row) + 1 for row in cells if row), default=0)
    lo, hi = 0, ncols
    if ncols > width:
        centre = mark_col if mark_col is not None else 0
        lo = max(0, min(centre - width // 2, ncols - width))
        hi = lo + width
    cw = max([len(t) for row in cells for c, t in row.items() if lo <= c < hi] + [3])
    head = "      " + " ".join(f"{c:>{cw}}" for c in range(lo, hi))
    lines = [head]
    for r, row in enumerate(cells):
        body = " ".join(f"{row.get(c, '.'):>{cw}}" for c in range(lo, hi))
        lines.append(f"rank {r:<2}{'…' if lo else ' '}{body}{' …' if hi < ncols else ''}")
    return "\n".join(lines)


def _fail(schedule: Schedule, message: str, action: Action | None = None, rank: int | None = None) -> None:
    grid = render_grid(schedule, action, rank)
    raise ScheduleError(f"schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, v={schedule.v}): "
                        f"{message}\n{grid}")


@dataclass(frozen=True)
class DryRun:
    """Unit-time execution with non-blocking sends and blocking receives."""

    steps: list[list[int]]  # start step of each action, per rank
    makespan: int
    peak_in_flight: list[int]  # per rank, activations held (F done, input grad not yet)


@functools.lru_cache(maxsize=8)
def _unit_lowered(placement: Placement, m: int, backward: str) -> Lowered:
    """Unit time, and an activation counts 1 (`koala_ds.core.lowered` without a profile)."""
    return Lowered(placement, m, backward)


def dry_run(schedule: Schedule) -> DryRun:
    """Execute every rank's order with unit-time actions; raise on deadlock. The orders must be
    complete and locally ordered (`validate` checks that first)."""
    lowered = _unit_lowered(schedule.placement, schedule.m, schedule.backward)
    codes = lowered.encode(schedule.ranks)
    free, starts, pos, _ = lowered.run_async(codes, record=True)
    waiting = [r for r in range(schedule.p) if pos[r] < len(codes[r])]
    if waiting:
        _deadlock(schedule, lowered, codes, pos, waiting)
    steps = [[int(t) for t in row] for row in starts]
    return DryRun(steps, int(max(free)), [int(x) for x in lowered.peaks(codes)])


def _deadlock(schedule: Schedule, lowered: Lowered, codes: list[list[int]], pos: list[int],
              waiting: list[int]) -> None:
    m = schedule.m
    gradient_op = {a.stage * m + a.microbatch: a.op.value for r in schedule.ranks for a in r
                   if a.op in BACKWARD_INPUT_OPS}
    desc = "; ".join(f"rank {r} waits at {schedule.ranks[r][pos[r]]} for "
                     f"{lowered.slot_text(lowered.dep[codes[r][pos[r]]], gradient_op)}" for r in waiting)
    r = waiting[0]
    _fail(schedule, f"deadlock with non-blocking sends and blocking receives: {desc}", schedule.ranks[r][pos[r]], r)


def _check_rank(schedule: Schedule, r: int, allowed: set, flags: dict) -> None:
    """The per-action rules of rank r, in order; marks each action done in `flags`."""
    placement, m = schedule.placement, schedule.m
    n, stage_ranks, pipelines, spp = placement.num_stages, placement.stage_ranks, placement.pipelines, \
        placement.stages_per_pipeline
    f_done, i_done = flags[Op.F], flags[Op.I]
    for a in schedule.ranks[r]:
        s, mb, op = a.stage, a.microbatch, a.op
        if s >= n or stage_ranks[s] != r or mb >= m or mb % pipelines != s // spp or op not in allowed:
            _check_action(schedule, r, a, allowed, flags)  # raises with the reason
        k = s * m + mb
        done = flags[op]
        if done[k] or (op is Op.W and not i_done[k]) or (op is not Op.F and op is not Op.W and not f_done[k]):
            _check_action(schedule, r, a, allowed, flags)
        done[k] = 1


def _check_action(schedule: Schedule, r: int, a: Action, allowed: set, flags: dict) -> None:
    """The per-action rules (placement, range, op, order); marks the action done."""
    placement, m = schedule.placement, schedule.m
    s, mb = a.stage, a.microbatch
    if s >= placement.num_stages:
        _fail(schedule, f"{a}: stage {s} does not exist (stages 0..{placement.num_stages - 1})", a, r)
    if placement.stage_ranks[s] != r:
        _fail(schedule, f"{a} is on rank {r} but stage {s} lives on rank {placement.rank_of(s)}", a, r)
    if mb >= m or mb % placement.pipelines != placement.pipeline_of(s):
        _fail(schedule, f"{a}: microbatch {mb} does not pass through stage {s} (m={m})", a, r)
    if a.op not in allowed:
        _fail(schedule, f"{a}: op {a.op} needs 'backward split' (schedule is backward full)", a, r)
    k = s * m + mb
    if flags[a.op][k]:
        _fail(schedule, f"{a} appears twice", a, r)
    if a.op in BACKWARD_INPUT_OPS and not flags[Op.F][k]:
        _fail(schedule, f"{a} runs before its forward {s}F{mb}", a, r)
    if a.op is Op.W and not flags[Op.I][k]:
        _fail(schedule, f"{a} runs before its input-gradient step {s}I{mb}", a, r)
    flags[a.op][k] = 1


def _check_complete(schedule: Schedule, flags: dict) -> None:
    placement, m = schedule.placement, schedule.m
    f, b, i, w = flags[Op.F], flags[Op.B], flags[Op.I], flags[Op.W]
    for stage in range(placement.num_stages):
        for mb in placement.microbatches_of(stage, m):
            k = stage * m + mb
            if f[k] and ((b[k] and not i[k] and not w[k]) or (i[k] and w[k] and not b[k])):
                continue
            rank = placement.rank_of(stage)
            if not f[k]:
                _fail(schedule, f"missing forward {stage}F{mb} on rank {rank}")
            _fail(schedule, f"stage {stage} microbatch {mb} needs one B or one I and one W on rank {rank}; "
                            f"has B x{b[k]}, I x{i[k]}, W x{w[k]}")


def validate(schedule: Schedule) -> DryRun:
    """Check every rule; return the unit-time dry run. Raises `ScheduleError`.

    Time and memory are O(actions + stages * m): each (op, stage, microbatch) is a flag in a
    dense table (a stage lives on one rank, so a repeat anywhere is a repeat on that rank)."""
    placement = schedule.placement
    if placement.num_stages != schedule.p * schedule.v * placement.pipelines:
        _fail(schedule, f"placement has {placement.num_stages} stages, expected p*v*pipelines = "
                        f"{schedule.p * schedule.v * placement.pipelines}")
    if schedule.num_actions > MAX_ACTIONS:
        raise ScheduleError(f"schedule {schedule.name!r}: {schedule.num_actions:,} actions, over the limit of "
                            f"{MAX_ACTIONS:,} (MAX_ACTIONS): use a smaller -m, -p or -v")
    allowed = {Op.F, Op.B} if schedule.backward == "full" else {Op.F, Op.I, Op.W, Op.B}
    n = placement.num_stages * schedule.m
    flags = {op: bytearray(n) for op in Op}
    for r in range(schedule.p):
        _check_rank(schedule, r, allowed, flags)
    _check_complete(schedule, flags)
    return dry_run(schedule)
