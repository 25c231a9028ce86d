"""The lower bound: no schedule beats it (random profiles, random and library schedules), and
it is tight where theory says it must be."""
from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.core.ir import KoalaError, Placement, ScheduleError
from koala_ds.sim import CostProfile, StageCost, lower_bound, lower_bound_for, random_schedule, simulate

TOL = 1e-9  # floating-point rounding: the bound and the makespan add the same numbers in different orders

time_ = st.floats(0.0, 4.0, allow_nan=False).map(lambda x: round(x, 3))
# Strategies are built once here, not inside the composites on every example: Hypothesis
# validates and labels each new strategy object, which cost more than the test's own work.
_activation = st.floats(0.0, 100.0, allow_nan=False)
_fraction = st.floats(0.0, 1.0)
# the profile's full backward B: absent (I + W), or measured: an absolute time, or a factor of I + W
_styles = st.sampled_from(["linear", "interleaved", "vshape", "bidirectional"])
_full_backward = st.one_of(st.none(), time_.map(lambda t: (t, None)), st.floats(0.3, 1.3).map(lambda f: (None, f)))


@st.composite
def _profiles(draw, n: int):
    stages = []
    for _ in range(n):
        act = draw(_activation)
        i, w = draw(time_), draw(time_)
        # B absent, or measured: below I, between, above I + W
        b = draw(_full_backward)
        if b is not None:
            b = b[0] if b[1] is None else round(b[1] * (i + w), 3)
        stages.append(StageCost(draw(time_), i, w, act, act * draw(_fraction), b))
    # step_overhead (ms per step, after every rank's pipeline work): 0 or a time; and for some
    # placements their own (below or above it), which the bound must take as the simulator does
    own = draw(st.dictionaries(_styles, time_, max_size=3))
    return CostProfile(tuple(stages), draw(time_) / 4, step_overhead=draw(st.one_of(st.just(0.0), time_)),
                       step_overhead_by_placement=tuple(own.items()))


profiles = functools.lru_cache(maxsize=None)(_profiles)  # one strategy object per n


def assert_not_beaten(schedule, profile, memory_limit=None):
    bound = lower_bound_for(schedule, profile, memory_limit)
    assert bound.feasible
    for mode in ("async", "rendezvous"):
        try:
            r = simulate(schedule, profile, mode=mode, timeline=False)
        except ScheduleError:
            assert mode == "rendezvous"
            continue
        assert bound.value <= r.makespan * (1 + TOL) + TOL, (schedule.name, mode, bound, r.makespan)
        assert max(bound.work) <= r.makespan * (1 + TOL) + TOL
    return bound


_backwards = st.sampled_from(["full", "split"])
_split_probabilities = st.sampled_from([0.0, 0.5, 1.0])
_seeds = st.integers(0, 2 ** 31)


@st.composite
def random_cases(draw):
    style = draw(_styles)
    p = draw(st.integers(1, 4))
    v = 1 if style in ("linear", "bidirectional") else draw(st.integers(1, 3))
    placement = Placement.named(style, p, v)
    m = draw(st.integers(1, 7))
    backward = draw(_backwards)
    schedule = random_schedule(placement, m, backward, seed=draw(_seeds), split_probability=draw(_split_probabilities))
    return schedule, draw(profiles(placement.num_stages))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases())
def test_no_random_schedule_beats_the_bound(case):
    schedule, profile = case
    assert_not_beaten(schedule, profile)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases(), st.floats(1.0, 1.5))
def test_memory_term_holds_for_schedules_that_fit(case, slack):
    """Give each schedule a limit just above its own peak: the bound with the memory term
    must still not exceed its makespan (it fits that limit)."""
    schedule, profile = case
    peaks = simulate(schedule, profile, timeline=False).peak_memory_mb
    limit = [peak * slack for peak in peaks]
    bound = assert_not_beaten(schedule, profile, limit)
    assert bound.memory is not None and len(bound.memory) == schedule.p


