"""Syntax tree of a Koala program. Plain frozen dataclasses; evaluation lives in `program.py`.

Every node is a `Node` and so carries `pos`, where it starts in the source (for messages), as
Python's own `ast` nodes share their position attributes; the whole tree (`ProgramAst`, like
`ast.Module`) has its file name instead."""
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


@dataclass(frozen=True)
class Node:
    """A piece of syntax. `pos` is keyword-only, so that a node's own fields come first:
    `Binary("+", left, right, pos=p)`."""

    pos: Pos = field(kw_only=True)


# -- expressions ------------------------------------------------------------------------
@dataclass(frozen=True)
class Num(Node):
    value: int


@dataclass(frozen=True)
class Name(Node):
    id: str


@dataclass(frozen=True)
class Unary(Node):
    op: str  # '-' or 'not'
    operand: "Expr"


@dataclass(frozen=True)
class Binary(Node):
    op: str  # + - * // % == != < <= > >= and or
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Call(Node):
    fn: str
    args: tuple["Expr", ...]


Expr = Union[Num, Name, Unary, Binary, Call]


# -- op sequences -----------------------------------------------------------------------
@dataclass(frozen=True)
class OpItem(Node):
    """`F`, `B[1]`, `W`, `I@3`, `F[c]@(k+1)`, with `?` = skip when nothing is left to do."""

    op: str
    chunk: Expr | None
    microbatch: Expr | None
    optional: bool


@dataclass(frozen=True)
class Group(Node):
    items: tuple["Item", ...]


@dataclass(frozen=True)
class Repeat(Node):
    item: "Item"
    count: Expr


Item = Union[OpItem, Group, Repeat]


# -- statements -------------------------------------------------------------------------
@dataclass(frozen=True)
class Seq(Node):
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Let(Node):
    name: str
    value: Expr


@dataclass(frozen=True)
class For(Node):
    var: str
    start: Expr
    stop: Expr
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class If(Node):
    cond: Expr
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...]


@dataclass(frozen=True)
class Slot(Node):
    """`slot EXPR`: the ops emitted after it (until the next `slot`) run at that unit-time slot."""

    value: Expr


Stmt = Union[Seq, Let, For, If, Slot]


@dataclass(frozen=True)
class Requirement(Node):
    """One condition of a `supports` line, with its source text for messages."""

    cond: Expr
    text: str


@dataclass(frozen=True)
class PlacementSpec(Node):
    style: str  # a named style, or "map"
    groups: tuple[tuple[Expr, ...], ...] = ()  # for map: one group of ranks per pipeline
    pos: Pos | None = field(default=None, kw_only=True)  # None: the implied `placement linear`


@dataclass(frozen=True)
class CompactSpec(Node):
    """`compact greedy`: reorder each rank by the slots of its ops (see `compact.py`)."""

    mode: str


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
