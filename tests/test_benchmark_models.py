"""benchmarks/engine_speedup.py chooses its schedules on the model of what each runtime runs."""
from __future__ import annotations

import sys
from pathlib import Path

from koala_ds.sim import CostProfile, StageCost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import engine_speedup as E  # noqa: E402


def _stages(*forwards: float) -> CostProfile:
    """Stages whose I = F, W = F / 2 and B = 1.5 F (full backward cheaper than I + W)."""
    return CostProfile(tuple(StageCost(f, f, f / 2, 1.0, 1.0, 1.5 * f) for f in forwards), 0.0, None, "test")


def test_each_v_is_modelled_by_its_own_profile_not_by_merging_the_finer_one():
    # DeepSpeed's uniform split of a 10-entry layer list: 5 + 5 on two stages, 3 + 3 + 2 + 2 on
    # four. Merged pairwise, the four-stage profile is 6 + 4: an unbalanced 1f1b.
    v1, v2 = _stages(9.0, 9.0), _stages(4.5, 6.5, 4.5, 2.5)
    assert [s.forward for s in E.variants(v2, 2)[1].stages] == [11.0, 7.0]  # what merging would model
    chosen, _ = E.candidates({1: v1, 2: v2}, 2, 8, budget=0.2)
    sched, model = chosen["1f1b"]
    assert sched.v == 1 and model is v1
    merged = E.predict(sched, E.variants(v2, 2)[1])
    assert E.predict(sched, model) < merged  # the balanced split the runtime runs is faster
    for label, (sched, model) in chosen.items():
        assert model is {1: v1, 2: v2}[sched.v], label


def test_the_search_and_the_prediction_charge_a_full_backward_one_overhead():
    """B is one action: with a per-action overhead it costs I + W + overhead, not I + W + 2 x
    overhead, also where the profile gives no B (the search's model once charged it twice)."""
    no_b = CostProfile(tuple(StageCost(2.0, 2.0, 1.0, 1.0, 1.0) for _ in range(2)), 0.0, None, "test")
    model = E.with_overhead(no_b, 0.5)
    assert all(s.backward == 2.0 + 1.0 + 0.5 and s.forward == 2.5 for s in model.stages)
    from koala_ds.resolve import load_schedule
    from koala_ds.sim import Simulator

    one = load_schedule("1f1b", 2, 4, 1)
    assert E.predict(one, no_b, 0.5) == Simulator(model, one.placement, 4, one.backward).makespan(one.ranks)


def test_the_verdict_also_averages_two_instances_of_each_schedule():
    def row(schedule, ms, pred=1.05):
        return {"engine": "deepspeed", "profile": "real-gpt", "p": 2, "schedule": schedule, "measured_ms": ms,
                "predicted_speedup_vs_1f1b": pred, "speedup_vs_1f1b": 100.0 / ms, "error": 0.0, "error_profile": 0.0,
                "overhead_ms": 0.5, "overhead_zero_ms": 0.5, "p2p_latency_ms": 0.2}
    rows = [row("1f1b", 100.0), row("searched (linear, split = zb-h1)", 98.0), row("1f1b again (control)", 104.0),
            row("searched again (second instance)", 93.0)]
    text = E.summary(rows)
    assert "two instances of each: 1.068x" in text   # (100 + 104) / 2 over (98 + 93) / 2
    assert text.count("searched measured") == 1      # the second instance is not a verdict of its own


def test_the_summary_floor_is_the_bare_stream_measured_in_the_run():
    """The floor line reports torch-bare (measured in the run), and each engine above it; it used
    to be 2 (p - 1) / p x a 2-process ping-pong's CPU per message, which torch-bare showed to be
    well under the real floor at p = 4."""
    def row(engine, p, cpu, **extra):
        return {"engine": engine, "profile": "x", "p": p, "schedule": "1f1b", "measured_ms": 100.0,
                "predicted_speedup_vs_1f1b": 1.0, "speedup_vs_1f1b": 1.0, "error": 0.0, "error_profile": 0.0,
                "overhead_ms": 0.5, "overhead_zero_ms": 0.5, "p2p_latency_ms": 0.2, "cpu_ms_per_action": cpu,
                "p2p_cpu_ms_per_message": 0.05, **extra}
    rows = [row("megatron", 4, 0.25, bare_cpu_ms_per_action=0.2), row("deepspeed", 4, 0.375, bare_cpu_ms_per_action=0.2)]
    text = E.summary(rows)
    floor = [line for line in text.splitlines() if line.startswith("floor of")]
    assert len(floor) == 1, text
    assert "torch-bare" in floor[0] and "p=4: 0.200 ms CPU per action" in floor[0], floor[0]
    assert "megatron p=4 +0.050 ms" in floor[0] and "deepspeed p=4 +0.175 ms" in floor[0], floor[0]
    # rows written before the floor was measured: no floor line rather than an estimate
    assert "floor of" not in E.summary([row("megatron", 4, 0.25)])
