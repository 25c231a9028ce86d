"""Measure the cost of each pipeline stage of a real model and write a cost profile (v1).

For each stage (in pipeline order) and each of `warmup + iters` rounds, one microbatch run split
and one run whole:
- F: the stage's forward (plus the loss on the last stage);
- I: the backward with the layers' weight-gradient GEMMs queued (`koala_ds.runtime.wgrad`), exactly as
  the Koala runtimes run an I action;
- W: that queue run (the weight gradients), as the runtimes run a W action;
- B: a plain full backward, as the runtimes run a B action (the profile's `backward`).
The measurement is interleaved (`measurement_plan`): each round runs every stage in turn, split
first in even rounds and whole first in odd ones, so that the machine's drift (other processes,
its clock) hits every stage and both backward kinds alike. Times are the median over `iters`
rounds after `warmup`; the profile's `spread` is how precisely that median is known
(`StageMeasurement.spread`, `koala_ds.sim.profile.value_spread`). CUDA events on CUDA; on CPU the calling thread's CPU time
(`time.thread_time`) when torch runs one thread, else the wall clock (`resolve_clock`). The
timed microbatches run without hooks; the memory is measured on one more microbatch, with every
tensor autograd saves for backward recorded by `torch.autograd.graph.saved_tensors_hooks`.

Memory (MiB = 2**20 bytes, per microbatch; the profile's `_mb` fields):
- `activation_mb`: bytes of the distinct storages autograd saved for backward during F,
  parameters excluded (their memory is static). The stage input counts when a layer saves it.
- `w_hold_mb`: what is still held after I until W runs: the storages the weight-gradient queue
  keeps (each deferred layer's input and output gradient), plus any saved storage autograd
  still holds (capped at `activation_mb`; the raw figure is in `meta`).
A first stage whose input needs no gradient still backpropagates through its layers in I (to
reach the weights); only the input gradient itself is not computed.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..runtime.wgrad_policy import DEFAULT
from ..sim.profile import value_spread

MIB = float(1 << 20)
#: Rounds run before measuring, and rounds measured (`koala profile --warmup / --iters`).
DEFAULT_WARMUP, DEFAULT_ITERS = 10, 40
#: The fewest measured rounds a spread is computed from (fewer: the profile has no `spread`).
SPREAD_MIN_SAMPLES = 5
#: The clocks a CPU profile can take (`clock=`, `koala profile --clock`); a GPU takes CUDA events.
CLOCKS = ("auto", "cpu", "wall")
#: How the profile's `meta.timer` names each timer.
TIMERS = {"cuda": "cuda events", "cpu": "thread CPU time (time.thread_time)",
          "wall": "wall clock (time.perf_counter)"}


@dataclass
class StageMeasurement:
    """What was measured for one stage (times in ms, memory in bytes)."""

    forward: list[float] = field(default_factory=list)
    backward_input: list[float] = field(default_factory=list)
    backward_weight: list[float] = field(default_factory=list)
    backward_full: list[float] = field(default_factory=list)
    # F before a full backward, where the stage has nn.Linear layers: those run torch's own linear
    # then, as in an unprepared model (koala_ds.runtime.wgrad.plain_forward), the model a full-backward
    # schedule runs; `forward` is the deferrable F a split schedule runs
    forward_full: list[float] = field(default_factory=list)
    activation_bytes: int = 0
    w_hold_bytes: int = 0
    output_shape: tuple = ()
    output_dtype: str = ""
    output_numel: int = 0
    output_bytes: int = 0
    input_grad: bool = True
    w_flops_deferred: float | None = None  # fraction of the covered layers' weight-gradient FLOPs W runs
    max_w_hold: float | None = None  # the hold policy it ran under (koala_ds.runtime.wgrad.prepare's max_hold)

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0

    def costs(self) -> tuple[float, float, float, float | None]:
        """(F, I, W, B) as the runtimes run them: F the forward of a full-backward schedule; what a
        deferrable forward costs over it (>= 0) is charged to I, so F + I + W is a split
        microbatch's cost and F + B a full one's. B is None when not measured."""
        f, i, w = (self.median(k) for k in ("forward", "backward_input", "backward_weight"))
        if self.forward_full:
            f, i = self.median("forward_full"), i + max(0.0, self.forward_extra())
        return f, i, w, (self.median("backward_full") if self.backward_full else None)

    def forward_extra(self) -> float:
        """What the deferrable forward took over the plain one (medians; 0 without `forward_full`)."""
        return self.median("forward") - self.median("forward_full") if self.forward_full else 0.0

    def samples(self) -> dict[str, list[float]]:
        """The samples of each time field of the profile, one per measured round, as `costs()` takes
        their medians: F the plain forward where there is one; I plus, round by round, what the
        deferrable forward took over the plain one; W; B where measured."""
        out = {"forward": list(self.forward_full or self.forward), "backward_input": list(self.backward_input)}
        if self.forward_full:
            out["backward_input"] = [i + f - ff for i, f, ff in zip(self.backward_input, self.forward,
                                                                     self.forward_full)]
        out["backward_weight"] = list(self.backward_weight)
        if self.backward_full:
            out["backward"] = list(self.backward_full)
        return out

    def spread(self) -> dict[str, float] | None:
        """Per time field of the profile, how precisely its value (a median) is known:
        `koala_ds.sim.profile.value_spread` of its samples (about 1.25 x their interquartile range
        / sqrt(rounds), over the value; 0 where the value is 0). None with fewer than
        SPREAD_MIN_SAMPLES rounds: too few to tell."""
        if len(self.forward) < SPREAD_MIN_SAMPLES:
            return None
        values = dict(zip(("forward", "backward_input", "backward_weight", "backward"), self.costs()))
        return {name: round(value_spread(xs, values[name]), 4) for name, xs in self.samples().items()}


class ProfileFile:
    """A profile as JSON (`to_dict()` given by the subclass), and its atomic write."""

    def to_dict(self) -> dict:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def write(self, path, flag: str | None = None) -> None:
        """Write the profile JSON atomically (the previous file survives any failure)."""
        from ..core.outputs import atomic_write

        atomic_write(path, self.to_json() + "\n", flag)


@dataclass
class ProfileResult(ProfileFile):
    """The measurements of all stages; `to_dict()` is a profile v1 (with a `meta` section)."""

    stages: list[StageMeasurement]
    p2p_latency: float = 0.0
    p2p_measured: bool = False
    memory_limit_mb: float | None = None
    device: str = "cpu"
    name: str = "profile"
    description: str = ""
    extra_meta: dict = field(default_factory=dict)
    timer: str = ""  # a key of TIMERS (resolve_clock); "" : as the device implies (cuda events, else wall)

    def to_dict(self) -> dict:
        stages = []
        for m in self.stages:
            act = m.activation_bytes / MIB
            f, i, w, b = m.costs()
            entry = {"forward": round(f, 6), "backward_input": round(i, 6), "backward_weight": round(w, 6),
                     "activation_mb": round(act, 9),
                     "w_hold_mb": round(min(act, m.w_hold_bytes / MIB), 9)}
            if b is not None:
                entry["backward"] = round(b, 6)
            spread = m.spread()
            if spread is not None:
                entry["spread"] = spread
            stages.append(entry)
        timer = self.timer or ("cuda" if self.device.startswith("cuda") else "wall")
        meta = {"tool": "koala profile", "device": self.device, "timer": TIMERS[timer],
                "statistic": "median per microbatch after warm-up, stages and backward kinds measured in turn; "
                             "spread: the median's own interquartile range (value_spread) / median",
                "memory_unit": "MiB (2**20 bytes) per microbatch, parameters excluded",
                "p2p_latency": "measured (2-process ping-pong, one way)" if self.p2p_measured else "given / not measured",
                "stages": [{"backward_full_ms": round(m.median("backward_full"), 6),
                            "samples": len(m.forward),
                            "activation_bytes": m.activation_bytes, "w_hold_bytes_raw": m.w_hold_bytes,
                            "output_shape": list(m.output_shape), "output_dtype": m.output_dtype,
                            "input_gradient": m.input_grad, "w_flops_deferred": m.w_flops_deferred,
                            "max_w_hold": m.max_w_hold} for m in self.stages]}
        meta.update(self.extra_meta)
        out: dict[str, Any] = {"version": 1, "name": self.name}
        if self.description:
            out["description"] = self.description
        out.update({"stages": stages, "p2p_latency": round(self.p2p_latency, 6)})
        if self.memory_limit_mb is not None:
            out["memory_limit_mb"] = self.memory_limit_mb
        out["meta"] = meta
        return out

    def to_profile(self):
        from ..sim import CostProfile

        return CostProfile.from_dict(self.to_dict(), source=f"<profile {self.name}>")



class NotOneTensor(TypeError):
    """A stage (not the last) passed on something else than one tensor (its type name)."""


#: Attributes `profile_stages` sets on an exception raised while it measured a stage (the
#: exception is re-raised unchanged otherwise): the stage's index and the step that raised.
_STAGE_ATTR, _STEP_ATTR = "_koala_profile_stage", "_koala_profile_step"


def _tag(exc: BaseException, attr: str, value: Any) -> None:
    """Record `value` on `exc` unless an inner step recorded it first."""
    if not hasattr(exc, attr):
        try:
            setattr(exc, attr, value)
        except (AttributeError, TypeError):  # an exception type that takes no attributes
            pass


@contextlib.contextmanager
def _step(name: str, stage: int | None = None):
    """Inside: an exception gets the step `name` (and the `stage`) it was raised in."""
    try:
        yield
    except Exception as exc:
        _tag(exc, _STEP_ATTR, name)
        if stage is not None:
            _tag(exc, _STAGE_ATTR, stage)
        raise


def failed_step(exc: BaseException) -> tuple[int, str] | None:
    """Where `profile_stages` was when `exc` was raised: (stage index, "forward", "backward" or
    "measurement"); None when it was not raised while a stage ran."""
    stage = getattr(exc, _STAGE_ATTR, None)
    if not isinstance(stage, int):
        return None
    return stage, getattr(exc, _STEP_ATTR, "measurement")


class _Saved:
    """A tensor saved for backward, boxed so that we can tell when autograd lets go of it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorTracker:
    """saved_tensors_hooks that record every non-parameter tensor saved for backward."""

    def __init__(self, params: Sequence):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.records: list[tuple[int, int, weakref.ref]] = []

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.param_ptrs or storage.nbytes() == 0:
            return t
        box = _Saved(t)
        self.records.append((ptr, storage.nbytes(), weakref.ref(box)))
        return box

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def saved_bytes(self, alive_only: bool = False) -> int:
        from ..runtime.wgrad import storage_bytes

        return storage_bytes((ptr, nbytes) for ptr, nbytes, ref in self.records if not alive_only or ref() is not None)


