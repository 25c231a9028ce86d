"""Gradients as the stock engine treats them: its clipping norm, and the flag and bf16 hand-over
around every step that accumulates weight gradients."""
from __future__ import annotations

import torch
from deepspeed import comm as dist

def clip_grads_like_stock(params: list, counted: list, max_norm: float, mpu, device) -> torch.Tensor:
    """Scale the gradients of `params` as deepspeed.runtime.utils.clip_grad_norm_ (norm 2) does,
    but with the norm measured over `counted` (plus parameters marked model parallel) on every
    rank, summed over the model-parallel group and averaged over the data-parallel group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    ids = {id(q) for q in counted}
    norms = [q.grad.detach().float().norm(2) for q in params
             if q.grad is not None and (id(q) in ids or is_model_parallel_parameter(q))]
    total = torch.stack(norms).pow(2).sum().float().reshape(1) if norms else torch.zeros(1)
    total = total.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(0.5)
    dp_group = groups._get_data_parallel_group()
    dp = dist.get_world_size(group=dp_group)
    if dp > 1:  # the mean over one rank is the value: no collective (one per step) for it
        total = total / float(dp)
        dist.all_reduce(total, group=dp_group)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for q in params:
        if q.grad is not None:
            q.grad.data.mul_(clip_coef.to(q.grad.device))
    return total


class _ParamGradStep:
    """Around a step that accumulates weight gradients (B, I or W): DeepSpeedEngine's backward
    flag and the bf16 optimizer's gradient hand-over. A plain context manager (entered once per
    backward step; a generator-based one costs several times more)."""

    __slots__ = ("engine",)

    def __init__(self, engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        if engine.using_bf16_optimizer:
            engine.optimizer.clear_lp_grads()
        engine._set_running_backward(True)

    def __exit__(self, exc_type, *_exc_info) -> None:
        engine = self.engine
        engine._set_running_backward(False)
        if exc_type is None and engine.using_bf16_optimizer and \
                not engine._config.bfloat16_config.immediate_grad_update:
            engine.optimizer.update_hp_grads(clear_lp_grads=False)
