"""A per-token loss under a V-shape schedule: megatron-core's finalize_model_grads divides the
gradients by the step's token count, which it broadcasts from the last pipeline rank. The
V-shape computes the loss on rank 0, so the last rank handed it 0 tokens and the gradients went
undivided (64 times too large in a reported run); the runtime now hands the count to the last
rank with the losses."""
from __future__ import annotations

import pytest

from koala_ds.runtime.spawn import spawn

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_the_last_rank_hands_finalize_the_steps_token_count(schedule):
    from megatron_worker import M, MBS, SEQ

    results = spawn("megatron_tokens_worker:tokens_worker", 2, {"schedule": schedule}, timeout_s=240)
    assert [r["seen"] for r in results] == [[M * MBS * SEQ]] * 2, results
    assert [r["losses"] for r in results] == [0, M]  # the losses, too, on the last pipeline rank
