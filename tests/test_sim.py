"""The timed simulator: hand-computed cases, known formulas, a brute-force reference, the CLI."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.cli import main
from koala_ds.core.ir import Action, Op, Placement, Schedule, ScheduleError
from koala_ds.sim import CostProfile, Simulator, StageCost, load_profile, random_schedule, simulate
from koala_ds.sim.profile import ProfileError
from koala_ds.core.validate import validate

A = Action.parse


def sched(placement: Placement, m: int, ranks: list[str], backward: str = "full", name: str = "hand") -> Schedule:
    v = placement.chunks_per_rank // placement.pipelines
    return Schedule(placement.p, m, v, placement, tuple(tuple(A(x) for x in r.split()) for r in ranks), backward, name)


def two_stage_profile(latency: float = 0.5) -> CostProfile:
    return CostProfile((StageCost(1.0, 1.5, 0.5, 10.0, 4.0), StageCost(2.0, 2.0, 1.0, 20.0, 5.0)), latency)


# -- hand-computed cases ------------------------------------------------------------------
def test_hand_computed_1f1b_two_stages_with_latency():
    s = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    r = simulate(s, two_stage_profile())
    # rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1.5,3.5] B0 [3.5,6.5] F1 [6.5,8.5] B1 [8.5,11.5];
    # rank 0: B0 waits for the gradient (6.5 + 0.5) [7,9], B1 waits for 11.5 + 0.5 [12,14].
    starts = {str(t.action): (t.rank, t.start, t.end) for t in r.timeline}
    assert starts == {"0F0": (0, 0, 1), "0F1": (0, 1, 2), "0B0": (0, 7, 9), "0B1": (0, 12, 14),
                      "1F0": (1, 1.5, 3.5), "1B0": (1, 3.5, 6.5), "1F1": (1, 6.5, 8.5), "1B1": (1, 8.5, 11.5)}
    assert r.makespan == 14
    assert r.busy == (6, 10) and r.idle == (8, 4)
    assert r.finish == (14, 11.5)
    assert r.bubble_ratio == pytest.approx(12 / 28)
    assert r.peak_memory_mb == (20, 20)  # rank 0 holds two stage-0 activations, rank 1 one of 20 MB
    # Rendezvous: rank 0 blocks sending 0F1 until rank 1 reaches 1F1, which comes after 1B0,
    # whose send waits for rank 0 to reach 0B0: the classic deadlock of blocking sends.
    with pytest.raises(ScheduleError, match=r"deadlock in rendezvous mode \(.*use async sends: --mode async, "
                                            r"mode=.async. in Python; or reorder\).*rank 0 is blocked sending "
                                            r"the output of 0F1"):
        simulate(s, two_stage_profile(), mode="rendezvous")


def test_hand_computed_rendezvous_delays_the_sender():
    s = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"])
    async_run = simulate(s, two_stage_profile())
    assert async_run.makespan == 14  # rank 1: F0 [1.5,3.5] F1 [3.5,5.5] B0 [5.5,8.5] B1 [8.5,11.5]
    r = simulate(s, two_stage_profile(), mode="rendezvous")
    # 0F0 ends at 1, rank 1 has posted its receive at 0: arrives 1.5, rank 0 free at 1.5.
    # 0F1 [1.5,2.5]; rank 1 posts 1F1's receive at 3.5 -> handshake 3.5, arrives 4, rank 0 free at 4.
    # 1F1 [4,6], 1B0 [6,9]; rank 0 posted 0B0 at 4 -> arrives 9.5 (rank 1 free at 9.5); 0B0 [9.5,11.5].
    # 1B1 [9.5,12.5]; rank 0 posts 0B1 at 11.5 -> arrives 13; 0B1 [13,15].
    starts = {str(t.action): (t.start, t.end) for t in r.timeline}
    assert starts == {"0F0": (0, 1), "0F1": (1.5, 2.5), "0B0": (9.5, 11.5), "0B1": (13, 15),
                      "1F0": (1.5, 3.5), "1F1": (4, 6), "1B0": (6, 9), "1B1": (9.5, 12.5)}
    assert r.makespan == 15 and r.finish == (15, 13)
    assert r.mode == "rendezvous"


def test_split_backward_costs_and_memory():
    s = sched(Placement.named("linear", 2), 1, ["0F0 0I0 0W0", "1F0 1I0 1W0"], "split")
    r = simulate(s, two_stage_profile(latency=0.0))
    # F chain 1 + 2, then 1I0 (2), 0I0 (1.5), 0W0 (0.5); 1W0 runs beside rank 0's work.
    assert r.makespan == 1 + 2 + 2 + 1.5 + 0.5
    assert {str(t.action): t.end for t in r.timeline}["1W0"] == 6
    assert r.peak_memory_mb == (10, 20)


def test_mixed_b_and_i_w_like_dualpipe():
    s = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0I1 0W1", "1F0 1I0 1F1 1B1 1W0"], "split")
    validate(s)
    r = simulate(s, two_stage_profile(latency=0.0))
    ends = {str(t.action): t.end for t in r.timeline}
    # rank 1: 1F0 [1,3] 1I0 [3,5] 1F1 [5,7] 1B1 [7,10] 1W0 [10,11]; rank 0: 0B0 [5,7] 0I1 [10,11.5] 0W1 [11.5,12]
    assert ends == {"0F0": 1, "0F1": 2, "0B0": 7, "0I1": 11.5, "0W1": 12,
                    "1F0": 3, "1I0": 5, "1F1": 7, "1B1": 10, "1W0": 11}
    # memory: rank 1 frees 20-5 at 1I0, allocates 20 at 1F1 -> 25 peak, before 1B1 and 1W0 free it all
    assert r.peak_memory_mb == (20, 25)


def measured_b_profile(latency: float = 0.5) -> CostProfile:
    """two_stage_profile with the profile's full backward B given: 1.2 (I + W = 2) and 2.5 (I + W = 3)."""
    a, b = two_stage_profile(latency).stages
    return CostProfile((dataclasses.replace(a, backward_full=1.2), dataclasses.replace(b, backward_full=2.5)), latency)


