import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from koala_ds.dsl import KoalaCompileError, KoalaSyntaxError, parse_program, print_schedule, python_program
from koala_ds.dsl import program as program_mod
from koala_ds.core.ir import KoalaError, Placement
from koala_ds.sim import random_schedule

ONE_F_ONE_B = """\
schedule my-1f1b
description "test"
placement linear
backward full
rank:
  let k = min(p - r - 1, m)
  F * k
  (F B) * (m - k)
  B * k
"""


def ops(schedule, rank):
    return [str(a) for a in schedule.ranks[rank]]


def test_compiles_1f1b():
    s = parse_program(ONE_F_ONE_B, "t.koala").compile(3, 4)
    assert ops(s, 0) == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert ops(s, 2) == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]
    assert s.name == "my-1f1b" and s.backward == "full"


def test_programs_are_translated_once_not_on_every_compile(monkeypatch):
    prog = parse_program(ONE_F_ONE_B, "t.koala")
    before = prog.compile(4, 8)

    def translate(*args):
        raise AssertionError("the syntax tree was translated again")

    monkeypatch.setattr(program_mod, "expression", translate)
    monkeypatch.setattr(program_mod, "block", translate)
    assert prog.compile(4, 8).same_order(before) and prog.compile(3, 5).num_actions == 30


def test_chunks_explicit_microbatches_loops_and_conditions():
    text = """\
schedule t
placement vshape
backward split
rank 0:
  for c in 0..2:
    F[c] * m
  for j in 0..m:
    if j % 2 == 0: I[1]@(m - 1 - j)
    else: I[1]@(m - 1 - j)
  W * m
  (I W[0]) * m
rank:
  F * m
  F[1] * m
  (I[1] W[1]) * m
  (I W) * m
"""
    s = parse_program(text).compile(2, 3, 2)
    assert ops(s, 0)[:6] == ["0F0", "0F1", "0F2", "3F0", "3F1", "3F2"]
    assert ops(s, 0)[6:9] == ["3I2", "3I1", "3I0"]
    # bare W is first-in first-out over the rank's pending I's
    assert ops(s, 0)[9:12] == ["3W2", "3W1", "3W0"]
    assert ops(s, 0)[12:] == ["0I0", "0W0", "0I1", "0W1", "0I2", "0W2"]


def test_optional_ops_are_skipped_when_nothing_is_pending():
    text = "schedule t\nbackward split\nrank:\n  F W? I W? W? F? F?\n"
    s = parse_program(text).compile(1, 1)
    assert ops(s, 0) == ["0F0", "0I0", "0W0"]


def test_min_and_max_of_one_value_are_that_value():
    """`min(m)` parsed (the parser allows one argument) but compiling it raised a TypeError."""
    text = "schedule t\nrank:\n  F * min(m)\n  B * max(m, 1)\n  let k = min(max(m), 2 * m, m + 1)\n  F * (k - m)\n"
    s = parse_program(text, "t.koala").compile(2, 3)
    assert [a.op.value for a in s.ranks[0]] == ["F"] * 3 + ["B"] * 3


def test_global_lets_and_supports_message_names_parameters():
    text = "schedule t\nlet g = 2 * p\nsupports m >= g, v == 1\nrank:\n  F * m\n  B * m\n"
    prog = parse_program(text, "x.koala")
    assert prog.supports(2, 4, 1) is None
    reason = prog.supports(2, 3, 1)
    assert "needs m >= g" in reason and "x.koala:3" in reason and "got p=2, m=3, v=1" in reason
    with pytest.raises(KoalaCompileError, match="needs v == 1"):
        prog.compile(2, 4, 2)
    assert "m must be a positive integer" in prog.supports(2, 0, 1)


