"""`KoalaPipelineEngine`: DeepSpeed's `PipelineEngine` running any single-pipeline Koala schedule.

What it adds to the stock engine (deepspeed/runtime/pipe/engine.py, 0.19.8):

- the schedule comes from Koala (`KoalaPipeSchedule`), checked against the engine's pipeline
  size and gradient accumulation steps before any communication;
- split backward: `BackwardInputPass` runs the backward with the layers' weight-gradient GEMMs
  queued (`koala_ds.runtime.wgrad`), `BackwardWeightPass` later runs that queue, so I + W costs about
  one full backward. The
  gradient-accumulation scaling is applied once, to the loss, by this engine: the per-tensor
  output hook of DeepSpeedEngine is made a no-op (`_backward_prologue_per_tensor`);
- point-to-point messages follow the rank's lowered stream (`koala_ds.runtime.lowering`, the stream the
  Megatron runtime interprets too): non-blocking sends, receives posted in the sender's order on
  every channel (so order-matching backends pair them right, whatever order the compute needs
  them in) and waited by the compute that consumes them; a tag per (kind, stage, microbatch,
  tensor) keeps both directions between the same two ranks apart on gloo (p=2, v=2 has one
  neighbour on both sides); every wait has a timeout (`pipeline.koala.timeout_s`) that ends in
  `PipelineTimeoutError`, not a hang; sends are waited (`WaitSends`) before the gradient
  reduction and the optimizer step. The first training step posts each receive right before its
  consumer (a stage's first receive learns the message's shape, blocking); later steps post
  them `RECV_LOOKAHEAD` actions early;
- one loss per buffer on the last stage, so forwards of several microbatches may precede
  their backwards;
- several model chunks per rank (`KoalaPipelineModule`, interleaved or V-shape placement);
  stages of the same rank hand tensors over locally (the turn of a V);
- checkpoints record which layers each rank held (`checkpoint.py`), and optimizer states saved
  for another assignment are refused before anything loads.

Refused up front, with the property named: schedules with more than one pipeline (Chimera),
a placement that differs from the module's, fp16 loss scaling and ZeRO stages >= 2,
and dynamic shapes. With model-parallel ranks, `pipe_partitioned` / `grad_partitioned` send each
rank's share of a message (`slices.py`).

This module holds the engine's set-up and its compute (forward, B, I, W, the losses); the rest is
split by concern: the config section and the schedule it names (`config.py`), messages and
bounded collectives (`comm.py`, the `PipeComm` mixin), gradient clipping and the backward flag
(`grads.py`), and checkpoints (`checkpoint.py`, the `CheckpointLayout` mixin).
"""
from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from ..core.ir import KoalaError, Placement, Schedule
from ..resolve import DEEPSPEED, check_profile_stages, load_profile, resolve
from ..runtime import wgrad
from ..runtime.channels import schedule_channels
from ..runtime.lowering import ACT, GRAD, Message, recv_lookahead
from ..runtime.trace_record import TraceRecorder, timed_wait
from ..runtime.wgrad import WeightGradQueue
from .checkpoint import CheckpointLayout
from .comm import PipeComm, _as_list
from .config import (ENV_KOALA_SCHEDULE, ENV_KOALA_TRACE, KoalaConfigError, KoalaPipelineConfig, ensure_config_class,
                     module_placement)
from .grads import _ParamGradStep, clip_grads_like_stock
from .module import check_model_parts
from .schedule import BackwardInputPass, BackwardWeightPass, KoalaInferenceSchedule, KoalaPipeSchedule, WaitSends
from .slices import SliceSplit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ScheduleState:
    """A schedule as the engine runs it on one rank (KoalaPipelineEngine._states)."""

    schedule: Schedule
    wgrad: Any  # koala_ds.runtime.wgrad.Prepared of a split-backward schedule, else None
    first_step: KoalaPipeSchedule  # receives right before their consumers (the shapes are learned)
    later_steps: KoalaPipeSchedule  # receives posted early (recv_lookahead)


def _added(total, loss):
    """`total` + `loss` (a tensor, or a list of them: element-wise), as a new value; a copy of
    `loss` when `total` is None."""
    if torch.is_tensor(loss):
        return loss.clone() if total is None else total + loss
    return [x.clone() for x in loss] if total is None else [a + x for a, x in zip(total, loss)]


