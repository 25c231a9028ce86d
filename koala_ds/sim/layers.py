"""Per-layer cost profiles (the stage profile's versioned extension, docs/profiling.md).

```json
{"version": 1,
 "layers": [{"name": "embedding", "kind": "embedding", "forward": 0.1, "backward_input": 0.0,
             "backward_weight": 0.3, "activation_mb": 1.0, "w_hold_mb": 1.0, "output_mb": 16.0,
             "param_mb": 200.0}, ...],
 "p2p_latency": 0.05,
 "memory_limit_mb": 80000,
 "optimizer_bytes_per_param_byte": 3.0}
```

One entry per layer in model order (the embedding, each transformer layer, the output layer with
the loss). A *partition* gives the number of consecutive layers of each virtual stage in
pipeline order; a stage costs the sums over its layers (`LayerProfile.stage_profile`). The
memory limit is the whole memory of a rank: its static memory (`param_mb * (1 +
optimizer_bytes_per_param_byte)` over its layers) comes off it, and the rest is what the
schedule's activations may use. Every error names the file and the field.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.ir import Placement
from ..core.json_input import NotJson, parse_json
from .profile import (PROFILE_VERSION, CostProfile, ProfileError, StageCost, _number, check_header,
                      check_latency_and_limit, resolve_profile, sorted_by_placement, with_action_overhead)

log = logging.getLogger(__name__)

LAYER_FIELDS = ("forward", "backward_input", "backward_weight", "activation_mb", "w_hold_mb", "output_mb")
OPTIONAL_LAYER_FIELDS = ("name", "kind", "backward", "param_mb")
LAYER_KINDS = ("embedding", "transformer", "output", "other")
TOP_FIELDS = ("version", "layers", "p2p_latency", "memory_limit_mb", "optimizer_bytes_per_param_byte",
              "action_overhead", "step_overhead", "step_overhead_by_placement")


@dataclass(frozen=True)
class LayerCost:
    """One layer's cost per microbatch (ms and MB) and its parameter bytes (MB)."""

    name: str
    kind: str
    forward: float
    backward_input: float
    backward_weight: float
    activation_mb: float
    w_hold_mb: float
    output_mb: float
    param_mb: float = 0.0
    backward_full: float | None = None   # the file's `backward`; None: B = I + W

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight if self.backward_full is None else self.backward_full


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer costs, the p2p latency, the per-rank memory limit (MB, whole memory) and the
    optimizer's bytes per parameter byte."""

    layers: tuple[LayerCost, ...]
    p2p_latency: float = 0.0
    memory_limit_mb: float | tuple[float, ...] | None = None
    optimizer_bytes_per_param_byte: float = 0.0
    source: str = "<layer profile>"
    action_overhead: float = 0.0  # ms per action, added once to each stage's F, I, W and B (see sim.profile)
    step_overhead: float = 0.0  # ms per step, beside the pipeline (see sim.profile)
    #: (placement style, ms) pairs: a placement's own step overhead (CostProfile's field of that name)
    step_overhead_by_placement: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_overhead_by_placement", sorted_by_placement(self.step_overhead_by_placement))

    def step_overhead_of(self, style: str) -> float:
        """The step overhead (ms) of placement `style`'s schedules (CostProfile.step_overhead_of)."""
        return dict(self.step_overhead_by_placement).get(style, self.step_overhead)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def static_mb(self, layers: Sequence[int]) -> float:
        """Parameter, gradient and optimizer-state MB of the layers with these indices."""
        k = 1.0 + self.optimizer_bytes_per_param_byte
        return sum(self.layers[i].param_mb for i in layers) * k

    def limit_for(self, rank: int, p: int) -> float | None:
        """The whole memory limit of `rank` (None: no limit)."""
        limit = self.memory_limit_mb
        if isinstance(limit, tuple):
            if len(limit) != p:
                raise ProfileError(f"{self.source}: field 'memory_limit_mb' lists {len(limit)} ranks but p={p}; "
                                   f"give one number or {p} numbers")
            limit = limit[rank]
        return None if limit is None or math.isinf(limit) else limit

    def stage_layers(self, partition: Sequence[int]) -> list[range]:
        """The layer indices of each stage of a (checked) partition."""
        check_partition(partition, self.num_layers, len(partition), self.source)
        out, start = [], 0
        for count in partition:
            out.append(range(start, start + count))
            start += count
        return out

    def stage_cost(self, layers: Sequence[int]) -> StageCost:
        """The cost of a stage made of these layers: sums of their costs."""
        ls = [self.layers[i] for i in layers]
        full = sum(x.backward for x in ls) if any(x.backward_full is not None for x in ls) else None
        cost = StageCost(sum(x.forward for x in ls), sum(x.backward_input for x in ls),
                         sum(x.backward_weight for x in ls), sum(x.activation_mb for x in ls),
                         sum(x.w_hold_mb for x in ls), full)
        return with_action_overhead(cost, self.action_overhead) if self.action_overhead else cost

    def rank_static_mb(self, partition: Sequence[int], placement: Placement) -> list[float]:
        """Static memory (MB) of each rank under `partition` and `placement`."""
        stages = self.stage_layers(partition)
        out = [0.0] * placement.p
        for s, rng in enumerate(stages):
            out[placement.stage_ranks[s]] += self.static_mb(rng)
        return out

    def stage_profile(self, partition: Sequence[int], p: int, placement: Placement | None = None
                      ) -> CostProfile:
        """The stage profile of `partition` on `p` ranks: per-stage sums, and per rank the memory
        limit minus that rank's static memory. `placement` says which rank holds each stage
        (default: stage s on rank s % p, the interleaved and linear placements)."""
        S = len(partition)
        if placement is None:
            if S % p:
                raise ProfileError(f"partition {partition_text(partition)} has {S} stages, not a multiple of p={p}")
            placement = Placement.named("interleaved", p, S // p)
        if placement.num_stages != S:
            raise ProfileError(f"partition {partition_text(partition)} has {S} stages but the placement has "
                               f"{placement.num_stages}; give p x v = {placement.num_stages} counts")
        stages = tuple(self.stage_cost(rng) for rng in self.stage_layers(partition))
        limits = None
        if self.memory_limit_mb is not None:
            static = self.rank_static_mb(partition, placement)
            limits = []
            for r in range(placement.p):
                whole = self.limit_for(r, placement.p)
                if whole is None:
                    limits.append(math.inf)
                    continue
                if static[r] >= whole:
                    raise ProfileError(
                        f"{self.source}: memory_limit_mb: under partition {partition_text(partition)} rank {r} "
                        f"holds {static[r]:.6g} MB of parameters and optimizer state (param_mb x (1 + "
                        f"optimizer_bytes_per_param_byte)), not less than its limit {whole:.6g} MB")
                limits.append(whole - static[r])
            limits = tuple(limits)
        return CostProfile(stages, self.p2p_latency, limits, f"{self.source} split {partition_text(partition)}",
                           self.step_overhead, step_overhead_by_placement=self.step_overhead_by_placement)

    def uniform_partition(self, stages: int) -> list[int]:
        """The engines' default split: the transformer layers evenly, the leading embedding
        entries with the first stage and the trailing output entries with the last."""
        kinds = [x.kind for x in self.layers]
        head = next((i for i, k in enumerate(kinds) if k != "embedding"), len(kinds))
        tail = next((i for i, k in enumerate(reversed(kinds)) if k != "output"), len(kinds))
        if head + tail >= len(kinds):
            head = tail = 0
        return uniform_partition(self.num_layers, stages, head=head, tail=tail, source=self.source)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, source: str = "<layer profile>") -> "LayerProfile":
        """Validate a parsed per-layer profile. Errors name `source` and the field (`layers[3].forward`)."""
        _check_top(data, source)
        layers = tuple(_layer(entry, i, source) for i, entry in enumerate(data["layers"]))
        limit = data.get("memory_limit_mb")
        if isinstance(limit, list):
            limit = tuple(float(x) for x in limit)
        elif limit is not None:
            limit = float(limit)
        return cls(layers, float(data["p2p_latency"]), limit,
                   float(data.get("optimizer_bytes_per_param_byte", 0.0)), source,
                   float(data.get("action_overhead", 0.0)), float(data.get("step_overhead", 0.0)),
                   tuple(data.get("step_overhead_by_placement", {}).items()))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"version": PROFILE_VERSION, "layers": [_layer_dict(x) for x in self.layers],
                               "p2p_latency": self.p2p_latency}
        if self.memory_limit_mb is not None:
            lim = self.memory_limit_mb
            out["memory_limit_mb"] = list(lim) if isinstance(lim, tuple) else lim
        if self.optimizer_bytes_per_param_byte:
            out["optimizer_bytes_per_param_byte"] = self.optimizer_bytes_per_param_byte
        if self.action_overhead:
            out["action_overhead"] = self.action_overhead
        if self.step_overhead:
            out["step_overhead"] = self.step_overhead
        if self.step_overhead_by_placement:
            out["step_overhead_by_placement"] = dict(self.step_overhead_by_placement)
        return out


