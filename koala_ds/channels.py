"""Which process group carries each channel (ordered pair of pipeline ranks) of a pipeline.

Both engines post receives ahead of their consumers (koala_ds.lowering). On NCCL the two
directions between two ranks would share one communicator and one CUDA stream, where a pending
receive blocks a later send to the same peer: every channel gets its own two-rank group then.
On gloo one group serves every channel (gloo matches by source and tag). torch only.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from .ir import Schedule

log = logging.getLogger(__name__)


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
