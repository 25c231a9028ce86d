"""Deferred weight gradients: a split backward (I, then W) that costs one full backward.

A split schedule runs a stage's backward as I (the input gradient, which the previous stage
waits for) and, later, W (the weight gradients). Splitting the autograd graph does not give
that cheaply: a custom autograd Function (megatron-core's linears, Transformer Engine's)
computes grad_input AND grad_weight on every call. So the split is made at the layer:

- `prepare(module)` makes the layers it knows deferrable (once per model chunk): every plain
  `torch.nn.Linear` and megatron-core's ColumnParallelLinear / RowParallelLinear (their
  LinearWithGradAccumulationAndAsyncCommunication path, tensor and sequence parallel, with
  gradient_accumulation_fusion / `main_grad` kept exact). Transformer Engine modules built with
  `delay_wgrad_compute=True` (TE >= 2.3) defer by themselves; W calls their `backward_dw()`.
- I is an ordinary full backward run inside `deferring()`: every deferrable layer computes its
  input gradient (and bias gradient) and queues its weight-gradient GEMM, with the two tensors
  it needs (its input and its output gradient), on the `WeightGradQueue` of that
  (chunk, microbatch). The graph is freed as after any backward: after I only the queue is held.
- W is `queue.run()`: the queued GEMMs, accumulated through autograd's own gradient
  accumulators, so `.grad`, `main_grad`, and the hooks of DDP / DeepSpeed see what they would
  see in a full backward. A runtime that knows no hook sits on the gradient accumulators
  (DeepSpeed's pipeline engine: its hooks are post-accumulate-grad hooks, which are visible)
  runs W with `direct=True`: each `nn.Linear` weight gradient is then added into `.grad` by
  its GEMM (`addmm_`), layer by layer while the data is in cache, instead of being written
  whole and added afterwards (which cost W about twice B - I on a CPU); a weight with a tensor
  hook or a post-accumulate-grad hook, or a GEMM in another dtype (autocast), still goes
  through autograd.
- A full backward (B) outside `deferring()` computes everything at once, as before.
- The hold policy (`prepare(model, max_hold=0.75)`, `koala_ds.runtime.wgrad_policy`): W may hold at
  most that fraction of the chunk's activation; the covered layers with the most held bytes per
  weight-gradient FLOP beyond it compute their weight gradient in I (planned on the chunk's
  first forward with autograd; `max_hold=None` defers every covered layer).

Parameters of layers not covered (norms, embeddings, biases, a custom Function of a library
this module does not know) get their gradients in I: exact, since every backward still runs
once; only I costs more. `prepare` warns once per layer that holds a weight matrix and is
not covered, naming it. A functional `F.linear(x, w)` outside an `nn.Linear` is such a case.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from ..core.ir import Op
from .wgrad_policy import DEFAULT, DEFAULT_MAX_HOLD, ForwardWatch, Plan, check_max_hold

log = logging.getLogger(__name__)

#: A deferred weight-gradient step: returns (parameter, gradient) pairs to accumulate, or None.
WgradWork = Callable[[], Optional[list]]

_ACTIVE: "WeightGradQueue | None" = None  # the queue of the I step running now (a global, not a
# thread-local: autograd runs CUDA backward functions on its own device threads)


def storage_bytes(storages: Iterable[tuple[int, int]]) -> int:
    """Bytes of distinct storages, given (data pointer, size in bytes) pairs (a storage met twice counts once)."""
    sizes: dict[int, int] = {}
    for ptr, nbytes in storages:
        sizes[ptr] = max(sizes.get(ptr, 0), nbytes)
    return sum(sizes.values())


@dataclass
class WeightGradQueue:
    """The weight-gradient work one I step left for its W step."""

    work: list = field(default_factory=list)
    held: list = field(default_factory=list)  # the tensors the work keeps alive (for the profiler)
    te_modules: list = field(default_factory=list)  # TE modules whose backward_dw() W calls
    kept: set = field(default_factory=set)  # id() of weights the hold policy computes in I
    direct: bool = False  # add nn.Linear weight gradients into .grad in their GEMM (see the module doc)

    def defers(self, weight) -> bool:
        """Whether this I step queues the weight gradient of `weight` (else it is computed now)."""
        return id(weight) not in self.kept

    def add(self, work: WgradWork, *tensors: torch.Tensor) -> None:
        self.work.append(work)
        self.held.extend(t for t in tensors if t is not None)

    def held_bytes(self) -> int:
        """Bytes of the distinct storages the queue keeps alive until W."""
        return storage_bytes((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self.held)

    def run(self) -> None:
        """W: compute the queued weight gradients and accumulate them as autograd would."""
        pairs: dict = {}
        # no graph: the saved inputs require grad, and in grad mode each GEMM would record an
        # autograd node (and gloo refuses to all-gather such an input for sequence parallelism)
        with torch.no_grad():
            for work in self.work:
                if self.direct and isinstance(work, LinearWgrad) and work.accumulate():
                    continue
                for param, grad in work() or ():
                    prev = pairs.get(id(param))
                    pairs[id(param)] = (param, grad if prev is None else prev[1] + grad)
        self.work.clear()
        self.held.clear()
        if pairs:
            params, grads = zip(*pairs.values())
            # through the parameters' AccumulateGrad nodes: .grad and DDP / DeepSpeed hooks as in B
            torch.autograd.backward(list(params), grad_tensors=list(grads))
        for module in self.te_modules:
            module.backward_dw()
        self.te_modules.clear()


_PLAIN_FORWARD = False  # inside plain_forward(): DeferrableLinear runs torch's own linear


@contextlib.contextmanager
def plain_forward(on: bool = True) -> Iterator[None]:
    """A forward as an unprepared model runs it: `DeferrableLinear` calls torch's own linear
    (no custom Function), so its backward computes every gradient at once, deferring nothing.
    Exact either way; the profiler uses it to time the forward a full-backward schedule runs
    (the runtimes prepare a model only for split schedules). `on` False: no change."""
    global _PLAIN_FORWARD
    old, _PLAIN_FORWARD = _PLAIN_FORWARD, _PLAIN_FORWARD or on
    try:
        yield
    finally:
        _PLAIN_FORWARD = old


def full_backward_forwards(schedule, rank: int) -> frozenset:
    """(stage, microbatch) of the B actions of `rank` in `schedule`: a split schedule may run some
    backwards whole (dualpipe-v does); their forwards need no deferral (`plain_forward`)."""
    return frozenset((a.stage, a.microbatch) for a in schedule.ranks[rank] if a.op is Op.B)


def plain_forwards(schedule, rank: int, models, deferring: bool) -> frozenset:
    """(stage, microbatch) of the forwards of `rank` that a runtime runs in `plain_forward`, as an
    unprepared model would: none where no model chunk was prepared (nothing to switch off); in a
    call that defers weight gradients (a split schedule, training), those whose backward is a full
    B (`full_backward_forwards`); in any other call on prepared chunks (a full-backward schedule
    or a forward-only call after a split schedule ran on the same model: schedules taking turns),
    every one."""
    if not any(getattr(m, "_koala_wgrad", None) is not None for m in models):
        return frozenset()
    if deferring:
        return full_backward_forwards(schedule, rank)
    return frozenset((a.stage, a.microbatch) for a in schedule.ranks[rank] if a.op is Op.F)


def active_queue() -> WeightGradQueue | None:
    """The queue of the I step running now, or None (a full backward: compute everything)."""
    return _ACTIVE


@contextlib.contextmanager
def deferring(queue: WeightGradQueue | None = None) -> Iterator[WeightGradQueue]:
    """Run a backward inside this to make it an I step; yields the queue W will run."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("koala wgrad: an I step is already running (nested deferring())")
    queue = WeightGradQueue() if queue is None else queue
    _ACTIVE = queue
    try:
        yield queue
    finally:
        _ACTIVE = None


