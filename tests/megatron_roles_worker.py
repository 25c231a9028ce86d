"""Worker for the chunk-role refusal test of the Megatron runtime (launched by koala_ds.runtime.spawn).

`world` gloo ranks build their two model chunks as megatron-core's model builder does (chunk c
of rank r holds stage c x p + r: `pre_process` / `post_process` set for that stage) and call
koala's forward_backward_func with zb-v, whose V-shape placement runs other stages there. Rank 0
and the last rank see the mismatch on their own chunks; the middle ranks' chunks hold no
embedding and no loss either way. Each rank returns what its call raised and how long it took,
then waits at a barrier: the refusing ranks stay alive, as a script that caught the error would.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine_runs import _MegatronChunk, _forward_step, chunk_config


def roles_worker(rank: int, world: int, spec: dict) -> dict:
    from megatron.core import parallel_state as ps
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import get_forward_backward_func

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    m, hidden, seq = 2 * world, 8, 2
    schedule = load_schedule("zb-v", world, m, 2)
    config = chunk_config(2 * world, hidden, world, 2)
    chunks = [_MegatronChunk(config, c * world + rank, 2 * world, (0.0, 0.0, 0.0), hidden) for c in range(2)]
    func = get_forward_backward_func(schedule, timeout_s=spec["timeout_s"])
    data = [torch.randn(seq, 1, hidden) for _ in range(m)]
    start = time.monotonic()
    try:
        func(forward_step_func=_forward_step, data_iterator=[iter(data), iter(data)], model=chunks,
             num_microbatches=m, seq_length=seq, micro_batch_size=1)
        out = {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the call raised is the result
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["elapsed"] = time.monotonic() - start
    dist.barrier()
    ps.destroy_model_parallel()
    return out
