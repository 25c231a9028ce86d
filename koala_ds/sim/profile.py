"""Cost profiles (JSON, version 1): what each virtual stage costs in time and memory.

```json
{"version": 1,
 "stages": [{"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.8, "backward": 1.1,
             "activation_mb": 120.0, "w_hold_mb": 30.0}, ...],
 "p2p_latency": 0.05,
 "memory_limit_mb": 2000}
```

One entry per virtual stage in pipeline order; times are milliseconds per microbatch.
F allocates `activation_mb`; I frees `activation_mb - w_hold_mb`; W frees `w_hold_mb`; a full B
frees all of it. A full B takes `backward` when the stage gives it (optional: the measured
full backward, which on real hardware is often less than I + W) and `backward_input +
backward_weight` otherwise; no relation between B and I + W is imposed. `p2p_latency` is paid
on every dependency between stages on different ranks. `memory_limit_mb` (a number or one per
rank) is optional. `action_overhead` (optional, ms, default 0) is what the runtime costs per
action on top of the compute the stage times measure (its Python, the launch, the CPU side of
messages): loading adds it to every F, I, W and B (B is one action: it gets it once, so a
profile without `backward` gets B = I + W + action_overhead). `step_overhead` (optional, ms,
default 0) is what a training step costs beside the pipeline (the optimizer step, gradient
reduction, the runtime's set-up and tear-down): the simulator adds it to every rank's finish,
so to every makespan (= predicted step time); `step_overhead_by_placement` (optional, e.g.
`{"vshape": 5.0}`) gives a placement its own, used for its schedules instead. A stage's
optional `switch` (ms, default 0) is what one of its actions costs extra when its rank's
previous action was of another stage (a rank's other chunk: the weights and activations it
reads are no longer in the caches); the first action of a rank's order pays none.
`koala calibrate` fits them from a measured run.
A stage's optional `spread` (written by `koala profile` and `koala calibrate`) gives, per time
field, how precisely the profile knows its value: the interquartile range the value itself would
show over repeated measurements, over the value (`value_spread`: about sqrt(pi/2) x the samples'
interquartile range / sqrt(samples); `{"forward": 0.01, ...}`); `koala search` treats a predicted
gain within the spread it makes on a makespan as no gain (`CostProfile.quartile_profiles`,
docs/search.md). Without it everything is as before the field.
Loading validates everything; every error names the file and the field.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from ..core.ir import PLACEMENT_STYLES, KoalaError
from ..core.json_input import NotJson, parse_json

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
STAGE_FIELDS = ("forward", "backward_input", "backward_weight", "activation_mb", "w_hold_mb")
#: Optional per-stage fields: `backward`, the full backward's time (default I + W); `switch`, the
#: extra time of an action whose rank's previous action was of another stage (default 0).
OPTIONAL_STAGE_FIELDS = ("backward", "switch")
#: The time fields a stage's optional `spread` may give (`value_spread`, a fraction); `backward`
#: only where the stage gives `backward`.
SPREAD_FIELDS = ("forward", "backward_input", "backward_weight", "backward")
TOP_FIELDS = ("version", "stages", "p2p_latency", "memory_limit_mb", "action_overhead", "step_overhead",
              "step_overhead_by_placement")
#: The placements `step_overhead_by_placement` may name (koala_ds.core.ir's named styles).
OVERHEAD_PLACEMENTS = (*PLACEMENT_STYLES, "bidirectional")
#: Free-form top-level fields that are kept out of validation (the profiler writes its notes there).
FREE_FIELDS = ("name", "description", "meta")


#: The median of n samples varies, over repeated measurements, by about sqrt(pi / 2) / sqrt(n) times
#: the samples' own spread (its standard error is sqrt(pi / 2) sigma / sqrt(n) for normal noise).
MEDIAN_SPREAD_FACTOR = math.sqrt(math.pi / 2)


def value_spread(samples: Sequence[float], value: float) -> float:
    """The spread of a value measured as the median (or a trimmed mean) of `samples`: the
    interquartile range the value itself would show over repeated measurements, about
    MEDIAN_SPREAD_FACTOR x the samples' interquartile range / sqrt(len(samples)), over `value`
    (0 for a value of 0). Needs 2 samples or more. Not one sample's spread: a profile of 40
    microbatches that vary by 10% knows its median to about 2%."""
    import statistics

    if value <= 0:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return MEDIAN_SPREAD_FACTOR * (q3 - q1) / math.sqrt(len(samples)) / value


class ProfileError(KoalaError):
    """A cost profile that cannot be used: bad file, missing or bad field, wrong size."""


@dataclass(frozen=True)
class StageCost:
    """The cost of one virtual stage for one microbatch (ms and MB)."""

    forward: float
    backward_input: float
    backward_weight: float
    activation_mb: float = 0.0
    w_hold_mb: float = 0.0
    backward_full: float | None = None  # the profile's `backward`; None: B = I + W
    switch: float = 0.0  # the profile's `switch`: added to an action after one of another stage

    @property
    def backward(self) -> float:
        """A full backward (B): the profile's `backward` when given, else backward_input + backward_weight."""
        if self.backward_full is not None:
            return self.backward_full
        return self.backward_input + self.backward_weight

    @property
    def split_backward(self) -> float:
        """A split backward: I + W."""
        return self.backward_input + self.backward_weight

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in STAGE_FIELDS}
        if self.backward_full is not None:
            out["backward"] = self.backward_full
        if self.switch:
            out["switch"] = self.switch
        return out


