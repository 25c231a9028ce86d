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

import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..core.ir import (MAX_ACTIONS, Action, KoalaError, Op, Placement, Schedule, ScheduleError, change_hint,
                  setting_names, size_error)
from ..core.validate import validate
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

    def spend_passes(self, n: int, what: str | Callable[[], str]) -> None:
        """Charge `n` passes before a loop runs them; `what` names the loop in the message (a
        function of no arguments is called only then)."""
        if n <= 0:
            return
        self.passes_left -= n
        if self.passes_left < 0:
            what = what if isinstance(what, str) else what()
            amount = f" of {_count_text(n)} passes" if n > 1 else ""
            raise KoalaError(f"{what}{amount} goes over the limit of {self.max_passes:,} loop passes "
                             f"for this p, m, v (LOOP_PASSES_PER_ACTION per action, at least MIN_LOOP_PASSES): "
                             f"bound the loop by p, m or v")


_CLASS = {"F": "F", "B": "B", "I": "B", "W": "W"}  # B and I share one counter
_OP = {op.value: op for op in Op}


#: Actions are immutable values, so compiles share one object per (op, stage, microbatch): a hit
#: costs a fraction of building one, and repeated compiles (the search's seeds, the library's
#: tests) meet the same small actions again. The first _ACTIONS_KEPT made are kept, no others.
_ACTIONS: dict[tuple[str, int, int], Action] = {}
_ACTIONS_KEPT = 1 << 14


def _action(op: str, stage: int, microbatch: int) -> Action:
    if type(stage) is not int or type(microbatch) is not int:  # the cache's key: False == 0 == 0.0
        raise KoalaError(f"{op}: chunk and microbatch must be integers, got stage {stage!r}, microbatch "
                         f"{microbatch!r}")
    key = (op, stage, microbatch)
    action = _ACTIONS.get(key)
    if action is None:
        action = Action(_OP[op], stage, microbatch)
        if len(_ACTIONS) < _ACTIONS_KEPT:
            _ACTIONS[key] = action
    return action


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
        self._lanes: dict[tuple[str, int], tuple[int, _Track]] = {}  # (op, chunk) -> (stage, its track)
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
        return self.emit_times(op, chunk, microbatch, optional, 1) == 1

    def emit_times(self, op: str, chunk: int | None, microbatch: int | None, optional: bool, times: int) -> int:
        """`emit` the same request `times` times, stopping at the first that `optional` skips;
        the number of actions appended."""
        if times <= 0:
            return 0
        if op == "W" and chunk is None and microbatch is None:
            return self._emit_oldest_w(optional, times)
        lane = self._lanes.get((op, chunk))
        if lane is None:
            lane = self._lanes[(op, chunk)] = self._lane(op, chunk)
        stage, track = lane
        used, check_w = track.used, optional and op == "W"
        for done in range(times):
            mb = track.next() if microbatch is None else microbatch
            if mb is None or mb in used or (check_w and (stage, mb) not in self._w_live):
                if optional:
                    return done
                raise self._refusal(op, chunk, stage, mb)
            self._append(op, stage, mb, used)
        return times

    def _lane(self, op: str, chunk: int | None) -> tuple[int, _Track]:
        """The stage of `chunk` and the counter of `op` there (`emit_times` keeps them by (op, chunk))."""
        stage = self.stage_of_chunk(0 if chunk is None else chunk)
        return stage, self._track(op, stage)

    def _refusal(self, op: str, chunk: int | None, stage: int, mb: int | None) -> KoalaError:
        if mb is None:
            what = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-gradient"}[op]
            return KoalaError(f"{op}[{chunk or 0}] on rank {self.rank}: every microbatch of stage {stage} "
                              f"already had its {what} step (m={self.m})")
        return KoalaError(f"{op}@{mb} on rank {self.rank}, stage {stage}: microbatch {mb} already done")

    def _emit_oldest_w(self, optional: bool, times: int) -> int:
        for done in range(times):
            target = self.oldest_pending_w()
            if target is None:
                if optional:
                    return done
                raise KoalaError(f"W on rank {self.rank}: no weight gradient is pending (no I without its W)")
            stage, mb = target
            self._append("W", stage, mb, self._track("W", stage).used)
        return times

    def _append(self, op: str, stage: int, mb: int, used: set[int]) -> None:
        if self.budget is not None:
            self.budget.spend_action()
        used.add(mb)
        if op == "I":
            self._w_queue.append((stage, mb))
            self._w_live.add((stage, mb))
        elif op == "W":
            self._w_live.discard((stage, mb))
        self.actions.append(_action(op, stage, mb))
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
        self._e.emit_times(op, chunk, mb, optional, times)

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


