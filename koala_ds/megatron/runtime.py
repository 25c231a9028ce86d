"""The Megatron-core interpreter of Koala schedules: a drop-in forward_backward_func.

One interpreter for every schedule: it walks this rank's action list (F, B, I, W on virtual
stages), calls megatron-core's own `forward_step` / `backward_step` helpers, moves tensors with
`koala_ds.megatron.p2p`, and keeps megatron-core's contract (loss dicts on the last pipeline
rank, `[]` elsewhere; set_input_tensor, loss scaling, no_sync / grad_sync,
finalize_model_grads_func).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist

from ..runtime.bounded_collectives import bounded_collectives
from ..core.ir import KoalaError, Op, Schedule
from ..runtime.lowering import ACT, COMPUTE, GRAD, RECV, Message, lower, recv_lookahead
from ..runtime.timeout import timeout_setting
from ..runtime.trace_record import TraceRecorder, check_trace_path, timed_wait
from . import resolve as _resolve
from .layout import tied_embeddings_conflict
from .p2p import ChannelGroups, CollectiveWaiter, P2P, schedule_channels
from .resolve import MegatronScheduleError
from ..runtime import wgrad

log = logging.getLogger(__name__)
_perf_ns = time.perf_counter_ns


class _ReorderingIterator:
    """Serves microbatch `current` of an in-order data iterator, for schedules that run a
    data-reading stage's forwards out of microbatch order."""

    def __init__(self, inner):
        self.inner = inner
        self.cache: dict[int, object] = {}
        self.pulled = 0
        self.current = 0

    def __iter__(self):
        return self

    def __next__(self):
        while self.pulled <= self.current:
            self.cache[self.pulled] = next(self.inner)
            self.pulled += 1
        return self.cache.pop(self.current)


@dataclass(frozen=True)
class _StageInfo:
    """Where a local virtual stage's input comes from and its output goes (fixed per schedule)."""

    chunk: int
    prev: int | None  # the stage feeding this one, None for a first stage
    prev_rank: int | None
    next: int | None  # the stage this one feeds, None for a last stage
    next_rank: int | None
    is_last: bool


@dataclass
class _Prepared:
    schedule: Schedule
    chunks_reading_data: tuple
    stages: dict  # local stage -> _StageInfo
    program: tuple  # (function of _StepRunner, its arguments) per step: see _program
    spans: tuple  # (first, end) positions in program of each compute action (see _program)
    traced_program: tuple | None = None  # program with the trace recorder's marks (_traced), when asked


def _program(schedule: Schedule, rank: int, forward_only: bool, stages: dict, lookahead: int | None
             ) -> tuple[tuple, tuple]:
    """This rank's lowered stream (koala_ds.runtime.lowering) as (function, arguments) pairs, so that the
    interpreter's work per step is the call: RECV posts a receive, a compute action runs with its
    messages and stage facts at hand, SEND sends the tensor the compute before it produced. With
    backward, the grad sync of a chunk brackets its last action producing weight gradients.
    Also each compute action's span in it, (first, end) positions: from the end of the
    action before (its receives posted ahead included) through its SEND (`_traced`). `lookahead`:
    the lowering's (`recv_lookahead`)."""
    steps = lower(schedule, forward_only, lookahead).ranks[rank]
    pl = schedule.placement
    last_w = {}
    if not forward_only:
        for i, st in enumerate(steps):
            if st.kind == COMPUTE and st.action.op in (Op.B, Op.W):
                last_w[pl.chunk_of(st.action.stage)] = i
    sync_at = {i: c for c, i in last_w.items()}
    R = _StepRunner
    out, spans, first = [], [], 0
    for i, st in enumerate(steps):
        if st.kind == RECV:
            out.append((R._post, (st.message, st.peer)))
            continue
        if st.kind != COMPUTE:  # SEND: right after the compute that produced its tensor
            out.append((R._send, (st.message, st.peer)))
            spans.append((first, len(out)))
            if i - 1 in sync_at:
                out.append((R._sync_after, (sync_at[i - 1],)))
            first = len(out)
            continue
        a = st.action
        s, mb, info = a.stage, a.microbatch, stages[a.stage]
        if i in sync_at:
            out.append((R._sync_before, (sync_at[i],)))
        if a.op is Op.F:
            remote_in = info.prev is not None and info.prev_rank != rank
            out.append((R._forward, (s, mb, info, Message(ACT, s, mb) if remote_in else None)))
        elif a.op is Op.W:
            out.append((R._backward_weight, (s, mb)))
        else:
            remote_out = info.next is not None and info.next_rank != rank
            grad_msg = Message(GRAD, s, mb) if remote_out else None
            out.append((R._backward_full if a.op is Op.B else R._backward_input, (s, mb, info, grad_msg)))
        sends_next = i + 1 < len(steps) and steps[i + 1].kind not in (COMPUTE, RECV)
        if not sends_next:  # else after that SEND
            spans.append((first, len(out)))
            if i in sync_at:
                out.append((R._sync_after, (sync_at[i],)))
            first = len(out)
    return tuple(out), tuple(spans)


