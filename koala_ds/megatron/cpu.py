"""Run megatron-core models on CPU (gloo) for examples and tests.

megatron-core 0.16.1's GPT layers ask CUDA for two things even on CPU: the attention score
buffer (`parallel_state.get_global_memory_buffer()`, allocated with
`torch.cuda.current_device()`) and the model-parallel RNG tracker (`get_cuda_rng_tracker()`,
which saves and restores CUDA generator states around dropout). `prepare_cpu()` gives both
a CPU stand-in. Call it after `parallel_state.initialize_model_parallel(...)`. It does
nothing when CUDA is available. The pipeline runtime itself needs none of this.
"""
from __future__ import annotations

import contextlib

import torch


class CpuRngTracker:
    """The interface of megatron's CudaRNGStatesTracker over CPU generator states."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def reset(self):
        self.states_, self.seeds_ = {}, set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = states

    def add(self, name: str, seed: int):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def prepare_cpu(seed: int = 1234, attention_buffer_elements: int = 1 << 22) -> bool:
    """Install the CPU stand-ins (after initialize_model_parallel); True when installed."""
    if torch.cuda.is_available():
        return False
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    buffer = parallel_state.get_global_memory_buffer()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buffer.buffer[("mpu", dtype)] = torch.empty(attention_buffer_elements, dtype=dtype)
    tracker = CpuRngTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("data-parallel-rng", seed)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return True


def data_parallel_finalize(dp_group, dp_size: int):
    """A `config.finalize_model_grads_func` that averages gradients over the data-parallel
    group with a plain all-reduce (Megatron's DDP wrapper and its buffers need CUDA)."""
    import torch.distributed as dist

    def finalize(model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
        if dp_size > 1:
            for chunk in model_list:
                for prm in chunk.parameters():
                    if prm.grad is not None:
                        dist.all_reduce(prm.grad, group=dp_group)
                        prm.grad /= dp_size

    return finalize
