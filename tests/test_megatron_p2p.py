"""The Megatron runtime's p2p layer keeps its pending sends per channel, in the order sent: the
work per send is constant (it was O(pending sends), O(sends^2) per step), and what it frees and
waits for is unchanged. Single process: the links are stand-ins that record what P2P asks of
them (the real ones are tested by the multi-process Megatron tests)."""
from __future__ import annotations

import pytest

from koala_ds.runtime.lowering import ACT, GRAD, Message

pytest.importorskip("torch")


class _Work:
    """A send's work: completed when the test says so; counts what P2P asks of it."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done, self.polls = log, name, False, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done

    def wait(self, timeout=None) -> bool:
        self.log.append(self.name)
        self.done = True
        return True


class _Link:
    def __init__(self, log: list):
        self.log, self.works = log, []

    def isend(self, tensor):
        self.works.append(_Work(self.log, f"send {len(self.works)}"))
        return self.works[-1]


class _Channels:
    def __init__(self, peers: list[int], log: list):
        self.send_links = {peer: _Link(log) for peer in peers}

    def links(self, rank: int) -> dict:
        return {peer: (None, link) for peer, link in self.send_links.items()}


def _p2p(gloo: bool, peers=(1,)):
    import torch

    from koala_ds.megatron.p2p import P2P

    log: list = []
    channels = _Channels(list(peers), log)
    comm = P2P(0, channels, (2,), torch.float32, 5.0, torch.device("cpu"), gloo)
    return comm, channels.send_links, log


def _send(comm, count: int, dst: int = 1, kind=ACT) -> list[Message]:
    import torch

    msgs = [Message(kind, 1, mb) for mb in range(count)]
    for msg in msgs:
        comm.send(msg, dst, torch.zeros(2))
    return msgs


def test_reaping_checks_only_each_channels_oldest_send():
    comm, links, _log = _p2p(gloo=False)
    _send(comm, 50)
    for _ in range(50):
        assert comm.reap() == []
    works = links[1].works
    assert works[0].polls == 50 and all(w.polls == 0 for w in works[1:]), [w.polls for w in works[:3]]


def test_reaping_frees_completed_sends_in_order_per_channel():
    import torch

    comm, links, _log = _p2p(gloo=False, peers=(1, 2))
    to_1 = _send(comm, 4, dst=1)
    to_2 = [Message(GRAD, 0, mb) for mb in range(2)]
    for msg in to_2:
        comm.send(msg, 2, torch.zeros(2))
    for work in links[1].works[:2] + links[2].works[1:]:
        work.done = True
    # peer 1: the two oldest are done; peer 2: its oldest is not, so its second waits behind it
    assert comm.reap() == to_1[:2]
    links[2].works[0].done = True
    assert comm.reap() == to_2
    assert comm.wait_send(to_1[0], 1) == []  # already reaped: nothing to wait for
    for work in links[1].works:
        work.done = True
    comm.finish()
    assert comm.reap() == []


def test_on_gloo_reaping_is_free_and_waiting_for_a_send_waits_its_channel_up_to_it():
    comm, links, log = _p2p(gloo=True)
    msgs = _send(comm, 5)
    assert comm.reap() == []
    assert all(w.polls == 0 for w in links[1].works)  # gloo's send work reports completion only once waited
    assert comm.wait_send(msgs[2], 1) == msgs[:3]  # what it completed: the runtime frees their outputs
    assert log == ["send 0", "send 1", "send 2"]
    assert comm.wait_send(msgs[1], 1) == []  # waited already
    comm.finish()
    assert log == ["send 0", "send 1", "send 2", "send 3", "send 4"]