@pytest.mark.parametrize("text,line,col,expect", [
    ("schedule t\nrank:\n  F * (m +)\n", 3, 11, "a number, a name"),
    ("schedule t\nrank:\n  F X\n", 3, 5, "an op"),
    ("schedule t\nrank:\n  (F B * 2\n", 3, 11, "an op or ')'"),
    ("schedule t\nfrobnicate 3\nrank:\n  F\n", 2, 1, "one of: schedule"),
    ("schedule t\nbackward half\nrank:\n  F\n", 2, 10, "'full' or 'split'"),
    ("schedule t\nrank:\n  for k in 0 to 3: F\n", 3, 14, "'..'"),
    ("schedule t\nrank:\n  F * m / 2\n", 3, 9, "parentheses around a computed count"),
    ("schedule t\nrank:\n  let x = m / 2\n", 3, 13, "'//'"),
    ("rank:\n  F\n", 1, 1, "schedule my-schedule"),
    ("schedule t\nrank:\n  F\n    B\n", 4, 5, "same indentation"),
    ("schedule t\nrank:\n  F[1\n", 3, 6, "']'"),
    ("schedule t\nrank:\n  F * foo(2)\n", 3, 7, "one of min"),
    ("schedule t\nrank:\n  slot\n  F\n", 3, 7, "a slot number or expression"),
    ("schedule t\nrank:\n  slot 2 F\n", 3, 10, "end of line after the slot expression"),
    ("schedule t\nrank:\n  slot (r +\n", 3, 12, "a number, a name"),
    ("schedule t\nrank:\n  let slot = 2\n  F\n", 3, 7, "a variable name"),
    ("schedule t\ncompact tight\nrank:\n  F\n", 2, 9, "'greedy'"),
    ("schedule t\ncompact greedy\ncompact greedy\nrank:\n  F\n", 3, 1, ""),
])
def test_syntax_errors_carry_position_and_expectation(text, line, col, expect):
    with pytest.raises(KoalaSyntaxError) as info:
        parse_program(text, "f.koala")
    err = info.value
    assert (err.pos.file, err.pos.line, err.pos.col) == ("f.koala", line, col), str(err)
    assert expect in str(err)
    assert str(err).startswith(f"f.koala:{line}:{col}:")
    assert "^" in str(err)


def test_compile_errors_say_what_to_change():
    prog = parse_program("schedule t\nrank:\n  F * (p - m)\n  F * m\n  B * m\n", "c.koala")
    with pytest.raises(KoalaCompileError, match=r"c.koala:3:5: repetition count is -1 .*p=2, m=3"):
        prog.compile(2, 3)
    prog = parse_program("schedule t\nrank:\n  F * (m + 1)\n", "c.koala")
    with pytest.raises(KoalaCompileError, match="every microbatch of stage 0 already had its forward"):
        prog.compile(1, 2)
    prog = parse_program("schedule t\nrank:\n  F * m\n", "c.koala")
    with pytest.raises(KoalaCompileError, match="missing forward|needs one B"):
        prog.compile(1, 2)
    prog = parse_program("schedule t\nrank:\n  F[1]\n", "c.koala")
    with pytest.raises(KoalaCompileError, match="chunk 1 does not exist"):
        prog.compile(1, 1)


def test_invalid_order_shows_grid_with_marked_action():
    text = "schedule t\nrank:\n  B@0 F * m\n  B * (m - 1)\n"
    with pytest.raises(KoalaCompileError) as info:
        parse_program(text).compile(2, 2)
    assert ">0B0<" in str(info.value) and "rank 0" in str(info.value)


def test_deadlock_is_reported():
    # rank 1 waits for a forward rank 0 only runs after its backward, which needs rank 1
    text = "schedule t\nrank 0:\n  F B F B\nrank 1:\n  F F B B\n"
    with pytest.raises(KoalaCompileError, match="deadlock"):
        parse_program(text).compile(2, 2)


SLOTTED = """\
schedule blocks
placement vshape
backward split
supports v == 2
compact greedy
rank:
  for j in 0..m:
    slot r + 6 * j
    F[0]
    slot 2 * p - r - 1 + 6 * j
    F[1]
    slot 2 * p + r + 6 * j
    I[1]
    slot 4 * p - r - 1 + 6 * j
    I[0]
  W * (2 * m)
"""


def test_slots_without_compact_keep_the_emission_order():
    text = "schedule t\nbackward split\nrank:\n  slot 5\n  F\n  slot 1\n  I\n  W\n"
    s = parse_program(text).compile(1, 1)
    assert ops(s, 0) == ["0F0", "0I0", "0W0"]


def test_compact_greedy_orders_by_slot_and_places_weights():
    s = parse_program(SLOTTED, "s.koala").compile(2, 3, 2)
    # emitted per microbatch (F[0] F[1] I[1] I[0]), run in slot order: on rank 1 (stages 1
    # and 2) microbatch 0 takes slots 1, 2, 5, 6 and microbatch 1 starts at slot 7
    assert ops(s, 1)[:5] == ["1F0", "2F0", "2I0", "1I0", "1F1"]
    assert sum(a.op.value == "W" for a in s.ranks[0]) == 6
    # without `compact`, the slots are ignored: the emission order is kept
    plain = parse_program(SLOTTED.replace("compact greedy\n", "")).compile(2, 3, 2)
    assert ops(plain, 0)[:8] == ["0F0", "3F0", "3I0", "0I0", "0F1", "3F1", "3I1", "0I1"]
    assert not plain.same_order(s)