def resolve_clock(device, clock: str = "auto") -> str:
    """The timer of the steps (a key of TIMERS): CUDA events on a GPU, whatever `clock`; on the
    CPU `clock`, where "auto" is the calling thread's CPU time when torch runs one thread (all
    of a step's work is then on that thread, forward and backward, and time the process spent
    descheduled by a busy machine does not count), else the wall clock. "cpu" with more torch
    threads is refused: it would count one thread's share."""
    import torch

    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: use {', '.join(CLOCKS)}")
    if device is not None and torch.device(device).type == "cuda":
        return "cuda"
    threads = torch.get_num_threads()
    if clock == "auto":
        return "cpu" if threads == 1 else "wall"
    if clock == "cpu" and threads > 1:
        raise ValueError(f"clock 'cpu' counts the calling thread only, and torch runs {threads} threads: use the "
                         f"wall clock, or one thread")
    return clock


class _Timer:
    def __init__(self, kind: str):
        import torch

        self.kind = kind  # a key of TIMERS
        self.torch = torch
        self.now = time.thread_time if kind == "cpu" else time.perf_counter

    def start(self):
        if self.kind == "cuda":
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def stop(self, start) -> float:
        if self.kind == "cuda":
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            return start.elapsed_time(ev)
        return (self.now() - start) * 1000.0