def _traced(program: tuple, spans: tuple) -> tuple:
    """`program` with the recorder's marks around each compute action's span (action k: the
    k-th of the rank's order), for a step that records a trace (koala_ds.runtime.trace_record)."""
    begins = {first: k for k, (first, _end) in enumerate(spans)}
    ends = {end for _first, end in spans}
    out = []
    for pos, entry in enumerate(program):
        if pos in begins:
            out.append((_StepRunner._trace_begin, (begins[pos],)))
        out.append(entry)
        if pos + 1 in ends:
            out.append((_StepRunner._trace_end, ()))
    return tuple(out)


def _chunk_iterators(data_iterator, v: int) -> list:
    """One data iterator per model chunk, as megatron-core's interleaved schedule takes them."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != v:
            raise MegatronScheduleError(f"data_iterator is a list of {len(data_iterator)} but the model has {v} "
                                        f"chunks: give one data iterator per model chunk")
        return list(data_iterator)
    if v == 1:
        return [data_iterator]
    raise MegatronScheduleError(f"the model has {v} chunks: data_iterator must be a list of {v} iterators "
                                f"(one per chunk, as for megatron-core's interleaved schedule)")


def _process_groups(pg_collection):
    """The caller's ProcessGroupCollection, or one built from parallel_state as megatron-core does."""
    if pg_collection is not None:
        return pg_collection
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp, pgc.cp = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    pgc.pp = ps.get_pipeline_model_parallel_group()
    pgc.embd = ps.get_embedding_group(check_initialized=False)
    pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc


