"""Which covered layers an I step defers: a bound on what W holds (see `koala_ds.runtime.wgrad`).

A deferred layer keeps its input and its output gradient alive from I until W. For a GPT layer
that is about 16 x hidden values per token against an activation (what the forward saves for
backward) of 16-20 x hidden: W would hold nearly as much as the forward did. The hold policy
bounds it: W may hold at most `max_hold` x the chunk's activation, and within that bound it
defers as much weight-gradient work as it can. The other covered layers compute their weight
gradient at once in I (as in a full backward): exact either way, only the split of time moves.

How: the first forward of a chunk run with autograd on is watched (`ForwardWatch`): the
storages autograd saves (parameters excluded: the chunk's activation, as the profiler counts
it) and, for every covered layer, the bytes its deferral would hold (its input's storage and
its output, the size of its output gradient) and its weight-gradient FLOPs. `choose_deferred`
then ranks the layers by held bytes per FLOP, (in + out) / (in x out) for a linear (for a GPT
layer: attention's output projection is the worst, then qkv, then the MLP's two), and takes
them best first while the estimate stays within the bound (a layer that does not fit is
skipped, a smaller one after it may still fit). Layers first seen in a later forward (another
chunk of a DeepSpeed module) are planned at that forward against its activation.
Nothing here imports torch: the watch gets tensors' sizes through the callers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)

#: The default bound: W holds at most this fraction of a chunk's activation (issue 13's target;
#: docs/split_backward.md explains the choice).
DEFAULT_MAX_HOLD = 0.75

#: `prepare(max_hold=DEFAULT)`: DEFAULT_MAX_HOLD on a model's first prepare, that call's value after.
DEFAULT = "default"


def check_max_hold(max_hold) -> Optional[float]:
    """The bound as a float (or None: defer every covered layer); a one-line error otherwise."""
    if max_hold is None:
        return None
    if isinstance(max_hold, bool) or not isinstance(max_hold, (int, float)) or not 0 <= max_hold < float("inf"):
        raise ValueError(f"koala wgrad: max_hold (koala_ds.runtime.wgrad.prepare) must be a finite number >= 0 "
                         f"(a fraction of the activation) or None (defer every layer), got {max_hold!r}")
    return float(max_hold)


@dataclass
class LayerCost:
    """What deferring one covered layer (one weight, every call in one forward) would cost."""

    key: int  # id() of the layer's weight: the plan is by weight
    order: int  # first seen at this call of the forward
    inputs: dict = field(default_factory=dict)  # storage key -> bytes of the inputs it would hold
    output_bytes: int = 0  # its output gradients (the size of its outputs)
    flops: float = 0.0  # weight-gradient FLOPs (2 x tokens x in x out per call)

    def held(self) -> int:
        return sum(self.inputs.values()) + self.output_bytes


def choose_deferred(layers: list[LayerCost], activation_bytes: int, max_hold: float) -> set[int]:
    """The keys of the layers to defer: best held-bytes-per-FLOP first, while the estimated
    hold (inputs shared between layers counted once) stays <= max_hold x activation_bytes."""
    budget = max_hold * activation_bytes
    ranked = sorted(layers, key=lambda c: (c.held() / c.flops if c.flops > 0 else float("inf"), c.order))
    held_inputs: dict = {}
    total, chosen = 0, set()
    for cost in ranked:
        extra = cost.output_bytes + sum(b for k, b in cost.inputs.items() if k not in held_inputs)
        if cost.flops <= 0 or total + extra > budget:
            continue
        total += extra
        held_inputs.update(cost.inputs)
        chosen.add(cost.key)
    return chosen


@dataclass
class Plan:
    """The outcome for one chunk: which weights an I step defers (ids), what was estimated."""

    deferred: set = field(default_factory=set)
    kept: set = field(default_factory=set)  # computed in I
    activation_bytes: int = 0  # summed over the forwards that planned
    held_bytes: int = 0  # the estimated W-hold of the deferred layers
    flops_deferred: float = 0.0
    flops_total: float = 0.0

    def add(self, layers: list[LayerCost], activation_bytes: int, max_hold: float) -> None:
        chosen = choose_deferred(layers, activation_bytes, max_hold)
        self.activation_bytes += activation_bytes
        held: dict = {}
        for cost in layers:
            self.flops_total += cost.flops
            if cost.key in chosen:
                self.deferred.add(cost.key)
                self.flops_deferred += cost.flops
                held.update(cost.inputs)
                self.held_bytes += cost.output_bytes
            else:
                self.kept.add(cost.key)
        self.held_bytes += sum(held.values())
        log.info("koala wgrad: %d of %d layers deferred to W (%.0f%% of the weight-gradient FLOPs); "
                 "estimated W-hold %.2f MiB <= %.2f x activation %.2f MiB", len(chosen), len(layers),
                 100 * self.deferred_fraction(), self.held_bytes / 2 ** 20, max_hold, self.activation_bytes / 2 ** 20)

    def deferred_fraction(self) -> float:
        return self.flops_deferred / self.flops_total if self.flops_total else 0.0


class ForwardWatch:
    """What one watched forward saw: saved storages (the activation) and the covered layers' costs."""

    def __init__(self, param_storages: set):
        self.param_storages = param_storages
        self.saved: dict = {}  # storage ptr -> bytes
        self.layers: dict = {}  # weight id -> LayerCost

    def saved_storage(self, ptr: int, nbytes: int) -> None:
        if ptr not in self.param_storages and nbytes > 0:
            self.saved[ptr] = max(self.saved.get(ptr, 0), nbytes)

    def layer_call(self, key: int, input_storage, input_bytes: int, output_bytes: int, flops: float) -> None:
        """One call of a covered layer; `input_storage` None when its held input is a fresh copy."""
        cost = self.layers.get(key)
        if cost is None:
            cost = self.layers[key] = LayerCost(key, len(self.layers))
        cost.inputs[input_storage if input_storage is not None else ("copy", key, len(cost.inputs))] = input_bytes
        cost.output_bytes += output_bytes
        cost.flops += flops

    def activation_bytes(self) -> int:
        return sum(self.saved.values())