def _layer_dict(x: LayerCost) -> dict:
    out = {"name": x.name, "kind": x.kind, **{k: getattr(x, k) for k in LAYER_FIELDS}, "param_mb": x.param_mb}
    if x.backward_full is not None:
        out["backward"] = x.backward_full
    return out


def _check_top(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a per-layer profile is a JSON object with fields {', '.join(TOP_FIELDS)}")
    if "stages" in data and "layers" in data:
        raise ProfileError(f"{source}: has both 'stages' and 'layers'; a profile is either a stage profile "
                           f"or a per-layer profile: remove one")
    check_header(data, source, "layers", TOP_FIELDS)
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise ProfileError(f"{source}: field 'layers' must be a non-empty list, one entry per layer in model order")
    check_latency_and_limit(data, source)
    if "optimizer_bytes_per_param_byte" in data:
        _number(data["optimizer_bytes_per_param_byte"], f"{source}: optimizer_bytes_per_param_byte")


def _layer(entry: Any, i: int, source: str) -> LayerCost:
    where = f"{source}: layers[{i}]"
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: expected an object with fields {', '.join(LAYER_FIELDS)}")
    known = LAYER_FIELDS + OPTIONAL_LAYER_FIELDS
    extra = [k for k in entry if k not in known]
    if extra:
        raise ProfileError(f"{where}: unknown field {extra[0]!r}; known fields: {', '.join(known)}")
    values = {}
    for name in LAYER_FIELDS:
        if name not in entry:
            raise ProfileError(f"{where}: missing field {name!r}")
        values[name] = _number(entry[name], f"{where}.{name}")
    if values["w_hold_mb"] > values["activation_mb"]:
        raise ProfileError(f"{where}.w_hold_mb: {values['w_hold_mb']} is more than activation_mb "
                           f"{values['activation_mb']} (W holds part of the activation memory)")
    kind = entry.get("kind", "other")
    if kind not in LAYER_KINDS:
        raise ProfileError(f"{where}.kind: {kind!r} is not one of {', '.join(LAYER_KINDS)}")
    name = entry.get("name", f"layer {i}")
    if not isinstance(name, str):
        raise ProfileError(f"{where}.name: expected a string, got {name!r}")
    full = _number(entry["backward"], f"{where}.backward") if "backward" in entry else None
    param = _number(entry["param_mb"], f"{where}.param_mb") if "param_mb" in entry else 0.0
    return LayerCost(name, kind, values["forward"], values["backward_input"], values["backward_weight"],
                     values["activation_mb"], values["w_hold_mb"], values["output_mb"], param, full)


# -- partitions ------------------------------------------------------------------------------
def partition_text(partition: Sequence[int]) -> str:
    return ",".join(str(x) for x in partition)


def check_partition(partition: Sequence[int], n_layers: int, stages: int, source: str = "",
                    flag: str = "--partition") -> None:
    """A partition is `stages` counts >= 1 that sum to `n_layers`; else one line naming `flag`."""
    where = f"{flag} {partition_text(partition)}"
    of = f" of {source}" if source else ""
    if len(partition) != stages:
        raise ProfileError(f"{where}: {len(partition)} counts, but p x v = {stages} virtual stages need {stages} "
                           f"(layers per stage, in pipeline order)")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in partition):
        raise ProfileError(f"{where}: every count must be a whole number >= 1 (layers per stage)")
    if sum(partition) != n_layers:
        raise ProfileError(f"{where}: the counts sum to {sum(partition)}, but the {n_layers} layers{of} "
                           f"(embedding and output entries included) must all be placed")


