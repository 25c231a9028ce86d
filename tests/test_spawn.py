"""koala_ds.spawn: ranks forked from a fork server (`preload`) see what spawned ranks see."""
from __future__ import annotations

import os

import pytest

from koala_ds.spawn import spawn
from rank_processes import PRELOAD

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
    spawn("test_spawn:environment_worker", 1, timeout_s=180, preload=preload)  # starts the server
    monkeypatch.delenv("KOALA_SPAWN_TEST_GONE")
    monkeypatch.setenv("KOALA_SPAWN_TEST_SET", "after")
    got = spawn("test_spawn:environment_worker", 2, timeout_s=180, preload=preload,
                env={"KOALA_SPAWN_TEST_EXTRA": "from env="})
    assert got == [{"KOALA_SPAWN_TEST_SET": "after", "KOALA_SPAWN_TEST_GONE": None,
                    "KOALA_SPAWN_TEST_EXTRA": "from env=", "RANK": str(rank), "OMP_NUM_THREADS": "1"}
                   for rank in range(2)]
