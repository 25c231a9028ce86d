"""koala_ds.runtime.turns: the schedules taking turns in one run (--alternate-schedules)."""
import math

import pytest

from koala_ds.runtime.turns import kept_periods, summary, turn_index, turn_medians


def test_turns_follow_the_order_given_block_iterations_each():
    assert [turn_index(i, 3, 2) for i in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]
    assert [turn_index(i, 2, 1) for i in range(4)] == [0, 1, 0, 1]


def test_an_iteration_counts_after_the_warmup_and_when_not_the_first_of_its_turn():
    names = ["a", "a", "b", "b", "a", "a", "b", "b"]
    periods = [float(i) for i in range(8)]
    assert kept_periods(periods, names, 2, 2) == {"a": [5.0], "b": [3.0, 7.0]}
    assert kept_periods(periods, ["a", "b"] * 4, 1, 1) == {"a": [2.0, 4.0, 6.0], "b": [1.0, 3.0, 5.0, 7.0]}


def test_settle_leaves_out_a_turns_first_iterations():
    names = ["a"] * 4 + ["b"] * 4 + ["a"] * 4
    periods = [float(i) for i in range(12)]
    assert kept_periods(periods, names, 0, 4, settle=2) == {"a": [2.0, 3.0, 10.0, 11.0], "b": [6.0, 7.0]}
    assert kept_periods(periods, names, 3, 4, settle=3) == {"a": [3.0, 11.0], "b": [7.0]}
    assert [(r.schedule, r.median_ms, r.kept) for r in turn_medians(periods, names, 0, 4, settle=2)] == [
        ("a", 6.5, 4), ("b", 6.5, 2)]
    assert summary(periods[:6], names[:6], 4, 4, settle=2).startswith(
        "schedules taking turns: no iteration counted (the first 4 and the first 2 of each turn of 4 are left out)")
    assert kept_periods(periods, names, 0, 1, settle=1) == kept_periods(periods, names, 0, 1, settle=3)  # turns of 1
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"--alternate-settle {bad} must be at least 1 and below --alternate-block 4"):
            kept_periods(periods, names, 0, 4, settle=bad)


def test_medians_and_speeds_against_the_first_schedule():
    names = ["1f1b", "1f1b", "zb", "zb"] * 3
    periods = [999.0, 100.0, 999.0, 80.0, 999.0, 110.0, 999.0, 90.0, 999.0, 120.0, 999.0, 70.0]
    rows = turn_medians(periods, names, 0, 2)
    assert [(r.schedule, r.median_ms, r.kept) for r in rows] == [("1f1b", 110.0, 3), ("zb", 80.0, 3)]
    assert rows[0].speed == 1.0 and math.isclose(rows[1].speed, 110 / 80)
    assert summary(periods, names, 0, 2) == ("schedules taking turns, median step period (iterations counted): "
                                             "1f1b 110.0 ms (3, 1.000x of 1f1b's speed), zb 80.0 ms (3, 1.375x "
                                             "of 1f1b's speed)")
    assert summary(periods[:2], names[:2], 4, 2).startswith("schedules taking turns: no iteration counted")