def _message_shape(config, seq_length: int, micro_batch_size: int, cp_size: int, tp_size: int,
                   adjust_tensor_shapes_fn) -> list:
    """The shape of the one tensor passed between stages (megatron-core's tensor_shape)."""
    shape = [seq_length // cp_size, micro_batch_size, config.hidden_size]
    if config.sequence_parallel:
        shape[0] //= tp_size
    if adjust_tensor_shapes_fn is not None:
        recv_shapes, _ = adjust_tensor_shapes_fn([tuple(shape)], [tuple(shape)])
        if len(recv_shapes) != 1:
            raise MegatronScheduleError("adjust_tensor_shapes_fn: the koala runtime sends one tensor per stage")
        shape = list(recv_shapes[0])
    return shape


def _comm_setting(config, pp_group, model) -> tuple:
    """(message dtype, gloo?, the model's device, the device messages travel on)."""
    p = pp_group.size()
    dtype = config.pipeline_dtype
    if dtype is None and p > 1:
        raise MegatronScheduleError("config.pipeline_dtype must be set for pipeline parallelism "
                                    "(TransformerConfig(pipeline_dtype=...), e.g. torch.float32)")
    gloo = (dist.get_backend(pp_group) if p > 1 else "gloo") == "gloo"
    model_device = next((q.device for q in model.parameters()), torch.device("cpu"))
    comm_device = torch.device("cpu") if gloo else (model_device if model_device.type == "cuda"
                                                    else torch.device("cuda", torch.cuda.current_device()))
    return dtype, gloo, model_device, comm_device


def _check_chunk_roles(models: list, schedule: Schedule, rank: int) -> None:
    """A chunk that says whether it holds the embedding (`pre_process`) or the loss
    (`post_process`), as megatron-core's models do, must say so for the stage the schedule runs
    on it: stage 0 and the last stage. Else its forward_step would compute the wrong thing (a
    V-shape schedule on chunks built by megatron-core's get_model: a traceback from the loss
    function, or a message of the wrong shape)."""
    from megatron.core.utils import get_attr_wrapped_model

    last = schedule.num_stages - 1
    for chunk, (model, stage) in enumerate(zip(models, schedule.placement.stages_of(rank))):
        for attr, want in (("pre_process", stage == 0), ("post_process", stage == last)):
            try:
                built = get_attr_wrapped_model(model, attr)
            except RuntimeError:  # the chunk (or what it wraps) does not say
                continue
            if isinstance(built, bool) and built != want:
                raise MegatronScheduleError(
                    f"koala schedule runtime: schedule {schedule.name!r} runs stage {stage} of {last + 1} in model "
                    f"chunk {chunk} of pipeline rank {rank}, which was built with {attr}={built}: build chunk c of "
                    f"rank r as stage koala_ds.megatron.chunk_stages(schedule, r)[c] (stage_layers; "
                    f"examples/megatron_gpt), or choose a schedule with the interleaved placement, which is "
                    f"megatron-core's own")


def _check_tied_embeddings(models: list, schedule: Schedule, rank: int) -> None:
    """Chunks built with tied input and output embeddings (megatron-core's
    `share_embeddings_and_output_weights`, Megatron-LM's default) only train right where
    megatron-core ties them (`layout.tied_embeddings_conflict`): elsewhere finalize_model_grads
    all-reduces the embedding's gradient with a rank that holds neither end, and waits."""
    from megatron.core.utils import get_attr_wrapped_model

    conflict = tied_embeddings_conflict(schedule.placement)
    if conflict is None:
        return
    for chunk, model in enumerate(models):
        try:
            tied = get_attr_wrapped_model(model, "share_embeddings_and_output_weights")
        except RuntimeError:  # the chunk (or what it wraps) does not say
            continue
        if tied is True:
            raise MegatronScheduleError(
                f"koala schedule runtime: model chunk {chunk} of pipeline rank {rank} was built with "
                f"share_embeddings_and_output_weights=True, but schedule {schedule.name!r} "
                f"({schedule.placement.style} placement) {conflict}: build the chunks with "
                f"share_embeddings_and_output_weights=False (Megatron-LM: --untie-embeddings-and-output-weights), "
                f"or choose a schedule with the interleaved placement")


def _replica_index(pg_collection) -> int:
    """This rank's data-parallel replica (its pipeline's index), for the trace's header."""
    for name in ("dp", "dp_cp"):
        group = getattr(pg_collection, name, None)
        if group is not None:
            return group.rank()
    return 0


def _losses_to_last_rank(schedule: Schedule, comm, losses: list, num_tokens, rank: int, p: int, model_device
                         ) -> tuple[list, Any]:
    """(losses, token count) where megatron-core reads them: Megatron-LM the losses, and
    finalize_model_grads the token count of a per-token loss (it broadcasts it from there), on the
    last pipeline rank; a V-shape computes both on another rank. `num_tokens`: None when the loss
    is not per token."""
    holder = schedule.placement.rank_of(schedule.num_stages - 1)
    if holder == p - 1:
        return losses, num_tokens
    if rank == holder:
        comm.send_object((losses, num_tokens), p - 1)
        return [], num_tokens  # its count is replaced by the broadcast from the last rank
    if rank == p - 1:
        received, count = comm.recv_object(holder, model_device)
        return received, None if count is None else count.to(num_tokens.device, num_tokens.dtype)
    return losses, num_tokens


class KoalaForwardBackward:
    """Callable with megatron-core's forward_backward_func keyword signature."""

    def __init__(self, schedule, profile=None, timeout_s: float | None = None, per_direction_groups: bool | None = None,
                 timeout_name: str = "get_forward_backward_func(timeout_s=...)",
                 trace: str | TraceRecorder | None = None, trace_name: str = "get_forward_backward_func(trace=...)"):
        _resolve.check_spec(schedule)
        # a measured timeline of the training steps (koala_ds.runtime.trace_record); None: no recording at all
        self.recorder: TraceRecorder | None = trace if isinstance(trace, TraceRecorder) else None
        if trace is not None and self.recorder is None:
            try:
                check_trace_path(trace, trace_name)
            except KoalaError as exc:
                raise MegatronScheduleError(str(exc)) from None
            self.recorder = TraceRecorder(str(trace), "megatron", trace_name)
        self.schedule_spec = schedule
        self.profile = profile
        # KOALA_TIMEOUT_S (or its alias KOALA_P2P_TIMEOUT) when timeout_s is None; checked here
        self.timeout_s, self.timeout_source = timeout_setting(timeout_s, timeout_name)
        self.per_direction_groups = per_direction_groups
        self._channels: dict = {}
        self._prepared: dict = {}
        self._agreed: dict = {}  # (schedule, forward_only, chunks) -> the schedule the ranks agreed on
        self.last_schedule: Schedule | None = None
        if profile is not None:
            self._check_profile(profile)

    def __repr__(self) -> str:
        name = self.schedule_spec.name if isinstance(self.schedule_spec, Schedule) else self.schedule_spec
        return f"<koala forward_backward_func schedule={name!r}>"

    @staticmethod
    def _check_profile(profile) -> None:
        """A profile file, bundled name or dict as `koala_ds.sim.load_profile` reads it; errors name --koala-profile."""
        from ..resolve import MEGATRON, load_profile

        load_profile(profile, MEGATRON)

    # ------------------------------------------------------------------------------------
    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator: Union[Iterator, List[Iterator]],
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: Optional[int] = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        adjust_tensor_shapes_fn: Optional[Callable] = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: Optional[bool] = False,
    ):
        from megatron.core.pipeline_parallel import schedules as mcs
        from megatron.core.utils import get_model_config, get_model_type

        del p2p_communicator  # megatron-core's signature; this runtime does its own p2p
        recorder = self.recorder
        step_start = _perf_ns() if recorder is not None else 0

        models = list(model) if isinstance(model, (list, tuple)) else [model]
        v = len(models)
        iterators = _chunk_iterators(data_iterator, v)
        config = get_model_config(models[0])
        model_type = get_model_type(models[0])
        pg_collection = _process_groups(pg_collection)
        pp_group, tp_group, cp_group = pg_collection.pp, pg_collection.tp, pg_collection.cp
        p, rank = pp_group.size(), pp_group.rank()

        # every blocking collective of the call (finalize_model_grads_func's all-reduces, grad / param
        # sync, timers' barriers, ...) waits at most the pipeline timeout, as the p2p waits do
        waiter = CollectiveWaiter(f"koala runtime: rank {dist.get_rank()} (pipeline rank {rank})", self.timeout_s,
                                  self.timeout_source)
        # -- everything that can be wrong is checked here, before any communication --
        schedule = _resolve.resolve(self.schedule_spec, p, num_microbatches, v)
        self._check_setup(schedule, models, config, forward_only, pp_group, waiter)
        dtype, gloo, model_device, comm_device = _comm_setting(config, pp_group, models[0])
        prep = self._prepare(schedule, rank, forward_only, recv_lookahead(gloo))
        self.last_schedule = schedule

        shape = _message_shape(config, decoder_seq_length or seq_length, micro_batch_size, cp_group.size(),
                               tp_group.size(), adjust_tensor_shapes_fn)
        if recorder is not None:  # training steps only; the trace's rows are the schedule's actions
            recorder = self._begin_step(recorder, prep, forward_only, rank, pg_collection, step_start, model_device)
        with bounded_collectives(waiter):
            channels = self._channel_groups(schedule, pp_group, gloo)
            comm = P2P(rank, channels, shape, dtype, self.timeout_s, comm_device, gloo,
                       timeout_source=self.timeout_source)

            runner = _StepRunner(
                mcs=mcs, schedule=schedule, prep=prep, comm=comm, models=models, iterators=iterators,
                config=config, model_type=model_type, forward_step_func=forward_step_func,
                num_microbatches=num_microbatches, forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                cp_size=cp_group.size(), model_device=model_device, rank=rank, recorder=recorder)

            if config.timers is not None:
                config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
            holds_last = schedule.placement.rank_of(schedule.num_stages - 1) == rank
            embedding_module = None
            if config.finalize_model_grads_func is not None and not forward_only:
                last_chunk = schedule.placement.chunk_of(schedule.num_stages - 1) if holds_last else v - 1
                embedding_module = mcs.clear_embedding_activation_buffer(config, [models[last_chunk]], holds_last)
            runner.run()
            losses = runner.losses()
            comm.finish()
            tokens = runner.total_num_tokens if config.calculate_per_token_loss else None
            losses, tokens = _losses_to_last_rank(schedule, comm, losses, tokens, rank, p, model_device)

            if config.finalize_model_grads_func is not None and not forward_only:
                mcs.finish_embedding_wgrad_compute(config, embedding_module, holds_last, tp_group)
                waiter.phase = "finalize_model_grads_func"
                config.finalize_model_grads_func(models, tokens, pg_collection=pg_collection,
                                                 force_all_reduce=force_all_reduce)
            if config.timers is not None:
                config.timers("forward-backward").stop()
            if recorder is not None:
                recorder.end_step()
            return losses

    def _begin_step(self, recorder: TraceRecorder, prep: _Prepared, forward_only: bool, rank: int, pg_collection,
                    start_ns: int, device: torch.device) -> TraceRecorder | None:
        """The recorder for this step (the file opened at the first), or None: a forward-only
        call, or a step of another schedule than the traced one, is not recorded."""
        if forward_only:
            return None
        if recorder.schedule is None:  # the first step: the file is named by the rank now known
            recorder.global_rank = dist.get_rank()
        # on a GPU an action ends when its kernels have run, not when they were queued
        recorder.sync = torch.cuda.synchronize if device.type == "cuda" else None
        if not recorder.begin_step(prep.schedule, rank, _replica_index(pg_collection), start_ns):
            return None
        if prep.traced_program is None:
            prep.traced_program = _traced(prep.program, prep.spans)
        return recorder

    def close_trace(self) -> None:
        """End the trace file (also done at interpreter exit); a no-op without a trace."""
        if self.recorder is not None:
            self.recorder.close()

    def _check_setup(self, schedule: Schedule, models: list, config, forward_only: bool, pp_group, waiter) -> None:
        """The config and the chunks' roles, checked on this rank; the first time this schedule
        meets these chunks, the pipeline ranks also agree (one all_gather_object, bounded by the
        timeout): a refusal on one rank is raised on every rank, in the words of the first rank
        that refused. A rank whose own chunks look right would otherwise start the step and wait
        for a refusing peer until the p2p timeout."""
        rank = pp_group.rank()
        problem = None
        try:
            split = any(a.op in (Op.I, Op.W) for a in schedule.ranks[rank])
            self._check_config(config, split, forward_only, pp_group.size())
            _check_chunk_roles(models, schedule, rank)
            _check_tied_embeddings(models, schedule, rank)
        except MegatronScheduleError as exc:
            problem = str(exc)
        key = (id(schedule), forward_only, tuple(id(m) for m in models))
        if self._agreed.get(key) is not schedule and pp_group.size() > 1:
            verdicts: list = [None] * pp_group.size()
            phase, waiter.phase = waiter.phase, "the ranks' check of the schedule's set-up"
            with bounded_collectives(waiter):
                dist.all_gather_object(verdicts, problem, group=pp_group)
            waiter.phase = phase
            problem = next((v for v in verdicts if v is not None), None)
        if problem is not None:
            raise MegatronScheduleError(problem)
        self._agreed[key] = schedule

    # ------------------------------------------------------------------------------------
    @staticmethod
    def _check_config(config, split: bool, forward_only: bool, p: int) -> None:
        problems = []
        if getattr(config, "variable_seq_lengths", False):
            problems.append("variable_seq_lengths=True (the koala runtime sends fixed shapes): turn it off")
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            problems.append("overlap_moe_expert_parallel_comm=True: not supported with --pipeline-schedule koala")
        # gradient_accumulation_fusion is exact with a split backward: the deferred weight gradients
        # (koala_ds.runtime.wgrad) add into main_grad in W, once; megatron-core's own deferral is not
        if split and not forward_only and getattr(config, "defer_embedding_wgrad_compute", False):
            problems.append("the schedule splits backward (I/W): turn off defer_embedding_wgrad_compute "
                            "(--defer-embedding-wgrad-compute)")
        if problems:
            raise MegatronScheduleError("koala schedule runtime: " + "; ".join(problems))

    def _prepare(self, schedule: Schedule, rank: int, forward_only: bool, lookahead: int | None) -> _Prepared:
        key = (id(schedule), rank, forward_only, lookahead)
        if key in self._prepared and self._prepared[key].schedule is schedule:
            return self._prepared[key]
        pl = schedule.placement
        reading = []
        for chunk, stage in enumerate(pl.stages_of(rank)):
            order = [a.microbatch for a in schedule.ranks[rank] if a.op is Op.F and a.stage == stage]
            reading.append(order != sorted(order))
        stages = {}
        for chunk, stage in enumerate(pl.stages_of(rank)):
            prev, nxt = pl.prev_stage(stage), pl.next_stage(stage)
            stages[stage] = _StageInfo(chunk, prev, None if prev is None else pl.rank_of(prev),
                                       nxt, None if nxt is None else pl.rank_of(nxt), nxt is None)
        prep = _Prepared(schedule, tuple(reading), stages, *_program(schedule, rank, forward_only, stages, lookahead))
        self._prepared[key] = prep
        return prep

    def _channel_groups(self, schedule: Schedule, pp_group, gloo: bool) -> ChannelGroups:
        per_direction = (not gloo) if self.per_direction_groups is None else self.per_direction_groups
        pairs = tuple(schedule_channels(schedule))
        key = (id(pp_group), pairs, per_direction)
        if key not in self._channels:
            self._channels[key] = ChannelGroups(pp_group, list(pairs), per_direction, self.timeout_s)
        return self._channels[key]