@functools.lru_cache(maxsize=None)
def library_schedules() -> list:
    out = []
    for name in library.names():
        for p, m, v in [(1, 3, 1), (2, 2, 1), (2, 5, 1), (4, 4, 1), (4, 9, 1), (3, 6, 2), (4, 8, 2), (2, 6, 2)]:
            if library.get(name).supports(p, m, v) is None:
                try:
                    out.append(load_schedule(name, p, m, v))
                except KoalaError:  # a library bug; the library's own tests report it
                    continue
    return out


def test_every_library_schedule_is_in_the_property_test():
    names = {s.name for s in library_schedules()}
    assert names == set(library.names()), "a library schedule is never checked against the bound"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_library_schedule_beats_the_bound(data):
    schedule = data.draw(st.sampled_from(library_schedules()))
    n = schedule.placement.stages_per_pipeline if schedule.placement.pipelines > 1 else schedule.num_stages
    profile = data.draw(profiles(n))
    assert_not_beaten(schedule, profile)
    peaks = simulate(schedule, profile, timeline=False).peak_memory_mb
    assert_not_beaten(schedule, profile, list(peaks))


# -- tightness: the bound equals the optimum where the optimum is known --------------------
@pytest.mark.parametrize("p, m, lat", [(4, 8, 0.0), (4, 8, 0.3), (3, 2, 0.1), (6, 12, 0.05), (5, 3, 0.0)])
def test_1f1b_fill_drain_bound_with_full_backward_and_uniform_costs(p, m, lat):
    profile = CostProfile.uniform(p, forward=1.0, backward_input=1.2, backward_weight=0.8, p2p_latency=lat)
    schedule = load_schedule("1f1b", p, m)
    bound = lower_bound_for(schedule, profile)
    # The last rank starts after the fill (p-1 forwards and hops), works m (F + B), and its
    # last B must flow back down: (m + p - 1) (F + B) plus one latency each way per hop.
    assert bound.value == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * lat)
    assert bound.binding == "fill_drain"
    makespan = simulate(schedule, profile).makespan
    if lat == 0:
        assert makespan == pytest.approx(bound.value)  # 1F1B is optimal here
    else:
        assert makespan >= bound.value * (1 - TOL)  # with m >= p, 1F1B waits for latencies in its steady state


def test_split_backward_bound_is_below_the_full_one():
    profile = CostProfile.uniform(4, p2p_latency=0.1)
    full = lower_bound(profile, 4, 8, 1, "linear", "full")
    split = lower_bound(profile, 4, 8, 1, "linear", "split")
    assert split.value < full.value
    # with split backward the last rank can start at the end of the fill and never stop
    assert split.value == pytest.approx(3 * (1 + 0.1) + 8 * 3)


def test_memory_for_one_activation_forces_one_microbatch_at_a_time():
    p, m = 4, 5
    profile = CostProfile.uniform(p, activation_mb=100.0, p2p_latency=0.2)
    schedule = load_schedule("1f1b", p, m)
    no_limit = lower_bound_for(schedule, profile)
    one = lower_bound_for(schedule, profile, memory_limit=100.0)
    round_trip = p * 1.0 + p * 2.0 + 2 * (p - 1) * 0.2
    assert one.binding == "memory" and one.value == pytest.approx(m * round_trip)
    assert one.value > no_limit.value
    # one microbatch at a time through the whole pipeline reaches it exactly
    serial = random_schedule(Placement.named("linear", p), 1, seed=0)
    assert simulate(serial, profile).makespan == pytest.approx(round_trip)


def test_an_activation_larger_than_the_limit_is_infeasible():
    profile = CostProfile.uniform(2, activation_mb=100.0)
    bound = lower_bound(profile, 2, 4, 1, "linear", "full", memory_limit=[1000.0, 99.0])
    assert not bound.feasible and math.isinf(bound.value)
    assert "rank 1" in bound.reason and "stage 1" in bound.reason


