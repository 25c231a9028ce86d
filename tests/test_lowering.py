"""The lowering pass (koala_ds.runtime.lowering): explicit SEND / RECV per rank, checked without torch."""
from __future__ import annotations

import random

import pytest

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.core.ir import Action, Op, Placement, ScheduleError, schedule_from_ranks
from koala_ds.runtime.lowering import (ACT, COMPUTE, GRAD, RECV, RECV_LOOKAHEAD, SEND, LookaheadSettingError,
                                      Lowered, Message, Step, check_lowered, lower, received_message,
                                      recv_lookahead)
from koala_ds.sim.random_schedule import random_schedule
from koala_ds.core.validate import validate

GRID = [(1, 3, 1), (2, 1, 1), (2, 3, 1), (2, 4, 2), (3, 7, 2), (4, 8, 1), (4, 6, 2), (4, 8, 3), (8, 16, 1), (4, 16, 2)]


def _library_cases():
    for name in library.names():
        for p, m, v in GRID:
            if library.get(name).supports(p, m, v) is None:
                yield name, p, m, v


def _check_all(schedule) -> None:
    """Channel orders agree, each compute is preceded by the receive of its input, the streams run."""
    for forward_only in (False, True):
        for lookahead in (0, 1, 2, None):
            lowered = lower(schedule, forward_only, lookahead)
            _check_shape(lowered)
            check_lowered(lowered)
            if lookahead == 0:
                check_lowered(lowered, blocking_recv=True)


def _check_shape(lowered: Lowered) -> None:
    schedule = lowered.schedule
    for src in range(schedule.p):
        for dst in range(schedule.p):
            sent, posted = lowered.channel(src, dst)
            assert sent == posted, (src, dst)
    for rank, steps in enumerate(lowered.ranks):
        computes = [st.action for st in steps if st.kind == COMPUTE]
        assert computes == [a for a in schedule.ranks[rank] if a.op is Op.F or not lowered.forward_only]
        received = set()
        for i, st in enumerate(steps):
            if st.kind == RECV:
                received.add(st.message)
            elif st.kind == COMPUTE:
                need = received_message(schedule, rank, st.action)
                assert need is None or need[1] in received, (rank, st.action)
                if lowered.lookahead == 0 and i and steps[i - 1].kind == RECV:  # right before its consumer
                    assert need is not None and steps[i - 1].peer == need[0]


@pytest.mark.parametrize("name, p, m, v", list(_library_cases()))
def test_every_library_schedule_lowers_to_agreeing_deadlock_free_streams(name, p, m, v):
    _check_all(load_schedule(name, p, m, v))


@pytest.mark.parametrize("seed", range(60))
def test_random_valid_schedules_lower_to_agreeing_deadlock_free_streams(seed):
    rng = random.Random(seed)
    style = rng.choice(["linear", "interleaved", "vshape", "bidirectional"])
    p = rng.randint(1, 5)
    v = 1 if style in ("linear", "bidirectional") else rng.randint(1, 3)
    placement = Placement.named(style, p, v)
    schedule = random_schedule(placement, rng.randint(1, 8), rng.choice(["full", "split"]), seed=rng,
                               split_probability=0.7)
    validate(schedule)
    _check_all(schedule)


