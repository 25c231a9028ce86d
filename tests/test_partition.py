"""Per-layer profiles, splits (partitions), the engines' split settings and the joint search of
split and schedule (koala_ds/sim/layers.py, koala_ds/core/layout.py, koala_ds/search/partition*.py)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re

import pytest

from koala_ds.cli import main
from koala_ds.core.ir import KoalaError, Placement
from koala_ds.core.layout import deepspeed_parts, megatron_layout
from koala_ds.resolve import load_schedule
from koala_ds.search.partition import PartitionSearch, default_memory_limit, search_partition
from koala_ds.search.partition_bound import joint_lower_bound
from koala_ds.sim import ProfileError, load_profile, simulate
from koala_ds.sim.layers import LayerProfile, load_layer_profile, uniform_partition


def layer(name, kind="transformer", f=1.0, i=1.0, w=1.0, act=10.0, hold=5.0, out=1.0, **extra):
    return {"name": name, "kind": kind, "forward": f, "backward_input": i, "backward_weight": w,
            "activation_mb": act, "w_hold_mb": hold, "output_mb": out, **extra}


def tiny(**top) -> dict:
    layers = [layer("embedding", "embedding", f=0.5, i=0.0, w=0.5, act=1.0, hold=1.0, param_mb=100.0),
              layer("layer.0", param_mb=10.0), layer("layer.1", param_mb=10.0, backward=1.5),
              layer("output", "output", f=3.0, i=2.0, w=2.0, act=30.0, hold=10.0, out=0.0, param_mb=100.0)]
    return {"version": 1, "layers": layers, "p2p_latency": 0.1, **top}


def write(tmp_path, data) -> str:
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


# -- the format and its loader -----------------------------------------------------------------
@pytest.mark.parametrize("edit, field", [
    (lambda d: d["layers"][1].pop("forward"), "layers[1]"),
    (lambda d: d["layers"][2].update(backward_input=-1), "layers[2].backward_input"),
    (lambda d: d["layers"][0].update(kind="lmhead"), "layers[0].kind"),
    (lambda d: d["layers"][3].update(w_hold_mb=99.0), "layers[3].w_hold_mb"),
    (lambda d: d["layers"][1].update(param_mb="big"), "layers[1].param_mb"),
    (lambda d: d["layers"][1].update(colour=1), "layers[1]"),
    (lambda d: d.update(optimizer_bytes_per_param_byte=-3), "optimizer_bytes_per_param_byte"),
    (lambda d: d.update(action_overhead="x"), "action_overhead"),
    (lambda d: d.update(step_overhead_by_placement={"zigzag": 1.0}), "step_overhead_by_placement"),
    (lambda d: d.update(step_overhead_by_placement={"vshape": -1.0}), "step_overhead_by_placement.vshape"),
    (lambda d: d.update(stages=[]), "'stages' and 'layers'"),
    (lambda d: d.update(version=2), "'version'"),
    (lambda d: d.pop("p2p_latency"), "'p2p_latency'"),
])
def test_loader_errors_name_the_file_and_the_field(tmp_path, edit, field):
    data = tiny()
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(ProfileError) as err:
        load_layer_profile(path)
    assert path in str(err.value) and field in str(err.value) and "\n" not in str(err.value)


def test_a_stage_profile_and_a_layer_profile_are_told_apart(tmp_path):
    path = write(tmp_path, tiny())
    with pytest.raises(ProfileError, match="per-layer profile .*--partition"):
        load_profile(path)
    with pytest.raises(ProfileError, match="a stage profile"):
        load_layer_profile("gpt-lmhead-8")


def test_stage_profile_sums_the_layers_and_takes_static_memory_off_the_limit(tmp_path):
    lp = load_layer_profile(write(tmp_path, tiny(memory_limit_mb=1000.0, optimizer_bytes_per_param_byte=3.0)))
    prof = lp.stage_profile([2, 2], 2)
    first, last = prof.stages
    assert (first.forward, first.backward_input, first.backward_weight) == (1.5, 1.0, 1.5)
    assert (first.activation_mb, first.w_hold_mb, first.backward_full) == (11.0, 6.0, None)
    # layer.1 gives its full backward (1.5); the output layer's is I + W (4.0)
    assert last.backward_full == 5.5 and last.activation_mb == 40.0 and last.w_hold_mb == 15.0
    # static memory: param_mb x (1 + 3) over each rank's layers
    assert prof.memory_limit_mb == (1000.0 - 110 * 4, 1000.0 - 110 * 4)
    assert lp.stage_profile([1, 3], 2).memory_limit_mb == (1000.0 - 400, 1000.0 - 120 * 4)
    # v = 2: the interleaved placement puts stages 0 and 2 on rank 0
    assert lp.stage_profile([1, 1, 1, 1], 2).memory_limit_mb == (1000.0 - 110 * 4, 1000.0 - 110 * 4)
    vshape = lp.stage_profile([1, 1, 1, 1], 2, Placement.named("vshape", 2, 2))
    assert vshape.memory_limit_mb == (1000.0 - 200 * 4, 1000.0 - 20 * 4)
    with pytest.raises(ProfileError, match=r"x: memory_limit_mb: .* rank 0 holds 440 MB"):
        LayerProfile(lp.layers, 0.1, 400.0, 3.0, "x").stage_profile([2, 2], 2)


@pytest.mark.parametrize("text, message", [("3,1", "2 counts"), ("2,2,0", "whole number >= 1"),
                                            ("1,1,1", "sum to 3"), ("a,b", "comma-separated")])
def test_bad_partitions_name_the_option(tmp_path, text, message):
    from koala_ds.sim.layers import parse_partition

    with pytest.raises(ProfileError, match=message) as err:
        parse_partition(text, 4, 3)
    assert "--partition" in str(err.value)


def test_uniform_partition_is_the_engines_default():
    lp = load_layer_profile("gpt-largevocab-32L")
    assert lp.uniform_partition(8) == [5, 4, 4, 4, 4, 4, 4, 5]
    assert lp.uniform_partition(4) == [9, 8, 8, 9]
    assert uniform_partition(10, 3, head=1, tail=1) == [4, 3, 3]   # 8 layers: the first stages take one more
    with pytest.raises(ProfileError, match="lower -p or -v"):
        uniform_partition(4, 3, head=1, tail=1)


def test_bundled_layer_profiles_have_a_heavy_lm_head():
    lp = load_layer_profile("gpt-largevocab-32L")
    work = [x.forward + x.backward_input + x.backward_weight for x in lp.layers]
    assert [x.kind for x in lp.layers] == ["embedding"] + ["transformer"] * 32 + ["output"]
    assert 3 <= work[-1] / work[1] <= 4
    assert load_layer_profile("gpt1.3b-24L").num_layers == 26


# -- the engines' settings ----------------------------------------------------------------------
def expand(layout: str) -> list[str]:
    """Megatron-core's documented layout syntax, unrolled (x*n runs; stages split by |)."""
    return [re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), st) for st in layout.split("|")]


