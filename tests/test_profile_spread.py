"""The profile's measured spread and the profiler's interleaved measurement (issue 39, item 5).

- the optional per-stage `spread` loads, validates (one line naming the file and the field),
  round-trips, and old profiles load without it (docs/profiling.md, the profile format);
- the profiler writes it (the interquartile range of each time field's samples over the value);
- the profiler times the stages and the two backward kinds in turn (`measurement_plan`), checked
  on what actually ran, not on any timing;
- `koala search` treats a predicted gain within the profile's spread on the makespans as none
  (docs/search.md, "Keeping the known schedule"); without a spread, as before.
"""
from __future__ import annotations

import json

import pytest

from koala_ds.cli import main
from koala_ds.sim import CostProfile, ProfileError, load_profile, simulate
from koala_ds.sim.profile import StageSpread


def profile_dict(n: int = 2, spread: dict | None = None, backward: float | None = 1.6) -> dict:
    stage = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.8, "activation_mb": 10.0, "w_hold_mb": 3.0}
    if backward is not None:
        stage["backward"] = backward
    if spread is not None:
        stage["spread"] = spread
    return {"version": 1, "stages": [dict(stage) for _ in range(n)], "p2p_latency": 0.0}


def write(tmp_path, data, name="prof.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# -- the format ----------------------------------------------------------------------------------
def test_spread_loads_in_ms_round_trips_and_old_profiles_have_none(tmp_path):
    data = profile_dict(spread={"forward": 0.1, "backward_input": 0.05, "backward": 0.2})
    data["action_overhead"] = 0.5   # added to the times on loading; the spread is of the times as written
    prof = load_profile(write(tmp_path, data))
    assert prof.spread == (StageSpread(forward=0.1, backward_input=0.05, backward_weight=0.0,
                                       backward=pytest.approx(0.32)),) * 2
    again = CostProfile.from_json(prof.to_json(), prof.source)
    assert again.stages == prof.stages
    for a, b in zip(again.spread, prof.spread):
        assert a.forward == pytest.approx(b.forward) and a.backward == pytest.approx(b.backward)
    old = load_profile(write(tmp_path, profile_dict(), "old.json"))
    assert old.spread is None and old.quartile_profiles() is None
    assert all("spread" not in st for st in old.to_dict()["stages"])  # written exactly as before


def test_quartile_profiles_move_each_time_by_half_its_spread():
    prof = CostProfile.from_dict(profile_dict(1, spread={"forward": 0.2, "backward_weight": 0.5, "backward": 0.1}))
    low, high = prof.quartile_profiles()
    assert (low.stages[0].forward, high.stages[0].forward) == pytest.approx((0.9, 1.1))
    assert (low.stages[0].backward_weight, high.stages[0].backward_weight) == pytest.approx((0.6, 1.0))
    assert (low.stages[0].backward, high.stages[0].backward) == pytest.approx((1.52, 1.68))
    assert low.stages[0].backward_input == high.stages[0].backward_input == 1.0  # no spread given: none
    assert low.spread is None and low.memory_limit_mb == prof.memory_limit_mb
    # without the stage's `backward`, B = I + W follows I's and W's quartiles
    no_b = CostProfile.from_dict(profile_dict(1, spread={"backward_weight": 0.5}, backward=None))
    assert [q.stages[0].backward for q in no_b.quartile_profiles()] == pytest.approx([1.6, 2.0])


@pytest.mark.parametrize("spread, backward, says", [
    ({"forward": -0.1}, 1.6, r"stages\[0\]\.spread\.forward: must not be negative"),
    ({"forward": "wide"}, 1.6, r"stages\[0\]\.spread\.forward: expected a number"),
    ({"forward": float("nan")}, 1.6, r"stages\[0\]\.spread\.forward: expected a finite number"),
    ({"activation_mb": 0.1}, 1.6, r"stages\[0\]\.spread: unknown field 'activation_mb'"),
    ([0.1, 0.2], 1.6, r"stages\[0\]\.spread: expected an object .* got list"),
    ({"backward": 0.1}, None, r"stages\[0\]\.spread\.backward: the stage gives no 'backward'"),
])
def test_a_bad_spread_is_one_line_naming_the_file_and_field(tmp_path, spread, backward, says):
    path = write(tmp_path, profile_dict(spread=spread, backward=backward))
    with pytest.raises(ProfileError, match=says) as info:
        load_profile(path)
    assert str(info.value).startswith(path) and "\n" not in str(info.value)


# -- the profiler writes it -------------------------------------------------------------------------
torch_needed = pytest.mark.usefixtures("one_torch_thread")


def test_spread_is_how_precisely_the_median_is_known():
    """The samples' interquartile range x sqrt(pi / 2) / sqrt(n), over the value: the first
    version wrote one sample's spread (IQR / median), which on the calibrated profiles of
    benchmarks/fidelity.py kept 1f1b where zb-h1 ran 6-10% faster."""
    import math

    from koala_ds.profiler.core import SPREAD_MIN_SAMPLES, StageMeasurement

    def precision(iqr, n, value):
        return round(math.sqrt(math.pi / 2) * iqr / math.sqrt(n) / value, 4)

    m = StageMeasurement(forward=[1.0, 2.0, 3.0, 4.0, 5.0], backward_input=[2.0] * 5, backward_weight=[1.0] * 5)
    assert m.spread() == {"forward": precision(2, 5, 3), "backward_input": 0.0, "backward_weight": 0.0}
    # four times the samples: half the spread
    m4 = StageMeasurement(forward=[1.0, 2.0, 3.0, 4.0, 5.0] * 4, backward_input=[2.0] * 20, backward_weight=[1.0] * 20)
    assert m4.spread()["forward"] == pytest.approx(m.spread()["forward"] / 2, abs=2e-4) and \
        m4.spread()["forward"] < (4 - 2) / 3 / 3  # well under one sample's IQR / median
    # F is the plain forward; I carries, round by round, what the deferrable forward took more
    m = StageMeasurement(forward=[2.0] * 5, forward_full=[1.0] * 5, backward_input=[1.0, 2.0, 3.0, 4.0, 5.0],
                         backward_weight=[1.0] * 5, backward_full=[2.0, 2.0, 4.0, 6.0, 6.0])
    assert m.costs() == (1.0, 4.0, 1.0, 4.0)
    assert m.spread() == {"forward": 0.0, "backward_input": precision(2, 5, 4), "backward_weight": 0.0,
                          "backward": precision(4, 5, 4)}
    few = SPREAD_MIN_SAMPLES - 1
    assert StageMeasurement(forward=[1.0] * few, backward_input=[1.0] * few, backward_weight=[1.0] * few
                            ).spread() is None


@torch_needed
def test_the_profiler_writes_a_spread_that_loads(tmp_path):
    torch = pytest.importorskip("torch")
    from koala_ds.profiler.core import profile_stages

    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)]
    data = profile_stages(stages, torch.randn(4, 8), warmup=0, iters=5).to_dict()
    for st in data["stages"]:
        assert set(st["spread"]) == {"forward", "backward_input", "backward_weight", "backward"}
        assert all(v >= 0 for v in st["spread"].values())
    assert "interquartile" in data["meta"]["statistic"]
    prof = CostProfile.from_dict(data, "<profiled>")
    assert prof.spread is not None and len(prof.spread) == 2
    few = profile_stages(stages, torch.randn(4, 8), warmup=0, iters=3).to_dict()
    assert all("spread" not in st for st in few["stages"])