def test_bad_arguments():
    profile = CostProfile.uniform(4)
    with pytest.raises(ScheduleError, match="placement has 4 ranks but p=2"):
        lower_bound(profile, 2, 4, 1, Placement.named("linear", 4))
    with pytest.raises(Exception, match="'stages' has 4 entries"):
        lower_bound(profile, 4, 4, 2, "interleaved")
    with pytest.raises(ScheduleError, match="backward must be"):
        lower_bound(profile, 4, 4, 1, "linear", "half")


# -- the profile's full backward B (issue 13): B < I, I < B < I + W, B > I + W ---------------
@pytest.mark.parametrize("b", [0.6, 1.5, 2.0, 2.6])
@pytest.mark.parametrize("p, m, lat", [(4, 8, 0.0), (3, 5, 0.2)])
def test_1f1b_bound_uses_the_profiles_full_backward(p, m, lat, b):
    profile = CostProfile.uniform(p, forward=1.0, backward_input=1.2, backward_weight=0.8, p2p_latency=lat, backward=b)
    schedule = load_schedule("1f1b", p, m)
    bound = lower_bound_for(schedule, profile)
    assert bound.value == pytest.approx((m + p - 1) * (1.0 + b) + 2 * (p - 1) * lat)
    makespan = simulate(schedule, profile).makespan
    assert makespan >= bound.value * (1 - TOL)
    if lat == 0:
        assert makespan == pytest.approx(bound.value)


@pytest.mark.parametrize("factor", [0.4, 0.7, 1.0, 1.4])  # B = factor * (I + W), so B < I at 0.4
@pytest.mark.parametrize("style, p, v", [("linear", 4, 1), ("vshape", 3, 2), ("interleaved", 2, 2),
                                         ("bidirectional", 2, 1)])
def test_no_schedule_beats_the_bound_with_a_measured_full_backward(factor, style, p, v):
    """Full, split and mixed random schedules, and the library's, on profiles whose B differs from
    I + W per stage; with a memory limit at each schedule's own peak too."""
    import random

    placement = Placement.named(style, p, v)
    rng = random.Random(f"{factor}-{style}")
    stages = []
    for _ in range(placement.num_stages):
        i, w = rng.uniform(0.5, 2), rng.uniform(0.2, 2)
        stages.append(StageCost(rng.uniform(0.5, 2), i, w, 100.0, rng.uniform(0, 60),
                                round(factor * (i + w) * rng.uniform(0.9, 1.1), 3)))
    profile = CostProfile(tuple(stages), 0.1)
    m = 5
    schedules = [random_schedule(placement, m, backward, seed=k, split_probability=prob)
                 for k in range(12) for backward, prob in (("full", 1.0), ("split", 1.0), ("split", 0.5))]
    schedules += [s for s in library_schedules() if s.placement.stage_ranks == placement.stage_ranks
                  and s.placement.pipelines == placement.pipelines]
    for schedule in schedules:
        assert_not_beaten(schedule, profile)
        assert_not_beaten(schedule, profile, list(simulate(schedule, profile, timeline=False).peak_memory_mb))


def test_split_bound_counts_a_full_backward_where_it_is_cheaper():
    """A split schedule may run B where B < I + W: its bound must allow that (and 1f1b, written as a
    full schedule, is also a split-configuration schedule)."""
    profile = CostProfile.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0, backward=1.1)
    one = load_schedule("1f1b", 4, 8)
    makespan = simulate(one, profile).makespan
    assert makespan == pytest.approx(11 * 2.1)
    split = lower_bound(profile, 4, 8, 1, "linear", "split")
    assert split.value <= makespan * (1 + TOL)
    assert split.work[0] == pytest.approx(8 * 2.1)  # each microbatch's backward costs at least min(B, I + W)