def _fold(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_gradient(param: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear's weight gradient, grad_out^T x folded over the leading dims, in the weight's dtype."""
    return _fold(grad_out).t().matmul(_fold(x)).to(param.dtype)


@dataclass
class LinearWgrad:
    """One deferred `nn.Linear` weight gradient: grad_out^T x, folded over the leading dims."""

    param: torch.Tensor
    grad_out: torch.Tensor
    x: torch.Tensor

    def __call__(self) -> list:
        return [(self.param, _weight_gradient(self.param, self.grad_out, self.x))]

    def accumulate(self) -> bool:
        """Add the gradient into `.grad` in the GEMM itself; False (nothing done) where autograd
        must do it: a tensor hook or post-accumulate-grad hook on the weight, or another dtype."""
        param = self.param
        if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None) \
                or not self.grad_out.dtype == self.x.dtype == param.dtype:
            return False
        grad_out, x = _fold(self.grad_out).t(), _fold(self.x)
        with torch.no_grad():
            if param.grad is None:
                param.grad = grad_out.matmul(x)
            else:
                param.grad.addmm_(grad_out, x)
        return True


class _Linear(torch.autograd.Function):
    """F.linear whose weight gradient is queued when an I step is running."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.param, ctx.has_bias = weight, bias is not None
        device = x.device.type
        if torch.is_autocast_enabled(device):  # compute (and save) in the autocast dtype, as F.linear would
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out.matmul(weight) if need_x else None
        grad_b = _fold(grad_out).sum(0) if ctx.has_bias and need_b else None
        grad_w = None
        if need_w:
            queue = active_queue()
            param = ctx.param
            if queue is None or not queue.defers(param):
                grad_w = _weight_gradient(param, grad_out, x)
            else:
                queue.add(LinearWgrad(param, grad_out, x), x, grad_out)
        return grad_x, grad_w, grad_b


class DeferrableLinear(torch.nn.Linear):
    """`torch.nn.Linear` whose weight gradient an I step defers (what `prepare` makes of one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _PLAIN_FORWARD or not torch.is_grad_enabled():
            out = torch.nn.functional.linear(x, self.weight, self.bias)
        else:
            out = _Linear.apply(x, self.weight, self.bias)
        note_layer(self.weight, x, out)
        return out


def _te_delayed(module) -> bool:
    store = getattr(module, "wgrad_store", None)
    delayed = getattr(store, "delay_wgrad_compute", None)
    return bool(delayed() if callable(delayed) else delayed) and hasattr(module, "backward_dw")


def _has_own_matrix(module) -> bool:
    return any(p.requires_grad and p.dim() >= 2 for p in module.parameters(recurse=False))


def _uncovered_label(name: str, module) -> str:
    label = f"{name or '<model>'} ({type(module).__name__})"
    if type(module).__module__.split(".")[0] == "transformer_engine" or type(module).__name__.startswith("TE"):
        label += " (Transformer Engine: build it with delay_wgrad_compute=True, TE >= 2.3)"
    return label




def prepare(model: torch.nn.Module, max_hold=DEFAULT) -> "Prepared":
    """Make the layers of `model` this module knows deferrable (idempotent); warn once per
    layer holding a weight matrix whose gradient will be computed in I instead.

    `max_hold` (default `DEFAULT_MAX_HOLD`, 0.75): what W may hold after an I step, as a fraction
    of the chunk's activation; the covered layers beyond it compute their weight gradient in I
    (`koala_ds.runtime.wgrad_policy`). None defers every covered layer. The first call's value stays:
    call `prepare(chunk, max_hold=...)` before handing the chunk to a runtime to choose it."""
    default = isinstance(max_hold, str) and max_hold == DEFAULT
    found = getattr(model, "_koala_wgrad", None)
    if found is not None:
        if not default and check_max_hold(max_hold) != found.max_hold:
            raise ValueError(f"koala wgrad: this model was already prepared with max_hold={found.max_hold}; "
                             f"pass max_hold={max_hold!r} to the first prepare() call only")
        return found
    prepared = Prepared(max_hold=check_max_hold(DEFAULT_MAX_HOLD if default else max_hold))
    _cover(model, prepared)
    for layer in prepared.uncovered:
        log.warning("koala: the weight gradient of layer %s is computed in I, not deferred to W "
                    "(exact, but I costs more): deferred weight gradients cover torch.nn.Linear and "
                    "megatron-core's Column/RowParallelLinear", layer)
    if prepared.max_hold is not None and prepared.weights:
        model.register_forward_pre_hook(prepared._watch_start, with_kwargs=True)
        model.register_forward_hook(prepared._watch_end, always_call=True)
    model._koala_wgrad = prepared
    return prepared


def _megatron_linears():
    """`koala_ds.runtime._wgrad_megatron` when megatron-core's tensor-parallel layers are loaded, else
    None: a model holds one of those layers only once their module is imported, so preparing a
    plain-torch model does not import megatron-core (~5 s of CPU)."""
    if "megatron.core.tensor_parallel.layers" not in sys.modules:
        return None
    from . import _wgrad_megatron

    return _wgrad_megatron


def _cover(model: torch.nn.Module, prepared: "Prepared") -> None:
    mcore = _megatron_linears()
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = DeferrableLinear
        if type(module) is DeferrableLinear or (mcore is not None and mcore.make_deferrable(module)):
            prepared.linears += 1
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
                prepared.weights.add(id(weight))
        elif _te_delayed(module):
            prepared.te_modules.append(module)
        elif _has_own_matrix(module) and not isinstance(module, torch.nn.Embedding) \
                and not (mcore is not None and mcore.is_embedding(module)):
            prepared.uncovered.append(_uncovered_label(name, module))


_WATCH: ForwardWatch | None = None  # the forward being watched for a hold plan, if any
# covered layers that never run (or run through a path that does not report them) would keep
# every forward watched: stop after this many watched forwards in a row that planned nothing
_MAX_IDLE_WATCHES = 64


def note_layer(weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """One call of a covered layer: record what deferring it would hold, if a forward is watched."""
    watch = _WATCH
    if watch is None or not weight.requires_grad:
        return
    if x.dtype == out.dtype:  # W holds the input itself
        storage = x.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
    else:  # under autocast the layer saves (and W holds) a cast copy
        key, nbytes = None, x.numel() * out.element_size()
    watch.layer_call(id(weight), key, nbytes, out.numel() * out.element_size(),
                     2.0 * out.numel() * weight.shape[-1])


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _saved_by(node) -> Iterator[torch.Tensor]:
    """What an autograd node saved for its backward: a built-in node's `_saved_*` attributes, a
    custom Function's `saved_tensors`."""
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                yield from _tensors(getattr(node, name))
            except (RuntimeError, AttributeError):  # freed, or not a saved value
                continue


def _record_saved(watch: ForwardWatch, outputs, inputs) -> None:
    """The storages saved for backward by the graph of one forward: from its outputs back to its
    inputs (their own graph, an earlier chunk's, is not this forward's). Read off the graph, not
    through saved-tensor hooks: under hooks every custom Function would get copies of its saved
    parameters, without their attributes (main_grad, grad_added_to_main_grad)."""
    stop = {id(t.grad_fn) for t in _tensors(inputs) if t.grad_fn is not None}
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: dict = {}  # id -> node (kept alive while its id is in use)
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        for t in _saved_by(node):
            try:
                storage = t.untyped_storage()
                watch.saved_storage(storage.data_ptr(), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # no plain storage: not counted
                pass
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


@dataclass
class Prepared:
    """What `prepare` found in a model chunk, and its hold policy."""

    linears: int = 0
    te_modules: list = field(default_factory=list)
    uncovered: list = field(default_factory=list)
    max_hold: Optional[float] = DEFAULT_MAX_HOLD
    weights: set = field(default_factory=set)  # id() of the covered layers' weights
    plan: Plan = field(default_factory=Plan)
    _watching: Optional[tuple] = None
    _idle: int = 0  # watched forwards in a row that met no unplanned layer

    def _watch_start(self, module, args, kwargs) -> None:
        global _WATCH
        if _WATCH is not None or not torch.is_grad_enabled() or self._idle >= _MAX_IDLE_WATCHES \
                or self.weights <= self.plan.deferred | self.plan.kept:
            return
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        watch = ForwardWatch(params)
        self._watching, _WATCH = (watch, (args, kwargs)), watch

    def _watch_end(self, module, args, output) -> None:
        global _WATCH
        if self._watching is None:
            return
        (watch, inputs), self._watching, _WATCH = self._watching, None, None
        if sys.exc_info()[0] is not None:  # the forward raised: plan on a complete one
            return
        new = [c for c in watch.layers.values() if c.key not in self.plan.deferred and c.key not in self.plan.kept]
        self._idle = 0 if new else self._idle + 1
        if new:
            _record_saved(watch, output, inputs)
            self.plan.add(new, watch.activation_bytes(), self.max_hold)

    def deferred_fraction(self) -> Optional[float]:
        """The fraction of the covered layers' weight-gradient FLOPs W runs (None: nothing planned)."""
        if self.max_hold is None and self.weights:
            return 1.0
        return self.plan.deferred_fraction() if self.plan.flops_total else None

    @contextlib.contextmanager
    def input_step(self, direct: bool = False) -> Iterator[WeightGradQueue]:
        """An I step of this chunk: a full backward run inside this defers the weight gradients
        (of the layers the hold policy defers; the others compute theirs in it). `direct`: its W
        adds nn.Linear weight gradients into `.grad` in their GEMM (only where no hook sits on
        the weights' gradient accumulators: see the module doc)."""
        with deferring() as queue:
            queue.te_modules.extend(self.te_modules)
            queue.kept, queue.direct = self.plan.kept, direct
            yield queue

    def full_step_done(self) -> None:
        """After a full backward (B): TE modules built with delayed wgrad still need backward_dw()."""
        for module in self.te_modules:
            module.backward_dw()