def test_megatron_layout_and_deepspeed_parts():
    kinds = ["embedding"] + ["transformer"] * 32 + ["output"]
    part = [6, 5, 5, 4, 4, 4, 4, 2]
    layout = megatron_layout(kinds, part, 8)
    assert layout == "Et*5|t*5|t*5|t*4|t*4|t*4|t*4|tL"
    assert [len(s) for s in expand(layout)] == part and "".join(expand(layout)).count("t") == 32
    assert deepspeed_parts(part) == [0, 6, 11, 16, 20, 24, 28, 32, 34]
    # v = 2: 16 stages in pipeline order (stage c * p + r is chunk c of rank r)
    two = [3] + [2] * 14 + [3]
    assert expand(megatron_layout(kinds, two, 8)) == ["Ett"] + ["tt"] * 14 + ["ttL"]
    with pytest.raises(KoalaError, match="placement vshape"):
        megatron_layout(kinds, two, 8, Placement.named("vshape", 8, 2))
    with pytest.raises(KoalaError, match="kind 'other'"):
        megatron_layout(["embedding", "other", "output"], [2, 1], 2)


# -- the joint lower bound ----------------------------------------------------------------------
def random_layers(rng: random.Random, n: int, limit=None) -> LayerProfile:
    layers = []
    for i in range(n):
        act = rng.uniform(1, 10)
        layers.append(layer(f"l{i}", f=rng.uniform(0.5, 3), i=0.0 if i == 0 else rng.uniform(0.5, 3),
                            w=rng.uniform(0.2, 2), act=act, hold=act * rng.random(), backward=rng.uniform(1, 5),
                            param_mb=rng.uniform(0, 5)))
    data = {"version": 1, "layers": layers, "p2p_latency": rng.choice([0.0, 0.3]),
            "optimizer_bytes_per_param_byte": 1.0}
    if limit:
        data["memory_limit_mb"] = limit
    return LayerProfile.from_dict(data, "random")


def compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0,) + cuts + (n,)
        yield tuple(b[i + 1] - b[i] for i in range(k))


