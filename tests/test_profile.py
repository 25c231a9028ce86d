"""Cost profiles: bundled examples, round trips, and clear errors for bad files."""
from __future__ import annotations

import json

import pytest

from koala_ds.core.ir import KoalaError, Placement
from koala_ds.sim import (CostProfile, ProfileError, StageCost, bundled_profiles, load_profile, random_schedule,
                          resolve_profile, simulate)


def good_profile(n: int = 4) -> dict:
    return {"version": 1,
            "stages": [{"forward": 1.0, "backward_input": 1.5, "backward_weight": 0.5, "activation_mb": 100,
                        "w_hold_mb": 25} for _ in range(n)],
            "p2p_latency": 0.1,
            "memory_limit_mb": 1000}


def write(tmp_path, data, name="prof.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def test_bundled_profiles_load_and_describe_their_shape():
    assert {"uniform-4", "gpt-lmhead-8", "gpt-chunks-8"} <= set(bundled_profiles())
    uniform = load_profile("uniform-4")
    assert uniform.num_stages == 4 and len({s for s in uniform.stages}) == 1
    lmhead = load_profile("gpt-lmhead-8.json")
    assert lmhead.num_stages == 8
    middle = lmhead.stages[3]
    # the LM head and loss make the last stage the heaviest
    assert lmhead.stages[-1].forward > middle.forward and lmhead.stages[-1].backward > middle.backward
    assert lmhead.memory_limit_for(0, 8) == lmhead.memory_limit_mb is not None
    assert load_profile("gpt-chunks-8").num_stages == 8


def test_round_trip_and_path_loading(tmp_path):
    data = good_profile()
    data["memory_limit_mb"] = [900, 1000, 1100, 1200]
    path = write(tmp_path, data)
    profile = load_profile(path)
    assert profile.source == path
    assert profile.stages[0] == StageCost(1.0, 1.5, 0.5, 100.0, 25.0)
    assert profile.stages[0].backward == 2.0
    assert profile.memory_limit_for(2, 4) == 1100
    assert CostProfile.from_dict(profile.to_dict(), "again") == CostProfile.from_dict(data, "again")
    assert CostProfile.from_json(profile.to_json()).to_dict() == profile.to_dict()


def test_uniform_profile_defaults_are_unit_costs():
    profile = CostProfile.uniform(3)
    assert profile.num_stages == 3
    assert (profile.stages[0].forward, profile.stages[0].backward_input, profile.stages[0].backward_weight) == (1, 1, 1)
    assert profile.p2p_latency == 0 and profile.memory_limit_mb is None
    with pytest.raises(ProfileError, match="num_stages"):
        CostProfile.uniform(0)
    with pytest.raises(ProfileError, match="forward.*negative"):
        CostProfile.uniform(2, forward=-1.0)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["stages"][2].pop("forward"), r"stages\[2\]: missing field 'forward'"),
    (lambda d: d.pop("p2p_latency"), r"missing field 'p2p_latency'"),
    (lambda d: d.pop("stages"), r"missing field 'stages'"),
    (lambda d: d["stages"][1].__setitem__("backward_input", -0.5),
     r"stages\[1\]\.backward_input: must not be negative"),
    (lambda d: d.__setitem__("p2p_latency", -1), r"p2p_latency: must not be negative"),
    (lambda d: d["stages"][0].__setitem__("forward", "fast"), r"stages\[0\]\.forward: expected a number"),
    (lambda d: d["stages"][0].__setitem__("forward", True), r"stages\[0\]\.forward: expected a number"),
    (lambda d: d["stages"][3].__setitem__("w_hold_mb", 500), r"stages\[3\]\.w_hold_mb: .*more than activation_mb"),
    (lambda d: d["stages"][0].__setitem__("backwards_input", 1), r"stages\[0\]: unknown field 'backwards_input'"),
    (lambda d: d.__setitem__("memory_limit", 5), r"unknown field 'memory_limit'"),
    (lambda d: d.__setitem__("memory_limit_mb", [100, -1]), r"memory_limit_mb\[1\]: must not be negative"),
    (lambda d: d.__setitem__("version", 2), r"field 'version' is 2"),
    (lambda d: d.__setitem__("stages", []), r"field 'stages' must be a non-empty list"),
    (lambda d: d["stages"][1].__setitem__("backward", -2.0), r"stages\[1\]\.backward: must not be negative"),
    (lambda d: d["stages"][2].__setitem__("backward", "fast"), r"stages\[2\]\.backward: expected a number"),
    (lambda d: d["stages"][2].__setitem__("backward", None), r"stages\[2\]\.backward: expected a number"),
    (lambda d: d["stages"][0].__setitem__("backward", False), r"stages\[0\]\.backward: expected a number"),
    (lambda d: d["stages"][3].__setitem__("backward", float("inf")), r"stages\[3\]\.backward: expected a finite"),
    (lambda d: d["stages"][3].__setitem__("backward", float("nan")), r"stages\[3\]\.backward: expected a finite"),
    (lambda d: d["stages"][0].__setitem__("backward_full", 1), r"stages\[0\]: unknown field 'backward_full'.*backward"),
])
def test_bad_fields_name_the_file_and_the_field(tmp_path, mutate, field):
    data = good_profile()
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ProfileError, match=field) as info:
        load_profile(path)
    assert str(info.value).startswith(path)
    assert isinstance(info.value, KoalaError)


