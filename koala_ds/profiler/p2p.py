"""p2p latency between two ranks for a given tensor size: a 2-process gloo ping-pong. It also
measures the CPU time a message costs a rank (its process's threads, gloo's included)."""
from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import dataclass

from ..core.ir import KoalaError

#: The largest message the ping-pong sends (each of its two processes holds one buffer of it):
#: 1 GiB, far above any stage-boundary tensor worth profiling on one machine.
MAX_MESSAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class P2PCost:
    latency_ms: float          # one way: median round trip / 2
    cpu_ms_per_message: float  # CPU time of one rank per message it sends or receives


def pingpong_worker(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    numel, iters, warmup = int(spec["numel"]), int(spec.get("iters", 50)), int(spec.get("warmup", 5))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    buf = torch.zeros(max(1, numel), dtype=dtype)
    peer = 1 - rank
    rtts = []
    dist.barrier()
    c0 = 0.0
    for k in range(warmup + iters):
        if k == warmup:
            c0 = time.process_time()
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, dst=peer).wait()
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.isend(buf, dst=peer).wait()
        if k >= warmup:
            rtts.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    return {"rtt_ms": [x * 1000 for x in rtts], "cpu_ms_per_message": cpu * 1000 / (2 * max(1, iters))}


def _available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


def _sendable(kind) -> bool:
    """Whether the ping-pong can fill a buffer of `kind` (not a quantized dtype, say)."""
    import torch

    try:
        with warnings.catch_warnings():  # quantized dtypes: a deprecation warning before they fail
            warnings.simplefilter("ignore")
            torch.empty(1, dtype=kind).zero_()  # what the ping-pong does to its buffers
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def check_message(numel: int, dtype: str = "float32", flag: str = "--numel") -> int:
    """The message's size in bytes, or a one-line KoalaError: `dtype` is not a torch dtype,
    `numel` < 1, the message is above MAX_MESSAGE_BYTES, or the two processes' buffers would
    not fit the memory available now."""
    import torch

    kind = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(kind, torch.dtype):
        raise KoalaError(f"--dtype {dtype!r}: not a torch dtype (e.g. float32, bfloat16, float16)")
    if not _sendable(kind):
        raise KoalaError(f"--dtype {dtype}: not a dtype gloo sends (e.g. float32, bfloat16, float16, int64)")
    if not isinstance(numel, int) or numel < 1:
        raise KoalaError(f"{flag} must be a positive integer, got {numel!r}")
    size = numel * torch.empty((), dtype=kind).element_size()
    if size > MAX_MESSAGE_BYTES:
        raise KoalaError(f"{flag} {numel}: a message of {size / 2 ** 30:.3g} GiB ({dtype}) is above the "
                         f"ping-pong's cap of {MAX_MESSAGE_BYTES / 2 ** 30:g} GiB; give a smaller {flag}")
    avail = _available_bytes()
    if avail is not None and 2 * size > avail:
        raise KoalaError(f"{flag} {numel}: the two processes need {2 * size / 2 ** 20:.0f} MiB of buffers, "
                         f"{avail / 2 ** 20:.0f} MiB is available; give a smaller {flag}")
    return size


def measure_p2p(numel: int, dtype: str = "float32", iters: int = 50, timeout_s: float = 120.0) -> P2PCost:
    """Latency and CPU cost of a message of `numel` elements between two local gloo processes
    (each iteration: one send and one receive per rank). Raises `koala_ds.runtime.spawn.SpawnError`
    past `timeout_s`, and a KoalaError for a message that is too large (`check_message`)."""
    from ..runtime.spawn import spawn

    check_message(numel, dtype, flag="numel")

    res = spawn("koala_ds.profiler.p2p:pingpong_worker", 2, {"numel": numel, "dtype": dtype, "iters": iters},
                timeout_s=timeout_s)
    return P2PCost(statistics.median(res[0]["rtt_ms"]) / 2.0,
                   statistics.mean(r["cpu_ms_per_message"] for r in res))


def measure_p2p_latency(numel: int, dtype: str = "float32", iters: int = 50, timeout_s: float = 120.0) -> float:
    """One-way latency (ms) of a message of `numel` elements: median round trip / 2."""
    return measure_p2p(numel, dtype, iters, timeout_s).latency_ms