def test_hand_computed_1f1b_uses_the_profiles_full_backward():
    s = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    r = simulate(s, measured_b_profile())
    # rank 0: F0 [0,1] F1 [1,2]; rank 1: F0 [1.5,3.5] B0 [3.5,6] F1 [6,8] B1 [8,10.5];
    # rank 0: B0 waits for 6 + 0.5: [6.5,7.7]; B1 for 10.5 + 0.5: [11,12.2]
    assert {str(t.action): t.start for t in r.timeline} == pytest.approx(
        {"0F0": 0, "0F1": 1, "0B0": 6.5, "0B1": 11, "1F0": 1.5, "1B0": 3.5, "1F1": 6, "1B1": 8})
    assert {str(t.action): t.end for t in r.timeline} == pytest.approx(
        {"0F0": 1, "0F1": 2, "0B0": 7.7, "0B1": 12.2, "1F0": 3.5, "1B0": 6, "1F1": 8, "1B1": 10.5})
    assert r.makespan == pytest.approx(12.2)
    assert r.busy == pytest.approx((4.4, 9))
    # the same order with B = I + W (no field) is the 14 ms of the hand-computed case above
    assert simulate(s, two_stage_profile()).makespan == 14


def test_action_overhead_is_added_once_to_every_action():
    """`action_overhead` (the runtime's cost per action): F, I, W and B each get it once, a B
    without the profile's `backward` too (it is one action, not I and W)."""
    data = two_stage_profile().to_dict()
    data["stages"][1]["backward"] = 2.5
    base = CostProfile.from_dict(data)
    data["action_overhead"] = 0.25
    prof = CostProfile.from_dict(data)
    for a, b in zip(base.stages, prof.stages):
        assert (b.forward, b.backward_input, b.backward_weight, b.backward) == \
            (a.forward + 0.25, a.backward_input + 0.25, a.backward_weight + 0.25, a.backward + 0.25)
    assert prof.stages[0].backward == 1.5 + 0.5 + 0.25   # no `backward` in the file: I + W + one overhead
    s = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    assert simulate(s, prof).makespan > simulate(s, base).makespan
    assert CostProfile.from_dict(prof.to_dict()) == prof   # written back folded, read back the same
    data["action_overhead"] = -1
    with pytest.raises(ProfileError, match="action_overhead"):
        CostProfile.from_dict(data, source="p.json")