@dataclass(frozen=True)
class StageSpread:
    """How precisely a stage's times are known, in ms: each field's spread (the profile's relative
    `spread` times the field's value as written, before any action_overhead); 0 where the profile
    gives none."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    backward: float = 0.0


def _stage_spreads(entries: Sequence[dict]) -> tuple[StageSpread, ...] | None:
    """The stages' spreads in ms (validated entries); None when no stage gives one."""
    if not any("spread" in entry for entry in entries):
        return None
    return tuple(StageSpread(**{name: float(entry.get("spread", {}).get(name, 0.0)) * float(entry.get(name, 0.0))
                                for name in SPREAD_FIELDS}) for entry in entries)


def with_action_overhead(cost: StageCost, overhead: float) -> StageCost:
    """`cost` with `overhead` ms added to each action: F, I, W and B (once: B is one action)."""
    return StageCost(cost.forward + overhead, cost.backward_input + overhead, cost.backward_weight + overhead,
                     cost.activation_mb, cost.w_hold_mb, cost.backward + overhead, cost.switch)


#: The largest time (ms) or size (MB) a profile may give: 1e12 ms is 31 years, 1e12 MB an
#: exabyte. Below it every sum the simulator makes (at most MAX_ACTIONS terms) stays finite, so
#: every result, and `--json`, holds finite numbers.
MAX_PROFILE_NUMBER = 1e12


def _number(value: Any, where: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}: expected a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ProfileError(f"{where}: expected a finite number, got {value!r}")
    if value < 0:
        raise ProfileError(f"{where}: must not be negative, got {value!r}")
    if MAX_PROFILE_NUMBER < value < math.inf:
        raise ProfileError(f"{where}: {value!r} is more than {MAX_PROFILE_NUMBER:g} (MAX_PROFILE_NUMBER; "
                           f"times are ms, sizes MB)")
    return value