def _default_loss(output):
    return output.float().mean() if output.dim() else output.float()


@dataclass
class _StageRun:
    """One stage under measurement: its forward, I, W and B steps (see `measure_stage`)."""

    module: Any
    make_input: Callable[[], Any]
    is_last: bool
    loss_fn: Callable
    timer: _Timer
    deferral: Any  # koala_ds.runtime.wgrad.Prepared
    direct_wgrad: bool
    gen: Any  # torch.Generator for the output gradients
    plain_linears: bool  # nn.Linear layers: they run torch's own linear before a full backward

    def forward(self, tracker=None, plain: bool = False):
        from ..runtime import wgrad

        x = self.make_input()
        args = x if isinstance(x, tuple) else (x,)
        hooks = tracker.hooks() if tracker is not None else contextlib.nullcontext()
        with hooks, wgrad.plain_forward(plain and self.plain_linears), _step("forward"):
            t = self.timer.start()
            out = self.module(*args)
            if self.is_last:
                out = self.loss_fn(out)
            ms = self.timer.stop(t)
        return args, out, ms

    def output_grad(self, out):
        import torch

        if self.is_last:
            return None
        if not isinstance(out, torch.Tensor):
            raise NotOneTensor(type(out).__name__)
        return torch.randn(out.shape, generator=self.gen).to(out.device, out.dtype)

    def backward_input(self, out, grad):
        with _step("backward"), self.deferral.input_step(direct=self.direct_wgrad) as queue:
            _backward(out, grad)
        return queue

    def timed(self, step: Callable[[], Any]) -> tuple[Any, float]:
        """A backward step (W, or B) and its time (the step's bookkeeping outside it)."""
        with _step("backward"):
            t = self.timer.start()
            result = step()
            elapsed = self.timer.stop(t)
        return result, elapsed

    @classmethod
    def build(cls, module, make_input: Callable[[], Any], *, is_last: bool, loss_fn, timer: str, seed: int,
              max_hold, direct_wgrad: bool) -> "_StageRun":
        """The stage prepared for deferred weight gradients (`koala_ds.runtime.wgrad.prepare`); `timer` a
        key of TIMERS (`resolve_clock`)."""
        import torch

        from ..runtime import wgrad

        return cls(module, make_input, is_last, loss_fn or _default_loss, _Timer(timer),
                   wgrad.prepare(module, max_hold=max_hold), direct_wgrad,
                   torch.Generator(device="cpu").manual_seed(seed),
                   any(isinstance(mod, wgrad.DeferrableLinear) for mod in module.modules()))

    def time_one(self, meas: StageMeasurement | None, kinds: Sequence[str] = ("split", "full")) -> None:
        """One microbatch of each of `kinds`, in that order: "split" (F, I, W) and "full" (the
        plain F, B), both backpropagating the same output gradient; recorded into `meas` (None: a
        warm-up). No hooks: Python callbacks would slow the steps down."""
        grad = None
        for kind in kinds:
            grad = self._full(meas, grad) if kind == "full" else self._split(meas, grad)

    def _split(self, meas: StageMeasurement | None, grad):
        args, out, f_ms = self.forward()
        grad = self.output_grad(out) if grad is None else grad
        queue, i_ms = self.timed(lambda: self.backward_input(out, grad))
        del args, out
        _, w_ms = self.timed(queue.run)
        if meas is not None:
            meas.forward.append(f_ms)
            meas.backward_input.append(i_ms)
            meas.backward_weight.append(w_ms)
        return grad

    def _full(self, meas: StageMeasurement | None, grad):
        args, out, f_ms = self.forward(plain=True)
        grad = self.output_grad(out) if grad is None else grad
        _, b_ms = self.timed(lambda: _backward(out, grad))
        if meas is not None:
            meas.backward_full.append(b_ms)
            if self.plain_linears:
                meas.forward_full.append(f_ms)
        return grad

    def finish(self, meas: StageMeasurement) -> None:
        """After the timing: the memory microbatch, the gradients dropped, the deferral recorded."""
        self.memory(meas, [p for p in self.module.parameters() if p.requires_grad])
        self.module.zero_grad(set_to_none=True)
        fraction = self.deferral.deferred_fraction()
        meas.w_flops_deferred = None if fraction is None else round(fraction, 6)
        meas.max_w_hold = self.deferral.max_hold

    def memory(self, meas: StageMeasurement, params: list) -> None:
        """One more microbatch with saved_tensors_hooks: activation, W-hold, output, input gradient."""
        with _collecting_new_objects_only():
            self._memory(meas, SavedTensorTracker(params))

    def _memory(self, meas: StageMeasurement, tracker: "SavedTensorTracker") -> None:
        import torch

        args, out, _ = self.forward(tracker)
        grad = self.output_grad(out)
        if not self.is_last:
            meas.output_shape, meas.output_dtype = tuple(out.shape), str(out.dtype).replace("torch.", "")
            meas.output_numel = out.numel()
            meas.output_bytes = out.numel() * out.element_size()
        meas.input_grad = len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].requires_grad
        meas.activation_bytes = tracker.saved_bytes()
        queue = self.backward_input(out, grad)
        del args, out
        gc.collect()
        meas.w_hold_bytes = tracker.saved_bytes(alive_only=True) + queue.held_bytes()
        with _step("backward"):
            queue.run()


