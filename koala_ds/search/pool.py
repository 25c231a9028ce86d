"""Parallel try-test: (part index, orders) jobs evaluated in this process or in a pool of spawned
worker processes that end with their parent."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from .problem import SearchProblem


logger = logging.getLogger(__name__)

_WORKER: SearchProblem | None = None


def _exit_with_parent(parent: int) -> None:
    """End this worker when the search process dies (kill -9 included), instead of leaving it and
    multiprocessing's resource tracker running as orphans: Linux's parent-death signal, and a
    thread that polls the parent elsewhere (and covers a parent that died before the call)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="koala-parent-watch", daemon=True).start()


def _worker_init(args: tuple, parent: int | None = None) -> None:
    global _WORKER
    # Ctrl-C goes to the whole process group: only the search process answers it (with the best
    # schedule so far); a worker ignores it and finishes its batch, then exits with the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        _exit_with_parent(parent)
    profile, p, m, v, backward, limit, placements = args
    _WORKER = SearchProblem(profile, p, m, v, backward, limit, placements)


def _worker_eval(job: tuple[int, list[list[int]]]) -> tuple[float, float, list[list[int]]]:
    """Try-test one (part index, orders) job in a worker: (makespan, peak, repaired orders)."""
    assert _WORKER is not None
    ev = _WORKER.parts[job[0]].evaluate(job[1])
    return ev.makespan, ev.peak, ev.orders


class Evaluator:
    """Try-tests (part index, orders) jobs, in this process or in a pool of `workers` processes;
    counts them and the time they took."""

    def __init__(self, problem: SearchProblem, workers: int):
        self.problem = problem
        self.pool = None
        self.count = 0
        self.seconds = 0.0  # wall time of the calls, for the mean time of one try-test
        if workers > 1:
            import concurrent.futures as cf
            import multiprocessing as mp

            limit = problem.memory_limit if problem.memory_limit is not None else list(problem.limits)
            if isinstance(limit, list) and len(set(limit)) == 1:
                limit = limit[0]
            placements = list({(pt.placement.stage_ranks, pt.placement.pipelines): pt.placement
                               for pt in problem.parts}.values())
            args = (problem.profile if problem.memory_limit is not None else problem.search_profile,
                    problem.p, problem.m, problem.v, problem.backward,
                    limit if not isinstance(limit, list) else None, placements)
            self.pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                               initializer=_worker_init, initargs=(args, os.getpid()))
            self.workers = workers
            self.started = False

    def _start_workers(self) -> None:
        """Start every worker now, with SIGINT blocked while they are created: they inherit the
        mask, so a Ctrl-C while they import stays pending until their initializer ignores it (no
        worker tracebacks); this process gets it once the workers are started (a Ctrl-C then was
        lost while SIGINT was ignored here instead: the search ran on to its end)."""
        self.started = True
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set in the main thread; the initializer still ignores SIGINT
        if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self._submit_one_each()
            finally:
                signal.signal(signal.SIGINT, old)
            return
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._submit_one_each()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending SIGINT is delivered here

    def _submit_one_each(self) -> None:
        for _ in range(self.workers):
            self.pool.submit(os.getpid)

    def __call__(self, jobs: list[tuple[int, list[list[int]]]], out_of_time: Callable[[], bool] | None = None
                 ) -> list[tuple[float, float, list[list[int]]]]:
        """The results of `jobs`, in order; with `out_of_time`, of a prefix of them: it stops
        when that returns True (one job or one round of the pool at a time)."""
        t0 = time.perf_counter()
        try:
            return self._run(jobs, out_of_time)
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    def _run(self, jobs: list[tuple[int, list[list[int]]]], out_of_time: Callable[[], bool] | None
             ) -> list[tuple[float, float, list[list[int]]]]:
        if out_of_time is not None:
            step = 1 if self.pool is None else 2 * self.workers
            out: list = []
            for i in range(0, len(jobs), step):
                if i and out_of_time():
                    break
                out += self._run(jobs[i:i + step], None)
            return out
        self.count += len(jobs)
        if self.pool is not None and len(jobs) >= 4:
            chunk = max(1, len(jobs) // (self.workers * 2))
            try:
                if not self.started:
                    self._start_workers()
                return list(self.pool.map(_worker_eval, jobs, chunksize=chunk))
            except BrokenProcessPool:  # a worker was killed (the out-of-memory killer, a user): same answers, slower
                logger.warning("a search worker process ended abruptly (killed, or out of memory?): the search "
                               "goes on in this process alone (--workers 1)")
                self.close()
        out = []
        for part, orders in jobs:
            ev = self.problem.parts[part].evaluate(orders)
            out.append((ev.makespan, ev.peak, ev.orders))
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None