def parse_partition(text: str, n_layers: int, stages: int, source: str = "") -> list[int]:
    """`5,4,4,3` -> [5, 4, 4, 3], checked (`check_partition`)."""
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise ProfileError(f"--partition {text}: expected comma-separated layer counts per stage, e.g. "
                           f"--partition 5,4,4,3, or --partition auto (koala search)") from None
    check_partition(counts, n_layers, stages, source)
    return counts


def uniform_partition(n_layers: int, stages: int, *, head: int = 0, tail: int = 0, source: str = "") -> list[int]:
    """`n_layers` entries on `stages` stages as the engines split by default: the `n_layers - head -
    tail` middle (transformer) layers evenly, the earlier stages taking one more when they do
    not divide; the `head` leading entries (embedding) join the first stage, the `tail` trailing
    ones (output layer and loss) the last."""
    middle = n_layers - head - tail
    if stages < 1 or middle < stages:
        of = f" of {source}" if source else ""
        raise ProfileError(f"{middle} transformer layers{of} cannot fill {stages} virtual stages (p x v): "
                           f"lower -p or -v")
    base, extra = divmod(middle, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    counts[0] += head
    counts[-1] += tail
    return counts


# -- files ---------------------------------------------------------------------------------
def read_profile_json(path_or_name: str | os.PathLike) -> tuple[Any, str]:
    """The parsed JSON of a profile file or bundled profile, and the name to show for it."""
    path = resolve_profile(path_or_name)
    source = str(path) if Path(path_or_name).is_file() else path.stem
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a JSON file (not UTF-8 text)") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return parse_json(text), source
    except NotJson as exc:
        raise ProfileError(f"{source}{exc.where}: not a JSON file ({exc.reason})") from None


def is_layer_profile(data: Any) -> bool:
    return isinstance(data, dict) and "layers" in data


def load_layer_profile(path_or_name: str | os.PathLike) -> LayerProfile:
    """Load and validate a per-layer profile file, or a bundled one by name."""
    data, source = read_profile_json(path_or_name)
    if isinstance(data, dict) and "stages" in data and "layers" not in data:
        raise ProfileError(f"{source}: a stage profile (field 'stages'), not a per-layer profile (field 'layers'); "
                           f"measure one with `koala profile ... --per-layer`")
    profile = LayerProfile.from_dict(data, source)
    log.debug("loaded per-layer profile %s: %d layers", source, profile.num_layers)
    return profile


def load_any_profile(path_or_name: str | os.PathLike) -> CostProfile | LayerProfile:
    """A stage profile or a per-layer profile, whichever the file is."""
    data, source = read_profile_json(path_or_name)
    if is_layer_profile(data):
        return LayerProfile.from_dict(data, source)
    return CostProfile.from_dict(data, source)