def _crossing_schedule():
    """pp=2, v=2 interleaved: rank 0 sends activations (0->1) and gradients (2->1) to rank 1, and
    rank 1 needs them in another order than rank 0 sends them."""
    pl = Placement.named("interleaved", 2, 2)  # stages 0,2 on rank 0; 1,3 on rank 1
    F, B = Op.F, Op.B
    r0 = [Action(F, 0, 0), Action(F, 0, 1), Action(F, 2, 0), Action(F, 0, 2), Action(F, 2, 1), Action(B, 2, 0),
          Action(F, 0, 3), Action(B, 2, 1), Action(F, 2, 2), Action(B, 0, 0), Action(B, 2, 2), Action(F, 2, 3),
          Action(B, 0, 1), Action(B, 2, 3), Action(B, 0, 2), Action(B, 0, 3)]
    r1 = [Action(F, 1, 0), Action(F, 1, 1), Action(F, 3, 0), Action(B, 3, 0), Action(F, 3, 1), Action(B, 3, 1),
          Action(B, 1, 0), Action(F, 1, 2), Action(F, 3, 2), Action(B, 3, 2), Action(B, 1, 1), Action(F, 1, 3),
          Action(F, 3, 3), Action(B, 3, 3), Action(B, 1, 2), Action(B, 1, 3)]
    schedule = schedule_from_ranks("crossing", pl, 4, [r0, r1])
    validate(schedule)
    return schedule


def test_a_shared_channel_is_received_in_the_senders_order_not_the_consumers():
    schedule = _crossing_schedule()
    lowered = lower(schedule, lookahead=0)
    sent, posted = lowered.channel(0, 1)
    need = [received_message(schedule, 1, a)[1] for a in schedule.ranks[1] if received_message(schedule, 1, a)]
    need = [msg for msg in need if msg in set(sent)]
    assert {msg.kind for msg in sent} == {ACT, GRAD}
    assert sorted(need) == sorted(sent) and need != sent  # the crossing order-matched p2p must survive
    assert posted == sent
    check_lowered(lowered, blocking_recv=True)


def test_the_check_catches_a_receive_posted_out_of_the_senders_order():
    lowered = lower(_crossing_schedule(), lookahead=0)
    steps = list(lowered.ranks[1])
    recvs = [i for i, st in enumerate(steps) if st.kind == RECV and st.peer == 0]
    i, j = next((a, b) for a, b in zip(recvs, recvs[1:]) if steps[a].message.kind != steps[b].message.kind)
    steps[i], steps[j] = steps[j], steps[i]
    broken = Lowered(lowered.schedule, False, 0, (lowered.ranks[0], tuple(steps)))
    with pytest.raises(ScheduleError, match="expects|before posting"):
        check_lowered(broken)


def test_the_check_catches_a_consumer_before_its_receive_and_a_deadlock():
    schedule = load_schedule("1f1b", 2, 1)
    lowered = lower(schedule, lookahead=0)
    no_recv = tuple(st for st in lowered.ranks[1] if st.kind != RECV)
    with pytest.raises(ScheduleError, match="before posting the receive"):
        check_lowered(Lowered(schedule, False, 0, (lowered.ranks[0], no_recv)))
    # rank 0 sends its first activation only after its first backward: nobody can start
    r0 = list(lowered.ranks[0])
    first_send = next(i for i, st in enumerate(r0) if st.kind == SEND)
    moved = r0.pop(first_send)
    r0.insert(next(i for i, st in enumerate(r0) if st.kind == COMPUTE and st.action.op is Op.B) + 1, moved)
    with pytest.raises(ScheduleError, match="deadlocks"):
        check_lowered(Lowered(schedule, False, 0, (tuple(r0), lowered.ranks[1])))


def test_blocking_receives_need_lookahead_zero():
    """Why an engine that blocks at a RECV (to learn a shape first) lowers with lookahead 0:
    posted two actions early, interleaved-1f1b's receive of stage 2's input would wait for
    rank 1's forward, which waits for rank 0's."""
    schedule = load_schedule("interleaved-1f1b", 2, 4, 2)
    check_lowered(lower(schedule, lookahead=2))
    with pytest.raises(ScheduleError, match="deadlocks"):
        check_lowered(lower(schedule, lookahead=2), blocking_recv=True)
    check_lowered(lower(schedule, lookahead=0), blocking_recv=True)


