"""Run a function in several local processes over gloo, with a deadline (profiler, benchmark, tests).

`spawn("pkg.module:func", world, spec, timeout_s)` starts `world` spawned processes, sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, initialises a gloo process group, calls
`func(rank, world, spec)` in each and returns the per-rank return values. A rank that fails
makes `spawn` raise `SpawnError` with its traceback; processes still alive at the deadline (or
15 s after another rank failed) are killed, so nothing hangs.
"""
from __future__ import annotations

import importlib
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any


class SpawnError(RuntimeError):
    """A worker process failed, or the job ran past its deadline."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(target: str, rank: int, world: int, port: int, spec: Any, out: str, pg_timeout_s: float,
           env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if env.get("KOALA_SPAWN_NO_PG") != "1":
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=pg_timeout_s))
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        result = {"ok": True, "value": func(rank, world, spec)}
    except BaseException as exc:  # reported to the parent
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    try:
        import torch.distributed as dist

        if result["ok"] and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0 if result["ok"] else 1)


def spawn(target: str, world: int, spec: Any = None, timeout_s: float = 300.0, pg_timeout_s: float = 60.0,
          env: dict | None = None, retries: int = 3) -> list:
    """`func(rank, world, spec)` in `world` processes (target "module:function"); its return values.
    A launch whose rendezvous port was taken meanwhile (EADDRINUSE) is retried on a new port."""
    for attempt in range(retries + 1):
        try:
            return _spawn_once(target, world, spec, timeout_s, pg_timeout_s, env)
        except SpawnError as exc:
            if attempt == retries or "EADDRINUSE" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _spawn_once(target: str, world: int, spec: Any, timeout_s: float, pg_timeout_s: float, env: dict | None) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="koala-spawn-") as out:
        procs = [ctx.Process(target=_entry, args=(target, r, world, port, spec, out, pg_timeout_s, dict(env or {})),
                             daemon=True) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 15):
                break
            time.sleep(0.05)
        timed_out = time.monotonic() > deadline
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    results.append(pickle.load(fh))
            else:
                results.append({"ok": False, "type": "Killed", "traceback": "",
                                "message": f"no result ({'deadline of %.0f s passed' % timeout_s if timed_out else 'killed'})"})
    bad = [(r, res) for r, res in enumerate(results) if not res["ok"]]
    if bad:
        text = "\n".join(f"rank {r}: {res['type']}: {res['message']}\n{res['traceback']}" for r, res in bad[:3])
        raise SpawnError(f"{target}: {len(bad)} of {world} ranks failed:\n{text}")
    return [res["value"] for res in results]