def _backward(out, grad) -> None:
    """`out.backward(grad)`; nothing when `out` has no graph: a stage with no parameters whose
    input needs no gradient (integer token ids passed on, as DeepSpeed runs them) has I = W = B = 0."""
    if out.requires_grad:
        out.backward(grad)


@contextlib.contextmanager
def _collecting_new_objects_only():
    """Inside, `gc.collect()` looks only at objects made inside: what was there before is frozen
    (`gc.freeze`). A reference cycle among this microbatch's objects is still freed before W-hold
    is read, but the collection no longer walks the whole heap (0.1-0.4 s in a process that has
    imported torch, Megatron and DeepSpeed). A process that froze objects itself keeps its freeze
    (and the full collection)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measurement_plan(stages: int, warmup: int, iters: int, full_backward: bool = True
                     ) -> list[tuple[int, int, tuple[str, ...]]]:
    """The order of the timed microbatches: (round, stage, kinds) for each of `warmup + iters`
    rounds (the first `warmup` are not recorded) and, within a round, each stage in pipeline
    order; `kinds` is ("split", "full") in even rounds and ("full", "split") in odd ones (just
    ("split",) without `full_backward`). A slow spell of the machine (another process, a lower
    clock) then falls on every stage and on both backward kinds alike, instead of on whatever
    was measured at the time: the stages' ratios and each stage's (I + W) / B stay put."""
    kinds = ("split", "full") if full_backward else ("split",)
    return [(k, s, kinds if k % 2 == 0 else kinds[::-1]) for k in range(warmup + iters) for s in range(stages)]


def _time_stages(runs: Sequence[_StageRun], metas: Sequence[StageMeasurement], warmup: int, iters: int,
                 full_backward: bool) -> None:
    """Run `measurement_plan`; an error names its stage (`failed_step`). Older objects are frozen
    meanwhile (`_collecting_new_objects_only`): a full garbage collection of a heap holding torch
    and Megatron would land in some step's time."""
    with _collecting_new_objects_only():
        for k, s, kinds in measurement_plan(len(runs), warmup, iters, full_backward):
            try:
                with _step("measurement", s):
                    runs[s].time_one(metas[s] if k >= warmup else None, kinds)
            except NotOneTensor as exc:
                raise ValueError(f"stage {s} returns {exc}: stages must pass one tensor on") from None


