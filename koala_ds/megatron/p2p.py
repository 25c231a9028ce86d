"""Point-to-point layer of the Megatron runtime: non-blocking sends, posted receives, timeouts.

The runtime interprets the lowered stream of its rank (`koala_ds.runtime.lowering`): a RECV step posts
a receive (`P2P.post`), the compute that consumes the message waits for it (`P2P.recv`), a SEND
step sends (`P2P.send`). The lowering orders every channel's receives as its sender sends, so
messages are matched by order alone. That is what NCCL does (it ignores tags), and it is what
we do on gloo too (every message uses tag 0), so the gloo tests exercise the rule NCCL relies on.

On NCCL, every channel gets its own two-rank communicator (one per direction, see
`koala_ds.runtime.channels`), so that a pending receive from a peer never queues behind a send to that
same peer on one CUDA stream. On gloo a channel is just (pipeline group, peer): gloo matches by
source, so the directions cannot mix. Every wait has a deadline and raises `P2PTimeoutError` naming what it waited for.
"""
from __future__ import annotations

import logging
from collections import deque

import torch
import torch.distributed as dist

from ..runtime import packed
from ..runtime.bounded_collectives import WaitFailure, is_gloo, wait_work
from ..runtime.channels import ChannelGroups, schedule_channels
from ..core.ir import KoalaError
from ..runtime.lowering import ACT, GRAD, Message

log = logging.getLogger(__name__)

__all__ = ["ACT", "GRAD", "Message", "P2P", "P2PTimeoutError", "ChannelGroups", "CollectiveWaiter",
           "schedule_channels", "wait_failed", "to_device"]


class P2PTimeoutError(KoalaError, TimeoutError):
    """A pipeline receive or send did not complete in time (a peer died, hung or diverged), or
    failed before its deadline (the peer closed the connection): the message says which. What
    one rank saw (`rank_local`): that rank prints it (koala_ds.core.errors), not rank 0."""

    rank_local = True


