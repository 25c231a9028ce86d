"""Worker for the stopped-peer tests of the Megatron runtime (launched by koala_ds.runtime.spawn).

Two gloo ranks run one training step of the tiny megatron-core GPT of megatron_worker.py with
koala's forward_backward_func; rank `spec["stopped_rank"]` SIGSTOPs itself at `spec["stop"]`:

- "finalize": PP=2, just before finalize_model_grads_func's all-reduce over the pipeline group
  (the squared gradient norm, summed over the stages as Megatron's clipping does);
- "dp-finalize": PP=1 x DP=2, just before koala's CPU data-parallel finalize (gradient all-reduce);
- "p2p": PP=2, in the forward of microbatch 1, in the middle of the pipeline's p2p.

The other rank must raise P2PTimeoutError within the pipeline timeout; it returns what it saw.
"""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from megatron_worker import M, MBS, SEQ, batches, build_chunk, forward_step_func, make_config, make_schedule

STOPS = {"finalize": (2, 1), "dp-finalize": (1, 2), "p2p": (2, 1)}  # stop point -> (pp, dp)


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _norm_finalize(group, stop: bool):
    """A finalize_model_grads_func that sums the squared gradient norm over `group`."""

    def finalize(model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
        if stop:
            _stop_self()
        total = torch.zeros(1)
        for chunk in model_list:
            for prm in chunk.parameters():
                if prm.grad is not None:
                    total += prm.grad.pow(2).sum()
        dist.all_reduce(total, group=group)

    return finalize


def _dp_finalize(dp_group, dp: int, stop: bool):
    from koala_ds.megatron.cpu import data_parallel_finalize

    inner = data_parallel_finalize(dp_group, dp)

    def finalize(*args, **kwargs):
        if stop:
            _stop_self()
        inner(*args, **kwargs)

    return finalize


def _stopping_forward_step(stop_at: int):
    calls = []

    def step(data_iterator, model):
        calls.append(1)
        if len(calls) == stop_at + 1:
            _stop_self()
        return forward_step_func(data_iterator, model)

    return step


def _model(stop: str, rank: int, stopped_rank: int):
    from megatron.core import parallel_state as ps

    from koala_ds.megatron.cpu import prepare_cpu

    pp, dp = STOPS[stop]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, pp)
    prepare_cpu(seed=7)
    config = make_config(1, pp, 1)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunk = build_chunk(config, pp_rank, pp, None)
    me = rank == stopped_rank
    if stop == "dp-finalize":
        config.finalize_model_grads_func = _dp_finalize(ps.get_data_parallel_group(), dp, me)
    else:
        config.finalize_model_grads_func = _norm_finalize(ps.get_pipeline_model_parallel_group(), me and stop == "finalize")
    step = _stopping_forward_step(1) if me and stop == "p2p" else forward_step_func
    return chunk, step, pp


def stop_worker(rank: int, world: int, spec: dict) -> dict:
    import koala_ds.megatron as km
    from koala_ds.megatron.p2p import P2PTimeoutError

    chunk, step, pp = _model(spec["stop"], rank, spec["stopped_rank"])
    func = km.get_forward_backward_func(make_schedule("1f1b", pp, M, 1))  # timeout: KOALA_TIMEOUT_S
    dist.barrier()  # set-up done everywhere: what follows is the step
    start = time.perf_counter()
    try:
        func(forward_step_func=step, data_iterator=iter(batches(M)), model=chunk, num_microbatches=M,
             seq_length=SEQ, micro_batch_size=MBS)
    except P2PTimeoutError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.perf_counter() - start,
                "raised_at": time.time()}
    return {"error": None, "elapsed": time.perf_counter() - start}
