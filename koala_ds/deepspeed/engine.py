"""`KoalaPipelineEngine`: DeepSpeed's `PipelineEngine` running any single-pipeline Koala schedule.

What it adds to the stock engine (deepspeed/runtime/pipe/engine.py, 0.19.8):

- the schedule comes from Koala (`KoalaPipeSchedule`), checked against the engine's pipeline
  size and gradient accumulation steps before any communication;
- split backward: `BackwardInputPass` runs the backward with the layers' weight-gradient GEMMs
  queued (`koala_ds.wgrad`), `BackwardWeightPass` later runs that queue, so I + W costs about
  one full backward. The
  gradient-accumulation scaling is applied once, to the loss, by this engine: the per-tensor
  output hook of DeepSpeedEngine is made a no-op (`_backward_prologue_per_tensor`);
- point-to-point messages are non-blocking sends and receives with a tag per
  (kind, stage, microbatch, tensor), so any deadlock-free order runs, both directions between
  the same two ranks stay apart (p=2, v=2 has one neighbour on both sides), and every wait has
  a timeout (`pipeline.koala.timeout_s`) that ends in `PipelineTimeoutError`, not a hang; sends
  are waited (`WaitSends`) before the gradient reduction and the optimizer step;
- one loss per buffer on the last stage, so forwards of several microbatches may precede
  their backwards;
- several model chunks per rank (`KoalaPipelineModule`, interleaved or V-shape placement);
  stages of the same rank hand tensors over locally (the turn of a V).

Refused up front, with the property named: schedules with more than one pipeline (Chimera),
a placement that differs from the module's, fp16 loss scaling and ZeRO stages >= 1,
dynamic shapes and partitioned pipe tensors.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
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
from ..ir import KoalaError, Placement, Schedule
from ..resolve import DEEPSPEED, ScheduleFitError, check_fit, load, load_profile, resolve
from ..timeout import DEFAULT_TIMEOUT_S, ENV_TIMEOUT, TimeoutSettingError, timeout_setting
from ..validate import validate
from ..wgrad import WeightGradQueue
from .module import check_model_parts
from .schedule import (BackwardInputPass, BackwardWeightPass, KoalaInferenceSchedule, KoalaPipeSchedule, WaitSends,
                       messages_between)

logger = logging.getLogger(__name__)

#: Environment variables read when the config does not say (set by the patched launcher).
ENV_PIPELINE_SCHEDULE = "DS_PIPELINE_SCHEDULE"
ENV_KOALA_SCHEDULE = "KOALA_SCHEDULE"
ENV_KOALA_PROFILE = "KOALA_PROFILE"
ENV_KOALA_TIMEOUT = ENV_TIMEOUT  # KOALA_TIMEOUT_S (KOALA_P2P_TIMEOUT is read too): see koala_ds.timeout
#: The values of `"pipeline": {"schedule": ...}` (and DS_PIPELINE_SCHEDULE): DeepSpeed's own engine or Koala's.
PIPELINE_SCHEDULES = ("default", "koala")
_META_SIZE = 256
_KINDS = {"meta": 0, "act": 1, "grad": 2}
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

    @classmethod
    def from_pipeline_section(cls, section: dict | None, env: dict | None = None) -> "KoalaPipelineConfig":
        env = os.environ if env is None else env
        koala = (section or {}).get("koala") or {}
        if not isinstance(koala, dict):
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala" must be an object, got {koala!r}')
        unknown = set(koala) - {"schedule", "profile", "timeout_s", "parts"}
        if unknown:
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala": unknown keys {sorted(unknown)} '
                                   f'(known: schedule, profile, timeout_s, parts)')
        try:
            timeout, source = timeout_setting(koala.get("timeout_s"), '"pipeline.koala.timeout_s"', env)
        except TimeoutSettingError as exc:
            raise KoalaConfigError(str(exc)) from None
        return cls(koala.get("schedule") or env.get(ENV_KOALA_SCHEDULE) or None,
                   koala.get("profile") or env.get(ENV_KOALA_PROFILE) or None, timeout, source, koala.get("parts"))


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
    total = total / float(dist.get_world_size(group=dp_group))
    dist.all_reduce(total, group=dp_group)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for q in params:
        if q.grad is not None:
            q.grad.data.mul_(clip_coef.to(q.grad.device))
    return total


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
        schedule = resolve(spec, placement.p, m, placement.chunks_per_rank, DEEPSPEED, source, placement)
        self._check_config(config_class)
        if kcfg.parts is not None:
            try:
                check_model_parts(model, kcfg.parts, placement.p, placement.chunks_per_rank)
            except KoalaError as exc:
                raise KoalaConfigError(str(exc)) from None
        if kcfg.profile is not None:
            self._log_profile(schedule, kcfg.profile)

        self._koala_ready = False
        self._koala_schedule = schedule
        self._koala_placement = placement
        self._koala_timeout = datetime.timedelta(seconds=kcfg.timeout_s)
        self.koala_config = kcfg
        super().__init__(*args, **kwargs)

        if self.is_pipe_partitioned or self.is_grad_partitioned:
            raise KoalaConfigError('the Koala engine does not partition pipe tensors over model parallel ranks: '
                                   'set "pipeline": {"pipe_partitioned": false, "grad_partitioned": false}')
        if self.dynamic_shape:
            raise KoalaConfigError("the Koala engine exchanges activation shapes once per stage boundary: "
                                   "build the PipelineModule with dynamic_shape=False")
        self._check_backend_order()
        self._stage_chunk = {s: c for c, s in enumerate(placement.stages_of(self.stage_id))}
        # Called before the work of a stage when the module holds several chunks (see _activate).
        self._activate_chunk: Callable[[int], None] | None = (
            getattr(self.module, "activate_chunk", None) if len(self._stage_chunk) > 1 else None)
        # Global rank of the rank holding each virtual stage (the grid is fixed after set-up).
        self._stage_peer = [self.grid.stage_to_global(stage_id=placement.rank_of(s))
                            for s in range(placement.num_stages)]
        self._first_stage = 0
        self._last_stage = placement.num_stages - 1
        # split backward: the layers' weight-gradient GEMMs are queued by I and run by W (koala_ds.wgrad)
        self._wgrad = wgrad.prepare(self.module) if schedule.backward == "split" else None
        self._train_sched = KoalaPipeSchedule(schedule, self.stage_id)
        self.pipe_buffers["grads"] = [None] * self.num_pipe_buffers
        self.pipe_buffers["losses"] = [None] * self.num_pipe_buffers
        self._recv_specs: dict[int, tuple[bool, list]] = {}
        self._meta_sent: set[int] = set()
        self._reset_step_state()
        self._koala_ready = True
        if self.global_rank == 0:
            logger.info("Koala schedule %r: p=%d m=%d v=%d backward=%s, %d buffers on rank 0",
                        schedule.name, schedule.p, schedule.m, schedule.v, schedule.backward,
                        self._train_sched.num_pipe_buffers())

    # -- set-up checks ------------------------------------------------------------------
    @staticmethod
    def _check_config(config_class) -> None:
        if config_class.float16_config.enabled:
            raise KoalaConfigError('the Koala engine does not apply fp16 loss scaling: use "bf16" or fp32 '
                                   '(remove "fp16": {"enabled": true})')
        if config_class.zero_optimization_stage > 0:
            raise KoalaConfigError(f'the Koala engine supports ZeRO stage 0 only, the config has '
                                   f'"zero_optimization": {{"stage": {config_class.zero_optimization_stage}}}')

    @staticmethod
    def _log_profile(schedule: Schedule, profile: str) -> None:
        cost = load_profile(profile, DEEPSPEED)  # a KoalaError naming the setting and the file when it is bad
        logger.info("Koala profile %s: %d stage entries for schedule %r", profile, cost.num_stages, schedule.name)

    def _check_backend_order(self) -> None:
        """NCCL matches point-to-point messages by order, not tag: refuse orders that differ."""
        try:
            backend = str(torch.distributed.get_backend()).lower()
        except (RuntimeError, ValueError):
            return
        if "gloo" in backend or self.num_stages == 1:
            return
        p = self._koala_schedule.p
        for src in range(p):
            for dst in range(p):
                if src == dst:
                    continue
                sent, received = messages_between(self._koala_schedule, src, dst)
                if sent != received:
                    raise KoalaConfigError(
                        f"schedule {self._koala_schedule.name!r}: rank {src} sends to rank {dst} in a different "
                        f"order than rank {dst} receives, and backend {backend!r} matches messages by order; "
                        f"run on gloo or pick a schedule whose orders agree")

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
        return self._train_sched

    def _inference_schedule(self, micro_batches):
        return KoalaInferenceSchedule(self._koala_placement, micro_batches, self.stage_id)

    def _reset_step_state(self) -> None:
        self._mail: dict[tuple[str, int, int], Any] = {}
        self._w_state: dict[tuple[int, int], WeightGradQueue] = {}
        self._batches: list[list | None] = []  # per microbatch pulled: [batch, uses left], None once used up
        self._pending_sends: list[tuple[Any, Any, str]] = []
        self._p2p = self._p2p_backend()

    def _exec_schedule(self, pipe_schedule):
        """`PipelineEngine._exec_schedule`, dispatching without its per-instruction
        `self._exec_instr = MethodType(...)` (an `nn.Module.__setattr__` per instruction)."""
        self._reset_step_state()
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        handlers = self._INSTRUCTION_MAP
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                handler = handlers.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f'{self.__class__.__name__} does not understand instruction {repr(cmd)}')
                handler(self, **cmd.kwargs)
        leftover = [f"{s}W{mb}" for s, mb in self._w_state] + [f"{k} {s}/{mb}" for k, s, mb in self._mail]
        if leftover:
            raise RuntimeError(f"Koala engine: step ended with unfinished work {leftover[:8]} "
                               f"(schedule {self._koala_schedule.name!r}); this is a bug")

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
    def _peer(self, stage: int) -> int:
        return self._stage_peer[stage]

    def _is_local(self, stage: int) -> bool:
        return stage in self._stage_chunk

    def _tag(self, kind: str, stage: int, microbatch: int, index: int = 0) -> int:
        if index >= _MAX_TENSORS:
            raise KoalaConfigError(f"stage {stage} exchanges more than {_MAX_TENSORS} tensors per microbatch")
        tag = ((microbatch * self._koala_placement.num_stages + stage) * len(_KINDS) + _KINDS[kind]) * _MAX_TENSORS
        return tag + index

    def _wait(self, work, what) -> None:
        """Wait for `work` at most the step's timeout; `what` (a string, or a function giving
        one) names it in the PipelineTimeoutError."""
        start = time.monotonic()
        try:
            work.wait(timeout=self._koala_timeout)
        except RuntimeError as exc:
            raise self._wait_failed(what() if callable(what) else what, exc, time.monotonic() - start) from None

    def _wait_failed(self, what: str, exc: Exception, elapsed: float) -> PipelineTimeoutError:
        secs = self._koala_timeout.total_seconds()
        who = f"rank {self.global_rank} (pipeline rank {self.stage_id}, schedule {self._koala_schedule.name!r})"
        cause = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if elapsed < 0.9 * secs:  # gloo's wait(timeout) only raises early when the transport failed
            return PipelineTimeoutError(f"{who}: {what} failed after {elapsed:.1f} s, before the {secs:g} s "
                                        f"timeout: the peer closed the connection or crashed ({cause})")
        return PipelineTimeoutError(
            f"{who} gave up on {what} after {secs:g} s (timeout from {self.koala_config.timeout_source}): the peer "
            f"is hung, dead or runs a different schedule. Slow steps need a larger "
            f"\"pipeline\": {{\"koala\": {{\"timeout_s\": ...}}}} or {ENV_KOALA_TIMEOUT}. ({cause})")

    # -- every collective of a step is bounded by the same timeout -----------------------
    def train_batch(self, data_iter=None):
        with self._bounded_collectives():
            return super().train_batch(data_iter)

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
        """What `_isend` / `_recv` call: `torch.distributed` itself when `deepspeed.comm` would only
        forward to it (its torch backend, comms logger off, no CPU staging of MPS tensors), which
        saves deepspeed.comm's per-call wrappers; `deepspeed.comm` otherwise."""
        from deepspeed.comm import comm as ds_comm
        from deepspeed.comm.torch import TorchBackend

        if isinstance(_unbounded(ds_comm.cdb), TorchBackend) and not ds_comm.comms_logger.enabled and self.device.type != "mps":
            return torch.distributed
        return dist

    def _isend(self, tensor, peer: int, tag: int, what: str) -> None:
        tensor = tensor.detach().contiguous()
        work = self._p2p.isend(tensor, peer, tag=tag)
        self._pending_sends.append((work, tensor, what))

    def _recv(self, tensor, peer: int, tag: int, what: str) -> None:
        work = self._p2p.irecv(tensor, src=peer, tag=tag)
        self._wait(work, what)

    def _exec_wait_sends(self):
        for work, _tensor, what in self._pending_sends:
            self._wait(work, what)
        self._pending_sends.clear()

    def _send_meta(self, outputs, stage: int, microbatch: int, peer: int) -> None:
        tensors = _as_list(outputs)
        meta = [0 if torch.is_tensor(outputs) else 2, len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > _META_SIZE:
            raise KoalaConfigError(f"stage {stage} output has too many dimensions to describe in {_META_SIZE} ints")
        buf = torch.zeros(_META_SIZE, dtype=torch.long, device=self.device)
        buf[:len(meta)] = torch.tensor(meta, dtype=torch.long)
        self._isend(buf, peer, self._tag("meta", stage + 1, 0), f"shape of stage {stage}'s output")

    def _recv_meta(self, stage: int, peer: int) -> tuple[bool, list]:
        buf = torch.zeros(_META_SIZE, dtype=torch.long, device=self.device)
        self._recv(buf, peer, self._tag("meta", stage, 0), f"the input shape of stage {stage} from rank {peer}")
        meta = buf.tolist()
        is_tensor, n, pos, specs = meta[0] == 0, meta[1], 2, []
        for _ in range(n):
            dtype, ndim = self.ID_TO_DTYPE[meta[pos]], meta[pos + 1]
            specs.append((tuple(meta[pos + 2:pos + 2 + ndim]), dtype))
            pos += 2 + ndim
        return is_tensor, specs

    def _exec_send_activations(self, buffer_id, stage, microbatch):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        nxt = stage + 1
        if self._is_local(nxt):
            received = [t.detach().requires_grad_(t.is_floating_point()) for t in _as_list(outputs)]
            self._mail[("act", nxt, microbatch)] = received[0] if torch.is_tensor(outputs) else tuple(received)
        else:
            peer = self._peer(nxt)
            if nxt not in self._meta_sent:
                self._send_meta(outputs, stage, microbatch, peer)
                self._meta_sent.add(nxt)
            for i, t in enumerate(_as_list(outputs)):
                self._isend(t, peer, self._tag("act", nxt, microbatch, i),
                            f"the activation {nxt}F{microbatch} to rank {peer}")
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, stage, microbatch):
        if self._is_local(stage - 1):
            self.pipe_buffers["inputs"][buffer_id] = self._mail.pop(("act", stage, microbatch))
            return
        peer = self._peer(stage - 1)
        if stage not in self._recv_specs:
            self._recv_specs[stage] = self._recv_meta(stage, peer)
        is_tensor, specs = self._recv_specs[stage]
        received = []
        for i, (shape, dtype) in enumerate(specs):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, peer, self._tag("act", stage, microbatch, i),
                       f"the activation for {stage}F{microbatch} from rank {peer}")
            received.append(t.requires_grad_(t.is_floating_point()))
        self.pipe_buffers["inputs"][buffer_id] = received[0] if is_tensor else tuple(received)

    def _exec_send_grads(self, buffer_id, stage, microbatch):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in _as_list(inputs) if t.is_floating_point()]
        prv = stage - 1
        if self._is_local(prv):
            self._mail[("grad", prv, microbatch)] = grads
        else:
            peer = self._peer(prv)
            for i, g in enumerate(grads):
                self._isend(g, peer, self._tag("grad", prv, microbatch, i),
                            f"the input gradient of {stage}B{microbatch} to rank {peer}")
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, stage, microbatch):
        nxt = stage + 1
        if self._is_local(nxt):
            self.pipe_buffers["grads"][buffer_id] = self._mail.pop(("grad", stage, microbatch))
            return
        peer = self._peer(nxt)
        grads = []
        for i, out in enumerate(t for t in _as_list(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()):
            g = torch.empty_like(out, memory_format=torch.contiguous_format)
            self._recv(g, peer, self._tag("grad", stage, microbatch, i),
                       f"the output gradient of {stage}B{microbatch} from rank {peer}")
            grads.append(g)
        self.pipe_buffers["grads"][buffer_id] = grads

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
    def _exec_forward_pass(self, buffer_id, stage, microbatch):
        self.tput_timer.start()
        inputs = self.pipe_buffers["inputs"][buffer_id]
        self._activate(stage)
        outputs = DeepSpeedEngine.forward(self, inputs)
        if not self.module.training:
            ds_checkpointing.reset()
        if stage != self._last_stage:
            self.pipe_buffers["outputs"][buffer_id] = outputs
        else:
            if self._compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
            else:
                loss = outputs
            self.pipe_buffers["labels"][buffer_id] = None
            if self.eval_return_logits:
                self.outputs = outputs
            detached = loss.detach() if torch.is_tensor(loss) else [x.detach() for x in loss]
            self.fwd_outputs.append(detached)
            if torch.is_tensor(loss):
                self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
            else:
                self.total_loss = [d.clone() for d in detached] if self.total_loss is None else \
                    [a + d for a, d in zip(self.total_loss, detached)]
            if torch.is_grad_enabled():
                self.pipe_buffers["losses"][buffer_id] = loss
        if not torch.is_grad_enabled():
            self.pipe_buffers["inputs"][buffer_id] = None

    def _backward_targets(self, buffer_id: int, stage: int):
        """(tensors to differentiate, their gradients or None) for the stage's backward."""
        if stage == self._last_stage:
            loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
            if not torch.is_tensor(loss):
                raise KoalaConfigError("the last stage's loss_fn must return one tensor to train with Koala")
            return [self._scale_loss_by_gas(loss)], None
        outputs = [t for t in _as_list(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()]
        grads = self.pipe_buffers["grads"][buffer_id]
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["grads"][buffer_id] = None
        return outputs, list(grads)

    @contextmanager
    def _param_grad_step(self):
        """Around a step that accumulates weight gradients (B or W)."""
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self._set_running_backward(True)
        try:
            yield
        finally:
            self._set_running_backward(False)
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_backward_pass(self, buffer_id, stage, microbatch):
        tensors, grads = self._backward_targets(buffer_id, stage)
        self._activate(stage)
        with self._param_grad_step():
            torch.autograd.backward(tensors, grad_tensors=grads)
        if self._wgrad is not None:
            self._wgrad.full_step_done()

    def _exec_backward_input_pass(self, buffer_id, stage, microbatch):
        """I: the full backward with the layers' weight-gradient GEMMs queued for W."""
        tensors, grads = self._backward_targets(buffer_id, stage)
        self._activate(stage)
        with self._param_grad_step(), self._wgrad.input_step() as queue:
            torch.autograd.backward(tensors, grad_tensors=grads)
        self._w_state[(stage, microbatch)] = queue

    def _exec_backward_weight_pass(self, stage, microbatch):
        queue = self._w_state.pop((stage, microbatch))
        self._activate(stage)
        with self._param_grad_step():
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
