"""A setup the runtime refuses on some pipeline ranks is refused on every rank, at once.

Three gloo ranks call koala's forward_backward_func with zb-v on chunks built as megatron-core's
model builder builds them (chunk c of rank r = stage c x p + r; tests/megatron_roles_worker.py).
Ranks 0 and 2 see that their chunks' pre_process / post_process do not match the V-shape's
stages; rank 1's chunks hold neither the embedding nor the loss, so on its own it would start
the step and wait for rank 0's activation until the p2p timeout (30 s here), while rank 0, which
refused, is still alive."""
from __future__ import annotations

import pytest

from koala_ds.runtime.spawn import launch
from rank_processes import PRELOAD

TIMEOUT_S = 30


@pytest.fixture(autouse=True, scope="module")
def _megatron_core():
    """Imported when a test here runs, not at collection."""
    pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_chunk_refused_on_one_rank_is_refused_on_every_rank_before_the_step():
    results = launch("megatron_roles_worker:roles_worker", 3, {"timeout_s": TIMEOUT_S}, timeout_s=150,
                     pg_timeout_s=120, preload=PRELOAD)
    outs = [r["value"] for r in results]
    assert all(o["error"] == "ScheduleFitError" for o in outs), outs  # MegatronScheduleError is its alias
    first = outs[0]["message"]
    assert "chunk 1 of pipeline rank 0" in first and "post_process=False" in first, first
    assert all(o["message"] == first for o in outs), "every rank raises the first refusing rank's message"
    assert all(o["elapsed"] < TIMEOUT_S / 2 for o in outs), [o["elapsed"] for o in outs]
