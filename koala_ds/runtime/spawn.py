"""Run a function in several local processes with a process group and a deadline.

Used by the engine tests, the profiler and the benchmarks. `launch("pkg.module:func", world,
spec)` starts `world` spawned processes (or, with `preload`, forks them from a fork server that
has imported torch and the engines once) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set, initialises a gloo process group (through torch, or through
`deepspeed.init_distributed` with `init="deepspeed"`), calls `func(rank, world, spec)` in each
and returns one result dict per rank. Processes still alive at the deadline, or 15 s after
another rank failed, are killed, and so is a fork server that has not forked the ranks by the
deadline (its imports hang): nothing hangs. torch is imported only in the workers (and the fork
server).
"""
from __future__ import annotations

import glob
import importlib
import logging
import os
import pickle
import socket
import signal
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable

GRACE_AFTER_FAILURE_S = 15.0


#: megatron-core warns, once per module, that Apex / Transformer Engine (CUDA kernels) are missing
#: and it falls back to torch: on CPU that is expected, and it buries the output (7 warnings).
MEGATRON_FALLBACK_WARNINGS = r".*(Apex is|Apex are) not installed"
#: torch's CUDA wheels on a machine without a GPU log "No CUDA runtime is found, using CUDA_HOME=..."
#: from this logger when megatron-core imports torch.utils.cpp_extension: on CPU that is expected too.
CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


def quiet_megatron_imports() -> None:
    """Leave out megatron-core's and torch's expected CPU fallback notices (warnings and log lines
    about CUDA-only libraries missing); every other warning stays."""
    warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK_WARNINGS)
    logging.getLogger(CPP_EXTENSION_LOGGER).setLevel(logging.ERROR)


class SpawnError(RuntimeError):
    """A worker process failed, or the job ran past its deadline (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(init: str | None, pg_timeout_s: float) -> None:
    import datetime

    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if init == "deepspeed":
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    elif init == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timeout)


def _entry(target: str, rank: int, world: int, port: int, spec: Any, out: str, pg_timeout_s: float,
           init: str | None, env: dict, base_env: dict) -> None:
    os.environ.clear()  # the launching process's environment (a forked rank has the fork server's)
    os.environ.update(base_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    quiet_megatron_imports()
    try:
        import torch

        torch.set_num_threads(1)
        _init_process_group(init, pg_timeout_s)
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        result = {"ok": True, "value": func(rank, world, spec)}
    except BaseException as exc:  # reported to the parent
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    path = os.path.join(out, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as fh:  # whole or not at all: the parent may kill this rank now
        pickle.dump(result, fh)
    os.replace(path + ".tmp", path)
    try:
        import torch.distributed as dist

        if result["ok"] and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0 if result["ok"] else 1)


def launch(target: Callable | str, world: int, spec: Any = None, *, timeout_s: float = 300.0,
           pg_timeout_s: float = 60.0, init: str | None = "gloo", env: dict | None = None,
           allow_failures: bool = False, wait_ranks: list[int] | None = None, retries: int = 3,
           preload: tuple[str, ...] = ()) -> list[dict]:
    """`target(rank, world, spec)` in `world` processes; one dict per rank: {"ok": True, "value": ...}
    or {"ok": False, "type", "message", "traceback"}. A failed rank raises `SpawnError` unless
    `allow_failures`. With `wait_ranks`, the other ranks are killed once those have finished. A
    launch whose rendezvous port was taken meanwhile (EADDRINUSE) is retried on a new port.

    `preload` (CPU jobs only): modules that a fork server imports once for all the launches of
    this process; the ranks are forked from it instead of each importing torch and its engine
    anew (seconds of CPU per rank). The first launch with a preload starts the server; later
    launches use it as it is. Not for CUDA: importing an engine may initialise CUDA, which a
    forked process cannot use. Every rank gets this process's environment at the launch, with
    `env` on top, either way. The deadline counts from before the ranks start: a fork server
    still importing `preload` at the deadline is killed (the next launch starts a new one)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    for attempt in range(retries + 1):
        results, timed_out = _launch_once(target, world, spec, timeout_s, pg_timeout_s, init, dict(env or {}),
                                          wait_ranks, preload)
        bad = [(r, res) for r, res in enumerate(results) if not res["ok"]]
        if bad and attempt < retries and any("EADDRINUSE" in res["message"] for _, res in bad):
            continue
        if bad and not allow_failures:
            text = "\n".join(f"rank {r}: {res['type']}: {res['message']}\n{res['traceback']}" for r, res in bad[:3])
            raise SpawnError(f"{target}: {len(bad)} of {world} ranks failed"
                             f"{f' (deadline of {timeout_s:g} s passed)' if timed_out else ''}:\n{text}", timed_out)
        return results
    raise AssertionError("unreachable")


