"""The schedule search: BTT encoding, greedy seeds, the GA, the CLI (fast cases only)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.cli import main
from koala_ds.core.ir import KoalaError
from koala_ds.sim import CostProfile, load_profile, simulate
from koala_ds.sim.profile import ProfileError
from koala_ds.search import (SearchError, SearchProblem, best_predefined, decode, encode, greedy_seeds,
                             one_f_one_b_peak, placements_for, search)
from koala_ds.core.validate import validate


def _library_cases():
    for name in library.names():
        for p, m, v in [(2, 4, 1), (4, 8, 1), (4, 8, 2), (3, 7, 2), (4, 12, 2), (8, 16, 1)]:
            try:
                prog = library.get(name)
                if prog.supports(p, m, v) is not None:
                    continue
                yield pytest.param(name, p, m, v, id=f"{name}-p{p}m{m}v{v}")
            except KoalaError:
                continue


@pytest.mark.parametrize("name,p,m,v", list(_library_cases()))
def test_every_library_schedule_is_a_point_of_the_btt_space(name, p, m, v):
    try:
        schedule = library.get(name).compile(p, m, v)
    except KoalaError:
        pytest.skip(f"{name} does not compile for p={p} m={m} v={v} (library issue, not the encoding's)")
    enc = encode(schedule)
    assert len(enc.ranks) == p   # one choice sequence per rank
    back = decode(enc, schedule.name)
    assert back.same_order(schedule)


def _problem(p=4, m=8, v=1, backward="split", limit=None, profile=None):
    prof = profile or load_profile("uniform-4") if (p * v == 4 and profile is None) else profile
    if prof is None:
        prof = CostProfile.uniform(p * v, forward=1.0, backward_input=1.0, backward_weight=0.8,
                                   activation_mb=10.0, w_hold_mb=3.0, p2p_latency=0.05)
    return SearchProblem(prof, p, m, v, backward, limit)


def test_search_returns_a_valid_schedule_within_memory_and_no_worse_than_seeds():
    problem = _problem(4, 8)
    result = search(problem, time_budget=None, generations=15, seed=3)
    validate(result.schedule)
    sim = simulate(result.schedule, problem.search_profile, timeline=False)
    assert sim.fits_memory
    assert sim.peak_memory_max <= problem.memory_limit_mb * (1 + 1e-9)
    assert sim.makespan == pytest.approx(result.makespan)
    assert result.makespan >= result.lower_bound * (1 - 1e-9)
    fitting = [row.makespan for row in result.library if row.fits]
    assert fitting, "some library schedule fits 1F1B's memory (1f1b itself)"
    assert result.makespan <= min(fitting) + 1e-9
    for part in problem.parts[:1]:
        for _, orders in greedy_seeds(part):
            ev = part.evaluate(orders)
            assert result.makespan <= ev.makespan + 1e-9


def test_default_memory_limit_is_1f1b_peak():
    profile = CostProfile.uniform(4, activation_mb=10.0, w_hold_mb=2.0)
    problem = SearchProblem(profile, 4, 8, 1, "split")
    peak = simulate(library.get("1f1b").compile(4, 8, 1), profile, timeline=False).peak_memory_max
    assert problem.memory_limit_mb == pytest.approx(peak)
    assert one_f_one_b_peak(profile, 4, 8, 1) == pytest.approx(peak)
    assert problem.memory_limit_source.startswith("1F1B")


def test_memory_tight_search_respects_the_limit():
    profile = CostProfile.uniform(4, activation_mb=10.0, w_hold_mb=2.0, p2p_latency=0.1)
    limit = 0.6 * one_f_one_b_peak(profile, 4, 8, 1)
    problem = SearchProblem(profile, 4, 8, 1, "split", limit)
    result = search(problem, time_budget=None, generations=10, seed=0)
    sim = simulate(result.schedule, problem.search_profile, timeline=False)
    assert sim.peak_memory_max <= limit * (1 + 1e-9)
    validate(result.schedule)


def test_search_is_deterministic_for_a_seed():
    a = search(_problem(4, 8), time_budget=None, generations=12, seed=7)
    b = search(_problem(4, 8), time_budget=None, generations=12, seed=7)
    assert a.schedule.same_order(b.schedule)
    assert a.makespan == b.makespan


def test_chunks_search_v2():
    profile = CostProfile.uniform(8, activation_mb=10.0, w_hold_mb=2.0, p2p_latency=0.05)
    problem = SearchProblem(profile, 4, 8, 2, "split")
    result = search(problem, time_budget=None, generations=5, seed=1)
    validate(result.schedule)
    assert result.schedule.v == 2
    assert result.fits


def test_bad_input_errors():
    profile = CostProfile.uniform(4, activation_mb=10.0)
    with pytest.raises(SearchError, match="`m` must be >= 1") as exc:
        SearchProblem(profile, 4, 0, 1)
    assert exc.value.parameter == "m"
    with pytest.raises(SearchError, match="raise `memory_limit`") as exc:
        SearchProblem(profile, 4, 8, 1, "split", memory_limit=5.0)  # below one activation
    assert exc.value.parameter == "memory_limit"
    with pytest.raises(SearchError, match="change `p` / `v`") as exc:
        SearchProblem(profile, 3, 8, 1)
    assert exc.value.parameters == ("p", "v")
    with pytest.raises(ProfileError, match="no-such-profile"):
        load_profile("no-such-profile")


def test_cli_bad_input(tmp_path, capsys):
    out = str(tmp_path / "best.koala")
    assert main(["search", "--profile", "no-such-profile", "-m", "8", "-o", out, "--quiet"]) == 2
    assert "no-such-profile" in capsys.readouterr().err
    assert main(["search", "--profile", "uniform-4", "-m", "0", "-o", out, "--quiet"]) == 2
    assert "-m" in capsys.readouterr().err
    assert main(["search", "--profile", "uniform-4", "-m", "8", "--memory-limit", "1", "-o", out, "--quiet"]) == 2
    assert "--memory-limit" in capsys.readouterr().err


def test_ctrl_c_returns_the_best_so_far():
    def interrupt(gen, best):
        if gen == 3:
            raise KeyboardInterrupt

    result = search(_problem(4, 8), time_budget=None, generations=50, seed=0, on_generation=interrupt)
    assert result.interrupted and result.stopped == "interrupted"
    assert result.generations == 3
    validate(result.schedule)


def test_cli_writes_koala_that_round_trips_and_ctrl_c_writes_best(tmp_path, monkeypatch, capsys):
    out = tmp_path / "best.koala"
    rc = main(["search", "--profile", "uniform-4", "-m", "8", "--generations", "5", "--seed", "1",
               "-o", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "searched *" in text and "lower bound" in text and "1f1b" in text
    loaded = load_schedule(str(out), 4, 8, 1)
    validate(loaded)
    profile = load_profile("uniform-4")
    assert simulate(loaded, profile, timeline=False).makespan > 0

    import koala_ds.search as search_pkg
    real = search_pkg.search

    def interrupted(*args, **kwargs):
        def stop(gen, best):
            if gen == 2:
                raise KeyboardInterrupt
        kwargs["on_generation"] = stop
        kwargs["generations"] = 100
        return real(*args, **kwargs)

    monkeypatch.setattr(search_pkg, "search", interrupted)
    out2 = tmp_path / "interrupted.koala"
    rc = main(["search", "--profile", "uniform-4", "-m", "8", "-o", str(out2), "--quiet"])
    assert rc == 130
    assert "interrupted" in capsys.readouterr().out
    validate(load_schedule(str(out2), 4, 8, 1))


# -- placements: single copy of the weights by default ---------------------------------------
def test_default_search_keeps_one_copy_of_the_weights():
    problem = _problem(4, 8)
    assert all(pl.pipelines == 1 for pl in problem.placements)
    assert not problem.allows_two_copies
    result = search(problem, time_budget=None, generations=3, seed=0)
    assert result.schedule.placement.pipelines == 1
    assert all(s.placement.pipelines == 1 for s, _ in result.per_placement)
    chimera = [row for row in result.library if row.name == "chimera"]
    assert chimera, "chimera is valid for p=4, m=8"
    assert chimera[0].weight_copies == 2 and "2x weights" in chimera[0].note
    assert not chimera[0].comparable and not chimera[0].eligible
    best = best_predefined(result.library)
    assert best is not None and best.weight_copies == 1
    assert result.makespan <= best.makespan + 1e-9


def test_placement_any_allows_bidirectional():
    problem = _problem(4, 8)
    problem_any = SearchProblem(problem.profile, 4, 8, 1, "split", placement="any")
    assert problem_any.allows_two_copies
    assert {pl.pipelines for pl in problem_any.placements} == {1, 2}
    result = search(problem_any, time_budget=None, generations=2, seed=0)
    chimera = [row for row in result.library if row.name == "chimera"][0]
    assert chimera.comparable
    only = SearchProblem(problem.profile, 4, 8, 1, "split", placement="bidirectional")
    assert [pl.pipelines for pl in only.placements] == [2]


@pytest.mark.parametrize("choice,v,expected", [("default", 1, {"linear"}), ("default", 2, {"vshape", "interleaved"}),
                                               ("vshape", 2, {"vshape"}), ("interleaved", 2, {"interleaved"}),
                                               ("linear", 1, {"linear"})])
def test_placements_for(choice, v, expected):
    assert {pl.style for pl in placements_for(4, v, choice)} == expected


@pytest.mark.parametrize("choice,v", [("linear", 2), ("vshape", 1), ("interleaved", 1), ("diagonal", 1)])
def test_bad_placement_names_the_parameter(choice, v):
    with pytest.raises(SearchError, match="`placement`") as exc:
        placements_for(4, v, choice)
    assert exc.value.parameter == "placement"


def test_cli_placement_option_and_two_copies_note(tmp_path, capsys):
    out = tmp_path / "best.koala"
    rc = main(["search", "--profile", "uniform-4", "-m", "8", "--generations", "2", "--seed", "0",
               "--placement", "linear", "-o", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    chimera_line = [line for line in text.splitlines() if line.startswith("chimera")]
    assert chimera_line and "2x weights" in chimera_line[0]
    assert load_schedule(str(out), 4, 8, 1).placement.pipelines == 1
    assert main(["search", "--profile", "uniform-4", "-m", "8", "--placement", "vshape", "-o", str(out),
                 "--quiet"]) == 2
    assert "--placement" in capsys.readouterr().err


# -- local search ------------------------------------------------------------------------------
def test_local_search_timeline_agrees_with_the_simulator():
    from koala_ds.search.local import LocalSearch

    for p, m, v, backward in [(4, 8, 1, "split"), (4, 8, 2, "split"), (4, 6, 1, "full"), (3, 5, 2, "full")]:
        problem = _problem(p, m, v, backward)
        for part in problem.parts:
            ls = LocalSearch(part)
            for _, orders in greedy_seeds(part)[:5]:
                ev = part.evaluate(orders)
                if ev.makespan == float("inf"):
                    continue
                free, starts = ls.times(ev.codes)
                res = simulate(part.schedule(ev.codes, "greedy"), problem.search_profile)
                assert max(free) == pytest.approx(res.makespan, abs=1e-9)
                assert [[t.start for t in res.rank_timeline(r)] for r in range(p)] == starts


def test_local_search_never_worsens_and_stays_valid():
    import random

    from koala_ds.search.local import LocalSearch

    profile = CostProfile.uniform(4, activation_mb=10.0, w_hold_mb=2.0, p2p_latency=0.1)
    limit = 0.6 * one_f_one_b_peak(profile, 4, 8, 1)
    problem = SearchProblem(profile, 4, 8, 1, "split", limit)
    part = problem.parts[0]
    ls = LocalSearch(part)
    for _, orders in greedy_seeds(part)[:4]:
        start = part.evaluate(orders)
        res = ls.descend(orders, random.Random(0), lambda: False, max_evals=300)
        assert res is not None
        ev = part.evaluate(res.choices)
        assert ev.fits and ev.makespan == pytest.approx(res.makespan)
        assert res.makespan <= start.makespan + 1e-9
        schedule = part.schedule(ev.codes, "ls")
        validate(schedule)
        assert simulate(schedule, problem.search_profile, timeline=False).peak_memory_max <= limit * (1 + 1e-9)


# -- the release/tail bound -------------------------------------------------------------------
@pytest.mark.parametrize("p,m,v,backward,tight,style", [
    (4, 8, 1, "split", False, "linear"), (4, 8, 1, "split", True, "linear"), (3, 7, 1, "full", True, "linear"),
    (4, 8, 2, "split", True, "vshape"), (4, 6, 2, "full", False, "interleaved"),
    (4, 8, 1, "split", False, "bidirectional"), (4, 12, 2, "full", True, "vshape")])
def test_release_tail_bound_is_below_every_schedule(p, m, v, backward, tight, style):
    from koala_ds.search.bound import jackson_bound
    from koala_ds.sim import StageCost, random_schedule

    stages = [StageCost(1.0, 1.1, 0.9, 10.0, 3.0)] * (p * v - 1) + [StageCost(1.6, 1.7, 1.2, 14.0, 4.0)]
    profile = CostProfile(tuple(stages), 0.3)
    limit = (0.6 if tight else 10.0) * one_f_one_b_peak(profile, p, m, v)
    problem = SearchProblem(profile, p, m, v, backward, limit, placement=style)
    part = problem.parts[0]
    bound = jackson_bound(problem.search_profile, part.placement, m, backward, problem.limits).value
    assert bound > 0
    checked = 0
    candidates = [orders for _, orders in greedy_seeds(part)]
    candidates += [part.orders_of(random_schedule(part.placement, m, backward, seed=k)) for k in range(20)]
    for orders in candidates:
        ev = part.evaluate(orders)
        if ev.makespan == float("inf"):
            continue
        checked += 1
        assert ev.makespan >= bound - 1e-9
    assert checked > 0
    assert part.lower_bound >= bound - 1e-12


def test_cli_names_the_best_fitting_predefined_schedule_and_never_loses_to_it(tmp_path, capsys):
    import re

    from koala_ds.cli import main

    out = tmp_path / "best.koala"
    assert main(["search", "--profile", "gpt-chunks-8", "-v", "2", "-m", "8", "--generations", "2", "--seed", "0",
                 "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    found = re.search(r"best predefined schedule that fits: (\S+) ([\d.]+) ms; searched is ([\d.]+)x its speed", text)
    assert found, text
    assert float(found.group(3)) >= 1.0
    assert found.group(1) in text.split("lower bound")[0]


def test_chain_moves_shift_one_microbatch_on_every_stage():
    from koala_ds.search.local import LocalSearch

    assert LocalSearch.apply(list("abcde"), [(3, -2), (1, 2)]) == list("adcbe")
    assert LocalSearch.apply(list("abc"), [(0, 5)]) == list("bca")
    problem = _problem(4, 8, 2, "split")
    part = problem.parts[0]
    ls = LocalSearch(part)
    S, m = part.placement.num_stages, 8
    ev = part.evaluate(greedy_seeds(part)[0][1])
    free, starts = ls.times(ev.codes)
    chains = ls.chain_moves(ev.codes, starts, free)
    assert chains
    for chain in chains:
        kinds = {divmod(ev.codes[r][i], S * m)[0] for r, i, _ in chain}
        mbs = {ev.codes[r][i] % m for r, i, _ in chain}
        stages = {divmod(ev.codes[r][i], S * m)[1] // m for r, i, _ in chain}
        assert len(kinds) == 1 and len(mbs) == 1 and kinds != {3}   # one op kind (never W), one microbatch
        assert len(stages) == len(chain) == S                       # ... on every stage
        assert len({d for _, _, d in chain}) == 1                   # ... by the same shift


def test_orders_that_deadlock_are_repaired_not_rejected():
    # p = 2: rank 0 alternates F, I after one forward; rank 1 runs two forwards first. Rank 0
    # waits for the gradient of microbatch 0 while rank 1 waits for the forward of microbatch 1.
    profile = CostProfile.uniform(2, p2p_latency=0.1)
    problem = SearchProblem(profile, 2, 4, 1, "full", None)
    part = problem.parts[0]
    F, B = 0, 1
    orders = [[F, B, F, B, F, B, F, B], [F, F, B, B, F, F, B, B]]
    codes = [part.decoder.decode_rank(r, order)[1] for r, order in enumerate(orders)]
    with pytest.raises(KoalaError, match="deadlock"):
        part.sim.makespan(codes)
    ev = part.evaluate(orders)
    assert ev.makespan < float("inf")
    schedule = part.schedule(ev.codes, "repaired")
    validate(schedule)
    assert simulate(schedule, problem.search_profile, timeline=False).makespan == pytest.approx(ev.makespan)
    # each time both ranks wait, the repair moves rank 1's next backward (it needs nothing) in front
    # of the forward it waits at; rank 0's order is kept
    assert ev.orders == [orders[0], [F, B] * 4]


def test_repaired_random_orders_are_valid_schedules():
    import random

    from koala_ds.search.operators import mutate
    from koala_ds.sim.simulator import Stall

    profile = CostProfile.uniform(8, activation_mb=10.0, w_hold_mb=2.0, p2p_latency=0.1)
    limit = 0.6 * one_f_one_b_peak(profile, 4, 8, 2)
    problem = SearchProblem(profile, 4, 8, 2, "split", limit)
    rng = random.Random(0)
    repaired = 0
    for part in problem.parts:
        orders = part.orders_of(library.get("v-min" if part.placement.describe() == "vshape" else
                                          "interleaved-1f1b").compile(4, 8, 2)) \
            if part.placement.describe() in ("vshape", "interleaved") else greedy_seeds(part)[0][1]
        for _ in range(40):
            kicked = mutate(orders, rng, 6.0, part.placement.chunks_per_rank)
            plain = [part.decoder.decode_rank(r, t)[1] for r, t in enumerate(kicked)]
            deadlocks = isinstance(part.sim.try_times(plain), Stall)
            ev = part.evaluate(kicked)
            if ev.makespan == float("inf"):
                continue
            repaired += deadlocks
            schedule = part.schedule(ev.codes, "kicked")
            validate(schedule)
            res = simulate(schedule, problem.search_profile, timeline=False)
            assert res.makespan == pytest.approx(ev.makespan)
            assert res.peak_memory_max <= limit * (1 + 1e-9)
    assert repaired > 0  # the kicks did produce deadlocks, and they were repaired


def test_run_ahead_term_counts_whole_forwards():
    # V-shape, p = 4, m = 8, unit ops, 0.05 ms hops, 100 MB per chunk activation, limit 480 MB.
    # Rank 3 holds stages 3 and 4. Its first forward starts at 3.15 (three ops, three hops); the
    # first gradient comes back to it at 11.45 (F3 F4 on rank 3 end at 5.15, then F5 F6 F7 I7
    # I6 I5 and six hops: + 6.3). Until then it frees nothing, so it runs at most 4 forwards
    # (4 x 100 MB fit in 480, 5 do not), 4 ms of its 48 ms of work: T >= 11.45 + 48 - 4. The
    # fractional relaxation counted 4.8 forwards (54.65).
    from koala_ds.search.bound import _forward_work_that_fits, jackson_bound
    from koala_ds.sim import StageCost

    profile = CostProfile((StageCost(1.0, 1.0, 1.0, 100.0, 25.0),) * 8, 0.05)
    problem = SearchProblem(profile, 4, 8, 2, "split", 480.0, placement="vshape")
    part = problem.parts[0]
    jb = jackson_bound(problem.search_profile, part.placement, 8, "split", problem.limits)
    assert jb.per_rank[3] == pytest.approx(11.45 + 48 - 4)
    assert problem.lower_bound >= 55.45 - 1e-9
    # the knapsack itself: whole items, the best mix of two kinds, no limit for a zero activation
    assert _forward_work_that_fits([(1.0, 100.0, 8), (1.0, 100.0, 8)], 480.0) == 4.0
    # 2 x 1.6 + 2 x 1.0 (280 + 200 MB); the fractional relaxation would say 480 / 140 x 1.6 = 5.49
    assert _forward_work_that_fits([(1.6, 140.0, 8), (1.0, 100.0, 8)], 480.0) == pytest.approx(5.2)
    assert _forward_work_that_fits([(1.0, 0.0, 3)], 10.0) == float("inf")


# -- the profile's full backward B and --backward auto (issue 13) -----------------------------
def _b_profile(b: float, p: int = 4) -> CostProfile:
    """Unit F, I, W (I + W = 2) and the given full backward B."""
    return CostProfile.uniform(p, activation_mb=10.0, w_hold_mb=3.0, p2p_latency=0.05, backward=b)


def test_auto_searches_full_backward_only_where_a_b_is_cheaper_than_i_plus_w():
    from koala_ds.search import backward_kinds

    assert backward_kinds(load_profile("uniform-4")) == ("split",)   # no field: B = I + W
    assert backward_kinds(_b_profile(2.0)) == ("split",)              # given equal
    assert backward_kinds(_b_profile(2.5)) == ("split",)              # a full backward cannot win
    assert backward_kinds(_b_profile(1.5)) == ("split", "full")
    assert backward_kinds(_b_profile(1.5), "full") == ("full",)
    with pytest.raises(SearchError, match="`backward` must be one of auto, split, full") as exc:
        SearchProblem(_b_profile(1.5), 4, 8, 1, "half")
    assert exc.value.parameter == "backward"
    problem = SearchProblem(_b_profile(1.5), 4, 8, 1, placement="any")
    assert problem.backward == "auto"
    assert [(part.placement.pipelines, part.backward) for part in problem.parts] == \
        [(1, "split"), (1, "full"), (2, "split"), (2, "full")]
    assert problem.lower_bound == min(problem.lower_bound_of("split"), problem.lower_bound_of("full"))


@pytest.mark.parametrize("b, winner", [(1.2, "full"), (1.9, "split")])
def test_auto_answers_with_the_faster_backward_kind(b, winner):
    problem = SearchProblem(_b_profile(b), 4, 8)
    result = search(problem, time_budget=None, generations=3, seed=0)
    validate(result.schedule)
    assert result.schedule.backward == winner and result.kinds == ("split", "full")
    rows = {row.name: row.makespan for row in result.library}
    assert result.makespan <= min(rows["1f1b"], rows["zb-h1"]) + 1e-9
    assert simulate(result.schedule, problem.search_profile).makespan == pytest.approx(result.makespan)
    # the bound is the smaller of the two kinds' (the answer may be of either kind)
    assert result.lower_bound == min(result.kind_bounds.values()) <= result.makespan * (1 + 1e-9)
    for kind in ("split", "full"):
        alone = search(SearchProblem(_b_profile(b), 4, 8, 1, kind), time_budget=None, generations=3, seed=0)
        assert alone.lower_bound == pytest.approx(result.kind_bounds[kind])
        if kind == winner:
            assert result.makespan <= alone.makespan + 1e-9
        else:  # (a split search may still answer with a library full schedule that is faster)
            assert alone.best_of_kind(kind) > result.makespan
    # deterministic for a seed and a generation budget
    again = search(SearchProblem(_b_profile(b), 4, 8), time_budget=None, generations=3, seed=0)
    assert again.schedule.same_order(result.schedule) and again.makespan == result.makespan


def test_auto_is_the_split_search_without_the_field():
    """Without `backward` (or with B >= I + W) auto searches exactly what split did."""
    auto = search(_problem(4, 8, backward="auto"), time_budget=None, generations=4, seed=2)
    split = search(_problem(4, 8, backward="split"), time_budget=None, generations=4, seed=2)
    assert auto.schedule.same_order(split.schedule) and auto.makespan == split.makespan
    assert auto.lower_bound == split.lower_bound and auto.kinds == ("split",)


@pytest.mark.parametrize("factor", [0.4, 0.8, 1.3])
@pytest.mark.parametrize("backward, style, v", [("split", "linear", 1), ("full", "linear", 1),
                                                ("split", "vshape", 2), ("full", "interleaved", 2)])
def test_release_tail_bound_holds_with_a_measured_full_backward(factor, backward, style, v):
    """B = factor * (I + W): the split bound also holds for split schedules that run some B's (and
    so for full ones); the full bound for full schedules. With a tight memory limit too."""
    import random

    from koala_ds.search.bound import jackson_bound
    from koala_ds.sim import StageCost, random_schedule

    p, m = 3, 6
    rng = random.Random(f"{factor}{backward}{style}")
    stages = []
    for _ in range(p * v):
        i, w = rng.uniform(0.5, 1.5), rng.uniform(0.3, 1.5)
        stages.append(StageCost(rng.uniform(0.5, 1.5), i, w, 10.0, rng.uniform(0, 6), factor * (i + w)))
    profile = CostProfile(tuple(stages), 0.2)
    for tight in (False, True):
        limit = (0.7 if tight else 10.0) * one_f_one_b_peak(profile, p, m, v)
        problem = SearchProblem(profile, p, m, v, backward, limit, placement=style)
        part = problem.parts[0]
        bound = jackson_bound(problem.search_profile, part.placement, m, backward, problem.limits).value
        kinds = [("full", 1.0)] if backward == "full" else [("split", 1.0), ("split", 0.5), ("full", 1.0)]
        checked = 0
        for k in range(15):
            for kind, prob in kinds:
                schedule = random_schedule(part.placement, m, kind, seed=k, split_probability=prob)
                res = simulate(schedule, problem.search_profile, timeline=False)
                if res.fits_memory:
                    checked += 1
                    assert res.makespan >= bound - 1e-9, (kind, prob, k)
        for _, orders in greedy_seeds(part):
            ev = part.evaluate(orders)
            if ev.makespan != float("inf"):
                checked += 1
                assert ev.makespan >= bound - 1e-9
        for name in library.names():  # good schedules, full ones among them, are what test a bound
            prog = library.get(name)
            if prog.supports(p, m, v) is not None:
                continue
            schedule = prog.compile(p, m, v)
            if part.admits(schedule):
                res = simulate(schedule, problem.search_profile, timeline=False)
                checked += 1
                assert not res.fits_memory or res.makespan >= bound - 1e-9, name
        assert checked > 0


@pytest.mark.parametrize("backward, winner", [("measured", "full"), ("sum", "split")])
def test_auto_on_the_h200_profile(backward, winner):
    """Issue 13's H200 profile: with the measured B (about half of I + W) the answer is a full-backward
    schedule (1f1b); with B = I + W a split one that beats 1f1b."""
    from measured_profiles import h200_profile

    from koala_ds.search import GAConfig

    problem = SearchProblem(h200_profile(backward), 8, 16)
    result = search(problem, time_budget=None, generations=1, seed=0, config=GAConfig(local_search=False))
    one = next(row.makespan for row in result.library if row.name == "1f1b")
    assert result.schedule.backward == winner
    assert result.lower_bound <= result.makespan * (1 + 1e-9)
    if winner == "full":
        assert problem.kinds == ("split", "full") and result.makespan == pytest.approx(one)
        assert result.best_of_kind("split") > 1.15 * result.makespan
    else:
        assert problem.kinds == ("split",) and result.makespan < one / 1.1


def test_cli_auto_prints_which_backward_won(tmp_path, capsys):
    from measured_profiles import h200_profile

    prof = tmp_path / "h200.json"
    prof.write_text(h200_profile("measured").to_json())
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", str(prof), "-m", "16", "--generations", "0", "--time-budget", "2",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "backward=auto (split and full)" in text
    assert "backward: full wins; best found per kind: split " in text
    assert load_schedule(str(out), 8, 16, 1).backward == "full"
    assert main(["search", "--profile", "uniform-4", "-m", "8", "--generations", "0", "--time-budget", "2",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "backward=auto (split only" in text and "wins" not in text


# -- the GA's parts ------------------------------------------------------------------------------
def test_adaptive_rule_one_fifth_success_try_test_rate_and_restart():
    from koala_ds.search.ga import Dynamics, GAConfig

    d = Dynamics(GAConfig(trials=4, patience=2, strength_max=24.0))
    assert not d.after(True) and d.strength == pytest.approx(2.0 / 1.5) and d.trials == 4
    before = d.strength
    for _ in range(4):   # four failures after one success: the strength is back where it was
        assert not d.after(False)
    d.after(True)
    assert d.strength == pytest.approx(before / 1.5 * 1.5)
    restarts, trials = [], []
    for _ in range(8):
        restarts.append(d.after(False))
        trials.append(d.trials)
    assert trials == [4, 8, 8, 16, 16, 32, 32, 32]        # doubles every `patience`, up to 8x the base
    assert restarts == [False] * 7 + [True]                # a restart after 4 * patience failures
    assert d.strength == 2.0                               # ... resets the strength
    assert not d.after(True) and d.trials == 4 and d.since == 0


def test_population_keeps_each_feasible_candidate_once():
    from koala_ds.search.ga import Individual, Population

    pop = Population(started=0.0)
    assert pop.consider(Individual(0, [[0, 1]], 5.0, 1.0, "a"))
    assert not pop.consider(Individual(0, [[0, 1]], 5.0, 1.0, "same orders"))
    assert not pop.consider(Individual(0, [[1, 0]], float("inf"), 1.0, "deadlocks"))
    assert not pop.consider(Individual(1, [[1, 0]], 6.0, 1.0, "slower, other part"))
    assert pop.consider(Individual(1, [[0, 0]], 4.0, 1.0, "faster"))
    assert [x.origin for x in pop.members] == ["a", "slower, other part", "faster"]
    assert pop.best.origin == "faster" and [ms for _, ms in pop.history] == [5.0, 4.0]
    assert {idx: x.origin for idx, x in pop.part_best.items()} == {0: "a", 1: "faster"}
    pop.rank()
    pop.cut(2)
    assert [x.origin for x in pop.members] == ["faster", "a"]


# -- errors name the parameter; the CLI names the flag --------------------------------------------
def test_search_error_words_its_parameters_a_front_ends_way():
    import pickle

    exc = SearchError("p * v = 4; change `p` / `v`", "p", "v")
    assert exc.parameter == "p" and exc.parameters == ("p", "v")
    assert exc.worded({"p": "-p", "v": "-v"}) == "p * v = 4; change -p / -v"
    assert exc.worded({}) == str(exc)
    back = pickle.loads(pickle.dumps(exc))
    assert back.parameters == exc.parameters and str(back) == str(exc)
    assert SearchError("no parameter").parameter is None


@pytest.mark.parametrize("call, parameter, library_text, argv, cli_text", [
    (lambda: search(_problem(4, 8), time_budget=None, generations=-1), "generations",
     "`generations` must be >= 0, got -1", ["--generations", "-1"], "--generations must be >= 0, got -1"),
    (lambda: search(_problem(4, 8), time_budget=None, generations=1, workers=0), "workers",
     "`workers` must be >= 1, got 0", ["--workers", "0"], "--workers must be >= 1, got 0"),
    (lambda: search(_problem(4, 8), time_budget=None, generations=None), "time_budget",
     "`time_budget` and `generations` are both None", None, None),  # it ran until Ctrl-C
    (lambda: search(_problem(4, 8), time_budget=None, generations=1, workers=100_000), "workers",
     "`workers` must be at most", ["--workers", "100000"], "--workers must be at most"),  # forked until killed
    (lambda: search(_problem(4, 8), time_budget=float("nan")), "time_budget",
     "`time_budget` must be a finite number of seconds > 0", None, None),
    (lambda: SearchProblem(load_profile("uniform-4"), 4, 8, 1, memory_limit=1.0), "memory_limit",
     "raise `memory_limit` to at least 100 MB", ["--memory-limit", "1"], "raise --memory-limit to at least 100 MB"),
    (lambda: SearchProblem(load_profile("uniform-4"), 4, 8, 1, placement="vshape"), "placement",
     "`placement` vshape needs `v` >= 2", ["--placement", "vshape"], "--placement vshape needs -v >= 2"),
    (lambda: SearchProblem(load_profile("uniform-4"), 3, 8, 1), "p",
     "change `p` / `v` to match the profile", ["-p", "3"], "change -p / -v to match the profile"),
])
def test_search_errors_name_the_parameter_and_the_cli_the_flag(tmp_path, capsys, call, parameter, library_text,
                                                               argv, cli_text):
    with pytest.raises(SearchError) as exc:
        call()
    assert exc.value.parameter == parameter and library_text in str(exc.value)
    if argv is None:   # argparse refuses the value itself (tests/test_limits.py)
        return
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", "uniform-4", "-m", "8", *argv, "--time-budget", "5", "--quiet",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("koala search: error: ") and err.count("\n") == 1
    assert cli_text in err and "`" not in err
    assert not out.exists()


def test_min_gain_keeps_the_known_schedule_unless_a_gain_exceeds_it():
    """A predicted gain within the model's error should not replace the known schedule: with
    min_gain the answer is 1f1b unless something is predicted faster by more than that."""
    problem = _problem(4, 8, backward="auto")
    plain = search(problem, time_budget=None, generations=2, seed=0)
    one = next(row for row in plain.library if row.name == "1f1b")
    gain = one.makespan / plain.makespan - 1
    assert gain > 0.05 and not plain.origin.endswith("1f1b")   # the case: something clearly beats 1f1b
    kept = search(problem, time_budget=None, generations=2, seed=0, min_gain=gain * 1.01)
    assert kept.origin == "library 1f1b" and kept.makespan == pytest.approx(one.makespan)
    assert kept.schedule.same_order(library.get("1f1b").compile(4, 8, 1))
    taken = search(problem, time_budget=None, generations=2, seed=0, min_gain=gain * 0.99)
    assert taken.makespan == pytest.approx(plain.makespan)
    with pytest.raises(SearchError) as err:
        search(problem, time_budget=None, generations=1, min_gain=-0.1)
    assert err.value.parameters == ("min_gain",)


def test_cli_min_gain_says_what_it_kept(tmp_path, capsys):
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", "uniform-4", "-m", "8", "--generations", "2", "--quiet",
                 "--min-gain", "90", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "found by library 1f1b" in text and "kept 1f1b (--min-gain 90)" in text, text
    with pytest.raises(SystemExit) as exc:
        main(["search", "--profile", "uniform-4", "-m", "8", "--min-gain", "x", "-o", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--min-gain" in err[0], err


def test_a_search_worker_killed_mid_search_leaves_the_same_answer(monkeypatch, caplog):
    """A worker process killed (the out-of-memory killer, a user) broke the pool: the search died
    in BrokenProcessPool's traceback and its best schedule so far was lost. It goes on alone."""
    import logging
    import os
    import signal

    from koala_ds.search import pool

    problem = _problem(4, 8, limit=250.0)  # 1F1B's peak is 400 MB: the bound is not met at once
    alone = search(problem, time_budget=None, generations=3, seed=5)
    start, killed = pool.Evaluator._start_workers, []

    def start_then_kill_one(self):
        start(self)
        proc = next(iter(self.pool._processes.values()))
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(proc.pid)  # (its exit code may be the pool's to collect: not asserted)

    monkeypatch.setattr(pool.Evaluator, "_start_workers", start_then_kill_one)
    with caplog.at_level(logging.WARNING, logger="koala_ds.search.pool"):
        result = search(problem, time_budget=None, generations=3, seed=5, workers=2)
    assert len(killed) == 1
    assert "search worker process ended abruptly" in caplog.text
    assert (result.makespan, result.schedule.to_dict()) == (alone.makespan, alone.schedule.to_dict())


