"""The schedule IR: actions, placements and schedules, with JSON and torch-CSV I/O.

Schedules are plain data. A `Schedule` holds, for each pipeline rank, the ordered list of
compute actions that rank runs; communication is implied by the dependencies between
virtual stages and is inserted by each engine adapter.
"""
from __future__ import annotations

import enum
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Sequence

from .json_input import NotJson, parse_json


class KoalaError(ValueError):
    """Base of every error koala-ds raises for bad input; the CLI prints it without a traceback."""


class ScheduleError(KoalaError):
    """A schedule that breaks a rule of the IR (validation, deadlock, bad input)."""


#: The most actions a schedule may have (all ranks together): `koala` refuses larger ones
#: before compiling or loading them. A schedule has p * v * m * 2 actions (backward full) or
#: p * v * m * 3 (split); compile, validation and simulation take about 0.45 KB and a few
#: microseconds per action (2 M actions: about 1 GB). Change -m, -p or -v to stay below.
MAX_ACTIONS = 2_000_000

#: How messages name the settings that give p, m and v: koala's own flags by default; an engine
#: passes its own (DeepSpeed's config keys, Megatron's flags) so its users read their settings.
CLI_NAMES = {"p": "-p", "m": "-m", "v": "-v"}


def setting_names(names: dict | None) -> dict:
    """`names` completed with koala's flags for any of p, m, v it does not name."""
    return {**CLI_NAMES, **(names or {})}


def change_hint(keys, names: dict | None = None, verb: str = "change") -> str:
    """"change -m or -v" (or the engine's setting names) for the parameters `keys`."""
    names = setting_names(names)
    return f"{verb} {' or '.join(names[k] for k in keys)}"


def size_error(p: int, m: int, v: int, backward: str = "full", names: dict | None = None) -> str | None:
    """None when a (p, m, v) schedule stays within MAX_ACTIONS; else a one-line reason."""
    per = 3 if backward == "split" else 2
    n = p * v * m * per
    if n <= MAX_ACTIONS:
        return None
    return (f"p={p}, m={m}, v={v} gives p*v*m*{per} = {n:,} actions (backward {backward}), over the "
            f"limit of {MAX_ACTIONS:,} (MAX_ACTIONS): {_smaller(names)}")


def _smaller(names: dict | None) -> str:
    names = setting_names(names)
    return f"use a smaller {names['m']}, {names['p']} or {names['v']}"


_MISSING = object()


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(value), f"the number {value!r}" if isinstance(value, (int, float)) and len(repr(value)) < 30 else
        "a number")


def _json_check(value, kind: type, source: str, where: str):
    """`value` when it is a JSON `kind` (an integer is not true/false); else a ScheduleError."""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    wanted = {int: "an integer", str: "a string", list: "a list", dict: "an object"}[kind]
    raise ScheduleError(f"{source}: field {where} must be {wanted}, got {_json_type(value)}")


def _json_field(data: dict, name: str, kind: type, source: str, prefix: str = "", default=_MISSING):
    """Field `name` of a schedule JSON object, checked to be a `kind`."""
    if name not in data:
        if default is _MISSING:
            raise ScheduleError(f"{source}: missing field {prefix}{name!r} in schedule JSON")
        return default
    return _json_check(data[name], kind, source, prefix + name)


def _json_action(text, source: str, rank: int, index: int) -> "Action":
    try:
        return Action.parse(_json_check(text, str, source, f"ranks[{rank}][{index}]"))
    except ScheduleError as exc:
        if str(exc).startswith(source):
            raise
        raise ScheduleError(f"{source}: ranks[{rank}][{index}]: {exc}") from None


def _check_count(n: int, source: str) -> None:
    if n > MAX_ACTIONS:
        raise ScheduleError(f"{source}: {n:,} actions, over the limit of {MAX_ACTIONS:,} (MAX_ACTIONS): "
                            f"use a smaller -m, -p or -v")


