"""Megatron-core adapter: run any Koala schedule as megatron-core's forward_backward_func.

    from koala_ds.megatron import get_forward_backward_func
    forward_backward_func = get_forward_backward_func(schedule="zb-h1")
    losses = forward_backward_func(forward_step_func=..., data_iterator=..., model=...,
                                   num_microbatches=..., seq_length=..., micro_batch_size=...)

Launch flags for Megatron-LM: `add_arguments(parser)` (extra_args_provider) and `install(args)`.
torch and megatron are imported only when a function that needs them is called.
"""
from __future__ import annotations

from .launch import add_arguments, install, schedule_from_args
from .resolve import MegatronScheduleError

__all__ = ["get_forward_backward_func", "add_arguments", "install", "schedule_from_args", "MegatronScheduleError",
           "P2PTimeoutError", "chunk_stages", "stage_layers", "check_layout"]


def get_forward_backward_func(schedule="1f1b", profile=None, *, timeout_s=None, per_direction_groups=None,
                              timeout_name="get_forward_backward_func(timeout_s=...)", trace=None,
                              trace_name="get_forward_backward_func(trace=...)"):
    """See `koala_ds.megatron.runtime.get_forward_backward_func`."""
    from .runtime import get_forward_backward_func as _get

    return _get(schedule, profile, timeout_s=timeout_s, per_direction_groups=per_direction_groups,
                timeout_name=timeout_name, trace=trace, trace_name=trace_name)


def chunk_stages(schedule, pp_rank: int) -> tuple[int, ...]:
    """Virtual stages held by `pp_rank`, in model-chunk order: chunk c runs stage
    `chunk_stages(schedule, r)[c]` (build its layers and pre/post-process flags from that)."""
    return schedule.placement.stages_of(pp_rank)


def __getattr__(name):
    if name == "P2PTimeoutError":
        from .p2p import P2PTimeoutError

        return P2PTimeoutError
    if name in ("stage_layers", "check_layout"):  # --pipeline-model-parallel-layout: koala_ds/megatron/layout.py
        from . import layout

        return getattr(layout, name)
    raise AttributeError(name)