class KoalaPipelineEngine(PipeComm, CheckpointLayout, PipelineEngine):
    """A `PipelineEngine` that runs a Koala schedule (see the module docstring).

    Built by `deepspeed.initialize` once `koala_ds.deepspeed` is imported and the config says
    `"pipeline": {"schedule": "koala", "koala": {"schedule": ...}}` (or the launcher flag), or
    directly: `KoalaPipelineEngine(model=..., config=..., koala_schedule="zb-h1", ...)` with the
    keyword arguments of `PipelineEngine`.
    """

    def __init__(self, *args, koala_schedule: Any = None, **kwargs):
        model = kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise KoalaConfigError("KoalaPipelineEngine needs model=<a deepspeed.pipe.PipelineModule> (keyword)")
        config_class = ensure_config_class(kwargs)
        # Everything below is checked before any communication (the parent's __init__ talks).
        schedule, placement, kcfg = self._resolve_schedule(model, config_class, koala_schedule)
        self._check_config(config_class)
        if kcfg.parts is not None:
            try:
                check_model_parts(model, kcfg.parts, placement.p, placement.chunks_per_rank)
            except KoalaError as exc:
                raise KoalaConfigError(str(exc)) from None
        if kcfg.profile is not None:
            self._log_profile(schedule, kcfg.profile, kcfg.profile_source)

        self._koala_ready = False
        self._koala_schedule = schedule
        self._koala_placement = placement
        self._koala_timeout_s = float(kcfg.timeout_s)
        self.koala_config = kcfg
        super().__init__(*args, **kwargs)

        # pipe_partitioned / grad_partitioned: the first tensor of each activation / gradient
        # message goes as 1/n shares over the stage's n model-parallel ranks (slices.py)
        self._split_kinds = frozenset(k for k, on in ((ACT, self.is_pipe_partitioned), (GRAD, self.is_grad_partitioned))
                                      if on)
        self._slices = SliceSplit(self.grid.get_slice_parallel_group(), self.grid.get_slice_parallel_rank(),
                                  self.grid.get_slice_parallel_world_size()) if self._split_kinds else None
        if self.dynamic_shape:
            raise KoalaConfigError("the Koala engine exchanges activation shapes once per stage boundary: "
                                   "build the PipelineModule with dynamic_shape=False")
        self._init_koala_state(schedule, placement, kcfg)
        self._koala_ready = True
        if self.global_rank == 0:
            logger.info("Koala schedule %r: p=%d m=%d v=%d backward=%s, %d buffers on rank 0",
                        schedule.name, schedule.p, schedule.m, schedule.v, schedule.backward,
                        self._train_sched.num_pipe_buffers())

    @staticmethod
    def _resolve_schedule(model, config_class, koala_schedule) -> tuple[Schedule, Placement, "KoalaPipelineConfig"]:
        """The schedule to run (fitted to the model's placement and m), before any communication."""
        placement = module_placement(model)
        m = config_class.gradient_accumulation_steps
        kcfg = KoalaPipelineConfig.from_pipeline_section(config_class.pipeline)
        spec = koala_schedule if koala_schedule is not None else kcfg.schedule
        if spec is None:
            if placement.chunks_per_rank != 1:
                raise KoalaConfigError('the model holds several chunks per rank: name a schedule in '
                                       '"pipeline": {"koala": {"schedule": ...}} (e.g. interleaved-1f1b, zb-v)')
            spec = "1f1b"
        shown = spec.name if isinstance(spec, Schedule) else str(spec)
        if koala_schedule is not None:
            source = f"koala_schedule={shown!r}"
        elif kcfg.schedule is not None:
            source = f'"pipeline.koala.schedule" = {shown!r} (or {ENV_KOALA_SCHEDULE})'
        else:
            source = f"the default schedule {shown!r}"
        return resolve(spec, placement.p, m, placement.chunks_per_rank, DEEPSPEED, source, placement), placement, kcfg

    def _init_koala_state(self, schedule: Schedule, placement: Placement, kcfg) -> None:
        """The runtime's state, once the parent engine is set up."""
        try:  # how wait_work waits: gloo's wait(timeout), else polling until the deadline
            self._koala_gloo = "gloo" in str(torch.distributed.get_backend()).lower()
        except (RuntimeError, ValueError):
            self._koala_gloo = True
        self._stage_chunk = {s: c for c, s in enumerate(placement.stages_of(self.stage_id))}
        # Called before the work of a stage when the module holds several chunks (see _activate).
        self._activate_chunk: Callable[[int], None] | None = (
            getattr(self.module, "activate_chunk", None) if len(self._stage_chunk) > 1 else None)
        # Global rank of each pipeline rank (the grid is fixed after set-up) and the groups to send
        # to / receive from it on: the default group on gloo, one group per direction elsewhere
        self._pipe_global = [self.grid.stage_to_global(stage_id=r) for r in range(placement.p)]
        self._send_groups, self._recv_groups = self._channel_groups(schedule, placement.p, kcfg.timeout_s)
        self._link_sets: dict[bool, list] = {}  # see _p2p_links
        self._param_grad = _ParamGradStep(self)
        self._first_stage = 0
        self._last_stage = placement.num_stages - 1
        # the schedules' states (_states): the engine's own (key None) and set_koala_schedule's
        self._installed: dict[Any, _ScheduleState] = {None: self._states(schedule)}
        self._use(self._installed[None])
        self._shapes_known = False
        self._inference_scheds: dict[int, KoalaInferenceSchedule] = {}
        self._programs: dict[int, tuple] = {}
        self.pipe_buffers["losses"] = [None] * self.num_pipe_buffers
        self._recv_specs: dict[int, tuple[bool, list]] = {}  # stage -> its input's (is a tensor, shapes)
        self._meta_sent: set[int] = set()
        self._grad_specs: dict[int, list] = {}  # stage -> shapes of its output's gradients
        self._reset_step_state()
        self._init_trace(kcfg)

    def _init_trace(self, kcfg) -> None:
        """With "pipeline.koala.trace": the recorder of this process's training steps, and the
        waits for an action's input (the posted receive; a stage's first, blocking, shape
        receive) timed into it. Bound once: without a trace, nothing per action changes."""
        self._koala_recorder: TraceRecorder | None = None
        self._koala_step_recorder: TraceRecorder | None = None  # set while a recorded train_batch runs
        if kcfg.trace is None:
            return
        label = kcfg.trace_source if kcfg.trace_source == ENV_KOALA_TRACE else f"DeepSpeed config {kcfg.trace_source}"
        # on a GPU an action ends when its kernels have run, not when they were queued
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.record_into(TraceRecorder(kcfg.trace, "deepspeed", label, self.global_rank, sync))

    def record_into(self, recorder: TraceRecorder) -> None:
        """Record this engine's training steps into `recorder`: its own (the config's trace), or
        another engine's, so that schedules taking turns on engines of their own (another
        placement, a model copy) write one run per schedule with their steps numbered together
        (koala_ds.runtime.trace_record). Once per engine."""
        if self._koala_recorder is not None:
            raise KoalaError("record_into: this engine already records a trace")
        self._koala_recorder = recorder
        object.__setattr__(self, "_take", timed_wait(recorder, self._take))
        object.__setattr__(self, "_recv_meta", timed_wait(recorder, self._recv_meta))

    @property
    def koala_recorder(self) -> TraceRecorder | None:
        """The recorder of this engine's trace (None: not traced)."""
        return self._koala_recorder

    # -- set-up checks ------------------------------------------------------------------
    @staticmethod
    def _check_config(config_class) -> None:
        if config_class.float16_config.enabled:
            raise KoalaConfigError('the Koala engine does not apply fp16 loss scaling: use "bf16" or fp32 '
                                   '(remove "fp16": {"enabled": true})')
        stage = config_class.zero_optimization_stage
        if stage > 1:  # stage 1 partitions the optimizer states only, as the stock pipeline engine allows
            raise KoalaConfigError(f'"zero_optimization": {{"stage": {stage}}} partitions the gradients, which '
                                   f"DeepSpeed's pipeline engines do not support: use stage 0 or 1")

    @staticmethod
    def _log_profile(schedule: Schedule, profile: str, source: str = DEEPSPEED.profile) -> None:
        # a KoalaError naming the setting (the config key, or the variable) and the file when it is bad
        settings = replace(DEEPSPEED, profile=source)
        cost = load_profile(profile, settings)
        check_profile_stages(cost, schedule.placement, f"schedule {schedule.name!r}", settings, profile)
        logger.info("Koala profile %s: %d stage entries for schedule %r", profile, cost.num_stages, schedule.name)

    # -- stage queries (after __init__: "holds the first / last virtual stage") ----------
    def is_first_stage(self):
        if not getattr(self, "_koala_ready", False):
            return super().is_first_stage()
        return self._first_stage in self._stage_chunk

    def is_last_stage(self):
        if not getattr(self, "_koala_ready", False):
            return super().is_last_stage()
        return self._last_stage in self._stage_chunk

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self._koala_placement.rank_of(self._koala_placement.num_stages - 1))

    def clip_fp32_gradients(self):
        """DeepSpeed's fp32 gradient clipping, by the norm the stock engine would measure.

        Stock `clip_grad_norm_` counts the gradients of model-parallel rank 0 (pipeline rank 0)
        only. With several chunks per rank the first rank holds other layers than the stock
        engine's first stage, so the norm (and every update) would differ: count instead the
        parameters of the stock first stage's layers, wherever they are (`clip_norm_parameters`)."""
        counted = getattr(self.module, "clip_norm_parameters", None)
        if counted is None:
            return super().clip_fp32_gradients()
        return clip_grads_like_stock(list(self.module.parameters()), counted(), self.gradient_clipping(), self.mpu,
                                     self.device)

    def _backward_prologue_per_tensor(self, grad):
        # The loss is divided by the gradient accumulation steps once, in _backward_targets.
        return grad

    # -- schedules ----------------------------------------------------------------------
    @property
    def koala_schedule(self) -> Schedule:
        return self._koala_schedule

    def set_koala_schedule(self, spec) -> Schedule:
        """Run `spec` (a library name, a .koala / .json / .csv file or a Schedule) from the next
        train_batch on, on the model as it is (its placement, m and parameters): schedules taking
        turns in one run (examples/deepspeed_pipe --alternate-schedules), so that a drift of the
        machine hits them alike. Every rank switches before the same step. A spec is resolved once
        (a file edited later is not read again). On a backend other than gloo the schedule must
        use the pipeline links the engine's schedule uses (their communicators are built once)."""
        key = spec  # a name, a path or a Schedule (hashable: equal schedules share a state)
        if key not in self._installed:
            p, shown = self._koala_placement.p, spec.name if isinstance(spec, Schedule) else str(spec)
            schedule = resolve(spec, p, self.gradient_accumulation_steps(), self._koala_placement.chunks_per_rank,
                               DEEPSPEED, f"set_koala_schedule({shown!r})", self._koala_placement)
            own = self._installed[None].schedule
            if not self._koala_gloo and not set(schedule_channels(schedule)) <= set(schedule_channels(own)):
                raise KoalaConfigError(f"set_koala_schedule({shown!r}) sends on pipeline links the engine's "
                                       f"schedule {own.name!r} does not use: on "
                                       f"{torch.distributed.get_backend()} their communicators are built once")
            self._installed[key] = self._states(schedule)
        self._use(self._installed[key])
        return self._koala_schedule

    def _states(self, schedule: Schedule) -> "_ScheduleState":
        """What the engine runs `schedule` with on this rank."""
        # split backward: the layers' weight-gradient GEMMs are queued by I and run by W (koala_ds.runtime.wgrad)
        prepared = wgrad.prepare(self.module) if schedule.backward == "split" else None
        # the first step learns the messages' shapes at their first receive, so its receives come
        # right before their consumers; later steps post them early (koala_ds.runtime.lowering:
        # on gloo all at the step's start, recv_lookahead)
        return _ScheduleState(schedule, prepared, KoalaPipeSchedule(schedule, self.stage_id, lookahead=0),
                              KoalaPipeSchedule(schedule, self.stage_id, lookahead=recv_lookahead(self._koala_gloo)))

    def _use(self, state: "_ScheduleState") -> None:
        """Make the schedule of `state` (_states) the one train_batch runs."""
        self._koala_schedule, self._wgrad = state.schedule, state.wgrad
        self._first_sched, self._train_sched = state.first_step, state.later_steps
        # the forwards that run as an unprepared module's would (a full B's; all of them under a
        # full-backward schedule on a module a split one prepared); the module may have been
        # prepared since the state was made, so this is found now
        self._plain_forwards = wgrad.plain_forwards(state.schedule, self.stage_id, (self.module,),
                                                    state.wgrad is not None)

    def _train_schedule(self):
        return self._train_sched if self._shapes_known else self._first_sched

    def _inference_schedule(self, micro_batches):
        if micro_batches not in self._inference_scheds:
            self._inference_scheds[micro_batches] = KoalaInferenceSchedule(self._koala_placement, micro_batches,
                                                                           self.stage_id)
        return self._inference_scheds[micro_batches]

    def _reset_step_state(self) -> None:
        self._mail: dict[Message, Any] = {}  # hand-overs between stages of this rank
        self._inbox: dict[Message, tuple] = {}  # posted receives: (tensors, works, is a tensor, peer, whole shape)
        self._w_state: dict[tuple[int, int], WeightGradQueue] = {}
        self._batches: list[list | None] = []  # per microbatch pulled: [batch, uses left], None once used up
        self._pending_sends: list[tuple[Any, Any, str]] = []
        self._kept_shares: dict[int, tuple] = {}  # buffer -> (share, shape) of an output sent as shares
        self._links = self._p2p_links(self._p2p_backend() is torch.distributed)

    def _program(self, pipe_schedule, traced: bool = False) -> tuple:
        """The instructions of `pipe_schedule` as (handler, positional arguments) pairs, built once
        per schedule: the interpreter's work per instruction is the call. `traced` (a training
        schedule): each compute action's instructions (the receives posted before it, the
        compute, its send: one list of `steps()`) between the trace recorder's marks."""
        key = (id(pipe_schedule), traced)
        if key not in self._programs:
            program = []
            steps = list(pipe_schedule.steps())
            for k, step in enumerate(steps):
                mark = traced and k < len(steps) - 1  # the last list: WaitSends, the reduction, the optimizer
                if mark:
                    program.append((KoalaPipelineEngine._trace_begin, (k,)))
                program += [self._instruction(cmd) for cmd in step]
                if mark:
                    program.append((KoalaPipelineEngine._trace_end, ()))
            self._programs[key] = (pipe_schedule, tuple(program))  # the schedule keeps its id unique
        return self._programs[key][1]

    def _instruction(self, cmd) -> tuple:
        """(handler, positional arguments) of one DeepSpeed instruction."""
        handler = self._INSTRUCTION_MAP.get(type(cmd))
        if handler is None:
            raise RuntimeError(f'{self.__class__.__name__} does not understand instruction {repr(cmd)}')
        names = handler.__code__.co_varnames[1:handler.__code__.co_argcount][:len(cmd.kwargs)]
        if set(names) == set(cmd.kwargs):
            return handler, tuple(cmd.kwargs[n] for n in names)
        return functools.partial(handler, **cmd.kwargs), ()  # keywords that are not its leading parameters

    def _trace_begin(self, index: int) -> None:
        self._koala_step_recorder.begin(index)

    def _trace_end(self) -> None:
        self._koala_step_recorder.end()

    def _exec_schedule(self, pipe_schedule):
        """`PipelineEngine._exec_schedule` over the schedule's precomputed program (`_program`),
        without the stock per-instruction `self._exec_instr = MethodType(...)` and keyword unpacking."""
        self._reset_step_state()
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        traced = self._koala_step_recorder is not None and isinstance(pipe_schedule, KoalaPipeSchedule)
        for handler, args in self._program(pipe_schedule, traced):
            handler(self, *args)
        leftover = [f"{s}W{mb}" for s, mb in self._w_state] + [str(msg) for msg in (*self._mail, *self._inbox)]
        if leftover:
            raise RuntimeError(f"Koala engine: step ended with unfinished work {leftover[:8]} "
                               f"(schedule {self._koala_schedule.name!r}); this is a bug")
        if pipe_schedule is self._first_sched:
            self._shapes_known = True

    def _activate(self, stage: int) -> None:
        """Expose the chunk holding `stage` through the module's forward (multi-chunk modules;
        a no-op when that chunk is already the active one)."""
        if self._activate_chunk is not None:
            chunk = self._stage_chunk[stage]
            if getattr(self.module, "active_chunk", None) != chunk:
                self._activate_chunk(chunk)

    def _set_running_backward(self, flag: bool) -> None:
        # DeepSpeedEngine's flag for its backward hooks; a plain attribute, so skip
        # nn.Module.__setattr__'s parameter / buffer / submodule checks (run twice per B, I and W).
        object.__setattr__(self, "_running_engine_backward", flag)

    # -- every collective of a step is bounded by the same timeout -----------------------
    def train_batch(self, data_iter=None):
        """DeepSpeed's train_batch, every collective bounded; with a trace, recording its timeline:
        the step (gradient reduction and optimizer step included), each action, and what follows
        the last action (koala_ds.runtime.trace_record). Both run the step from this frame: a
        deeper Python stack would cost every forward of a PipelineModule(seed_layers=True) more
        (torch formats the stack per deferred device seed), so a trace would slow what it records."""
        recorder = self._koala_recorder
        recording = recorder is not None and self._begin_recorded_step(recorder)
        try:
            with self._bounded_collectives():
                result = super().train_batch(data_iter)
        finally:
            if recording:
                object.__setattr__(self, "_koala_step_recorder", None)
        if recording:
            recorder.end_step()
        return result

    def _begin_recorded_step(self, recorder: TraceRecorder) -> bool:
        """Start recording a step (False: the recorder does not record this schedule's steps)."""
        start = time.perf_counter_ns()
        recording = recorder.begin_step(self._koala_schedule, self.stage_id, self.grid.data_parallel_id, start)
        object.__setattr__(self, "_koala_step_recorder", recorder if recording else None)
        return recording

    def close_trace(self) -> None:
        """End the trace file (also done by destroy() and at interpreter exit); a no-op without a trace."""
        recorder = getattr(self, "_koala_recorder", None)  # None too on an engine whose __init__ failed
        if recorder is not None:
            recorder.close()

    def destroy(self):
        self.close_trace()
        return super().destroy()

    def eval_batch(self, *args, **kwargs):
        with self._bounded_collectives():
            return super().eval_batch(*args, **kwargs)

    # -- data ---------------------------------------------------------------------------
    def _batch(self, microbatch: int):
        """The batch of `microbatch`, pulling the data iterator in microbatch order."""
        batches = self._batches
        while len(batches) <= microbatch:
            uses = int(self._first_stage in self._stage_chunk) + int(self._last_stage in self._stage_chunk)
            batches.append([self._next_batch(), uses])
        entry = batches[microbatch]
        entry[1] -= 1
        if entry[1] <= 0:
            batches[microbatch] = None
        return entry[0]

    def _exec_load_micro_batch(self, buffer_id, stage, microbatch):
        batch = self._batch(microbatch)
        if stage == self._first_stage:
            def load(x):
                y = x.clone().detach().to(self.device)
                if self._reentrant_activation_checkpointing():
                    y.requires_grad = y.is_floating_point()
                return y

            self.pipe_buffers["inputs"][buffer_id] = load(batch[0]) if torch.is_tensor(batch[0]) \
                else tuple(load(x) for x in batch[0])
        if stage == self._last_stage:
            labels = batch[1]
            self.pipe_buffers["labels"][buffer_id] = labels.to(self.device) if torch.is_tensor(labels) \
                else tuple(x.to(self.device).detach() for x in labels)

    # -- compute ------------------------------------------------------------------------
    def _exec_forward_pass(self, buffer_id, stage, microbatch, message):
        """F: the input is the loaded batch (first stage), the posted receive of `message`, or the
        hand-over of the stage before on this rank; a stage after on this rank gets the output."""
        self.tput_timer.start()
        buffers = self.pipe_buffers
        if message is not None:
            tensors, is_tensor = self._take(message)
            for t in tensors:
                t.requires_grad_(t.is_floating_point())
            buffers["inputs"][buffer_id] = tensors[0] if is_tensor else tuple(tensors)
        elif stage != self._first_stage:
            buffers["inputs"][buffer_id] = self._mail.pop(Message(ACT, stage, microbatch))
        inputs = buffers["inputs"][buffer_id]
        self._activate(stage)
        with wgrad.plain_forward((stage, microbatch) in self._plain_forwards):
            outputs = DeepSpeedEngine.forward(self, inputs)
        module = self.module  # a submodule: nn.Module.__getattr__ on every lookup
        if not module.training:
            ds_checkpointing.reset()
        if stage != self._last_stage:
            buffers["outputs"][buffer_id] = outputs
            if stage + 1 in self._stage_chunk:
                handed = [t.detach().requires_grad_(t.is_floating_point()) for t in _as_list(outputs)]
                self._mail[Message(ACT, stage + 1, microbatch)] = handed[0] if torch.is_tensor(outputs) else tuple(handed)
                if not torch.is_grad_enabled():
                    buffers["outputs"][buffer_id] = None
        else:
            self._last_stage_loss(buffer_id, outputs)
        if not torch.is_grad_enabled():
            buffers["inputs"][buffer_id] = None

    def _last_stage_loss(self, buffer_id: int, outputs) -> None:
        """The loss of the last stage's output, added up over the step as the stock engine does:
        the loss, and the module's additional losses (`get_additional_losses`, e.g. an MoE
        auxiliary loss), which DeepSpeed's loss broadcast sends with it."""
        buffers, module = self.pipe_buffers, self.module
        if self._compute_loss and module.loss_fn is not None:
            loss = module.loss_fn(outputs, buffers["labels"][buffer_id])
        else:
            loss = outputs
        buffers["labels"][buffer_id] = None
        if self.eval_return_logits:
            self.outputs = outputs
        detached = loss.detach() if torch.is_tensor(loss) else [x.detach() for x in loss]
        self.fwd_outputs.append(detached)
        # tensors, lists and dicts, never a parameter, buffer or module: skip nn.Module.__setattr__'s checks
        object.__setattr__(self, "total_loss", _added(self.total_loss, detached))
        additional = module.get_additional_losses()
        if additional is not None:
            totals = self.total_additional_losses if self.total_additional_losses is not None else OrderedDict()
            for name, extra in additional.items():
                totals[name] = _added(totals.get(name), torch.as_tensor(extra).detach())
            object.__setattr__(self, "total_additional_losses", totals)
        if torch.is_grad_enabled():
            buffers["losses"][buffer_id] = loss

    def _backward_targets(self, buffer_id: int, stage: int, microbatch: int, message):
        """(tensors to differentiate, their gradients or None) for the stage's backward; the
        gradients come from the posted receive of `message` or the stage after on this rank."""
        if stage == self._last_stage:
            loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
            if not torch.is_tensor(loss):
                raise KoalaConfigError("the last stage's loss_fn must return one tensor to train with Koala")
            return [self._scale_loss_by_gas(loss)], None
        outputs = [t for t in _as_list(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()]
        kept = self._kept_shares.pop(buffer_id, None)
        if kept is not None:
            outputs[0].data = self._slices.whole(kept[0], kept[1], lambda work: self._wait(
                work, f"the model-parallel all-gather of stage {stage}'s output, microbatch {microbatch}"))
        grads = self._take(message)[0] if message is not None else self._mail.pop(Message(GRAD, stage, microbatch))
        self.pipe_buffers["outputs"][buffer_id] = None
        return outputs, list(grads)

    def _exec_backward_pass(self, buffer_id, stage, microbatch, message):
        tensors, grads = self._backward_targets(buffer_id, stage, microbatch, message)
        self._activate(stage)
        with self._param_grad:
            torch.autograd.backward(tensors, grad_tensors=grads)
        if self._wgrad is not None:
            self._wgrad.full_step_done()
        self._hand_over_grads(buffer_id, stage, microbatch)

    def _exec_backward_input_pass(self, buffer_id, stage, microbatch, message):
        """I: the full backward with the layers' weight-gradient GEMMs queued for W."""
        tensors, grads = self._backward_targets(buffer_id, stage, microbatch, message)
        self._activate(stage)
        # W adds the weight gradients into .grad in their GEMMs: DeepSpeed's own gradient hooks are
        # post-accumulate-grad hooks, which koala_ds.runtime.wgrad sees (such weights go through autograd)
        with self._param_grad, self._wgrad.input_step(direct=True) as queue:
            torch.autograd.backward(tensors, grad_tensors=grads)
        self._w_state[(stage, microbatch)] = queue
        self._hand_over_grads(buffer_id, stage, microbatch)

    def _exec_backward_weight_pass(self, stage, microbatch):
        queue = self._w_state.pop((stage, microbatch))
        self._activate(stage)
        with self._param_grad:
            queue.run()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.SendActivation: PipeComm._exec_send_activations,
        ds_schedule.RecvActivation: PipeComm._exec_recv_activations,
        ds_schedule.SendGrad: PipeComm._exec_send_grads,
        ds_schedule.RecvGrad: PipeComm._exec_recv_grads,
        BackwardInputPass: _exec_backward_input_pass,
        BackwardWeightPass: _exec_backward_weight_pass,
        WaitSends: PipeComm._exec_wait_sends,
    }
