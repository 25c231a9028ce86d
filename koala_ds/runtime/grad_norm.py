"""The step's end of the examples' training loops: gradient clipping by the global norm, reduced
over the ranks that hold the model's parts.

Megatron-LM's optimizer step reduces the gradients' L2 norm over the model-parallel group
(megatron-core's `clip_grads`; `train_step` then reduces `update_successful` and the norm again),
and torchtitan's `clip_grad_norm_` reduces it over the pipeline mesh. Either way every pipeline
rank meets the others there at the end of each step, so no rank starts step n + 1 before every
rank has ended step n: the one step at a time that the simulator predicts (docs/profiling.md, "A
step is one step"). megatron-core's `clip_grads` needs CUDA; this does the same with torch's own
norm and clip on any device.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, group,
                   counted: Callable[[torch.nn.Parameter], bool] | None = None) -> float:
    """The L2 norm of the gradients of `params` (this rank's) summed over `group` with one
    all-reduce, and the gradients scaled to a norm of at most `max_norm` (0: no clipping; the norm
    is still reduced, as Megatron-LM's train_step reduces it every step). `counted`: which
    parameters the norm counts (default all), so that a parameter held whole on every
    tensor-parallel rank counts once, as megatron-core counts it
    (`param_is_not_tensor_parallel_duplicate`); every gradient is clipped. Returns the norm."""
    params = list(params)
    grads = [prm.grad for prm in params if prm.grad is not None and (counted is None or counted(prm))]
    total = (torch.nn.utils.get_total_norm(grads).float() ** 2).reshape(1)  # no gradients: 0
    dist.all_reduce(total, group=group)
    norm = total[0].sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()
