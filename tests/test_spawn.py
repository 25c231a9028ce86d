"""koala_ds.runtime.spawn: ranks forked from a fork server (`preload`) see what spawned ranks see."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from koala_ds.runtime.spawn import spawn
from rank_processes import PRELOAD, environment

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("KOALA_SPAWN_TEST_SET", "KOALA_SPAWN_TEST_GONE", "KOALA_SPAWN_TEST_EXTRA", "RANK", "OMP_NUM_THREADS")


def environment_worker(rank: int, world: int, spec) -> dict:
    return {name: os.environ.get(name) for name in NAMES}


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(240)
@pytest.mark.parametrize("preload", [(), PRELOAD], ids=["spawned", "forked"])
def test_ranks_get_the_launching_processs_environment_at_the_launch(monkeypatch, preload):
    """A forked rank starts with the fork server's environment, fixed when the server started
    (by the first launch with a preload, in another test perhaps): the launch's is passed on."""
    monkeypatch.setenv("KOALA_SPAWN_TEST_GONE", "set before the first launch")
    monkeypatch.setenv("KOALA_SPAWN_TEST_SET", "before")
    spawn("test_spawn:environment_worker", 1, timeout_s=180, preload=preload)  # forked: the server runs now
    monkeypatch.delenv("KOALA_SPAWN_TEST_GONE")
    monkeypatch.setenv("KOALA_SPAWN_TEST_SET", "after")
    got = spawn("test_spawn:environment_worker", 2, timeout_s=180, preload=preload,
                env={"KOALA_SPAWN_TEST_EXTRA": "from env="})
    assert got == [{"KOALA_SPAWN_TEST_SET": "after", "KOALA_SPAWN_TEST_GONE": None,
                    "KOALA_SPAWN_TEST_EXTRA": "from env=", "RANK": str(rank), "OMP_NUM_THREADS": "1"}
                   for rank in range(2)]


SEEN_AT_IMPORT = """import os
SEEN = os.environ.get("KOALA_SPAWN_TEST_AT_IMPORT")


def worker(rank, world, spec):
    return SEEN
"""
LAUNCHER = """from koala_ds.runtime.spawn import spawn

if __name__ == "__main__":
    print(spawn("seen_at_import:worker", 1, timeout_s=120, init=None, preload=("seen_at_import",),
                env={"KOALA_SPAWN_TEST_AT_IMPORT": "from env="}))
"""


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(240)
def test_the_fork_server_imports_its_modules_with_the_launchs_env(tmp_path):
    """DeepSpeed picks its accelerator on import: a preloaded module must see DS_ACCELERATOR=cpu
    where the launch's `env` sets it (a fresh process, so that this launch starts the server)."""
    (tmp_path / "seen_at_import.py").write_text(SEEN_AT_IMPORT)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    env = environment(tmp_path, ROOT)
    env.pop("KOALA_SPAWN_TEST_AT_IMPORT", None)
    done = subprocess.run([sys.executable, str(tmp_path / "launcher.py")], capture_output=True, text=True,
                          env=env, timeout=200, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['from env=']\n"


HANGS_ON_IMPORT = """import time
time.sleep(600)
"""
WORKER = """def worker(rank, world, spec):
    return rank
"""
HUNG_LAUNCHER = """import time
from koala_ds.runtime.spawn import SpawnError, spawn

if __name__ == "__main__":
    start = time.monotonic()
    try:
        spawn("some_worker:worker", 2, timeout_s=5, init=None, preload=("hangs_on_import",))
    except SpawnError as exc:
        print(f"refused after {time.monotonic() - start:.0f} s:", str(exc).splitlines()[1])
    print(spawn("some_worker:worker", 2, timeout_s=120, init=None, preload=("some_worker",)))
"""


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(240)
def test_a_fork_server_that_hangs_importing_is_killed_at_the_deadline(tmp_path):
    """A forked rank's start waits for the fork server to fork it, after its preload imports: a
    hanging import used to hang the launch past its deadline. Now the server is killed at the
    deadline, the launch fails naming why, and the next launch starts a new server."""
    for name, text in (("hangs_on_import", HANGS_ON_IMPORT), ("some_worker", WORKER), ("launcher", HUNG_LAUNCHER)):
        (tmp_path / f"{name}.py").write_text(text)
    done = subprocess.run([sys.executable, str(tmp_path / "launcher.py")], capture_output=True, text=True,
                          env=environment(tmp_path, ROOT), timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    refused, second = done.stdout.splitlines()
    assert refused.startswith(("refused after 5 s:", "refused after 6 s:")), refused
    assert "rank 0: NotStarted: not started: the fork server had not forked the ranks by the deadline" in refused
    assert second == "[0, 1]"


def test_a_result_file_cut_short_reads_as_a_killed_rank(tmp_path):
    """A rank killed while writing its result (at the deadline) leaves a partial pickle: the
    launch reports that rank as killed instead of failing with the unpickler's EOFError."""
    from koala_ds.runtime.spawn import _result

    (tmp_path / "rank0.pkl").write_bytes(pickle.dumps({"ok": True, "value": list(range(100))})[:20])
    got = _result(str(tmp_path), 0, timed_out=True, not_started=None)
    assert got["ok"] is False and got["type"] == "Killed" and "rank0.pkl" in got["message"], got


def test_torchs_no_cuda_runtime_notice_is_left_out_and_other_warnings_stay(caplog):
    """torch's CUDA wheels on a CPU machine log 'No CUDA runtime is found' when megatron-core
    imports torch.utils.cpp_extension: koala profile megatron-gpt printed it before its one
    error line (torch 2.15+cu132). Other loggers and warnings are untouched."""
    import logging
    import warnings

    from koala_ds.runtime.spawn import CPP_EXTENSION_LOGGER, quiet_megatron_imports

    logger = logging.getLogger(CPP_EXTENSION_LOGGER)
    level = logger.level
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_megatron_imports()
            with caplog.at_level(logging.WARNING):
                logger.warning("No CUDA runtime is found, using CUDA_HOME='/x'")
                logging.getLogger("torch.other").warning("kept")
            warnings.warn("Apex is not installed. Falling back to Torch Norm")
            warnings.warn("another warning")
        assert [r.getMessage() for r in caplog.records] == ["kept"]
        assert [str(w.message) for w in seen] == ["another warning"]
    finally:
        logger.setLevel(level)
