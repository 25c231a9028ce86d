"""Point-to-point layer of the Megatron runtime: non-blocking sends, ordered receives, timeouts.

Every message of one training step is known in advance from the schedule (`CommPlan`): for
each ordered pair of pipeline ranks (a *channel*), the exact sequence of messages the sender
will send. The receiver posts its receives on a channel in that same sequence, so messages
are matched by order alone. That is what NCCL does (it ignores tags), and it is what we do on
gloo too (every message uses tag 0), so the gloo tests exercise the rule NCCL relies on.

Why order and not "the order the receiver needs them": when both neighbours are the same rank
(pp=2 with two chunks per rank) one channel carries activations of one stage and gradients of
another; the sender and the receiver can need them in different orders. Megatron-core's stock
interleaved schedule batches them in the receiver's order and gets crossed messages on gloo.

On NCCL, every channel gets its own two-rank communicator (one per direction), so that a
pending receive from a peer never queues behind a send to that same peer on one CUDA stream.
On gloo a channel is just (pipeline group, peer): gloo matches by source, so the directions
cannot mix. Every wait has a deadline and raises `P2PTimeoutError` naming what it waited for.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..bounded_collectives import is_gloo, wait_work
from ..ir import KoalaError, Op, Schedule

log = logging.getLogger(__name__)

ACT = "activation"
GRAD = "gradient"


class P2PTimeoutError(KoalaError, TimeoutError):
    """A pipeline receive or send did not complete in time (a peer died, hung or diverged), or
    failed before its deadline (the peer closed the connection): the message says which."""


class MessageKey(NamedTuple):
    """One message: the `kind` of tensor for virtual `stage` and `microbatch`.

    An activation message carries the input of `stage`; a gradient message carries the
    gradient of the output of `stage`. (A named tuple: hashed and compared in C, several
    times per action, as a dict key of the p2p layer.)"""

    kind: str
    stage: int
    microbatch: int

    def describe(self) -> str:
        what = "input activation" if self.kind == ACT else "output gradient"
        return f"the {what} of stage {self.stage} microbatch {self.microbatch}"


@dataclass
class CommPlan:
    """Who sends what to whom, in which order, for one rank of one schedule."""

    rank: int
    #: per peer, the messages this rank receives from it, in the peer's send order
    incoming: dict[int, list[MessageKey]] = field(default_factory=dict)
    #: per peer, the messages this rank sends to it, in this rank's order
    outgoing: dict[int, list[MessageKey]] = field(default_factory=dict)
    #: message -> (peer, index in that channel's sequence)
    recv_index: dict[MessageKey, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, schedule: Schedule, rank: int, forward_only: bool = False) -> "CommPlan":
        pl = schedule.placement
        sends: dict[tuple[int, int], list[MessageKey]] = {}
        for src, actions in enumerate(schedule.ranks):
            for a in actions:
                if a.op is Op.F:
                    nxt = pl.next_stage(a.stage)
                    if nxt is not None and pl.rank_of(nxt) != src:
                        sends.setdefault((src, pl.rank_of(nxt)), []).append(MessageKey(ACT, nxt, a.microbatch))
                elif a.op in (Op.B, Op.I) and not forward_only:
                    prev = pl.prev_stage(a.stage)
                    if prev is not None and pl.rank_of(prev) != src:
                        sends.setdefault((src, pl.rank_of(prev)), []).append(MessageKey(GRAD, prev, a.microbatch))
        plan = cls(rank)
        for (src, dst), keys in sends.items():
            if dst == rank:
                plan.incoming[src] = keys
                for i, key in enumerate(keys):
                    plan.recv_index[key] = (src, i)
            if src == rank:
                plan.outgoing[dst] = keys
        return plan

    def channels(self) -> set[tuple[int, int]]:
        """Ordered (src, dst) pipeline-rank pairs that carry messages, seen from this rank."""
        return {(src, self.rank) for src in self.incoming} | {(self.rank, dst) for dst in self.outgoing}


def schedule_channels(schedule: Schedule) -> list[tuple[int, int]]:
    """Every ordered (src, dst) pair of pipeline ranks that some message travels on."""
    pl = schedule.placement
    pairs = set()
    for s in range(pl.num_stages):
        nxt = pl.next_stage(s)
        if nxt is not None and pl.rank_of(s) != pl.rank_of(nxt):
            pairs.add((pl.rank_of(s), pl.rank_of(nxt)))
            pairs.add((pl.rank_of(nxt), pl.rank_of(s)))
    return sorted(pairs)


class ChannelGroups:
    """Process groups for the channels of one pipeline group.

    gloo: the pipeline group itself for every channel. NCCL (or `per_direction=True`): one
    two-rank group per ordered pair, created collectively by every rank of the job (all
    pipeline groups at once, in the same order everywhere), the first time a step runs."""

    def __init__(self, pp_group, pairs: list[tuple[int, int]], per_direction: bool, timeout_s: float):
        self.pp_group = pp_group
        self.pp_ranks = dist.get_process_group_ranks(pp_group)
        self.per_direction = per_direction
        self._groups: dict[tuple[int, int], object] = {}
        if per_direction:
            self._create(pairs, timeout_s)

    def _create(self, pairs: list[tuple[int, int]], timeout_s: float) -> None:
        world = dist.get_world_size()
        all_pp: list = [None] * world
        dist.all_gather_object(all_pp, list(self.pp_ranks))
        groups = sorted({tuple(g) for g in all_pp})
        mine = tuple(self.pp_ranks)
        for pp_ranks in groups:
            for src, dst in pairs:
                ranks = [pp_ranks[src], pp_ranks[dst]]
                # new_group sorts ranks; the same two ranks get two groups, one per direction.
                group = dist.new_group(ranks, timeout=timedelta(seconds=max(timeout_s, 60)),
                                       group_desc=f"koala_p2p_{pp_ranks[src]}_to_{pp_ranks[dst]}")
                if pp_ranks == mine:
                    self._groups[(src, dst)] = group
        log.info("created %d per-direction p2p groups for %d pipeline group(s)", len(pairs) * len(groups), len(groups))

    def group(self, src: int, dst: int):
        return self._groups.get((src, dst), self.pp_group) if self.per_direction else self.pp_group

    def global_rank(self, pp_rank: int) -> int:
        return self.pp_ranks[pp_rank]


@dataclass
class _Posted:
    tensor: torch.Tensor
    work: object | None


class P2P:
    """Send and receive the tensors of one step by the plan, with a timeout on every wait."""

    def __init__(self, plan: CommPlan, channels: ChannelGroups, recv_spec, timeout_s: float, device: torch.device,
                 gloo: bool, timeout_source: str = "timeout_s"):
        self.plan = plan
        self.channels = channels
        self.recv_spec = recv_spec  # MessageKey -> (shape, dtype)
        self.timeout_s = timeout_s
        self.timeout_source = timeout_source  # the setting timeout_s came from, for messages
        self.device = device
        self.gloo = gloo
        self._next_post = {peer: 0 for peer in plan.incoming}
        self._posted: dict[MessageKey, _Posted] = {}
        self._sent: dict[int, int] = {peer: 0 for peer in plan.outgoing}
        self.pending_sends: list[tuple[MessageKey, int, object, torch.Tensor]] = []

    # -- receiving -----------------------------------------------------------------------
    def post(self, key: MessageKey) -> None:
        """Post the receive of `key` and of every earlier message on its channel (sender order)."""
        if key in self._posted:
            return
        peer, index = self.plan.recv_index[key]
        seq = self.plan.incoming[peer]
        group = self.channels.group(peer, self.plan.rank)
        src = self.channels.global_rank(peer)
        while self._next_post[peer] <= index:
            k = seq[self._next_post[peer]]
            shape, dtype = self.recv_spec(k)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=src, group=group, tag=0)
            self._posted[k] = _Posted(buf, work)
            self._next_post[peer] += 1

    def recv(self, key: MessageKey) -> torch.Tensor:
        self.post(key)
        posted = self._posted.pop(key)
        peer, _ = self.plan.recv_index[key]
        self._wait(posted.work, f"receive {key.describe()} from pipeline rank {peer}")
        return posted.tensor

    # -- sending -------------------------------------------------------------------------
    def send(self, key: MessageKey, dst: int, tensor: torch.Tensor) -> None:
        expected = self.plan.outgoing[dst][self._sent[dst]]
        if expected != key:  # a bug in the runtime, never a user error
            raise RuntimeError(f"koala p2p: rank {self.plan.rank} sends {key} to {dst} but the plan says {expected}")
        self._sent[dst] += 1
        if self.gloo and tensor.is_cuda:
            tensor = tensor.cpu()
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.channels.global_rank(dst), group=self.channels.group(self.plan.rank, dst),
                          tag=0)
        self.pending_sends.append((key, dst, work, tensor))

    def reap(self) -> list[MessageKey]:
        """Forget sends that have completed; returns their keys."""
        done, still = [], []
        for item in self.pending_sends:
            (done if item[2].is_completed() else still).append(item)
        self.pending_sends = still
        return [item[0] for item in done]

    def wait_send(self, key: MessageKey) -> None:
        for item in list(self.pending_sends):
            if item[0] == key:
                self._wait(item[2], f"send {key.describe()} to pipeline rank {item[1]}")
                self.pending_sends.remove(item)

    def finish(self) -> None:
        """Wait for every outstanding send; check that the plan was followed to the end."""
        for key, dst, work, _ in self.pending_sends:
            self._wait(work, f"send {key.describe()} to pipeline rank {dst}")
        self.pending_sends = []
        left = [k for k in self._posted]
        unsent = {d: len(seq) - self._sent[d] for d, seq in self.plan.outgoing.items() if self._sent[d] != len(seq)}
        if left or unsent:
            raise RuntimeError(f"koala p2p: rank {self.plan.rank} ended the step with unreceived {left} / unsent {unsent}")

    # -- objects (loss dicts) --------------------------------------------------------------
    def send_object(self, obj, dst_pp_rank: int) -> None:
        """Blocking send of a picklable object (tensors moved to CPU) on the pipeline group."""
        buf = io.BytesIO()
        torch.save(_to_cpu(obj), buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        group, dst = self.channels.pp_group, self.channels.global_rank(dst_pp_rank)
        dev = self.device
        for t in (size.to(dev), data.to(dev)):
            self._wait(dist.isend(t, dst=dst, group=group, tag=1), f"send the loss values to pipeline rank {dst_pp_rank}")

    def recv_object(self, src_pp_rank: int, device: torch.device):
        group, src = self.channels.pp_group, self.channels.global_rank(src_pp_rank)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(size, src=src, group=group, tag=1), f"receive the loss values from pipeline rank {src_pp_rank}")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(data, src=src, group=group, tag=1), f"receive the loss values from pipeline rank {src_pp_rank}")
        obj = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)
        return to_device(obj, device)

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self, work, what: str) -> None:
        if work is None:
            return
        done, error, elapsed = wait_work(work, self.timeout_s, self.gloo)
        if not done:
            raise self._failed(what, error, elapsed)

    def _failed(self, what: str, error: str, elapsed: float) -> P2PTimeoutError:
        return wait_failed(f"koala p2p: pipeline rank {self.plan.rank}", what, error, elapsed, self.timeout_s,
                           self.timeout_source)


def wait_failed(who: str, what: str, error: str, elapsed: float, timeout_s: float, source: str) -> P2PTimeoutError:
    """The error for a wait that ended without its message or collective: a timeout, or (gloo
    raising well before the deadline) a transport failure such as the peer closing the connection."""
    cause = error.splitlines()[0][:200] if error else ""
    if elapsed < 0.9 * timeout_s:
        return P2PTimeoutError(f"{who} could not {what}: the connection failed after {elapsed:.1f} s, "
                               f"before the {timeout_s:g} s timeout (the peer closed it or crashed): {cause}")
    return P2PTimeoutError(f"{who} failed to {what} within {timeout_s:g} s (timeout from "
                           f"{source}; set it with get_forward_backward_func(timeout_s=...), "
                           f"--koala-p2p-timeout or KOALA_TIMEOUT_S)" + (f": {cause}" if cause else ""))


class CollectiveWaiter:
    """The `wait` of `koala_ds.bounded_collectives` for one forward_backward_func call: every
    blocking collective issued during the call waits at most the pipeline timeout, then raises
    P2PTimeoutError naming the rank, the collective and `phase` (where in the call it was)."""

    def __init__(self, who: str, timeout_s: float, source: str) -> None:
        self.who, self.timeout_s, self.source = who, timeout_s, source
        self.phase = "the pipeline steps"

    def __call__(self, work, group, describe) -> None:
        self.wait(work, is_gloo(group), describe)

    def wait(self, work, gloo: bool, describe) -> None:
        done, error, elapsed = wait_work(work, self.timeout_s, gloo)
        if not done:
            raise wait_failed(self.who, f"finish {describe()} (in {self.phase})", error, elapsed, self.timeout_s,
                              self.source)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def to_device(obj, device):
    """A tensor, or a dict / list / tuple of them (nested), on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