def test_split_actions_keep_i_and_w_when_b_is_given():
    split = sched(Placement.named("linear", 2), 1, ["0F0 0I0 0W0", "1F0 1I0 1W0"], "split")
    assert simulate(split, measured_b_profile(0.0)).makespan == simulate(split, two_stage_profile(0.0)).makespan == 7
    # a mixed order: B costs the profile's B, I and W their own
    mixed = sched(Placement.named("linear", 2), 2, ["0F0 0F1 0B0 0I1 0W1", "1F0 1I0 1F1 1B1 1W0"], "split")
    ends = {str(t.action): t.end for t in simulate(mixed, measured_b_profile(0.0)).timeline}
    # rank 1: 1F0 [1,3] 1I0 [3,5] 1F1 [5,7] 1B1 [7,9.5] 1W0 [9.5,10.5]; rank 0: 0B0 [5,6.2] 0I1 [9.5,11] 0W1 [11,11.5]
    assert ends == pytest.approx({"0F0": 1, "0F1": 2, "0B0": 6.2, "0I1": 11, "0W1": 11.5,
                                  "1F0": 3, "1I0": 5, "1F1": 7, "1B1": 9.5, "1W0": 10.5})


# -- known formulas -----------------------------------------------------------------------
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (4, 8), (4, 3), (8, 16), (3, 10)])
def test_1f1b_and_gpipe_unit_cost_makespan_and_bubble(p, m):
    unit = CostProfile.uniform(p)  # F = 1, B = I + W = 2, no latency
    for name in ("1f1b", "gpipe"):
        r = simulate(load_schedule(name, p, m), unit)
        assert r.makespan == (m + p - 1) * 3, name
        assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1)), name
        assert r.busy == (3 * m,) * p


@pytest.mark.parametrize("p, m", [(4, 8), (4, 4), (6, 7), (8, 3)])
def test_1f1b_memory_peak_is_p_minus_r_activations(p, m):
    profile = CostProfile.uniform(p, activation_mb=300.0, w_hold_mb=75.0, p2p_latency=0.1)
    r = simulate(load_schedule("1f1b", p, m), profile)
    assert r.peak_memory_mb == tuple(300.0 * min(p - rank, m) for rank in range(p))
    g = simulate(load_schedule("gpipe", p, m), profile)
    assert g.peak_memory_mb == (300.0 * m,) * p


def test_memory_limit_decides_fits():
    p, m = 4, 8
    schedule = load_schedule("1f1b", p, m)
    tight = CostProfile.uniform(p, activation_mb=100.0, memory_limit_mb=400.0)  # rank 0 needs exactly 4
    assert simulate(schedule, tight).fits_memory
    too_tight = CostProfile.uniform(p, activation_mb=100.0, memory_limit_mb=[399.0, 1000, 1000, 1000])
    r = simulate(schedule, too_tight)
    assert not r.fits_memory and r.memory_limit_mb == (399.0, 1000, 1000, 1000)
    per_rank = CostProfile.uniform(p, activation_mb=100.0, memory_limit_mb=[400.0, 300.0, 200.0, 100.0])
    assert simulate(schedule, per_rank).fits_memory


# -- errors -------------------------------------------------------------------------------
def test_deadlock_names_the_waiting_actions():
    s = sched(Placement.named("linear", 2), 2, ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"])
    with pytest.raises(ScheduleError) as info:
        simulate(s, two_stage_profile())
    text = str(info.value)
    assert "deadlock in async mode" in text
    assert "rank 0 waits at 0B0 for 1B0 (rank 1)" in text and "rank 1 waits at 1F1 for 0F1 (rank 0)" in text


@pytest.mark.parametrize("ranks, message", [
    (["0F0 0B0", "1F0"], "stage 1 microbatch 0 has no backward"),
    (["0F0 0B0 1F0 1B0", ""], "1F0 is on rank 0 but stage 1 lives on rank 1"),
    (["0B0 0F0", "1F0 1B0"], "0B0 runs before its forward 0F0 on rank 0"),
    (["0F0 0B0 0F0", "1F0 1B0"], "0F0 appears more than once"),
    (["0F0 0I0 0W0", "1F0 1B0"], "0I0: op I needs backward split"),
])
def test_invalid_schedules_are_rejected_clearly(ranks, message):
    s = sched(Placement.named("linear", 2), 1, ranks)
    with pytest.raises(ScheduleError, match=message):
        simulate(s, two_stage_profile())


def test_split_order_errors():
    s = sched(Placement.named("linear", 2), 1, ["0F0 0W0 0I0", "1F0 1B0"], "split")
    with pytest.raises(ScheduleError, match="0W0 runs before its input-gradient step 0I0"):
        simulate(s, two_stage_profile())
    s = sched(Placement.named("linear", 2), 1, ["0F0 0I0", "1F0 1B0"], "split")
    with pytest.raises(ScheduleError, match="needs one I and one W"):
        simulate(s, two_stage_profile())


def test_unknown_mode():
    s = load_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="unknown simulation mode 'eager'"):
        simulate(s, two_stage_profile(), mode="eager")