@dataclass(frozen=True)
class CostProfile:
    """Per-stage costs, the p2p latency, the optional memory limit (MB, per rank) and the
    per-step overhead (ms, added to every makespan)."""

    stages: tuple[StageCost, ...]
    p2p_latency: float = 0.0
    memory_limit_mb: float | tuple[float, ...] | None = None
    source: str = "<profile>"
    step_overhead: float = 0.0
    #: per stage, how much its measured times varied (ms; None: the profile gives no spread)
    spread: tuple[StageSpread, ...] | None = None
    #: (placement style, ms) pairs: the step overhead of that placement's steps, where it is not
    #: `step_overhead` (koala calibrate fits them where a run's placements differ; sorted by style)
    step_overhead_by_placement: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "step_overhead_by_placement", sorted_by_placement(self.step_overhead_by_placement))
        if self.spread is not None:
            object.__setattr__(self, "spread", tuple(self.spread))
            if len(self.spread) != len(self.stages):
                raise ProfileError(f"{self.source}: {len(self.spread)} stage spreads for {len(self.stages)} stages")
        if isinstance(self.memory_limit_mb, (list, tuple)):
            object.__setattr__(self, "memory_limit_mb", tuple(float(x) for x in self.memory_limit_mb))
        elif self.memory_limit_mb is not None:
            object.__setattr__(self, "memory_limit_mb", float(self.memory_limit_mb))
        # The same rules as a loaded file, so that a profile built in code cannot be wrong either.
        _check(self.to_dict(), self.source)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def step_overhead_of(self, style: str) -> float:
        """The step overhead (ms) of a schedule of placement `style`: its own where the profile
        gives one (`step_overhead_by_placement`), else `step_overhead`."""
        return dict(self.step_overhead_by_placement).get(style, self.step_overhead)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward_input: float = 1.0,
                backward_weight: float = 1.0, activation_mb: float = 1.0, w_hold_mb: float = 0.0,
                p2p_latency: float = 0.0, memory_limit_mb: float | Sequence[float] | None = None,
                source: str | None = None, backward: float | None = None) -> "CostProfile":
        """Every stage costs the same. The defaults are unit costs: F = I = W = 1 (B = 2); `backward`
        gives B its own time."""
        if num_stages < 1:
            raise ProfileError(f"uniform profile: num_stages must be >= 1, got {num_stages}")
        stage = StageCost(forward, backward_input, backward_weight, activation_mb, w_hold_mb, backward)
        limit = tuple(memory_limit_mb) if isinstance(memory_limit_mb, (list, tuple)) else memory_limit_mb
        return cls((stage,) * num_stages, p2p_latency, limit, source or f"<uniform x{num_stages}>")

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> "CostProfile":
        """Validate a parsed profile. Errors name `source` and the field (`stages[3].forward`)."""
        _check(data, source)
        stages = tuple(StageCost(*(float(entry[name]) for name in STAGE_FIELDS),
                                 backward_full=float(entry["backward"]) if "backward" in entry else None,
                                 switch=float(entry.get("switch", 0.0)))
                       for entry in data["stages"])
        overhead = float(data.get("action_overhead", 0.0))
        if overhead:
            stages = tuple(with_action_overhead(c, overhead) for c in stages)
        limit = data.get("memory_limit_mb")
        if isinstance(limit, list):
            limit = tuple(float(x) for x in limit)
        elif limit is not None:
            limit = float(limit)
        return cls(stages, float(data["p2p_latency"]), limit, source, float(data.get("step_overhead", 0.0)),
                   spread=_stage_spreads(data["stages"]),
                   step_overhead_by_placement=tuple(data.get("step_overhead_by_placement", {}).items()))

    @classmethod
    def from_json(cls, text: str, source: str = "<profile>") -> "CostProfile":
        try:
            data = parse_json(text)
        except NotJson as exc:
            raise ProfileError(f"{source}{exc.where}: not a JSON file ({exc.reason}); "
                               f"a cost profile is JSON with fields {', '.join(TOP_FIELDS)}") from None
        return cls.from_dict(data, source)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"version": PROFILE_VERSION, "stages": self._stage_dicts(),
                               "p2p_latency": self.p2p_latency}
        if self.memory_limit_mb is not None:
            limit = self.memory_limit_mb
            out["memory_limit_mb"] = list(limit) if isinstance(limit, tuple) else limit
        if self.step_overhead:
            out["step_overhead"] = self.step_overhead
        if self.step_overhead_by_placement:
            out["step_overhead_by_placement"] = dict(self.step_overhead_by_placement)
        return out

    def _stage_dicts(self) -> list[dict]:
        """The stages as written, each with its `spread` (relative again) where the profile has one."""
        out = [s.to_dict() for s in self.stages]
        for entry, cost, spread in zip(out, self.stages, self.spread or ()):
            values = {"forward": cost.forward, "backward_input": cost.backward_input,
                      "backward_weight": cost.backward_weight, "backward": cost.backward_full}
            entry["spread"] = {name: (getattr(spread, name) / value if value else 0.0)
                               for name, value in values.items() if value is not None}
        return out

    def quartile_profiles(self) -> tuple["CostProfile", "CostProfile"] | None:
        """This profile with every stage time moved down, and up, by half its spread (never below
        0): about the lower and upper quartiles of what repeated measurements would give. None
        when the profile gives no spread."""
        if self.spread is None:
            return None

        def moved(sign: int, which: str) -> "CostProfile":
            def at(value: float, iqr: float) -> float:
                return max(0.0, value + sign * iqr / 2)

            stages = tuple(dataclasses.replace(
                c, forward=at(c.forward, sp.forward), backward_input=at(c.backward_input, sp.backward_input),
                backward_weight=at(c.backward_weight, sp.backward_weight),
                backward_full=None if c.backward_full is None else at(c.backward_full, sp.backward))
                for c, sp in zip(self.stages, self.spread))
            return dataclasses.replace(self, stages=stages, spread=None, source=f"{self.source} ({which} quartiles)")

        return moved(-1, "lower"), moved(1, "upper")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    # -- queries ------------------------------------------------------------------------
    def memory_limit_for(self, rank: int, p: int) -> float | None:
        """The memory limit of `rank` out of `p` ranks, or None when there is none (an
        infinite limit is none)."""
        limit = self.memory_limit_mb
        if limit is None:
            return None
        if isinstance(limit, tuple):
            if len(limit) != p:
                raise ProfileError(f"{self.source}: field 'memory_limit_mb' lists {len(limit)} ranks "
                                   f"but the schedule has p={p}; give one number or {p} numbers")
            limit = limit[rank]
        return None if math.isinf(limit) else limit

    def memory_limits(self, p: int) -> tuple[float | None, ...]:
        return tuple(self.memory_limit_for(r, p) for r in range(p))

    def stage_costs(self, num_stages: int, pipelines: int = 1, what: str = "the schedule") -> tuple[StageCost, ...]:
        """The cost of each of `num_stages` virtual stages.

        A profile has one entry per virtual stage. With `pipelines` > 1 (bidirectional schedules
        such as Chimera) it may instead describe the stages of one pipeline, which every
        pipeline then uses."""
        n = len(self.stages)
        if n == num_stages:
            return self.stages
        per_pipeline = num_stages // pipelines
        if pipelines > 1 and n == per_pipeline:
            return tuple(self.stages[s % per_pipeline] for s in range(num_stages))
        expected = f"{num_stages}" if pipelines == 1 else f"{per_pipeline} (one pipeline) or {num_stages}"
        raise ProfileError(f"{self.source}: field 'stages' has {n} entries but {what} has {num_stages} virtual "
                           f"stages ({pipelines} pipeline{'s' if pipelines > 1 else ''}); the profile needs "
                           f"{expected} entries, one per virtual stage in pipeline order")


