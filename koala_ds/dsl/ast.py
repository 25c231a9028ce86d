"""Syntax tree of a Koala program. Plain frozen dataclasses; evaluation lives in `program.py`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Pos:
    file: str
    line: int
    col: int
    text: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


# -- expressions ------------------------------------------------------------------------
@dataclass(frozen=True)
class Num:
    value: int
    pos: Pos


@dataclass(frozen=True)
class Name:
    id: str
    pos: Pos


@dataclass(frozen=True)
class Unary:
    op: str  # '-' or 'not'
    operand: "Expr"
    pos: Pos


@dataclass(frozen=True)
class Binary:
    op: str  # + - * // % == != < <= > >= and or
    left: "Expr"
    right: "Expr"
    pos: Pos


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple["Expr", ...]
    pos: Pos


Expr = Union[Num, Name, Unary, Binary, Call]


# -- op sequences -----------------------------------------------------------------------
@dataclass(frozen=True)
class OpItem:
    """`F`, `B[1]`, `W`, `I@3`, `F[c]@(k+1)`, with `?` = skip when nothing is left to do."""

    op: str
    chunk: Expr | None
    microbatch: Expr | None
    optional: bool
    pos: Pos


@dataclass(frozen=True)
class Group:
    items: tuple["Item", ...]
    pos: Pos


@dataclass(frozen=True)
class Repeat:
    item: "Item"
    count: Expr
    pos: Pos


Item = Union[OpItem, Group, Repeat]


# -- statements -------------------------------------------------------------------------
@dataclass(frozen=True)
class Seq:
    items: tuple[Item, ...]
    pos: Pos


@dataclass(frozen=True)
class Let:
    name: str
    value: Expr
    pos: Pos


@dataclass(frozen=True)
class For:
    var: str
    start: Expr
    stop: Expr
    body: tuple["Stmt", ...]
    pos: Pos


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...]
    pos: Pos


@dataclass(frozen=True)
class Slot:
    """`slot EXPR`: the ops emitted after it (until the next `slot`) run at that unit-time slot."""

    value: Expr
    pos: Pos


Stmt = Union[Seq, Let, For, If, Slot]


@dataclass(frozen=True)
class Requirement:
    """One condition of a `supports` line, with its source text for messages."""

    cond: Expr
    text: str
    pos: Pos


@dataclass(frozen=True)
class PlacementSpec:
    style: str  # a named style, or "map"
    groups: tuple[tuple[Expr, ...], ...] = ()  # for map: one group of ranks per pipeline
    pos: Pos | None = None


@dataclass(frozen=True)
class CompactSpec:
    """`compact greedy`: reorder each rank by the slots of its ops (see `compact.py`)."""

    mode: str
    pos: Pos


@dataclass(frozen=True)
class ProgramAst:
    name: str
    description: str
    source: str
    supports: tuple[Requirement, ...]
    placement: PlacementSpec
    backward: str
    lets: tuple[Let, ...]
    ranks: dict  # rank number or None (every other rank) -> tuple[Stmt, ...]
    file: str
    compact: CompactSpec | None = None
