"""One process per rank of a script, as a launcher starts them (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), for tests that check what each rank prints and its exit code
(torchrun would stop the other ranks when one exits).

The port comes from `free_port()`, which another process can take before rank 0 binds it: rank
0 then fails with EADDRINUSE while the other ranks wait on whatever holds the port. Such a
launch is stopped and started again on a new port (as `koala_ds.runtime.spawn.launch` does);
`on_a_free_port` does that for any launch given a port (a launcher's own command too).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from koala_ds.runtime.spawn import free_port

ATTEMPTS = 3

#: What the tests' ranks import, once, in the fork server of `koala_ds.runtime.spawn.launch(preload=...)`
#: (on CPU): a spawned rank imported them itself, 3-7 s of CPU each.
PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core",
           "megatron.core.pipeline_parallel.schedules", "megatron.core.models.gpt")


def environment(*paths: Path | str, **values: str) -> dict:
    """This process's environment for a child Python: `paths` first on its PYTHONPATH (before
    any the environment has), then `values` on top."""
    pythonpath = os.pathsep.join(filter(None, [*map(str, paths), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, **values}


T = TypeVar("T")


def on_a_free_port(launch: Callable[[str], T], port_taken: Callable[[T], bool] | None = None) -> T:
    """`launch(port)` on a port from `free_port()`, again on a new one (up to ATTEMPTS in all)
    while `port_taken(result)` says another process took it first (by default: a
    CompletedProcess whose output says so)."""
    port_taken = port_taken or (lambda done: _says_port_taken((done.stdout or "") + (done.stderr or "")))
    for _ in range(ATTEMPTS - 1):
        result = launch(str(free_port()))
        if not port_taken(result):
            return result
    return launch(str(free_port()))


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 held, while inside, by a listening socket that never answers (as
    another run, or a process of another kind, holds one)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def run_ranks(cmd: list[str], world: int, env: dict, timeout_s: float, cwd: str | os.PathLike
              ) -> list[subprocess.CompletedProcess]:
    """Each rank's exit code, stdout and stderr; raises TimeoutError (after killing every rank)
    when they are not all done within `timeout_s`."""
    return on_a_free_port(lambda port: _run_once(cmd, world, env, timeout_s, cwd, port),
                          lambda results: _says_port_taken(results[0].stderr))


def _run_once(cmd: list[str], world: int, env: dict, timeout_s: float, cwd: str | os.PathLike, port: str
              ) -> list[subprocess.CompletedProcess]:
    with tempfile.TemporaryDirectory(prefix="koala-ranks-") as tmp:
        logs = [(Path(tmp) / f"{rank}.out", Path(tmp) / f"{rank}.err") for rank in range(world)]
        procs = []
        for rank, (out, err) in enumerate(logs):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=rank_env, cwd=cwd))
        deadline, timed_out = time.monotonic() + timeout_s, False
        while any(proc.poll() is None for proc in procs) and not (
                procs[0].poll() is not None and _says_port_taken(logs[0][1].read_text())):
            timed_out = time.monotonic() > deadline
            if timed_out:
                break
            time.sleep(0.1)
        _kill(procs)
        if timed_out:
            raise TimeoutError(f"{cmd[1]}: {world} ranks not done within {timeout_s:g} s; rank 0's stderr:\n"
                               + logs[0][1].read_text()[-3000:])
        return [subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())
                for proc, (out, err) in zip(procs, logs)]


def _says_port_taken(output: str) -> bool:
    """The port was already bound when the launch's rendezvous store tried (torch's TCPStore says EADDRINUSE)."""
    return "EADDRINUSE" in output


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait(timeout=30)
