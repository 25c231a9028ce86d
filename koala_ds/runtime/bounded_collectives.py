"""Blocking torch.distributed collectives with a deadline.

Inside `bounded_collectives(wait)`, a call such as `torch.distributed.all_reduce(t, group=g)`
(async_op left False) is issued with `async_op=True` and its work handed to
`wait(work, group, describe)`, which waits at most the caller's timeout and raises the caller's
error; `describe()` names the collective ("all_reduce over ranks [0, 1]"). A call that asks
for `async_op=True` itself is passed through: its caller waits. On exit the functions are
restored.

What is covered: the functions of `torch.distributed` listed in `COLLECTIVES`, looked up as
`torch.distributed.<name>` or `torch.distributed.distributed_c10d.<name>` at call time. That
includes the object collectives (`all_gather_object`, `broadcast_object_list`, ...), which
call `all_gather` / `broadcast` through that module. Not covered: a module that bound a
collective by `from torch.distributed import all_reduce` before the context was entered,
functional collectives (`torch.distributed._functional_collectives`), and communication
that does not go through torch.distributed at all (DeepSpeed's CPU shared-memory all-reduce:
the DeepSpeed engine bounds deepspeed.comm's backend instead, see koala_ds.deepspeed.comm).

The patch is process-wide while the context is open (every thread sees it); nested contexts
keep the outermost one. torch only: used by the Megatron runtime; `wait_work` by both engines.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: blocking collectives of torch.distributed that take async_op
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "all_gather_single",  # torch >= 2.15: all_gather_object gathers through it
)

Wait = Callable[[object, object, Callable[[], str]], None]  # (work, group, describe)

_active: list = []  # the wait of the open context (at most one)


def _group_ranks(group) -> str:
    try:
        return str(dist.get_process_group_ranks(group if group is not None else c10d._get_default_group()))
    except (RuntimeError, ValueError, AttributeError):
        return "?"


def describe(name: str, group) -> str:
    """'all_reduce over ranks [0, 1]'."""
    return f"{name} over ranks {_group_ranks(group)}"


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> inspect.Signature:
    """`inspect.signature(fn)`, computed once per function: the context is entered once per
    pipeline step, and 16 signatures cost about 4 ms of CPU."""
    return inspect.signature(fn)


def _bounded(name: str, fn: Callable, wait: Wait) -> Callable:
    signature = _signature(fn)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("async_op", False):
            return fn(*args, **kwargs)
        bound.arguments["async_op"] = True
        work = fn(*bound.args, **bound.kwargs)
        if work is not None:  # None: this rank is not in the group
            group = bound.arguments.get("group")
            wait(work, group, lambda: describe(name, group))
        return None

    call.__wrapped__ = fn
    call.__name__ = name
    return call


@contextlib.contextmanager
def bounded_collectives(wait: Wait) -> Iterator[None]:
    """While open, torch.distributed's blocking collectives are async and waited by `wait`."""
    if _active:
        yield
        return
    saved = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}
    exported = {name for name in saved if getattr(dist, name, None) is saved[name]}
    _active.append(wait)
    try:
        for name, fn in saved.items():
            wrapped = _bounded(name, fn, wait)
            setattr(c10d, name, wrapped)
            if name in exported:
                setattr(dist, name, wrapped)
        yield
    finally:
        for name, fn in saved.items():
            setattr(c10d, name, fn)
            if name in exported:
                setattr(dist, name, fn)
        _active.clear()


@dataclass(frozen=True)
class WaitFailure:
    """A wait that ended without its work: `error` is the transport's text ('' when the deadline
    passed while polling), `elapsed` the seconds waited, `timeout_s` the deadline."""

    error: str
    elapsed: float
    timeout_s: float

    @property
    def early(self) -> bool:
        """Ended well before the deadline: the transport failed (the peer closed the connection
        or crashed), as gloo's wait(timeout) raises early only then; else the time ran out."""
        return self.elapsed < 0.9 * self.timeout_s

    @property
    def cause(self) -> str:
        """The first line of the transport's error, at most 200 characters ('' when none)."""
        return self.error.splitlines()[0][:200] if self.error else ""


@functools.lru_cache(maxsize=16)
def _timedelta(seconds: float) -> timedelta:
    """`timedelta(seconds=...)`, built once per timeout (the p2p layers wait once per message)."""
    return timedelta(seconds=seconds)


def wait_work(work, timeout_s: float, gloo: bool) -> WaitFailure | None:
    """Wait for `work` at most `timeout_s`: None when it completed, else how it failed.

    gloo: `work.wait(timeout)` (raises at the deadline, or earlier when the connection failed).
    Other backends: poll `is_completed()` until the deadline (NCCL's wait only orders streams).
    The one wait of both engines' point-to-point layers and bounded collectives."""
    if gloo:
        start = time.monotonic()
        try:
            work.wait(_timedelta(timeout_s))
        except RuntimeError as exc:
            return WaitFailure(str(exc) or type(exc).__name__, time.monotonic() - start, timeout_s)
        return None
    start = time.monotonic()
    deadline = start + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return WaitFailure("", time.monotonic() - start, timeout_s)
        time.sleep(0.0002)
    work.wait()
    return None


def is_gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False
