"""koala_ds.runtime.channels.Link: the engines' sends and receives on a process group directly."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")


def link_worker(rank: int, world: int, spec: dict) -> dict:
    """Rank 1 sends to rank 2 on the group {1, 2} (where rank 2 is group rank 1) and rank 0 to
    rank 2 on the default group; a plain float tensor and a complex one (torch.distributed's path)."""
    import torch
    import torch.distributed as dist

    from koala_ds.runtime.channels import Link

    sub = dist.new_group([1, 2])
    plain, cplx = torch.arange(6, dtype=torch.float32) + rank, torch.tensor([1 + 2j, -3j]) * (rank + 1)
    out = {}
    if rank in (0, 1):
        link = Link(sub if rank == 1 else None, 2)
        for t in (plain, cplx):
            link.isend(t, tag=rank).wait()
    else:
        for src, group in ((1, sub), (0, None)):
            link = Link(group, src)
            got = [torch.empty(6), torch.empty(2, dtype=torch.complex64)]
            for t in got:
                link.irecv(t, tag=src).wait()
            out[src] = [t.tolist() for t in got]
    dist.barrier()
    return out


@pytest.mark.slow
def test_link_sends_to_the_global_rank_given_on_any_group():
    from koala_ds.runtime.spawn import spawn
    from rank_processes import PRELOAD

    got = spawn("test_channels_link:link_worker", 3, {}, timeout_s=120, preload=PRELOAD)[2]
    for src in (0, 1):
        assert got[src][0] == [float(i + src) for i in range(6)]
        assert got[src][1] == [complex(1, 2) * (src + 1), complex(0, -3) * (src + 1)]


def test_autograd_floor_is_the_cpu_of_one_emulated_forward_and_backward():
    from koala_ds.profiler.emulate import autograd_cpu_ms

    ms = autograd_cpu_ms(iters=30, warmup=5)
    assert math.isfinite(ms) and ms > 0.0  # a CPU time: how large depends on the machine and its load
