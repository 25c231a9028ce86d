"""megatron-core's tensor-parallel linears with a deferrable weight gradient (see `koala_ds.runtime.wgrad`).

ColumnParallelLinear / RowParallelLinear call `self._forward_impl(...)`, which applies
`LinearWithGradAccumulationAndAsyncCommunication`. `make_deferrable` points that instance
attribute at the same Function with one change, `_DeferrableTPLinear`: when an I step is
running, its backward computes the input gradient exactly as megatron-core does (the
tensor-parallel all-reduce, or the sequence-parallel reduce-scatter) and the bias gradient, and
queues the weight-gradient GEMM; otherwise it is megatron-core's own backward, except where the
saved weight is not the parameter (saved-tensor hooks): then the same code runs the GEMM at
once on the parameter, whose attributes megatron-core's backward would miss. The queued work
is megatron-core's weight-gradient code: the sequence-parallel all-gather of the input, then
`fused_weight_gradient_mlp_cuda` into `main_grad` under gradient_accumulation_fusion (and the
same dummy gradient, `grad_added_to_main_grad` set, so that DDP's hooks behave as in a full
backward), or `grad_output^T @ input`.
Megatron-core is imported only when this module is used; without it nothing is covered here.
"""
from __future__ import annotations

import functools

import torch

from .wgrad import active_queue, note_layer

try:
    from megatron.core.tensor_parallel import layers as _layers
    from megatron.core.utils import get_tensor_model_parallel_group_if_none as _get_tp_group
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute as _prepare
except ImportError:  # megatron-core is optional
    _layers = None


def is_embedding(module) -> bool:
    return _layers is not None and isinstance(module, _layers.VocabParallelEmbedding)


def _dummy_grad(weight, dtype):
    """What megatron-core's backward returns for a weight whose gradient went into main_grad."""
    shape, device = weight.main_grad.shape, weight.main_grad.device
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _weight_grad(weight, inp, grad_out, main_grad, fusion: bool, sequence_parallel: bool, tp_group):
    """megatron-core's weight-gradient half of the backward; (weight, grad) pairs to accumulate."""
    total = inp
    if sequence_parallel:
        size = list(inp.size())
        size[0] *= tp_group.size()
        total = torch.empty(size, dtype=inp.dtype, device=inp.device)
        torch.distributed.all_gather_into_tensor(total, inp.contiguous(), group=tp_group)
    grad_out, total = _prepare(grad_out, total)
    if not fusion:
        return [(weight, grad_out.t().matmul(total))]
    weight.main_grad = main_grad
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        torch.matmul(grad_out.t(), total, out=weight.main_grad)
    elif main_grad.dtype == torch.float32:
        _layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total, grad_out, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        _layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total, grad_out, main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return [(weight, _dummy_grad(weight, inp.dtype))]


def _deferred_placeholder(weight, fusion: bool, dtype):
    """I's gradient for a deferred weight: None, or under gradient_accumulation_fusion with
    Megatron's DDP the dummy megatron-core returns (DDP's hook asserts a gradient under
    overlap_grad_reduce; `grad_added_to_main_grad` makes it add nothing)."""
    if not fusion or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return _dummy_grad(weight, dtype)


def _input_grad(ctx, inp, weight, grad_out):
    grad_in = grad_out.matmul(weight)
    if ctx.sequence_parallel:
        out = torch.empty(list(inp.size()), dtype=inp.dtype, device=inp.device)
        torch.distributed.reduce_scatter_tensor(out, grad_in.contiguous(), group=ctx.tp_group)
        return out
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_in, group=ctx.tp_group)
    return grad_in


if _layers is not None:
    _Base = _layers.LinearWithGradAccumulationAndAsyncCommunication

    class _DeferrableTPLinear(_Base):
        @staticmethod
        def forward(ctx, input, weight, *args):
            # the parameter itself: under saved-tensor hooks (the profiler, activation
            # offloading) ctx.saved_tensors gives a new tensor that only borrows the parameter's
            # gradient accumulator while a graph holds it; a weight gradient given to that copy
            # later, in W, would be lost
            ctx.koala_weight = weight
            return _Base.forward(ctx, input, weight, *args)

        @staticmethod
        @_layers.custom_bwd
        def backward(ctx, grad_output):
            queue, param = active_queue(), ctx.koala_weight
            if ctx.grad_output_buffer is not None or not ctx.needs_input_grad[1]:
                return _Base.backward(ctx, grad_output)
            defer = queue is not None and queue.defers(param)
            inp, weight = ctx.saved_tensors
            if not defer and weight is param:
                return _Base.backward(ctx, grad_output)
            # deferred, or computed now on a saved weight that is not the parameter (saved-tensor
            # hooks): megatron-core's backward would read main_grad / grad_added_to_main_grad
            # off that copy, which has neither, and return no dummy gradient for DDP's hooks
            grad_in = _input_grad(ctx, inp, weight, grad_output)
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.use_bias else None
            main_grad, fusion, sp, group = ctx.main_grad, ctx.gradient_accumulation_fusion, ctx.sequence_parallel, \
                ctx.tp_group

            def work():
                return _weight_grad(param, inp, grad_output, main_grad, fusion, sp, group)

            if defer:
                queue.add(work, inp, grad_output)
                grad_weight = _deferred_placeholder(param, fusion, inp.dtype)
            else:
                pairs = work()  # [(param, gradient)], or None: all of it went into main_grad
                grad_weight = pairs[0][1] if pairs else None
            return grad_in, grad_weight, grad_bias, None, None, None, None, None, None

    def _forward_impl(module, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, **kw):
        """megatron-core's `_forward_impl` with `_DeferrableTPLinear` in place of its Function."""
        if not weight.requires_grad or kw:
            return type(module)._forward_impl(
                module, input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                tp_group=tp_group, **kw)
        tp_group = _get_tp_group(tp_group)
        out = _DeferrableTPLinear.apply(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                        sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)
        note_layer(weight, input, out)
        return out


def make_deferrable(module) -> bool:
    """Point a ColumnParallelLinear / RowParallelLinear at the deferrable Function; False for
    anything else (or without megatron-core)."""
    if _layers is None or not isinstance(module, (_layers.ColumnParallelLinear, _layers.RowParallelLinear)):
        return False
    module._forward_impl = functools.partial(_forward_impl, module)
    return True