def check_header(data: dict, source: str, entries: str, top_fields: Sequence[str]) -> None:
    """The checks a stage profile and a per-layer profile share: known top-level fields, the
    required ones (`version`, `entries`, `p2p_latency`) present, and the version."""
    known = tuple(top_fields) + FREE_FIELDS
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ProfileError(f"{source}: unknown field {unknown[0]!r}; known fields: {', '.join(known)}")
    for name in ("version", entries, "p2p_latency"):
        if name not in data:
            raise ProfileError(f"{source}: missing field {name!r}")
    if data["version"] != PROFILE_VERSION:
        raise ProfileError(f"{source}: field 'version' is {data['version']!r}; this koala-ds reads version "
                           f"{PROFILE_VERSION}")


def _check(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a cost profile is a JSON object with fields {', '.join(TOP_FIELDS)}, "
                           f"got {type(data).__name__}")
    if "layers" in data and "stages" not in data:
        raise ProfileError(f"{source}: a per-layer profile (field 'layers'), not a stage profile: give it to "
                           f"`koala simulate | compare | search` with --partition (docs/profiling.md)")
    check_header(data, source, "stages", TOP_FIELDS)
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise ProfileError(f"{source}: field 'stages' must be a non-empty list, one entry per virtual stage")
    for i, entry in enumerate(stages):
        where = f"{source}: stages[{i}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{where}: expected an object with fields {', '.join(STAGE_FIELDS)}")
        for name in STAGE_FIELDS:
            if name not in entry:
                raise ProfileError(f"{where}: missing field {name!r}")
            _number(entry[name], f"{where}.{name}")
        for name in OPTIONAL_STAGE_FIELDS:
            if name in entry:
                _number(entry[name], f"{where}.{name}")
        _check_spread(entry, where)
        known = STAGE_FIELDS + OPTIONAL_STAGE_FIELDS + ("spread",)
        extra = [k for k in entry if k not in known]
        if extra:
            raise ProfileError(f"{where}: unknown field {extra[0]!r}; known fields: {', '.join(known)}")
        if entry["w_hold_mb"] > entry["activation_mb"]:
            raise ProfileError(f"{where}.w_hold_mb: {entry['w_hold_mb']} is more than activation_mb "
                               f"{entry['activation_mb']} (W holds part of the activation memory)")
    check_latency_and_limit(data, source)


