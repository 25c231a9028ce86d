"""p2p latency between two ranks for a given tensor size: a 2-process gloo ping-pong."""
from __future__ import annotations

import statistics
import time


def pingpong_worker(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    numel, iters, warmup = int(spec["numel"]), int(spec.get("iters", 50)), int(spec.get("warmup", 5))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    buf = torch.zeros(max(1, numel), dtype=dtype)
    peer = 1 - rank
    rtts = []
    dist.barrier()
    for k in range(warmup + iters):
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, dst=peer).wait()
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.isend(buf, dst=peer).wait()
        if k >= warmup:
            rtts.append(time.perf_counter() - t0)
    return {"rtt_ms": [x * 1000 for x in rtts]}


def measure_p2p_latency(numel: int, dtype: str = "float32", iters: int = 50, timeout_s: float = 120.0) -> float:
    """One-way latency (ms) of a message of `numel` elements: median round trip / 2 between two
    local gloo processes. Raises `koala_ds.spawn.SpawnError` past `timeout_s`."""
    from ..spawn import spawn

    res = spawn("koala_ds.profiler.p2p:pingpong_worker", 2, {"numel": numel, "dtype": dtype, "iters": iters},
                timeout_s=timeout_s)
    return statistics.median(res[0]["rtt_ms"]) / 2.0