def test_not_json_names_the_file_and_position(tmp_path):
    path = write(tmp_path, "{\"version\": 1,\n \"stages\": [oops]}")
    with pytest.raises(ProfileError, match=r"prof\.json:2:.*not a JSON file"):
        load_profile(path)
    path = write(tmp_path, "[1, 2]", "list.json")
    with pytest.raises(ProfileError, match=r"list\.json: a cost profile is a JSON object"):
        load_profile(path)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ProfileError, match=r"bin\.json: not a JSON file"):
        load_profile(str(binary))


def test_unknown_profile_lists_the_bundled_ones(tmp_path):
    with pytest.raises(ProfileError, match="not a bundled profile.*uniform-4"):
        resolve_profile("no-such-profile")
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(str(tmp_path / "missing.json"))


def test_wrong_stage_count_for_the_schedule_says_so(tmp_path):
    path = write(tmp_path, good_profile(4))
    schedule = random_schedule(Placement.named("interleaved", 4, 2), 4, seed=1)
    with pytest.raises(ProfileError) as info:
        simulate(schedule, load_profile(path))
    text = str(info.value)
    assert text.startswith(path) and "'stages' has 4 entries" in text and "8 virtual stages" in text


def test_per_rank_memory_limit_must_match_p(tmp_path):
    data = good_profile(4)
    data["memory_limit_mb"] = [1000, 1000]
    profile = load_profile(write(tmp_path, data))
    schedule = random_schedule(Placement.named("linear", 4), 2, seed=0)
    with pytest.raises(ProfileError, match="memory_limit_mb' lists 2 ranks but the schedule has p=4"):
        simulate(schedule, profile)


def test_bidirectional_placements_take_one_pipeline_or_every_stage():
    placement = Placement.named("bidirectional", 4)
    assert placement.pipelines == 2 and placement.num_stages == 8
    half = CostProfile.from_dict({**good_profile(4), "stages": [
        {"forward": 1.0 + s, "backward_input": 1.0, "backward_weight": 1.0, "activation_mb": 1, "w_hold_mb": 0}
        for s in range(4)]})
    full = CostProfile(half.stages * 2, half.p2p_latency, half.memory_limit_mb)
    assert half.stage_costs(8, 2) == full.stage_costs(8, 2) == full.stages
    schedule = random_schedule(placement, 6, seed=3)
    assert simulate(schedule, half).makespan == simulate(schedule, full).makespan
    with pytest.raises(ProfileError, match="4 \\(one pipeline\\) or 8"):
        CostProfile(half.stages[:3], 0.0).stage_costs(8, 2)


# -- the optional full-backward time -------------------------------------------------------
def test_full_backward_time_is_optional_and_kept_as_given(tmp_path):
    data = good_profile(4)
    data["stages"][1]["backward"] = 1.25       # less than I + W = 2: the measured B
    data["stages"][2]["backward"] = 3          # more than I + W: allowed too (no relation is imposed)
    data["stages"][3]["backward"] = 0.0
    profile = load_profile(write(tmp_path, data))
    assert [s.backward for s in profile.stages] == [2.0, 1.25, 3.0, 0.0]
    assert [s.backward_full for s in profile.stages] == [None, 1.25, 3.0, 0.0]
    assert all(s.split_backward == 2.0 for s in profile.stages)
    assert profile.stages[1] == StageCost(1.0, 1.5, 0.5, 100.0, 25.0, 1.25)
    # written only where given; the round trip keeps it
    out = profile.to_dict()
    assert "backward" not in out["stages"][0] and out["stages"][1]["backward"] == 1.25
    assert CostProfile.from_json(profile.to_json(), profile.source) == profile
    assert CostProfile.from_json(profile.to_json()).stages == profile.stages
    # a profile without it is written exactly as before
    plain = load_profile(write(tmp_path, good_profile(4), "plain.json"))
    assert all(set(st) == {"forward", "backward_input", "backward_weight", "activation_mb", "w_hold_mb"}
               for st in plain.to_dict()["stages"])


def test_uniform_and_bidirectional_profiles_carry_the_full_backward_time():
    profile = CostProfile.uniform(4, backward=1.5)
    assert all(s.backward == 1.5 and s.split_backward == 2.0 for s in profile.stages)
    assert CostProfile.uniform(4).stages[0].backward == 2.0
    with pytest.raises(ProfileError, match=r"stages\[0\]\.backward: must not be negative"):
        CostProfile.uniform(2, backward=-1.0)
    half = CostProfile(tuple(StageCost(1.0, 1.0, 1.0, 1.0, 0.0, 1.2 + s) for s in range(4)), 0.0)
    assert [c.backward for c in half.stage_costs(8, 2)] == [1.2, 2.2, 3.2, 4.2] * 2