@torch_needed
def test_a_per_layer_profile_keeps_the_spread_in_meta_and_loads(tmp_path):
    torch = pytest.importorskip("torch")
    from koala_ds.profiler.layers import LayerInfo, profile_layers
    from koala_ds.sim.layers import load_layer_profile

    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    infos = [LayerInfo("embedding", "embedding"), LayerInfo("layer.0", "transformer"), LayerInfo("output", "output")]
    result = profile_layers(layers, infos, torch.randn(4, 8), warmup=0, iters=5)
    data = result.to_dict()
    assert all("spread" not in layer for layer in data["layers"])   # not a field of the per-layer format
    assert all(set(m["spread"]) >= {"forward", "backward_weight"} for m in data["meta"]["layers"])
    result.write(tmp_path / "layers.json")
    assert load_layer_profile(str(tmp_path / "layers.json")).num_layers == 3


# -- the CPU's clock --------------------------------------------------------------------------------
@torch_needed
def test_the_cpu_clock_counts_the_threads_cpu_time_only_with_one_thread():
    """With one torch thread a CPU profile takes the thread's CPU time: what a step waits off the
    CPU (here a sleep; on a busy machine, descheduled) does not count. Sleeping stages take the
    wall clock (a sleep never ends early)."""
    torch = pytest.importorskip("torch")
    from koala_ds.profiler.core import TIMERS, measure_stage, profile_stages, resolve_clock
    from koala_ds.profiler.emulate import EmulatedStage

    assert (resolve_clock(None), resolve_clock("cpu", "wall"), resolve_clock("cuda"), resolve_clock("cuda:1", "cpu")) \
        == ("cpu", "wall", "cuda", "cuda")
    torch.set_num_threads(2)   # the fixture puts it back
    assert resolve_clock("cpu") == "wall"
    with pytest.raises(ValueError, match="clock 'cpu' counts the calling thread only"):
        resolve_clock("cpu", "cpu")
    torch.set_num_threads(1)

    def forwards(clock):
        return measure_stage(EmulatedStage(20.0, 0.0, 0.0), lambda: torch.randn(2, 1, 8, requires_grad=True),
                             is_last=False, warmup=0, iters=3, full_backward=False, clock=clock).forward

    assert max(forwards("cpu")) < 10.0 and min(forwards("wall")) >= 20.0 - 0.05
    data = profile_stages([torch.nn.Linear(4, 4)], torch.randn(2, 4), warmup=0, iters=1).to_dict()
    assert data["meta"]["timer"] == TIMERS["cpu"] == "thread CPU time (time.thread_time)"


