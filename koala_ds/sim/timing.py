"""The lowered form with a profile's costs: the model's half of `koala_ds.core.lowered`.

The core lowers a configuration without any notion of cost (unit times: the validator's dry run);
the model gives every action its duration and memory delta from a cost profile, and every message
between ranks the profile's p2p latency. The simulator, the bound and the search build their
tables here.
"""
from __future__ import annotations

from ..core.ir import Placement, Schedule
from ..core.lowered import Lowered
from .profile import CostProfile


def costed(placement: Placement, m: int, backward: str = "full", profile: CostProfile | None = None) -> Lowered:
    """`Lowered` with the profile's stage costs and p2p latency (unit times without a profile)."""
    if profile is None:
        return Lowered(placement, m, backward)
    costs = profile.stage_costs(placement.num_stages, placement.pipelines, what=f"placement {placement.describe()}")
    return Lowered(placement, m, backward, costs, float(profile.p2p_latency))


def lower(schedule: Schedule, profile: CostProfile | None = None) -> tuple[Lowered, list[list[int]]]:
    """The costed lowered configuration of `schedule` and its orders as codes."""
    lowered = costed(schedule.placement, schedule.m, schedule.backward, profile)
    return lowered, lowered.encode(schedule.ranks)
