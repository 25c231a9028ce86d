"""One rank's part of a Koala `Schedule` as DeepSpeed pipeline instructions.

DeepSpeed's `PipelineEngine` executes `PipeSchedule.steps()`: lists of `PipeInstruction`s whose
keyword arguments are passed to the engine's handlers. `KoalaPipeSchedule` translates the
rank's lowered stream (`koala_ds.runtime.lowering`: compute actions with SEND / RECV in issue order,
every channel's receives in its sender's order), one instruction per step:

    RECV act / grad:  RecvActivation / RecvGrad     (posts the receive)
    F(s, mb):         LoadMicroBatch (first / last stage), ForwardPass (waits for its input)
    B(s, mb):         BackwardPass                  (waits for its output gradient)
    I(s, mb):         BackwardInputPass             (input gradient only)
    W(s, mb):         BackwardWeightPass            (deferred weight gradient)
    SEND act / grad:  SendActivation / SendGrad     (non-blocking)
    end:              WaitSends, ReduceTiedGrads, ReduceGrads, OptimizerStep

Each step of `steps()` is one compute action with the receives posted before it and the send
after it. Every instruction carries `stage=` and `microbatch=`; the communication and compute
instructions carry the `message` (a `koala_ds.runtime.lowering.Message`) they post, send or wait for
(None for a compute action whose input is local) and the communication ones the `peer`
pipeline rank. Messages between stages of the same rank are not in the stream: the compute
instructions hand them over. Buffer slots are taken at a forward and given back at the
backward that produces the input gradient (B or I), so `num_pipe_buffers()` is the rank's peak
number of microbatches in flight, not m. Nothing here imports torch beyond DeepSpeed's own
instruction classes.
"""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction,
                                             PipeSchedule, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad)

from ..core.ir import Action, Op, Placement, Schedule
from ..runtime.lowering import ACT, COMPUTE, RECV, RECV_LOOKAHEAD, Step, lower, received_message

__all__ = ["KoalaPipeSchedule", "KoalaInferenceSchedule", "BackwardInputPass", "BackwardWeightPass", "WaitSends"]


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


def _slots(actions) -> tuple[dict[tuple[int, int], int], int]:
    """Buffer slot of each (stage, microbatch) of the rank's forwards, and the number of slots."""
    slots = _Slots()
    out = {}
    for a in actions:
        if a.op is Op.F:
            out[(a.stage, a.microbatch)] = slots.take((a.stage, a.microbatch))
        elif a.op is not Op.W and (a.stage, a.microbatch) in slots.held:
            slots.give((a.stage, a.microbatch))
    return out, max(1, slots.next)


_COMPUTE = {Op.F: ForwardPass, Op.B: BackwardPass}


def _compile(schedule: Schedule, rank: int, steps: tuple[Step, ...], slot: dict) -> list[list[PipeInstruction]]:
    """The lowered `steps` of `rank` as instruction lists, one per compute action (see the module docstring)."""
    placement = schedule.placement
    out: list[list[PipeInstruction]] = []
    cmds: list[PipeInstruction] = []
    for st in steps:
        if st.kind == COMPUTE:
            a = st.action
            s, mb = a.stage, a.microbatch
            if a.op is Op.W:
                cmds.append(BackwardWeightPass(stage=s, microbatch=mb))
            else:
                need = received_message(schedule, rank, a)
                kw = {"stage": s, "microbatch": mb, "message": None if need is None else need[1]}
                if a.op is Op.F and (placement.prev_stage(s) is None or placement.is_last(s)):
                    cmds.append(LoadMicroBatch(slot[(s, mb)], stage=s, microbatch=mb))
                cmds.append(_COMPUTE.get(a.op, BackwardInputPass)(slot[(s, mb)], **kw))
            out.append(cmds)
            cmds = []
            continue
        msg = st.message
        kw = {"stage": msg.stage, "microbatch": msg.microbatch, "message": msg, "peer": st.peer}
        if st.kind == RECV:
            cmds.append((RecvActivation if msg.kind == ACT else RecvGrad)(slot[(msg.stage, msg.microbatch)], **kw))
        else:  # SEND, after its compute: the activation of the stage before msg.stage, or msg.stage's gradient
            source = (msg.stage - 1 if msg.kind == ACT else msg.stage + 1, msg.microbatch)
            out[-1].append((SendActivation if msg.kind == ACT else SendGrad)(slot[source], **kw))
    return out


def _compile_train(schedule: Schedule, rank: int, lookahead: int | None) -> tuple[list[list[PipeInstruction]], int]:
    slot, buffers = _slots(schedule.ranks[rank])
    steps = _compile(schedule, rank, lower(schedule, lookahead=lookahead).ranks[rank], slot)
    steps.append([WaitSends(), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
    return steps, buffers


def inference_order(placement: Placement, micro_batches: int) -> Schedule:
    """Forward only, microbatch-major: for mb, for each chunk of the rank in pipeline order.
    Every dependency goes from (mb, s-1) to (mb, s), so this order never deadlocks."""
    ranks = [[Action(Op.F, s, mb) for mb in range(micro_batches) for s in placement.stages_of(rank)]
             for rank in range(placement.p)]
    return Schedule(placement.p, micro_batches, placement.v, placement, ranks,
                    "full", "inference")


def _compile_inference(placement: Placement, micro_batches: int, rank: int) -> list[list[PipeInstruction]]:
    """One buffer (a forward's input and output are used before the next forward) and receives
    posted right before their consumer: the engine learns each input's shape at its first receive."""
    schedule = inference_order(placement, micro_batches)
    slot = {(a.stage, a.microbatch): 0 for a in schedule.ranks[rank]}
    steps = _compile(schedule, rank, lower(schedule, forward_only=True, lookahead=0).ranks[rank], slot)
    steps.append([WaitSends()])
    return steps


class KoalaPipeSchedule(PipeSchedule):
    """The training instruction stream of pipeline rank `stage_id` for a Koala `Schedule`.

    `stages` is the number of pipeline ranks (DeepSpeed's meaning), `micro_batches` the
    gradient accumulation steps; both must equal the schedule's p and m. `lookahead`: of the
    lowering (0: every receive right before its consumer, as a step that must first learn a
    message's shape needs; None: every receive at the step's start).
    """

    def __init__(self, schedule: Schedule, stage_id: int, lookahead: int | None = RECV_LOOKAHEAD) -> None:
        super().__init__(schedule.m, schedule.p, stage_id)
        self.schedule = schedule
        self.lookahead = lookahead
        self._steps, self._buffers = _compile_train(schedule, stage_id, lookahead)

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
