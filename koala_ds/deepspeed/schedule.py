"""Compile one rank's part of a Koala `Schedule` into DeepSpeed pipeline instructions.

DeepSpeed's `PipelineEngine` executes `PipeSchedule.steps()`: lists of `PipeInstruction`s whose
keyword arguments are passed to the engine's handlers. `KoalaPipeSchedule` turns the rank's
ordered action list (F, B, I, W on virtual stages) into such steps, inserting the
communication implied by the dependencies:

    F(s, mb):  LoadMicroBatch (first / last stage) or RecvActivation, ForwardPass, SendActivation
    B(s, mb):  RecvGrad, BackwardPass, SendGrad
    I(s, mb):  RecvGrad, BackwardInputPass, SendGrad       (input gradient only)
    W(s, mb):  BackwardWeightPass                          (deferred weight gradient)
    end:       WaitSends, ReduceTiedGrads, ReduceGrads, OptimizerStep

Every instruction carries `stage=` and `microbatch=` so that the engine knows the chunk, the
peer and the message tag. Buffer slots are taken at a forward and given back at the
backward that produces the input gradient (B or I), so `num_pipe_buffers()` is the rank's
peak number of microbatches in flight, not m. Nothing here imports torch beyond DeepSpeed's
own instruction classes.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction,
                                             PipeSchedule, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad)

from ..ir import Op, Placement, Schedule

__all__ = ["KoalaPipeSchedule", "KoalaInferenceSchedule", "BackwardInputPass", "BackwardWeightPass", "WaitSends",
           "Message", "messages_between"]


class BackwardInputPass(ds_schedule.BufferOpInstruction):
    """Backward for the stage inputs only (the I of zero-bubble schedules); the weight
    gradient is kept for a later :class:`BackwardWeightPass` of the same stage and microbatch."""


class BackwardWeightPass(PipeInstruction):
    """The deferred weight-gradient step (W) of `stage`, `microbatch`."""


class WaitSends(PipeInstruction):
    """Wait (with the engine's timeout) for every non-blocking send still in flight."""


class _Slots:
    """Lowest-free-index buffer allocator that remembers its peak."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.next = 0
        self.held: dict[tuple[int, int], int] = {}

    def take(self, key: tuple[int, int]) -> int:
        if self.free:
            self.free.sort()
            slot = self.free.pop(0)
        else:
            slot, self.next = self.next, self.next + 1
        self.held[key] = slot
        return slot

    def get(self, key: tuple[int, int]) -> int:
        return self.held[key]

    def give(self, key: tuple[int, int]) -> None:
        self.free.append(self.held.pop(key))


def _compile_train(schedule: Schedule, rank: int) -> tuple[list[list[PipeInstruction]], int]:
    placement = schedule.placement
    slots = _Slots()
    steps: list[list[PipeInstruction]] = []
    for action in schedule.ranks[rank]:
        s, mb = action.stage, action.microbatch
        kw = {"stage": s, "microbatch": mb}
        first, last = placement.prev_stage(s) is None, placement.is_last(s)
        cmds: list[PipeInstruction] = []
        if action.op is Op.F:
            buf = slots.take((s, mb))
            if first or last:
                cmds.append(LoadMicroBatch(buf, **kw))
            if not first:
                cmds.append(RecvActivation(buf, **kw))
            cmds.append(ForwardPass(buf, **kw))
            if not last:
                cmds.append(SendActivation(buf, **kw))
        elif action.op in (Op.B, Op.I):
            buf = slots.get((s, mb))
            if not last:
                cmds.append(RecvGrad(buf, **kw))
            cmds.append((BackwardPass if action.op is Op.B else BackwardInputPass)(buf, **kw))
            if not first:
                cmds.append(SendGrad(buf, **kw))
            slots.give((s, mb))
        else:  # W
            cmds.append(BackwardWeightPass(**kw))
        steps.append(cmds)
    steps.append([WaitSends(), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
    return steps, max(1, slots.next)


def _compile_inference(placement: Placement, micro_batches: int, rank: int) -> list[list[PipeInstruction]]:
    """Forward only, microbatch-major: for mb, for each chunk of the rank in pipeline order.
    Every dependency goes from (mb, s-1) to (mb, s), so this order never deadlocks."""
    steps: list[list[PipeInstruction]] = []
    for mb in range(micro_batches):
        for s in placement.stages_of(rank):
            kw = {"stage": s, "microbatch": mb}
            first, last = placement.prev_stage(s) is None, placement.is_last(s)
            cmds: list[PipeInstruction] = []
            if first or last:
                cmds.append(LoadMicroBatch(0, **kw))
            if not first:
                cmds.append(RecvActivation(0, **kw))
            cmds.append(ForwardPass(0, **kw))
            if not last:
                cmds.append(SendActivation(0, **kw))
            steps.append(cmds)
    steps.append([WaitSends()])
    return steps


class KoalaPipeSchedule(PipeSchedule):
    """The training instruction stream of pipeline rank `stage_id` for a Koala `Schedule`.

    `stages` is the number of pipeline ranks (DeepSpeed's meaning), `micro_batches` the
    gradient accumulation steps; both must equal the schedule's p and m.
    """

    def __init__(self, schedule: Schedule, stage_id: int) -> None:
        super().__init__(schedule.m, schedule.p, stage_id)
        self.schedule = schedule
        self._steps, self._buffers = _compile_train(schedule, stage_id)

    def steps(self):
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        """Peak number of microbatches in flight on this rank (F done, input gradient not yet)."""
        return self._buffers


class KoalaInferenceSchedule(PipeSchedule):
    """Forward-only instruction stream for `eval_batch` on any single-pipeline placement."""

    def __init__(self, placement: Placement, micro_batches: int, stage_id: int) -> None:
        super().__init__(micro_batches, placement.p, stage_id)
        self._steps = _compile_inference(placement, micro_batches, stage_id)

    def steps(self):
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        return 1


@dataclass(frozen=True)
class Message:
    """One point-to-point message implied by a schedule (for order checks)."""

    kind: str  # "act" or "grad"
    stage: int  # the receiving virtual stage
    microbatch: int


def messages_between(schedule: Schedule, src: int, dst: int) -> tuple[list[Message], list[Message]]:
    """(order in which rank `src` sends to `dst`, order in which `dst` receives from `src`).

    Backends that match point-to-point messages by order only (NCCL) need the two equal."""
    placement = schedule.placement

    def sends(rank: int) -> list[Message]:
        out = []
        for a in schedule.ranks[rank]:
            if a.op is Op.F and not placement.is_last(a.stage):
                nxt = a.stage + 1
                if placement.rank_of(nxt) == dst:
                    out.append(Message("act", nxt, a.microbatch))
            elif a.op in (Op.B, Op.I) and placement.prev_stage(a.stage) is not None:
                prv = a.stage - 1
                if placement.rank_of(prv) == dst:
                    out.append(Message("grad", prv, a.microbatch))
        return out

    def recvs(rank: int) -> list[Message]:
        out = []
        for a in schedule.ranks[rank]:
            if a.op is Op.F and placement.prev_stage(a.stage) is not None:
                if placement.rank_of(a.stage - 1) == src:
                    out.append(Message("act", a.stage, a.microbatch))
            elif a.op in (Op.B, Op.I) and not placement.is_last(a.stage):
                if placement.rank_of(a.stage + 1) == src:
                    out.append(Message("grad", a.stage, a.microbatch))
        return out

    return sends(src), recvs(dst)
