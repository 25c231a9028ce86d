"""`KoalaPipelineEngine`: DeepSpeed's `PipelineEngine` running any single-pipeline Koala schedule.

What it adds to the stock engine (deepspeed/runtime/pipe/engine.py, 0.19.8):

- the schedule comes from Koala (`KoalaPipeSchedule`), checked against the engine's pipeline
  size and gradient accumulation steps before any communication;
- split backward: `BackwardInputPass` runs the backward with the layers' weight-gradient GEMMs
  queued (`koala_ds.wgrad`), `BackwardWeightPass` later runs that queue, so I + W costs about
  one full backward. The
  gradient-accumulation scaling is applied once, to the loss, by this engine: the per-tensor
  output hook of DeepSpeedEngine is made a no-op (`_backward_prologue_per_tensor`);
- point-to-point messages follow the rank's lowered stream (`koala_ds.lowering`, the stream the
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
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from deepspeed import comm as dist
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from .. import wgrad
from ..bounded_collectives import WaitFailure, wait_work
from ..channels import ChannelGroups, Link, schedule_channels
from ..ir import KoalaError, Placement, Schedule
from ..lowering import ACT, GRAD, Message
from ..resolve import DEEPSPEED, ScheduleFitError, check_fit, check_profile_stages, load, load_profile, resolve
from ..timeout import DEFAULT_TIMEOUT_S, ENV_TIMEOUT, TimeoutSettingError, timeout_setting
from ..trace_record import TraceRecorder, check_trace_path, timed_wait
from ..validate import validate
from ..wgrad import WeightGradQueue
from .checkpoint import check_optimizer_layout, module_layout, write_layout
from .module import check_model_parts
from .schedule import BackwardInputPass, BackwardWeightPass, KoalaInferenceSchedule, KoalaPipeSchedule, WaitSends
from .slices import SliceSplit

logger = logging.getLogger(__name__)

#: Environment variables read when the config does not say (set by the patched launcher).
ENV_PIPELINE_SCHEDULE = "DS_PIPELINE_SCHEDULE"
ENV_KOALA_SCHEDULE = "KOALA_SCHEDULE"
ENV_KOALA_PROFILE = "KOALA_PROFILE"
ENV_KOALA_TRACE = "KOALA_TRACE"
ENV_KOALA_TIMEOUT = ENV_TIMEOUT  # KOALA_TIMEOUT_S (KOALA_P2P_TIMEOUT is read too): see koala_ds.timeout
#: The values of `"pipeline": {"schedule": ...}` (and DS_PIPELINE_SCHEDULE): DeepSpeed's own engine or Koala's.
PIPELINE_SCHEDULES = ("default", "koala")
_META_SIZE = 256
_KINDS = {"meta": 0, ACT: 1, GRAD: 2}
_MAX_TENSORS = 32


#: The DeepSpeed adapter's name for `koala_ds.resolve.ScheduleFitError` (the same class): the
#: DeepSpeed setup and the Koala schedule do not fit together; the message says what to change.
KoalaConfigError = ScheduleFitError


class PipelineTimeoutError(TimeoutError):
    """A pipeline rank waited longer than `pipeline.koala.timeout_s` for a peer (or the wait
    failed before: the message says which)."""


@dataclass(frozen=True)
class KoalaPipelineConfig:
    """The `"pipeline": {"schedule": "koala", "koala": {...}}` section of a DeepSpeed config."""

    schedule: Any = None  # library name, .koala / .json path, or a Schedule
    profile: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    timeout_source: str = "the default"  # the setting timeout_s came from, for messages
    parts: Any = None  # the model's layer boundaries (checked against the module; see module.py)
    profile_source: str = DEEPSPEED.profile  # the setting profile came from, for messages
    trace: str | None = None  # FILE: every process records its steps' timeline (koala_ds.trace_record)
    trace_source: str = '"pipeline.koala.trace"'  # the setting trace came from, for messages

    @classmethod
    def from_pipeline_section(cls, section: dict | None, env: dict | None = None) -> "KoalaPipelineConfig":
        env = os.environ if env is None else env
        koala = (section or {}).get("koala") or {}
        if not isinstance(koala, dict):
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala" must be an object, got {koala!r}')
        unknown = set(koala) - {"schedule", "profile", "timeout_s", "parts", "trace"}
        if unknown:
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala": unknown keys {sorted(unknown)} '
                                   f'(known: schedule, profile, timeout_s, parts, trace)')
        try:
            timeout, source = timeout_setting(koala.get("timeout_s"), '"pipeline.koala.timeout_s"', env)
        except TimeoutSettingError as exc:
            raise KoalaConfigError(str(exc)) from None
        profile, profile_source = koala.get("profile"), DEEPSPEED.profile
        if profile is None and env.get(ENV_KOALA_PROFILE):
            profile, profile_source = env[ENV_KOALA_PROFILE], ENV_KOALA_PROFILE
        schedule = koala.get("schedule")
        if schedule is not None and not isinstance(schedule, Schedule) and (not isinstance(schedule, str)
                                                                              or not schedule.strip()):
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala.schedule" is {schedule!r}: give a library '
                                   f'name, a .koala / .json / .csv file, or drop the key (default 1f1b)')
        trace, trace_source = _trace_setting(koala.get("trace"), env)
        return cls(schedule or env.get(ENV_KOALA_SCHEDULE) or None, profile, timeout, source,
                   koala.get("parts"), profile_source, trace, trace_source)


def _trace_setting(value, env) -> tuple[str | None, str]:
    """(FILE or None, the setting it came from): "pipeline.koala.trace", else KOALA_TRACE; the
    folder is checked now, before training (koala_ds.trace_record)."""
    source, label = '"pipeline.koala.trace"', 'DeepSpeed config "pipeline.koala.trace"'
    if value is None and env.get(ENV_KOALA_TRACE):
        value, source = env[ENV_KOALA_TRACE], ENV_KOALA_TRACE
        label = source
    if value is None:
        return None, source
    if not isinstance(value, str) or not value.strip():
        raise KoalaConfigError(f"{label} is {value!r}: give a file name (each process writes "
                               f"FILE.rank<global rank>.json), or drop the key")
    try:
        check_trace_path(value, label)
    except KoalaError as exc:
        raise KoalaConfigError(str(exc)) from None
    return value, source


def koala_requested(pipeline_section: dict | None, env: dict | None = None) -> bool:
    """True when the config (`pipeline.schedule`) or the launcher (DS_PIPELINE_SCHEDULE) asks for Koala;
    KoalaConfigError for a value that is neither "koala" nor "default"."""
    return pipeline_schedule(pipeline_section, env) == "koala"


def pipeline_schedule(pipeline_section: dict | None, env: dict | None = None) -> str:
    """"koala" or "default", from `"pipeline": {"schedule": ...}` or else DS_PIPELINE_SCHEDULE."""
    env = os.environ if env is None else env
    value = (pipeline_section or {}).get("schedule")
    where = 'DeepSpeed config "pipeline.schedule"'
    if value is None or value == "":
        value = env.get(ENV_PIPELINE_SCHEDULE) or "default"
        where = f"{ENV_PIPELINE_SCHEDULE} (the launcher's --pipeline_schedule)"
    text = str(value).lower()
    if text not in PIPELINE_SCHEDULES:
        from ..library import did_you_mean

        raise KoalaConfigError(f"{where} is {value!r}{did_you_mean(text, list(PIPELINE_SCHEDULES))}; "
                               f"valid values: {', '.join(map(repr, PIPELINE_SCHEDULES))} (default: DeepSpeed's "
                               f"own schedule; the Koala schedule itself goes in \"pipeline.koala.schedule\")")
    return text


def module_placement(model: PipelineModule) -> Placement:
    """The placement a module implements: `KoalaPipelineModule`'s, else linear over its ranks."""
    placement = getattr(model, "koala_placement", None)
    if placement is not None:
        return placement
    return Placement.named("linear", model._topo.get_dim("pipe"), 1)


