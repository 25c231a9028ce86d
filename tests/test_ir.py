import json
import random
import re

import pytest
from hypothesis import given, settings, strategies as st

from koala_ds.core.ir import Action, KoalaError, Op, Placement, Schedule, ScheduleError
from koala_ds.library import get
from koala_ds.resolve import load_schedule
from koala_ds.sim import random_schedule


def test_action_text_form():
    a = Action(Op.I, 3, 7)
    assert str(a) == "3I7"
    assert Action.parse("3I7") == a
    assert Action.parse(" 12W0 ") == Action(Op.W, 12, 0)
    for bad in ("3X7", "F3", "", "3I"):
        with pytest.raises(ScheduleError, match="bad action"):
            Action.parse(bad)


def test_action_is_frozen_and_typed():
    a = Action("F", 0, 1)
    assert a.op is Op.F
    with pytest.raises(Exception):
        a.stage = 2


def test_named_placements():
    assert Placement.named("linear", 4).stage_ranks == (0, 1, 2, 3)
    assert Placement.named("interleaved", 2, 3).stage_ranks == (0, 1, 0, 1, 0, 1)
    assert Placement.named("vshape", 4, 2).stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert Placement.named("wave", 2, 3).stage_ranks == (0, 1, 1, 0, 0, 1)
    bi = Placement.named("bidirectional", 3)
    assert bi.stage_ranks == (0, 1, 2, 2, 1, 0) and bi.pipelines == 2
    assert bi.next_stage(2) is None and bi.prev_stage(3) is None and bi.next_stage(3) == 4
    assert list(bi.microbatches_of(4, 5)) == [1, 3]
    v = Placement.named("vshape", 4, 2)
    assert v.stages_of(1) == (1, 6) and v.chunk_of(6) == 1


def test_explicit_placement_is_recognised_and_checked():
    assert Placement.explicit([0, 1, 1, 0]).style == "vshape"
    assert Placement.explicit([0, 2, 1]).style == "map"
    with pytest.raises(ScheduleError, match="different numbers of stages"):
        Placement.explicit([0, 0, 1])
    with pytest.raises(ScheduleError, match="must be 0..p-1"):
        Placement.explicit([0, 2])
    with pytest.raises(ScheduleError, match="linear needs v == 1"):
        Placement.named("linear", 2, 2)
    with pytest.raises(ScheduleError, match="unknown placement"):
        Placement.named("spiral", 2, 2)


CASES = [(name, p, m, v) for name in ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v", "looped-bfs"]
         for (p, m, v) in [(2, 4, 1), (4, 8, 1), (2, 4, 2), (3, 7, 2), (4, 8, 2)]
         if get(name).supports(p, m, v) is None]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_json_and_csv_round_trip_library(name, p, m, v):
    s = get(name).compile(p, m, v)
    assert Schedule.from_json(s.to_json()) == s.with_name(s.name)
    back = Schedule.from_torch_csv(s.to_torch_csv(), name=s.name)
    assert back.same_order(s)
    assert back.placement.style == s.placement.style


def test_csv_format_is_one_row_per_rank():
    s = get("1f1b").compile(2, 3)
    assert s.to_torch_csv().splitlines() == ["0F0,0F1,0B0,0F2,0B1,0B2", "1F0,1B0,1F1,1B1,1F2,1B2"]


def test_json_errors_name_the_source():
    with pytest.raises(ScheduleError, match=r"f\.json:1:1: not JSON"):
        Schedule.from_json("nope", "f.json")
    good = json.loads(get("1f1b").compile(2, 2).to_json())
    del good["ranks"]
    with pytest.raises(ScheduleError, match="f.json: missing field 'ranks'"):
        Schedule.from_json(json.dumps(good), "f.json")


def _mutated(change) -> str:
    data = json.loads(get("1f1b").compile(2, 2).to_json())
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.__setitem__("m", "2"), "f.json: field m must be an integer, got a string"),
    (lambda d: d.__setitem__("v", True), "f.json: field v must be an integer, got true/false"),
    (lambda d: d.__setitem__("p", 1e308), "f.json: field p must be an integer, got the number 1e\\+308"),
    (lambda d: d.__setitem__("placement", "linear"), "f.json: field placement must be an object, got a string"),
    (lambda d: d["placement"]["stage_ranks"].__setitem__(1, "1"),
     r"f.json: field placement.stage_ranks\[1\] must be an integer, got a string"),
    (lambda d: d.__setitem__("ranks", "abc"), "f.json: field ranks must be a list, got a string"),
    (lambda d: d["ranks"].__setitem__(0, "0F0"), r"f.json: field ranks\[0\] must be a list, got a string"),
    (lambda d: d["ranks"][1].__setitem__(3, 5), r"f.json: field ranks\[1\]\[3\] must be a string, got the number 5"),
    (lambda d: d["ranks"][1].__setitem__(2, "1X1"), r"f.json: ranks\[1\]\[2\]: bad action '1X1'"),
    (lambda d: d.__setitem__("backward", 3), "f.json: field backward must be a string"),
    (lambda d: d.__setitem__("v", 0), r"f.json: v=0 but the placement has 2 stages on p=2 ranks"),  # was accepted
    (lambda d: d.__setitem__("v", 2), r"f.json: v=2 but the placement has 2 stages on p=2 ranks"),
])
def test_json_of_the_wrong_type_names_the_field(change, message):
    """Wrong types used to surface as Python's own words ("list indices must be integers or
    slices, not str") or pass ("m": "2", "v": true)."""
    with pytest.raises(ScheduleError, match="^" + message) as info:
        Schedule.from_json(_mutated(change), "f.json")
    assert "\n" not in str(info.value)