class Op(str, enum.Enum):
    F = "F"  # forward
    I = "I"  # backward for inputs (activation gradients)  # noqa: E741
    W = "W"  # backward for weights
    B = "B"  # full backward = I + W

    def __str__(self) -> str:  # "F", not "Op.F"
        return self.value


class OpIndex(enum.IntEnum):
    """The one op table: each op's index in integer action codes (`koala_ds.core.lowered.action_code`)
    and in the search's choices (op index * chunks + chunk)."""

    F = 0
    B = 1
    I = 2  # noqa: E741
    W = 3


#: The ops by index (`OPS[OpIndex.I] is Op.I`) and the index of each op.
OPS = (Op.F, Op.B, Op.I, Op.W)
OP_INDEX = {op: OpIndex(k) for k, op in enumerate(OPS)}
#: The ops' names as the Koala language writes them.
OP_NAMES = tuple(op.value for op in OPS)


_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FIWB])\s*(\d+)\s*$")


@dataclass(frozen=True, order=True, slots=True)
class Action:
    """One compute action: `op` of virtual `stage` on `microbatch`. Text form `3I7`."""

    op: Op
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                raise ScheduleError(f"action op {self.op!r}: one of {', '.join(OP_NAMES)}") from None
        if type(self.stage) is not int or type(self.microbatch) is not int:  # a bool or 1.0 would pass for 1
            name, value = ("stage", self.stage) if type(self.stage) is not int else ("microbatch", self.microbatch)
            raise ScheduleError(f"action {name} {value!r}: expected an integer, got {type(value).__name__}")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"action {self.stage}{self.op.value}{self.microbatch}: negative index")

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if not match:
            raise ScheduleError(f"bad action {text!r}: expected <stage><F|I|W|B><microbatch>, e.g. 3I7")
        return cls(Op(match.group(2)), int(match.group(1)), int(match.group(3)))


def _zigzag_rank(stage: int, p: int) -> int:
    chunk, pos = divmod(stage, p)
    return pos if chunk % 2 == 0 else p - 1 - pos


#: Named placement styles: (p, stages) -> rank of each stage (one pipeline).
PLACEMENT_STYLES = {
    "linear": lambda p, n: [s for s in range(n)],
    "interleaved": lambda p, n: [s % p for s in range(n)],
    "vshape": lambda p, n: [_zigzag_rank(s, p) for s in range(n)],
}
PLACEMENT_ALIASES = {"looped": "interleaved", "wave": "vshape", "v": "vshape", "zigzag": "vshape"}