def measure_stage(module, make_input: Callable[[], Any], *, is_last: bool, loss_fn=None, warmup: int = DEFAULT_WARMUP,
                  iters: int = DEFAULT_ITERS, device=None, full_backward: bool = True, seed: int = 0,
                  max_hold=DEFAULT, direct_wgrad: bool = False, clock: str = "auto") -> StageMeasurement:
    """Measure one stage. `make_input()` returns a fresh input (a tensor, or a tuple of
    arguments for the first stage); the stage's input gradient is computed when it requires grad.
    `max_hold`: the hold policy of `koala_ds.runtime.wgrad.prepare` (default: its default, as the runtimes).
    `direct_wgrad`: W adds weight gradients into `.grad` in their GEMMs, as the DeepSpeed runtime
    runs it (`koala_ds.runtime.wgrad.Prepared.input_step`). `clock`: see `resolve_clock` ("wall" for
    stages that sleep, as `koala_ds.profiler.emulate`'s)."""
    run = _StageRun.build(module, make_input, is_last=is_last, loss_fn=loss_fn, timer=resolve_clock(device, clock),
                          seed=seed, max_hold=max_hold, direct_wgrad=direct_wgrad)
    meas = StageMeasurement()
    _time_stages([run], [meas], warmup, iters, full_backward)
    run.finish(meas)
    return meas