def test_json_that_is_not_an_object_says_what_it_is():
    with pytest.raises(ScheduleError, match=r"^f\.json: schedule JSON must be an object .* got a list$"):
        Schedule.from_json("[1, 2, 3]", "f.json")


def test_csv_errors():
    with pytest.raises(ScheduleError, match="x.csv:2: bad action"):
        Schedule.from_torch_csv("0F0,0B0\n1F0,1Q0\n", source="x.csv")
    with pytest.raises(ScheduleError, match="stage 0 appears on ranks 0 and 1"):
        Schedule.from_torch_csv("0F0\n0B0\n", source="x.csv")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.integers(1, 4), m=st.integers(1, 6),
       layout=st.sampled_from([("linear", 1), ("interleaved", 2), ("vshape", 2), ("interleaved", 3)]),
       backward=st.sampled_from(["full", "split"]))
def test_random_schedules_survive_json_and_csv(seed, p, m, layout, backward):
    style, v = layout
    s = random_schedule(Placement.named(style, p, v), m, backward, seed=random.Random(seed), split_probability=0.8)
    assert Schedule.from_json(s.to_json()) == s
    back = Schedule.from_torch_csv(s.to_torch_csv(), name=s.name)
    if backward == "split" and not any(a.op in (Op.I, Op.W) for r in s.ranks for a in r):
        assert back.backward == "full"  # CSV cannot tell a split schedule that uses only B
    else:
        assert back.same_order(s)


def test_a_json_placement_style_must_name_its_stage_ranks_and_the_format_be_koalas(tmp_path):
    """A style contradicting stage_ranks was trusted ('ok ... placement=vshape' for an interleaved
    map, whose .koala export then deadlocked); 'format': 'other' was accepted."""
    data = get("interleaved-1f1b").compile(2, 4, 2).to_dict()
    for style in ("vshape", "weird"):
        bad = {**data, "placement": {**data["placement"], "style": style}}
        with pytest.raises(ScheduleError, match=rf"^x.json: placement.style '{style}' is not what "
                                                r"placement.stage_ranks are \(interleaved\): fix it or drop it$"):
            Schedule.from_dict(bad, "x.json")
    plain = {**data, "placement": {k: v for k, v in data["placement"].items() if k != "style"}}
    assert Schedule.from_dict(plain).placement.style == "interleaved"  # a map is named by what it is
    with pytest.raises(ScheduleError, match=r"^x.json: format 'other': a koala schedule has 'koala-schedule'"):
        Schedule.from_dict({**data, "format": "other"}, "x.json")
    with pytest.raises(ScheduleError, match=r"^x.json: version 2:"):
        Schedule.from_dict({**data, "version": 2}, "x.json")


@pytest.mark.parametrize("text, reason", [('{"m": ' + "7" * 5000 + "}", "Exceeds the limit (4300 digits)"),
                                          ("[" * 100000 + "]" * 100000, "nested too deeply to read")])
def test_json_python_will_not_read_is_one_error_naming_the_file(tmp_path, text, reason):
    """A 5000-digit integer was a ValueError traceback, 100000 nested arrays a RecursionError."""
    from koala_ds.sim import ProfileError
    from koala_ds.sim.profile import CostProfile

    with pytest.raises(ScheduleError, match=rf"^x.json: not JSON \({re.escape(reason)}"):
        Schedule.from_json(text, "x.json")
    with pytest.raises(ProfileError, match=rf"^p.json: not a JSON file \({re.escape(reason)}"):
        CostProfile.from_json(text, "p.json")
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(KoalaError, match=re.escape(reason)):
        load_schedule(str(path), 2, 2, 1)


def test_to_torch_csv_refuses_two_pipelines():
    """The CLI refused chimera as torch-csv; Schedule.to_torch_csv wrote it, and it read back as
    one pipeline with v=2 (another schedule)."""
    with pytest.raises(ScheduleError, match=r"chimera runs 2 pipelines .*CSV holds one"):
        get("chimera").compile(4, 8).to_torch_csv()
    one = get("zb-h1").compile(4, 8)
    assert Schedule.from_torch_csv(one.to_torch_csv()).same_order(one)


def test_a_placement_is_its_stage_ranks_and_a_style_must_name_them():
    """Placement((0, 1, 2, 3)) and the named linear one were unequal (so were their schedules, and
    a schedule and its JSON round trip); Placement(..., style="interleaved") on V-shape ranks was
    taken (validated 'ok', its JSON then refused)."""
    s = load_schedule("1f1b", 4, 8)
    plain = Schedule(4, 8, 1, Placement((0, 1, 2, 3)), s.ranks, "full", "1f1b")
    assert plain.placement == s.placement and plain == s and Schedule.from_json(plain.to_json()) == plain
    with pytest.raises(ScheduleError, match=r"style 'interleaved' does not give stage_ranks \[0, 1, 1, 0\]"):
        Placement((0, 1, 1, 0), 1, "interleaved")
    assert Placement.named("interleaved", 4, 1).style == "linear"  # one chunk: every style is linear
    assert Placement.named("vshape", 2, 2).stage_ranks == (0, 1, 1, 0)
