"""The performance model: cost profiles, the timed simulator and the makespan lower bound.

No torch here: the model runs and tests without any engine installed.
"""
from .lower_bound import LowerBound, backward_durations, lower_bound, lower_bound_for
from .profile import (CostProfile, ProfileError, StageCost, bundled_profiles, load_profile,
                      resolve_profile)
from .random_schedule import random_schedule
from .simulator import MODES, SimResult, Simulator, TimedAction, simulate, simulator_for, unit_profile

__all__ = [
    "CostProfile", "StageCost", "ProfileError", "load_profile", "resolve_profile", "bundled_profiles",
    "Simulator", "SimResult", "TimedAction", "simulate", "simulator_for", "unit_profile", "MODES",
    "LowerBound", "backward_durations", "lower_bound", "lower_bound_for", "random_schedule",
]
