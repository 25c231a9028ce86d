"""Schedule validation: completeness, local order, deadlock freedom, in-flight activations.

Errors raise `ScheduleError` with a rank x step grid in which the offending action is
marked, so that a user sees where the schedule goes wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import MAX_ACTIONS, Action, Op, Schedule, ScheduleError

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


def _dependency_keys(schedule: Schedule) -> list[list[tuple[tuple[int, ...], int]]]:
    """Per rank and action, (its data dependencies, its own key), as keys into the end-time
    table: 2k = forward of (stage, mb) key k = stage * m + mb, 2k + 1 = its input gradient
    (I or B); W needs its I and has no key of its own (-1)."""
    spp, m = schedule.placement.stages_per_pipeline, schedule.m
    out = []
    for actions in schedule.ranks:
        row = []
        for a in actions:
            s, k = a.stage, a.stage * m + a.microbatch
            if a.op is Op.F:
                row.append((() if s % spp == 0 else (2 * (k - m),), 2 * k))
            elif a.op is Op.W:
                row.append(((2 * k + 1,), -1))
            else:
                row.append(((2 * k,) if (s + 1) % spp == 0 else (2 * k, 2 * (k + m) + 1), 2 * k + 1))
        out.append(row)
    return out


def _key_text(schedule: Schedule, key: int, bwd: dict[int, Op]) -> str:
    k, kind = divmod(key, 2)
    stage, mb = divmod(k, schedule.m)
    op = Op.F if kind == 0 else bwd.get(k, Op.B)
    return str(Action(op, stage, mb))


def _run_ranks(schedule: Schedule, deps: list) -> tuple[list[list[int]], list[int], list[int]]:
    """Unit-time execution; a rank waits on the first missing key of its next action and is
    woken when that key completes, so every action is looked at O(1) times."""
    p = schedule.p
    end = [-1] * (2 * schedule.num_stages * schedule.m)
    free, ptr = [0] * p, [0] * p
    steps: list[list[int]] = [[] for _ in range(p)]
    waiters: dict[int, list[int]] = {}
    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        dl_row, t, row = deps[r], free[r], steps[r]
        i, n = ptr[r], len(dl_row)
        while i < n:
            dl, key = dl_row[i]
            start, blocked = t, -1
            for d in dl:
                if end[d] < 0:
                    blocked = d
                    break
                if end[d] > start:
                    start = end[d]
            if blocked >= 0:
                waiters.setdefault(blocked, []).append(r)
                break
            row.append(start)
            t = start + 1
            if key >= 0:
                end[key] = t
                if key in waiters:
                    ready += waiters.pop(key)
            i += 1
        free[r], ptr[r] = t, i
    return steps, free, ptr


def dry_run(schedule: Schedule) -> DryRun:
    """Execute every rank's order with unit-time actions; raise on deadlock."""
    deps = _dependency_keys(schedule)
    steps, free, ptr = _run_ranks(schedule, deps)
    waiting = [(r, schedule.ranks[r][ptr[r]]) for r in range(schedule.p) if ptr[r] < len(schedule.ranks[r])]
    if waiting:
        _deadlock(schedule, deps, steps, ptr, waiting)
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


def _deadlock(schedule: Schedule, deps: list, steps: list[list[int]], ptr: list[int],
              waiting: list[tuple[int, Action]]) -> None:
    m = schedule.m
    bwd = {a.stage * m + a.microbatch: a.op for r in schedule.ranks for a in r if a.op in BACKWARD_INPUT_OPS}
    done = set()
    for r, actions in enumerate(schedule.ranks):
        for a in actions[:ptr[r]]:
            if a.op is not Op.W:
                done.add(2 * (a.stage * m + a.microbatch) + (a.op is not Op.F))
    desc = "; ".join(f"rank {r} waits at {a} for "
                     f"{', '.join(_key_text(schedule, d, bwd) for d in deps[r][ptr[r]][0] if d not in done)}"
                     for r, a in waiting)
    _fail(schedule, f"deadlock with non-blocking sends and blocking receives: {desc}", waiting[0][1], waiting[0][0])


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
