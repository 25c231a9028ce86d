"""The lowered tables (koala_ds/core/lowered.py): one op table, action codes, the dependency slots and
the async timing loop, checked against the rules written out here from the placement alone."""
from __future__ import annotations

import random

import pytest

from koala_ds.dsl import parser
from koala_ds.core.ir import OP_INDEX, OP_NAMES, OPS, Action, Op, OpIndex, Placement, Schedule, ScheduleError
from koala_ds.core.lowered import Lowered, Stall, action_code, lower, split_code
from koala_ds.sim.timing import costed
from koala_ds.sim import CostProfile, StageCost, random_schedule
from koala_ds.core.validate import validate

PLACEMENTS = [Placement.named("linear", 4, 1), Placement.named("interleaved", 3, 2), Placement.named("vshape", 4, 2),
              Placement.named("bidirectional", 4, 1), Placement.named("vshape", 2, 3)]


def _profile(S: int, seed: int, latency: float = 0.25) -> CostProfile:
    rng = random.Random(seed)
    stages = tuple(StageCost(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.1, 1.5), rng.uniform(1, 9), 0.5,
                             rng.choice([None, rng.uniform(0.5, 3)])) for _ in range(S))
    return CostProfile(stages, latency)


def test_one_op_table():
    assert [OPS[k] for k in OpIndex] == [Op.F, Op.B, Op.I, Op.W]
    assert all(OPS[OP_INDEX[op]] is op for op in Op)
    assert OP_NAMES == ("F", "B", "I", "W") and parser.OPS == set(OP_NAMES)
    S, m = 5, 7
    codes = [action_code(k, s, mb, S, m) for k in OpIndex for s in range(S) for mb in range(m)]
    assert codes == list(range(4 * S * m))   # dense, op-major
    assert [split_code(c, S, m) for c in codes] == [(k, s, mb) for k in OpIndex for s in range(S) for mb in range(m)]
    low = Lowered(Placement.named("vshape", 2, 2), 3, "split")
    assert all(low.code(low.decode(c)) == c for c in range(low.ncodes))
    schedule = random_schedule(Placement.named("vshape", 2, 2), 3, "split", seed=0)
    lowered, codes = lower(schedule)
    assert (lowered.p, lowered.m, lowered.v) == (2, 3, 2)
    assert [[lowered.decode(c) for c in order] for order in codes] == [list(order) for order in schedule.ranks]
    with pytest.raises(ScheduleError, match="out of range"):
        low.code(Action(Op.F, 4, 0))


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda pl: f"{pl.describe()}-p{pl.p}")
@pytest.mark.parametrize("backward", ["full", "split"])
def test_dependency_slots_follow_the_placement(placement, backward):
    m = 4
    S = placement.num_stages
    low = costed(placement, m, backward, _profile(S, 1))
    rank = placement.rank_of
    fwd, grad = (lambda s, mb: s * m + mb), (lambda s, mb: S * m + s * m + mb)
    for s in range(S):
        prev, nxt = placement.prev_stage(s), placement.next_stage(s)
        for mb in range(m):
            f, b, i, w = (action_code(k, s, mb, S, m) for k in (OpIndex.F, OpIndex.B, OpIndex.I, OpIndex.W))
            assert low.dep[f] == (-1 if prev is None else fwd(prev, mb))
            assert low.out[f] == (-1 if nxt is None else fwd(s, mb))
            for c in (b, i):   # B and I wait for the same gradient and send the same one
                assert low.dep[c] == (-1 if nxt is None else grad(nxt, mb))
                assert low.out[c] == (-1 if prev is None else grad(s, mb))
            assert low.dep[w] == low.out[w] == -1
            if prev is not None:
                assert low.dep_cross[f] == (rank(prev) != rank(s)) == low.out_cross[b]
                assert low.out_rank[b] == rank(prev) and low.dep_lat[f] == (0.25 if rank(prev) != rank(s) else 0.0)
            if nxt is not None:
                assert low.out_cross[f] == (rank(nxt) != rank(s)) == low.dep_cross[i]
                assert low.out_rank[f] == rank(nxt) and low.out_lat[f] == (0.25 if rank(nxt) != rank(s) else 0.0)
            assert {low.rank_of[c] for c in (f, b, i, w)} == {rank(s)}
            assert low.passes[s, mb] == (mb in placement.microbatches_of(s, m))
        # per group: the same dependencies, local ones included, the gradient from the mode's backward
        bk = OpIndex.I if backward == "split" else OpIndex.B
        assert low.inputs_of(OpIndex.F, s) == (() if prev is None else ((OpIndex.F, prev, rank(prev) != rank(s)),))
        assert low.inputs_of(bk, s) == ((OpIndex.F, s, False),) + (
            () if nxt is None else ((bk, nxt, rank(nxt) != rank(s)),))
        assert low.inputs_of(OpIndex.W, s) == ((OpIndex.I, s, False),)