@dataclass(eq=False, repr=False, kw_only=True)
class _StepRunner:
    """State of one call: runs the program of this rank (`_program`: its lowered stream)."""

    mcs: object  # megatron.core.pipeline_parallel.schedules
    schedule: Schedule
    prep: _Prepared
    comm: P2P
    models: list
    iterators: list
    config: object  # the models' TransformerConfig
    model_type: object
    forward_step_func: Callable
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    cp_size: int
    model_device: torch.device
    rank: int
    recorder: TraceRecorder | None = None  # records this step's timeline (koala_ds.runtime.trace_record)

    def __post_init__(self) -> None:
        models, forward_only, config = self.models, self.forward_only, self.config
        # what the interpreter runs, and how an action waits for its input: bound once per step
        self.program = self.prep.program if self.recorder is None else self.prep.traced_program
        self._recv = self.comm.recv if self.recorder is None else timed_wait(self.recorder, self.comm.recv)
        self.pl = self.schedule.placement
        self.v = len(models)
        # deferred weight gradients (koala_ds.runtime.wgrad) for the chunks of a split-backward schedule
        self.wgrad = [wgrad.prepare(mod) for mod in models] if self.schedule.backward == "split" \
            and not forward_only else None
        # the forwards that run as an unprepared model's would (a full B's; all of them when this
        # call defers nothing on chunks a split schedule prepared)
        self.plain_forwards = wgrad.plain_forwards(self.schedule, self.rank, models, self.wgrad is not None)
        self.iterators = [(_ReorderingIterator(it) if reorder and it is not None else it)
                          for it, reorder in zip(self.iterators, self.prep.chunks_reading_data)]
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.local_acts: dict = {}
        self.local_grads: dict = {}
        self.deferred: dict = {}
        self.deallocated: set = set()
        self.synced: set = set()
        self.last_out = None  # the tensor the last compute produced for the next SEND step
        self.loss_slots: dict = {}
        self.forwards_done = [0] * self.v
        self.total_num_tokens = torch.zeros([], dtype=torch.int)
        # read only by finalize_model_grads_func, and only with calculate_per_token_loss
        self.count_tokens = bool(config.calculate_per_token_loss)
        self.dealloc = bool(config.deallocate_pipeline_outputs) and not forward_only
        # received tensors are on the p2p layer's device: moved to the model's only when it differs
        self.move_received = self.comm.device != self.model_device
        # grad sync (DDP no_sync / grad_sync_func), as megatron-core's interleaved schedule
        nsf = config.no_sync_func
        if isinstance(nsf, list):
            funcs = nsf

            def multi():
                stack = contextlib.ExitStack()
                for f in funcs:
                    stack.enter_context(f())
                return stack

            nsf = multi
        self.no_sync_func = nsf or contextlib.nullcontext
        self.no_sync_ctx = None
        gsf = config.grad_sync_func
        self.grad_sync_funcs = None if gsf is None else (gsf if isinstance(gsf, list) else [gsf] * self.v)
        psf = config.param_sync_func
        self.param_sync_funcs = None if psf is None else (psf if isinstance(psf, list) else [psf] * self.v)

    # -- grad sync ---------------------------------------------------------------------------
    def _disable_sync(self):
        if self.no_sync_ctx is None:
            self.no_sync_ctx = self.no_sync_func()
            self.no_sync_ctx.__enter__()

    def _enable_sync(self):
        if self.no_sync_ctx is not None:
            self.no_sync_ctx.__exit__(None, None, None)
            self.no_sync_ctx = None

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> None:
        if not self.forward_only:
            self._disable_sync()
        for fn, args in self.program:
            fn(self, *args)
        if not self.forward_only:
            self._enable_sync()
            if self.grad_sync_funcs is not None:
                for c in range(self.v):
                    if c not in self.synced:
                        self.grad_sync_funcs[c](self.models[c].parameters())
        leftovers = [k for k, d in (("inputs", self.inputs), ("deferred W", self.deferred)) if d]
        if leftovers:  # validate() rules this out; kept as a guard for hand-made schedules
            raise RuntimeError(f"koala runtime: rank {self.rank} ended with pending {leftovers}")

    def losses(self) -> list:
        if not self.loss_slots:
            return []
        return [item for mb in sorted(self.loss_slots) for item in self.loss_slots[mb]]

    # -- communication and grad-sync steps ---------------------------------------------------
    def _post(self, msg: Message, peer: int) -> None:
        self.comm.post(msg, peer)

    def _send(self, msg: Message, peer: int) -> None:
        comm = self.comm
        done = comm.reap()  # forget completed sends (their tensors), free sent outputs
        if self.dealloc:
            for sent in done:
                self._maybe_deallocate(sent)
        tensor, self.last_out = self.last_out, None
        comm.send(msg, peer, tensor)

    def _trace_begin(self, index: int) -> None:
        self.recorder.begin(index)

    def _trace_end(self) -> None:
        self.recorder.end()

    def _sync_before(self, chunk: int) -> None:
        """Before the chunk's last action producing weight gradients: DDP may reduce in it."""
        if self.grad_sync_funcs is None:
            self._enable_sync()

    def _sync_after(self, chunk: int) -> None:
        if self.grad_sync_funcs is not None:
            self._enable_sync()
            self.grad_sync_funcs[chunk](self.models[chunk].parameters())
        self.synced.add(chunk)
        self._disable_sync()

    # -- actions ---------------------------------------------------------------------------
    def _incoming(self, local: dict, key: tuple[int, int], msg: Message | None):
        """A stage's input (activation or gradient): from this rank's own stash when the
        neighbour stage is local (no message), else the received message, on the model's device."""
        if msg is None:
            return local.pop(key)
        tensor = self._recv(msg)
        return tensor.to(self.model_device) if self.move_received else tensor

    def _forward(self, s: int, mb: int, info: _StageInfo, in_msg: Message | None) -> None:
        chunk, forward_only = info.chunk, self.forward_only
        input_tensor = None if info.prev is None else self._incoming(self.local_acts, (s, mb), in_msg)
        if in_msg is not None:
            input_tensor.requires_grad_(not forward_only)
        first = self.forwards_done[chunk] == 0
        if first and self.param_sync_funcs is not None and self.v > 1 and not forward_only:
            self.param_sync_funcs[chunk](self.models[chunk].parameters())
        is_last = info.is_last
        store: list = []
        if (s, mb) in self.plain_forwards:  # empty unless a split schedule prepared the chunks
            with wgrad.plain_forward():
                output_tensor, num_tokens = self._forward_step(chunk, mb, input_tensor, store, first, is_last)
        else:
            output_tensor, num_tokens = self._forward_step(chunk, mb, input_tensor, store, first, is_last)
        self.forwards_done[chunk] += 1
        if self.count_tokens and isinstance(num_tokens, torch.Tensor):
            total = self.total_num_tokens
            self.total_num_tokens = (total if total.device == num_tokens.device else total.to(num_tokens.device)) \
                + num_tokens
        if is_last:
            self.loss_slots[mb] = store
        nxt = info.next
        if nxt is not None:
            if info.next_rank == self.rank:
                passed = output_tensor.detach()
                if self.dealloc:
                    passed = passed.clone()
                self.local_acts[(nxt, mb)] = passed.requires_grad_(not forward_only)
            else:
                self.last_out = output_tensor  # the SEND step that follows sends it
        if not forward_only:
            key = (s, mb)
            self.inputs[key] = input_tensor
            self.outputs[key] = output_tensor
            if self.dealloc and (nxt is None or info.next_rank == self.rank):
                self._deallocate(s, mb)

    def _forward_step(self, chunk: int, mb: int, input_tensor, store: list, first: bool, is_last: bool):
        """megatron-core's forward_step of microbatch `mb` on model chunk `chunk`: (output, tokens)."""
        mcs, it = self.mcs, self.iterators[chunk]
        if isinstance(it, _ReorderingIterator):
            it.current = mb
        return mcs.forward_step(
            self.forward_step_func, it, self.models[chunk], self.num_microbatches, input_tensor, store,
            self.config, self.cp_size, self.collect_non_loss_data, None,
            is_first_microbatch=mcs.check_first_val_step(self.first_val_step, self.forward_only, first),
            current_microbatch=mb, vp_stage=chunk if self.v > 1 else None, is_last_stage=is_last)

    def _maybe_deallocate(self, msg: Message) -> None:
        """After a completed send (deallocate_pipeline_outputs only): free the activation it sent."""
        if msg.kind == ACT:
            self._deallocate(self.pl.prev_stage(msg.stage), msg.microbatch)

    def _deallocate(self, s: int, mb: int) -> None:
        out = self.outputs.get((s, mb))
        if out is not None and (s, mb) not in self.deallocated:
            self.mcs.deallocate_output_tensor(out, True)
            self.deallocated.add((s, mb))

    def _ensure_deallocated(self, s: int, mb: int, info: _StageInfo) -> None:
        """deallocate_pipeline_outputs only: megatron's custom_backward expects a freed output."""
        if (s, mb) not in self.deallocated:
            for sent in self.comm.wait_send(Message(ACT, info.next, mb), info.next_rank):
                self._maybe_deallocate(sent)
            self._deallocate(s, mb)

    def _send_input_grad(self, s: int, mb: int, info: _StageInfo, grad) -> None:
        prev = info.prev
        if prev is None:
            return
        if grad is None:
            raise RuntimeError(f"koala runtime: stage {s} microbatch {mb} produced no input gradient; "
                               f"does the model chunk use its input tensor (set_input_tensor)?")
        if info.prev_rank == self.rank:
            self.local_grads[(prev, mb)] = grad
        else:
            self.last_out = grad  # the SEND step that follows sends it

    def _backward_full(self, s: int, mb: int, info: _StageInfo, grad_msg: Message | None) -> None:
        self._send_input_grad(s, mb, info, self._backward(s, mb, info, grad_msg))
        if self.wgrad is not None:
            self.wgrad[info.chunk].full_step_done()

    def _backward(self, s: int, mb: int, info: _StageInfo, grad_msg: Message | None):
        """megatron-core's backward_step for (s, mb); returns the input gradient."""
        key = (s, mb)
        output_grad = None if info.next is None else self._incoming(self.local_grads, key, grad_msg)
        if self.dealloc:
            self._ensure_deallocated(s, mb, info)
            self.deallocated.discard(key)
        return self.mcs.backward_step(self.inputs.pop(key), self.outputs.pop(key), output_grad, self.model_type,
                                      self.config)

    def _backward_input(self, s: int, mb: int, info: _StageInfo, grad_msg: Message | None) -> None:
        """I: megatron-core's backward_step with the weight-gradient GEMMs queued for W."""
        with self.wgrad[info.chunk].input_step() as queue:
            grad = self._backward(s, mb, info, grad_msg)
        self.deferred[(s, mb)] = queue
        self._send_input_grad(s, mb, info, grad)

    def _backward_weight(self, s: int, mb: int) -> None:
        config = self.config
        if config.timers is not None:
            config.timers("backward-compute", log_level=2).start()
        self.deferred.pop((s, mb)).run()
        if config.timers is not None:
            config.timers("backward-compute").stop()


