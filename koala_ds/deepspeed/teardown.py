"""End a process that ran gloo collectives without the C++ abort at interpreter exit.

The abort: a rank prints "terminate called without an active exception" (SIGABRT) after its
last line, and torchrun reports a ChildFailedError. Its native backtrace (a core of the aborting
rank, torch 2.13, CPython 3.11):

    c10d::ProcessGroupGloo::runLoop(int)                 thread "pt_gloo_runloop"
    AsyncBroadcastWork::~AsyncBroadcastWork / AsyncWork::~AsyncWork
    std::vector<std::vector<at::Tensor>>::~vector
    c10::TensorImpl::decref_pyobject                     the tensor's Python object: needs the GIL
    ConcretePyInterpreterVTable::decref -> pybind11::gil_scoped_acquire -> PyEval_AcquireThread
    take_gil -> PyThread_exit_thread -> pthread_exit     (the interpreter is finalizing)
    _Unwind_ForcedUnwind -> __gxx_personality_v0 -> std::terminate

A gloo worker thread runs each collective, completes its future (the caller's `wait()` returns
and the caller goes on), and only then destroys the work, dropping its references to the
collective's tensors. While C++ holds a tensor beside Python, torch keeps a reference to the
tensor's Python object, so dropping the last C++ one takes the GIL, even when Python still holds
the tensor. If the caller's last collective is followed at once by the end of the script, the
worker may ask for the GIL after the interpreter started finalizing: CPython 3.11 then ends the
thread with pthread_exit, the unwinding meets the work's destructor (noexcept), and the process
aborts. It needs the worker to be descheduled between completing the future and destroying the
work, hence a busy machine. `deepspeed.comm.destroy_process_group()` does not help: the process
groups stay alive while DeepSpeed's objects reference them, and gloo's `shutdown()` leaves the
worker threads running.

`wait_for_gloo_workers()` waits, the GIL released, until every gloo worker thread of the process
is idle (asleep, and not woken for two polls in a row: a thread waiting for the GIL wakes every
switch interval), so that no worker needs the interpreter any more. Importing koala_ds.deepspeed
runs it at interpreter exit (`install_exit_wait`); a script on DeepSpeed's own engine calls it
after its last collective. Linux only (it reads /proc); elsewhere, and where torch names no
thread "pt_gloo_runloop" (before torch 2.1), it returns at once.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["WORKER_THREAD", "DEFAULT_WAIT_S", "wait_for_gloo_workers", "install_exit_wait"]

#: The name torch gives ProcessGroupGloo's worker threads (c10::setThreadName in runLoop).
WORKER_THREAD = "pt_gloo_runloop"
#: The longest the exit waits: idle workers settle in a few tens of milliseconds; a worker still
#: inside a collective (a peer that stopped answering, after an error) does not delay the exit longer.
DEFAULT_WAIT_S = 2.0
#: Polls in a row with every worker asleep and not woken.
QUIET_POLLS = 2
TASKS = "/proc/self/task"


@dataclass(frozen=True)
class ThreadState:
    """What /proc says about one thread: its state letter and how often it was switched out."""

    state: str
    switches: int


def worker_states(name: str = WORKER_THREAD, tasks: str = TASKS) -> dict[int, ThreadState]:
    """The state of each thread of this process named `name`, by thread id ({} off Linux)."""
    try:
        tids = os.listdir(tasks)
    except OSError:
        return {}
    states = {}
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as comm:
                if comm.read().strip() != name:
                    continue
            with open(f"{tasks}/{tid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        switches = sum(int(fields.get(key, "0")) for key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        states[int(tid)] = ThreadState(fields.get("State", "?").strip()[:1], switches)
    return states


def wait_for_gloo_workers(timeout_s: float = DEFAULT_WAIT_S, poll_s: float | None = None) -> bool:
    """Wait until every gloo worker thread of this process is idle; True when they are (or there
    are none), False when `timeout_s` ran out first (logged as a warning). Sleeps between polls,
    so a worker waiting for the GIL gets it."""
    poll = poll_s if poll_s is not None else max(0.01, 2 * sys.getswitchinterval())
    start = time.monotonic()
    previous, quiet = worker_states(), 0
    while previous and quiet < QUIET_POLLS:
        if time.monotonic() - start >= timeout_s:
            busy = sorted(tid for tid, state in previous.items() if state.state != "S")
            logger.warning("gloo worker threads still busy %.1f s after the last collective (threads %s); the "
                           "process may abort at exit ('terminate called without an active exception')",
                           timeout_s, busy or sorted(previous))
            return False
        time.sleep(poll)
        current = worker_states()
        idle = current == previous and all(state.state == "S" for state in current.values())
        previous, quiet = current, quiet + 1 if idle else 0
    logger.debug("gloo worker threads idle after %.3f s", time.monotonic() - start)
    return True


_installed = False


def install_exit_wait(timeout_s: float = DEFAULT_WAIT_S) -> None:
    """Run `wait_for_gloo_workers` at interpreter exit (once per process), before the
    interpreter starts finalizing."""
    global _installed
    if not _installed:
        atexit.register(wait_for_gloo_workers, timeout_s)
        _installed = True