def test_cli_clock_cpu_with_more_threads_is_one_line(capsys, tmp_path):
    code = main(["profile", "megatron-gpt", "-p", "2", "--threads", "2", "--clock", "cpu", "--device", "cpu",
                 "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--clock cpu" in err[0] and "--threads 2" in err[0], err


# -- interleaved measurement ------------------------------------------------------------------------
def test_the_plan_takes_every_stage_in_turn_and_alternates_the_backward_kinds():
    from koala_ds.profiler.core import measurement_plan

    plan = measurement_plan(3, warmup=2, iters=4)
    assert [(k, s) for k, s, _ in plan] == [(k, s) for k in range(6) for s in range(3)]
    assert all(kinds == (("split", "full") if k % 2 == 0 else ("full", "split")) for k, _, kinds in plan)
    assert {kinds for _, _, kinds in measurement_plan(2, 1, 3, full_backward=False)} == {("split",)}


@torch_needed
def test_the_profiler_runs_the_plan():
    """What ran, recorded by the stages themselves: each round takes every stage in turn, and a
    stage's I + W and its B come first by turns."""
    torch = pytest.importorskip("torch")
    from koala_ds.runtime import wgrad
    from koala_ds.profiler.core import measurement_plan, profile_stages

    log: list[tuple[str, int]] = []

    class Recorded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, stage):
            ctx.stage = stage
            ctx.save_for_backward(w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            (w,) = ctx.saved_tensors
            queue, stage = wgrad.active_queue(), ctx.stage
            if queue is None:
                log.append(("B", stage))
                return grad * w, grad.sum(0), None
            log.append(("I", stage))
            queue.add(lambda: log.append(("W", stage)) or [(w, grad.sum(0))])
            return grad * w, None, None

    class Stage(torch.nn.Module):
        def __init__(self, stage):
            super().__init__()
            self.stage, self.w = stage, torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            if torch.is_grad_enabled():
                log.append(("F", self.stage))
            return Recorded.apply(x if x.requires_grad else x.detach().requires_grad_(), self.w, self.stage)

    warmup, iters = 1, 5
    profile_stages([Stage(0), Stage(1)], torch.randn(2, 4), warmup=warmup, iters=iters, full_backward=True)
    expected = []
    for _, s, kinds in measurement_plan(2, warmup, iters):
        for kind in kinds:
            expected += [("F", s), ("I", s), ("W", s)] if kind == "split" else [("F", s), ("B", s)]
    assert log[:len(expected)] == expected   # then the memory microbatch of each stage
    assert log[:10] == [("F", 0), ("I", 0), ("W", 0), ("F", 0), ("B", 0),
                        ("F", 1), ("I", 1), ("W", 1), ("F", 1), ("B", 1)]
    assert log[10:15] == [("F", 0), ("B", 0), ("F", 0), ("I", 0), ("W", 0)]   # round 2: B first


# -- the search's rule ------------------------------------------------------------------------------
def _uniform(spread: float | None) -> CostProfile:
    """Four stages, F = I = W = 1 ms, no latency: scaling every time scales every makespan, so the
    spread on any makespan is exactly the stages' spread."""
    stage = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "activation_mb": 1.0, "w_hold_mb": 0.5}
    if spread is not None:
        stage["spread"] = {"forward": spread, "backward_input": spread, "backward_weight": spread}
    return CostProfile.from_dict({"version": 1, "stages": [dict(stage) for _ in range(4)], "p2p_latency": 0.0},
                                 f"<spread {spread}>")


def _search(profile, **kw):
    from koala_ds.search import SearchProblem, search

    return search(SearchProblem(profile, 4, 8, 1, "auto", None), time_budget=None, generations=2, seed=0, **kw)


def test_a_gain_within_the_spread_keeps_1f1b_and_without_one_nothing_changes():
    plain = _search(_uniform(None))
    one = next(row for row in plain.library if row.name == "1f1b")
    gain = one.makespan / plain.makespan - 1
    assert gain > 0.05 and not plain.origin.endswith("1f1b")      # something clearly beats 1f1b
    assert plain.spread is None and plain.required_gain == 0.0
    wide = _search(_uniform(2 * gain))
    assert wide.origin == "library 1f1b" and wide.makespan == pytest.approx(one.makespan)
    assert wide.spread == pytest.approx(2 * gain) and wide.required_gain == wide.spread
    narrow = _search(_uniform(gain / 2))
    assert narrow.makespan == pytest.approx(plain.makespan) and narrow.spread == pytest.approx(gain / 2)
    # --min-gain above the spread is the rule then; use_spread=False (--ignore-spread): min_gain alone
    assert _search(_uniform(gain / 2), min_gain=gain * 1.01).required_gain == pytest.approx(gain * 1.01)
    ignored = _search(_uniform(2 * gain), use_spread=False)
    assert ignored.makespan == pytest.approx(plain.makespan) and ignored.spread is None


def test_the_spread_on_a_makespan_is_measured_at_the_quartiles():
    from koala_ds.resolve import load_schedule
    from koala_ds.search.ga import makespan_spread

    prof = CostProfile.from_dict(profile_dict(4, spread={"forward": 0.2}))   # only F varies
    sched = load_schedule("1f1b", 4, 8)
    ms = simulate(sched, prof).makespan
    low, high = (simulate(sched, q).makespan for q in prof.quartile_profiles())
    assert makespan_spread(sched, prof.quartile_profiles(), ms) == pytest.approx((high - low) / ms)
    assert 0 < makespan_spread(sched, prof.quartile_profiles(), ms) < 0.2   # F is part of the makespan only


def test_cli_search_says_the_spread_kept_1f1b(tmp_path, capsys):
    gain = 0.3   # above what the search finds over 1f1b at p = 4, m = 8 (about 0.2)
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(_uniform(gain).to_dict()))
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", str(path), "-m", "8", "--generations", "2", "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "found by library 1f1b" in text, text
    assert "kept 1f1b (the profile's spread on the makespans, 30.00%)" in text, text
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(_uniform(None).to_dict()))
    assert main(["search", "--profile", str(plain), "-m", "8", "--generations", "2", "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "spread" not in text and "kept" not in text, text
    assert main(["search", "--profile", str(path), "-m", "8", "--generations", "2", "--quiet", "--ignore-spread",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "found by library 1f1b" not in text and "kept" not in text, text


@pytest.mark.parametrize("spreads, warned", [
    ([{"forward": 0.004, "backward": 0.008}, {"forward": 0.05, "backward_weight": 0.006}], "5.0% only (stage 1 forward"),
    ([{"forward": 0.004}, {"backward_input": 0.019}], None),
    ([None, None], None),
])
def test_koala_profile_warns_once_when_the_spread_says_the_machine_was_busy(caplog, spreads, warned):
    from koala_ds.commands import profile as profile_cmd

    stages = [{} if sp is None else {"spread": sp} for sp in spreads]
    with caplog.at_level("WARNING", logger="koala_ds.commands.profile"):
        profile_cmd._warn_if_busy(stages)
    lines = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and warned in lines[0] and "quiet machine" in lines[0], lines


@pytest.mark.parametrize("backward, kept", [(1.55, True), (1.6, False)])
def test_cli_search_keeps_1f1b_below_the_default_min_gain_of_5_percent(tmp_path, capsys, backward, kept):
    """--min-gain's default is the measured fidelity (5%, docs/search.md): F = I = W = 1 ms and B =
    1.55 ms make zb-h1 3.9% faster than 1f1b (kept), B = 1.6 ms 5.9% (chosen); the default was 0."""
    from koala_ds.commands.search import DEFAULT_MIN_GAIN_PCT

    assert DEFAULT_MIN_GAIN_PCT == 5.0
    stage = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "backward": backward,
             "activation_mb": 1.0, "w_hold_mb": 0.5}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"version": 1, "stages": [dict(stage) for _ in range(4)], "p2p_latency": 0.0}))
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", str(path), "-m", "8", "--generations", "2", "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("kept 1f1b (--min-gain 5)" in text) == kept, text
    assert ("found by library 1f1b" in text) == kept, text
