"""koala_ds.runtime.bounded_collectives in one process (a gloo group of one rank) and the Megatron
runtime's collective waiter; the multi-process behaviour is in test_megatron_stopped_peer.py."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from koala_ds.runtime.bounded_collectives import bounded_collectives  # noqa: E402


@pytest.fixture
def group_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Recorder:
    def __init__(self):
        self.waited = []

    def __call__(self, work, group, describe):
        work.wait()
        self.waited.append(describe())


def test_blocking_collectives_are_waited_by_the_caller_and_restored_on_exit(group_of_one):
    original = dist.all_reduce
    wait = _Recorder()
    t = torch.ones(3)
    with bounded_collectives(wait):
        assert dist.all_reduce(t) is None
        gathered = [None]
        dist.all_gather_object(gathered, {"x": 1})  # calls all_gather inside torch
        dist.barrier()
    assert torch.equal(t, torch.ones(3))
    assert gathered == [{"x": 1}]
    assert wait.waited[0] == "all_reduce over ranks [0]"
    # torch 2.13 gathers objects with all_gather, 2.15 with all_gather_single: waited either way
    assert any(w.startswith(("all_gather over", "all_gather_single over")) for w in wait.waited)
    assert wait.waited[-1] == "barrier over ranks [0]"
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original


def test_a_collective_that_asks_for_async_op_is_left_to_its_caller(group_of_one):
    wait = _Recorder()
    with bounded_collectives(wait):
        work = dist.all_reduce(torch.ones(2), async_op=True)
        inner = bounded_collectives(_Recorder())
        with inner:  # nested: the outer wait stays
            dist.broadcast(torch.ones(2), src=0)
    work.wait()
    assert wait.waited == ["broadcast over ranks [0]"]


class _TimedOutWork:
    def wait(self, timeout=None):
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Timed out waiting 200ms for recv operation to complete")


def test_the_megatron_waiter_names_rank_collective_phase_and_setting():
    from koala_ds.megatron.p2p import CollectiveWaiter, P2PTimeoutError

    waiter = CollectiveWaiter("koala runtime: rank 3 (pipeline rank 1)", 0.2, "KOALA_TIMEOUT_S")
    waiter.phase = "finalize_model_grads_func"
    with pytest.raises(P2PTimeoutError) as info:
        waiter.wait(_TimedOutWork(), True, lambda: "all_reduce over ranks [1, 3]")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("koala runtime: rank 3 (pipeline rank 1) failed to finish all_reduce over ranks [1, 3] "
                              "(in finalize_model_grads_func) within 0.2 s (timeout from KOALA_TIMEOUT_S"), message


def test_entering_the_context_again_inspects_no_signature(monkeypatch):
    """The context is entered once per pipeline step: the signatures of the 16 wrapped functions
    (about 4 ms of CPU) are computed once per process, not per step."""
    import inspect

    with bounded_collectives(_Recorder()):
        pass
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))
    with bounded_collectives(_Recorder()):
        pass
    assert calls == []