# -- the text form, translated once into closures --------------------------------------------
# `from_ast` turns each expression into a function of the environment (`Eval`), each statement
# and op item into a function of the rank being compiled (`Run`), once per Program; compiling
# then only calls them, instead of dispatching on node types on every pass.
Eval = Callable[[dict], int]
_BIN: dict[str, Callable[[int, int], int]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b), "<": lambda a, b: int(a < b),
    "<=": lambda a, b: int(a <= b), ">": lambda a, b: int(a > b), ">=": lambda a, b: int(a >= b),
}
_FUN = {"min": lambda *xs: min(xs), "max": lambda *xs: max(xs), "abs": abs}  # min(x) and max(x) are x


def expression(expr: A.Expr) -> Eval:
    """`expr` as a function of the environment. A chain `a + b - c ...` is a left-deep tree as
    long as the chain; it becomes one loop over its links, so neither translating nor running
    it recurses deeper than the parenthesized nesting, which the parser caps (`parser.MAX_NESTING`)."""
    kind = type(expr)
    if kind is A.Num:
        value = expr.value
        return lambda env: value
    if kind is A.Name:
        return _name(expr)
    if kind is A.Binary:
        return _chain(expr)
    if kind is A.Unary:
        operand = expression(expr.operand)
        if expr.op == "-":
            return lambda env: -operand(env)
        return lambda env: int(not operand(env))
    fn, args = _FUN[expr.fn], tuple(expression(a) for a in expr.args)
    return lambda env: fn(*[arg(env) for arg in args])


def _name(expr: A.Name) -> Eval:
    name, pos = expr.id, expr.pos

    def value(env: dict) -> int:
        try:
            return env[name]
        except KeyError:
            known = ", ".join(sorted(env))
            raise KoalaCompileError(f"{pos}: unknown name {name!r} (known here: {known})") from None
    return value


def _chain(expr: A.Binary) -> Eval:
    spine = []
    while type(expr) is A.Binary:
        spine.append(expr)
        expr = expr.left
    first = expression(expr)
    links = tuple(_link(node) for node in reversed(spine))
    if len(links) == 1:
        link = links[0]
        return lambda env: link(first(env), env)

    def value(env: dict) -> int:
        val = first(env)
        for link in links:
            val = link(val, env)
        return val
    return value


def _link(node: A.Binary) -> Callable[[int, dict], int]:
    """One link `op right` of a chain: the value so far -> the value after it. A number or a
    name on the right of `+ - *` or a comparison (`k + 1`, `r < p`) is read in place."""
    op, right, operand = node.op, expression(node.right), node.right
    if op == "and":
        return lambda val, env: int(bool(val) and bool(right(env)))
    if op == "or":
        return lambda val, env: int(bool(val) or bool(right(env)))
    if op in ("//", "%"):
        return _division(node, right)
    fn = _BIN[op]
    if type(operand) is A.Num:
        const = operand.value
        return lambda val, env: fn(val, const)
    if type(operand) is A.Name:
        name = operand.id

        def link(val: int, env: dict) -> int:
            try:
                return fn(val, env[name])
            except KeyError:
                return fn(val, right(env))  # `right` raises the unknown-name error
        return link
    return lambda val, env: fn(val, right(env))


