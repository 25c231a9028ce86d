"""Worker for tests/test_megatron_tokens.py (launched by koala_ds.runtime.spawn): two gloo pipeline ranks
run one step of the tiny megatron-core GPT of megatron_worker.py (v = 2, chunks placed as the
schedule says) with a per-token loss (config.calculate_per_token_loss); finalize_model_grads_func
records the token count it is handed, as megatron-core's finalize_model_grads reads it: it
broadcasts the count from the last pipeline rank."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_worker import M, MBS, SEQ, batches, build_chunk, forward_step_func, make_config, make_schedule


def _per_token_forward_step(data_iterator, model):
    out, _ = forward_step_func(data_iterator, model)

    def loss_func(output):  # the loss summed over tokens, and their count: 2 x 8 = 16 per microbatch
        tokens = torch.tensor(output.numel(), dtype=torch.int)
        loss = output.float().sum()
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return out, loss_func


def tokens_worker(rank: int, world: int, spec: dict) -> dict:
    from megatron.core import parallel_state as ps

    import koala_ds.megatron as km
    from koala_ds.megatron.cpu import prepare_cpu

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    prepare_cpu(seed=7)
    schedule = make_schedule(spec["schedule"], 2, M, 2)
    config = dataclasses.replace(make_config(1, 2, 2), calculate_per_token_loss=True)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = [build_chunk(config, stage, 4, chunk) for chunk, stage in enumerate(schedule.placement.stages_of(pp_rank))]
    group, last = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    seen = []

    def finalize(model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
        count = num_tokens.clone()
        dist.broadcast(count, src=last, group=group)  # as megatron-core's finalize_model_grads
        seen.append(int(count))

    config.finalize_model_grads_func = finalize
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize
    func = km.get_forward_backward_func(schedule, timeout_s=60)
    losses = func(forward_step_func=_per_token_forward_step, data_iterator=[iter(batches(M)) for _ in chunks],
                  model=chunks, num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
    return {"seen": seen, "losses": len(losses)}
