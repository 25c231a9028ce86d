"""Which process group carries each channel (ordered pair of pipeline ranks) of a pipeline.

Both engines post receives ahead of their consumers (koala_ds.runtime.lowering). On NCCL the two
directions between two ranks would share one communicator and one CUDA stream, where a pending
receive blocks a later send to the same peer: every channel gets its own two-rank group then.
On gloo one group serves every channel (gloo matches by source and tag). torch only.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.ir import Schedule

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


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
    pipeline groups at once, in the same order everywhere)."""

    def __init__(self, pp_group, pairs: list[tuple[int, int]], per_direction: bool, timeout_s: float):
        self.pp_group = pp_group
        self.pp_ranks = dist.get_process_group_ranks(pp_group)
        self.per_direction = per_direction
        self._groups: dict[tuple[int, int], object] = {}
        self._links: dict[int, list] = {}
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

    def links(self, rank: int) -> list[tuple["Link", "Link"]]:
        """Per pipeline rank q: (the link pipeline rank `rank` receives from q on, the link it
        sends to q on); built once per rank."""
        if rank not in self._links:
            self._links[rank] = [(Link(self.group(q, rank), self.pp_ranks[q]), Link(self.group(rank, q), self.pp_ranks[q]))
                                 for q in range(len(self.pp_ranks))]
        return self._links[rank]


class Link:
    """Non-blocking send to / receive from one peer on one process group, without
    torch.distributed's per-call Python (`dist.isend` / `dist.irecv` check the tensor and the
    group and map the peer's global rank to its rank in the group on every call: about 12 us
    of CPU per message on this machine). The group and the peer's rank in it are looked up once;
    a tensor the plain path does not cover (complex, a tensor subclass) goes through
    torch.distributed. Both return the Work, as `dist.isend` / `dist.irecv` do."""

    __slots__ = ("group", "peer", "_pg", "_group_peer", "_send", "_recv")

    def __init__(self, group, peer: int) -> None:
        import torch.distributed.distributed_c10d as c10d

        self.group, self.peer = group, peer  # as torch.distributed takes them: group (None: default), global rank
        self._pg = group if group is not None else c10d._get_default_group()
        self._group_peer = dist.get_group_rank(self._pg, peer)
        self._send, self._recv = self._pg.send, self._pg.recv

    def isend(self, tensor, tag: int = 0):
        if type(tensor) is not _Tensor or tensor.is_complex():
            return dist.isend(tensor, dst=self.peer, group=self.group, tag=tag)
        return self._send([tensor], self._group_peer, tag)

    def irecv(self, tensor, tag: int = 0):
        if type(tensor) is not _Tensor or tensor.is_complex():
            return dist.irecv(tensor, src=self.peer, group=self.group, tag=tag)
        return self._recv([tensor], self._group_peer, tag)