def test_sends_follow_their_producer_and_local_hand_offs_are_not_messages():
    schedule = load_schedule("zb-v", 2, 4, 2)  # the V turns on rank 1: stages 1 -> 2 stay local
    lowered = lower(schedule)
    for rank, steps in enumerate(lowered.ranks):
        for i, st in enumerate(steps):
            if st.kind == SEND:
                assert steps[i - 1].kind == COMPUTE
                assert schedule.placement.rank_of(st.message.stage) == st.peer != rank
    assert Message(ACT, 2, 0) not in {st.message for steps in lowered.ranks for st in steps}
    assert lowered.channels() == [(0, 1), (1, 0)]


def test_messages_nobody_sends_or_uses_are_refused():
    pl = Placement.named("linear", 2)
    F, B = Op.F, Op.B
    lonely = schedule_from_ranks("x", pl, 1, [[Action(F, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]])
    with pytest.raises(ScheduleError, match="never uses it|no action"):
        lower(lonely)
    orphan = schedule_from_ranks("y", pl, 1, [[], [Action(F, 1, 0)]])
    with pytest.raises(ScheduleError, match="no action of rank 0 sends"):
        lower(orphan)


def test_steps_print_as_actions_and_messages():
    assert str(Step(COMPUTE, action=Action(Op.I, 3, 7))) == "3I7"
    assert str(Step(SEND, message=Message(GRAD, 2, 1), peer=0)) == "SEND grad 2/1 -> 0"


def test_the_lowering_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, koala_ds.runtime.lowering; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- how far ahead the engines post their receives -----------------------------------------
@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("zb-v", 2, 2), ("interleaved-1f1b", 2, 2)])
def test_lookahead_none_posts_every_receive_before_the_first_compute(name, p, v):
    schedule = load_schedule(name, p, 8, v)
    lowered = lower(schedule, lookahead=None)
    check_lowered(lowered)
    for rank, steps in enumerate(lowered.ranks):
        first = next(i for i, st in enumerate(steps) if st.kind == COMPUTE)
        receives = [i for i, st in enumerate(steps) if st.kind == RECV]
        assert receives and max(receives) < first, rank
        assert len(receives) == len([st for st in lower(schedule).ranks[rank] if st.kind == RECV])


def test_recv_lookahead_is_all_on_gloo_and_the_environment_overrides_it():
    assert recv_lookahead(True, {}) is None
    assert recv_lookahead(False, {}) == RECV_LOOKAHEAD
    assert recv_lookahead(False, {"KOALA_RECV_LOOKAHEAD": "all"}) is None
    assert recv_lookahead(True, {"KOALA_RECV_LOOKAHEAD": " 3 "}) == 3
    assert recv_lookahead(True, {"KOALA_RECV_LOOKAHEAD": ""}) is None
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(LookaheadSettingError) as err:
            recv_lookahead(True, {"KOALA_RECV_LOOKAHEAD": bad})
        assert str(err.value).startswith(f"KOALA_RECV_LOOKAHEAD={bad!r}") and "\n" not in str(err.value)


def test_a_bad_recv_lookahead_stops_both_engines_before_training(monkeypatch):
    """One line naming KOALA_RECV_LOOKAHEAD, from DeepSpeed's config reading and Megatron's launch check."""
    pytest.importorskip("torch")
    import argparse

    from koala_ds.deepspeed.config import KoalaConfigError, KoalaPipelineConfig
    from koala_ds.megatron import MegatronScheduleError, add_arguments, install

    with pytest.raises(KoalaConfigError, match=r"^KOALA_RECV_LOOKAHEAD='soon': .*'all'"):
        KoalaPipelineConfig.from_pipeline_section({}, env={"KOALA_RECV_LOOKAHEAD": "soon"})
    assert KoalaPipelineConfig.from_pipeline_section({}, env={"KOALA_RECV_LOOKAHEAD": "all"}).schedule is None
    monkeypatch.setenv("KOALA_RECV_LOOKAHEAD", "-2")
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", "koala", "--koala-schedule", "1f1b"])
    with pytest.raises(MegatronScheduleError, match=r"^KOALA_RECV_LOOKAHEAD='-2'"):
        install(args)