def _reference_starts(schedule: Schedule, profile: CostProfile) -> list[list[float]]:
    """Start times by the rules alone: a rank runs its order one action at a time; an action
    starts when its rank is free and its data inputs (F(s) <- F(prev); I/B(s) <- the I or B of
    next(s)) have arrived, `p2p_latency` after their end when they come from another rank."""
    pl, lat = schedule.placement, profile.p2p_latency
    costs = profile.stage_costs(pl.num_stages, pl.pipelines)
    dur = {Op.F: lambda c: c.forward, Op.B: lambda c: c.backward, Op.I: lambda c: c.backward_input,
           Op.W: lambda c: c.backward_weight}
    end: dict[tuple[str, int, int], float] = {}
    starts = [[0.0] * len(order) for order in schedule.ranks]
    for _ in range(schedule.num_actions + 1):   # longest paths of a DAG: at most one pass per action
        changed = False
        for r, order in enumerate(schedule.ranks):
            t = 0.0
            for i, a in enumerate(order):
                s, mb = a.stage, a.microbatch
                src = pl.prev_stage(s) if a.op is Op.F else (pl.next_stage(s) if a.op is not Op.W else None)
                if src is not None:
                    arrival = end.get(("F" if a.op is Op.F else "G", src, mb), 0.0)
                    t = max(t, arrival + (lat if pl.rank_of(src) != r else 0.0))
                changed |= starts[r][i] != t
                starts[r][i] = t
                t += dur[a.op](costs[s])
                end[("F" if a.op is Op.F else "G" if a.op is not Op.W else "W", s, mb)] = t
        if not changed:
            return starts
    raise AssertionError("the reference did not settle")


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda pl: f"{pl.describe()}-p{pl.p}")
def test_async_timing_matches_the_rules(placement):
    for seed in range(6):
        backward = "split" if seed % 2 else "full"
        schedule = random_schedule(placement, 5, backward, seed=seed, split_probability=0.7)
        profile = _profile(placement.num_stages, seed)
        low = costed(placement, 5, backward, profile)
        res = low.try_times(low.encode(schedule.ranks))
        assert not isinstance(res, Stall)
        free, starts = res
        ref = _reference_starts(schedule, profile)
        assert [len(x) for x in starts] == [len(x) for x in ref]
        for got, want in zip(starts, ref):
            assert got == pytest.approx(want, abs=1e-9)


def test_unit_lowering_is_the_dry_run():
    """Without a profile every action lasts 1 and an activation counts 1 until its I or B."""
    placement = Placement.named("linear", 2, 1)
    low = Lowered(placement, 2, "split")
    assert set(low.dur) == {1.0} and low.latency == 0.0
    deltas = {OPS[split_code(c, 2, 2)[0]]: float(low.mem[c]) for c in range(low.ncodes)}
    assert deltas == {Op.F: 1.0, Op.B: -1.0, Op.I: -1.0, Op.W: 0.0}


def test_validate_names_where_each_rank_waits_in_a_deadlock():
    pl = Placement.named("linear", 2, 1)
    F, B = Op.F, Op.B
    r0 = (Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1))
    r1 = (Action(F, 1, 0), Action(F, 1, 1), Action(B, 1, 0), Action(B, 1, 1))
    with pytest.raises(ScheduleError) as err:
        validate(Schedule(2, 2, 1, pl, (r0, r1), "full", "x"))
    assert "deadlock with non-blocking sends and blocking receives: rank 0 waits at 0B0 for 1B0; " \
           "rank 1 waits at 1F1 for 0F1" in str(err.value)
    ok = validate(Schedule(2, 2, 1, pl, (r0[:1] + r0[2:3] + r0[1:2] + r0[3:], r1), "full", "y"))
    assert ok.steps == [[0, 1, 4, 5], [1, 2, 3, 4]] and ok.makespan == 6 and ok.peak_in_flight == [2, 2]


def test_rendezvous_steps_report_the_blocked_sends():
    """Blocking sends run as added post/send steps in the one timing loop; the results speak of
    the orders' own actions: starts per action, how far each rank got, the slot it is sending."""
    placement, m = Placement.named("linear", 2, 1), 2
    profile = CostProfile((StageCost(1.0, 1.5, 0.5, 10.0, 4.0), StageCost(2.0, 2.0, 1.0, 20.0, 5.0)), 0.5)
    low = costed(placement, m, "full", profile)
    ranks = [[Action.parse(x) for x in r.split()] for r in ("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1")]
    free, starts, pos, sending = low.run_rendezvous(low.encode(ranks), record=True)
    # 0F0 [0,1] is received at once (rank 1 posted at 0): rank 0 free at 1.5; 0F1 [1.5,2.5] then
    # waits in its send for 1F1, behind 1B0 [3.5,6.5], whose send waits for 0B0: a deadlock.
    assert starts == [[0.0, 1.5], [1.5, 3.5]]
    assert pos == [2, 2]
    assert sending == [low.out[low.code(Action.parse("0F1"))], low.out[low.code(Action.parse("1B0"))]]
    assert sending == [0 * m + 1, 2 * m + 1 * m + 0]
    ranks[1] = [Action.parse(x) for x in "1F0 1F1 1B0 1B1".split()]
    free, starts, pos, sending = low.run_rendezvous(low.encode(ranks), record=False)
    assert (free, starts, pos, sending) == ([15.0, 13.0], [[], []], [4, 4], [-1, -1])
