"""The Koala engine's messages and collectives: point-to-point sends and receives along the
lowered stream, their tags and shapes, and every wait bounded by the step's timeout."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from deepspeed import comm as dist

from ..core.ir import Schedule
from ..runtime.bounded_collectives import WaitFailure, wait_work
from ..runtime.channels import ChannelGroups, Link, schedule_channels
from ..runtime.lowering import ACT, GRAD, Message
from .config import ENV_KOALA_TIMEOUT, KoalaConfigError, PipelineTimeoutError

_META_SIZE = 256
_KINDS = {"meta": 0, ACT: 1, GRAD: 2}
_MAX_TENSORS = 32


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


class PipeComm:
    """The communication half of `KoalaPipelineEngine` (a mixin over DeepSpeed's `PipelineEngine`)."""

    def _channel_groups(self, schedule: Schedule, p: int, timeout_s: float) -> tuple[list, list]:
        """Per pipeline rank, the group to send to it on and the group to receive from it on
        (koala_ds.runtime.channels: receives are posted ahead of their consumers; on NCCL each direction
        needs its own communicator). Collective on non-gloo backends: every rank builds its engine."""
        if self._koala_gloo:
            return [None] * p, [None] * p
        groups = ChannelGroups(self.grid.get_pipe_parallel_group(), schedule_channels(schedule), True, timeout_s)
        me = self.stage_id
        return [groups.group(me, q) for q in range(p)], [groups.group(q, me) for q in range(p)]

    def _p2p_links(self, direct: bool) -> list:
        """Per pipeline rank: (the link to send to it on, the link to receive from it on), on
        torch.distributed's process groups directly (`direct`) or through deepspeed.comm; built once."""
        if direct not in self._link_sets:
            kind = Link if direct else _CommLink
            self._link_sets[direct] = [(kind(self._send_groups[r], g), kind(self._recv_groups[r], g))
                                       for r, g in enumerate(self._pipe_global)]
        return self._link_sets[direct]

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
        (`koala_ds.runtime.channels.Link`) when `deepspeed.comm` would only forward to torch.distributed
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
