"""Schedule validation: completeness, local order, deadlock freedom, in-flight activations.

Errors raise `ScheduleError` with a rank x step grid in which the offending action is
marked, so that a user sees where the schedule goes wrong.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .ir import Action, Op, Schedule, ScheduleError

BACKWARD_INPUT_OPS = (Op.I, Op.B)


def cross_dependencies(schedule: Schedule, action: Action, bwd_op: dict[tuple[int, int], Op]) -> list[Action]:
    """Actions that must finish before `action` may start (data dependencies).

    `bwd_op[(stage, mb)]` says whether that pair's input gradient comes from I or B."""
    placement = schedule.placement
    s, mb = action.stage, action.microbatch
    if action.op is Op.F:
        prev = placement.prev_stage(s)
        return [] if prev is None else [Action(Op.F, prev, mb)]
    if action.op is Op.W:
        return [Action(Op.I, s, mb)]
    deps = [Action(Op.F, s, mb)]
    nxt = placement.next_stage(s)
    if nxt is not None:
        deps.append(Action(bwd_op.get((nxt, mb), Op.B), nxt, mb))
    return deps


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
    peak_pending_w: list[int]  # per rank, weight-gradient steps waiting


def dry_run(schedule: Schedule) -> DryRun:
    """Execute every rank's order with unit-time actions; raise on deadlock."""
    bwd_op = {(a.stage, a.microbatch): a.op for r in schedule.ranks for a in r if a.op in BACKWARD_INPUT_OPS}
    deps = [[cross_dependencies(schedule, a, bwd_op) for a in rank] for rank in schedule.ranks]
    end: dict[Action, int] = {}
    free = [0] * schedule.p
    ptr = [0] * schedule.p
    steps: list[list[int]] = [[] for _ in range(schedule.p)]
    remaining = schedule.num_actions
    while remaining:
        progress = False
        for r, actions in enumerate(schedule.ranks):
            while ptr[r] < len(actions):
                dl = deps[r][ptr[r]]
                if any(d not in end for d in dl):
                    break
                start = max([free[r]] + [end[d] for d in dl])
                steps[r].append(start)
                free[r] = start + 1
                end[actions[ptr[r]]] = start + 1
                ptr[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            waiting = [(r, schedule.ranks[r][ptr[r]]) for r in range(schedule.p) if ptr[r] < len(schedule.ranks[r])]
            desc = "; ".join(f"rank {r} waits at {a} for "
                             f"{', '.join(str(d) for d in deps[r][ptr[r]] if d not in end)}" for r, a in waiting)
            _fail(schedule, f"deadlock with non-blocking sends and blocking receives: {desc}",
                  waiting[0][1], waiting[0][0])
    peaks, pend = [], []
    for rank in schedule.ranks:
        held = pw = peak = peak_w = 0
        for a in rank:
            if a.op is Op.F:
                held += 1
            elif a.op in BACKWARD_INPUT_OPS:
                held -= 1
                if a.op is Op.I:
                    pw += 1
            else:
                pw -= 1
            peak, peak_w = max(peak, held), max(peak_w, pw)
        peaks.append(peak)
        pend.append(peak_w)
    return DryRun(steps, max(free), peaks, pend)


def validate(schedule: Schedule) -> DryRun:
    """Check every rule; return the unit-time dry run. Raises `ScheduleError`."""
    placement = schedule.placement
    if placement.num_stages != schedule.p * schedule.v * placement.pipelines:
        _fail(schedule, f"placement has {placement.num_stages} stages, expected p*v*pipelines = "
                        f"{schedule.p * schedule.v * placement.pipelines}")
    allowed = {Op.F, Op.B} if schedule.backward == "full" else {Op.F, Op.I, Op.W, Op.B}
    seen: Counter = Counter()
    for r, actions in enumerate(schedule.ranks):
        done: set[tuple[Op, int, int]] = set()
        for a in actions:
            if a.stage >= placement.num_stages:
                _fail(schedule, f"{a}: stage {a.stage} does not exist (stages 0..{placement.num_stages - 1})", a, r)
            if placement.rank_of(a.stage) != r:
                _fail(schedule, f"{a} is on rank {r} but stage {a.stage} lives on rank "
                                f"{placement.rank_of(a.stage)}", a, r)
            if a.microbatch not in placement.microbatches_of(a.stage, schedule.m):
                _fail(schedule, f"{a}: microbatch {a.microbatch} does not pass through stage {a.stage} "
                                f"(m={schedule.m})", a, r)
            if a.op not in allowed:
                _fail(schedule, f"{a}: op {a.op} needs 'backward split' (schedule is backward full)", a, r)
            key = (a.op, a.stage, a.microbatch)
            if key in done:
                _fail(schedule, f"{a} appears twice", a, r)
            if a.op in (Op.I, Op.B) and (Op.F, a.stage, a.microbatch) not in done:
                _fail(schedule, f"{a} runs before its forward {a.stage}F{a.microbatch}", a, r)
            if a.op is Op.W and (Op.I, a.stage, a.microbatch) not in done:
                _fail(schedule, f"{a} runs before its input-gradient step {a.stage}I{a.microbatch}", a, r)
            done.add(key)
            seen[key] += 1
    for stage in range(placement.num_stages):
        for mb in placement.microbatches_of(stage, schedule.m):
            has = {op: seen[(op, stage, mb)] for op in Op}
            rank = placement.rank_of(stage)
            if not has[Op.F]:
                _fail(schedule, f"missing forward {stage}F{mb} on rank {rank}")
            full, split = has[Op.B] == 1 and not has[Op.I] and not has[Op.W], has[Op.I] == 1 and has[Op.W] == 1 and not has[Op.B]
            if not (full or split):
                _fail(schedule, f"stage {stage} microbatch {mb} needs one B or one I and one W on rank {rank}; "
                                f"has B x{has[Op.B]}, I x{has[Op.I]}, W x{has[Op.W]}")
    return dry_run(schedule)
