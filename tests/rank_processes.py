"""One process per rank of a script, as a launcher starts them (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), for tests that check what each rank prints and its exit code
(torchrun would stop the other ranks when one exits).

The port comes from `free_port()`, which another process can take before rank 0 binds it: rank
0 then fails with EADDRINUSE while the other ranks wait on whatever holds the port. Such a
launch is stopped and started again on a new port (as `koala_ds.spawn.launch` does).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from koala_ds.spawn import free_port

ATTEMPTS = 3


def run_ranks(cmd: list[str], world: int, env: dict, timeout_s: float, cwd: str | os.PathLike
              ) -> list[subprocess.CompletedProcess]:
    """Each rank's exit code, stdout and stderr; raises TimeoutError (after killing every rank)
    when they are not all done within `timeout_s`."""
    for attempt in range(ATTEMPTS):
        results, port_taken = _run_once(cmd, world, env, timeout_s, cwd)
        if not port_taken or attempt == ATTEMPTS - 1:
            return results
    raise AssertionError("unreachable")


def _run_once(cmd: list[str], world: int, env: dict, timeout_s: float, cwd: str | os.PathLike
              ) -> tuple[list[subprocess.CompletedProcess], bool]:
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="koala-ranks-") as tmp:
        logs = [(Path(tmp) / f"{rank}.out", Path(tmp) / f"{rank}.err") for rank in range(world)]
        procs = []
        for rank, (out, err) in enumerate(logs):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=rank_env, cwd=cwd))
        deadline, timed_out = time.monotonic() + timeout_s, False
        while any(proc.poll() is None for proc in procs) and not _port_taken(procs[0], logs[0][1]):
            timed_out = time.monotonic() > deadline
            if timed_out:
                break
            time.sleep(0.1)
        _kill(procs)
        if timed_out:
            raise TimeoutError(f"{cmd[1]}: {world} ranks not done within {timeout_s:g} s; rank 0's stderr:\n"
                               + logs[0][1].read_text()[-3000:])
        return [subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())
                for proc, (out, err) in zip(procs, logs)], _port_taken(procs[0], logs[0][1])


def _port_taken(rank0: subprocess.Popen, stderr: Path) -> bool:
    """Rank 0 ended because MASTER_PORT was already bound (torch's TCPStore says EADDRINUSE)."""
    return rank0.poll() is not None and "EADDRINUSE" in stderr.read_text()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait(timeout=30)
