"""Compiling Koala programs to schedules.

A program is parametric in p (ranks), m (microbatches), v (chunks per rank) and r (the
rank). Both faces of the language drive the same `RankEmitter`, so a `.koala` file and a
Python builder function with the same ops give the same schedule:

- `F[c]`, `B[c]`, `I[c]` take the smallest microbatch that chunk c has not yet run that op
  on (B and I share one counter: both compute the input gradient); `W[c]` likewise.
- a bare `W` takes the oldest pending weight gradient of the rank (first in, first out);
  other ops without a chunk use chunk 0.
- `X@n` names the microbatch explicitly; `X?` is skipped when there is nothing left to do.
- `slot t` gives the ops emitted after it unit-time slot t; only `compact greedy` uses the
  slots (`compact.py`), otherwise each rank's order is its emission order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..ir import (MAX_ACTIONS, Action, KoalaError, Op, Placement, Schedule, ScheduleError, change_hint,
                  setting_names, size_error)
from ..validate import validate
from . import ast as A
from .compact import CompactError, Pass, compact_greedy


class KoalaCompileError(ScheduleError):
    """A program that parses but cannot produce a valid schedule for the given (p, m, v)."""


def _fmt_params(env: dict) -> str:
    return ", ".join(f"{k}={env[k]}" for k in ("p", "m", "v", "r") if k in env)


#: Loop passes (`for` iterations and `X * n` repetitions, all ranks together, emitting or not)
#: one compile may run: LOOP_PASSES_PER_ACTION per action of the schedule, p * v * m * 2 (or 3
#: with backward split), and at least MIN_LOOP_PASSES. The library needs at most 2 per action;
#: a pass costs about a microsecond.
LOOP_PASSES_PER_ACTION = 4
MIN_LOOP_PASSES = 1_000_000


def loop_pass_limit(p: int, m: int, v: int, backward: str = "full") -> int:
    return max(MIN_LOOP_PASSES, LOOP_PASSES_PER_ACTION * p * v * m * (3 if backward == "split" else 2))


class Budget:
    """The actions and loop passes left to one compile; raises `KoalaError` when spent."""

    def __init__(self, max_actions: int = MAX_ACTIONS, max_passes: int = MIN_LOOP_PASSES):
        self.actions_left, self.passes_left = max_actions, max_passes
        self.max_actions, self.max_passes = max_actions, max_passes

    def spend_action(self) -> None:
        self.actions_left -= 1
        if self.actions_left < 0:
            raise KoalaError(f"more than {self.max_actions:,} actions, the limit of one schedule "
                             f"(MAX_ACTIONS): use a smaller -m, -p or -v")

    def spend_passes(self, n: int, what: str) -> None:
        """Charge `n` passes before a loop runs them."""
        if n <= 0:
            return
        self.passes_left -= n
        if self.passes_left < 0:
            amount = f" of {n:,} passes" if n > 1 else ""
            raise KoalaError(f"{what}{amount} goes over the limit of {self.max_passes:,} loop passes "
                             f"for this p, m, v (LOOP_PASSES_PER_ACTION per action, at least MIN_LOOP_PASSES): "
                             f"bound the loop by p, m or v")


_CLASS = {"F": "F", "B": "B", "I": "B", "W": "W"}  # B and I share one counter
_OP = {op.value: op for op in Op}


class _Track:
    """The microbatches one (op class, stage) has done, and a cursor to the first not done."""

    __slots__ = ("used", "cursor", "mbs")

    def __init__(self, mbs: range):
        self.used: set[int] = set()
        self.cursor, self.mbs = 0, mbs

    def next(self) -> int | None:
        i, mbs, used = self.cursor, self.mbs, self.used
        while i < len(mbs) and mbs[i] in used:
            i += 1
        self.cursor = i
        return mbs[i] if i < len(mbs) else None


class RankEmitter:
    """Turns op requests into actions for one rank, tracking the implicit microbatch counters.

    Every request costs O(1) amortized: per (op class, stage) a `_Track`; pending weight
    gradients are a FIFO with lazy deletion. `budget` (shared by the ranks of one compile)
    caps the actions."""

    def __init__(self, placement: Placement, m: int, rank: int, budget: "Budget | None" = None):
        self.placement, self.m, self.rank = placement, m, rank
        self.stages = placement.stages_of(rank)
        self.budget = budget
        self.names = setting_names(None)  # how messages name p, m, v (Program.compile sets it)
        self.actions: list[Action] = []
        self.slot: int | None = None  # set by `slot`; recorded with each action
        self.slots: list[int | None] = []
        self._tracks: dict[tuple[str, int], _Track] = {}
        self._w_queue: deque[tuple[int, int]] = deque()  # I order; entries leave `_w_live` lazily
        self._w_live: set[tuple[int, int]] = set()

    def _track(self, op: str, stage: int) -> _Track:
        key = (_CLASS[op], stage)
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track(self.placement.microbatches_of(stage, self.m))
        return track

    def next_microbatch(self, op: str, stage: int) -> int | None:
        return self._track(op, stage).next()

    def oldest_pending_w(self) -> tuple[int, int] | None:
        """(stage, microbatch) of the oldest I whose W has not run, or None."""
        queue = self._w_queue
        while queue and queue[0] not in self._w_live:
            queue.popleft()
        return queue[0] if queue else None

    def stage_of_chunk(self, chunk: int) -> int:
        if not 0 <= chunk < len(self.stages):
            raise KoalaError(f"chunk {chunk} does not exist: rank {self.rank} holds "
                             f"{len(self.stages)} chunk(s) (0..{len(self.stages) - 1})")
        return self.stages[chunk]

    def emit(self, op: str, chunk: int | None = None, microbatch: int | None = None,
             optional: bool = False) -> bool:
        """Append one action; return False when `optional` and nothing is left to do (which
        leaves the emitter as it was, so the same request again returns False too)."""
        if op == "W" and chunk is None and microbatch is None:
            return self._emit_oldest_w(optional)
        stage = self.stage_of_chunk(0 if chunk is None else chunk)
        track = self._track(op, stage)
        mb = track.next() if microbatch is None else microbatch
        if mb is None or (optional and op == "W" and (stage, mb) not in self._w_live):
            if optional:
                return False
            what = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-gradient"}[op]
            raise KoalaError(f"{op}[{chunk or 0}] on rank {self.rank}: every microbatch of stage {stage} "
                             f"already had its {what} step (m={self.m})")
        if mb in track.used:
            if optional:
                return False
            raise KoalaError(f"{op}@{mb} on rank {self.rank}, stage {stage}: microbatch {mb} already done")
        self._append(op, stage, mb, track.used)
        return True

    def _emit_oldest_w(self, optional: bool) -> bool:
        target = self.oldest_pending_w()
        if target is None:
            if optional:
                return False
            raise KoalaError(f"W on rank {self.rank}: no weight gradient is pending (no I without its W)")
        stage, mb = target
        self._append("W", stage, mb, self._track("W", stage).used)
        return True

    def _append(self, op: str, stage: int, mb: int, used: set[int]) -> None:
        if self.budget is not None:
            self.budget.spend_action()
        used.add(mb)
        if op == "I":
            self._w_queue.append((stage, mb))
            self._w_live.add((stage, mb))
        elif op == "W":
            self._w_live.discard((stage, mb))
        self.actions.append(Action(_OP[op], stage, mb))
        self.slots.append(self.slot)


class RankBuilder:
    """The Python face of the language: `b.F()`, `b.B(2)`, `b.W(chunk=1)`, `b.F(mb=3)`, `b.W(optional=True)`."""

    def __init__(self, emitter: RankEmitter):
        self._e = emitter

    def _op(self, op: str, times: int, chunk: int | None, mb: int | None, optional: bool) -> None:
        if times < 0:
            raise KoalaError(f"{op}: repetition count {times} < 0")
        # Every call is at least one pass, so a Python loop around calls that emit nothing
        # (`b.F(0)`, an optional op with nothing left) still ends at the pass limit.
        self._charge(max(times, 1), f"{op} repeated {times:,} times" if times > 1 else f"a call b.{op}(...)")
        for _ in range(times):
            self._e.emit(op, chunk, mb, optional)

    def _charge(self, n: int, what: str) -> None:
        if self._e.budget is not None:
            self._e.budget.spend_passes(n, what)

    def slot(self, t: int) -> None:
        """The unit-time slot of the ops that follow (used by `compact="greedy"`)."""
        self._charge(1, "a call b.slot(...)")
        self._e.slot = int(t)

    def F(self, times: int = 1, chunk: int | None = None, mb: int | None = None, optional: bool = False):
        self._op("F", times, chunk, mb, optional)

    def B(self, times: int = 1, chunk: int | None = None, mb: int | None = None, optional: bool = False):
        self._op("B", times, chunk, mb, optional)

    def I(self, times: int = 1, chunk: int | None = None, mb: int | None = None, optional: bool = False):  # noqa: E743
        self._op("I", times, chunk, mb, optional)

    def W(self, times: int = 1, chunk: int | None = None, mb: int | None = None, optional: bool = False):
        self._op("W", times, chunk, mb, optional)


# -- evaluation of the text form ------------------------------------------------------------
_BIN = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
}
_FUN = {"min": min, "max": max, "abs": abs}


def _name(expr: A.Name, env: dict) -> int:
    if expr.id not in env:
        known = ", ".join(sorted(env))
        raise KoalaCompileError(f"{expr.pos}: unknown name {expr.id!r} (known here: {known})")
    return env[expr.id]


def _binary(expr: A.Binary, left: int, right: int, env: dict) -> int:
    if expr.op in ("//", "%"):
        if right == 0:
            raise KoalaCompileError(f"{expr.pos}: division by zero ({_fmt_params(env)})")
        return left // right if expr.op == "//" else left % right
    return int(_BIN[expr.op](left, right))


def evaluate(expr: A.Expr, env: dict) -> int:
    """The value of `expr`. A chain `a + b - c ...` is a left-deep tree as long as the chain;
    it is walked in a loop, so recursion goes only as deep as the parenthesized nesting, which
    the parser caps (`parser.MAX_NESTING`)."""
    kind = type(expr)
    if kind is A.Num:
        return expr.value
    if kind is A.Name:
        return _name(expr, env)
    if kind is A.Binary:
        return _chain(expr, env)
    if kind is A.Unary:
        val = evaluate(expr.operand, env)
        return -val if expr.op == "-" else int(not val)
    return _FUN[expr.fn](*(evaluate(a, env) for a in expr.args))


def _chain(expr: A.Binary, env: dict) -> int:
    spine = []
    while type(expr) is A.Binary:
        spine.append(expr)
        expr = expr.left
    val = evaluate(expr, env)
    for node in reversed(spine):
        if node.op == "and":
            val = int(bool(val) and bool(evaluate(node.right, env)))
        elif node.op == "or":
            val = int(bool(val) or bool(evaluate(node.right, env)))
        else:
            val = _binary(node, val, evaluate(node.right, env), env)
    return val


class _Interpreter:
    def __init__(self, emitter: RankEmitter, env: dict, budget: Budget):
        self.e, self.env, self.budget = emitter, env, budget

    def charge(self, n: int, what: str, pos: A.Pos) -> None:
        try:
            self.budget.spend_passes(n, what)
        except KoalaError as exc:
            raise KoalaCompileError(f"{pos}: {exc} ({_fmt_params(self.env)})") from None

    def run(self, stmts: tuple[A.Stmt, ...]) -> None:
        for stmt in stmts:
            if isinstance(stmt, A.Let):
                self.env[stmt.name] = evaluate(stmt.value, self.env)
            elif isinstance(stmt, A.Slot):
                self.e.slot = evaluate(stmt.value, self.env)
            elif isinstance(stmt, A.Seq):
                for item in stmt.items:
                    self.item(item)
            elif isinstance(stmt, A.For):
                self.loop(stmt)
            else:
                self.run(stmt.then if evaluate(stmt.cond, self.env) else stmt.orelse)

    def loop(self, stmt: A.For) -> None:
        start, stop = evaluate(stmt.start, self.env), evaluate(stmt.stop, self.env)
        self.charge(stop - start, f"loop 'for {stmt.var} in {start}..{stop}'", stmt.pos)
        saved = self.env.get(stmt.var)
        for value in range(start, stop):
            self.env[stmt.var] = value
            self.run(stmt.body)
        if saved is None:
            self.env.pop(stmt.var, None)
        else:
            self.env[stmt.var] = saved

    def item(self, item: A.Item) -> None:
        if isinstance(item, A.OpItem):
            self.op(item, 1)
        elif isinstance(item, A.Repeat):
            count = evaluate(item.count, self.env)
            if count < 0:
                raise KoalaCompileError(f"{item.pos}: repetition count is {count} for {_fmt_params(self.env)}; "
                                        f"this program needs other values of p, m or v")
            self.charge(count, f"repetition '* {count}'", item.pos)
            if isinstance(item.item, A.OpItem):
                self.op(item.item, count)
            else:
                for _ in range(count):
                    self.item(item.item)
        else:
            for sub in item.items:
                self.item(sub)

    def op(self, item: A.OpItem, times: int) -> None:
        """Emit `item` `times` times; its chunk and microbatch are the same on every pass."""
        chunk = None if item.chunk is None else evaluate(item.chunk, self.env)
        mb = None if item.microbatch is None else evaluate(item.microbatch, self.env)
        emit = self.e.emit
        try:
            for _ in range(times):
                if not emit(item.op, chunk, mb, item.optional):
                    break  # nothing left to do, and a skipped request changes nothing
        except KoalaError as exc:
            if isinstance(exc, KoalaCompileError):
                raise
            raise KoalaCompileError(f"{item.pos}: {exc} ({_fmt_params(self.env)})") from None


# -- programs -------------------------------------------------------------------------------
RankBody = Callable[[RankBuilder, int, int, int, int], None]


@dataclass(frozen=True)
class Requirement:
    """A condition on (p, m, v); `check` returns truthy when met."""

    text: str
    check: Callable[[dict], int]
    where: str = ""


@dataclass
class Program:
    """A schedule generator: compiles to a `Schedule` for concrete (p, m, v)."""

    name: str
    placement: str | Callable[[int, int], Placement]
    backward: str
    rank_body: Callable[[RankEmitter, dict], None]
    description: str = ""
    source: str = ""
    requirements: tuple[Requirement, ...] = ()
    file: str = ""
    text: str = field(default="", repr=False)
    compact: str | None = None  # "greedy": reorder by slots after every rank ran (compact.py)
    compact_where: str = ""  # file:line:col of the `compact` line, for messages

    def supports(self, p: int, m: int, v: int = 1, names: dict | None = None) -> str | None:
        """None when (p, m, v) is supported; else the reason, naming what to change: koala's
        flags (-p, -m, -v), or the engine's settings given as `names` ({"m": "...", ...})."""
        for name, val in (("p", p), ("m", m), ("v", v)):
            if not isinstance(val, int) or val < 1:
                return f"{name} must be a positive integer, got {name}={val!r} ({change_hint(name, names)})"
        too_big = size_error(p, m, v, self.backward, names)
        if too_big:
            return f"schedule {self.name!r}: {too_big}"
        env = {"p": p, "m": m, "v": v}
        for req in self.requirements:
            try:
                ok = req.check(env)
            except KoalaError as exc:
                return f"schedule {self.name!r}: {exc}"
            if not ok:
                params = [k for k in ("p", "m", "v") if _mentions(req.text, k)] or ["p", "m", "v"]
                where = f" ({req.where})" if req.where else ""
                return (f"schedule {self.name!r} needs {req.text}{where}; got p={p}, m={m}, v={v}: "
                        f"{change_hint(params, names)}")
        return None

    def make_placement(self, p: int, v: int) -> Placement:
        if callable(self.placement):
            return self.placement(p, v)
        return Placement.named(self.placement, p, v)

    def compile(self, p: int, m: int, v: int = 1, names: dict | None = None) -> Schedule:
        """The Schedule for (p, m, v); errors name `names`' settings (see `supports`)."""
        reason = self.supports(p, m, v, names)
        if reason:
            raise KoalaCompileError(reason)
        try:
            placement = self.make_placement(p, v)
        except ScheduleError as exc:
            raise KoalaCompileError(f"schedule {self.name!r} ({self.file or 'python'}): {exc}") from None
        ranks, slots = self._run_ranks(placement, p, m, v, names)
        if self.compact:
            ranks = self._compacted(placement, ranks, slots, p, m, v, names)
        schedule = Schedule(p, m, v, placement, tuple(ranks), self.backward, self.name,
                            {"program": self.name, "file": self.file})
        try:
            validate(schedule)
        except ScheduleError as exc:
            raise KoalaCompileError(f"{self.file or self.name}: compiles to an invalid schedule for "
                                    f"p={p}, m={m}, v={v}: {exc}") from None
        return schedule

    def _run_ranks(self, placement: Placement, p: int, m: int, v: int, names: dict | None = None) -> tuple[list, list]:
        """Each rank's actions (and their slots when `compact` needs them), one rank at a time."""
        ranks, slots = [], []
        budget = Budget(MAX_ACTIONS, loop_pass_limit(p, m, v, self.backward))
        for r in range(p):
            emitter = RankEmitter(placement, m, r, budget)
            emitter.names = setting_names(names)
            try:
                self.rank_body(emitter, {"p": p, "m": m, "v": v, "r": r})
            except KoalaCompileError:
                raise
            except KoalaError as exc:
                raise KoalaCompileError(f"schedule {self.name!r}, rank {r} (p={p}, m={m}, v={v}): {exc}") from None
            ranks.append(tuple(emitter.actions))
            slots.append(emitter.slots if self.compact else None)
        return ranks, slots

    def _compacted(self, placement: Placement, ranks: list[tuple[Action, ...]], slots: list[list],
                   p: int, m: int, v: int, names: dict | None = None) -> list[tuple[Action, ...]]:
        """Each rank's order after `compact greedy` (V-shape, v == 2, split backward only)."""
        where = self.compact_where or self.file or self.name
        params = f"p={p}, m={m}, v={v}"
        vshape = Placement.named("vshape", p, v).stage_ranks == placement.stage_ranks and placement.pipelines == 1
        why = ("it needs backward split" if self.backward != "split" else
               f"it needs v == 2, got {params}: {change_hint('v', names)}" if v != 2 else
               "it needs placement vshape" if not vshape else "")
        if why:
            raise KoalaCompileError(f"{where}: compact {self.compact}: {why}")
        passes = [[Pass(a.op.value, placement.chunk_of(a.stage), a.microbatch, slot)
                   for a, slot in zip(actions, rank_slots)] for actions, rank_slots in zip(ranks, slots)]
        try:
            orders = compact_greedy(passes, m)
        except CompactError as exc:
            raise KoalaCompileError(f"{where}: compact {self.compact}: {exc} ({params})") from None
        return [tuple(Action(Op(op), placement.stages_of(r)[chunk], j) for op, chunk, j in order)
                for r, order in enumerate(orders)]