@pytest.mark.parametrize("seed", range(4))
def test_joint_bound_is_below_the_optimum_of_every_split(seed):
    pytest.importorskip("ortools")
    from koala_ds.search import SearchProblem
    from koala_ds.search.exact import solve_exact

    rng = random.Random(seed)
    lp = random_layers(rng, 4, limit=[None, 60.0][seed % 2])
    p, m = 2, 2
    bound = joint_lower_bound(lp, p, m, [Placement.named("linear", p)])
    best = float("inf")
    for part in compositions(4, p):
        try:
            prof = lp.stage_profile(part, p)
            # no limit: a huge one (the search's default would be 1F1B's peak)
            problem = SearchProblem(prof, p, m, 1, "auto", None if prof.memory_limit_mb else 1e9)
        except (ProfileError, KoalaError):
            continue   # no schedule of this split fits
        for pp in problem.parts:
            ex = solve_exact(problem, pp, time_limit=20)
            assert ex.status in ("optimal", "infeasible")
            if ex.optimal:
                best = min(best, ex.objective)
    assert best < float("inf") and bound.value <= best * (1 + 1e-6)


def test_joint_bound_is_below_every_split_with_its_best_predefined_schedule():
    rng = random.Random(7)
    lp = random_layers(rng, 7)
    ps = PartitionSearch(lp, 3, 6, 1)
    bound = joint_lower_bound(ps.lp, 3, 6, ps.placements)
    found = [ps.score(part).best for part in compositions(7, 3)]
    assert bound.value <= min(a.makespan for a in found if a is not None) * (1 + 1e-9)


# -- the joint search --------------------------------------------------------------------------
def test_joint_answer_is_never_slower_than_either_single_sided_answer():
    lp = load_layer_profile("gpt-largevocab-32L")
    res = search_partition(lp, 4, 8, 1, memory_limit=40000.0, time_budget=4.0)
    joint = res.joint
    for side in (res.uniform_predefined, res.uniform_searched, res.split_baseline):
        assert side is not None and joint.makespan <= side.makespan * (1 + 1e-12)
    assert res.bound.value <= joint.makespan * (1 + 1e-9)
    assert res.speedup > 1.05   # the LM head is worth ~3 layers: the uniform split's last stage is the slowest
    # the answer fits each rank's whole memory: static bytes plus the schedule's activations
    prof = load_layer_profile("gpt-largevocab-32L")
    static = prof.rank_static_mb(joint.partition, joint.schedule.placement)
    sim = simulate(joint.schedule, prof.stage_profile(joint.partition, 4, joint.schedule.placement))
    assert all(static[r] + sim.peak_memory_mb[r] <= 40000.0 * (1 + 1e-9) for r in range(4))
    assert sim.makespan == pytest.approx(joint.makespan)


def test_default_memory_limit_is_the_uniform_splits_1f1b_peak_with_static_memory():
    data = load_layer_profile("gpt-largevocab-32L").to_dict()
    data.pop("memory_limit_mb")
    lp = LayerProfile.from_dict(data, "no-limit")
    limit = default_memory_limit(lp, 4, 8, 1)
    ps = PartitionSearch(lp, 4, 8, 1)
    assert ps.limit_source.startswith("1F1B") and ps.lp.memory_limit_mb == limit
    score = ps.score(tuple(lp.uniform_partition(4)))
    assert score.baseline is not None  # 1F1B on the uniform split fits, exactly at the limit on some rank