def _style_ranks(style: str, p: int, n: int, pipelines: int) -> list[int] | None:
    """The stage -> rank list a named style gives for p ranks and n stages (None: no such style)."""
    if style == "bidirectional":
        if pipelines != 2:
            return None
        down = PLACEMENT_STYLES["interleaved"](p, n // 2)
        return down + [p - 1 - r for r in down]
    return PLACEMENT_STYLES[style](p, n) if style in PLACEMENT_STYLES and pipelines == 1 else None


@dataclass(frozen=True)
class Placement:
    """Which rank holds each virtual stage.

    `stage_ranks[s]` is the rank of virtual stage s. With `pipelines` > 1 (bidirectional
    schedules such as Chimera), the stages split into that many equal consecutive groups,
    each a full copy of the model in pipeline order; microbatch mb flows through pipeline
    `mb % pipelines`.
    """

    stage_ranks: tuple[int, ...]
    pipelines: int = 1
    # linear | interleaved | vshape | bidirectional | map: a name for stage_ranks, which must be what
    # it names; not compared (two placements with the same ranks are one)
    style: str = field(default="map", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_ranks", tuple(int(r) for r in self.stage_ranks))
        n = len(self.stage_ranks)
        if n == 0:
            raise ScheduleError("placement: no stages")
        if self.pipelines < 1 or n % self.pipelines:
            raise ScheduleError(f"placement: {n} stages do not split into {self.pipelines} pipelines")
        ranks = set(self.stage_ranks)
        if ranks != set(range(len(ranks))):
            raise ScheduleError(f"placement: ranks {sorted(ranks)} must be 0..p-1 with none unused")
        counts = dict(Counter(self.stage_ranks))
        if len(set(counts.values())) != 1:
            raise ScheduleError(f"placement: ranks hold different numbers of stages {counts}")
        if self.style != "map" and list(self.stage_ranks) != _style_ranks(self.style, len(ranks), n, self.pipelines):
            raise ScheduleError(f"placement: style {self.style!r} does not give stage_ranks {list(self.stage_ranks)} "
                                f"(pipelines={self.pipelines}); use style 'map', or Placement.explicit")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def named(cls, style: str, p: int, v: int = 1) -> "Placement":
        style = PLACEMENT_ALIASES.get(style, style)
        if style == "bidirectional":
            return cls(tuple(_style_ranks(style, p, 2 * p * v, 2)), pipelines=2, style="bidirectional")
        if style not in PLACEMENT_STYLES:
            known = ", ".join(sorted([*PLACEMENT_STYLES, "bidirectional", "map"]))
            raise ScheduleError(f"unknown placement {style!r}; known: {known}")
        if style == "linear" and v != 1:
            raise ScheduleError(f"placement linear needs v == 1 (got v={v}): use interleaved or vshape")
        # canonical label: with one chunk (or one rank) every style is the linear one
        return cls(tuple(_style_ranks(style, p, p * v, 1)), 1, style).canonical()

    @classmethod
    def explicit(cls, stage_ranks: Sequence[int], pipelines: int = 1) -> "Placement":
        """An explicit map; it takes a style name when it equals a named placement."""
        placement = cls(tuple(stage_ranks), pipelines, "map")
        return placement.canonical()

    def canonical(self) -> "Placement":
        p, v = self.p, self.v
        candidates = ["bidirectional"] if self.pipelines == 2 else list(PLACEMENT_STYLES)
        for style in candidates:
            if style == "linear" and v != 1:
                continue
            ranks = _style_ranks(style, p, self.num_stages, self.pipelines)
            if ranks is not None and tuple(ranks) == self.stage_ranks:
                return Placement(self.stage_ranks, self.pipelines, style)
        return Placement(self.stage_ranks, self.pipelines, "map")

    # -- queries ------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @cached_property
    def p(self) -> int:
        return max(self.stage_ranks) + 1

    @property
    def chunks_per_rank(self) -> int:
        return self.num_stages // self.p

    @property
    def stages_per_pipeline(self) -> int:
        return self.num_stages // self.pipelines

    @property
    def v(self) -> int:
        """Model chunks per rank and pipeline (a schedule's v)."""
        return self.chunks_per_rank // self.pipelines

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    @cached_property
    def _rank_stages(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.p)]
        for stage, rank in enumerate(self.stage_ranks):
            out[rank].append(stage)
        return tuple(tuple(s) for s in out)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages of `rank` in pipeline order; index = chunk number."""
        return self._rank_stages[rank]

    def chunk_of(self, stage: int) -> int:
        return self._rank_stages[self.stage_ranks[stage]].index(stage)

    def pipeline_of(self, stage: int) -> int:
        return stage // self.stages_per_pipeline

    def prev_stage(self, stage: int) -> int | None:
        """The stage that feeds `stage` its input, or None for a first stage."""
        return None if stage % self.stages_per_pipeline == 0 else stage - 1

    def next_stage(self, stage: int) -> int | None:
        """The stage `stage` feeds, or None for a last stage (which computes the loss)."""
        return None if (stage + 1) % self.stages_per_pipeline == 0 else stage + 1

    def is_last(self, stage: int) -> bool:
        return self.next_stage(stage) is None

    def microbatches_of(self, stage: int, m: int) -> range:
        """The microbatches that pass through `stage`, in order."""
        return range(self.pipeline_of(stage), m, self.pipelines)

    def describe(self) -> str:
        if self.style != "map":
            return self.style
        groups = [self.stage_ranks[i:i + self.stages_per_pipeline]
                  for i in range(0, self.num_stages, self.stages_per_pipeline)]
        return "map " + " | ".join(" ".join(str(r) for r in g) for g in groups)


BACKWARD_MODES = ("full", "split")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule for concrete (p, m, v): one ordered action list per rank."""

    p: int
    m: int
    v: int
    placement: Placement
    ranks: tuple[tuple[Action, ...], ...]
    backward: str = "full"
    name: str = "schedule"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))
        if self.backward not in BACKWARD_MODES:
            raise ScheduleError(f"backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.placement.p != self.p:
            raise ScheduleError(f"placement has {self.placement.p} ranks but p={self.p}")
        if len(self.ranks) != self.p:
            raise ScheduleError(f"schedule has {len(self.ranks)} rank lists but p={self.p}")
        if self.m < 1:
            raise ScheduleError(f"m must be >= 1, got m={self.m}")
        if self.v < 1 or self.placement.num_stages != self.p * self.v * self.placement.pipelines:
            raise ScheduleError(f"v={self.v} but the placement has {self.placement.num_stages} stages on p={self.p} "
                                f"ranks ({self.placement.pipelines} pipeline(s)): v is the stages per rank and pipeline")

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def num_actions(self) -> int:
        return sum(len(r) for r in self.ranks)

    def with_name(self, name: str) -> "Schedule":
        return Schedule(self.p, self.m, self.v, self.placement, self.ranks, self.backward, name, dict(self.meta))

    def same_order(self, other: "Schedule") -> bool:
        """Equal as schedules (placement, backward mode, every rank's order), ignoring the name."""
        return (self.p, self.m, self.v, self.placement.stage_ranks, self.placement.pipelines,
                self.backward, self.ranks) == (other.p, other.m, other.v, other.placement.stage_ranks,
                                                other.placement.pipelines, other.backward, other.ranks)

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": "koala-schedule",
            "version": 1,
            "name": self.name,
            "p": self.p,
            "m": self.m,
            "v": self.v,
            "backward": self.backward,
            "placement": {"style": self.placement.style, "stage_ranks": list(self.placement.stage_ranks),
                          "pipelines": self.placement.pipelines},
            "ranks": [[str(a) for a in rank] for rank in self.ranks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<json>") -> "Schedule":
        """The schedule a `to_dict` object describes; a ScheduleError naming `source` and the
        field (its path, e.g. ranks[1][3]) for anything else."""
        if not isinstance(data, dict):
            raise ScheduleError(f"{source}: schedule JSON must be an object with fields p, m, v, placement and "
                                f"ranks, got {_json_type(data)}")
        pl = _json_field(data, "placement", dict, source)
        stage_ranks = _json_field(pl, "stage_ranks", list, source, "placement.")
        for i, r in enumerate(stage_ranks):
            _json_check(r, int, source, f"placement.stage_ranks[{i}]")
        ranks = _json_field(data, "ranks", list, source)
        for i, rank in enumerate(ranks):
            _json_check(rank, list, source, f"ranks[{i}]")
        _check_count(sum(len(rank) for rank in ranks), source)
        for key, expected in (("format", "koala-schedule"), ("version", 1)):
            if key in data and data[key] != expected:
                raise ScheduleError(f"{source}: {key} {data[key]!r}: a koala schedule has {expected!r} (koala export "
                                    f"--format json writes one)")
        try:
            placement = _json_placement(pl, tuple(stage_ranks), source)
            return cls(*(_json_field(data, k, int, source) for k in ("p", "m", "v")), placement,
                       tuple(tuple(_json_action(a, source, i, j) for j, a in enumerate(rank))
                             for i, rank in enumerate(ranks)),
                       _json_field(data, "backward", str, source, default="full"),
                       _json_field(data, "name", str, source, default="schedule"))
        except ScheduleError as exc:
            if str(exc).startswith(source):
                raise
            raise ScheduleError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> "Schedule":
        try:
            data = parse_json(text)
        except NotJson as exc:
            raise ScheduleError(f"{source}{exc.where}: not JSON ({exc.reason})") from None
        return cls.from_dict(data, source)

    # -- torch.distributed.pipelining compute-only CSV ----------------------------------
    def to_torch_csv(self) -> str:
        """One row per rank, one action per cell (`3I7`), as torch's `_load_csv` reads it; one
        pipeline only (torch runs one: two would read back as another schedule)."""
        if self.placement.pipelines > 1:
            raise ScheduleError(f"{self.name} runs {self.placement.pipelines} pipelines (placement "
                                f"{self.placement.describe()}); torch.distributed.pipelining's CSV holds one: write it "
                                f"as koala or json")
        return "".join(",".join(str(a) for a in rank) + "\n" for rank in self.ranks)

    @classmethod
    def from_torch_csv(cls, text: str, name: str = "schedule", v: int | None = None,
                       placement: Placement | None = None, source: str = "<csv>") -> "Schedule":
        """Read a compute-only CSV. The placement is inferred (which rank runs each stage)
        unless given; the backward mode is split when any I or W appears."""
        _check_count(sum(1 for cell in text.replace("\n", ",").split(",") if cell.strip()), source)
        rows: list[list[Action]] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            cells = [c.strip() for c in line.split(",")]
            try:
                rows.append([Action.parse(c) for c in cells if c])
            except ScheduleError as exc:
                raise ScheduleError(f"{source}:{lineno}: {exc}") from None
        while rows and not rows[-1] and len(rows) > 1:
            rows.pop()
        actions = [a for row in rows for a in row]
        if not actions:
            raise ScheduleError(f"{source}: no actions")
        if placement is None:
            stage_ranks: dict[int, int] = {}
            for rank, row in enumerate(rows):
                for a in row:
                    if stage_ranks.setdefault(a.stage, rank) != rank:
                        raise ScheduleError(f"{source}: stage {a.stage} appears on ranks "
                                            f"{stage_ranks[a.stage]} and {rank}")
            n = max(stage_ranks) + 1
            missing = [s for s in range(n) if s not in stage_ranks]
            if missing:
                raise ScheduleError(f"{source}: stages {missing} have no actions")
            placement = Placement.explicit([stage_ranks[s] for s in range(n)])
        p = len(rows)
        m = max(a.microbatch for a in actions) + 1
        if v is None:
            v = placement.v
        backward = "split" if any(a.op in (Op.I, Op.W) for a in actions) else "full"
        return cls(p, m, v, placement, tuple(tuple(r) for r in rows), backward, name)


def _json_placement(pl: dict, stage_ranks: tuple, source: str) -> Placement:
    """A JSON placement: its stage_ranks and pipelines; a style, when given, must name them."""
    pipelines = _json_field(pl, "pipelines", int, source, "placement.", 1)
    style = _json_field(pl, "style", str, source, "placement.", "map")
    try:
        placement = Placement.explicit(stage_ranks, pipelines)
    except (ValueError, ZeroDivisionError, IndexError):  # not a placement at all: Schedule's checks word it
        return Placement(stage_ranks, pipelines, style)
    if style not in ("map", placement.style):
        raise ScheduleError(f"{source}: placement.style {style!r} is not what placement.stage_ranks are "
                            f"({placement.describe()}): fix it or drop it")
    return placement


def schedule_from_ranks(name: str, placement: Placement, m: int, ranks: Iterable[Iterable[Action]],
                        backward: str | None = None) -> Schedule:
    """Convenience constructor: p and v come from the placement, backward from the ops."""
    ranks = tuple(tuple(r) for r in ranks)
    if backward is None:
        backward = "split" if any(a.op in (Op.I, Op.W) for r in ranks for a in r) else "full"
    v = placement.v
    return Schedule(placement.p, m, v, placement, ranks, backward, name)