class P2P:
    """Send and receive the tensors of one step as the lowered stream says, with a timeout on every wait.

    `shape`, `dtype`: of every message (megatron-core sends one fixed-shape tensor per stage)."""

    def __init__(self, rank: int, channels: ChannelGroups, shape: tuple, dtype, timeout_s: float,
                 device: torch.device, gloo: bool, timeout_source: str = "timeout_s"):
        self.rank = rank
        self.channels = channels
        self.shape, self.dtype = tuple(shape), dtype
        self.timeout_s = timeout_s
        self.timeout_source = timeout_source  # the setting timeout_s came from, for messages
        self.device = device
        self.gloo = gloo
        self._proto = torch.empty(0, dtype=dtype, device=device)
        self._posted: dict[Message, tuple[torch.Tensor, object, int]] = {}
        # per destination, in the order sent: (message, work, tensor); a channel completes in order
        self._sends: dict[int, deque[tuple[Message, object, torch.Tensor]]] = {}
        self._in_flight: set[Message] = set()  # the messages in _sends (sent, not known complete)
        if channels is not None:  # per peer: (the link to receive on, the link to send on)
            self._peers = channels.links(rank)

    # -- receiving -----------------------------------------------------------------------
    def post(self, msg: Message, peer: int) -> None:
        """Post the receive of `msg` from pipeline rank `peer` (the stream's RECV step)."""
        buf = self._proto.new_empty(self.shape)  # dtype and device of the prototype, no argument parsing
        self._posted[msg] = (buf, self._peers[peer][0].irecv(buf), peer)

    def recv(self, msg: Message) -> torch.Tensor:
        """Wait for the posted receive of `msg`; its tensor."""
        buf, work, peer = self._posted.pop(msg)
        self._wait(work, "receive", msg, peer)
        return buf

    # -- sending -------------------------------------------------------------------------
    def send(self, msg: Message, dst: int, tensor: torch.Tensor) -> None:
        if self.gloo and tensor.is_cuda:
            tensor = tensor.cpu()
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        queue = self._sends.get(dst)
        if queue is None:
            queue = self._sends[dst] = deque()
        queue.append((msg, self._peers[dst][1].isend(tensor), tensor))
        self._in_flight.add(msg)

    def reap(self) -> list[Message]:
        """Forget the sends that have completed (their tensors); their messages. A channel's sends
        complete in the order they were issued, so only each channel's oldest is checked: constant
        work per send, where scanning every pending send cost O(sends) per call, O(sends^2) per
        step. gloo: none, as gloo's send work reports completion only once waited."""
        if self.gloo:
            return []
        done = []
        for queue in self._sends.values():
            while queue and queue[0][1].is_completed():
                done.append(queue.popleft()[0])
        self._in_flight.difference_update(done)
        return done

    def wait_send(self, msg: Message, dst: int) -> list[Message]:
        """Wait for the send of `msg` to pipeline rank `dst` if it is still pending, and for the
        sends to `dst` before it (on one channel they complete in order: no extra wait); the
        messages of the sends it completed, as `reap` returns them."""
        done: list[Message] = []
        if msg not in self._in_flight:
            return done
        queue = self._sends[dst]
        while msg not in done:
            sent, work, _tensor = queue.popleft()
            self._in_flight.discard(sent)
            self._wait(work, "send", sent, dst)
            done.append(sent)
        return done

    def finish(self) -> None:
        """Wait for every outstanding send; check that every posted receive was consumed."""
        for dst, queue in self._sends.items():
            for msg, work, _tensor in queue:
                self._wait(work, "send", msg, dst)
        self._sends, self._in_flight = {}, set()
        if self._posted:
            raise RuntimeError(f"koala p2p: rank {self.rank} ended the step with unreceived {list(self._posted)}")

    # -- objects (loss dicts) --------------------------------------------------------------
    def send_object(self, obj, dst_pp_rank: int) -> None:
        """Blocking send of a small object of tensors (koala_ds.runtime.packed) on the pipeline group."""
        data = packed.pack(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        group, dst = self.channels.pp_group, self.channels.global_rank(dst_pp_rank)
        dev = self.device
        for t in (size.to(dev), data.to(dev)):
            self._wait(dist.isend(t, dst=dst, group=group, tag=1), f"send the loss values to pipeline rank {dst_pp_rank}")

    def recv_object(self, src_pp_rank: int, device: torch.device):
        """What `send_object` sent from `src_pp_rank`, its tensors on `device`."""
        group, src = self.channels.pp_group, self.channels.global_rank(src_pp_rank)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(size, src=src, group=group, tag=1), f"receive the loss values from pipeline rank {src_pp_rank}")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(data, src=src, group=group, tag=1), f"receive the loss values from pipeline rank {src_pp_rank}")
        return packed.unpack(data, device)

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self, work, what: str, msg: Message | None = None, peer: int = -1) -> None:
        """Wait for `work`; on failure raise naming `what` ("receive" / "send" of `msg` from / to
        `peer`, or a whole phrase when msg is None). The text is built only on failure."""
        if work is None:
            return
        failure = wait_work(work, self.timeout_s, self.gloo)
        if failure is not None:
            if msg is not None:
                what = f"{what} {msg.describe()} {'from' if what == 'receive' else 'to'} pipeline rank {peer}"
            raise wait_failed(f"koala p2p: pipeline rank {self.rank}", what, failure, self.timeout_source)


def wait_failed(who: str, what: str, failure: WaitFailure, source: str) -> P2PTimeoutError:
    """The error for a wait that ended without its message or collective: a timeout, or (gloo
    raising well before the deadline) a transport failure such as the peer closing the connection."""
    cause, timeout_s = failure.cause, failure.timeout_s
    if failure.early:
        return P2PTimeoutError(f"{who} could not {what}: the connection failed after {failure.elapsed:.1f} s, "
                               f"before the {timeout_s:g} s timeout (the peer closed it or crashed): {cause}")
    return P2PTimeoutError(f"{who} failed to {what} within {timeout_s:g} s (timeout from "
                           f"{source}; set it with get_forward_backward_func(timeout_s=...), "
                           f"--koala-p2p-timeout or KOALA_TIMEOUT_S)" + (f": {cause}" if cause else ""))


class CollectiveWaiter:
    """The `wait` of `koala_ds.runtime.bounded_collectives` for one forward_backward_func call: every
    blocking collective issued during the call waits at most the pipeline timeout, then raises
    P2PTimeoutError naming the rank, the collective and `phase` (where in the call it was)."""

    def __init__(self, who: str, timeout_s: float, source: str) -> None:
        self.who, self.timeout_s, self.source = who, timeout_s, source
        self.phase = "the pipeline steps"

    def __call__(self, work, group, describe) -> None:
        self.wait(work, is_gloo(group), describe)

    def wait(self, work, gloo: bool, describe) -> None:
        failure = wait_work(work, self.timeout_s, gloo)
        if failure is not None:
            raise wait_failed(self.who, f"finish {describe()} (in {self.phase})", failure, self.source)


def to_device(obj, device):
    """A tensor, or a dict / list / tuple of them (nested), on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