# -- the brute-force reference ------------------------------------------------------------
def reference(schedule: Schedule, profile: CostProfile, mode: str) -> tuple[dict, float, list[float]]:
    """Solve the model's equations by repeated sweeps over every action (no event queue).

    ready(a)   = release of the previous action on the rank (0 for the first)
    start(a)   = max(ready(a), arrival of each input)
    end(a)     = start(a) + cost(a)
    arrival    = end(d) [+ latency if d is on another rank]                 (async)
               = max(end(d), ready(a)) + latency if d is on another rank     (rendezvous)
    release(a) = end(a), or, in rendezvous mode with a consumer c on another rank,
                 max(end(a), ready(c)) + latency.
    Memory: the running sum of allocations along each rank's order."""
    pl = schedule.placement
    n_pipe = pl.stages_per_pipeline
    cost = [profile.stages[s % len(profile.stages)] for s in range(pl.num_stages)] \
        if len(profile.stages) != pl.num_stages else list(profile.stages)
    if len(profile.stages) != pl.num_stages:
        assert len(profile.stages) == n_pipe
    lat = profile.p2p_latency
    rank_of = {a: r for r, acts in enumerate(schedule.ranks) for a in acts}
    bwd = {(a.stage, a.microbatch): a for acts in schedule.ranks for a in acts if a.op in (Op.B, Op.I)}

    def inputs(a: Action) -> list[Action]:
        s, mb = a.stage, a.microbatch
        if a.op is Op.F:
            return [Action(Op.F, s - 1, mb)] if s % n_pipe else []
        if a.op is Op.W:
            return [Action(Op.I, s, mb)]
        out = [Action(Op.F, s, mb)]
        if (s + 1) % n_pipe:
            out.append(bwd[(s + 1, mb)])
        return out

    def consumer(a: Action) -> Action | None:
        s, mb = a.stage, a.microbatch
        if a.op is Op.F:
            return Action(Op.F, s + 1, mb) if (s + 1) % n_pipe else None
        if a.op in (Op.B, Op.I):
            return bwd[(s - 1, mb)] if s % n_pipe else None
        return None

    def duration(a: Action) -> float:
        c = cost[a.stage]
        b = c.backward_input + c.backward_weight if c.backward_full is None else c.backward_full
        return {Op.F: c.forward, Op.I: c.backward_input, Op.W: c.backward_weight, Op.B: b}[a.op]

    prev = {}
    for acts in schedule.ranks:
        for i, a in enumerate(acts):
            prev[a] = acts[i - 1] if i else None
    ready, end, release = {}, {}, {}
    everything = [a for acts in schedule.ranks for a in acts]
    while len(release) < len(everything):
        progress = False
        for a in everything:
            if a not in ready and (prev[a] is None or prev[a] in release):
                ready[a] = 0.0 if prev[a] is None else release[prev[a]]
                progress = True
            if a in ready and a not in end:
                ins = inputs(a)
                arrivals = []
                for d in ins:
                    if d not in end:
                        break
                    if rank_of[d] == rank_of[a]:
                        arrivals.append(end[d])
                    elif mode == "async":
                        arrivals.append(end[d] + lat)
                    else:
                        arrivals.append(max(end[d], ready[a]) + lat)
                else:
                    end[a] = max([ready[a]] + arrivals) + duration(a)
                    progress = True
            if a in end and a not in release:
                c = consumer(a)
                if mode == "async" or c is None or rank_of[c] == rank_of[a]:
                    release[a] = end[a]
                    progress = True
                elif c in ready:
                    release[a] = max(end[a], ready[c]) + lat
                    progress = True
        if not progress:
            raise ScheduleError("reference: deadlock")
    finish = [release[acts[-1]] if acts else 0.0 for acts in schedule.ranks]
    peaks = []
    for acts in schedule.ranks:
        held = peak = 0.0
        for a in acts:
            c = cost[a.stage]
            held += {Op.F: c.activation_mb, Op.B: -c.activation_mb, Op.I: -(c.activation_mb - c.w_hold_mb),
                     Op.W: -c.w_hold_mb}[a.op]
            peak = max(peak, held)
        peaks.append(peak)
    starts = {(rank_of[a], a): end[a] - duration(a) for a in everything}
    return starts, max(finish), peaks