def get_forward_backward_func(schedule="1f1b", profile=None, *, timeout_s: float | None = None,
                              per_direction_groups: bool | None = None,
                              timeout_name: str = "get_forward_backward_func(timeout_s=...)",
                              trace: str | TraceRecorder | None = None,
                              trace_name: str = "get_forward_backward_func(trace=...)") -> KoalaForwardBackward:
    """A drop-in for megatron-core's `get_forward_backward_func()` that runs a Koala schedule.

    `schedule`: a `koala_ds.Schedule`, a library name (compiled for the pipeline size, the
    number of model chunks and the number of microbatches of each call), or a .koala / .json
    / .csv file. `profile`: a cost profile (path or dict) kept for reporting. `timeout_s`:
    deadline of every p2p wait (default $KOALA_TIMEOUT_S, or its older name $KOALA_P2P_TIMEOUT,
    or 600 s; see koala_ds.runtime.timeout). `per_direction_groups`: one communicator per direction of
    each pipeline link (default: on for NCCL, off for gloo). `timeout_name`: how error messages
    name the setting timeout_s came from (a launcher passes its flag). `trace`: FILE: each
    process records the measured timeline of every training call in FILE.rank{global rank}.json
    (koala_ds.runtime.trace_record; its folder is checked here), or another function's `.recorder`:
    schedules taking turns in one process record into one recorder, each its own file
    (FILE.<schedule name>), their steps numbered together; `trace_name`: how messages name it."""
    return KoalaForwardBackward(schedule, profile, timeout_s, per_direction_groups, timeout_name, trace, trace_name)