def _mentions(text: str, name: str) -> bool:
    import re

    return re.search(rf"\b{name}\b", text) is not None


def from_ast(tree: A.ProgramAst, text: str = "") -> Program:
    """A Program from a parsed `.koala` file."""
    lets = tree.lets

    def global_env(env: dict) -> dict:
        env = dict(env)
        for let in lets:
            env[let.name] = evaluate(let.value, env)
        return env

    def body(emitter: RankEmitter, env: dict) -> None:
        env = global_env(env)
        stmts = tree.ranks.get(env["r"], tree.ranks.get(None))
        if stmts is None:
            raise KoalaCompileError(f"{tree.file}: no block for rank {env['r']} (add 'rank {env['r']}:' "
                                    f"or a generic 'rank:' block, or change {emitter.names['p']})")
        _Interpreter(emitter, env, emitter.budget or Budget()).run(stmts)

    reqs = tuple(Requirement(r.text, (lambda cond: lambda env: evaluate(cond, global_env(env)))(r.cond), str(r.pos))
                 for r in tree.supports)
    spec = tree.placement
    if spec.style == "map":
        def placement(p: int, v: int) -> Placement:
            env = global_env({"p": p, "m": 1, "v": v})
            groups = [[evaluate(e, env) for e in g] for g in spec.groups]
            if len({len(g) for g in groups}) != 1:
                raise ScheduleError(f"{spec.pos}: placement map groups have different lengths")
            return Placement.explicit([r for g in groups for r in g], len(groups))
    else:
        placement = spec.style
    compact = tree.compact
    return Program(tree.name, placement, tree.backward, body, tree.description, tree.source, reqs, tree.file, text,
                   compact.mode if compact else None, str(compact.pos) if compact else "")


def python_program(name: str, *, placement: str = "linear", backward: str = "full", description: str = "",
                   source: str = "", supports: dict[str, Callable[[int, int, int], bool]] | None = None,
                   compact: str | None = None):
    """Decorator: a Program from a Python function `body(b: RankBuilder, p, m, v, r)`.

    `supports` maps a human-readable condition (e.g. "m >= p") to a predicate of (p, m, v);
    `compact="greedy"` reorders each rank by the slots set with `b.slot(t)`, as `compact greedy`."""
    if compact not in (None, "greedy"):
        raise KoalaError(f"python_program {name!r}: compact={compact!r}; the only mode is 'greedy'")

    def wrap(fn: RankBody) -> Program:
        reqs = tuple(Requirement(text, (lambda f: lambda env: f(env["p"], env["m"], env["v"]))(pred))
                     for text, pred in (supports or {}).items())

        def body(emitter: RankEmitter, env: dict) -> None:
            fn(RankBuilder(emitter), env["p"], env["m"], env["v"], env["r"])

        where = f"python:{fn.__module__}.{fn.__qualname__}"
        return Program(name, placement, backward, body, description or (fn.__doc__ or "").strip(), source, reqs,
                       where, compact=compact, compact_where=where if compact else "")
    return wrap