def _division(node: A.Binary, right: Eval) -> Callable[[int, dict], int]:
    pos, floor = node.pos, node.op == "//"

    def link(val: int, env: dict) -> int:
        divisor = right(env)
        if divisor == 0:
            raise KoalaCompileError(f"{pos}: division by zero ({_fmt_params(env)})")
        return val // divisor if floor else val % divisor
    return link


class _Rank:
    """What the closures of a rank block act on: its emitter, its environment, the budget."""

    __slots__ = ("e", "env", "budget")

    def __init__(self, emitter: RankEmitter, env: dict, budget: Budget):
        self.e, self.env, self.budget = emitter, env, budget

    def charge(self, n: int, what: Callable[[], str], pos: A.Pos) -> None:
        try:
            self.budget.spend_passes(n, what)
        except KoalaError as exc:
            raise KoalaCompileError(f"{pos}: {exc} ({_fmt_params(self.env)})") from None


Run = Callable[[_Rank], None]


def block(stmts: tuple[A.Stmt, ...]) -> Run:
    """The statements `stmts`, in order, as one function of the rank."""
    return _in_order(tuple(_statement(stmt) for stmt in stmts))


def _in_order(runs: tuple[Run, ...]) -> Run:
    if len(runs) == 1:
        return runs[0]

    def run(rank: _Rank) -> None:
        for one in runs:
            one(rank)
    return run


def _statement(stmt: A.Stmt) -> Run:
    if isinstance(stmt, A.Let):
        name, value = stmt.name, expression(stmt.value)

        def let(rank: _Rank) -> None:
            rank.env[name] = value(rank.env)
        return let
    if isinstance(stmt, A.Slot):
        value = expression(stmt.value)

        def slot(rank: _Rank) -> None:
            rank.e.slot = value(rank.env)
        return slot
    if isinstance(stmt, A.Seq):
        return _items(stmt.items)
    if isinstance(stmt, A.For):
        return _loop(stmt)
    cond, then, orelse = expression(stmt.cond), block(stmt.then), block(stmt.orelse)
    return lambda rank: (then if cond(rank.env) else orelse)(rank)


def _loop(stmt: A.For) -> Run:
    var, pos, start, stop, body = stmt.var, stmt.pos, expression(stmt.start), expression(stmt.stop), block(stmt.body)

    def loop(rank: _Rank) -> None:
        env = rank.env
        first, last = start(env), stop(env)
        rank.charge(last - first, lambda: f"loop 'for {var} in {first}..{last}'", pos)
        saved = env.get(var)
        for value in range(first, last):
            env[var] = value
            body(rank)
        if saved is None:
            env.pop(var, None)
        else:
            env[var] = saved
    return loop


def _items(items: tuple[A.Item, ...]) -> Run:
    return _in_order(tuple(_item(item) for item in items))


def _item(item: A.Item) -> Run:
    if isinstance(item, A.OpItem):
        return _op(item)
    if isinstance(item, A.Repeat):
        return _repeat(item)
    return _items(item.items)


def _repeat(item: A.Repeat) -> Run:
    count_of, pos = expression(item.count), item.pos
    if isinstance(item.item, A.OpItem):
        times = _op(item.item)  # one op `count` times: its chunk and microbatch evaluated once
    else:
        inner = _item(item.item)

        def times(rank: _Rank, count: int) -> None:
            for _ in range(count):
                inner(rank)

    def repeat(rank: _Rank) -> None:
        count = count_of(rank.env)
        if count < 0:
            raise KoalaCompileError(f"{pos}: repetition count is {count} for {_fmt_params(rank.env)}; "
                                    f"this program needs other values of p, m or v")
        rank.charge(count, lambda: f"repetition '* {_count_text(count)}'", pos)
        times(rank, count)
    return repeat