# -- the command line -------------------------------------------------------------------------
def test_cli_search_auto_with_a_bundled_layer_profile(tmp_path, capsys):
    out = tmp_path / "best.koala"
    assert main(["search", "--profile", "gpt-largevocab-32L", "-p", "4", "-m", "8", "--partition", "auto",
                 "--time-budget", "3", "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^over uniform split \+ best predefined: \d+\.\d\dx$", text, re.M)
    for label in ("uniform split + best predefined", "uniform split + searched", "searched split + 1f1b",
                  "searched split + searched schedule"):
        assert label in text
    split = re.search(r"^split: ([\d,]+)", text, re.M).group(1)
    assert "--pipeline-model-parallel-layout 'E" in text and "parts=[0, " in text
    assert main(["show", str(out), "-p", "4", "-m", "8"]) == 0
    # the split found runs through simulate and search with --partition
    capsys.readouterr()
    assert main(["simulate", str(out), "-m", "8", "--profile", "gpt-largevocab-32L", "--partition", split]) == 0
    assert f"split of gpt-largevocab-32L's 34 layers: {split} (--partition)" in capsys.readouterr().out
    assert main(["compare", "--profile", "gpt-largevocab-32L", "-m", "8", "--partition", split]) == 0
    assert main(["search", "--profile", "gpt-largevocab-32L", "-m", "8", "--partition", split, "--time-budget", "1",
                 "--quiet", "-o", str(tmp_path / "fixed.koala")]) == 0
    assert "run it with:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "1f1b", "--profile", "gpt-lmhead-8", "-m", "8", "--partition", "1,1"], "needs a per-layer profile"),
    (["search", "--profile", "gpt-lmhead-8", "-m", "8", "--partition", "auto"], "needs a per-layer profile"),
    (["simulate", "1f1b", "--profile", "gpt-largevocab-32L", "-m", "8"], "-p is needed"),
    (["search", "--profile", "gpt-largevocab-32L", "-p", "4", "-m", "8", "--partition", "auto", "--exact"],
     "--exact needs one split"),
    (["search", "--profile", "gpt-largevocab-32L", "-p", "4", "-m", "8", "--partition", "auto", "--min-gain", "3"],
     "--min-gain needs one split"),
    (["search", "--profile", "gpt-largevocab-32L", "-p", "4", "-m", "8", "--partition", "9,9,9,9"], "sum to 36"),
])
def test_cli_errors_are_one_line_naming_the_option(tmp_path, capsys, argv, message):
    if argv[0] == "search":
        argv = argv + ["-o", str(tmp_path / "x.koala")]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_limit_no_predefined_schedule_fits_still_gets_a_searched_split_and_schedule():
    # at 18000 MB per rank no library schedule fits any split tried (the embedding and the output
    # layer hold 6.3 GB of static memory each); the split's own bound guides the descents and the
    # schedule search, which repairs memory, finds one that fits
    lp = load_layer_profile("gpt-largevocab-32L")
    res = search_partition(lp, 4, 8, 1, memory_limit=18000.0, time_budget=3.0)
    assert res.uniform_predefined is None
    joint = res.joint
    static = lp.rank_static_mb(joint.partition, joint.schedule.placement)
    sim = simulate(joint.schedule, lp.stage_profile(joint.partition, 4, joint.schedule.placement))
    assert all(static[r] + sim.peak_memory_mb[r] <= 18000.0 * (1 + 1e-9) for r in range(4))


def test_search_partition_errors_name_parameters_the_cli_words_as_flags():
    from koala_ds.commands.search import FLAGS
    from koala_ds.search.partition import search_partition
    from koala_ds.search.problem import SearchError

    lp = load_layer_profile("gpt-largevocab-32L")
    for kwargs, parameter, worded in [({"time_budget": 0.0}, "time_budget", "--time-budget must be"),
                                      ({"m": 0}, "p", "-p, -m and -v must be >= 1")]:
        args = {"p": 4, "m": 8, **kwargs}
        with pytest.raises(SearchError) as exc:
            search_partition(lp, args.pop("p"), args.pop("m"), **args)
        assert exc.value.parameter == parameter and worded in exc.value.worded(FLAGS)


def test_action_overhead_is_added_once_per_stage_not_per_layer():
    plain, extra = LayerProfile.from_dict(tiny()), LayerProfile.from_dict(tiny(action_overhead=0.5))
    a, b = plain.stage_cost(range(0, 3)), extra.stage_cost(range(0, 3))   # three layers, one stage
    assert (b.forward, b.backward_input, b.backward_weight, b.backward) == \
        (a.forward + 0.5, a.backward_input + 0.5, a.backward_weight + 0.5, a.backward + 0.5)
    assert LayerProfile.from_dict(extra.to_dict()) == extra


def test_a_placement_s_own_step_overhead_reaches_every_split_its_makespans_and_the_joint_bound():
    """A per-layer profile carries `step_overhead_by_placement` as a stage profile does (it was refused
    as an unknown field): each split's stage profile has it, a schedule's makespan pays its own
    placement's value, and the joint bound adds the placement's value (it added none)."""
    lp = LayerProfile.from_dict(tiny(step_overhead=1.0, step_overhead_by_placement={"vshape": 5.0}))
    assert LayerProfile.from_dict(lp.to_dict()) == lp and lp.step_overhead_of("vshape") == 5.0
    bare = dataclasses.replace(lp, step_overhead=0.0, step_overhead_by_placement=())
    vshape, inter = Placement.named("vshape", 2, 2), Placement.named("interleaved", 2, 2)
    for name, placement, own in (("zb-v", vshape, 5.0), ("interleaved-1f1b", inter, 1.0)):
        schedule = load_schedule(name, 2, 4, 2)
        assert schedule.placement.style == placement.style
        with_own = lp.stage_profile([1, 1, 1, 1], 2, placement)
        assert with_own.step_overhead_of(placement.style) == own
        plain = simulate(schedule, bare.stage_profile([1, 1, 1, 1], 2, placement)).makespan
        assert simulate(schedule, with_own).makespan == pytest.approx(plain + own)
        assert joint_lower_bound(lp, 2, 4, [placement]).value == \
            pytest.approx(joint_lower_bound(bare, 2, 4, [placement]).value + own)
        assert joint_lower_bound(lp, 2, 4, [placement]).value <= simulate(schedule, with_own).makespan