def _input_maker(current, first: bool) -> Callable[[], Any]:
    """A stage's input: the sample itself for the first stage; for a later one a fresh copy of
    the previous stage's output, detached and requiring grad, as the runtimes hand it over."""
    if first:
        return lambda: current
    base = current.detach()
    return lambda: base.clone().requires_grad_(base.is_floating_point())


def _stage_runs(stage_modules: Sequence, sample_input, progress, **build) -> list[_StageRun]:
    """Each stage prepared with its input: the previous stages run once (no grad) to get a real
    tensor. `progress(s, n)` before stage s; `build` goes to `_StageRun.build`."""
    import torch

    runs, current, n = [], sample_input, len(stage_modules)
    for s, module in enumerate(stage_modules):
        if progress is not None:
            progress(s, n)
        with _step("measurement", s):
            runs.append(_StageRun.build(module, _input_maker(current, s == 0), is_last=s == n - 1, seed=s, **build))
        if s < n - 1:
            with torch.no_grad(), _step("forward", s):
                current = module(*(current if isinstance(current, tuple) else (current,)))
            if not isinstance(current, torch.Tensor):
                raise ValueError(f"stage {s} returns {type(current).__name__}: stages must pass one tensor on")
    return runs


def profile_stages(stage_modules: Sequence, sample_input, *, loss_fn: Callable | None = None,
                   warmup: int = DEFAULT_WARMUP, iters: int = DEFAULT_ITERS, device=None, p2p: bool | float = False,
                   p2p_timeout_s: float = 120.0, memory_limit_mb: float | None = None, full_backward: bool = True,
                   name: str = "profile", description: str = "", progress: Callable[[int, int], None] | None = None,
                   max_hold=DEFAULT, direct_wgrad: bool = False, clock: str = "auto") -> ProfileResult:
    """Profile a model split into pipeline stages (one module per virtual stage, in order).

    `sample_input` is the first stage's input (a tensor, or a tuple of arguments); each later
    stage gets the previous stage's output (one tensor), detached and requiring grad, as the
    runtimes hand it over. The last stage's output goes through `loss_fn` (default: mean).
    The stages are timed in turn, `warmup` rounds then `iters` measured ones (`measurement_plan`).
    `p2p`: False (p2p_latency 0), True (measure it with a 2-process gloo ping-pong for the
    largest stage-boundary tensor), or a number (ms) to write as is. `progress(s, n)` is called
    before stage s of n is set up (its input made; all are set up before the timing starts).
    `max_hold`: what W may hold, as a fraction of a stage's activation (`koala_ds.runtime.wgrad.prepare`;
    default 0.75, as the runtimes). `direct_wgrad`: W as the DeepSpeed runtime runs it
    (`measure_stage`). `clock`: the CPU's timer, "auto", "cpu" or "wall" (`resolve_clock`).
    Returns a `ProfileResult` (`.to_dict()` / `.write(path)` give a profile v1 JSON that
    `koala_ds.sim.load_profile` reads)."""
    if not stage_modules:
        raise ValueError("profile_stages: no stage modules")
    timer = resolve_clock(device, clock)
    runs = _stage_runs(stage_modules, sample_input, progress, loss_fn=loss_fn, timer=timer, max_hold=max_hold,
                       direct_wgrad=direct_wgrad)
    results = [StageMeasurement() for _ in runs]
    _time_stages(runs, results, warmup, iters, full_backward)
    for s, (run, meas) in enumerate(zip(runs, results)):
        with _step("measurement", s):
            run.finish(meas)
    latency, measured = 0.0, False
    if p2p is True:
        from .p2p import measure_p2p_latency

        boundary = max(results[:-1], key=lambda m: m.output_numel, default=None)
        if boundary is not None:
            latency = measure_p2p_latency(boundary.output_numel, boundary.output_dtype or "float32",
                                          timeout_s=p2p_timeout_s)
            measured = True
    elif p2p is not False:
        latency = float(p2p)
    dev = str(device) if device is not None else "cpu"
    return ProfileResult(results, latency, measured, memory_limit_mb, dev, name, description, timer=timer)