def _op(item: A.OpItem) -> Callable[..., None]:
    """Emit `item` `times` times (once by default); its chunk and microbatch are the same on every pass."""
    op, optional, pos = item.op, item.optional, item.pos
    chunk_of = None if item.chunk is None else expression(item.chunk)
    mb_of = None if item.microbatch is None else expression(item.microbatch)

    def emit(rank: _Rank, times: int = 1) -> None:
        env = rank.env
        chunk = None if chunk_of is None else chunk_of(env)
        mb = None if mb_of is None else mb_of(env)
        try:
            rank.e.emit_times(op, chunk, mb, optional, times)
        except KoalaCompileError:
            raise
        except KoalaError as exc:
            raise KoalaCompileError(f"{pos}: {exc} ({_fmt_params(env)})") from None
    return emit


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
            if type(val) is not int or val < 1:  # not a bool: True would pass for 1
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
        return [tuple(_action(op, placement.stages_of(r)[chunk], j) for op, chunk, j in order)
                for r, order in enumerate(orders)]


def _mentions(text: str, name: str) -> bool:
    import re

    return re.search(rf"\b{name}\b", text) is not None


def from_ast(tree: A.ProgramAst, text: str = "") -> Program:
    """A Program from a parsed `.koala` file; its expressions and rank blocks are translated
    into closures here, once."""
    lets = tuple((let.name, expression(let.value)) for let in tree.lets)
    blocks = {rank: block(stmts) for rank, stmts in tree.ranks.items()}

    def global_env(env: dict) -> dict:
        env = dict(env)
        for name, value in lets:
            env[name] = value(env)
        return env

    def body(emitter: RankEmitter, env: dict) -> None:
        env = global_env(env)
        run = blocks.get(env["r"], blocks.get(None))
        if run is None:
            raise KoalaCompileError(f"{tree.file}: no block for rank {env['r']} (add 'rank {env['r']}:' "
                                    f"or a generic 'rank:' block, or change {emitter.names['p']})")
        run(_Rank(emitter, env, emitter.budget or Budget()))

    reqs = tuple(Requirement(r.text, (lambda cond: lambda env: cond(global_env(env)))(expression(r.cond)), str(r.pos))
                 for r in tree.supports)
    spec = tree.placement
    if spec.style == "map":
        groups = [[expression(e) for e in g] for g in spec.groups]

        def placement(p: int, v: int) -> Placement:
            env = global_env({"p": p, "m": 1, "v": v})
            ranks = [[rank(env) for rank in g] for g in groups]
            if len({len(g) for g in ranks}) != 1:
                raise ScheduleError(f"{spec.pos}: placement map groups have different lengths")
            return Placement.explicit(_checked_map(ranks, p, v, spec.pos), len(ranks))
    else:
        placement = spec.style
    compact = tree.compact
    return Program(tree.name, placement, tree.backward, body, tree.description, tree.source, reqs, tree.file, text,
                   compact.mode if compact else None, str(compact.pos) if compact else "")


def _count_text(n: int) -> str:
    """A count for a message: 1,234, or its size when Python would refuse to print it whole."""
    return f"{n:,}" if n < 10 ** 30 else f"about 2^{n.bit_length() - 1}"


def _checked_map(groups: list[list[int]], p: int, v: int, pos) -> list[int]:
    """The stage -> rank list of a `placement map` (one group per pipeline), checked against p
    and v: ranks 0..p-1, v stages of each pipeline on every rank."""
    flat = [r for g in groups for r in g]
    outside = [r for r in flat if not 0 <= r < p]
    if outside:
        raise ScheduleError(f"{pos}: placement map names rank {outside[0]}, but p={p} (ranks 0..{p - 1}): change "
                            f"the map or p")
    for r in range(p):
        held = [sum(1 for x in g if x == r) for g in groups]
        if any(n != v for n in held):
            raise ScheduleError(f"{pos}: placement map puts {next(n for n in held if n != v)} stage(s) of a "
                                f"pipeline on rank {r}, but v={v} (each rank holds v stages of each pipeline): "
                                f"change the map, p or v")
    return flat


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