@pytest.mark.parametrize("change,args,expect", [
    (("placement vshape", "placement interleaved"), (2, 3, 2), "s.koala:5:1: compact greedy: it needs placement vshape"),
    (("backward split", "backward full"), (2, 3, 2), "s.koala:5:1: compact greedy: it needs backward split"),
    (("supports v == 2", "supports v >= 2"), (2, 3, 3), "s.koala:5:1: compact greedy: it needs v == 2, got p=2, m=3, v=3"),
    (("    slot r + 6 * j\n", ""), (2, 3, 2), "s.koala:5:1: compact greedy: F\\[0\\]@0 on rank 0 has no slot"),
    (("slot 2 * p + r + 6 * j", "slot r + 6 * j"), (2, 3, 2), "s.koala:5:1: compact greedy: rank 0 has two passes"),
])
def test_compact_greedy_elsewhere_is_a_clear_error(change, args, expect):
    prog = parse_program(SLOTTED.replace(*change), "s.koala")
    with pytest.raises(KoalaCompileError, match=expect):
        prog.compile(*args)


def test_compacted_schedules_round_trip_through_the_printer():
    s = parse_program(SLOTTED).compile(4, 5, 2)
    text = print_schedule(s)
    assert "slot " not in text and "compact" not in text
    assert parse_program(text).compile(4, 5, 2).same_order(s)


def test_python_builder_slots_and_compact():
    @python_program("slotted-py", placement="vshape", backward="split", compact="greedy")
    def slotted(b, p, m, v, r):
        for j in range(m):
            for op, chunk, t in (("F", 0, r), ("F", 1, 2 * p - r - 1), ("I", 1, 2 * p + r), ("I", 0, 4 * p - r - 1)):
                b.slot(t + 6 * j)
                getattr(b, op)(chunk=chunk)
        b.W(2 * m)

    assert slotted.compile(4, 5, 2).same_order(parse_program(SLOTTED).compile(4, 5, 2))
    with pytest.raises(KoalaError, match="the only mode is 'greedy'"):
        python_program("x", compact="tight")


def test_printer_normal_form_is_readable():
    schedule = parse_program(ONE_F_ONE_B).compile(4, 8)
    text = print_schedule(schedule)
    assert "supports p == 4, m == 8, v == 1" in text
    blocks = text.split("\n\n")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["rank 0:", "rank 1:", "rank 2:", "rank 3:"]
    # warm-up, steady state and drain: three run-length lines per rank at most
    assert all(len(b.strip().splitlines()) <= 4 for b in blocks), text
    assert "(F B) * 8" in blocks[3]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), p=st.integers(1, 4), m=st.integers(1, 6),
       layout=st.sampled_from([("linear", 1), ("interleaved", 2), ("vshape", 2), ("vshape", 3),
                               ("bidirectional", 1)]),
       backward=st.sampled_from(["full", "split"]))
def test_print_parse_round_trip_random_schedules(seed, p, m, layout, backward):
    style, v = layout
    s = random_schedule(Placement.named(style, p, v), m, backward, seed=random.Random(seed), split_probability=0.8)
    back = parse_program(print_schedule(s)).compile(s.p, s.m, s.v)
    assert back.same_order(s)


GRAMMAR_PIECES = ["schedule", "rank", "rank 0", ":", "\n", "  ", "F", "B", "I", "W", "[", "]", "(", ")", "*", "@",
                  "?", "let", "=", "slot", "compact greedy", "for", "in", "..", "if", "else", "min(", ",", "p", "m", "r", "1", "2", "-", "+",
                  "//", "%", "#", "\"", "placement", "map", "|", "supports", "==", "and", "not", "x", "\t", "é"]


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=80), st.lists(st.sampled_from(GRAMMAR_PIECES), max_size=40).map("".join)))
def test_parser_never_crashes_with_anything_but_syntax_errors(text):
    try:
        program = parse_program("schedule fuzz\n" + text)
    except KoalaSyntaxError:
        return
    try:
        program.compile(2, 2, 1)
    except KoalaCompileError:
        pass