def _check_spread(entry: dict, where: str) -> None:
    """A stage's optional `spread`: an object giving, for some of its time fields, a finite
    fraction >= 0 (`backward` only where the stage gives `backward`)."""
    if "spread" not in entry:
        return
    _numbers_by_name(entry["spread"], f"{where}.spread", SPREAD_FIELDS, "an object such as {\"forward\": 0.03} "
                     "(per time field, how precisely its value is known, a fraction of it)")
    if "backward" in entry["spread"] and "backward" not in entry:
        raise ProfileError(f"{where}.spread.backward: the stage gives no 'backward' (B = I + W, whose spread "
                           f"is theirs): drop it, or give the stage's 'backward'")


def _numbers_by_name(obj: Any, where: str, known: Sequence[str], expected: str) -> None:
    """`obj` an object whose fields are some of `known`, each a number (`_number`)."""
    if not isinstance(obj, dict):
        raise ProfileError(f"{where}: expected {expected}, got {type(obj).__name__}")
    for name, value in obj.items():
        if name not in known:
            raise ProfileError(f"{where}: unknown field {name!r}; known fields: {', '.join(known)}")
        _number(value, f"{where}.{name}")


def sorted_by_placement(pairs: Any) -> tuple[tuple[str, float], ...]:
    """(placement style, ms) pairs (or a dict of them) as the profiles hold them: sorted by style."""
    return tuple(sorted((k, float(x)) for k, x in dict(pairs).items()))


def check_latency_and_limit(data: dict, source: str) -> None:
    """`p2p_latency` a number; `memory_limit_mb` (optional) a number or one per rank."""
    _number(data["p2p_latency"], f"{source}: p2p_latency")
    for name in ("action_overhead", "step_overhead"):
        if name in data:
            _number(data[name], f"{source}: {name}")
    _numbers_by_name(data.get("step_overhead_by_placement", {}), f"{source}: step_overhead_by_placement",
                     OVERHEAD_PLACEMENTS, "an object of placement -> ms such as {\"vshape\": 5.0}")
    limit = data.get("memory_limit_mb")
    if isinstance(limit, (list, tuple)):
        if not limit:
            raise ProfileError(f"{source}: memory_limit_mb: an empty list; give a number or one per rank")
        for r, value in enumerate(limit):
            _number(value, f"{source}: memory_limit_mb[{r}]", allow_inf=True)
    elif limit is not None:
        _number(limit, f"{source}: memory_limit_mb", allow_inf=True)


# -- files and bundled profiles ----------------------------------------------------------
def bundled_profiles() -> list[str]:
    """Names of the example profiles shipped in koala_ds/profiles/."""
    folder = resources.files("koala_ds") / "profiles"
    return sorted(item.name[:-5] for item in folder.iterdir() if item.name.endswith(".json"))


def resolve_profile(name_or_path: str | os.PathLike) -> Path:
    """A path to an existing file, or the name of a bundled profile (`uniform-4`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir():
        raise ProfileError(f"profile {path} is a directory, not a JSON file")
    if path.exists():
        raise ProfileError(f"profile {path} is not a regular file (a device, a pipe or a socket): give a JSON file")
    text = str(name_or_path)
    looks_like_path = os.sep in text or "/" in text
    if not looks_like_path:
        stem = text[:-5] if text.endswith(".json") else text
        bundled = resources.files("koala_ds") / "profiles" / f"{stem}.json"
        if bundled.is_file():
            return Path(str(bundled))
    close = difflib.get_close_matches(text[:-5] if text.endswith(".json") else text, bundled_profiles(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close and not looks_like_path else ""
    raise ProfileError(f"profile {text!r}: no such file, and not a bundled profile{hint} "
                       f"(bundled: {', '.join(bundled_profiles())})")


def load_profile(path_or_name: str | os.PathLike) -> CostProfile:
    """Load and validate a profile file, or a bundled profile by name."""
    path = resolve_profile(path_or_name)
    # a bundled profile is named by its name, not by where this package is installed
    source = str(path) if Path(path_or_name).is_file() else path.stem
    try:
        text = path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark is fine
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a JSON file (not UTF-8 text)") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    profile = CostProfile.from_json(text, source=source)
    log.debug("loaded profile %s: %d stages", path, profile.num_stages)
    return profile
