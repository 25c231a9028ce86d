import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from koala_ds.dsl import KoalaCompileError, KoalaSyntaxError, parse_program, print_schedule
from koala_ds.ir import Placement
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
                  "?", "let", "=", "for", "in", "..", "if", "else", "min(", ",", "p", "m", "r", "1", "2", "-", "+",
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