def resolve_schedule(spec: Any, p: int, m: int, v: int) -> Schedule:
    """A `Schedule` from a Schedule, a library name or a .koala file (compiled for p, m, v), or a
    schedule .json / .csv file (as written: `check_schedule` checks it); errors name DeepSpeed's
    settings (`koala_ds.resolve.load`)."""
    return load(spec, p, m, v, DEEPSPEED)


def check_schedule(schedule: Schedule, placement: Placement, m: int, source: str) -> None:
    """Refuse a schedule this engine cannot run, naming the property and what to change
    (`koala_ds.resolve.check_fit` against the module's placement, then validation)."""
    check_fit(schedule, placement.p, m, placement.chunks_per_rank, DEEPSPEED,
              f"Koala schedule {schedule.name!r} (from {source})", placement)
    validate(schedule)


def ensure_config_class(kwargs: dict) -> DeepSpeedConfig:
    """The DeepSpeedConfig that `PipelineEngine(**kwargs)` will use, built once and stored in
    `kwargs["config_class"]` (as `deepspeed.initialize` does) so the schedule can be checked first."""
    if kwargs.get("config_class") is None:
        config = kwargs.get("config")
        if config is None and kwargs.get("args") is not None:
            config = getattr(kwargs["args"], "deepspeed_config", None)
        kwargs["config_class"] = DeepSpeedConfig(config, kwargs["model"].mpu())
    return kwargs["config_class"]


