"""Emulated compute: pipeline stages whose forward, backward-input and backward-weight steps
*sleep* for a given time while real tensors flow through the real engine.

This is what makes `benchmarks/engine_speedup.py` able to run 4 to 8 pipeline ranks faithfully
on a machine with 2 CPU cores: a sleeping rank uses no CPU, so the measured step time is the
schedule plus the runtime's own overhead (Python, p2p), not kernel speed.

The stage computes `out = SleepInput(x) + SleepWeight(w, x.detach())`:
- `SleepInput` sleeps `forward` in its forward and `backward_input` in its backward (the
  input-gradient path); it has no parameter;
- `SleepWeight` has the stage's only parameter `w` (one value per hidden unit, initialised to
  zero, so the activations pass through unchanged); it sleeps `backward_weight` in its
  backward, which only produces the gradient of `w`.
A first stage's input (data) needs no gradient, but a real first stage still backpropagates
through its layers to reach their weights: the stage makes its input require a gradient so
that its I sleeps `backward_input` too. `SleepWeight` defers like a real layer
(`koala_ds.runtime.wgrad`): inside an I step it queues its sleep and its gradient for W; a full
backward (B) runs both.

`precise_sleep` sleeps to a deadline: `time.sleep` for the bulk (minus the measured wake-up
latency of this machine), then a short spin, so a 1 ms op takes 1 ms, not 1.07 ms.
torch is imported here: this module is for the engines' side only.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..runtime.wgrad import active_queue

_perf = time.perf_counter
_WAKE_S = None  # measured wake-up latency of time.sleep (seconds), see calibrate()


def calibrate(samples: int = 40, probe_s: float = 0.0005) -> float:
    """Measure how late `time.sleep` wakes up on this machine (median, seconds)."""
    global _WAKE_S
    late = []
    for _ in range(samples):
        t0 = _perf()
        time.sleep(probe_s)
        late.append(_perf() - t0 - probe_s)
    _WAKE_S = max(0.0, min(statistics.median(late), 0.002))
    return _WAKE_S


def precise_sleep(seconds: float) -> None:
    """Sleep `seconds` (to a deadline): `time.sleep` for the bulk, ending early by the expected
    wake-up latency (a running estimate, kept up to date by every call), then a short spin."""
    global _WAKE_S
    if seconds <= 0:
        return
    if _WAKE_S is None:
        calibrate()
    start = _perf()
    deadline = start + seconds
    bulk = seconds - 1.5 * _WAKE_S
    if bulk > 0:
        time.sleep(bulk)
        late = _perf() - start - bulk
        _WAKE_S = min(0.002, max(0.0, 0.8 * _WAKE_S + 0.2 * late))
    while _perf() < deadline:
        pass


class SleepInput(torch.autograd.Function):
    """Identity that sleeps `forward_s` forward and `input_s` in the input-gradient step."""

    @staticmethod
    def forward(ctx, x, forward_s: float, input_s: float):
        precise_sleep(forward_s)
        ctx.input_s = input_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        precise_sleep(ctx.input_s)
        return grad, None, None


class SleepWeight(torch.autograd.Function):
    """`w` broadcast to the shape of `like`; its backward sleeps `weight_s` and returns dL/dw."""

    @staticmethod
    def forward(ctx, w, like, weight_s: float):
        ctx.save_for_backward(w)
        ctx.weight_s = weight_s
        return like.new_zeros(like.shape) + w

    @staticmethod
    def backward(ctx, grad):
        grad_w = grad.reshape(-1, grad.shape[-1]).sum(0)
        queue = active_queue()
        if queue is None:
            precise_sleep(ctx.weight_s)
            return grad_w, None, None
        w, weight_s = ctx.saved_tensors[0], ctx.weight_s

        def work():
            precise_sleep(weight_s)
            return [(w, grad_w)]

        queue.add(work, grad_w)
        return None, None, None


class EmulatedStage(torch.nn.Module):
    """One virtual stage with emulated costs (milliseconds, as in a cost profile)."""

    def __init__(self, forward_ms: float, backward_input_ms: float, backward_weight_ms: float, hidden: int = 8):
        super().__init__()
        self.forward_s = forward_ms / 1000.0
        self.input_s = backward_input_ms / 1000.0
        self.weight_s = backward_weight_ms / 1000.0
        self.weight = torch.nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad and torch.is_grad_enabled():
            # a first stage (its input is data): a real model still backpropagates through its
            # layers to reach their weights, so the input-path work exists and I runs it
            x = x.detach().requires_grad_()
        return SleepInput.apply(x, self.forward_s, self.input_s) + \
            SleepWeight.apply(self.weight, x.detach(), self.weight_s)


def emulated_stages(profile, hidden: int = 8) -> list[EmulatedStage]:
    """One `EmulatedStage` per stage of a `koala_ds.sim.CostProfile`."""
    return [EmulatedStage(s.forward, s.backward_input, s.backward_weight, hidden) for s in profile.stages]


def autograd_cpu_ms(hidden: int = 8, seq: int = 2, iters: int = 300, warmup: int = 20) -> float:
    """CPU time (ms, this thread) of one forward + full backward of a zero-cost `EmulatedStage`
    through torch autograd, the activation [seq, 1, hidden]: what torch alone costs per F + B
    pair of the emulated runs, before any engine code (the floor of an engine's CPU per pair)."""
    stage = EmulatedStage(0.0, 0.0, 0.0, hidden)
    x = torch.zeros(seq, 1, hidden)
    grad = torch.ones(seq, 1, hidden)
    for k in range(warmup + iters):
        if k == warmup:
            start = time.thread_time()
        inp = x.detach().requires_grad_()
        torch.autograd.backward([stage(inp)], grad_tensors=[grad])
    return (time.thread_time() - start) * 1000.0 / iters