def spawn(target: Callable | str, world: int, spec: Any = None, **kwargs) -> list:
    """`launch` that returns the workers' return values (raising `SpawnError` on any failure)."""
    return [res["value"] for res in launch(target, world, spec, **kwargs)]


def remove_deepspeed_shm(port: int) -> None:
    """DeepSpeed's CPU shared-memory allreduce creates /dev/shm/deepspeed_allreduce_buffer_<uid>_
    <addr>_<port>_<rank> (about 66 MB per rank) and never unlinks it: a test suite or benchmark
    would fill /dev/shm (and so RAM) job after job. The names carry the job's port, so exactly
    this job's buffers are removed once its processes are gone."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _start_fork_server(ctx, preload: tuple[str, ...], env: dict) -> None:
    """Start this process's fork server unless it runs: it imports `preload` with `env` in its
    environment, as the ranks will have it (DeepSpeed picks its accelerator, DS_ACCELERATOR, on
    import)."""
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(list(preload))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_by(procs: list, deadline: float, forked: bool) -> str | None:
    """Start `procs`; None once all have started, else why not. A forked process's `start()`
    waits for the fork server to fork it, which it does once it has imported its preload
    modules: if that has not happened by `deadline`, the server is killed (its connections
    close, so the waiting `start()` fails), and the next launch starts a new one."""
    from multiprocessing import forkserver

    errors: list[BaseException] = []

    def start_all() -> None:
        try:
            for proc in procs:
                proc.start()
        except BaseException as exc:  # reported below
            errors.append(exc)

    starter = threading.Thread(target=start_all, name="koala-spawn-start", daemon=True)
    starter.start()
    starter.join(max(0.0, deadline - time.monotonic()))
    if not starter.is_alive():
        return f"{type(errors[0]).__name__}: {errors[0]}" if errors else None
    if not forked:
        starter.join(10)
        return "the ranks had not started by the deadline"
    server = forkserver._forkserver._forkserver_pid  # private, but the only handle on it there is
    if server is not None:
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
    starter.join(10)
    return "the fork server had not forked the ranks by the deadline (still importing its preload modules?): killed"


def _launch_once(target: str, world: int, spec: Any, timeout_s: float, pg_timeout_s: float, init: str | None,
                 env: dict, wait_ranks: list[int] | None, preload: tuple[str, ...]) -> tuple[list[dict], bool]:
    import multiprocessing as mp

    deadline = time.monotonic() + timeout_s
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        _start_fork_server(ctx, preload, env)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="koala-spawn-") as out:
        base_env = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(target, r, world, port, spec, out, pg_timeout_s, init, env, base_env),
                             daemon=True) for r in range(world)]
        not_started = _start_by(procs, deadline, bool(preload))
        if not_started is None:
            _wait(procs if wait_ranks is None else [procs[r] for r in wait_ranks], procs, deadline)
        timed_out = time.monotonic() > deadline
        for proc in procs:
            if proc.pid is None:  # never started
                continue
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        remove_deepspeed_shm(port)
        return [_result(out, r, timed_out, not_started) for r in range(world)], timed_out


def _wait(watched: list, procs: list, deadline: float) -> None:
    """Until the watched processes end, the deadline passes, or GRACE_AFTER_FAILURE_S after a failure."""
    failed_at = None
    while any(p.is_alive() for p in watched):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_AFTER_FAILURE_S):
            return
        time.sleep(0.05)


def _result(out: str, rank: int, timed_out: bool, not_started: str | None) -> dict:
    path = os.path.join(out, f"rank{rank}.pkl")
    if os.path.exists(path):
        try:
            with open(path, "rb") as fh:
                return pickle.load(fh)
        except (EOFError, pickle.UnpicklingError) as exc:
            return {"ok": False, "type": "Killed", "traceback": "", "message": f"unreadable result {path}: {exc}"}
    if not_started is not None:
        return {"ok": False, "type": "NotStarted", "traceback": "", "message": f"not started: {not_started}"}
    return {"ok": False, "type": "Killed", "traceback": "",
            "message": "no result (deadline passed)" if timed_out else "no result (killed)"}