_CTRL_C_AT_WORKER_START = """
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever the test runner's
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from koala_ds.search import SearchProblem, pool
from koala_ds.sim import CostProfile

submit = pool.Evaluator._submit_one_each

def ctrl_c_then_submit(self):
    os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in a terminal does to this process
    submit(self)

pool.Evaluator._submit_one_each = ctrl_c_then_submit
evaluator = pool.Evaluator(SearchProblem(CostProfile.uniform(4, activation_mb=10.0), 4, 8, 1, "split"), 2)
try:
    evaluator._start_workers()
    print("not interrupted")
except KeyboardInterrupt:
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    print("interrupted", "blocked" if blocked else "unblocked")
finally:
    evaluator.close()
"""


@pytest.mark.slow  # worker processes
def test_a_ctrl_c_while_the_search_starts_its_workers_is_not_lost():
    """Ctrl-C reaching the search while its workers were being created was dropped (SIGINT was
    ignored meanwhile, so the workers would inherit that) and the search ran on to its end. In a
    process of its own: a real SIGINT, whatever the test runner does with one."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _CTRL_C_AT_WORKER_START], capture_output=True, text=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["interrupted", "unblocked"], done.stdout + done.stderr


def _ends_heavy(limit):
    """4 stages whose first and last hold 200 MB per activation, the middle ones 100: on 2 ranks
    (v = 2) the V-shape puts both 200 MB stages on rank 0 (400 MB whatever the schedule), the
    interleaved placement 300 MB on each rank."""
    stage = {"forward": 1, "backward_input": 1, "backward_weight": 1, "w_hold_mb": 20}
    prof = CostProfile.from_dict({"version": 1, "p2p_latency": 0.02, "stages": [
        {**stage, "activation_mb": mb} for mb in (200, 100, 100, 200)]})
    return SearchProblem(prof, 2, 4, 2, "auto", limit)


def test_a_default_placement_that_cannot_fit_is_left_out_not_the_whole_search():
    """The search refused ('raise memory_limit to at least 400 MB') though the interleaved
    placement fits 300 MB: the V-shape's need stopped it."""
    problem = _ends_heavy(300.0)
    assert [pl.style for pl in problem.placements] == ["interleaved"]
    assert [(pl.style, r, need) for pl, r, need in problem.unfit] == [("vshape", 0, 400.0)]
    result = search(problem, time_budget=None, generations=2, seed=0)
    validate(result.schedule)
    assert result.fits and result.peak <= 300.0 and result.schedule.placement.style == "interleaved"


