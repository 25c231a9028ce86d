"""koala_ds.deepspeed.teardown: the wait for gloo's worker threads before interpreter exit.

The threads here stand in for torch's gloo workers by their name (what the wait looks for): one
blocked on an event (as an idle worker in its condition wait), one busy. The abort itself is a
race: benchmarks/exit_check.py counts it over whole runs of the example.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from koala_ds.deepspeed.teardown import WORKER_THREAD, wait_for_gloo_workers, worker_states

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")


def named_thread(target, name: str = WORKER_THREAD) -> threading.Thread:
    """Start `target` in a thread whose native name (what /proc shows) is `name`."""
    ready = threading.Event()

    def run():
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name)
        ready.set()
        target()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    return thread


def test_no_worker_threads_no_wait():
    assert worker_states("koala-no-such-thread") == {}
    t0 = time.monotonic()
    assert wait_for_gloo_workers(timeout_s=5)
    assert time.monotonic() - t0 < 5


def test_an_idle_worker_is_waited_for_briefly():
    release = threading.Event()
    thread = named_thread(release.wait)
    try:
        assert thread.native_id in worker_states()
        assert wait_for_gloo_workers(timeout_s=5)
        assert worker_states()[thread.native_id].state == "S"
    finally:
        release.set()
        thread.join(10)


def test_a_busy_worker_runs_the_wait_out_with_a_warning(caplog):
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    thread = named_thread(spin)
    try:
        with caplog.at_level(logging.WARNING, logger="koala_ds.deepspeed.teardown"):
            t0 = time.monotonic()
            assert not wait_for_gloo_workers(timeout_s=0.3)
            assert time.monotonic() - t0 >= 0.3
        assert "still busy" in caplog.text and str(thread.native_id) in caplog.text
    finally:
        stop.set()
        thread.join(10)


def test_a_worker_that_finishes_is_then_idle():
    """A worker busy for a while, then idle (a collective's end): the wait returns True, after it."""
    release, busy_until = threading.Event(), time.monotonic() + 0.3

    def work_then_idle():
        while time.monotonic() < busy_until:
            sum(range(1000))
        release.wait()

    thread = named_thread(work_then_idle)
    try:
        assert wait_for_gloo_workers(timeout_s=10)
        assert time.monotonic() >= busy_until
    finally:
        release.set()
        thread.join(10)