positive = st.floats(0.0, 5.0, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def configurations(draw):
    style = draw(st.sampled_from(["linear", "interleaved", "vshape", "bidirectional"]))
    p = draw(st.integers(1, 4))
    v = 1 if style in ("linear", "bidirectional") else draw(st.integers(1, 3))
    placement = Placement.named(style, p, v)
    m = draw(st.integers(1, 6))
    backward = draw(st.sampled_from(["full", "split"]))
    n = placement.stages_per_pipeline if placement.pipelines > 1 and draw(st.booleans()) else placement.num_stages
    stages = []
    for _ in range(n):
        act = draw(positive) * 10
        stages.append(StageCost(draw(positive), draw(positive), draw(positive), act, draw(st.floats(0, 1)) * act,
                                draw(st.one_of(st.none(), positive))))  # a measured B (any value) or I + W
    profile = CostProfile(tuple(stages), draw(positive) / 5)
    seed = draw(st.integers(0, 2 ** 31))
    return random_schedule(placement, m, backward, seed=seed, split_probability=0.7), profile


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_agrees_with_the_reference_on_random_schedules(case):
    schedule, profile = case
    validate(schedule)
    for mode in ("async", "rendezvous"):
        try:
            ref_starts, ref_makespan, ref_peaks = reference(schedule, profile, mode)
        except ScheduleError:
            assert mode == "rendezvous", "random schedules never deadlock with non-blocking sends"
            with pytest.raises(ScheduleError, match="deadlock in rendezvous mode"):
                simulate(schedule, profile, mode=mode)
            continue
        r = simulate(schedule, profile, mode=mode)
        assert r.makespan == pytest.approx(ref_makespan, rel=1e-9, abs=1e-9)
        got = {(t.rank, t.action): t.start for t in r.timeline}
        assert got.keys() == ref_starts.keys()
        for key, start in ref_starts.items():
            assert got[key] == pytest.approx(start, rel=1e-9, abs=1e-9), key
        assert r.peak_memory_mb == pytest.approx(ref_peaks, rel=1e-9, abs=1e-9)
        sim = Simulator(profile, schedule.placement, schedule.m, schedule.backward)
        codes = sim.encode(schedule.ranks)
        assert sim.makespan(codes, mode=mode, check=False) == r.makespan
        assert sim.makespan(schedule.ranks, mode=mode) == r.makespan


def _library_cases():
    for name in library.names():
        for p, m, v in [(2, 3, 1), (4, 8, 1), (4, 6, 2), (3, 7, 2), (8, 16, 1), (4, 16, 2)]:
            if library.get(name).supports(p, m, v) is None:
                yield name, p, m, v


@pytest.mark.parametrize("name, p, m, v", list(_library_cases()))
def test_library_schedules_agree_with_the_reference(name, p, m, v):
    schedule = load_schedule(name, p, m, v)
    rng = random.Random(f"{name}-{p}-{m}-{v}")
    profile = CostProfile(tuple(StageCost(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 2),
                                          100.0, rng.uniform(0, 50)) for _ in range(schedule.num_stages)),
                          rng.uniform(0, 0.3))
    starts, makespan, peaks = reference(schedule, profile, "async")
    r = simulate(schedule, profile)
    assert r.makespan == pytest.approx(makespan, rel=1e-9)
    assert {(t.rank, t.action): t.start for t in r.timeline} == pytest.approx(starts, rel=1e-9, abs=1e-12)
    assert r.peak_memory_mb == pytest.approx(peaks)


