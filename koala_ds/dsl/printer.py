"""The printer: any Schedule as a `.koala` program in normal form.

Normal form: one `rank N:` block per rank; an op is written bare when the implicit rule
(see `program.py`) picks the same microbatch, else with `@mb`; runs that repeat are written
`X * n` or `(X Y ...) * n`. `parse(print(s))` compiles back to the identical schedule.
"""
from __future__ import annotations

from ..core.ir import Op, Schedule, ScheduleError
from .program import RankEmitter

MAX_PERIOD = 12
LINE_TOKENS = 12


def rank_tokens(schedule: Schedule, rank: int) -> list[str]:
    placement = schedule.placement
    emitter = RankEmitter(placement, schedule.m, rank)
    out = []
    for a in schedule.ranks[rank]:
        op, stage, mb = a.op.value, a.stage, a.microbatch
        if stage >= placement.num_stages or placement.rank_of(stage) != rank:  # validate would say so too
            raise ScheduleError(f"schedule {schedule.name!r}: action {a} on rank {rank} is not of a stage the "
                                f"placement ({placement.describe()}) gives that rank")
        chunk = placement.chunk_of(stage)
        if a.op is Op.W and emitter.oldest_pending_w() == (stage, mb):
            out.append("W")
            emitter.emit("W")
            continue
        implicit = emitter.next_microbatch(op, stage) == mb
        chunk_text = f"[{chunk}]" if chunk or a.op is Op.W else ""
        out.append(op + chunk_text + ("" if implicit else f"@{mb}"))
        emitter.emit(op, chunk, mb)
    return out


def compress(tokens: list[str]) -> list[str]:
    """Greedy run-length encoding into lines: `X * n`, `(X Y) * n`, or plain runs."""
    lines: list[str] = []
    plain: list[str] = []
    i, n = 0, len(tokens)
    while i < n:
        best_cover, best = 0, None
        for period in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
            unit = tokens[i:i + period]
            count = 1
            while tokens[i + count * period:i + (count + 1) * period] == unit:
                count += 1
            if count >= 2 and period * count > best_cover and period * count >= period + 2:
                best_cover, best = period * count, (period, count)
        if best is None:
            plain.append(tokens[i])
            i += 1
            if len(plain) == LINE_TOKENS:
                lines.append(" ".join(plain))
                plain = []
            continue
        if plain:
            lines.append(" ".join(plain))
            plain = []
        period, count = best
        unit = tokens[i:i + period]
        lines.append(f"{unit[0]} * {count}" if period == 1 else f"({' '.join(unit)}) * {count}")
        i += period * count
    if plain:
        lines.append(" ".join(plain))
    return lines


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def print_schedule(schedule: Schedule, description: str | None = None) -> str:
    placement = schedule.placement
    name = schedule.name if schedule.name and all(c.isalnum() or c in "-_.+" for c in schedule.name) else "schedule"
    lines = [f"schedule {name}"]
    desc = description if description is not None else schedule.meta.get("description", "")
    if desc:
        lines.append(f"description {_quote(desc)}")
    lines += [f"supports p == {schedule.p}, m == {schedule.m}, v == {schedule.v}",
              f"placement {placement.describe()}",
              f"backward {schedule.backward}"]
    for r in range(schedule.p):
        lines.append("")
        lines.append(f"rank {r}:")
        body = compress(rank_tokens(schedule, r))
        lines += ["  " + line for line in body] if body else []
        if not body:
            lines.pop()
            lines.pop()
    return "\n".join(lines) + "\n"