@pytest.mark.parametrize("line, p, v, message", [
    ("placement map 0 0", 2, 1, "map.koala:2:11: placement map puts 2 stage(s) of a pipeline on rank 0, but v=1"),
    ("placement map 0 1 2", 2, 1, "map.koala:2:11: placement map names rank 2, but p=2 (ranks 0..1)"),
    ("placement map 0 1 | 1 1", 2, 1, "placement map puts 0 stage(s) of a pipeline on rank 0, but v=1"),
])
def test_a_placement_map_that_does_not_fit_p_and_v_names_its_line(tmp_path, line, p, v, message):
    """`placement map 0 0` at p=2 was an IndexError from deep in the placement (a traceback);
    `0 1 2` at p=2 said 'placement has 3 ranks but p=2' without the file or line."""
    path = tmp_path / "map.koala"
    path.write_text(f"schedule x\n{line}\nrank:\n F B\n")
    program = parse_program(path.read_text(), str(path))
    with pytest.raises(KoalaError) as exc:
        program.compile(p, 2, v)
    assert message in str(exc.value)


def test_a_number_too_large_is_a_syntax_error_and_a_long_line_is_shown_around_the_caret():
    """A 5000-digit count was Python's ValueError (int conversion limit); a product of large
    literals crashed the loop-limit message itself while printing the number."""
    with pytest.raises(KoalaSyntaxError) as exc:
        parse_program("schedule x\nrank:\n  F * " + "1" * 5000 + "\n", "big.koala")
    head, shown, caret = str(exc.value).splitlines()
    assert head == "big.koala:3:7: number too large (5000 digits); expected at most 18 digits"
    assert len(shown) < 140 and shown.endswith("...") and caret.index("^") == shown.index("1")
    far = "schedule x\nrank:\n  F * (" + "p + " * 60 + "$)\n"
    with pytest.raises(KoalaSyntaxError) as exc:
        parse_program(far, "far.koala")
    _, shown, caret = str(exc.value).splitlines()
    assert shown.startswith("    ...") and shown[caret.index("^")] == "$"
    huge = "schedule x\nlet a = 999999999999999999\nrank:\n  F * (" + "*".join(["a"] * 300) + ")\n  B\n"
    with pytest.raises(KoalaError, match=r"repetition '\* about 2\^\d+' of about 2\^\d+ passes goes over the limit"):
        parse_program(huge, "huge.koala").compile(1, 1, 1)


@pytest.mark.parametrize("mb", [False, True, 1.0])
def test_a_microbatch_that_is_not_an_integer_is_refused_and_leaves_other_schedules_alone(mb):
    """b.F(mb=False) compiled, and the action cache (keyed by value: False == 0) then handed '0FFalse'
    to every later schedule of the process, the library's included (their JSON no longer loaded);
    mb=1.0 was a TypeError, and every later 1f1b too."""
    from koala_ds.core.ir import Schedule
    from koala_ds.resolve import load_schedule

    @python_program(f"odd-{mb!r}")
    def odd(b, p, m, v, r):
        b.F(mb=mb)

    with pytest.raises(KoalaError, match="microbatch must be integers|expected an integer"):
        odd.compile(2, 4)
    s = load_schedule("1f1b", 2, 4)
    assert all(type(a.microbatch) is int for rank in s.ranks for a in rank)
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("p, m", [(True, 4), (2, True)])
def test_a_bool_is_not_a_size(p, m):
    """load_schedule("1f1b", True, 4) gave a schedule with p=True (its JSON then refused)."""
    from koala_ds.resolve import load_schedule

    with pytest.raises(KoalaError, match="must be a positive integer"):
        load_schedule("1f1b", p, m)


def test_action_refuses_what_is_not_an_action():
    from koala_ds.core.ir import Action, ScheduleError

    for args in (("X", 1, 2), ("F", "1", 2), ("F", 1, 2.0), ("F", True, 2)):
        with pytest.raises(ScheduleError):
            Action(*args)
    with pytest.raises(ScheduleError, match="bad action 5"):
        Action.parse(5)


def test_printing_an_action_of_a_stage_the_rank_does_not_hold_is_a_schedule_error():
    """print_schedule raised a bare IndexError where validate and simulate say ScheduleError."""
    from koala_ds.core.ir import Action, Op, Schedule, ScheduleError

    good = parse_program(ONE_F_ONE_B, "t.koala").compile(2, 2)
    ranks = (good.ranks[0] + (Action(Op.F, 5, 0),), good.ranks[1])
    bad = Schedule(good.p, good.m, good.v, good.placement, ranks, good.backward, "bad")
    with pytest.raises(ScheduleError, match=r"action 5F0 on rank 0 is not of a stage the placement"):
        print_schedule(bad)
