"""A stopped peer (SIGSTOP) ends the other rank of a Megatron step within the pipeline timeout.

Two gloo processes run the tiny megatron-core GPT with koala's forward_backward_func and
KOALA_TIMEOUT_S=3; rank 1 stops itself before finalize_model_grads_func's all-reduce (PP=2, or
PP=1 x DP=2 with koala's data-parallel finalize) or in the middle of the pipeline p2p. Rank 0
must raise P2PTimeoutError within timeout + 10 s and end; the launcher SIGKILLs the stopped
rank. Before the collectives of the call were bounded, the finalize cases waited for the
process group's timeout (100 s here) and hit the launch deadline.
"""
from __future__ import annotations

import time

import pytest

from koala_ds.runtime.spawn import launch
from rank_processes import PRELOAD

TIMEOUT_S = 3


@pytest.fixture(autouse=True, scope="module")
def _megatron_core():
    """Imported when a test here runs, not at collection, which every xdist worker pays (~3 s)."""
    pytest.importorskip("megatron.core")


def run_stopped(stop: str) -> tuple[dict, float]:
    """Rank 0's result and when the launch returned (time.time())."""
    spec = {"stop": stop, "stopped_rank": 1}
    results = launch("megatron_stop_worker:stop_worker", 2, spec, timeout_s=45, pg_timeout_s=100,
                     env={"KOALA_TIMEOUT_S": str(TIMEOUT_S)}, allow_failures=True, wait_ranks=[0], preload=PRELOAD)
    return results[0], time.time()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["finalize", "dp-finalize", "p2p"])
def test_a_stopped_peer_ends_the_other_megatron_rank_within_the_timeout(stop):
    rank0, ended = run_stopped(stop)
    assert rank0["ok"], rank0
    value = rank0["value"]
    assert value["error"] == "P2PTimeoutError", value
    message = value["message"]
    assert "rank 0" in message and f"within {TIMEOUT_S} s" in message and "KOALA_TIMEOUT_S" in message, message
    if stop == "p2p":
        assert "from pipeline rank 1" in message, message
    else:
        assert "all_reduce over ranks [0, 1]" in message and "finalize_model_grads_func" in message, message
    assert value["elapsed"] < TIMEOUT_S + 10, value
    assert ended - value["raised_at"] < 10, "rank 0 raised in time but took too long to end"