def clip_grads_like_stock(params: list, counted: list, max_norm: float, mpu, device) -> torch.Tensor:
    """Scale the gradients of `params` as deepspeed.runtime.utils.clip_grad_norm_ (norm 2) does,
    but with the norm measured over `counted` (plus parameters marked model parallel) on every
    rank, summed over the model-parallel group and averaged over the data-parallel group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    ids = {id(q) for q in counted}
    norms = [q.grad.detach().float().norm(2) for q in params
             if q.grad is not None and (id(q) in ids or is_model_parallel_parameter(q))]
    total = torch.stack(norms).pow(2).sum().float().reshape(1) if norms else torch.zeros(1)
    total = total.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(0.5)
    dp_group = groups._get_data_parallel_group()
    dp = dist.get_world_size(group=dp_group)
    if dp > 1:  # the mean over one rank is the value: no collective (one per step) for it
        total = total / float(dp)
        dist.all_reduce(total, group=dp_group)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for q in params:
        if q.grad is not None:
            q.grad.data.mul_(clip_coef.to(q.grad.device))
    return total


def _added(total, loss):
    """`total` + `loss` (a tensor, or a list of them: element-wise), as a new value; a copy of
    `loss` when `total` is None."""
    if torch.is_tensor(loss):
        return loss.clone() if total is None else total + loss
    return [x.clone() for x in loss] if total is None else [a + x for a, x in zip(total, loss)]


class _BoundedBackend:
    """A deepspeed.comm backend (`deepspeed.comm.comm.cdb`) whose blocking collectives are
    issued with async_op=True and waited by `wait(work, what)`; everything else is the wrapped
    backend's.

    The backend's methods are wrapped without their signatures (deepspeed/comm/torch.py's
    `stage_on_cpu`), so the calling convention of deepspeed/comm/comm.py is spelled out here:
    per collective, the position of (tensor(s), op, group, async_op) when deepspeed.comm passes
    them positionally, None when it passes keywords."""

    COLLECTIVES = {"all_reduce": 3, "all_reduce_coalesced": 3, "broadcast": None, "reduce": None,
                   "all_gather": None, "all_gather_into_tensor": None, "reduce_scatter_tensor": None,
                   "barrier": None}

    def __init__(self, inner, wait: Callable) -> None:
        self._inner = inner
        self._koala_wait = wait
        for name, async_index in self.COLLECTIVES.items():
            method = getattr(inner, name, None)
            if method is not None:
                setattr(self, name, self._bounded(name, method, async_index))

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _bounded(self, name: str, method: Callable, async_index: int | None) -> Callable:
        def call(*args, **kwargs):
            if async_index is not None and len(args) > async_index:
                asked, group = args[async_index], args[2]
                args = (*args[:async_index], True, *args[async_index + 1:])
            else:
                asked, group = kwargs.get("async_op", False), kwargs.get("group")
                kwargs["async_op"] = True
            work = method(*args, **kwargs)
            if asked or work is None or not hasattr(work, "is_completed"):
                return work
            self._koala_wait(work, lambda: _describe_collective(name, group))
            return None

        return call


def _unbounded(backend):
    return backend._inner if isinstance(backend, _BoundedBackend) else backend


def _describe_collective(name: str, group) -> str:
    try:
        ranks = torch.distributed.get_process_group_ranks(group) if group is not None else "all"
    except (RuntimeError, ValueError):
        ranks = "?"
    return f"DeepSpeed's {name} over ranks {ranks}"


def _as_list(x) -> list:
    return [x] if torch.is_tensor(x) else list(x)


class _CommLink:
    """Send to / receive from one peer through deepspeed.comm (what `Link` does on torch.distributed)."""

    __slots__ = ("group", "peer")

    def __init__(self, group, peer: int) -> None:
        self.group, self.peer = group, peer

    def isend(self, tensor, tag: int):
        return dist.isend(tensor, self.peer, group=self.group, tag=tag)

    def irecv(self, tensor, tag: int):
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=tag)


class _ParamGradStep:
    """Around a step that accumulates weight gradients (B, I or W): DeepSpeedEngine's backward
    flag and the bf16 optimizer's gradient hand-over. A plain context manager (entered once per
    backward step; a generator-based one costs several times more)."""

    __slots__ = ("engine",)

    def __init__(self, engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        if engine.using_bf16_optimizer:
            engine.optimizer.clear_lp_grads()
        engine._set_running_backward(True)

    def __exit__(self, exc_type, *_exc_info) -> None:
        engine = self.engine
        engine._set_running_backward(False)
        if exc_type is None and engine.using_bf16_optimizer and \
                not engine._config.bfloat16_config.immediate_grad_update:
            engine.optimizer.update_hp_grads(clear_lp_grads=False)


def _latest_tag(load_dir: str):
    """The tag DeepSpeed's `latest` file in `load_dir` names (None without one): what
    load_checkpoint(tag=None) loads. DeepSpeed has no public function for it."""
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as fh:
        return fh.read().strip()


class KoalaPipelineEngine(PipelineEngine):
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
        # split backward: the layers' weight-gradient GEMMs are queued by I and run by W (koala_ds.wgrad)
        self._wgrad = wgrad.prepare(self.module) if schedule.backward == "split" else None
        # the forwards of microbatches whose backward is a full B run as an unprepared model would
        self._plain_forwards = wgrad.full_backward_forwards(schedule, self.stage_id) if self._wgrad else frozenset()
        # the first step learns the messages' shapes at their first receive, so its receives come
        # right before their consumers; later steps post them early (koala_ds.lowering)
        self._first_sched = KoalaPipeSchedule(schedule, self.stage_id, lookahead=0)
        self._train_sched = KoalaPipeSchedule(schedule, self.stage_id)
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
        self._koala_recorder = recorder = TraceRecorder(kcfg.trace, "deepspeed", label, self.global_rank, sync)
        object.__setattr__(self, "_take", timed_wait(recorder, self._take))
        object.__setattr__(self, "_recv_meta", timed_wait(recorder, self._recv_meta))

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

    def _channel_groups(self, schedule: Schedule, p: int, timeout_s: float) -> tuple[list, list]:
        """Per pipeline rank, the group to send to it on and the group to receive from it on
        (koala_ds.channels: receives are posted ahead of their consumers; on NCCL each direction
        needs its own communicator). Collective on non-gloo backends: every rank builds its engine."""
        if self._koala_gloo:
            return [None] * p, [None] * p
        groups = ChannelGroups(self.grid.get_pipe_parallel_group(), schedule_channels(schedule), True, timeout_s)
        me = self.stage_id
        return [groups.group(me, q) for q in range(p)], [groups.group(q, me) for q in range(p)]

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

    def _p2p_links(self, direct: bool) -> list:
        """Per pipeline rank: (the link to send to it on, the link to receive from it on), on
        torch.distributed's process groups directly (`direct`) or through deepspeed.comm; built once."""
        if direct not in self._link_sets:
            kind = Link if direct else _CommLink
            self._link_sets[direct] = [(kind(self._send_groups[r], g), kind(self._recv_groups[r], g))
                                       for r, g in enumerate(self._pipe_global)]
        return self._link_sets[direct]

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

    # -- communication ------------------------------------------------------------------
    def _tag(self, kind: str, stage: int, microbatch: int, index: int = 0) -> int:
        if index >= _MAX_TENSORS:
            raise KoalaConfigError(f"stage {stage} exchanges more than {_MAX_TENSORS} tensors per microbatch")
        tag = ((microbatch * self._koala_placement.num_stages + stage) * len(_KINDS) + _KINDS[kind]) * _MAX_TENSORS
        return tag + index

    def _wait(self, work, what) -> None:
        """Wait for `work` at most the step's timeout; `what` (a string, or a function giving
        one, called only on failure) names it in the PipelineTimeoutError."""
        failure = wait_work(work, self._koala_timeout_s, self._koala_gloo)
        if failure is not None:
            raise self._wait_failed(what() if callable(what) else what, failure)

    def _wait_failed(self, what: str, failure: WaitFailure) -> PipelineTimeoutError:
        secs = failure.timeout_s
        who = f"rank {self.global_rank} (pipeline rank {self.stage_id}, schedule {self._koala_schedule.name!r})"
        cause = failure.cause or "no error from the transport"
        if failure.early:
            return PipelineTimeoutError(f"{who}: {what} failed after {failure.elapsed:.1f} s, before the {secs:g} s "
                                        f"timeout: the peer closed the connection or crashed ({cause})")
        return PipelineTimeoutError(
            f"{who} gave up on {what} after {secs:g} s (timeout from {self.koala_config.timeout_source}): the peer "
            f"is hung, dead or runs a different schedule. Slow steps need a larger "
            f"\"pipeline\": {{\"koala\": {{\"timeout_s\": ...}}}} or {ENV_KOALA_TIMEOUT}. ({cause})")

    # -- checkpoints: which layers each rank held ------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's save_checkpoint, plus `koala_layout.json` (the layers of every pipeline
        rank) in the tag's directory, written by global rank 0 before any rank returns."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # as DeepSpeed names it
        result = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                         **kwargs)
        if self.global_rank == 0:
            write_layout(os.path.join(save_dir, tag), module_layout(self.module))
        with self._bounded_collectives():  # within the step's timeout, as a step's collectives
            dist.barrier()  # a rank that loads right after finds the file
        return result

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load_checkpoint; optimizer states saved with another assignment of layers
        to ranks are refused first, in one line (`checkpoint.check_optimizer_layout`).

        With the bf16 optimizer (bf16 without ZeRO) its states are read from the files it wrote,
        `bf16_zero_pp_rank_*_optim_states.pt`: DeepSpeed 0.19.8 reads the model-states file
        instead and fails (`KeyError: 0`, stock engine too)."""
        states = load_optimizer_states and not load_module_only and not self.load_universal_checkpoint()
        if states:
            tag = tag if tag is not None else _latest_tag(load_dir)
            if tag is not None and os.path.isdir(os.path.join(load_dir, str(tag))):
                try:
                    check_optimizer_layout(os.path.join(load_dir, str(tag)), self.module)
                except KoalaError as exc:
                    raise KoalaConfigError(str(exc)) from None
        bf16_states = states and not self.zero_optimization() and hasattr(self.optimizer, "bf16_groups")
        result = super().load_checkpoint(load_dir, tag=tag, load_module_strict=load_module_strict,
                                         load_optimizer_states=load_optimizer_states and not bf16_states,
                                         load_lr_scheduler_states=load_lr_scheduler_states,
                                         load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if bf16_states and result[0] is not None:
            # DeepSpeed's own reader of those files (as under ZeRO): the fp32 master weights and the
            # optimizer states of every data-parallel rank's partition
            if not self._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
                raise KoalaConfigError(f"load_checkpoint({load_dir!r}, tag={tag!r}): the checkpoint has no bf16 "
                                       f"optimizer states (bf16_zero_*_optim_states.pt): pass "
                                       f"load_optimizer_states=False to load the weights alone")
        elif not load_optimizer_states and not load_module_only and not self.zero_optimization() \
                and hasattr(self.optimizer, "refresh_fp32_params"):
            # DeepSpeed refreshes the bf16 optimizer's fp32 master weights from loaded weights under
            # load_module_only only: without it the next step would put the old weights back
            self.optimizer.refresh_fp32_params()
        return result

    # -- every collective of a step is bounded by the same timeout -----------------------
    def train_batch(self, data_iter=None):
        recorder = self._koala_recorder
        if recorder is None:
            with self._bounded_collectives():
                return super().train_batch(data_iter)
        return self._recorded_train_batch(recorder, data_iter)

    def _recorded_train_batch(self, recorder: TraceRecorder, data_iter):
        """train_batch recording its timeline: the step (gradient reduction and optimizer step
        included), each action, and what follows the last action (koala_ds.trace_record)."""
        start = time.perf_counter_ns()
        recording = recorder.begin_step(self._koala_schedule, self.stage_id, self.grid.data_parallel_id, start)
        object.__setattr__(self, "_koala_step_recorder", recorder if recording else None)
        try:
            with self._bounded_collectives():
                result = super().train_batch(data_iter)
        finally:
            object.__setattr__(self, "_koala_step_recorder", None)
        if recording:
            recorder.end_step()
        return result

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

    @contextmanager
    def _bounded_collectives(self):
        """While a step runs, deepspeed.comm's blocking collectives (the gradient and tied-weight
        all-reduces, clipping, DeepSpeed's loss broadcast in `_aggregate_total_loss`, ...) are
        issued asynchronously and waited with the step's timeout."""
        from deepspeed.comm import comm as ds_comm

        inner = ds_comm.cdb
        if inner is None or isinstance(inner, _BoundedBackend):
            yield
            return
        ds_comm.cdb = _BoundedBackend(inner, self._wait)
        try:
            yield
        finally:
            ds_comm.cdb = inner

    def _p2p_backend(self):
        """What `_isend` / `_recv` call: `torch.distributed`'s process groups directly
        (`koala_ds.channels.Link`) when `deepspeed.comm` would only forward to torch.distributed
        (its torch backend, comms logger off, no CPU staging of MPS tensors), which saves
        deepspeed.comm's and torch.distributed's per-call wrappers; `deepspeed.comm` otherwise."""
        from deepspeed.comm import comm as ds_comm
        from deepspeed.comm.torch import TorchBackend

        if isinstance(_unbounded(ds_comm.cdb), TorchBackend) and not ds_comm.comms_logger.enabled and self.device.type != "mps":
            return torch.distributed
        return dist

    def _isend(self, tensor, peer: int, tag: int, what) -> None:
        """Send to pipeline rank `peer` without waiting (WaitSends waits)."""
        tensor = tensor.detach().contiguous()
        work = self._links[peer][0].isend(tensor, tag)
        self._pending_sends.append((work, tensor, what))

    def _irecv(self, tensor, peer: int, tag: int):
        return self._links[peer][1].irecv(tensor, tag)

    def _exec_wait_sends(self):
        for work, _tensor, what in self._pending_sends:
            self._wait(work, what)
        self._pending_sends.clear()

    def _send_meta(self, outputs, stage: int, peer: int) -> None:
        """The shapes of stage `stage`'s output, to pipeline rank `peer`, before its first activation."""
        tensors = _as_list(outputs)
        meta = [0 if torch.is_tensor(outputs) else 2, len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > _META_SIZE:
            raise KoalaConfigError(f"stage {stage} output has too many dimensions to describe in {_META_SIZE} ints")
        buf = torch.zeros(_META_SIZE, dtype=torch.long, device=self.device)
        buf[:len(meta)] = torch.tensor(meta, dtype=torch.long)
        self._isend(buf, peer, self._tag("meta", stage + 1, 0), f"shape of stage {stage}'s output")
        self._grad_specs[stage] = [(t.shape, t.dtype) for t in tensors if t.is_floating_point()]

    def _recv_meta(self, stage: int, peer: int) -> tuple[bool, list]:
        """Blocking: only at a stage's first receive, which the first step posts right before its consumer."""
        buf = torch.zeros(_META_SIZE, dtype=torch.long, device=self.device)
        self._wait(self._irecv(buf, peer, self._tag("meta", stage, 0)),
                   f"the input shape of stage {stage} from rank {self._pipe_global[peer]}")
        meta = buf.tolist()
        is_tensor, n, pos, specs = meta[0] == 0, meta[1], 2, []
        for _ in range(n):
            dtype, ndim = self.ID_TO_DTYPE[meta[pos]], meta[pos + 1]
            specs.append((tuple(meta[pos + 2:pos + 2 + ndim]), dtype))
            pos += 2 + ndim
        return is_tensor, specs

    def _split(self, kind: str, i: int, dtype: torch.dtype) -> bool:
        """Whether tensor `i` of a `kind` message goes as model-parallel shares (`slices.py`)."""
        return i == 0 and kind in self._split_kinds and dtype.is_floating_point

    def _post(self, message: Message, peer: int, specs: list, is_tensor: bool) -> None:
        """Post the receives of `message`'s tensors from pipeline rank `peer` (the stream's RECV step)."""
        kind, stage, mb = message
        tensors, works, whole = [], [], None
        for i, (shape, dtype) in enumerate(specs):
            if self._split(kind, i, dtype):
                t, whole = self._slices.empty_share(shape, dtype, self.device), shape
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(self._irecv(t, peer, self._tag(kind, stage, mb, i)))
            tensors.append(t)
        self._inbox[message] = (tensors, works, is_tensor, peer, whole)

    def _take(self, message: Message) -> tuple[list, bool]:
        """Wait for the posted receives of `message`: (its tensors, whether it is one tensor)."""
        tensors, works, is_tensor, src, whole = self._inbox.pop(message)
        for work in works:
            self._wait(work, lambda: f"receive {message.describe()} from rank {self._pipe_global[src]}")
        if whole is not None:
            tensors[0] = self._slices.whole(tensors[0], whole, lambda work: self._wait(
                work, f"the model-parallel all-gather of {message.describe()}"))
        return tensors, is_tensor

    def _exec_recv_activations(self, buffer_id, stage, microbatch, message, peer):
        spec = self._recv_specs.get(stage)
        if spec is None:
            spec = self._recv_specs[stage] = self._recv_meta(stage, peer)
        self._post(message, peer, spec[1], spec[0])

    def _exec_recv_grads(self, buffer_id, stage, microbatch, message, peer):
        specs = self._grad_specs.get(stage)
        if specs is None:  # not reached: the activation to stage + 1 went first, with its shape
            specs = [(t.shape, t.dtype) for t in _as_list(self.pipe_buffers["outputs"][buffer_id])
                     if t.is_floating_point()]
        self._post(message, peer, specs, False)

    def _exec_send_activations(self, buffer_id, stage, microbatch, message, peer):
        """Send the output of stage `stage - 1` (held in `buffer_id`) as `message` to pipeline rank `peer`."""
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if stage not in self._meta_sent:
            self._send_meta(outputs, stage - 1, peer)
            self._meta_sent.add(stage)
        for i, t in enumerate(_as_list(outputs)):
            split = self._split(ACT, i, t.dtype)
            sent = self._slices.share(t) if split else t
            self._isend(sent, peer, self._tag(ACT, stage, microbatch, i),
                        lambda: f"send {message.describe()} to rank {self._pipe_global[peer]}")
            if split and torch.is_grad_enabled():
                # as the stock engine: only this rank's share is held until the backward, which
                # all-gathers the output back (`_backward_targets`); the graph stays. A copy: the
                # share may be a view of the output's storage, which would keep it all alive
                self._kept_shares[buffer_id] = (sent.clone(), t.shape)
                t.data = t.new_empty(0)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _input_grads(self, buffer_id: int) -> list:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        self.pipe_buffers["inputs"][buffer_id] = None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in _as_list(inputs) if t.is_floating_point()]

    def _exec_send_grads(self, buffer_id, stage, microbatch, message, peer):
        """Send the input gradient of stage `stage + 1` (its inputs held in `buffer_id`) to pipeline rank `peer`."""
        for i, g in enumerate(self._input_grads(buffer_id)):
            self._isend(self._slices.share(g) if self._split(GRAD, i, g.dtype) else g, peer,
                        self._tag(GRAD, stage, microbatch, i),
                        lambda: f"send {message.describe()} to rank {self._pipe_global[peer]}")

    def _hand_over_grads(self, buffer_id: int, stage: int, microbatch: int) -> None:
        """After the input gradient of `stage`: to the stage before it, when this rank holds that one."""
        if stage - 1 in self._stage_chunk:
            self._mail[Message(GRAD, stage - 1, microbatch)] = self._input_grads(buffer_id)

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
        # post-accumulate-grad hooks, which koala_ds.wgrad sees (such weights go through autograd)
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
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.RecvGrad: _exec_recv_grads,
        BackwardInputPass: _exec_backward_input_pass,
        BackwardWeightPass: _exec_backward_weight_pass,
        WaitSends: _exec_wait_sends,
    }