def test_a_limit_no_placement_fits_names_the_nearest_placement_and_what_it_needs():
    with pytest.raises(SearchError, match=r"memory limit 250 MB on rank \d is below what any schedule needs there "
                                          r"\(300 MB: one activation of each of its stages, placement interleaved\); "
                                          r"raise `memory_limit` to at least 300 MB"):
        _ends_heavy(250.0)


def test_simulate_says_two_copies_of_the_weights_not_a_gap_below_the_bound(tmp_path, capsys):
    """The bound counts one copy of the weights; a bidirectional schedule keeps two. `koala
    simulate` printed a negative gap (-5.80% over the bound) where compare and --json say so."""
    import json

    times = [(1.72, 1.83, 1.8, 100), (1.29, 1.29, 1.34, 150), (1.35, 1.32, 1.24, 200), (0.81, 0.92, 0.83, 200),
             (1.41, 1.32, 1.43, 100), (1.31, 1.2, 1.37, 200)]  # chimera 34.12 ms, under the 36.22 ms bound
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"version": 1, "p2p_latency": 0.05, "memory_limit_mb": 1200, "stages": [
        {"forward": f, "backward_input": i, "backward_weight": w, "activation_mb": mb, "w_hold_mb": 30}
        for f, i, w, mb in times]}))
    assert main(["simulate", "chimera", "--profile", str(prof), "-m", "6"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("lower bound"))
    assert line.endswith("makespan 2x weights over it"), line
    assert main(["simulate", "chimera", "--profile", str(prof), "-m", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["over_bound"] is None


def test_a_full_backward_library_seed_run_split_says_so():
    """'found by library interleaved-1f1b' came with '1.329x its speed': the answer was that order
    with each B run as I + W, which the origin now says."""
    prof = _ends_heavy(None).profile
    problem = SearchProblem(prof, 2, 1, 2, "auto", None, placement="interleaved")
    result = search(problem, time_budget=None, generations=1, seed=0)
    assert result.origin == "library interleaved-1f1b as I + W" and result.schedule.backward == "split"
    assert result.makespan < next(r.makespan for r in result.library if r.name == "interleaved-1f1b")


@pytest.mark.parametrize("placements, says", [([], "`placements` is empty"),
                                              (["linear"], "`placements` holds 'linear', not a"),
                                              ("other-p", "is a placement of p=2, v=1; this problem's p=4, v=1")])
def test_placements_given_are_checked_and_name_the_parameter(placements, says):
    """placements=[] was accepted and then a ValueError (min of an empty sequence); a name, an
    AttributeError; a placement of another p, a ProfileError naming no parameter."""
    from koala_ds.core.ir import Placement

    if placements == "other-p":
        placements = [Placement.named("linear", 2, 1)]
    with pytest.raises(SearchError, match=re.escape(says)) as exc:
        SearchProblem(CostProfile.uniform(4), 4, 4, placements=placements)
    assert exc.value.parameter == "placements"