@pytest.mark.parametrize("given, source", [(["--memory-limit", "20000"], "--memory-limit 20000 MB per rank"),
                                           ([], "the profile 140000 MB per rank")])
def test_search_of_one_split_says_where_its_activation_limit_comes_from(tmp_path, capsys, given, source):
    """The limit shown is the roomiest rank's activation memory (the whole limit less static memory):
    it was labelled "(the profile)" when the user had given --memory-limit."""
    lp = load_layer_profile("gpt1.3b-24L")
    assert lp.memory_limit_mb == 140000
    assert main(["search", "--profile", "gpt1.3b-24L", "-p", "2", "-m", "4", *given, "--generations", "1",
                 "-o", str(tmp_path / "x.koala")]) == 0
    text = capsys.readouterr().out
    whole = float(given[1]) if given else lp.memory_limit_mb
    limited = dataclasses.replace(lp, memory_limit_mb=whole)
    limit = max(x for x in limited.stage_profile(uniform_partition(lp.num_layers, 2), 2).memory_limit_mb)
    assert limit < whole
    searching = re.search(r"^searching .*memory limit ([\d.]+) MB \(([^)]*)\)", text, re.M)
    assert searching and float(searching.group(1)) == pytest.approx(limit, rel=1e-5)
    assert searching.group(2) == f"{source}, less its parameters and optimizer state; the roomiest rank"
    assert re.search(rf"^lower bound .* per rank \({re.escape(searching.group(2))}\)", text, re.M)


def test_a_whole_memory_limit_too_small_for_one_split_is_answered_in_whole_memory(tmp_path, capsys):
    """It said "raise --memory-limit to at least 6160.37 MB": a rank's activation need, which as
    --memory-limit (the whole memory of a rank, per-layer profile) is below its static memory."""
    argv = ["search", "--profile", "gpt1.3b-24L", "-p", "2", "-m", "4", "--generations", "1", "--quiet",
            "-o", str(tmp_path / "x.koala"), "--memory-limit"]
    assert main(argv + ["13000"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "for activations after its parameters and optimizer state" in err, err
    least = re.search(r"raise --memory-limit to at least ([\d.]+) MB, or -p$", err)
    assert least and float(least.group(1)) > 13000, err
    assert main(argv + [least.group(1)]) == 0  # enough: the rank furthest short is the one named
    assert main(argv + [f"{float(least.group(1)) - 0.01:.2f}"]) != 0


@pytest.mark.parametrize("command", [["simulate", "1f1b"], ["compare"], ["search", "-o", "x.koala"]])
def test_an_empty_partition_is_refused_not_taken_for_the_uniform_split(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--profile", "gpt-largevocab-32L", "-p", "4", "-m", "8", "--partition", " "])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "argument --partition: is empty: give the layers per virtual stage, N,N,..., or drop it" in err


def test_the_search_apis_name_their_parameter_where_the_cli_names_its_flag(capsys, tmp_path):
    """search_partition(memory_limit=10) and SearchProblem(memory_limit=...) said '--memory-limit'
    to an API caller; the CLI still says --memory-limit."""
    from koala_ds.search import SearchError, SearchProblem
    from koala_ds.sim import CostProfile

    lp = load_layer_profile("gpt-largevocab-32L")
    with pytest.raises(SearchError) as exc:
        search_partition(lp, p=8, m=8, memory_limit=10)
    assert "(`memory_limit`)" in str(exc.value) and "--memory-limit" not in str(exc.value)
    assert SearchProblem(CostProfile.uniform(4), 4, 4, memory_limit=1000).memory_limit_source == "`memory_limit`"
    assert main(["search", "--profile", "uniform-4", "-m", "8", "--memory-limit", "300", "--generations", "1",
                 "-o", str(tmp_path / "x.koala")]) == 0
    out = capsys.readouterr().out
    assert "memory limit 300 MB (--memory-limit)" in out and "`memory_limit`" not in out