def test_timeline_is_consistent_and_ranks_never_overlap():
    schedule = load_schedule("zb-h1", 4, 8)
    profile = load_profile("uniform-4")
    r = simulate(schedule, profile)
    assert len(r.timeline) == schedule.num_actions
    for rank in range(4):
        row = r.rank_timeline(rank)
        assert [t.action for t in row] == list(schedule.ranks[rank])
        assert all(a.end <= b.start + 1e-12 for a, b in zip(row, row[1:]))
        assert sum(t.end - t.start for t in row) == pytest.approx(r.busy[rank])
    assert r.makespan == max(t.end for t in r.timeline)
    assert simulate(schedule, profile, timeline=False).timeline is None


# -- CLI ----------------------------------------------------------------------------------
def test_cli_simulate_json_matches_the_library_call(capsys):
    assert main(["simulate", "zb-h1", "-m", "8", "--profile", "gpt-lmhead-8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = simulate(load_schedule("zb-h1", 8, 8), load_profile("gpt-lmhead-8"))
    assert out["p"] == 8 and out["makespan"] == expected.makespan
    assert out["peak_memory_mb"] == list(expected.peak_memory_mb) and out["fits_memory"] is True
    assert out["lower_bound"]["value"] <= out["makespan"] * (1 + 1e-9)


def test_cli_simulate_table_and_errors(capsys, tmp_path):
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8"]) == 0  # unit costs without --profile
    out = capsys.readouterr().out
    assert "makespan 33 ms" in out and "bubble 27.27%" in out
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--mode", "rendezvous"]) == 2
    assert "deadlock in rendezvous mode" in capsys.readouterr().err
    assert main(["simulate", "1f1b", "-p", "8", "-m", "8", "--profile", "uniform-4"]) == 2
    err = capsys.readouterr().err
    assert "uniform-4 has 4 stages but p x v = 8 x 1 = 8" in err and "change -p or -v" in err
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert main(["simulate", "1f1b", "-m", "8", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not a JSON file" in err


def test_cli_compare_lists_every_valid_library_schedule_sorted(capsys):
    assert main(["compare", "--profile", "gpt-lmhead-8", "-m", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [row["schedule"] for row in out["schedules"]]
    assert sorted(names) == sorted(n for n in library.names() if library.get(n).supports(8, 16, 1) is None)
    makespans = [row["makespan"] for row in out["schedules"]]
    assert makespans == sorted(makespans)
    base = next(row for row in out["schedules"] if row["schedule"] == "1f1b")
    for row in out["schedules"]:
        assert row["speedup"] == pytest.approx(base["makespan"] / row["makespan"])
        assert row["lower_bound"] <= row["makespan"] * (1 + 1e-9)
    assert main(["compare", "--profile", "gpt-lmhead-8", "-m", "16"]) == 0
    table = capsys.readouterr().out
    assert "vs 1f1b" in table and "1.000x" in table


def test_cli_compare_costs_b_with_the_measured_full_backward(capsys, tmp_path):
    """The H200 profile of issue 13 with its measured B: 1f1b beats every split schedule at m=32;
    with B = I + W (as the model assumed before) zb-h1 beats 1f1b."""
    from measured_profiles import h200_profile

    for backward, full_wins in (("measured", True), ("sum", False)):
        path = tmp_path / f"h200-{backward}.json"
        path.write_text(h200_profile(backward).to_json())
        assert main(["compare", "--profile", str(path), "-m", "32", "--json"]) == 0
        rows = {row["schedule"]: row for row in json.loads(capsys.readouterr().out)["schedules"]}
        one, zb = rows["1f1b"], rows["zb-h1"]
        assert (one["makespan"] < zb["makespan"]) == full_wins
        for row in rows.values():
            if row["placement"] != "bidirectional":  # the bound is for one copy of the weights
                assert row["lower_bound"] <= row["makespan"] * (1 + 1e-9)
        if full_wins:
            assert one["makespan"] / zb["makespan"] < 0.8  # about 0.76 on this profile
            assert main(["compare", "--profile", str(path), "-m", "32"]) == 0
            table = capsys.readouterr().out.splitlines()
            assert next(line for line in table if line.startswith("1f1b ")).split()[4] == "1.000x"
            assert float(next(line for line in table if line.startswith("zb-h1 ")).split()[4][:-1]) < 0.8
